"""The learner's GPU path (varlen flash attention, compiled layers, fused LM-head kernels, merged
micro-batches) against the plain step on the same GPU: same log-probs, loss and gradients up to bf16."""
from __future__ import annotations

import copy

import pytest
import torch

import learner.grpo_loss as gl
import learner.train_step as train_step
from learner.config import PolicyConfig
from learner.grpo_loss import logprobs_from_hidden
from learner.logprob_head import logprobs_kept_grad
from learner.packed_attention import packed_attention_forward
from learner.policy import build_policy
from learner.train_step import Learner, synthetic_packed_batch
from tests.learner.test_group_step import config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = PolicyConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, seed=1)


def test_varlen_attention_equals_per_sequence_sdpa():
    g = torch.Generator(device="cuda").manual_seed(0)
    n, cu = 300, torch.tensor([0, 37, 180, 181, 300], device="cuda")
    q = torch.randn(1, 4, n, 32, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, n, 32, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    kw = dict(cu_seq_lens_q=cu.int(), max_length_q=143, postrain_bounds=bounds)
    got, _ = packed_attention_forward(None, q, k, v, None, 32 ** -0.5, postrain_backend="varlen", **kw)
    want, _ = packed_attention_forward(None, q, k, v, None, 32 ** -0.5, postrain_backend="sdpa_docs", **kw)
    assert got.shape == (1, n, 4, 32)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("entropy_coef", [0.01, 0.0])  # entropy with a gradient: the recompute head; without: kept
def test_fast_step_matches_plain_step(monkeypatch, entropy_coef):
    base, tok = build_policy(SMALL)
    vocab = len(tok)
    packs = [synthetic_packed_batch(vocab, lengths, seed=i) for i, lengths in enumerate(([60, 90, 31], [100, 77]))]
    cfg = config(loss={"aggregation": "seq-mean-token-mean", "entropy_coef": entropy_coef},
                 learner={"device": "cuda", "bf16": True, "logprob_chunk_rows": 64, "micro_batch_tokens": 512})
    kept_calls = []
    real_kept = train_step.logprobs_kept_grad
    monkeypatch.setattr(train_step, "logprobs_kept_grad", lambda *a, **k: kept_calls.append(1) or real_kept(*a, **k))
    out = []
    for fast in (False, True):
        monkeypatch.setitem(gl._FUSED_ENABLED, "cuda", fast)
        model = copy.deepcopy(base)
        learner = Learner(model, cfg, attention="auto" if fast else "hf", compile=fast, merge_micro_batches=fast,
                          kept_head_grad=fast)
        if fast:
            assert learner.attention in ("varlen", "sdpa_docs")
        m = learner.accumulate_gradients(packs)
        assert len(kept_calls) == (1 if fast and entropy_coef == 0 else 0)
        grad = torch.cat([p.grad.flatten().float() for p in model.parameters()])
        out.append((m, grad))
    (m0, g0), (m1, g1) = out
    assert (m0["micro_batches"], m1["micro_batches"]) == (2, 1)
    for key in ("loss", "entropy", "approx_kl"):
        assert m1[key] == pytest.approx(m0[key], rel=2e-2, abs=1e-3), key
    cos = torch.nn.functional.cosine_similarity(g0, g1, dim=0)
    assert cos > 0.999 and (g1.norm() / g0.norm() - 1).abs() < 2e-2


def test_fp32_learner_on_cuda_takes_a_kernel_that_runs_fp32():
    """learner.bf16 = false with an fp32 model: attention runs in fp32, which the varlen kernel refuses;
    the step must still run (per-sequence SDPA) and match the model's own attention."""
    base, tok = build_policy(SMALL)
    packs = [synthetic_packed_batch(len(tok), [60, 90, 31], seed=0), synthetic_packed_batch(len(tok), [100, 77], seed=1)]
    cfg = config(learner={"device": "cuda", "bf16": False, "logprob_chunk_rows": 64, "micro_batch_tokens": 512})
    out = []
    for attention in ("hf", "auto"):
        model = copy.deepcopy(base)
        learner = Learner(model, cfg, attention=attention, compile=False, merge_micro_batches=True)
        if attention == "auto":
            assert learner.attention == "sdpa_docs"
        m = learner.accumulate_gradients(packs)
        out.append((m["loss"], torch.cat([p.grad.flatten() for p in model.parameters()])))
    (l0, g0), (l1, g1) = out
    assert l1 == pytest.approx(l0, rel=1e-4, abs=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-3, atol=1e-5)


def test_varlen_call_on_fp32_tensors_falls_back_to_per_sequence_sdpa():
    g = torch.Generator(device="cuda").manual_seed(0)
    n, cu = 200, torch.tensor([0, 37, 150, 200], device="cuda")
    q = torch.randn(1, 4, n, 32, device="cuda", generator=g)
    k, v = (torch.randn(1, 2, n, 32, device="cuda", generator=g) for _ in range(2))
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    kw = dict(cu_seq_lens_q=cu.int(), max_length_q=113)
    got, _ = packed_attention_forward(None, q, k, v, None, 32 ** -0.5, postrain_backend="varlen", **kw)
    want, _ = packed_attention_forward(None, q, k, v, None, 32 ** -0.5, postrain_backend="sdpa_docs",
                                       postrain_bounds=bounds, **kw)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_kept_head_matches_fp64_and_the_recompute_head(with_entropy):
    """log-probs, entropy and both gradients of the kept-gradient head against float64 (bf16 tolerances)
    and against the recompute head on the same inputs; every output row written."""
    g = torch.Generator(device="cuda").manual_seed(3)
    n, hid, vocab = 1500, 64, 9001  # the vocabulary spans several blocks with a ragged tail
    h = torch.randn(n, hid, device="cuda", generator=g)
    w = torch.randn(vocab, hid, device="cuda", generator=g) * 0.3
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    g_N = torch.randn(n, device="cuda", generator=g)
    results = []
    for fn in (lambda hh, ww: logprobs_kept_grad(hh, ww, labels, torch.bfloat16, with_entropy),
               lambda hh, ww: logprobs_from_hidden(hh, ww, labels, 512, with_entropy)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logp, ent = fn(hh, ww)
        (logp * g_N).sum().backward()
        assert torch.isfinite(logp).all() and (ent is None or torch.isfinite(ent).all())
        results.append((logp, ent, hh.grad, ww.grad))
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    logp_ref_NV = torch.log_softmax(hd.to(torch.bfloat16).double() @ wd.to(torch.bfloat16).double().t(), -1)
    logp_ref = logp_ref_NV.gather(1, labels[:, None]).squeeze(1)
    (logp_ref * g_N.double()).sum().backward()
    ent_ref = -(logp_ref_NV.exp() * logp_ref_NV).sum(-1)

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    kept, recompute = results
    assert rel(kept[0], logp_ref.detach()) < 2e-3
    assert rel(kept[2], hd.grad) < 2e-2 and rel(kept[3], wd.grad) < 2e-2
    if with_entropy:
        assert rel(kept[1], ent_ref.detach()) < 2e-3
        assert rel(kept[1], recompute[1]) < 2e-3
    for a, b in zip(kept[::2] + kept[3:], recompute[::2] + recompute[3:]):
        assert rel(a, b.double()) < 2e-2
