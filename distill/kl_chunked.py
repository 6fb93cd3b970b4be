"""Chunked torch reverse KL: exact over the full vocabulary, memory bounded by a chunk size.

Works on any device. Per chunk of tokens, logits are rebuilt vocab-chunk by vocab-chunk from the
hidden states in float32 (inputs upcast per vocab chunk, so bf16/fp16 logits are never rounded),
softmax statistics, KL and dlogits are computed in float32, and dh / dW are accumulated in float32.
Peak working memory: about 3 * chunk_tokens * V float32 plus one [chunk_vocab, H] float32 slice.

Math (a = z_s / T, b = z_t / T, d = a - b, p = softmax(a)):
    KL      = sum_k p_k d_k - (lse(a) - lse(b))
    dKL/da  = p * (d - sum_k p_k d_k)          (the lse terms cancel)
    dKL/dz_s = dKL/da / T
"""
from __future__ import annotations

import torch

WORK_BYTES_DEFAULT = 256 * 2**20  # per-chunk working set budget for the [tokens, V] float32 buffers
CHUNK_TOKENS_MAX = 256
CHUNK_VOCAB_DEFAULT = 8192


def default_chunk_tokens(vocab_size: int, work_bytes: int = WORK_BYTES_DEFAULT) -> int:
    """Token chunk whose three [chunk, V] float32 buffers fit in `work_bytes`, at most 256.

    Depends on V only, never on N: every chunk (the last one padded) has this many rows.
    """
    return max(1, min(CHUNK_TOKENS_MAX, work_bytes // (12 * vocab_size)))


def _logits_f32(h_CH: torch.Tensor, W_VH: torch.Tensor, chunk_vocab: int) -> torch.Tensor:
    """[C, V] float32 logits h @ W.T, upcasting W one vocab slice at a time."""
    V = W_VH.shape[0]
    out_CV = torch.empty(h_CH.shape[0], V, dtype=torch.float32, device=h_CH.device)
    for v0 in range(0, V, chunk_vocab):
        v1 = min(V, v0 + chunk_vocab)
        torch.mm(h_CH, W_VH[v0:v1].float().T, out=out_CV[:, v0:v1])
    return out_CV


def kl_and_grads(h_s, W_s, h_t, W_t, coef_N, temperature: float, need_grad: bool, *,
                 chunk_tokens: int | None = None, chunk_vocab: int = CHUNK_VOCAB_DEFAULT, grads_f32: bool = False):
    """Per-token KL [N] float32 and, if `need_grad`, the gradients of sum_i coef_i * KL_i.

    Returns (kl_N, grad_h_s or None, grad_W_s or None); gradients in the student's dtypes (`grads_f32`
    and fp16 inputs: float32, for a caller that scales them before the cast).
    Tokens are processed in fixed-size chunks (the last one zero-padded), so every GEMM has the same
    shape and a token's result does not depend on the other tokens of the batch.
    """
    N, H_s = h_s.shape
    V = W_s.shape[0]
    C = chunk_tokens or default_chunk_tokens(V)
    inv_T = 1.0 / float(temperature)
    dev = h_s.device
    kl_N = torch.empty(N, dtype=torch.float32, device=dev)
    dh_NH = torch.zeros(N, H_s, dtype=torch.float32, device=dev) if need_grad else None
    dW_VH = torch.zeros(V, H_s, dtype=torch.float32, device=dev) if need_grad else None
    hs_CH = torch.zeros(C, H_s, dtype=torch.float32, device=dev)
    ht_CH = torch.zeros(C, h_t.shape[1], dtype=torch.float32, device=dev)
    for t0 in range(0, N, C):
        t1 = min(N, t0 + C)
        n = t1 - t0
        hs_CH.zero_()
        ht_CH.zero_()
        hs_CH[:n] = h_s[t0:t1]
        ht_CH[:n] = h_t[t0:t1]
        a_CV = _logits_f32(hs_CH, W_s, chunk_vocab).mul_(inv_T)
        d_CV = _logits_f32(ht_CH, W_t, chunk_vocab).mul_(inv_T)  # b, then d = a - b in place
        lse_b = torch.logsumexp(d_CV, dim=1)
        torch.sub(a_CV, d_CV, out=d_CV)
        lse_a = torch.logsumexp(a_CV, dim=1)
        p_CV = a_CV.sub_(lse_a[:, None]).exp_()  # a is no longer needed
        mean_d = (p_CV * d_CV).sum(dim=1)
        kl_N[t0:t1] = (mean_d - lse_a + lse_b)[:n]
        if not need_grad:
            continue
        coef_C = torch.zeros(C, dtype=torch.float32, device=dev)
        coef_C[:n] = coef_N[t0:t1].float() * inv_T
        dl_CV = p_CV.mul_(d_CV.sub_(mean_d[:, None])).mul_(coef_C[:, None])
        dl_CV.masked_fill_((coef_C == 0)[:, None], 0.0)  # a row outside the loss adds nothing, even a NaN one
        for v0 in range(0, V, chunk_vocab):
            v1 = min(V, v0 + chunk_vocab)
            dh_NH[t0:t1] += (dl_CV[:, v0:v1] @ W_s[v0:v1].float())[:n]
            dW_VH[v0:v1] += dl_CV[:, v0:v1].T @ hs_CH
    if not need_grad:
        return kl_N, None, None
    if grads_f32 and h_s.dtype == torch.float16:
        return kl_N, dh_NH, dW_VH
    return kl_N, dh_NH.to(h_s.dtype), dW_VH.to(W_s.dtype)
