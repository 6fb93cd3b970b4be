"""Retention of a `postrain grpo` run directory (real Ray workers, WAL, SQLite data plane): after a run the
data plane holds the last K iterations' batches only (shards on disk included), the workers' WALs hold
records of the last two batches at most, older checkpoints are gone, the size is reported, and a run
stopped and resumed under retention repeats the metrics of an uninterrupted run that kept everything."""
from __future__ import annotations

import json
import re

from core import config
from deploy.grpo_config import GRPOLoopConfig
from deploy.grpo_loop import TIMING_KEYS, run_grpo

SEGMENT_BYTES = 4096  # small WAL segments, so that the WAL rolls several times per batch here
BASE = ["sampling.max_new_tokens=12", "eval.max_new_tokens=12", "eval.n=16", "learner.threads=1",
        "learner.device=cpu", "pool.workers=1", "loop.eval_every=2", "engine.strict=true", "loop.minibatches=1",
        "optim.lr=5e-4", "loop.prompts_per_iteration=4", "loop.group_size=4", "loop.async_rollouts=true",
        "loop.checkpoint_every=1", "staleness.bound=1", f"pool.wal_segment_bytes={SEGMENT_BYTES}",
        "loop.keep_iterations=1", "loop.keep_checkpoints=1"]
ITERATIONS = 4
# Pool counters: a resumed run finds the batch sampled ahead in the data plane and does not roll it out again.
POOL_KEYS = ("faults", "replacements", "completed", "tokens_lost", "tokens_resampled")


def _cfg(*extra):
    return config.load(GRPOLoopConfig, None, BASE + list(extra))


def _rows(out, stage):
    return [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
            if r["stage"] == stage]


def _seeded(row):
    return {k: v for k, v in row.items() if k not in TIMING_KEYS and k not in POOL_KEYS}


def _batches_in_dataplane(out):
    import dataplane

    with dataplane.open(out / "dataplane" / "catalog.db", out / "dataplane" / "store") as dp:
        sel = dp.select(status=None)
        shards_catalogued = {p for _, p, *_ in dp.catalog.shard_rows()}
        shards_on_disk = set(dp.store.list())
    return {re.search(r"-(it\d+)-", str(t)).group(1) for t in sel.ids}, shards_catalogued, shards_on_disk


def _batches_in_wal(out):
    """Batch indices of every trajectory any worker WAL segment still holds records of."""
    from wal import segments
    from wal.types import StepRecord, TokensRecord

    seen = set()

    def on_record(rec):
        ids = rec.traj_ids if isinstance(rec, StepRecord) else [rec.traj_id] if isinstance(rec, TokensRecord) else []
        seen.update(int(re.search(r"-it(\d+)-", t).group(1)) for t in ids)

    dirs = sorted((out / "rollout").glob("start-*/wal/*"))
    for d in dirs:
        segments.scan(d, on_record, mutate=False)
    return seen, dirs


def test_retention_keeps_the_last_iterations_and_resume_repeats_the_metrics(tmp_path, reverse_base):
    kept, out = tmp_path / "kept", tmp_path / "reclaimed"
    run_grpo(_cfg("loop.keep_data=true"), "reverse", reverse_base, kept, iterations=ITERATIONS, quiet=True)
    first = run_grpo(_cfg(), "reverse", reverse_base, out, iterations=ITERATIONS, quiet=True, stop_after=2)
    assert first["iterations_done"] == 2
    summary = run_grpo(_cfg(), "reverse", reverse_base, out, iterations=ITERATIONS, quiet=True, resume=True)

    # Retention changes nothing the learner sees: the resumed, reclaimed run repeats the kept one.
    assert [_seeded(r) for r in _rows(kept, "train")] == [_seeded(r) for r in _rows(out, "train")]
    assert [_seeded(r) for r in _rows(kept, "eval")] == [_seeded(r) for r in _rows(out, "eval")]

    # --keep-data: every batch stays. Retention (K = 1): the last trained batch only, no orphan shard.
    runs, catalogued, on_disk = _batches_in_dataplane(kept)
    assert runs == {f"it{k:06d}" for k in range(ITERATIONS)}
    runs, catalogued, on_disk = _batches_in_dataplane(out)
    assert runs == {f"it{ITERATIONS - 1:06d}"}, runs
    assert catalogued == on_disk and all(p.startswith(f"shards/it{ITERATIONS - 1:06d}/") for p in on_disk), on_disk
    assert sorted(p.name for p in (out / "dataplane" / "store" / "shards").iterdir()) == [f"it{ITERATIONS - 1:06d}"]

    # WAL: the interrupted start's directory is gone; the last one holds records of the last two batches at most.
    batches, dirs = _batches_in_wal(out)
    assert len({d.parent.parent for d in dirs}) == 1, dirs
    assert batches <= {ITERATIONS - 2, ITERATIONS - 1}, batches  # without retention: all four

    # Checkpoints: the newest only. Size: reported per iteration and in the summary, smaller than the kept run's.
    assert sorted(p.name for p in (out / "checkpoints").glob("iter_*")) == [f"iter_{ITERATIONS:08d}"]
    assert len(list((kept / "checkpoints").glob("iter_*"))) == ITERATIONS
    assert all(r["run_dir_mb"] > 0 for r in _rows(out, "train"))
    disk = _rows(out, "disk")[-1]
    assert disk["run_dir_mb"] == summary["run_dir_mb"] > 0 and disk["reclaimed_trajectories"] > 0
    assert summary["run_dir_mb"] < _rows(kept, "disk")[-1]["run_dir_mb"]
