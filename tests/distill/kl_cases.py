"""Shared inputs and tolerances for the reverse-KL tests (seeded; dtypes always explicit)."""
from __future__ import annotations

import torch

# Relative-norm tolerances against the fp64 reference. fp32: fp32 accumulation only. bf16 / fp16: the
# gradients come back in the input dtype (one rounding, 2**-9 / 2**-12 relative) and dlogits are
# rounded once before the dh / dW GEMMs.
TOL = {
    torch.float32: dict(loss=1e-5, grad=1e-4),
    torch.float16: dict(loss=1e-4, grad=4e-3),
    torch.bfloat16: dict(loss=1e-4, grad=1.5e-2),
}


def make_inputs(N, V, H_s, H_t, dtype=torch.float32, seed=0, scale=1.0, device="cpu"):
    """h_s [N, H_s], W_s [V, H_s], h_t [N, H_t], W_t [V, H_t]; logits of size about `scale` * 1.

    The teacher is correlated with the student (its logits share a component) so KL is moderate.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=g, dtype=torch.float32, device=device)
    h_s = torch.randn(N, H_s, **kw) * scale / H_s**0.25
    W_s = torch.randn(V, H_s, **kw) / H_s**0.25
    h_t = torch.randn(N, H_t, **kw) * scale / H_t**0.25
    W_t = torch.randn(V, H_t, **kw) / H_t**0.25
    k = min(H_s, H_t)
    h_t[:, :k] = 0.5 * h_t[:, :k] + h_s[:, :k] * (H_t / H_s) ** 0.25
    W_t[:, :k] = 0.5 * W_t[:, :k] + W_s[:, :k] * (H_t / H_s) ** 0.25
    return tuple(x.to(dtype) for x in (h_s, W_s, h_t, W_t))


def mask_and_weights(N, seed=1, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mask = torch.rand(N, generator=g, dtype=torch.float32) > 0.3
    if N:
        mask[0] = True
    weights = torch.rand(N, generator=g, dtype=torch.float32) * 2
    return mask.to(device), weights.to(device)


def rel_err(x, ref) -> float:
    x64, ref64 = x.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref64.norm().item()
    if denom == 0.0:
        return (x64 - ref64).norm().item()
    return ((x64 - ref64).norm() / denom).item()
