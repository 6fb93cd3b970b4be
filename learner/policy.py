"""Policy construction: a tiny HF causal LM from config (loading any HF checkpoint is `core.hf`)."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from core.errors import UserError
from learner.config import PolicyConfig
from learner.tokenizer import char_tokenizer

def build_policy(cfg: PolicyConfig) -> tuple[PreTrainedModel, object]:
    """A freshly initialised model of `cfg` and the char tokenizer."""
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise UserError(f"policy: hidden_size {cfg.hidden_size} must divide by num_heads {cfg.num_heads}, "
                        f"and num_heads by num_kv_heads {cfg.num_kv_heads}")
    tok = char_tokenizer()
    common = dict(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_positions,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        tie_word_embeddings=True, rope_theta=10000.0,
    )
    hf_cfg = Qwen2Config(**common) if cfg.arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    return model, tok
