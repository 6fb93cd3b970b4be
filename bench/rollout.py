"""Rollout benchmark: engine decode vs Hugging Face `generate`, resume by KV restore vs re-prefill,
WAL commit overhead per decode step. Prints one JSON object.

Baselines measured in the same run: HF `generate` on the same model, batch and lengths (sampling,
no early stop); re-prefill of the same committed tokens; the same decode loop without the WAL.
CPU: the tiny policy (PolicyConfig defaults). GPU (when CUDA is present, or --gpu): a ~0.5B
Qwen2-style config with random weights in bf16, batch 64, prompt 128, 256 new tokens, resume up to 32k.

    python -m bench.rollout --json [--quick] [--out FILE] [--gpu-only]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench._device import run_meta

GPU_DECODE_CHUNK = 32  # the chunked decoder's steps per device launch in the GPU section
GOALS = {
    "engine_vs_hf_generate_cpu": (">= 1", lambda v: v >= 1),
    "engine_vs_hf_static_compile_h200_b64": (">= 1.5 (tokens/s, our best decode mode over HF generate's best: eager "
                                             "dynamic cache or static cache + torch.compile; median of 3 runs each)",
                                             lambda v: v >= 1.5),
    "reprefill_vs_kv_restore_cold_32k": (">= 3 (re-prefill time over a resume from the snapshot, its page cache "
                                         "dropped first; medians of 5)", lambda v: v >= 3),
    "wal_overhead_share_b64_h200": ("<= 0.02 (median over 7 paired rounds; see gpu.wal.median_interval)",
                                    lambda v: v <= 0.02),
}


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _prompts(B, P, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (B, P), generator=g).tolist()  # ids 0..2 are pad/eos/unk in the char vocab


def engine_tps(model, tok, prompts, N, device, strict=False, reps=1, static=False, fp=None, stat=min, **engine_kw):
    """Our engine's tokens/s over `prompts` (`engine_kw`: e.g. decode_chunk, compile_decode); the warm-up
    decodes the full batch once (a compiled chunk decoder compiles there)."""
    from rollout.engine import Engine
    from rollout.sampling import SamplingParams

    B, P = len(prompts), len(prompts[0])
    params = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True)
    eng = Engine(model, tok, seed=0, max_batch=B, max_len=P + N + 8, strict=strict, device=device,
                 static_decode=static, fingerprint=fp, **engine_kw)
    warm = SamplingParams(max_new_tokens=min(N, 40), ignore_eos=True)
    eng.generate(prompts if engine_kw else [p[:8] for p in prompts[:2]], warm, [f"w{i}" for i in range(B)])
    times, out = [], None
    for r in range(reps):
        _sync(device)
        t = time.perf_counter()
        out = eng.generate(prompts, params, [f"t{i}" for i in range(B)])  # same ids: same draws every rep
        _sync(device)
        times.append(time.perf_counter() - t)
    return B * N / stat(times), [s.tokens for s in out], eng


def hf_tps(model, tok, prompts, N, device, reps=1, static=False, stat=min):
    """HF `generate` tokens/s. static=True: `cache_implementation="static"` with the forward under
    torch.compile (HF's CompileConfig defaults: fullgraph, reduce-overhead), warmed up at the measured
    shapes first so compilation is not timed."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=N, min_new_tokens=N,
              pad_token_id=tok.pad_token_id if tok is not None else 0)
    if static:
        from transformers.generation import CompileConfig

        kw.update(cache_implementation="static", compile_config=CompileConfig())
    with torch.inference_mode():
        if static:
            model.generate(ids, attention_mask=mask, **kw)  # compile at the measured shapes
            model.generate(ids, attention_mask=mask, **kw)
        else:
            model.generate(ids[:2, :8], attention_mask=mask[:2, :8], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        times = []
        for _ in range(reps):
            _sync(device)
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **kw)
            _sync(device)
            times.append(time.perf_counter() - t)
    if out.shape[1] != ids.shape[1] + N:
        raise RuntimeError(f"HF generate stopped early: {out.shape[1] - ids.shape[1]} of {N} tokens")
    return len(prompts) * N / stat(times)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where two decodes of the same requests agree (up to the first divergence each)."""
    same = total = 0
    for x, y in zip(a, b):
        total += len(x)
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same / max(1, total)


def _fit(policy) -> list[float] | None:
    """The split policy's line through its heads' prefills ([fixed ms, us per token]), None where it had none."""
    from rollout.restore import affine_fit

    fit = affine_fit(list(policy.prefills))
    return None if fit is None else [round(fit[0] * 1e3, 3), round(fit[1] * 1e6, 3)]


def resume_latency(model, tok, ctx, device, store_dir, reps=5, fp=None):
    """Seconds to bring a trajectory of `ctx` committed tokens back: a resume from its snapshot as the worker
    makes it (`rollout.restore.resume`: the head re-prefilled while the tail is read, split where the rates
    this process measured say both take as long; its first resume, with nothing measured, splits in the
    middle), the whole snapshot read (no split), and re-prefill of the same tokens. Restores are timed
    cold (the snapshot's pages evicted first, as after a restart elsewhere) and warm (just resumed: a split
    resume leaves only the tails in the page cache, so the next one splits again); one
    split policy for all rounds of a context, as one worker keeps its own; medians of `reps`."""
    from bench._device import drop_page_cache
    from rollout import restore, snapshot
    from rollout.engine import Engine
    from rollout.sampling import SamplingParams
    from rollout.snapshot import SnapshotStore, encode

    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    V = model.config.vocab_size
    tokens = _prompts(1, ctx, V, seed=ctx)[0]
    sampled = [False] * (ctx - 4) + [True] * 4  # the last tokens were sampled: resume point is ctx-1
    eng = Engine(model, tok, seed=0, max_batch=1, max_len=ctx + 16, device=device, fingerprint=fp)
    eng.add("r", tokens, sampled, params)
    kv, covered = eng.export_kv("r")
    store = SnapshotStore(store_dir)
    store.put("r", encode("r", tokens[:covered], kv, eng.version, eng.fingerprint))
    del kv
    eng.remove("r")
    split, whole = restore.SplitPolicy(), restore.SplitPolicy(enabled=False)
    # the split with the Python readers too, where the C reader is built: what reading without the GIL gives
    split_py = restore.SplitPolicy() if snapshot._kvread is not None else None
    t: dict[str, list[float]] = {k: [] for k in ("split_cold", "split_warm", "whole_cold", "whole_warm", "reprefill", "disk",
                                                 "split_py_cold", "split_py_warm")}
    heads: list[int] = []

    def timed(policy) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with _reader("python" if policy is split_py else "c"):
            r = restore.resume(eng, store, policy, "r", tokens, sampled, params)
        _sync(device)
        dt = time.perf_counter() - t0
        recomputed = r.rejected == restore.RECOMPUTE  # the policy found a prefill of all quicker than a read
        if not recomputed and (r.rejected or r.kv_tokens + r.head_tokens != covered):
            raise RuntimeError(f"resume did not restore the snapshot: {r}")
        eng.remove("r")
        if policy is split:
            heads.append(covered if recomputed else r.head_tokens)
        return dt

    for i in range(reps):
        drop_page_cache(store_dir)
        t["disk"].append(_read_cold_s(store.path("r")))
        order = [("split", split), ("whole", whole)] + ([("split_py", split_py)] if split_py is not None else [])
        for name, policy in order[i % len(order):] + order[:i % len(order)]:  # each goes first in turn
            drop_page_cache(store_dir)
            t[f"{name}_cold"].append(timed(policy))
            t[f"{name}_warm"].append(timed(policy))
        _sync(device)
        t0 = time.perf_counter()
        eng.add("r", tokens, sampled, params)
        _sync(device)
        t["reprefill"].append(time.perf_counter() - t0)
        eng.remove("r")
    probe = _fixed_split_probe(eng, store, tokens, sampled, params, covered, device, store_dir, reps)
    snap_mb = len(store.get("r")) / 2**20
    med = statistics.median
    return {"context": ctx, "snapshot_mb": round(snap_mb, 1), "reps": reps,
            "kv_restore_cold_s_median": med(t["split_cold"]), "kv_restore_warm_s_median": med(t["split_warm"]),
            "reprefill_s_median": med(t["reprefill"]), "ratio_cold_median": med(t["reprefill"]) / med(t["split_cold"]),
            "ratio_warm_median": med(t["reprefill"]) / med(t["split_warm"]),
            "split_head_tokens": heads, "split_policy": {"prefill_us_per_token": _us(split.prefill_s_per_token),
                                                         "read_us_per_mb_cold": _us(split.read_s_per_byte[False], 2**20),
                                                         "read_us_per_mb_warm": _us(split.read_s_per_byte[True], 2**20),
                                                         "prefill_fit_fixed_ms_us_per_token": _fit(split),
                                                         "prefills_tokens_ms": [[n, round(sec * 1e3, 2)] for n, sec in split.prefills],
                                                         "alone_tokens_ms": [[n, round(sec * 1e3, 2)] for n, sec in split.alone]},
            "whole_restore_cold_s_median": med(t["whole_cold"]), "whole_restore_warm_s_median": med(t["whole_warm"]),
            "ratio_whole_cold_median": med(t["reprefill"]) / med(t["whole_cold"]),
            "kv_restore_cold_s_all": t["split_cold"], "whole_restore_cold_s_all": t["whole_cold"],
            "reprefill_s_all": t["reprefill"],
            "fixed_split": probe,
            "kv_reader": "c" if split_py is not None else "python",
            "split_python_readers_cold_s_median": med(t["split_py_cold"]) if split_py else None,
            "split_python_readers_warm_s_median": med(t["split_py_warm"]) if split_py else None,
            "disk_read_cold_s_median": med(t["disk"]), "reprefill_vs_disk_read_cold": med(t["reprefill"]) / med(t["disk"]),
            "disk_read_cold_gb_s": snap_mb * 2**20 / med(t["disk"]) / 1e9}


@contextlib.contextmanager
def _reader(name: str):
    """Snapshot reads in this block on the C readers ("c") or the Python thread pool ("python")."""
    from rollout import snapshot

    was, snapshot.READER = snapshot.READER, name
    try:
        yield
    finally:
        snapshot.READER = was


def _fixed_split_probe(eng, store, tokens, sampled, params, covered, device, store_dir, reps) -> dict | None:
    """Where a split's time goes: the split at the middle block boundary, with the C readers and with the
    Python readers, next to the head's prefill alone and the tail's cold read alone (C readers), all
    cold, rotated, medians of `reps`. A split that overlaps perfectly takes the longer of the last two."""
    from bench._device import drop_page_cache
    from rollout import restore, snapshot

    at = covered // 2 // snapshot.BLOCK_TOKENS * snapshot.BLOCK_TOKENS
    if at == 0 or torch.device(device).type != "cuda" and not restore.SPLIT_ON_CPU:
        return None  # no split here: a snapshot under two blocks, or the CPU
    head_sampled = [False] * (at - 4) + [True] * 4

    class Fixed(restore.SplitPolicy):  # splits at `at` whatever it measures
        def start(self, *_args, **_kw) -> int:
            return at

    def split(reader):
        def run():
            with _reader(reader):
                r = restore.resume(eng, store, Fixed(), "r", tokens, sampled, params)
            if r.rejected or r.head_tokens != at:
                raise RuntimeError(f"fixed split did not split at {at}: {r}")
        return run

    def head():
        eng.add("h", tokens[:at], head_sampled, params)

    def tail():
        f = store.open("r", tokens, eng.version, eng.fingerprint, eng.dtype)
        try:
            f.read(at, eng.device)
        finally:
            f.close()

    runs = {"split_c": split("c"), "head_prefill_alone": head, "tail_read_cold_alone": tail}
    if snapshot._kvread is not None:
        runs["split_python"] = split("python")
    names, t = list(runs), {n: [] for n in runs}
    for i in range(reps):
        for n in names[i % len(names):] + names[:i % len(names)]:
            drop_page_cache(store_dir)
            _sync(device)
            t0 = time.perf_counter()
            runs[n]()
            _sync(device)
            t[n].append(time.perf_counter() - t0)
            if n == "head_prefill_alone":
                eng.remove("h")
            elif n != "tail_read_cold_alone":
                eng.remove("r")
    return {"head_tokens": at, **{f"{n}_s_median": statistics.median(v) for n, v in t.items()}}


def _us(seconds_per_unit, unit=1):
    return None if seconds_per_unit is None else round(seconds_per_unit * unit * 1e6, 3)


def _read_cold_s(path: str, threads: int = 32) -> float:
    """Seconds to read a file whose pages were just dropped, as a restore reads it (pieces of
    `snapshot.READ_BYTES`, `threads` at a time, one buffer) but nothing checked or uploaded: the disk's
    floor under any restore of that file."""
    from rollout import snapshot

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        view, step = memoryview(bytearray(size)), snapshot.READ_BYTES
        t = time.perf_counter()
        done = list(snapshot.reader_pool(threads).map(lambda a: snapshot.pread_into(fd, view[a:a + step], a),
                                                      range(0, size, step)))
        dt = time.perf_counter() - t
    finally:
        os.close(fd)
    if not all(done):
        raise OSError(f"short read of {path}")
    return dt


def wal_overhead(model, tok, prompts, N, device, wal_dir, static=False, fp=None, group_steps=1, append_inline=True,
                 rounds=3):
    """Decode loop as the worker runs it (launch step t+1, then commit step t) with and without the WAL.
    append_inline=False appends in the commit thread (as for a remote log) instead of the decode loop's.
    `rounds` pairs (without, with; the order alternating), each pair's overhead share computed from its
    two runs; the median share, and the range of the shares: for n pairs the interval from the smallest
    to the largest holds the true median with probability 1 - 2 / 2^n (distribution-free)."""
    import wal
    from rollout.commit import AsyncCommitter
    from rollout.engine import Engine
    from rollout.sampling import SamplingParams
    from rollout.types import ENV_LOGPROB

    params = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True)
    B, P = len(prompts), len(prompts[0])
    out = {}
    order = [w for r in range(rounds) for w in ((False, True) if r % 2 == 0 else (True, False))]
    pairs: list[dict] = [{} for _ in range(rounds)]
    for run, with_wal in enumerate(order):  # paired rounds, alternating which side runs first
        eng = Engine(model, tok, seed=0, max_batch=B, max_len=P + N + 8, device=device, static_decode=static,
                     fingerprint=fp)
        log = wal.open(Path(wal_dir) / f"w{run}") if with_wal else None  # a fresh log each run
        for i, p in enumerate(prompts):
            eng.add(f"t{i}", p, [False] * P, params)
            if log:
                log.append(f"t{i}", 0, p, [ENV_LOGPROB] * P, 0)
        if log:
            log.commit()
        committer = AsyncCommitter(log, group_steps=group_steps) if log else None
        if committer:
            committer.inline = append_inline
        _sync(device)
        t0 = time.perf_counter()
        t_wal = 0.0
        pending = eng.launch()
        steps = 0
        while pending is not None:
            draws = eng.collect(pending)
            eng.accept(draws)
            pending = eng.launch()
            if log:  # as the worker does it: append, commit in the background, expose when durable
                tw = time.perf_counter()
                committer.submit(draws, 0, draws)
                committer.ready()
                t_wal += time.perf_counter() - tw
            steps += 1
        if committer:
            tw = time.perf_counter()
            committer.close()
            t_wal += time.perf_counter() - tw
        _sync(device)
        total = time.perf_counter() - t0
        fsyncs = 0
        if log:
            fsyncs = log.stats()["fsyncs"]
            log.close()
        key = "with" if with_wal else "without"
        pairs[run // 2][key] = total
        best = out.get(key)
        if best is None or total < best[0]:
            out[key] = (total, t_wal, steps, fsyncs)
    (t_with, t_wal, steps, fsyncs), (t_without, _, _, _) = out["with"], out["without"]
    shares = sorted((p["with"] - p["without"]) / p["without"] for p in pairs)
    return {"batch": B, "steps": steps, "static_decode": static, "group_steps": group_steps, "append_inline": append_inline,
            "step_ms_without_wal": 1e3 * t_without / steps,
            "step_ms_with_wal": 1e3 * t_with / steps, "wal_blocking_ms_per_step": 1e3 * t_wal / steps,
            "wal_overhead_share_best_of": (t_with - t_without) / t_without,
            "wal_overhead_share": statistics.median(shares), "paired_rounds": rounds, "paired_shares": shares,
            "median_interval": [shares[0], shares[-1]], "median_interval_coverage": 1 - 2 / 2 ** rounds,
            "wal_blocking_time_over_step_time": t_wal / t_without, "wal_fsyncs": fsyncs}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _attempt(out: dict, key: str, fn, on_progress=None):
    """Run one measurement; a failure is recorded (one line) instead of losing the others."""
    try:
        out[key] = fn()
    except Exception as exc:  # a benchmark section that breaks must not hide the rest of the run
        out[key + "_error"] = f"{type(exc).__name__}: {exc}"[:500]
    if on_progress:
        on_progress(out)


def run_cpu(quick: bool, scratch: Path) -> dict:
    from learner.config import PolicyConfig
    from learner.policy import build_policy
    from rollout.engine import model_fingerprint

    # One thread, as rollout workers run: on a shared 2-core machine two intra-op threads made both
    # sides' timings swing by 50x under load.
    torch.set_num_threads(1)
    B, P, N = (8, 16, 16) if quick else (16, 32, 64)
    model, tok = build_policy(PolicyConfig(max_positions=4096))
    model.eval()
    fp = model_fingerprint(model)
    prompts = _prompts(B, P, model.config.vocab_size)
    reps = 1 if quick else 3
    fast, fast_out, _ = engine_tps(model, tok, prompts, N, "cpu", reps=reps, fp=fp)
    static, _, _ = engine_tps(model, tok, prompts, N, "cpu", reps=reps, static=True, fp=fp)
    strict, strict_out, _ = engine_tps(model, tok, prompts, N, "cpu", strict=True, reps=1, fp=fp)
    hf = hf_tps(model, tok, prompts, N, "cpu", reps=reps)
    resume = [resume_latency(model, tok, c, "cpu", scratch / f"kv{c}", fp=fp) for c in ((256,) if quick else (512, 2048))]
    walo = wal_overhead(model, tok, prompts, N, "cpu", scratch, fp=fp)
    best = max(fast, static)
    return {"model": "tiny qwen2 (PolicyConfig defaults)", "params": sum(p.numel() for p in model.parameters()),
            "batch": B, "prompt": P, "new_tokens": N, "threads": 1,
            "engine_tokens_per_s": fast, "engine_static_tokens_per_s": static, "engine_strict_tokens_per_s": strict,
            "hf_generate_tokens_per_s": hf, "engine_vs_hf_generate": best / hf,
            "engine_mode_for_ratio": "static" if static > fast else "eager",
            "fast_vs_strict_agreement": agreement(fast_out, strict_out), "resume": resume, "wal": walo}


def qwen2_05b_config(max_positions: int = 32768 + 64, small: bool = False):
    from transformers import Qwen2Config

    if small:  # the same code path at toy size (to check the GPU section on a CPU)
        return Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                           tie_word_embeddings=True, rope_theta=1e6, eos_token_id=999, pad_token_id=999)
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=max_positions,
                       tie_word_embeddings=True, rope_theta=1e6, eos_token_id=151643, pad_token_id=151643)


def _gpu_decode(out, model, prompts, N, device, fp, on_progress) -> None:
    """Our decode modes against HF `generate`'s: each side's configurations, `reps` timed runs each, medians."""
    med = statistics.median
    reps = 3
    _attempt(out, "engine_static_tokens_per_s_median", lambda: engine_tps(model, None, prompts, N, device, reps=reps, static=True, fp=fp, stat=med)[0], on_progress)
    _attempt(out, "engine_eager_tokens_per_s_median", lambda: engine_tps(model, None, prompts, N, device, reps=reps, fp=fp, stat=med)[0], on_progress)
    _attempt(out, "engine_chunk_tokens_per_s_median", lambda: engine_tps(
        model, None, prompts, N, device, reps=reps, static=True, fp=fp, stat=med, decode_chunk=GPU_DECODE_CHUNK,
        compile_decode=device == "cuda")[0], on_progress)
    out["engine_chunk"] = f"decode_chunk={GPU_DECODE_CHUNK}, compile_decode on a CUDA device, CUDA graph"
    _attempt(out, "hf_generate_tokens_per_s_median", lambda: hf_tps(model, None, prompts, N, device, reps=reps, stat=med), on_progress)
    _attempt(out, "hf_static_compile_tokens_per_s_median", lambda: hf_tps(model, None, prompts, N, device, reps=reps, static=True, stat=med), on_progress)
    out["hf_static_compiled"] = getattr(model, "_compiled_call", None) is not None  # whether HF did compile the forward
    modes = ("engine_static_tokens_per_s_median", "engine_eager_tokens_per_s_median", "engine_chunk_tokens_per_s_median")
    ours = max(out.get(m, 0) for m in modes)
    if ours:
        out["engine_best_mode"] = max(modes, key=lambda m: out.get(m, 0)).split("_")[1]
    hf = max(out.get("hf_generate_tokens_per_s_median", 0), out.get("hf_static_compile_tokens_per_s_median", 0))
    out["hf_static_compile"] = "cache_implementation='static', transformers CompileConfig() defaults (torch.compile of the forward)"
    if ours and hf:
        out["engine_vs_hf_best"] = ours / hf
        out["hf_best_mode"] = "static+compile" if out.get("hf_static_compile_tokens_per_s_median", 0) >= out.get("hf_generate_tokens_per_s_median", 0) else "eager dynamic cache"
    # the earlier figures (best of 2 of our static decode, one run of HF's default generate)
    out["engine_static_tokens_per_s"] = out.get("engine_static_tokens_per_s_median")
    out["engine_eager_tokens_per_s"] = out.get("engine_eager_tokens_per_s_median")
    out["hf_generate_tokens_per_s"] = out.get("hf_generate_tokens_per_s_median")
    if ours and out.get("hf_generate_tokens_per_s"):
        out["engine_vs_hf_generate"] = ours / out["hf_generate_tokens_per_s"]


def _gpu_wal(out, model, prompts, N, device, scratch, fp, static, on_progress) -> None:
    """The decode loop with and without a WAL commit per step (and variants), paired rounds."""
    _attempt(out, "wal", lambda: wal_overhead(model, None, prompts, min(N, 128), device, scratch / "wal",
                                              static=static, fp=fp, rounds=7), on_progress)
    _attempt(out, "wal_append_in_commit_thread", lambda: wal_overhead(
        model, None, prompts, min(N, 128), device, scratch / "walt", static=static, fp=fp, append_inline=False,
        rounds=2), on_progress)
    for g in (4, 8):
        _attempt(out, f"wal_group{g}", lambda: wal_overhead(model, None, prompts, min(N, 128), device, scratch / f"wal{g}",
                                                            static=static, fp=fp, group_steps=g, rounds=2), on_progress)


PARTS = ("decode", "wal", "resume")  # the GPU section's parts, in the order they run


def run_gpu(quick: bool, scratch: Path, device: str = "cuda", small: bool = False, on_progress=None,
            parts=PARTS) -> dict:
    from transformers import AutoModelForCausalLM

    from rollout.engine import model_fingerprint

    cfg = qwen2_05b_config(small=small)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()
    fp = model_fingerprint(model)
    B, P, N = (64, 128, 64) if quick else (64, 128, 256)
    if small:
        B, P, N = 8, 16, 16
    prompts = _prompts(B, P, cfg.vocab_size)
    out = {"model": "qwen2-0.5B-style random " + str(dtype).removeprefix("torch."),
           "params": sum(p.numel() for p in model.parameters()),
           "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "batch": B, "prompt": P, "new_tokens": N}
    if "decode" in parts:
        _gpu_decode(out, model, prompts, N, device, fp, on_progress)
    if "wal" in parts:  # the static decode unless this run's decode part found it failing
        static = "decode" not in parts or "engine_static_tokens_per_s_median" in out
        _gpu_wal(out, model, prompts, N, device, scratch, fp, static, on_progress)
    ctxs = () if "resume" not in parts else (2048, 8192, 32768) if not small else (256,)
    out["parts"] = list(parts)
    out["resume"] = []
    for c in ctxs:
        r: dict = {}
        _attempt(r, "r", lambda: resume_latency(model, None, c, device, scratch / f"kv{c}", fp=fp))
        out["resume"].append(r.get("r") or {"context": c, "error": r.get("r_error")})
        if on_progress:
            on_progress(out)
        torch.cuda.empty_cache() if device == "cuda" else None
    return out


def _target(name, value, note=None):
    goal, ok = GOALS[name]
    t = {"value": None if value is None else round(value, 4), "goal": goal, "met": None if value is None else bool(ok(value))}
    if note:
        t["note"] = note
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench rollout", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON (always on; kept for a uniform CLI)")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--gpu-only", action="store_true", help="skip the CPU part")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"GPU parts to run, comma-separated (default: all of "
                    f"{','.join(PARTS)}); the targets of a part not run say so")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--scratch", help="directory for WAL and snapshot files (default: a temp dir; use a disk, not tmpfs)")
    args = ap.parse_args(argv)
    parts = tuple(x for x in args.parts.split(",") if x)
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--parts {args.parts!r}: choose from {','.join(PARTS)}")
    scratch_ctx = tempfile.TemporaryDirectory() if not args.scratch else None
    scratch = Path(args.scratch or scratch_ctx.name)
    scratch.mkdir(parents=True, exist_ok=True)
    res: dict = {"benchmark": "rollout", "device": f"{cpu_name()}, 2 cores"}
    if not args.gpu_only:
        res["cpu"] = run_cpu(args.quick, scratch / "cpu")
    gpu_note = "not run: no CUDA device in this run (see bench/results/rollout_h200.json when present)"
    if torch.cuda.is_available():
        def save_partial(gpu_part):  # a run cut short still leaves what it measured
            if args.out:
                Path(args.out).write_text(json.dumps({**res, "gpu": gpu_part, "partial": True}, indent=2) + "\n")

        res["gpu"] = run_gpu(args.quick, scratch / "gpu", on_progress=save_partial, parts=parts)
        res["device"] = f"{res['gpu']['gpu']} + {cpu_name()}" + ("" if args.gpu_only else " (CPU part: 2 threads)")
        gpu_note = None
    cpu, gpu = res.get("cpu"), res.get("gpu")
    res32 = next((r for r in (gpu or {}).get("resume", []) if r.get("context") == 32768), {})
    r32 = res32.get("ratio_cold_median")
    floor = res32.get("reprefill_vs_disk_read_cold")
    floor_note = None if floor is None else (
        f"the resume re-prefills {res32['split_head_tokens']} head tokens while the rest of the snapshot is read; "
        f"reading the whole snapshot instead gives {res32['ratio_whole_cold_median']:.2f}, bound by the disk: "
        f"re-prefill over a bare cold read of the same file (32 preads of 1 MiB in flight, nothing checked or "
        f"uploaded, {res32['disk_read_cold_gb_s']:.2f} GB/s) is {floor:.2f}")
    w = (gpu or {}).get("wal", {})

    def skipped(part):
        return gpu_note or (None if part in parts else f"not run: this run's GPU parts were {','.join(parts)}")

    res["targets"] = {
        "engine_vs_hf_generate_cpu": _target("engine_vs_hf_generate_cpu", cpu and cpu["engine_vs_hf_generate"],
                                             None if cpu else "CPU part skipped (--gpu-only)"),
        "engine_vs_hf_static_compile_h200_b64": _target("engine_vs_hf_static_compile_h200_b64",
                                                        gpu and gpu.get("engine_vs_hf_best"), skipped("decode")),
        "reprefill_vs_kv_restore_cold_32k": _target("reprefill_vs_kv_restore_cold_32k", r32,
                                                    skipped("resume") or floor_note),
        "wal_overhead_share_b64_h200": _target(
            "wal_overhead_share_b64_h200", w.get("wal_overhead_share"),
            skipped("wal") or (f"one WAL commit per decode step (group_steps=1); shares of the {w.get('paired_rounds')} pairs "
                         f"range {w.get('median_interval')} (holds the true median with probability "
                         f"{w.get('median_interval_coverage')}); gpu.wal_group4/8 commit every 4/8 steps")),
    }
    res["meta"] = run_meta(res.get("device"))
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
