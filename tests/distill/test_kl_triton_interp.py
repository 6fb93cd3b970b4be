"""The Triton kernels on CPU under TRITON_INTERPRET=1, small shapes, against the fp64 reference.

Triton reads TRITON_INTERPRET when it is imported, so the default run launches this same file in a
child pytest with the variable set (the launcher test), and the cases run there.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(INTERPRETED, reason="launcher only")
def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", str(pathlib.Path(__file__))],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1].split("passed")[0]


interp = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")

if INTERPRETED:
    from distill import kl_triton
    from distill.kl import token_coefficients
    from distill.kl_reference import reverse_kl_reference
    from tests.distill.kl_cases import TOL, make_inputs, mask_and_weights, rel_err

# The interpreter pays per program: few, wide tiles (V is never a multiple of BLOCK_V).
SMALL = dict(BLOCK_M=16, BLOCK_V=128, BLOCK_K=16, EW_BLOCK=1024)
WIDE = dict(BLOCK_M=16, BLOCK_V=1024, BLOCK_K=16, EW_BLOCK=8192)  # V = 50,257


def _run(x, coef, temperature=1.0, chunk_tokens=16, grads_f32=False, **config):
    return kl_triton.kl_and_grads(*x, coef, temperature, True, chunk_tokens=chunk_tokens, config=config,
                                  grads_f32=grads_f32)


def _check(x, dtype, weights=None, mask=None, temperature=1.0, **config):
    coef = token_coefficients(x[0].shape[0], weights, mask, x[0].device)
    kl_N, gh, gW = _run(x, coef, temperature, **config)
    loss = (coef * kl_N).sum()
    ref = reverse_kl_reference(*x, weights=weights, mask=mask, temperature=temperature)
    assert gh.dtype == dtype and gW.dtype == dtype
    assert torch.isfinite(kl_N).all() and torch.isfinite(gh).all() and torch.isfinite(gW).all()
    tol = TOL[dtype]
    assert rel_err(loss, ref[0]) <= tol["loss"], (loss.item(), ref[0].item())
    assert rel_err(gh, ref[1]) <= tol["grad"] + rel_err(ref[1].to(dtype), ref[1])
    assert rel_err(gW, ref[2]) <= tol["grad"] + rel_err(ref[2].to(dtype), ref[2])


@interp
@pytest.mark.parametrize("variant", ["fused", "cublas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_value_and_grads_mask_weights_temperature(dtype, variant):
    x = make_inputs(7, 1001, 32, 48, dtype=dtype, seed=1)
    mask, weights = mask_and_weights(7)
    _check(x, dtype, weights=weights, mask=mask, temperature=0.7, variant=variant, **SMALL)
    _check(x, dtype, mask=mask, temperature=1.9, variant=variant, **SMALL)
    _check(x, dtype, mask=mask, temperature=1.3, variant=variant, grad_group=2, chunk_tokens=4, **SMALL)


@interp
@pytest.mark.parametrize("N", [1, 7, 20])
def test_odd_vocab_50257_and_uneven_hidden(N):
    # H = 20 is not a multiple of BLOCK_K (masked K loop); N = 20 spans two chunks, the last padded
    _check(make_inputs(N, 50257, 20, 24, seed=N), torch.float32, **WIDE)


@interp
def test_identical_distributions_give_exact_zero():
    h_s, W_s, _, _ = make_inputs(7, 1001, 32, 32, dtype=torch.bfloat16, seed=2)
    coef = torch.full((7,), 1 / 7, dtype=torch.float32)
    kl_N, gh, gW = _run((h_s, W_s, h_s.clone(), W_s.clone()), coef, 0.5, **SMALL)
    assert not kl_N.any() and not gh.any() and not gW.any()


@interp
def test_near_one_hot_is_finite():
    x = make_inputs(7, 1001, 32, 32, seed=3, scale=300.0)
    kl_N, gh, gW = _run(x, torch.full((7,), 1 / 7, dtype=torch.float32), **SMALL)
    ref_loss, ref_gh, _ = reverse_kl_reference(*x)
    assert torch.isfinite(kl_N).all() and torch.isfinite(gh).all() and torch.isfinite(gW).all()
    assert rel_err(kl_N.mean(), ref_loss) <= 1e-5
    # logits of ~1e3 carry an fp32 rounding of ~1e-4: the gradient error scales with it
    assert (gh.double() - ref_gh).abs().max().item() <= 1e-3 * ref_gh.abs().max().item() + 1e-6


@interp
@pytest.mark.parametrize("grad_group", [1, 2])
def test_deterministic_and_batch_invariant(grad_group):
    # three chunks, the last padded; with grad_group=2 the second GEMM group has an empty slot
    x = make_inputs(40, 1001, 32, 24, dtype=torch.bfloat16, seed=4)
    ones = torch.ones(40, dtype=torch.float32)
    cfg = dict(SMALL, grad_group=grad_group)
    first, second = _run(x, ones, **cfg), _run(x, ones, **cfg)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    h_s, W_s, h_t, W_t = x
    for lo, hi in [(0, 1), (17, 24), (33, 40)]:
        kl_small, dh_small, _ = _run((h_s[lo:hi], W_s, h_t[lo:hi], W_t), ones[lo:hi], **cfg)
        assert torch.equal(kl_small, first[0][lo:hi])
        assert torch.equal(dh_small, first[1][lo:hi])


@interp
@pytest.mark.parametrize("grad_group", [1, 2])
def test_pipelined_schedule_is_bit_identical(grad_group):
    # overlap=True: double-buffered logits / dlogits and the pipelined order (one stream on CPU; the
    # GPU test checks the two-stream run); five chunks, with grad_group=2 the last group half empty
    x = make_inputs(37, 1001, 32, 24, dtype=torch.bfloat16, seed=6)
    coef = torch.full((37,), 1 / 37, dtype=torch.float32)
    cfg = dict(SMALL, variant="cublas", grad_group=grad_group, chunk_tokens=8)
    serial, piped = _run(x, coef, **cfg), _run(x, coef, overlap=True, **cfg)
    for a, b in zip(serial, piped):
        assert torch.equal(a, b)
    _check(x, torch.bfloat16, overlap=True, **cfg)


def test_chunks_and_heads_past_int32_offsets_are_refused_by_name():
    # 17,408 x 129,280 logits read out of bounds on an H100 (an illegal memory access); 16,576 ran right
    from distill.kl_triton import check_launch, default_config

    cfg = default_config(torch.bfloat16, torch.device("cpu"))
    check_launch(16_384, 129_280, 4096, cfg)
    with pytest.raises(ValueError, match="int32 offsets"):
        check_launch(17_408, 129_280, 4096, cfg)
    with pytest.raises(ValueError, match="output head"):
        check_launch(16, 262_144, 8192, cfg)


@interp
@pytest.mark.parametrize("config,chunk,words", [(dict(EW_BLOCK=1), 16, "grid's second axis"),
                                                (dict(BLOCK_M=1, BLOCK_V=1), 1 << 20, "lower chunk_tokens")])
def test_launches_over_cudas_grid_limits_are_refused_by_name(config, chunk, words):
    x = make_inputs(4, 70_000, 2, 2, seed=5)
    with pytest.raises(ValueError, match=words):
        _run(x, torch.full((4,), 0.25), chunk_tokens=chunk, **dict(SMALL, **config))


@interp
def test_a_masked_row_with_non_finite_teacher_states_adds_nothing():
    h_s, W_s, h_t, W_t = make_inputs(7, 1001, 32, 48, seed=8)
    mask = torch.tensor([True] * 6 + [False])
    bad = h_t.clone()
    bad[6] = float("nan")
    kl_N, gh, gW = _run((h_s, W_s, bad, W_t), token_coefficients(7, None, mask, "cpu"), **SMALL)
    ref = reverse_kl_reference(h_s[:6], W_s, h_t[:6], W_t)
    assert torch.isfinite(gh).all() and torch.isfinite(gW).all() and not gh[6].any()
    assert rel_err(kl_N[:6].mean(), ref[0]) <= TOL[torch.float32]["loss"]
    assert rel_err(gh[:6], ref[1]) <= TOL[torch.float32]["grad"]
    assert rel_err(gW, ref[2]) <= TOL[torch.float32]["grad"]


@interp
@pytest.mark.parametrize("variant", ["fused", "cublas"])
def test_fp16_gradients_come_back_float32_when_asked(variant):
    # reverse_kl scales them by the upstream gradient (a loss scale) before the cast to fp16
    x = make_inputs(7, 1001, 32, 48, dtype=torch.float16, seed=9)
    coef = torch.full((7,), 1 / 7, dtype=torch.float32)
    _, gh, gW = _run(x, coef, grads_f32=True, variant=variant, **SMALL)
    ref = reverse_kl_reference(*x)
    assert gh.dtype == torch.float32 and gW.dtype == torch.float32
    assert rel_err(gh, ref[1]) <= TOL[torch.float32]["grad"] and rel_err(gW, ref[2]) <= TOL[torch.float32]["grad"]
