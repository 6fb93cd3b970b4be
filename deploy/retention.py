"""Retention of a GRPO run directory: what a durable checkpoint makes dead is reclaimed.

A checkpoint written after iteration c covers batches 0..c-1 (batch k trains in iteration k+1): a run
resumed from it starts at iteration c and needs batch c (sampled ahead, one-step-off) and later ones,
never an earlier batch. So once that checkpoint is durable, the data-plane trajectories and shards of
batches before c − K go (K = `loop.keep_iterations`, the last K trained batches stay for inspection), and
checkpoints older than the newest `loop.keep_checkpoints` are deleted. The rollout workers' WAL records
die when a trajectory is finalized (after the data plane holds it); the WAL's own retention deletes
their sealed segments, kept small by `pool.wal_segment_bytes`. A resumed run starts a fresh rollout
directory, so the WAL directories of earlier starts hold nothing live and go too.

With `loop.keep_data` nothing is reclaimed. With hard-prompt replay the batches stay: a resumed run
rebuilds the replay queue from all of them.
"""
from __future__ import annotations

import os
from pathlib import Path


class Retention:
    """Reclaims one run's dead data; `after_checkpoint(c)` once the checkpoint of iteration c is durable."""

    def __init__(self, dp, out: Path, checkpoints: Path, keep_iterations: int, keep_checkpoints: int,
                 keep_batches: bool, batch_name):
        self.dp, self.out, self.checkpoints = dp, Path(out), Path(checkpoints)
        self.keep_iterations, self.keep_checkpoints = keep_iterations, keep_checkpoints
        self.keep_batches, self.batch_name = keep_batches, batch_name
        self.reclaimed_below = 0  # batches below this index are known to be gone
        self.trajectories_deleted = self.shards_deleted = self.checkpoints_deleted = 0

    def after_checkpoint(self, iteration: int) -> None:
        from learner.checkpoint import prune_checkpoints

        self.checkpoints_deleted += len(prune_checkpoints(self.checkpoints, self.keep_checkpoints))
        if self.keep_batches:
            return
        upto = iteration - self.keep_iterations  # batches < upto are dead
        for j in range(self.reclaimed_below, max(upto, 0)):
            sel = self.dp.select(run=self.batch_name(j), status=None)
            if len(sel):
                self.trajectories_deleted += self.dp.delete([str(i) for i in sel.ids])
        if upto <= self.reclaimed_below:
            return
        self.reclaimed_below = upto
        dropped = self.dp.gc()["empty_shards_deleted"]  # orphans of puts in flight are young: gc keeps them
        self.shards_deleted += len(dropped)
        if self.dp.store.local:
            for parent in {os.path.dirname(rel) for rel in dropped}:
                try:
                    os.rmdir(self.dp.store.full_path(parent))
                except OSError:  # not empty (a batch spread over several puts), or already gone
                    pass

    def drop_earlier_starts(self, current: Path) -> list[Path]:
        """The rollout directories of earlier starts (interrupted attempts): nothing in them is live."""
        from core import fileio

        gone = [p for p in sorted(current.parent.glob("start-*")) if p != current and p.is_dir()]
        for p in gone:
            fileio.rmtree(p)
        return gone

    def stats(self) -> dict:
        return {"reclaimed_trajectories": self.trajectories_deleted, "reclaimed_shards": self.shards_deleted,
                "reclaimed_checkpoints": self.checkpoints_deleted}
