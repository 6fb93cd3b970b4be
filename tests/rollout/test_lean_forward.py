"""The engine's lean CPU forward equals the HF forward it replaces, and refuses what it does not cover."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rollout.engine import Engine
from rollout.lean_forward import LeanForward
from rollout.sampling import SamplingParams


def _model(kind: str, **kw):
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=96, pad_token_id=96)
    cfg = (Qwen2Config if kind == "qwen2" else LlamaConfig)(**{**common, **kw})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # non-zero biases so a dropped bias shows
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("kind,kw", [("qwen2", {}), ("llama", {"attention_bias": True}), ("llama", {"num_key_value_heads": 4})])
def test_lean_decode_equals_hf(kind, kw):
    torch.set_num_threads(1)
    model = _model(kind, **kw)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9, 9, 3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    outs = []
    for lean in (True, False):
        eng = Engine(model, None, seed=3, max_batch=4, max_len=64)
        assert (eng._lean is not None) is True
        if not lean:
            eng._lean = None
        logits = []
        run = eng._run
        eng._run = lambda *a, run=run: logits.append(run(*a)) or logits[-1]
        seqs = eng.generate(prompts, params)
        outs.append(([s.tokens for s in seqs], logits))
    (tok_lean, lg_lean), (tok_hf, lg_hf) = outs
    assert tok_lean == tok_hf
    assert len(lg_lean) == len(lg_hf) > 10
    for a, b in zip(lg_lean, lg_hf):
        torch.testing.assert_close(a[:, -1], b[:, -1], rtol=1e-5, atol=1e-5)


def test_lean_block_feed_equals_hf():
    """A resumed trajectory's block feed (past K/V present, T > 1) through both forwards."""
    model = _model("qwen2")
    toks = list(range(10, 40))
    res = []
    for lean in (True, False):
        eng = Engine(model, None, seed=0, max_batch=2, max_len=64)
        if not lean:
            eng._lean = None
        sampled = [False] * 8 + [True] * 22
        eng.add("r", toks, sampled, SamplingParams(max_new_tokens=40, ignore_eos=True))
        res.append(eng.step()[0])
    assert res[0].token == res[1].token and abs(res[0].logprob - res[1].logprob) < 1e-5


def test_lean_refuses_what_it_does_not_cover():
    assert LeanForward.supports(_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})) is not None
    assert LeanForward.supports(_model("llama", hidden_act="gelu")) is not None
    with pytest.raises(ValueError, match="does not cover"):
        LeanForward(_model("llama", mlp_bias=True))
    assert LeanForward.supports(_model("qwen2")) is None


def test_new_weights_reach_the_lean_forward():
    """The fused q/k/v and gate/up weights are copies: load_weights must rebuild them."""
    model, other = _model("qwen2"), _model("qwen2")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    eng = Engine(model, None, seed=3, max_batch=2, max_len=32)
    eng.load_weights(other.state_dict(), version=1)
    ref = Engine(other, None, seed=3, max_batch=2, max_len=32)
    ref._lean = None
    draws = []
    for e in (eng, ref):
        for i, p in enumerate(prompts):
            e.add(f"r{i}", p, [False] * len(p), params)
        steps = []
        for _ in range(6):
            d = e.step()
            e.accept(d)
            steps += [(x.token, x.logprob) for x in d]
        draws.append(steps)
    assert [t for t, _ in draws[0]] == [t for t, _ in draws[1]]
    assert max(abs(a[1] - b[1]) for a, b in zip(*draws)) < 1e-5
