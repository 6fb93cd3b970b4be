"""Full-vocabulary reverse KL: forward+backward time and peak extra memory against named baselines.

On CUDA (the shape of the targets: bf16, V = 129,280, H = 4,096, N in {4,096, 16,384}):
- `eager`: PyTorch with materialised logits (bf16 GEMM output, log-softmax in fp32);
- `compile`: `torch.compile` of the same function;
- `liger`: Liger-Kernel's `LigerFusedLinearJSD(jsd_beta=1.0)` (reverse KL), where installed;
- `ours`: `distill.reverse_kl` (fused Triton path), after trying a few launch configurations (`tune`);
- the GEMM roofline 8*N*H*V FLOPs (two logit GEMMs, dX, dW) at the measured bf16 GEMM rate (the
  better of the same-shape logits GEMM and an 8192^3 product);
- `gemm_only`: our cuBLAS GEMMs alone, back to back (and the full-batch bf16 ones eager / compile run),
  `logits_gemm_sm_carveout`: the logits GEMM with SMs left free for a second stream, and `analysis`:
  what each speed goal leaves for the softmax passes once the GEMMs are paid;
- `floor` (bench/kl_floor.py): the time no exact method beats here (the four products in cuBLAS'
  faster layout plus one read of the float32 logits at the measured HBM rate), and per goal whether it
  lies below that floor (`analysis`).
Gradient accuracy: relative L2 error of dh and dW against the fp64 reference (bf16 inputs, N = 1,024).
Peak extra memory: max allocated during one forward+backward minus what was allocated before it.

On a machine without CUDA it runs a small-shape version (chunked torch path against eager) and says so.

    python -m bench.kl --json [--out bench/results/kl.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

GIB = 2**30


def _log(msg: str) -> None:
    print(f"[bench.kl {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


from bench._device import cpu_name as _cpu_name, run_meta  # noqa: E402
from bench import kl_floor  # noqa: E402
from bench.kl_floor import gpu_ms as _gpu_ms  # noqa: E402


def eager_loss(h_s, W_s, h_t, W_t):
    """The baseline everybody writes: materialise both logits, log-softmax in fp32, mean KL."""
    import torch

    logp_s = torch.log_softmax((h_s @ W_s.T).float(), dim=-1)
    logp_t = torch.log_softmax((h_t @ W_t.T).float(), dim=-1)
    return (logp_s.exp() * (logp_s - logp_t)).sum(dim=-1).mean()


def _inputs(N, V, H, dtype, device, seed=0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=g, device=device, dtype=torch.float32)
    h_s = (torch.randn(N, H, **kw) / H**0.25).to(dtype)
    W_s = (torch.randn(V, H, **kw) / H**0.25).to(dtype)
    h_t = (0.5 * torch.randn(N, H, **kw) / H**0.25 + h_s.float()).to(dtype)
    W_t = (0.5 * torch.randn(V, H, **kw) / H**0.25 + W_s.float()).to(dtype)
    return h_s.requires_grad_(True), W_s.requires_grad_(True), h_t, W_t


def _fwd_bwd(fn, x):
    x[0].grad = None
    x[1].grad = None
    loss = fn(*x)
    loss.backward()
    return loss


def _time_cuda(fn, x, warmup: int, reps: int) -> dict:
    import torch

    for _ in range(warmup):
        _fwd_bwd(fn, x)
    torch.cuda.synchronize()
    x[0].grad = None
    x[1].grad = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _fwd_bwd(fn, x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(reps):
        x[0].grad = None
        x[1].grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _fwd_bwd(fn, x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return dict(ms=statistics.median(times), ms_min=min(times), peak_extra_gib=peak / GIB, reps=reps)


def _gemm_rate_tflops(N, V, H) -> dict:
    import torch

    def rate(a, b, flops):
        return flops / (_gpu_ms(lambda: a @ b, reps=10, warmup=3) / 1e3) / 1e12

    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g)
    W = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g)
    same_shape = rate(h, W.T, 2 * N * H * V)
    del h, W
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    square = rate(a, b, 2 * 8192**3)
    return dict(logits_gemm_tflops=same_shape, square_8192_tflops=square, used_tflops=max(same_shape, square))


def _grad_errors(V, H, N, device, fns: dict) -> dict:
    import torch

    from distill.kl_reference import reverse_kl_reference

    x = _inputs(N, V, H, torch.bfloat16, device, seed=7)
    _, ref_h, ref_W = reverse_kl_reference(*x, rows_per_slice=256)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    out = {}
    for name, fn in fns.items():
        try:
            _fwd_bwd(fn, x)
            out[name] = dict(rel_err_dh=rel(x[0].grad, ref_h), rel_err_dW=rel(x[1].grad, ref_W))
            out[name]["max"] = max(out[name]["rel_err_dh"], out[name]["rel_err_dW"])
        except Exception as exc:  # a baseline that fails is recorded, not fatal
            out[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    return out


def _liger_fn():
    try:
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"[:300]
    mod = LigerFusedLinearJSD(jsd_beta=1.0)
    return (lambda h_s, W_s, h_t, W_t: mod(h_s, W_s, h_t, W_t, None)), None


FUSED = dict(variant="fused", BLOCK_M=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=4)
STATS = dict(variant="cublas", BLOCK_M=8, BLOCK_V=1024, num_warps=8)
TUNE_CANDIDATES = [
    dict(FUSED, chunk_tokens=1024, grad_group=1),
    dict(STATS, chunk_tokens=1024, grad_group=2),
    dict(STATS, BLOCK_M=2, BLOCK_V=4096, EW_BLOCK=1024, chunk_tokens=1024, grad_group=4),
    dict(STATS, BLOCK_M=2, BLOCK_V=4096, EW_BLOCK=1024, chunk_tokens=512, grad_group=4),
    dict(STATS, BLOCK_M=2, BLOCK_V=4096, EW_BLOCK=1024, chunk_tokens=1280, grad_group=2),
    # two streams: double-buffered logits only fit the memory goal with chunks of 512 tokens
    dict(STATS, BLOCK_M=2, BLOCK_V=4096, EW_BLOCK=1024, chunk_tokens=512, grad_group=4, overlap=True),
]
TIMING_KEYS = ("ms", "ms_min", "peak_extra_gib", "reps")


def _gemm_floor(x, C: int = 1024, R: int = 2048) -> dict:
    """GPU time of the GEMMs alone (8*N*H*V FLOPs, no softmax work), back to back as in a real run:
    our schedule (float32-output logits per C tokens, dh / dW per R tokens, as ours_default) and the
    full-batch one that eager / torch.compile run (bf16 [N, V] logits, two backward GEMMs)."""
    import torch

    h_s, W_s, h_t, W_t = (t.detach() for t in x)
    N, H = h_s.shape
    V = W_s.shape[0]
    z = torch.empty(C, V, device="cuda")
    dl = (torch.randn(R, V, device="cuda") * 1e-5).to(torch.bfloat16)
    dW = torch.empty(V, H, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(N, H, device="cuda", dtype=torch.bfloat16)

    def ours():
        for t0 in range(0, N, C):
            torch.mm(h_s[t0:t0 + C], W_s.T, out_dtype=torch.float32, out=z)
            torch.mm(h_t[t0:t0 + C], W_t.T, out_dtype=torch.float32, out=z)
        for t0 in range(0, N, R):
            torch.mm(dl, W_s, out=dh[t0:t0 + R])
            (torch.mm(dl.T, h_s[:R], out=dW) if t0 == 0 else dW.addmm_(dl.T, h_s[t0:t0 + R]))

    out = dict(ours_schedule_ms=_gpu_ms(ours, reps=3))
    del z, dl
    torch.cuda.empty_cache()

    def full():
        zs = h_s @ W_s.T
        zt = h_t @ W_t.T
        del zt
        torch.mm(zs, W_s, out=dh)
        torch.mm(zs.T, h_s, out=dW)

    out["full_batch_bf16_ms"] = _gpu_ms(full, reps=3)
    out["ours_schedule_tflops"] = 8 * N * H * V / out["ours_schedule_ms"] / 1e9
    return out


def _carveout_cost(V, H, C: int = 1024) -> dict:
    """One float32-output logits GEMM [C, H] x [H, V] (cuBLASLt) with SMs left free for concurrent
    kernels (torch._C._set_sm_carveout_experimental): what overlapping the softmax passes would cost."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(2)
    h = torch.randn(C, H, device="cuda", dtype=torch.bfloat16, generator=g)
    W = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g)
    z = torch.empty(C, V, device="cuda")
    lib, carve = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    out = {}
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        for free in (None, 8, 16, 32):
            torch._C._set_sm_carveout_experimental(free)
            out[f"free_sms_{free or 0}_ms"] = _gpu_ms(lambda: torch.mm(h, W.T, out_dtype=torch.float32, out=z),
                                                       reps=20, warmup=3)
    finally:
        torch.backends.cuda.preferred_blas_library(lib)
        torch._C._set_sm_carveout_experimental(carve)
    return out


def _ours_fn(config=None):
    from distill import reverse_kl

    def fn(h_s, W_s, h_t, W_t):
        return reverse_kl(h_s, W_s, h_t, W_t, triton_config=config)

    return fn


def _profile(fn, x, top: int = 14) -> dict:
    """GPU time per kernel name over one forward+backward (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    _fwd_bwd(fn, x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _fwd_bwd(fn, x)
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t:
            rows.append(dict(kernel=evt.key[:120], calls=evt.count, ms=t / 1e3))
    rows.sort(key=lambda r: -r["ms"])
    out = dict(kernels=rows[:top])
    try:  # GPU timeline: busy time, span, and the largest idle gaps between kernels
        kern = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if str(getattr(e, "device_type", "")).endswith("CUDA")), key=lambda k: k[0])
        gaps, busy, last_end, last_name = [], 0.0, None, None
        for start, end, name in kern:
            busy += end - start
            if last_end is not None and start > last_end:
                gaps.append(dict(us=start - last_end, after=last_name[:60], before=name[:60]))
            if last_end is None or end > last_end:
                last_end, last_name = end, name
        gaps.sort(key=lambda g: -g["us"])
        out.update(busy_ms=busy / 1e3, span_ms=(last_end - kern[0][0]) / 1e3 if kern else None,
                   idle_ms=sum(g["us"] for g in gaps) / 1e3, largest_gaps=gaps[:8])
    except Exception as exc:
        out["timeline_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def run_cuda(quick: bool, profile: bool = False, tune: bool = True) -> dict:
    import torch

    V, H = 129280, 4096
    Ns = [4096] if quick else [4096, 16384]
    res = dict(device=f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})",
               cpu_run=False, shape=dict(V=V, H=H, dtype="bfloat16", N=Ns), results={}, tune={})
    try:
        import triton

        res["device"] += f", triton {triton.__version__}"
    except ImportError:
        pass
    liger, liger_err = _liger_fn()
    if liger_err:
        res["liger_error"] = liger_err
    else:
        from importlib.metadata import version

        res["liger_version"] = version("liger-kernel")
    _log("GEMM rate, HBM read rate")
    res["gemm"] = _gemm_rate_tflops(Ns[-1], V, H)
    res["hbm_read"] = kl_floor.hbm_read_tb_s()
    torch.cuda.empty_cache()
    compiled = torch.compile(eager_loss, dynamic=False)
    for N in Ns:
        x = _inputs(N, V, H, torch.bfloat16, "cuda")
        row, best_cfg = {}, None
        if tune:  # the winner within the memory goal is reported as ours_tuned
            trials = []
            for cand in TUNE_CANDIDATES:
                try:
                    m = _time_cuda(_ours_fn(cand), x, warmup=2, reps=5)
                    trials.append(dict(cand, **m))
                    _log(f"N={N} tune {cand}: {m['ms']:.1f} ms, {m['peak_extra_gib']:.2f} GiB")
                except Exception as exc:
                    trials.append(dict(cand, error=f"{type(exc).__name__}: {exc}"[:300]))
                    _log(f"N={N} tune {cand}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                torch.cuda.empty_cache()
            res["tune"][str(N)] = trials
            ok = [t for t in trials if "ms" in t and t["peak_extra_gib"] <= 3.4]
            if ok:
                best_cfg = {k: v for k, v in min(ok, key=lambda t: t["ms"]).items() if k not in TIMING_KEYS}
        fns = dict(ours_default=_ours_fn(), eager=eager_loss, compile=compiled)
        if best_cfg:
            fns["ours_tuned"] = _ours_fn(best_cfg)
        if liger:
            fns["liger"] = liger
        for name, fn in fns.items():
            try:
                row[name] = _time_cuda(fn, x, warmup=3 if name == "compile" else 2, reps=10)
                _log(f"N={N} {name}: {row[name]['ms']:.1f} ms, {row[name]['peak_extra_gib']:.2f} GiB")
            except Exception as exc:
                row[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
                _log(f"N={N} {name}: FAILED {row[name]['error']}")
            torch.cuda.empty_cache()
        row["ours_tuned_config"] = best_cfg
        row["roofline_ms"] = 8 * N * H * V / (res["gemm"]["used_tflops"] * 1e12) * 1e3
        try:
            row["gemm_only"] = _gemm_floor(x)
            _log(f"N={N} GEMMs alone: {row['gemm_only']}")
        except Exception as exc:
            row["gemm_only"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
        torch.cuda.empty_cache()
        try:
            products = kl_floor.gemm_best(x)
            gemm_ms = dict(products_best_layout=products["best_total_ms"])
            gemm_ms.update((k, v) for k, v in row.get("gemm_only", {}).items() if k.endswith("_ms"))
            row["floor"] = dict(kl_floor.floor(N, V, gemm_ms, res["hbm_read"]), products=products)
            _log(f"N={N} floor: {row['floor']}")
        except Exception as exc:
            row["floor"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
        torch.cuda.empty_cache()
        if profile and N == Ns[-1]:
            row["profile_ours_default"] = _profile(_ours_fn(), x)
        res["results"][str(N)] = row
        del x
        torch.cuda.empty_cache()
    try:
        res["logits_gemm_sm_carveout"] = _carveout_cost(V, H)
    except Exception as exc:
        res["logits_gemm_sm_carveout"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    res["analysis"] = _analysis(res, Ns)
    _log("gradient errors vs fp64")
    grad_fns = dict(ours=_ours_fn(), eager=eager_loss)
    if liger:
        grad_fns["liger"] = liger
    res["grad_error_vs_fp64"] = _grad_errors(V, H, 1024, "cuda", grad_fns)
    res["targets"] = _targets(res, Ns)
    return res


def _analysis(res, Ns) -> dict:
    """Why the speed targets stand where they do, from the figures above: ours minus the GEMMs alone
    (the softmax passes), and the time each speed target allows against the GEMMs alone."""
    out = {}
    for N in Ns:
        row = res["results"].get(str(N), {})
        ours, gemms = row.get("ours_default", {}).get("ms"), row.get("gemm_only", {}).get("ours_schedule_ms")
        if ours is None or gemms is None:
            continue
        a = dict(ours_ms=ours, gemm_only_ms=gemms, softmax_passes_ms=ours - gemms)
        bound = row.get("floor", {}).get("floor_ms")  # bench/kl_floor.py: no serial exact schedule is faster
        if bound is not None:
            a["exact_floor_ms"] = bound
        for base, goal in (("compile", 1.15), ("liger", 1.7)):
            b = row.get(base, {}).get("ms")
            if b is not None:
                a[f"{base}_goal_ms"] = b / goal  # ours must take at most this
                a[f"{base}_goal_left_for_passes_ms"] = b / goal - gemms
                if bound is not None:
                    a[f"{base}_goal_below_exact_floor"] = b / goal < bound
        out[str(N)] = a
    return out


def _targets(res, Ns) -> dict:
    def ms(N, name):
        return res["results"].get(str(N), {}).get(name, {}).get("ms")

    def entry(value, goal, ok):
        return dict(value=value, goal=goal, met=bool(value is not None and ok(value)))

    def ratio(N, base):
        a, b = ms(N, base), ms(N, "ours_default")
        return None if a is None or b is None else a / b

    big = Ns[-1]
    peak = res["results"].get(str(big), {}).get("ours_default", {}).get("peak_extra_gib")
    roof = res["results"].get(str(big), {}).get("roofline_ms")
    ours_big = ms(big, "ours_default")
    err = res["grad_error_vs_fp64"].get("ours", {}).get("max")
    return {
        "vs_compile_n4096": entry(ratio(4096, "compile"), ">= 1.15", lambda v: v >= 1.15),
        "vs_compile_n16384": entry(ratio(16384, "compile"), ">= 1.15", lambda v: v >= 1.15),
        "vs_liger_n16384": entry(ratio(16384, "liger"), ">= 1.7", lambda v: v >= 1.7),
        "roofline_fraction_n16384": entry(None if big != 16384 or not ours_big else roof / ours_big,
                                          ">= 0.85", lambda v: v >= 0.85),
        "peak_extra_gib_n16384": entry(peak if big == 16384 else None, "<= 3.4", lambda v: v <= 3.4),
        "rel_grad_err_vs_fp64": entry(err, "<= 1e-2 (bf16 inputs)", lambda v: v <= 1e-2),
    }


def run_cpu() -> dict:
    import torch

    from distill import reverse_kl

    V, H = 8192, 256
    res = dict(device=_cpu_name(), cpu_run=True,
               note="CPU run: small shapes, chunked torch path vs eager; the speed and memory targets "
                    "apply to the H200 run only (bench/results/kl_h200.json)",
               shape=dict(V=V, H=H, dtype="float32", N=[256, 1024]), results={})
    for N in (256, 1024):
        x = _inputs(N, V, H, torch.float32, "cpu")
        row = {}
        for name, fn in (("eager", eager_loss), ("ours_chunked", reverse_kl)):
            _fwd_bwd(fn, x)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                _fwd_bwd(fn, x)
                times.append((time.perf_counter() - t0) * 1e3)
            row[name] = dict(ms=statistics.median(times))
        row["speedup_vs_eager"] = row["eager"]["ms"] / row["ours_chunked"]["ms"]
        row["logits_bytes_eager_gib"] = 2 * N * V * 4 / GIB
        res["results"][str(N)] = row
    grad = _grad_errors(V, H, 256, "cpu", dict(ours=reverse_kl, eager=eager_loss))
    res["grad_error_vs_fp64"] = grad
    err = grad["ours"].get("max")
    res["targets"] = {"rel_grad_err_vs_fp64": dict(value=err, goal="<= 1e-2", met=bool(err is not None and err <= 1e-2))}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="postrain bench kl", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (default)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--quick", action="store_true", help="CUDA: N = 4,096 only")
    p.add_argument("--profile", action="store_true", help="CUDA: add a per-kernel time table of ours")
    p.add_argument("--no-tune", action="store_true", help="CUDA: skip trying launch configurations")
    args = p.parse_args(argv)
    import torch

    res = run_cuda(args.quick, args.profile, not args.no_tune) if torch.cuda.is_available() else run_cpu()
    res["date_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res["meta"] = run_meta(res.get("device"))
    text = json.dumps(res, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
