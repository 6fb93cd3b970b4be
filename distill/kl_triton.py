"""Fused Triton reverse KL (CUDA; runs on CPU under TRITON_INTERPRET=1 for tests).

Per chunk of C tokens (C fixed by V, never by N; the last chunk is zero-padded, so every launch has
the same shape and a token's result does not depend on the rest of the batch):

1. `_logits_stats_kernel`: one program per [BLOCK_M, BLOCK_V] tile computes the student and the
   teacher logit tiles with tensor-core dots (fp32 accumulators), stores them as float32 into the
   bounded chunk buffers z_s, z_t [C, V], and writes the tile's softmax statistics for both
   distributions (max, sum of exp, and sum of exp * (a - b)) into a small [5, C, V/BLOCK_V] buffer.
   Programs walk the M blocks of one vocab block back to back, so each W tile is read from HBM once.
   (variant "cublas": the two logit GEMMs run in cuBLAS with float32 output and
   `_tile_stats_kernel` reads them back for the same statistics.)
2. `_row_reduce_kernel`: combines the tile statistics in a fixed order into lse(a), E_p[a - b] and
   KL per token (online-softmax rescaling).
3. `_dlogits_kernel`: dlogits_s = c_i / T * p_s * ((a - b) - E_p[a - b]), written in the student's
   dtype into a [C, V] buffer.
4. dh_s = dlogits @ W_s and dW_s += dlogits.T @ h_s (cuBLAS, fixed shapes, no atomics: deterministic).

Nothing of size [N, V] exists in HBM: the buffers hold C rows. Logits stay in float32 throughout.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

N_STATS = 5  # max_a, sum exp(a - max_a), sum exp(a - max_a) * (a - b), max_b, sum exp(b - max_b)
CHUNK_BYTES_DEFAULT = 1280 * 2**20  # z_s, z_t (float32) and dlogits for one chunk of tokens


@triton.jit
def _tile_stats(zs, zt, offs_m, offs_v, m_ok, v_ok, pid_v, stats_ptr, stride_sk, stride_sm, inv_T):
    """Softmax statistics of one [BLOCK_M, BLOCK_V] tile of raw logits, stored per row."""
    a = zs * inv_T
    b = zt * inv_T
    d = tl.where(v_ok[None, :], a - b, 0.0)
    a = tl.where(v_ok[None, :], a, float("-inf"))
    b = tl.where(v_ok[None, :], b, float("-inf"))
    max_a = tl.max(a, axis=1)
    e_a = tl.exp(a - max_a[:, None])
    sum_a = tl.sum(e_a, axis=1)
    sum_ad = tl.sum(e_a * d, axis=1)
    max_b = tl.max(b, axis=1)
    sum_b = tl.sum(tl.exp(b - max_b[:, None]), axis=1)
    base = stats_ptr + offs_m * stride_sm + pid_v
    tl.store(base, max_a, mask=m_ok)
    tl.store(base + stride_sk, sum_a, mask=m_ok)
    tl.store(base + 2 * stride_sk, sum_ad, mask=m_ok)
    tl.store(base + 3 * stride_sk, max_b, mask=m_ok)
    tl.store(base + 4 * stride_sk, sum_b, mask=m_ok)


@triton.jit
def _dot_tile(h_ptr, w_ptr, offs_m, offs_v, K, stride_h, stride_w,
              BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """[BLOCK_M, BLOCK_V] float32 tile of h @ w.T; rows/cols out of range are clamped, not masked.

    DOT_F32 upcasts the operands first: only for the CPU interpreter, whose bf16 dot is wrong.
    """
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + offs_m[:, None] * stride_h + offs_k[None, :]
    w_ptrs = w_ptr + offs_v[None, :] * stride_w + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            h = tl.load(h_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + offs_k) < K
            h = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_F32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _logits_stats_kernel(hs_ptr, ws_ptr, ht_ptr, wt_ptr, zs_ptr, zt_ptr, stats_ptr,
                         M, V, HS, HT, stride_hs, stride_ws, stride_ht, stride_wt, stride_z,
                         stride_sk, stride_sm, inv_T,
                         BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_v = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_ok = offs_m < M
    v_ok = offs_v < V
    ld_m = tl.where(m_ok, offs_m, 0)
    ld_v = tl.where(v_ok, offs_v, 0)
    zs = _dot_tile(hs_ptr, ws_ptr, ld_m, ld_v, HS, stride_hs, stride_ws, BLOCK_M, BLOCK_V, BLOCK_K, EVEN_K, PRECISION, DOT_F32)
    zt = _dot_tile(ht_ptr, wt_ptr, ld_m, ld_v, HT, stride_ht, stride_wt, BLOCK_M, BLOCK_V, BLOCK_K, EVEN_K, PRECISION, DOT_F32)
    z_off = offs_m[:, None] * stride_z + offs_v[None, :]
    ok = m_ok[:, None] & v_ok[None, :]
    tl.store(zs_ptr + z_off, zs, mask=ok)
    tl.store(zt_ptr + z_off, zt, mask=ok)
    _tile_stats(zs, zt, offs_m, offs_v, m_ok, v_ok, pid_v, stats_ptr, stride_sk, stride_sm, inv_T)


@triton.jit
def _tile_stats_kernel(zs_ptr, zt_ptr, stats_ptr, M, V, stride_z, stride_sk, stride_sm, inv_T,
                       BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_v = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_ok = offs_m < M
    v_ok = offs_v < V
    z_off = offs_m[:, None] * stride_z + offs_v[None, :]
    ok = m_ok[:, None] & v_ok[None, :]
    zs = tl.load(zs_ptr + z_off, mask=ok, other=0.0)
    zt = tl.load(zt_ptr + z_off, mask=ok, other=0.0)
    _tile_stats(zs, zt, offs_m, offs_v, m_ok, v_ok, pid_v, stats_ptr, stride_sk, stride_sm, inv_T)


@triton.jit
def _row_reduce_kernel(stats_ptr, kl_ptr, lse_ptr, mean_ptr, NVB, stride_sk, stride_sm, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = stats_ptr + row * stride_sm
    offs = tl.arange(0, BLOCK)
    run_a = tl.full((BLOCK,), float("-inf"), tl.float32)
    run_b = tl.full((BLOCK,), float("-inf"), tl.float32)
    for j0 in range(0, NVB, BLOCK):
        ok = (j0 + offs) < NVB
        run_a = tl.maximum(run_a, tl.load(base + j0 + offs, mask=ok, other=float("-inf")))
        run_b = tl.maximum(run_b, tl.load(base + 3 * stride_sk + j0 + offs, mask=ok, other=float("-inf")))
    max_a = tl.max(run_a, axis=0)
    max_b = tl.max(run_b, axis=0)
    acc_sa = tl.zeros((BLOCK,), tl.float32)
    acc_sad = tl.zeros((BLOCK,), tl.float32)
    acc_sb = tl.zeros((BLOCK,), tl.float32)
    for j0 in range(0, NVB, BLOCK):
        ok = (j0 + offs) < NVB
        ma = tl.load(base + j0 + offs, mask=ok, other=float("-inf"))
        sa = tl.load(base + stride_sk + j0 + offs, mask=ok, other=0.0)
        sad = tl.load(base + 2 * stride_sk + j0 + offs, mask=ok, other=0.0)
        mb = tl.load(base + 3 * stride_sk + j0 + offs, mask=ok, other=float("-inf"))
        sb = tl.load(base + 4 * stride_sk + j0 + offs, mask=ok, other=0.0)
        scale_a = tl.exp(ma - max_a)
        acc_sa += sa * scale_a
        acc_sad += sad * scale_a
        acc_sb += sb * tl.exp(mb - max_b)
    sum_a = tl.sum(acc_sa, axis=0)
    mean_d = tl.sum(acc_sad, axis=0) / sum_a
    lse_a = max_a + tl.log(sum_a)
    lse_b = max_b + tl.log(tl.sum(acc_sb, axis=0))
    tl.store(kl_ptr + row, mean_d - lse_a + lse_b)
    tl.store(lse_ptr + row, lse_a)
    tl.store(mean_ptr + row, mean_d)


@triton.jit
def _dlogits_kernel(zs_ptr, zt_ptr, dl_ptr, lse_ptr, mean_ptr, coef_ptr, V, stride_z, stride_dl, inv_T,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    a = tl.load(zs_ptr + row * stride_z + offs, mask=ok, other=0.0) * inv_T
    b = tl.load(zt_ptr + row * stride_z + offs, mask=ok, other=0.0) * inv_T
    lse_a = tl.load(lse_ptr + row)
    mean_d = tl.load(mean_ptr + row)
    c = tl.load(coef_ptr + row)  # c_i / T
    dl = c * tl.exp(a - lse_a) * ((a - b) - mean_d)
    tl.store(dl_ptr + row * stride_dl + offs, dl.to(dl_ptr.dtype.element_ty), mask=ok)


def default_config(dtype: torch.dtype, device: torch.device) -> dict:
    """Launch configuration; fixed per dtype (never per N), so results are batch invariant."""
    if device.type != "cuda":  # interpreter: small tiles keep it fast
        return dict(BLOCK_M=16, BLOCK_V=32, BLOCK_K=16, num_warps=4, num_stages=1, EW_BLOCK=64, variant="fused")
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_V=128, BLOCK_K=32, num_warps=8, num_stages=3, EW_BLOCK=2048, variant="fused")
    return dict(BLOCK_M=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3, EW_BLOCK=2048, variant="fused")


def default_chunk_tokens(vocab_size: int, block_m: int, chunk_bytes: int = CHUNK_BYTES_DEFAULT) -> int:
    """Rows per chunk: z_s, z_t (4 B each) and dlogits (<= 4 B) per vocab entry, a multiple of block_m."""
    rows = chunk_bytes // (12 * vocab_size)
    return max(block_m, rows // block_m * block_m)


def _mm_f32(h, W):
    """float32 logits h @ W.T from cuBLAS without rounding them to the input dtype."""
    if h.dtype == torch.float32:
        return h @ W.T
    if h.device.type == "cuda":
        return torch.mm(h, W.T, out_dtype=torch.float32)
    return h.float() @ W.float().T  # CPU tests of the variant


def kl_and_grads(h_s, W_s, h_t, W_t, coef_N, temperature: float, need_grad: bool, *,
                 chunk_tokens: int | None = None, config: dict | None = None):
    """Per-token KL [N] float32 and, if `need_grad`, gradients of sum_i coef_i * KL_i (student dtypes)."""
    cfg = dict(default_config(h_s.dtype, h_s.device), **(config or {}))
    N, HS = h_s.shape
    HT = h_t.shape[1]
    V = W_s.shape[0]
    BM, BV, BK = cfg["BLOCK_M"], cfg["BLOCK_V"], cfg["BLOCK_K"]
    C = chunk_tokens or default_chunk_tokens(V, BM)
    dev = h_s.device
    h_s, W_s, h_t, W_t = (x.contiguous() for x in (h_s, W_s, h_t, W_t))
    inv_T = 1.0 / float(temperature)
    interpreted = dev.type != "cuda"
    precision = "ieee" if interpreted or torch.float32 in (h_s.dtype, h_t.dtype) else "tf32"
    even_k = HS % BK == 0 and HT % BK == 0
    nvb = triton.cdiv(V, BV)

    zs_CV = torch.empty(C, V, dtype=torch.float32, device=dev)
    zt_CV = torch.empty(C, V, dtype=torch.float32, device=dev) if cfg["variant"] == "fused" else None
    stats = torch.empty(N_STATS, C, nvb, dtype=torch.float32, device=dev)
    kl_N = torch.empty(N, dtype=torch.float32, device=dev)
    lse_C = torch.empty(C, dtype=torch.float32, device=dev)
    mean_C = torch.empty(C, dtype=torch.float32, device=dev)
    if need_grad:
        dl_CV = torch.empty(C, V, dtype=h_s.dtype, device=dev)
        dh_NH = torch.empty(N, HS, dtype=h_s.dtype, device=dev)
        dW_VH = torch.empty(V, HS, dtype=W_s.dtype, device=dev)
        coef_scaled = torch.zeros(C, dtype=torch.float32, device=dev)
    kl_C = torch.empty(C, dtype=torch.float32, device=dev)
    for t0 in range(0, N, C):
        n = min(C, N - t0)
        hs_c, ht_c = h_s[t0:t0 + n], h_t[t0:t0 + n]
        if n < C:  # pad the last chunk: same shapes for every launch
            hs_c = torch.cat([hs_c, hs_c.new_zeros(C - n, HS)])
            ht_c = torch.cat([ht_c, ht_c.new_zeros(C - n, HT)])
        if cfg["variant"] == "fused":
            grid = (triton.cdiv(C, BM) * nvb,)
            _logits_stats_kernel[grid](
                hs_c, W_s, ht_c, W_t, zs_CV, zt_CV, stats, C, V, HS, HT,
                hs_c.stride(0), W_s.stride(0), ht_c.stride(0), W_t.stride(0), zs_CV.stride(0),
                stats.stride(0), stats.stride(1), inv_T,
                BLOCK_M=BM, BLOCK_V=BV, BLOCK_K=BK, EVEN_K=even_k, PRECISION=precision, DOT_F32=interpreted,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        else:  # "cublas": logits GEMMs in cuBLAS (float32 out), statistics in Triton
            zs_CV = _mm_f32(hs_c, W_s)
            zt_CV = _mm_f32(ht_c, W_t)
            grid = (triton.cdiv(C, BM) * nvb,)
            _tile_stats_kernel[grid](zs_CV, zt_CV, stats, C, V, zs_CV.stride(0), stats.stride(0), stats.stride(1),
                                     inv_T, BLOCK_M=BM, BLOCK_V=BV, num_warps=cfg["num_warps"])
        _row_reduce_kernel[(C,)](stats, kl_C, lse_C, mean_C, nvb, stats.stride(0), stats.stride(1), BLOCK=256)
        kl_N[t0:t0 + n] = kl_C[:n]
        if not need_grad:
            continue
        coef_scaled.zero_()
        coef_scaled[:n] = coef_N[t0:t0 + n] * inv_T
        _dlogits_kernel[(C, triton.cdiv(V, cfg["EW_BLOCK"]))](
            zs_CV, zt_CV, dl_CV, lse_C, mean_C, coef_scaled, V, zs_CV.stride(0), dl_CV.stride(0), inv_T,
            BLOCK=cfg["EW_BLOCK"], num_warps=8 if dev.type == "cuda" else 4)
        if n == C:
            torch.mm(dl_CV, W_s, out=dh_NH[t0:t0 + n])
        else:
            dh_NH[t0:t0 + n] = (dl_CV @ W_s)[:n]
        if t0 == 0:
            torch.mm(dl_CV.T, hs_c, out=dW_VH)
        else:
            dW_VH.addmm_(dl_CV.T, hs_c)
    if not need_grad:
        return kl_N, None, None
    return kl_N, dh_NH, dW_VH
