"""`reverse_kl`: the autograd-facing full-vocabulary reverse KL from hidden states.

    loss = sum_i c_i * KL(p_s,i || p_t,i),  p_x,i = softmax(h_x,i @ W_x.T / T)

with c_i = mask_i / max(1, sum(mask))   when `weights` is None (mean over unmasked tokens),
     c_i = weights_i * mask_i            when `weights` is given (weighted sum, no normalisation).
Gradients flow to h_s and W_s only; the teacher (h_t, W_t) and the weights get none. The loss is a
float32 scalar; the gradients come back in the student's dtypes. No T**2 factor is applied. A token
with c_i = 0 adds nothing, even where its hidden states are not finite.

The backend computes the loss and both gradients in one sweep during the forward (the logits are
rebuilt from hidden states chunk by chunk, never held for the whole batch); backward only scales
them by the incoming gradient.
"""
from __future__ import annotations

import math

import torch

from distill import kl_chunked

BACKENDS = ("triton", "chunked")


def _check(h_s, W_s, h_t, W_t, weights, mask, temperature):
    for name, x in (("h_s", h_s), ("W_s", W_s), ("h_t", h_t), ("W_t", W_t)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"reverse_kl: {name} must be a 2-D tensor, got {getattr(x, 'shape', type(x))}")
        if not x.is_floating_point():
            raise ValueError(f"reverse_kl: {name} must be floating point, got {x.dtype}")
        if x.device != h_s.device:
            raise ValueError(f"reverse_kl: {name} is on {x.device}, h_s on {h_s.device}; put all on one device")
    N = h_s.shape[0]
    if h_t.shape[0] != N:
        raise ValueError(f"reverse_kl: h_s has {N} tokens, h_t has {h_t.shape[0]}")
    if W_s.shape[0] != W_t.shape[0]:
        raise ValueError(f"reverse_kl: vocab sizes differ: W_s {W_s.shape[0]}, W_t {W_t.shape[0]}")
    if W_s.shape[1] != h_s.shape[1] or W_t.shape[1] != h_t.shape[1]:
        raise ValueError(f"reverse_kl: hidden sizes do not match: h_s {tuple(h_s.shape)} vs W_s {tuple(W_s.shape)}, "
                         f"h_t {tuple(h_t.shape)} vs W_t {tuple(W_t.shape)}")
    if h_s.dtype != W_s.dtype or h_t.dtype != W_t.dtype:
        raise ValueError(f"reverse_kl: each hidden state must share its head's dtype "
                         f"(h_s {h_s.dtype}, W_s {W_s.dtype}, h_t {h_t.dtype}, W_t {W_t.dtype})")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"reverse_kl: temperature must be a finite number > 0, got {temperature!r}")
    for name, x in (("weights", weights), ("mask", mask)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != (N,)):
            raise ValueError(f"reverse_kl: {name} must be a tensor of shape ({N},), got {getattr(x, 'shape', type(x))}")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"reverse_kl: mask must be bool, got {mask.dtype}")


def token_coefficients(n: int, weights, mask, device) -> torch.Tensor:
    """c_i of the loss (see module docstring), float32 [N]."""
    keep_N = torch.ones(n, dtype=torch.float32, device=device) if mask is None else mask.to(device, torch.float32)
    if weights is None:
        return keep_N / keep_N.sum().clamp_min(1.0)
    return keep_N * weights.to(device, torch.float32)


def _pick_backend(device: torch.device, backend: str | None) -> str:
    if backend is None:
        return "triton" if device.type == "cuda" else "chunked"
    if backend not in BACKENDS:
        raise ValueError(f"reverse_kl: unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "triton" and device.type != "cuda":
        raise ValueError("reverse_kl: the triton backend needs CUDA tensors; use backend='chunked' on CPU")
    return backend


def kl_and_grads(h_s, W_s, h_t, W_t, coef_N, temperature, need_grad, backend, chunk_tokens=None,
                 triton_config=None):
    """Dispatch to a backend: (kl_N float32, grad_h_s | None, grad_W_s | None) of sum_i coef_i KL_i;
    fp16 inputs get float32 gradients (the caller casts them after the upstream gradient)."""
    if h_s.shape[0] == 0:  # no tokens: zero loss, zero gradients
        kl_N = torch.zeros(0, dtype=torch.float32, device=h_s.device)
        return (kl_N, torch.zeros_like(h_s), torch.zeros_like(W_s)) if need_grad else (kl_N, None, None)
    # fp16 gradients rounded before a loss scale (GradScaler's 2**16) is applied would lose the small ones
    grads_f32 = h_s.dtype == torch.float16
    if backend == "triton":
        from distill import kl_triton

        return kl_triton.kl_and_grads(h_s, W_s, h_t, W_t, coef_N, temperature, need_grad,
                                      chunk_tokens=chunk_tokens, config=triton_config, grads_f32=grads_f32)
    return kl_chunked.kl_and_grads(h_s, W_s, h_t, W_t, coef_N, temperature, need_grad, chunk_tokens=chunk_tokens,
                                   grads_f32=grads_f32)


class _ReverseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, W_s, h_t, W_t, coef_N, temperature, backend, chunk_tokens, triton_config):
        need_grad = h_s.requires_grad or W_s.requires_grad
        kl_N, dh, dW = kl_and_grads(h_s.detach(), W_s.detach(), h_t.detach(), W_t.detach(), coef_N,
                                    temperature, need_grad, backend, chunk_tokens, triton_config)
        # Plain attributes, not save_for_backward: the gradients are scaled in place and handed over
        # without a copy (a [V, H] copy would raise peak memory by the size of the head).
        ctx.grads = (dh, dW)
        ctx.dtypes = (h_s.dtype, W_s.dtype)
        return torch.where(coef_N != 0, coef_N * kl_N, 0.0).sum()  # a NaN outside the loss stays out

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("reverse_kl: backward ran twice over the same graph; call reverse_kl again")
        dh, dW = ctx.grads
        ctx.grads = None
        # The usual upstream gradient is exactly 1: skip a pass over the [V, H] gradient then (one
        # host sync on a scalar; the forward's kernels are already queued).
        g = grad_loss.float()
        unit = bool(g == 1.0)
        gh = (dh if unit else dh.mul_(g)).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] and dh is not None else None
        gW = (dW if unit else dW.mul_(g)).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] and dW is not None else None
        return gh, gW, None, None, None, None, None, None, None


def reverse_kl(h_s, W_s, h_t, W_t, *, weights=None, mask=None, temperature: float = 1.0,
               backend: str | None = None, chunk_tokens: int | None = None,
               triton_config: dict | None = None) -> torch.Tensor:
    """Exact full-vocabulary KL(p_s || p_t) from hidden states; see the module docstring for semantics.

    h_s [N, H_s], W_s [V, H_s], h_t [N, H_t], W_t [V, H_t]; weights [N] float, mask [N] bool.
    backend: None picks "triton" on CUDA and "chunked" elsewhere. chunk_tokens bounds the working set
    (tokens per chunk). triton_config overrides the Triton launch configuration (benchmark tuning).
    """
    _check(h_s, W_s, h_t, W_t, weights, mask, temperature)
    chosen = _pick_backend(h_s.device, backend)
    coef_N = token_coefficients(h_s.shape[0], weights, mask, h_s.device)
    return _ReverseKL.apply(h_s, W_s, h_t, W_t, coef_N, float(temperature), chosen, chunk_tokens, triton_config)
