"""Chunked torch reverse KL (the CPU path of `distill.reverse_kl`) against the fp64 reference."""
from __future__ import annotations

import math

import pytest
import torch

import distill
from distill import kl_chunked
from distill.kl_reference import reverse_kl_reference
from tests.distill.kl_cases import TOL, make_inputs, mask_and_weights, rel_err


def _ours(h_s, W_s, h_t, W_t, **kw):
    h_s = h_s.clone().requires_grad_(True)
    W_s = W_s.clone().requires_grad_(True)
    loss = distill.reverse_kl(h_s, W_s, h_t, W_t, **kw)
    loss.backward()
    return loss, h_s.grad, W_s.grad


def _check(h_s, W_s, h_t, W_t, dtype, **kw):
    loss, gh, gW = _ours(h_s, W_s, h_t, W_t, **kw)
    ref = reverse_kl_reference(h_s, W_s, h_t, W_t, **{k: v for k, v in kw.items() if k != "chunk_tokens"})
    assert loss.dtype == torch.float32 and gh.dtype == dtype and gW.dtype == dtype
    assert torch.isfinite(loss) and torch.isfinite(gh).all() and torch.isfinite(gW).all()
    tol = TOL[dtype]
    assert rel_err(loss, ref[0]) <= tol["loss"], (loss.item(), ref[0].item())
    # the gradient comes back in `dtype`: its own rounding (subnormals in fp16) is allowed on top
    assert rel_err(gh, ref[1]) <= tol["grad"] + rel_err(ref[1].to(dtype), ref[1])
    assert rel_err(gW, ref[2]) <= tol["grad"] + rel_err(ref[2].to(dtype), ref[2])


@pytest.mark.parametrize("N,V", [(1, 50257), (7, 129280), (1000, 50257)])
def test_odd_shapes_fp32_different_hidden_sizes(N, V):
    _check(*make_inputs(N, V, 8, 12, seed=N), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_with_mask_weights_and_temperature(dtype):
    h_s, W_s, h_t, W_t = make_inputs(7, 50257, 16, 24, dtype=dtype, seed=3)
    mask, weights = mask_and_weights(7)
    _check(h_s, W_s, h_t, W_t, dtype, mask=mask, weights=weights, temperature=0.7)
    _check(h_s, W_s, h_t, W_t, dtype, mask=mask, temperature=2.5, chunk_tokens=3)


def test_mean_over_unmasked_and_weighted_sum_semantics():
    h_s, W_s, h_t, W_t = make_inputs(9, 1031, 8, 8, seed=4)
    kl_N = torch.stack([distill.reverse_kl(h_s[i:i + 1], W_s, h_t[i:i + 1], W_t) for i in range(9)])
    mask, weights = mask_and_weights(9)
    got_mean = distill.reverse_kl(h_s, W_s, h_t, W_t, mask=mask)
    got_sum = distill.reverse_kl(h_s, W_s, h_t, W_t, mask=mask, weights=weights)
    assert torch.allclose(got_mean, kl_N[mask].mean(), rtol=1e-5)
    assert torch.allclose(got_sum, (kl_N * weights * mask).sum(), rtol=1e-5)
    assert torch.allclose(distill.reverse_kl(h_s, W_s, h_t, W_t), kl_N.mean(), rtol=1e-5)


def test_all_masked_gives_zero_loss_and_zero_gradients():
    h_s, W_s, h_t, W_t = make_inputs(5, 1031, 8, 8, seed=5)
    loss, gh, gW = _ours(h_s, W_s, h_t, W_t, mask=torch.zeros(5, dtype=torch.bool))
    assert loss.item() == 0.0 and not gh.any() and not gW.any()


def test_no_tokens_gives_zero_loss_and_zero_gradients():
    h_s, W_s, h_t, W_t = make_inputs(0, 1031, 8, 8, seed=5)
    loss, gh, gW = _ours(h_s, W_s, h_t, W_t)
    assert loss.item() == 0.0 and gh.shape == (0, 8) and gW.shape == W_s.shape and not gW.any()


def test_upstream_gradient_scales_and_teacher_gets_none():
    h_s, W_s, h_t, W_t = make_inputs(6, 1031, 8, 8, seed=6)
    _, gh, gW = _ours(h_s, W_s, h_t, W_t)
    hs2, Ws2 = h_s.clone().requires_grad_(True), W_s.clone().requires_grad_(True)
    ht2, Wt2 = h_t.clone().requires_grad_(True), W_t.clone().requires_grad_(True)
    (3.0 * distill.reverse_kl(hs2, Ws2, ht2, Wt2)).backward()
    assert torch.allclose(hs2.grad, 3 * gh, rtol=1e-6) and torch.allclose(Ws2.grad, 3 * gW, rtol=1e-6)
    assert ht2.grad is None and Wt2.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identical_distributions_give_exact_zero(dtype):
    h_s, W_s, _, _ = make_inputs(7, 50257, 16, 16, dtype=dtype, seed=7)
    loss, gh, gW = _ours(h_s, W_s, h_s.clone(), W_s.clone(), temperature=0.5)
    assert loss.item() == 0.0
    assert not gh.any() and not gW.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_near_one_hot_is_finite_and_exact(dtype):
    # logits of size ~1e3: both distributions put all but ~1e-30 of their mass on one token, different
    # ones. The true gradient nearly vanishes (~1e-9); fp32 logits leave an absolute error far below
    # the O(1/N) gradient of an ordinary token, and nothing may overflow.
    h_s, W_s, h_t, W_t = make_inputs(7, 50257, 16, 16, dtype=dtype, seed=8, scale=300.0)
    loss, gh, gW = _ours(h_s, W_s, h_t, W_t)
    assert math.isfinite(loss.item()) and torch.isfinite(gh).all() and torch.isfinite(gW).all()
    ref_loss, ref_gh, ref_gW = reverse_kl_reference(h_s, W_s, h_t, W_t)
    assert ref_loss.item() > 100.0
    assert rel_err(loss, ref_loss) <= TOL[dtype]["loss"]
    assert (gh.double() - ref_gh).abs().max().item() <= 1e-3 * ref_gh.abs().max().item() + 1e-6
    assert (gW.double() - ref_gW).abs().max().item() <= 1e-3 * ref_gW.abs().max().item() + 1e-6


def test_peaked_distributions_are_exact():
    # p_max of 0.5 to 0.9: peaked but with a gradient of order one
    _check(*make_inputs(7, 50257, 16, 16, seed=11, scale=10.0), torch.float32)


def _rows(h_s, W_s, h_t, W_t, chunk_tokens=None):
    coef = torch.ones(h_s.shape[0], dtype=torch.float32)
    return kl_chunked.kl_and_grads(h_s, W_s, h_t, W_t, coef, 1.0, True, chunk_tokens=chunk_tokens)


def test_deterministic_bit_identical():
    x = make_inputs(300, 50257, 16, 12, dtype=torch.bfloat16, seed=9)
    first, second = _rows(*x), _rows(*x)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_batch_invariance_token_result_independent_of_batch():
    h_s, W_s, h_t, W_t = make_inputs(600, 50257, 8, 12, seed=10)  # 3 chunks of 256, the last padded
    kl_big, dh_big, _ = _rows(h_s, W_s, h_t, W_t)
    for lo, hi in [(0, 1), (250, 257), (593, 600)]:
        kl_small, dh_small, _ = _rows(h_s[lo:hi], W_s, h_t[lo:hi], W_t)
        assert torch.equal(kl_small, kl_big[lo:hi])
        assert torch.equal(dh_small, dh_big[lo:hi])


def test_memory_is_bounded_by_the_chunk():
    V = 129280
    C = kl_chunked.default_chunk_tokens(V)
    assert 3 * C * V * 4 <= kl_chunked.WORK_BYTES_DEFAULT and C >= 1


@pytest.mark.parametrize("bad,match", [
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(mask=torch.ones(4, dtype=torch.bool)), "mask"),
    (dict(mask=torch.ones(5, dtype=torch.float32)), "mask must be bool"),
    (dict(weights=torch.ones(3, dtype=torch.float32)), "weights"),
    (dict(backend="cuda-magic"), "unknown backend"),
    (dict(backend="triton"), "needs CUDA"),
])
def test_bad_arguments_raise_clear_errors(bad, match):
    h_s, W_s, h_t, W_t = make_inputs(5, 101, 8, 8)
    with pytest.raises(ValueError, match=match):
        distill.reverse_kl(h_s, W_s, h_t, W_t, **bad)


def test_mismatched_shapes_raise():
    h_s, W_s, h_t, W_t = make_inputs(5, 101, 8, 8)
    with pytest.raises(ValueError, match="vocab"):
        distill.reverse_kl(h_s, W_s, h_t, W_t[:100])
    with pytest.raises(ValueError, match="tokens"):
        distill.reverse_kl(h_s, W_s, h_t[:4], W_t)
    with pytest.raises(ValueError, match="hidden"):
        distill.reverse_kl(h_s, W_s[:, :7], h_t, W_t)


@pytest.mark.parametrize("exclude", ["mask", "weight"])
def test_a_row_outside_the_loss_with_non_finite_teacher_states_adds_nothing(exclude):
    # a masked (or zero-weight) row holding garbage, e.g. padding: loss and gradients are those of the rest
    h_s, W_s, h_t, W_t = make_inputs(4, 50, 8, 8, seed=7)
    keep = torch.tensor([True, True, True, False])
    kw = dict(mask=keep) if exclude == "mask" else dict(weights=keep.float() / 3)
    bad = h_t.clone()
    bad[3] = float("nan")
    loss, gh, gW = _ours(h_s, W_s, bad, W_t, **kw)
    ref = reverse_kl_reference(h_s[:3], W_s, h_t[:3], W_t)
    assert torch.isfinite(loss) and torch.isfinite(gh).all() and torch.isfinite(gW).all()
    assert rel_err(loss, ref[0]) <= TOL[torch.float32]["loss"]
    assert rel_err(gh[:3], ref[1]) <= TOL[torch.float32]["grad"] and not gh[3].any()
    assert rel_err(gW, ref[2]) <= TOL[torch.float32]["grad"]


def test_fp16_gradients_are_scaled_before_they_are_rounded():
    # GradScaler's loss * 2**16: gradients of ~1e-6 are subnormal in fp16; rounded before the scale they
    # lose most of their digits (dW 8e-2 off), scaled first they keep fp16's precision
    scale = 2.0 ** 16
    h_s, W_s, h_t, W_t = make_inputs(64, 512, 16, 16, dtype=torch.float16, seed=0)
    weights = torch.full((64,), 2.0 ** -16)
    hs, Ws = h_s.clone().requires_grad_(True), W_s.clone().requires_grad_(True)
    (distill.reverse_kl(hs, Ws, h_t, W_t, weights=weights) * scale).backward()
    ref = reverse_kl_reference(h_s, W_s, h_t, W_t, weights=weights)
    assert hs.grad.dtype == torch.float16 and Ws.grad.dtype == torch.float16
    assert rel_err(hs.grad.double() / scale, ref[1]) <= TOL[torch.float16]["grad"]
    assert rel_err(Ws.grad.double() / scale, ref[2]) <= TOL[torch.float16]["grad"]
