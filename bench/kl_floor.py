"""The time no exact full-vocabulary reverse KL can beat on this GPU, measured in the benchmark's run.

Any exact method does the four GEMMs (student and teacher logits, dh, dW: 8*N*H*V FLOPs). The
gradient at vocab entry k of token i, c_i / T * p_ik * ((a - b)_ik - E_p[a - b]_i), needs the row's
lse and E_p[a - b], known only once all V entries of the row have been seen. So after the row
statistics the logits are either read back (both float32, since rounding them to bf16 is not allowed:
8 bytes per entry and token) or rebuilt (two more GEMMs). The cheaper of the two gives the floor:

    floor_ms = (the four GEMMs done the fastest way measured: each product in cuBLAS' faster layout
                with bf16 output at full batch, or the benchmark's own schedules)
             + 2 * N * V * 4 bytes at the measured HBM read rate

Everything else (writing the logits, the statistics, writing dlogits) is counted as free, and so are
every launch and gap: the floor is a bound, not an estimate. A speed goal below it cannot be met
without GEMMs faster than cuBLAS on the same chip, or a kernel that runs the read concurrently with
tensor-core work at cuBLAS speed (the floor adds the two).
"""
from __future__ import annotations


def gpu_ms(fn, reps: int = 3, warmup: int = 1) -> float:
    """Mean GPU time of fn() over `reps` back-to-back calls (CUDA events), after `warmup` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def hbm_read_tb_s(gib: int = 4) -> dict:
    """Read bandwidth of the GPU's memory: a sum and a max over `gib` GiB of float32 (the better counts)."""
    import torch

    x = torch.ones(gib * 2**28, device="cuda")
    out = {}
    for name, fn in (("sum", lambda: x.sum()), ("amax", lambda: x.amax())):
        out[f"{name}_tb_s"] = x.numel() * 4 / (gpu_ms(fn, reps=10, warmup=2) / 1e3) / 1e12
    del x
    torch.cuda.empty_cache()
    out["used_tb_s"] = max(out["sum_tb_s"], out["amax_tb_s"])
    return out


def gemm_best(x) -> dict:
    """Each of the four products at full batch, bf16 output, in both operand layouts; the faster counts.

    x = (h_s, W_s, h_t, W_t); the dlogits operand is a bf16 [N, V] tensor of small values.
    """
    import torch

    h_s, W_s, h_t, W_t = (t.detach() for t in x)
    N, H = h_s.shape
    V = W_s.shape[0]
    dl = (torch.randn(N, V, device="cuda") * 1e-5).to(torch.bfloat16)
    products = {
        "logits_s": (lambda: h_s @ W_s.T, lambda: W_s @ h_s.T),
        "logits_t": (lambda: h_t @ W_t.T, lambda: W_t @ h_t.T),
        "dh": (lambda: dl @ W_s, lambda: W_s.T @ dl.T),
        "dW": (lambda: dl.T @ h_s, lambda: h_s.T @ dl),
    }
    out, total = {}, 0.0
    for name, (plain, transposed) in products.items():
        ms = (gpu_ms(plain), gpu_ms(transposed))
        out[f"{name}_ms"] = dict(plain=ms[0], transposed=ms[1])
        total += min(ms)
    del dl
    torch.cuda.empty_cache()
    out["best_total_ms"] = total
    out["best_total_tflops"] = 8 * N * H * V / total / 1e9
    return out


def floor(N: int, V: int, gemm_ms: dict, hbm: dict) -> dict:
    """The bound of the module docstring: the fastest measured way to do the four GEMMs (`gemm_ms`:
    name -> ms, e.g. `gemm_best` and the benchmark's own schedules) plus one read of the float32
    logits at the `hbm_read_tb_s` rate."""
    fastest = min(gemm_ms, key=gemm_ms.get)
    reread_ms = 2 * N * V * 4 / (hbm["used_tb_s"] * 1e12) * 1e3
    return dict(gemm_ms=gemm_ms[fastest], gemm_from=fastest, logits_reread_ms=reread_ms,
                floor_ms=gemm_ms[fastest] + reread_ms)
