"""Models whose logits are not hidden @ W.T are refused, by name of the setting, before any training.

The learner's fused LM head and the OPD losses rebuild logits from the last hidden states as
hidden @ W.T; a logit scale (Cohere), a logits divisor (Granite), a final softcap (Gemma 2 and 3) or a bias
in the output head (Phi) would give wrong log-probs silently. A plain model still loads, and its fused
log-probs equal its own logits' (the control)."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig, Gemma3TextConfig, GraniteConfig, PhiConfig

from core.errors import UserError
from core.hf import load_policy, save_policy
from distill.teachers import describe
from learner.config import PolicyConfig
from learner.policy import build_policy
from learner.train_step import LogprobModel

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64)
CASES = {
    "logit_scale": lambda: CohereConfig(**COMMON, num_key_value_heads=1),
    "logits_scaling": lambda: GraniteConfig(**COMMON, num_key_value_heads=1, logits_scaling=8.0),
    "final_logit_softcapping": lambda: Gemma3TextConfig(**COMMON, num_key_value_heads=1, head_dim=16,
                                                        final_logit_softcapping=30.0),
    "bias in its output head": lambda: PhiConfig(**COMMON),
}


def _saved(path, cfg):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    _, tok = build_policy(PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64))
    save_policy(model, tok, path)
    return model


@pytest.mark.parametrize("setting", list(CASES))
def test_a_model_with_a_logit_transform_is_refused_at_load(tmp_path, setting):
    model = _saved(tmp_path, CASES[setting]())
    with pytest.raises(UserError, match=setting):
        load_policy(tmp_path)
    with pytest.raises(UserError, match=setting):
        LogprobModel(model)
    with pytest.raises(UserError, match=f"teacher arith:0.*{setting}"):
        describe("arith", 0, str(tmp_path), 1.0)


def test_a_plain_model_loads_and_its_fused_logprobs_are_its_own(tmp_path):
    model, tok = build_policy(PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                           intermediate_size=64))
    save_policy(model, tok, tmp_path)
    model = load_policy(tmp_path)[0].double().eval()
    describe("arith", 0, str(tmp_path), 1.0)
    ids = torch.randint(3, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1).gather(1, ids[1:, None])[:, 0]
        got, _ = LogprobModel(model, chunk_rows=4)(ids, torch.arange(12), 1.0, False, False)
    torch.testing.assert_close(got[1:], want, rtol=1e-9, atol=1e-9)
