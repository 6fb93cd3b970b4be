"""A Llama-family checkpoint loaded for the CPU rollout engine without transformers' modeling code.

Importing transformers' model classes costs a rollout process ~2 CPU-seconds (its kernel, fp8 and
tensor-parallel integrations pull in torch._dynamo, triton and sympy), about half of what a fresh
worker spends before its first token, and every replacement of a preempted or killed worker pays it
again. On a CPU the engine never runs those classes: `LeanForward` does the arithmetic straight on the
parameters. This module builds the same parameter tree (HF names, so `state_dict` and
`load_state_dict` of the learner's weights work unchanged) from `config.json` and the safetensors
files, for exactly the configurations `LeanForward` covers; anything else returns None and the caller
loads the HF class. The rotary `inv_freq` is computed as transformers' default rope computes it.
`load_lite_tokenizer` does the same for a tokenizer saved as a plain `tokenizers` backend (what
`postrain sft` writes): the `tokenizers` library alone, for the `encode` / `decode` the rollout path
calls, so a worker process never imports transformers.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from rollout.lean_forward import LeanForward

_DEFAULTS = {  # what the HF configs of these model types assume when config.json leaves a field out
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "rope_scaling": None,
    "use_sliding_window": False, "sliding_window": None, "mlp_bias": False, "partial_rotary_factor": 1.0,
    "eos_token_id": None, "pad_token_id": None, "bos_token_id": None, "head_dim": None, "num_key_value_heads": None,
}
_BIAS_DEFAULT = {"qwen2": True, "llama": False, "mistral": False}  # q/k/v biases


class LiteConfig:
    """The fields of config.json as attributes (HF defaults for the ones it omits)."""

    def __init__(self, raw: dict):
        for k, v in {**_DEFAULTS, **raw}.items():
            setattr(self, k, v)
        rope = raw.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        if self.rope_scaling is None and rope.get("rope_type", "default") != "default":
            self.rope_scaling = rope
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.attention_bias = raw.get("attention_bias", _BIAS_DEFAULT.get(raw.get("model_type"), False))


class _Linear(nn.Module):
    def __init__(self, n_out: int, n_in: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out), requires_grad=False) if bias else None


class _Norm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n), requires_grad=False)


class _Layer(nn.Module):
    def __init__(self, c: LiteConfig, head_dim: int):
        super().__init__()
        q, kv, h = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim, c.hidden_size
        self.self_attn = nn.Module()
        for name, n_out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            setattr(self.self_attn, name, _Linear(n_out, h, c.attention_bias))
        self.self_attn.o_proj = _Linear(h, q, c.attention_bias and c.model_type != "qwen2")  # Llama: o_proj too
        self.mlp = nn.Module()
        self.mlp.gate_proj = _Linear(c.intermediate_size, h, False)
        self.mlp.up_proj = _Linear(c.intermediate_size, h, False)
        self.mlp.down_proj = _Linear(h, c.intermediate_size, False)
        self.input_layernorm = _Norm(h)
        self.post_attention_layernorm = _Norm(h)


class _Rotary(nn.Module):
    def __init__(self, c: LiteConfig, head_dim: int):
        super().__init__()
        dim = int(head_dim * c.partial_rotary_factor)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0


class LiteCausalLM(nn.Module):
    """Parameters of a Qwen2 / Llama / Mistral causal LM under their HF names; no forward of its own
    (the engine runs `LeanForward` over it)."""

    lean_only = True

    def __init__(self, c: LiteConfig):
        super().__init__()
        self.config = c
        head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
        self.model = nn.Module()
        self.model.embed_tokens = _Linear(c.vocab_size, c.hidden_size, False)  # a weight, never initialised
        self.model.layers = nn.ModuleList(_Layer(c, head_dim) for _ in range(c.num_hidden_layers))
        self.model.norm = _Norm(c.hidden_size)
        self.model.rotary_emb = _Rotary(c, head_dim)
        self.lm_head = _Linear(c.vocab_size, c.hidden_size, False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, *args, **kwargs):
        raise NotImplementedError("LiteCausalLM holds parameters only: the rollout engine runs LeanForward over it")


def load_lite(path: str | Path, dtype: torch.dtype = torch.float32) -> LiteCausalLM | None:
    """The checkpoint at `path` as a LiteCausalLM, or None when LeanForward does not cover it."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        return None
    raw = json.loads(cfg_path.read_text())
    archs = raw.get("architectures") or []
    if raw.get("model_type") not in _BIAS_DEFAULT or any(not a.endswith("ForCausalLM") for a in archs):
        return None
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    if not all((path / f).is_file() for f in files):
        return None
    from safetensors import SafetensorError

    state = {}
    for f in files:
        try:
            state.update(load_file(str(path / f)))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"checkpoint {path}: {f} does not load ({exc})") from None
    held = sum(t.numel() for t in state.values())
    try:  # the embedding and the MLPs alone, a floor under what config.json asks for, before allocating it
        floor = int(raw["vocab_size"]) * int(raw["hidden_size"]) + int(raw["num_hidden_layers"]) * 3 * int(
            raw["hidden_size"]) * int(raw["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint {path}: config.json lacks a size ({type(exc).__name__}: {exc})") from None
    if floor > held:
        raise ValueError(f"checkpoint {path}: config.json asks for at least {floor:,} parameters, its files hold "
                         f"{held:,}")
    try:
        model = LiteCausalLM(LiteConfig(raw))  # torch.empty parameters: allocated, never touched (replaced below)
    except (ValueError, TypeError, KeyError, ZeroDivisionError, RuntimeError) as exc:
        raise ValueError(f"checkpoint {path}: config.json does not describe a model ({type(exc).__name__}: {exc})") from None
    if LeanForward.supports(model) is not None:
        return None
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    state = {k: v.to(dtype) for k, v in state.items()}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # shapes that do not fit the config
        raise ValueError(f"checkpoint {path}: {exc}") from None
    if unexpected or missing:
        raise ValueError(f"checkpoint {path}: tensors {sorted(unexpected)[:4]} unexpected, {sorted(missing)[:4]} missing "
                         "for its config")
    if model.config.tie_word_embeddings:  # assign=True replaced the embedding: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


_PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
_CHANGES_ENCODING = ("add_bos_token", "add_eos_token", "add_prefix_space", "clean_up_tokenization_spaces")


class LiteTokenizer:
    """`encode(text) -> ids` and `decode(ids, skip_special_tokens=False) -> text` of a `tokenizers`
    Tokenizer, as transformers' fast tokenizer computes them for a plain backend (its post-processor
    adds what the saved template says; no clean-up of spaces)."""

    def __init__(self, tokenizer, config: dict):
        self._tk = tokenizer
        self.eos_token_id = self._id(config.get("eos_token"))
        self.pad_token_id = self._id(config.get("pad_token"))

    def _id(self, token) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self._tk.token_to_id(token) if token else None

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)


def load_lite_tokenizer(path: str | Path) -> LiteTokenizer | None:
    """The tokenizer at `path` through `tokenizers` alone, or None where transformers would change what
    it encodes or decodes (a model-specific class, BOS/EOS insertion, space clean-up)."""
    path = Path(path)
    cfg_path, tk_path = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (cfg_path.is_file() and tk_path.is_file()):
        return None
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("tokenizer_class") not in _PLAIN_TOKENIZERS or any(cfg.get(k) for k in _CHANGES_ENCODING):
        return None
    from tokenizers import Tokenizer

    return LiteTokenizer(Tokenizer.from_file(str(tk_path)), cfg)
