"""Triton reverse KL (CUDA; runs on CPU under TRITON_INTERPRET=1 for tests).

Per chunk of C tokens (C fixed by the launch configuration, never by N; the last chunk is
zero-padded, so every launch has the same shape and a token's result does not depend on the rest of
the batch):

1. float32 logits z_s, z_t [C, V] and per-tile softmax statistics (max, sum of exp, and
   sum of exp * (a - b) for the student; max and sum of exp for the teacher) in a small
   [5, C, V/BLOCK_V] buffer. Two variants:
   - "fused": `_logits_stats_kernel`, one program per [BLOCK_M, BLOCK_V] tile computes both logit
     tiles with tensor-core dots (fp32 accumulators), stores them and the tile statistics; programs
     walk the M blocks of one vocab block back to back so each W tile is read from HBM once.
   - "cublas" (default for bf16/fp16 on CUDA: faster on an H200, see bench/results/kl_h200.json): the two
     logit GEMMs run in cuBLAS with float32 output (`torch.mm(..., out_dtype=torch.float32)`, never
     rounded to bf16) into preallocated buffers, and `_tile_stats_kernel` reads them back for the
     same statistics.
2. `_row_reduce_kernel`: combines the tile statistics in a fixed order into lse(a), E_p[a - b] and
   KL per token (online-softmax rescaling).
3. `_dlogits_kernel`: dlogits_s = c_i / T * p_s * ((a - b) - E_p[a - b]), in the student's dtype
   (float32 for fp16, whose range cannot hold them), into a [grad_group * C, V] buffer.
4. Once per `grad_group` chunks: dh_s = dlogits @ W_s and dW_s += dlogits.T @ h_s (cuBLAS, fixed
   shapes, no atomics, fixed order: deterministic). For bf16 inputs dW_s is a bf16 sum, rounded once
   per group (its error grows with the groups: 3.6e-3 for one, 1.7e-2 for 256 against float64).

Offsets are int32: `check_launch` refuses a chunk of C x V or a head of V x H elements at 2**31 or
more (they would wrap), and what CUDA's grid limits cannot launch.

Nothing of size [N, V] exists in HBM: the buffers hold C (logits) and grad_group * C (dlogits) rows.
Option `overlap`: steps 1b-3 of chunk i run on a second stream beside the logits GEMMs of chunk i+1
and the gradient GEMMs of the previous group (double-buffered logits and dlogits; same kernels,
shapes and order per buffer: bit-identical to the serial schedule). Measured slower than the serial
default on an H200 (bench/results/kl_h200.json): the cuBLAS kernels hold every SM, so the side kernels
only run in the gaps, and the double buffers force chunks of 512 tokens under the memory goal.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

N_STATS = 5  # max_a, sum exp(a - max_a), sum exp(a - max_a) * (a - b), max_b, sum exp(b - max_b)
CHUNK_BYTES_DEFAULT = 1280 * 2**20  # z_s, z_t (float32) and dlogits for one chunk of tokens
GRID_X_MAX, GRID_Y_MAX = 2**31 - 1, 65535  # CUDA's limits on a launch grid's first and second axes
OFFSET_MAX = 2**31 - 1  # the kernels' offsets are int32


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
    dl = tl.where(c != 0.0, dl, 0.0)  # a row outside the loss adds nothing, even where its logits are not finite
    tl.store(dl_ptr + row * stride_dl + offs, dl.to(dl_ptr.dtype.element_ty), mask=ok)


def default_config(dtype: torch.dtype, device: torch.device) -> dict:
    """Launch configuration; fixed per dtype (never per N), so results are batch invariant."""
    if device.type != "cuda":  # interpreter: small tiles keep it fast
        return dict(BLOCK_M=16, BLOCK_V=32, BLOCK_K=16, num_warps=4, num_stages=1, EW_BLOCK=64, variant="fused")
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_V=128, BLOCK_K=32, num_warps=8, num_stages=3, EW_BLOCK=2048, variant="fused")
    # Measured on an H200 (bench/results/kl_h200.json): cuBLAS logits GEMMs + Triton statistics beat the
    # fused Triton dual GEMM; BLOCK_M / BLOCK_V here are the statistics tiles. grad_group=2: the
    # gradient GEMMs run once per two chunks (K = 2048 for dW: half the read-add-write passes over dW).
    return dict(BLOCK_M=2, BLOCK_V=4096, BLOCK_K=64, num_warps=8, num_stages=4, EW_BLOCK=1024, variant="cublas",
                chunk_tokens=1024, grad_group=2)


def default_chunk_tokens(vocab_size: int, block_m: int, chunk_bytes: int = CHUNK_BYTES_DEFAULT) -> int:
    """Rows per chunk: z_s, z_t (4 B each) and dlogits (<= 4 B) per vocab entry, a multiple of block_m."""
    rows = chunk_bytes // (12 * vocab_size)
    return max(block_m, rows // block_m * block_m)


def check_launch(C: int, V: int, H: int, cfg: dict) -> None:
    """Refuse what the kernels cannot address or CUDA cannot launch: int32 offsets into a [C, V] chunk
    and a [V, H] head (each under 2**31 elements: past that they would wrap and read or write out of
    bounds), the dlogits grid's cdiv(V, EW_BLOCK) programs along its second axis (at most 65,535), the
    statistics grid's cdiv(C, BLOCK_M) * cdiv(V, BLOCK_V) along its first (at most 2**31 - 1)."""
    if C < 1:
        raise ValueError(f"kl_triton: chunk_tokens must be >= 1, got {C}")
    if (C + cfg["BLOCK_M"]) * V > OFFSET_MAX:
        raise ValueError(f"kl_triton: chunk_tokens {C} x vocabulary {V} passes the kernels' int32 offsets "
                         f"(2**31 elements); lower chunk_tokens below {OFFSET_MAX // V - cfg['BLOCK_M']}")
    if V * H > OFFSET_MAX:
        raise ValueError(f"kl_triton: an output head of {V} x {H} passes the kernels' int32 offsets (2**31 "
                         "elements); use the chunked backend")
    if triton.cdiv(V, cfg["EW_BLOCK"]) > GRID_Y_MAX:
        raise ValueError(f"kl_triton: vocabulary {V} / EW_BLOCK {cfg['EW_BLOCK']} needs more than {GRID_Y_MAX} "
                         "programs on the grid's second axis (CUDA's limit); raise EW_BLOCK")
    if triton.cdiv(C, cfg["BLOCK_M"]) * triton.cdiv(V, cfg["BLOCK_V"]) > GRID_X_MAX:
        raise ValueError(f"kl_triton: chunk_tokens {C} x vocabulary {V} in tiles of {cfg['BLOCK_M']} x "
                         f"{cfg['BLOCK_V']} needs more than {GRID_X_MAX} programs (CUDA's grid limit); "
                         "lower chunk_tokens")


def _mm_f32(a, b, out):
    """out = a @ b in float32 (cuBLAS float32 output: the product is never rounded to the input dtype)."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)  # CPU tests of the variant


def kl_and_grads(h_s, W_s, h_t, W_t, coef_N, temperature: float, need_grad: bool, *,
                 chunk_tokens: int | None = None, config: dict | None = None, grads_f32: bool = False):
    """Per-token KL [N] float32 and, if `need_grad`, gradients of sum_i coef_i * KL_i in the student's
    dtypes (`grads_f32` and fp16 inputs: float32, for a caller that scales them before the cast)."""
    cfg = dict(default_config(h_s.dtype, h_s.device), **(config or {}))
    C = chunk_tokens or cfg.get("chunk_tokens") or default_chunk_tokens(W_s.shape[0], cfg["BLOCK_M"])
    check_launch(C, W_s.shape[0], max(W_s.shape[1], W_t.shape[1]), cfg)
    h_s, W_s, h_t, W_t = (x.contiguous() for x in (h_s, W_s, h_t, W_t))
    run = _ChunkRunner(h_s, W_s, h_t, W_t, coef_N, temperature, need_grad, cfg, C, grads_f32)
    run.sweep()
    return run.result()


class _ChunkRunner:
    """Buffers and the three stages of one chunk of C tokens: logits, statistics + dlogits, gradient GEMMs."""

    def __init__(self, h_s, W_s, h_t, W_t, coef_N, temperature, need_grad, cfg, C, grads_f32=False):
        self.h_s, self.W_s, self.h_t, self.W_t, self.coef_N = h_s, W_s, h_t, W_t, coef_N
        self.need_grad, self.cfg, self.C = need_grad, cfg, C
        self.grads_f32 = grads_f32 and self.h_s.dtype == torch.float16  # fp16: float32 dlogits, float32 dh
        N, HS = h_s.shape
        V, dev = W_s.shape[0], h_s.device
        self.inv_T = 1.0 / float(temperature)
        self.interpreted = dev.type != "cuda"
        self.fused = cfg["variant"] == "fused"
        # overlap: double buffers and the pipelined order on any device, the second stream on CUDA only
        self.pipelined = bool(cfg.get("overlap")) and not self.fused
        self.overlap = self.pipelined and dev.type == "cuda"
        self.group = int(cfg.get("grad_group", 1))
        self.slots = 2 if self.pipelined else 1  # logits buffers and dlogits groups in flight
        self.nvb = triton.cdiv(V, cfg["BLOCK_V"])
        f32 = dict(dtype=torch.float32, device=dev)
        self.stats = torch.empty(N_STATS, C, self.nvb, **f32)
        self.kl_N = torch.empty(N, **f32)
        self.kl_C, self.lse_C, self.mean_C = (torch.empty(C, **f32) for _ in range(3))
        self.coef_C = torch.zeros(C, **f32)
        self.z = [(torch.empty(C, V, **f32), torch.empty(C, V, **f32)) for _ in range(self.slots)]
        self.dl, self.dh, self.dW = None, None, None
        if need_grad:
            # fp16 cannot hold dlogits (~c / V: subnormal): keep them and the dW sum in float32 for fp16
            self.dl_dtype = torch.float32 if h_s.dtype == torch.float16 else h_s.dtype
            self.dl = torch.empty(self.slots * self.group * C, V, dtype=self.dl_dtype, device=dev)
            self.dh = torch.empty(N, HS, dtype=torch.float32 if self.grads_f32 else h_s.dtype, device=dev)
            dW_dtype = torch.float32 if self.dl_dtype != W_s.dtype else W_s.dtype
            self.dW = torch.empty(V, HS, dtype=dW_dtype, device=dev)

    def _rows(self, x, t0, count=None):
        count = count or self.C
        rows = x[t0:t0 + count]
        if rows.shape[0] < count:  # pad the last chunk: every launch has the same shape
            rows = torch.cat([rows, rows.new_zeros(count - rows.shape[0], x.shape[1])])
        return rows

    def sweep(self):
        """All chunks: serial, or with statistics / dlogits on a second stream (`overlap`)."""
        C, P = self.C, self.group
        n_chunks = triton.cdiv(self.kl_N.shape[0], C)
        main = torch.cuda.current_stream() if self.overlap else None
        side = torch.cuda.Stream(device=self.h_s.device) if self.overlap else None
        done, pending = [None] * n_chunks, None
        for i in range(n_chunks):
            k = i % self.slots
            if self.overlap and i >= self.slots:
                main.wait_event(done[i - self.slots])  # the side stream has read logits slot k
            self.logits(i * C, k)
            base = (i // P) % self.slots * P * C  # first dlogits row of this chunk's group
            row = base + i % P * C
            if self.overlap:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    self.stats_and_dlogits(i * C, k, row)
                done[i] = side.record_event()
            else:
                self.stats_and_dlogits(i * C, k, row)
            if pending is not None:  # the previous group's gradient GEMMs, queued behind this chunk's logits
                self._flush(main, done, *pending)
                pending = None
            if i % P == P - 1 or i == n_chunks - 1:
                job = ((i - i % P) * C, i % P + 1, base, i)
                if self.pipelined:
                    pending = job
                else:
                    self.group_grads(*job[:-1])
        if pending is not None:
            self._flush(main, done, *pending)
        if self.overlap:
            main.wait_stream(side)

    def _flush(self, main, done, t_first, filled, base, last):
        if self.overlap:
            main.wait_event(done[last])
        self.group_grads(t_first, filled, base)

    def logits(self, t0, k):
        """float32 logits z_s, z_t [C, V] of the chunk into slot k; the fused kernel also writes the statistics."""
        cfg, C = self.cfg, self.C
        hs_c, ht_c = self._rows(self.h_s, t0), self._rows(self.h_t, t0)
        zs, zt = self.z[k]
        if not self.fused:  # "cublas": logits GEMMs in cuBLAS with float32 output
            _mm_f32(hs_c, self.W_s.T, zs)
            _mm_f32(ht_c, self.W_t.T, zt)
            return
        HS, HT, V = hs_c.shape[1], ht_c.shape[1], self.W_s.shape[0]
        BK = cfg["BLOCK_K"]
        precision = "ieee" if self.interpreted or torch.float32 in (hs_c.dtype, ht_c.dtype) else "tf32"
        grid = (triton.cdiv(C, cfg["BLOCK_M"]) * self.nvb,)
        _logits_stats_kernel[grid](
            hs_c, self.W_s, ht_c, self.W_t, zs, zt, self.stats, C, V, HS, HT,
            hs_c.stride(0), self.W_s.stride(0), ht_c.stride(0), self.W_t.stride(0), zs.stride(0),
            self.stats.stride(0), self.stats.stride(1), self.inv_T,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_V=cfg["BLOCK_V"], BLOCK_K=BK, EVEN_K=HS % BK == 0 and HT % BK == 0,
            PRECISION=precision, DOT_F32=self.interpreted, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    def stats_and_dlogits(self, t0, k, row):
        """Per-token lse, E_p[a - b] and KL of the chunk in slot k; its dlogits into rows row:row + C."""
        cfg, C, st, V = self.cfg, self.C, self.stats, self.W_s.shape[0]
        n = min(C, self.kl_N.shape[0] - t0)
        zs, zt = self.z[k]
        if not self.fused:
            grid = (triton.cdiv(C, cfg["BLOCK_M"]) * self.nvb,)
            _tile_stats_kernel[grid](zs, zt, st, C, V, zs.stride(0), st.stride(0), st.stride(1), self.inv_T,
                                     BLOCK_M=cfg["BLOCK_M"], BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"])
        _row_reduce_kernel[(C,)](st, self.kl_C, self.lse_C, self.mean_C, self.nvb, st.stride(0), st.stride(1),
                                 BLOCK=256)
        self.kl_N[t0:t0 + n] = self.kl_C[:n]
        if not self.need_grad:
            return
        self.coef_C.zero_()
        self.coef_C[:n] = self.coef_N[t0:t0 + n] * self.inv_T
        dl = self.dl[row:row + C]
        _dlogits_kernel[(C, triton.cdiv(V, cfg["EW_BLOCK"]))](
            zs, zt, dl, self.lse_C, self.mean_C, self.coef_C, V, zs.stride(0), dl.stride(0), self.inv_T,
            BLOCK=cfg["EW_BLOCK"], num_warps=4 if self.interpreted else 8)

    def group_grads(self, t_first, filled: int, base: int):
        """Gradient GEMMs over the `group` chunks from token t_first, dlogits from buffer row `base`
        (always group * C rows: slots no chunk filled are zeroed, so every launch has the same shape)."""
        if not self.need_grad:
            return
        rows = self.group * self.C
        if filled < self.group:
            self.dl[base + filled * self.C:base + rows].zero_()
        n = min(rows, self.kl_N.shape[0] - t_first)  # the valid rows are a prefix of the group
        _grad_gemms(self.dl[base:base + rows], self.W_s, self._rows(self.h_s, t_first, rows),
                    self.dh[t_first:t_first + n], self.dW, first=t_first == 0)

    def result(self):
        if not self.need_grad:
            return self.kl_N, None, None
        return self.kl_N, self.dh, self.dW if self.grads_f32 else self.dW.to(self.W_s.dtype)


def _grad_gemms(dl_CV, W_s, hs_c, dh_out, dW_VH, first: bool, slice_vocab: int = 16384):
    """dh_out = (dl @ W_s)[:n] and dW (+)= dl.T @ h, in cuBLAS with fixed shapes (no atomics).

    When dl is float32 and the weights are not (fp16 inputs), W and h are upcast one vocab slice at a
    time and dW is a float32 sum.
    """
    n = dh_out.shape[0]
    if dl_CV.dtype == W_s.dtype:
        if n == dl_CV.shape[0]:
            torch.mm(dl_CV, W_s, out=dh_out)
        else:
            dh_out.copy_((dl_CV @ W_s)[:n])
        if first:
            torch.mm(dl_CV.T, hs_c, out=dW_VH)
        else:
            dW_VH.addmm_(dl_CV.T, hs_c)
        return
    h32 = hs_c.float()
    dh32 = torch.zeros(dl_CV.shape[0], W_s.shape[1], dtype=torch.float32, device=dl_CV.device)
    for v0 in range(0, W_s.shape[0], slice_vocab):
        v1 = min(W_s.shape[0], v0 + slice_vocab)
        dh32.addmm_(dl_CV[:, v0:v1], W_s[v0:v1].float())
        if first:
            torch.mm(dl_CV[:, v0:v1].T, h32, out=dW_VH[v0:v1])
        else:
            dW_VH[v0:v1].addmm_(dl_CV[:, v0:v1].T, h32)
    dh_out.copy_(dh32[:n])
