"""Plain fp64 full-vocabulary reverse KL: the obviously correct reference, used only in tests.

Materialises the whole [N, V] logits in float64; fine for test shapes, never for training.
"""
from __future__ import annotations

import torch


def kl_rows_reference(h_s, W_s, h_t, W_t, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_s || p_t) per token in float64, p = softmax(h @ W.T / T). Differentiable in h_s, W_s."""
    logp_s_NV = torch.log_softmax((h_s.double() @ W_s.double().T) / temperature, dim=-1)
    logp_t_NV = torch.log_softmax((h_t.double() @ W_t.double().T) / temperature, dim=-1)
    return (logp_s_NV.exp() * (logp_s_NV - logp_t_NV)).sum(dim=-1)


def reverse_kl_reference(h_s, W_s, h_t, W_t, *, weights=None, mask=None, temperature: float = 1.0,
                         rows_per_slice: int = 64):
    """Same loss semantics as `distill.reverse_kl`, in float64.

    Returns (loss, grad_h_s, grad_W_s) on the inputs' device, the gradients from autograd of the fp64 graph.
    """
    N, dev = h_s.shape[0], h_s.device
    keep_N = torch.ones(N, dtype=torch.float64, device=dev) if mask is None else mask.to(torch.float64)
    if weights is None:
        coef_N = keep_N / keep_N.sum().clamp_min(1.0)
    else:
        coef_N = keep_N * weights.detach().double()
    h_s64 = h_s.detach().double().requires_grad_(True)
    W_s64 = W_s.detach().double().requires_grad_(True)
    h_t64, W_t64 = h_t.detach().double(), W_t.detach().double()
    loss = torch.zeros((), dtype=torch.float64, device=dev)
    for t0 in range(0, N, rows_per_slice):  # the loss is a sum over tokens: slice only to bound memory
        t1 = min(N, t0 + rows_per_slice)
        part = (coef_N[t0:t1] * kl_rows_reference(h_s64[t0:t1], W_s64, h_t64[t0:t1], W_t64, temperature)).sum()
        part.backward()
        loss += part.detach()
    return loss, h_s64.grad, W_s64.grad
