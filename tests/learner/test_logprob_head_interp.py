"""The kept-gradient LM head (`learner.logprob_head`) on CPU under TRITON_INTERPRET=1, small shapes,
against float64: log-probs, entropy, U written in place, and both gradients."""
from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import INTERPRETED, interp, run_child


@pytest.mark.skipif(INTERPRETED, reason="launcher only")
def test_head_kernels_under_interpreter():
    run_child(__file__)


def _inputs(seed: int, n: int, hid: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hid, generator=g)
    w = torch.randn(vocab, hid, generator=g) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    return h, w, labels, torch.randn(n, generator=g)


def _reference(h, w, labels, g_N):
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    logp_NV = torch.log_softmax(hd @ wd.t(), -1)
    logp = logp_NV.gather(1, labels[:, None]).squeeze(1)
    (logp * g_N.double()).sum().backward()
    return logp.detach(), -(logp_NV.exp() * logp_NV).sum(-1).detach(), hd.grad, wd.grad


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@interp
@pytest.mark.parametrize("vocab", [1, 97, 1000])
def test_softmax_grad_rows_in_place(vocab):
    from learner.logprob_head import softmax_grad_rows_

    h, w, labels, _ = _inputs(vocab, 23, 8, vocab)
    logits = h @ w.t()
    x = logits.clone()
    lse, logp, ent = softmax_grad_rows_(x, labels, with_entropy=True)
    ref = torch.log_softmax(logits.double(), -1)
    onehot = torch.nn.functional.one_hot(labels, vocab).double()
    torch.testing.assert_close(x.double(), onehot - ref.exp(), atol=1e-6, rtol=1e-5)  # U over the logits
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.double(), -1), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(logp.double(), ref.gather(1, labels[:, None]).squeeze(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=1e-5)


@interp
@pytest.mark.parametrize("compute_dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kept_head_values_and_gradients(compute_dtype, tol):
    from learner.logprob_head import logprobs_kept_grad

    h, w, labels, g_N = _inputs(1, 37, 16, 1000)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = logprobs_kept_grad(hh, ww, labels, compute_dtype, with_entropy=True)
    assert not ent.requires_grad  # the entropy carries no gradient on this path
    (logp * g_N).sum().backward()
    logp_ref, ent_ref, gh_ref, gw_ref = _reference(h, w, labels, g_N)
    assert logp.dtype == torch.float32 and hh.grad.dtype == h.dtype and ww.grad.dtype == w.dtype
    assert _rel(logp, logp_ref) < tol and _rel(ent, ent_ref) < tol
    assert _rel(hh.grad, gh_ref) < tol and _rel(ww.grad, gw_ref) < tol


@interp
def test_kept_head_without_entropy_and_weight_frozen():
    from learner.logprob_head import logprobs_kept_grad

    h, w, labels, g_N = _inputs(2, 11, 8, 300)
    hh = h.clone().requires_grad_()
    logp, ent = logprobs_kept_grad(hh, w, labels, torch.float32)
    assert ent is None
    (logp * g_N).sum().backward()
    logp_ref, _, gh_ref, _ = _reference(h, w, labels, g_N)
    assert _rel(logp, logp_ref) < 1e-5 and _rel(hh.grad, gh_ref) < 1e-5
