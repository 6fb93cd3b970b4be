"""OPD's training step at a production shape: teacher heads from pinned host memory and hidden states
from the data plane, one teacher head resident, against the same steps with everything on the device.

On CUDA (the targets' shape: V = 129,280, H = 4,096, bf16, 4 teachers with their own heads, 4
minibatches of 16,384 tokens, each holding every teacher's rows: 4 head loads per minibatch, the
most a minibatch can ask for) the student is a trunk of `trunk_layers` real HF Qwen2 decoder layers
(random weights from a config, bf16) with its own untied head, trained by the product's
`OPDLearner`:
- `streamed`: `OPDLearner.plan_step` on each minibatch of one plan: each teacher group's cached hidden
  states come from the data plane's shard files (memory-mapped, checksum-verified, prepared in the
  prefetch thread), its head through `HeadScheduler` (read from storage and pinned once per run,
  then copied to the device on a side stream while the student's trunk runs its backward and the
  next forward; one head resident);
- `resident`: the same learner (`train_groups`, gradient reduction and optimizer step: the very code
  `plan_step` runs) with every teacher head and every hidden state already on the device.
`io_overhead_share` = streamed / resident - 1, medians of the same number of interleaved rounds. A
few decoder layers are a lower bound on a real student's trunk, so the trunk hides less I/O here
than in a real run. The KL calls alone (no trunk: nothing to hide a copy behind) are timed too and
reported apart (`kl_only`, not a target).

Device memory is read from the allocator: its trace of every allocation and free during a streamed
round gives the most teacher-head blocks alive at once (allocations made by the head scheduler's
copy), and the peak of a step with 4 teachers is compared with one with 1.
`cache_bytes_vs_fp32_logits`: the shard bytes per token over V float32 logits.

On a machine without CUDA it runs a small shape on the CPU and says so (the targets are H200 targets).

    python -m bench.opd --json [--out bench/results/opd_h200.json] [--rounds 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from bench._device import cpu_name, emit, run_meta
from core.cli_args import positive_int

SHAPE_GPU = {"V": 129_280, "H": 4_096, "teachers": 4, "minibatches": 4, "tokens": 16_384, "row": 512,
             "trunk_layers": 4, "intermediate": 12_288, "attention_heads": 32, "kv_heads": 8}
SHAPE_CPU = {"V": 2_048, "H": 128, "teachers": 4, "minibatches": 4, "tokens": 512, "row": 64,
             "trunk_layers": 2, "intermediate": 256, "attention_heads": 4, "kv_heads": 2}


def _write_teacher(path: Path, V: int, H: int, seed: int, device: torch.device) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator(device).manual_seed(seed)
    head = (torch.randn(V, H, generator=g, device=device) * H ** -0.5).to(torch.bfloat16).cpu()
    save_file({"lm_head.weight": head}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": V, "hidden_size": H,
                                                  "tie_word_embeddings": False}))


def _student(s: dict, device: torch.device) -> torch.nn.Module:
    """A Qwen2 trunk of `trunk_layers` decoder layers with its own head, random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=s["V"], hidden_size=s["H"], intermediate_size=s["intermediate"],
                      num_hidden_layers=s["trunk_layers"], num_attention_heads=s["attention_heads"],
                      num_key_value_heads=s["kv_heads"], max_position_embeddings=4 * s["row"],
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)


def _setup(root: Path, s: dict, device: torch.device):
    """Teachers on disk, the cache rows in a data plane, a plan of `minibatches` minibatches each holding
    every teacher's rows in teacher order, and the tokens' hashes."""
    import dataplane
    from dataplane import TrajectoryRecord
    from distill.teachers import describe
    from rollout.types import token_hash

    teachers = []
    for i in range(s["teachers"]):
        _write_teacher(root / f"t{i}", s["V"], s["H"], i, device)
        teachers.append(describe(f"d{i}", 0, str(root / f"t{i}"), 1.0))
    dp = dataplane.open(root / "catalog.db", root / "store")
    rows_per_teacher = s["tokens"] // s["teachers"] // s["row"]
    rng = np.random.default_rng(7)
    g = torch.Generator(device).manual_seed(7)
    hashes = {}
    for m in range(s["minibatches"]):
        recs = []
        for t in teachers:
            for r in range(rows_per_teacher):
                tokens = rng.integers(0, s["V"], s["row"]).astype(np.int32)
                rid = f"m{m}-{t.name}-{r}"
                hashes[rid] = token_hash(tokens.tolist())
                hidden = torch.randn(s["row"], s["H"], generator=g, device=device).to(torch.bfloat16).cpu()
                recs.append(TrajectoryRecord(
                    id=rid, run="bench", domain=t.domain, prompt="", group_id=f"m{m}-{r}", tokens=tokens,
                    loss_mask=np.r_[0, np.ones(s["row"] - 1)].astype(np.uint8),
                    logprobs=np.zeros(s["row"], np.float32), teacher_id=t.name, extras={"teacher_hidden": hidden}))
        dp.put(recs)
    sel = dp.select(run="bench")
    return dp, teachers, sel, hashes


def _interleaved(dp, sel, s: dict, only: str | None = None):
    """A teacher-ordered plan whose minibatch m holds the rows written for minibatch m (every teacher's,
    or `only` one teacher's rows of all minibatches in one minibatch)."""
    plan = dp.plan(sel, tokens_per_rank=s["tokens"], ranks=1, by_teacher=True)
    ids = plan.ids.astype(str)
    if only is not None:
        bins = [np.flatnonzero(np.char.find(ids, f"-{only}-") >= 0)]
    else:
        bins = [np.flatnonzero(np.char.startswith(ids, f"m{m}-")) for m in range(s["minibatches"])]
    traj = np.concatenate([b[np.argsort(plan.teacher[b], kind="stable")] for b in bins]).astype(np.int64)
    sizes = [len(b) for b in bins]
    return dataclasses.replace(plan, seg_traj=traj, seg_start=np.zeros(len(traj), np.int64),
                               seg_stop=plan.length[traj].astype(np.int64),
                               bin_offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                               balanced=np.ones(len(bins), bool))


class AllResident:
    """The baseline's heads: every teacher head on the device for the whole run (the interface of
    `HeadScheduler` that `OPDLearner.train_groups` uses)."""

    stream = None
    loads = 0

    def __init__(self, heads: dict[str, torch.Tensor]):
        self.heads = heads
        self.max_resident = len(heads)

    def stage(self, name: str) -> None:
        pass

    def swap(self, name: str | None) -> None:
        pass

    @contextmanager
    def resident(self, name: str, then: str | None = None):
        yield self.heads[name]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(rounds: int) -> dict:
    from distill.cache import FIELD
    from distill.heads import read_head
    from distill.opd_batches import prepare, to_device
    from distill.opd_config import OPDTrainConfig
    from distill.opd_learner import OPDLearner, _load, teacher_groups
    from distill.opd_loss import full_vocab_kl

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    s = SHAPE_GPU if cuda else SHAPE_CPU
    tmp = tempfile.TemporaryDirectory(prefix="bench-opd-")
    root = Path(tmp.name)
    t_setup = time.perf_counter()
    dp, teachers, sel, hashes = _setup(root, s, device)
    plan = _interleaved(dp, sel, s)
    M = plan.num_minibatches
    cfg = OPDTrainConfig.model_validate({"learner": {"device": device.type, "threads": 0},
                                         "optim": {"lr": 1e-6, "total_steps": 1_000_000}})
    learner = OPDLearner(_student(s, device), cfg)
    learner.set_teachers(0, teachers)
    setup_s = time.perf_counter() - t_setup
    head_bytes = s["V"] * s["H"] * 2

    def streamed(p=plan):
        for m in range(p.num_minibatches):
            learner.plan_step(0, p, m, hashes)
        _sync(device)

    t0 = time.perf_counter()
    streamed()  # warm-up: kernels, the shards' page cache, heads read from storage and pinned once
    first_round_s = time.perf_counter() - t0
    streamed()

    # Teacher heads on the device, from the allocator's trace of a whole streamed round.
    alloc = None
    if cuda:
        from bench._alloc_trace import live_max, recording

        copies = learner.heads.copies
        with recording() as rec:
            streamed()
        alloc = live_max(rec["snapshot"], "distill/heads.py", "_copy_to_device")
        alloc["scheduler_copies"] = learner.heads.copies - copies
        del rec
    # Only a trace that saw every head the scheduler made counts (else the stacks were not recorded).
    seen_all = bool(alloc) and alloc["allocations"] == alloc["scheduler_copies"] > 0
    max_resident_alloc = alloc["max_live_bytes"] / head_bytes if seen_all else None

    # Peak of a step with every teacher against a step (as many tokens) with one.
    peak = {}
    if cuda:
        one = _interleaved(dp, sel, s, only=teachers[0].name)
        for n, p in ((s["teachers"], plan), (1, one)):
            learner.heads.release()  # each step loads its own heads
            _sync(device)
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            learner.plan_step(0, p, 0, hashes)
            _sync(device)
            peak[n] = (torch.cuda.max_memory_allocated() - before) / 2**30
    sched = learner.heads
    sched_stats = {"max_resident_heads_scheduler": sched.max_resident, "head_loads": sched.loads,
                   "head_copies": sched.copies, "head_copies_unused": sched.unused_copies,
                   "head_reads_from_storage": sched.host.reads}

    # The baseline: every head and every hidden state on the device before the steps.
    budget, pin = cfg.learner.micro_batch_tokens, cuda
    everything = AllResident({t.name: read_head(t).to(device) for t in teachers})
    ready = []
    for m in range(M):
        groups = teacher_groups(plan, m, 0)
        ready.append(([name for name, _ in groups],
                      [[to_device(part, device, None) for part in prepare(_load(sub), hashes, budget, pin)]
                       for _, sub in groups]))
    _sync(device)

    def resident():
        for names, parts in ready:
            sums = learner.train_groups(names, lambda j, parts=parts: parts[j], everything)
            learner.finish_gradients(sums, everything, 0)
            learner.apply_update()
        _sync(device)

    resident()  # warm-up
    times = {"streamed": [], "resident": []}
    for _ in range(rounds):  # interleaved, so drift hits both sides alike
        for side, fn in (("streamed", streamed), ("resident", resident)):
            t0 = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    overhead = med["streamed"] / med["resident"] - 1

    # The KL calls alone (secondary): no trunk to hide a head's copy behind.
    W_s = learner.model.get_output_embeddings().weight
    per = s["tokens"] // s["teachers"]
    h_s = torch.randn(s["tokens"], s["H"], device=device).to(W_s.dtype).requires_grad_()
    coef = torch.full((per,), 1.0 / s["tokens"], device=device)
    hidden = [[_load(sub).extras[FIELD].to(device) for _, sub in teacher_groups(plan, m, 0)] for m in range(M)]

    def kl_streamed():
        for m in range(M):
            groups = teacher_groups(plan, m, 0)
            for j, (name, sub) in enumerate(groups):
                h_t = _load(sub).extras[FIELD].to(device, non_blocking=True)
                with sched.resident(name) as W_t:
                    full_vocab_kl(h_s[j * per:(j + 1) * per], W_s, h_t, W_t, coef).backward()
                    del W_t
                sched.swap(groups[j + 1][0] if j + 1 < len(groups) else None)
        _sync(device)

    def kl_resident():
        for m in range(M):
            for j, (name, _) in enumerate(teacher_groups(plan, m, 0)):
                full_vocab_kl(h_s[j * per:(j + 1) * per], W_s, hidden[m][j], everything.heads[name], coef).backward()
        _sync(device)

    kl_times = {"streamed": [], "resident": []}
    kl_streamed(), kl_resident()
    for _ in range(rounds):
        for side, fn in (("streamed", kl_streamed), ("resident", kl_resident)):
            W_s.grad = h_s.grad = None
            t0 = time.perf_counter()
            fn()
            kl_times[side].append(time.perf_counter() - t0)
    kl_med = {k: statistics.median(v) for k, v in kl_times.items()}

    h2d_ms = None
    if cuda:  # one head's copy from pinned host memory, alone
        host = sched.host.get(teachers[0].name)
        dst = torch.empty_like(host, device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            start.record()
            dst.copy_(host, non_blocking=True)
            end.record()
            torch.cuda.synchronize()
        h2d_ms = start.elapsed_time(end)
        del dst, host
    del everything, ready, hidden
    learner.heads.close()

    shard_bytes = sum(b for _, _, _, b, _ in dp.catalog.shard_rows())
    tokens = s["tokens"] * s["minibatches"]
    cache_ratio = shard_bytes / tokens / (s["V"] * 4)
    dp.close()
    tmp.cleanup()
    res = {
        "benchmark": "opd", "device": torch.cuda.get_device_name() if cuda else cpu_name(), "cuda": cuda,
        "shape": s, "student": f"Qwen2ForCausalLM, {s['trunk_layers']} decoder layers, untied head, "
                               f"{'bf16' if cuda else 'fp32'}, random weights",
        "rounds": rounds, "setup_s": setup_s, "first_round_s": first_round_s,
        "times_s": times, "median_s": med, "io_overhead_share": overhead,
        "kl_only": {"times_s": kl_times, "median_s": kl_med,
                    "io_overhead_share": kl_med["streamed"] / kl_med["resident"] - 1},
        "head_h2d_ms": h2d_ms, "head_bytes": head_bytes,
        "max_resident_heads_allocator": max_resident_alloc, "allocator_trace": alloc, **sched_stats,
        "peak_gib": peak, "cache_bytes_per_token": shard_bytes / tokens, "fp32_logits_bytes_per_token": s["V"] * 4,
        "cache_bytes_vs_fp32_logits": cache_ratio,
    }
    if cuda:
        ratio = peak[s["teachers"]] / peak[1]
        res["targets"] = {
            "max_resident_teacher_heads": {"value": max_resident_alloc, "goal": "<= 1 (device allocations)",
                                           "met": max_resident_alloc is not None and max_resident_alloc <= 1.01},
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
    p.add_argument("--rounds", type=positive_int, default=3, help="timed rounds per side (median)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    a = p.parse_args(argv)
    res = run(max(1, a.rounds))
    res["meta"] = run_meta(res.get("device"))
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
