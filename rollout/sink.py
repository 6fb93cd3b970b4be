"""Where finished trajectories go: the data plane (metadata + heavy fields), idempotent per trajectory id."""
from __future__ import annotations

import numpy as np

from rollout.types import Finished


class DataPlaneSink:
    """`put(finished)` writes the trajectories the catalog does not hold yet (one shard per call)."""

    def __init__(self, catalog_url: str, store_root: str, run: str):
        import dataplane

        self.dp = dataplane.open(catalog_url, store_root)
        self.run = run
        # the pool is this run's only writer: what the catalog holds now plus what we put since
        self._have = set(self.dp.select(run=run, status=None).ids.tolist())

    def put(self, finished: list[Finished]) -> int:
        from dataplane import TrajectoryRecord

        if not finished:
            return 0
        records = []
        for f in finished:
            if f.traj_id in self._have:
                continue  # a repeat after a worker died before its WAL finalize: already stored
            mask = np.array(f.loss_mask, dtype=np.uint8)
            versions = [v for v, m in zip(f.policy_versions, mask) if m] or [0]
            records.append(TrajectoryRecord(
                id=f.traj_id, run=self.run, domain=f.domain, prompt=f.prompt, group_id=f.prompt,
                tokens=np.array(f.tokens, dtype=np.int32), loss_mask=mask,
                logprobs=np.where(mask.astype(bool), np.array(f.logprobs), 0.0).astype(np.float32),
                reward=f.reward, policy_min=min(versions), policy_max=max(versions), status="complete",
                meta={"tokens_hash": f.token_hash}))
        if records:
            self.dp.put(records)
            self._have.update(r.id for r in records)
        return len(records)

    def close(self) -> None:
        self.dp.close()
