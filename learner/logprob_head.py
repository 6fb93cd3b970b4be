"""The LM head fused with the log-softmax, its softmax gradient formed in the forward (CUDA, Triton).

Legend: N rows (tokens), H hidden, V vocabulary; U = onehot(label) − softmax(logits), [N, V].

d logp[label] / d logits = U does not depend on the loss. So the forward writes U over the logits
(one Triton pass per row: log-sum-exp, log p of the label, entropy when asked, then U in place) and
forms A = U @ W; given g = dL/dlogp per row, the backward is
    dL/dh = g · A,        dL/dW = Uᵀ @ (g · h)      (one GEMM, float32 output)
against the recompute path's three GEMMs (logits again, dlogits @ W, dlogitsᵀ @ h) and its
elementwise passes over every chunk of logits (`learner.grpo_loss.logprobs_from_hidden`). The price is
U held from the forward to the backward: 2·V bytes per row in bf16 (~10 GB for 32k rows of a
152k vocabulary), so the caller takes this path only under a byte budget, and only when the entropy
needs no gradient (its gradient is a second [N, V] term). Results are float32; matmuls run in the
compute dtype with float32 accumulation, as on the recompute path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # vocabulary entries per step of a row's loop (CUDA); the interpreter takes V rounded up


@triton.jit
def _softmax_grad_rows(x_ptr, labels_ptr, lse_ptr, logp_ptr, ent_ptr, V, stride_x,
                       WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of x: logits in, U = onehot(label) − p out (in place); lse, log p(label), entropy."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        ok = v0 + offs < V
        x = tl.load(base + v0 + offs, mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        live = m_new > float("-inf")  # lanes that have seen no entry yet add nothing (no inf - inf)
        s = tl.where(live, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - m_row), 0.0), axis=0))
    label = tl.load(labels_ptr + row)
    logp = tl.load(base + label).to(tl.float32) - lse  # read before the row is overwritten
    px = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + offs
        ok = idx < V
        x = tl.load(base + idx, mask=ok, other=0.0).to(tl.float32)
        p = tl.where(ok, tl.exp(x - lse), 0.0)
        if WITH_ENTROPY:
            px += p * x
        u = tl.where(idx == label, 1.0 - p, -p)
        tl.store(base + idx, u.to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, logp)
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, lse - tl.sum(px, axis=0))


def softmax_grad_rows_(logits_NV: torch.Tensor, labels_N: torch.Tensor, with_entropy: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Overwrite `logits_NV` (contiguous rows) with U; returns float32 (lse, log p(label), entropy or None)."""
    n, v = logits_NV.shape
    if logits_NV.stride(1) != 1:
        raise ValueError("softmax_grad_rows_ needs rows with unit stride")
    lse = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
    logp = torch.empty_like(lse)
    ent = torch.empty_like(lse) if with_entropy else lse  # a placeholder pointer when unused
    if n:
        cuda = logits_NV.device.type == "cuda"
        block = BLOCK_V if cuda else triton.next_power_of_2(v)  # the interpreter pays per loop step
        _softmax_grad_rows[(n,)](logits_NV, labels_N, lse, logp, ent, v, logits_NV.stride(0),
                                 WITH_ENTROPY=with_entropy, BLOCK=block, num_warps=8 if cuda else 1)
    return lse, logp, (ent if with_entropy else None)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with float32 output (cuBLAS accumulates in float32 and never rounds to the input dtype)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # CPU (interpreter tests)


class _KeptGradHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, with_entropy: bool, compute_dtype: torch.dtype):
        h_NH = hidden_NH.to(compute_dtype)
        w_VH = weight_VH.to(compute_dtype)
        u_NV = h_NH @ w_VH.t()  # the logits, U after the next line
        _, logp_N, ent_N = softmax_grad_rows_(u_NV, labels_N, with_entropy)
        a_NH = u_NV @ w_VH
        ctx.save_for_backward(h_NH, u_NV, a_NH)
        ctx.hidden_dtype, ctx.weight_dtype = hidden_NH.dtype, weight_VH.dtype
        if ent_N is None:
            ent_N = logp_N.new_zeros(0)
        ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, g_logp_N, _g_ent_N):
        h_NH, u_NV, a_NH = ctx.saved_tensors
        g_N1 = g_logp_N.float()[:, None]
        grad_h = (a_NH.float() * g_N1).to(ctx.hidden_dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = _mm_f32(u_NV.t(), (h_NH.float() * g_N1).to(h_NH.dtype)).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None


def logprobs_kept_grad(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor,
                       compute_dtype: torch.dtype, with_entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weightᵀ)[label] per row (float32) and, when asked, the entropy (no gradient)."""
    logp_N, ent_N = _KeptGradHead.apply(hidden_NH, weight_VH, labels_N, with_entropy, compute_dtype)
    return logp_N, (ent_N if with_entropy else None)


def kept_bytes(rows: int, vocab: int, compute_dtype: torch.dtype) -> int:
    """Bytes held from forward to backward by `logprobs_kept_grad` (U; A and h are small beside it)."""
    return rows * vocab * torch.empty(0, dtype=compute_dtype).element_size()
