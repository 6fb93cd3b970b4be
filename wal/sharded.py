"""ShardedWAL: one TokenLog over several log services, a trajectory's records all on one shard.

The shard of a trajectory is crc32(traj_id) mod n over the ordered address list (the shard map of
the run's config), so every writer and every reader finds a trajectory on the same service without
asking anyone. The order of the list is the map: a run must keep it for its whole life (a resumed run
with another order would look for trajectories on the wrong services and re-sample them).

`commit` commits every shard that received appends since the last commit (in order), and returns
the sum of their durable lsns (monotonic, only meaningful as "it returned"). Reads, `finalize` and
`length` go to the trajectory's shard; `trajectories` lists every shard.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from wal import codec
from wal.base import TokenLog
from wal.store import _index
from wal.types import Committed


def shard_of(traj_id: str, shards: int) -> int:
    """The shard index of `traj_id` among `shards` services (stable across processes and machines)."""
    return zlib.crc32(traj_id.encode()) % shards


def parse_addresses(spec: str | Sequence[str]) -> list[str]:
    """"a:1,b:2" or ["a:1", "b:2"] -> ["a:1", "b:2"] (blanks dropped; a repeated address is refused)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = [a.strip() for a in items if a and a.strip()]
    if len(set(out)) != len(out):
        raise ValueError(f"WAL shard map {out}: an address appears twice")
    return out


class ShardedWAL(TokenLog):
    def __init__(self, logs: Sequence[TokenLog]):
        if not logs:
            raise ValueError("ShardedWAL needs at least one log")
        self.logs = list(logs)
        self._dirty: set[int] = set()
        self._lsns = [0] * len(self.logs)  # the last durable lsn each shard returned

    def _log(self, traj_id: str) -> tuple[int, TokenLog]:
        k = shard_of(traj_id, len(self.logs))
        return k, self.logs[k]

    def append(self, traj_id: str, start: int, tokens: Sequence[int], logprobs: Sequence[float], policy_version: int) -> int:
        k, log = self._log(traj_id)
        end = log.append(traj_id, start, tokens, logprobs, policy_version)
        self._dirty.add(k)
        return end

    def append_step(self, traj_ids: Sequence[str], positions: Sequence[int], tokens: Sequence[int],
                    logprobs: Sequence[float], policy_version: int) -> None:
        """The step split by shard. Its values (types, ranges, NaN, counts, ids) are checked whole before any
        shard gets its part; what only a shard can check (a gap, a rewrite) fails that shard's part alone."""
        tok = np.frombuffer(codec.pack_tokens(tokens), codec.TOKEN_DTYPE)
        n = len(tok)
        lp = np.frombuffer(codec.pack_logprobs(logprobs, n), codec.LOGPROB_DTYPE)
        if len(traj_ids) != n or len(positions) != n:
            raise codec.CodecError(f"append_step: {len(traj_ids)} trajectory ids, {len(positions)} positions, {n} "
                                   "tokens; there must be one of each per trajectory")
        pos = np.frombuffer(codec.pack_positions(positions), "<i8")
        policy_version = codec.check_u64(_index(policy_version, "policy_version"), "policy_version")
        parts: dict[int, list[int]] = {}
        for i, t in enumerate(traj_ids):
            codec._id_bytes(t, "traj_id")
            parts.setdefault(shard_of(t, len(self.logs)), []).append(i)
        for k, idx in parts.items():
            self.logs[k].append_step([traj_ids[i] for i in idx], pos[idx], tok[idx], lp[idx], policy_version)
            self._dirty.add(k)

    def commit(self) -> int:
        dirty, self._dirty = sorted(self._dirty), set()
        for k in dirty:
            try:
                self._lsns[k] = self.logs[k].commit()
            except BaseException:
                self._dirty.update(dirty[dirty.index(k):])  # not confirmed: the next commit tries again
                raise
        return sum(self._lsns)

    def tokens(self, traj_id: str) -> list[int]:
        return self._log(traj_id)[1].tokens(traj_id)

    def logprobs(self, traj_id: str) -> list[float]:
        return self._log(traj_id)[1].logprobs(traj_id)

    def policy_versions(self, traj_id: str) -> list[int]:
        return self._log(traj_id)[1].policy_versions(traj_id)

    def length(self, traj_id: str) -> int:
        return self._log(traj_id)[1].length(traj_id)

    def _by_shard(self, traj_ids: Sequence[str]) -> dict[int, list[str]]:
        parts: dict[int, list[str]] = {}
        for t in traj_ids:
            parts.setdefault(shard_of(t, len(self.logs)), []).append(t)
        return parts

    def read_many(self, traj_ids: Sequence[str]) -> dict[str, Committed | None]:
        got: dict[str, Committed | None] = {}
        for k, ids in self._by_shard(traj_ids).items():
            got.update(self.logs[k].read_many(ids))
        return {t: got[t] for t in traj_ids}

    def finalize_many(self, traj_ids: Sequence[str]) -> None:
        for k, ids in self._by_shard(traj_ids).items():
            self.logs[k].finalize_many(ids)
            self._dirty.discard(k)

    def trajectories(self) -> list[str]:
        return [t for log in self.logs for t in log.trajectories()]

    def finalize(self, traj_id: str) -> None:
        k, log = self._log(traj_id)
        log.finalize(traj_id)
        self._dirty.discard(k)  # a remote finalize commits what came before it

    def stats(self) -> dict:
        return {"shards": [log.stats() for log in self.logs]}

    def close(self) -> None:
        errors = []
        for log in self.logs:
            try:
                log.close()
            except Exception as exc:  # close every shard; report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]
