"""OPD's teacher side at a production shape: heads from storage, hidden states from the data plane,
one teacher head resident, against the same work with everything already on the device.

On CUDA (the targets' shape: V = 129,280, H = 4,096, bf16, 4 teachers with their own heads, 4
minibatches of 16,384 tokens, each holding every teacher's rows):
- `streamed`: per minibatch and teacher, the teacher's cached hidden states come from the data plane's
  shard files (memory-mapped, checksum-verified), its head through `HeadScheduler` (pinned host memory,
  copied on a side stream, the next head read ahead), then the exact full-vocabulary reverse KL
  forward+backward against the student head;
- `resident`: the same KL calls with every head and every hidden state already on the device.
`io_overhead_share` = streamed / resident - 1 (median of the rounds on both sides). Device memory is
read from the allocator: the heads resident at each KL call, and the peak of a step with 4 teachers
against one with 1. `cache_bytes_vs_fp32_logits`: the shard bytes per token over V float32 logits.

On a machine without CUDA it runs a small shape on the CPU and says so (the targets are H200 targets).

    python -m bench.opd --json [--out bench/results/opd_h200.json] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench._device import cpu_name, run_meta

SHAPE_GPU = {"V": 129_280, "H": 4_096, "teachers": 4, "minibatches": 4, "tokens": 16_384, "row": 512}
SHAPE_CPU = {"V": 4_096, "H": 256, "teachers": 4, "minibatches": 4, "tokens": 1_024, "row": 128}


def _write_teacher(path: Path, V: int, H: int, seed: int) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file({"lm_head.weight": (torch.randn(V, H, generator=g) * H ** -0.5).to(torch.bfloat16)},
              str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": V, "hidden_size": H,
                                                  "tie_word_embeddings": False}))


def _setup(root: Path, s: dict, device: torch.device):
    import dataplane
    from dataplane import TrajectoryRecord
    from distill.teachers import describe

    teachers = []
    for i in range(s["teachers"]):
        _write_teacher(root / f"t{i}", s["V"], s["H"], seed=i)
        teachers.append(describe(f"d{i}", 0, str(root / f"t{i}"), 1.0))
    dp = dataplane.open(root / "catalog.db", root / "store")
    rows_per_teacher = s["tokens"] // s["teachers"] // s["row"]
    g = torch.Generator().manual_seed(7)
    for m in range(s["minibatches"]):
        recs = []
        for t in teachers:
            for r in range(rows_per_teacher):
                recs.append(TrajectoryRecord(
                    id=f"m{m}-{t.name}-{r}", run=f"mb{m}", domain=t.domain, prompt="", group_id=f"m{m}-{r}",
                    tokens=np.zeros(s["row"], np.int32), loss_mask=np.r_[0, np.ones(s["row"] - 1)].astype(np.uint8),
                    logprobs=np.zeros(s["row"], np.float32), teacher_id=t.name,
                    extras={"teacher_hidden": torch.randn(s["row"], s["H"], generator=g).to(torch.bfloat16)}))
        dp.put(recs)
    W_s = (torch.randn(s["V"], s["H"], generator=g) * s["H"] ** -0.5).to(device, torch.bfloat16).requires_grad_()
    h_s = torch.randn(s["tokens"], s["H"], generator=g).to(device, torch.bfloat16).requires_grad_()
    return dp, teachers, W_s, h_s


def _groups(dp, m: int, s: dict):
    """(teacher, loader batch) per teacher of minibatch m, read from the shards."""
    from distill.opd_learner import teacher_groups

    sel = dp.select(run=f"mb{m}")
    plan = dp.plan(sel, tokens_per_rank=sel.num_tokens, ranks=1, by_teacher=True)
    return teacher_groups(plan, 0, 0)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(rounds: int) -> dict:
    from distill.heads import HeadScheduler, read_head
    from distill.opd_learner import _load
    from distill.opd_loss import full_vocab_kl

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    s = SHAPE_GPU if cuda else SHAPE_CPU
    tmp = tempfile.TemporaryDirectory(prefix="bench-opd-")
    root = Path(tmp.name)
    dp, teachers, W_s, h_s = _setup(root, s, device)
    by_name = {t.name: t for t in teachers}
    per = s["tokens"] // s["teachers"]
    coef = torch.full((per,), 1.0 / s["tokens"], device=device)
    head_bytes = s["V"] * s["H"] * 2
    resident_at_kl: list[float] = []

    def kl(h_t, W_t, j):
        if cuda:  # heads on the device right now, from the allocator: everything above the base, in heads
            resident_at_kl.append((torch.cuda.memory_allocated() - base_alloc) / head_bytes)
        loss = full_vocab_kl(h_s[j * per:(j + 1) * per], W_s, h_t, W_t, coef)
        loss.backward()

    def streamed(teacher_subset=None):
        sched = HeadScheduler(by_name, device, dtype=torch.bfloat16, prefetch=True)
        for m in range(s["minibatches"]):
            groups = [g for g in _groups(dp, m, s) if teacher_subset is None or g[0] in teacher_subset]
            for j, (name, sub) in enumerate(groups):
                batch = _load(sub)
                h_t = batch.extras["teacher_hidden"].to(device, non_blocking=True)
                nxt = groups[j + 1][0] if j + 1 < len(groups) else None
                with sched.resident(name, then=nxt) as W_t:
                    kl(h_t, W_t, j)
                    del W_t
                del h_t, batch
            sched.release()
        _sync(device)
        sched.close()
        return sched

    def resident(heads, hidden):
        for m in range(s["minibatches"]):
            for j, t in enumerate(teachers):
                kl(hidden[m][t.name], heads[t.name], j)
        _sync(device)

    W_s.grad = h_s.grad = None
    base_alloc = torch.cuda.memory_allocated() if cuda else 0
    streamed()  # warm-up: kernels, page cache of the shards
    times = {"streamed": [], "resident": []}
    for _ in range(rounds):
        W_s.grad = h_s.grad = None
        base_alloc = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        sched = streamed()
        times["streamed"].append(time.perf_counter() - t0)
    max_resident_sched = sched.max_resident
    max_resident_alloc = max(resident_at_kl) if resident_at_kl else None
    heads = {t.name: read_head(t).to(device) for t in teachers}
    hidden = [{name: _load(sub).extras["teacher_hidden"].to(device) for name, sub in _groups(dp, m, s)}
              for m in range(s["minibatches"])]
    for _ in range(rounds):
        W_s.grad = h_s.grad = None
        base_alloc = torch.cuda.memory_allocated() if cuda else 0
        t0 = time.perf_counter()
        resident(heads, hidden)
        times["resident"].append(time.perf_counter() - t0)
    del heads, hidden
    peak = {}
    if cuda:
        for n in (1, s["teachers"]):
            W_s.grad = h_s.grad = None
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            streamed({t.name for t in teachers[:n]})
            peak[n] = (torch.cuda.max_memory_allocated() - before) / 2**30
    shard_bytes = sum(b for _, _, _, b, _ in dp.catalog.shard_rows())
    tokens = s["tokens"] * s["minibatches"]
    med = {k: statistics.median(v) for k, v in times.items()}
    overhead = med["streamed"] / med["resident"] - 1
    cache_ratio = shard_bytes / tokens / (s["V"] * 4)
    dp.close()
    tmp.cleanup()
    res = {
        "benchmark": "opd", "device": torch.cuda.get_device_name() if cuda else cpu_name(), "cuda": cuda,
        "shape": s, "rounds": rounds, "times_s": times, "median_s": med, "io_overhead_share": overhead,
        "max_resident_heads_scheduler": max_resident_sched, "max_resident_heads_allocator": max_resident_alloc,
        "peak_gib": peak, "cache_bytes_per_token": shard_bytes / tokens, "fp32_logits_bytes_per_token": s["V"] * 4,
        "cache_bytes_vs_fp32_logits": cache_ratio,
    }
    if cuda:
        ratio = peak[s["teachers"]] / peak[1]
        res["targets"] = {
            "max_resident_teacher_heads": {"value": max_resident_alloc, "goal": "<= 1 (device allocations)",
                                           "met": max_resident_alloc is not None and max_resident_alloc <= 1.05},
            "io_overhead_share_h200": {"value": overhead, "goal": "<= 0.05", "met": overhead <= 0.05},
            "cache_bytes_vs_fp32_logits": {"value": cache_ratio, "goal": "<= 0.02", "met": cache_ratio <= 0.02},
            "peak_gib_4_teachers_vs_1": {"value": ratio, "goal": "<= 1.1", "met": ratio <= 1.1},
        }
    else:
        res["note"] = "no CUDA device: a small shape on the CPU checks the path; the targets are H200 targets"
        res["targets"] = {}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="postrain bench opd", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per side (median)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    a = p.parse_args(argv)
    res = run(max(1, a.rounds))
    res["meta"] = run_meta(res.get("device"))
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
