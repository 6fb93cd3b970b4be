"""TokenWAL: the in-process token log (a façade over Store)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from wal import codec, stepgroup
from wal.base import TokenLog
from wal.config import WALConfig
from wal.errors import FinalizedError
from wal.store import Store
from wal.types import Committed


class TokenWAL(TokenLog):
    appends_in_memory = True  # append / append_step only check and encode in memory; commit() does the I/O

    def __init__(self, path: str | Path, config: WALConfig | None = None, *, repair: bool = False):
        self._store = Store(path, config, repair=repair)
        self.path = self._store.log.directory

    @property
    def recovery(self):
        """What opening found: ScanReport (torn bytes cut, files kept aside, repair)."""
        return self._store.log.report

    def append(self, traj_id: str, start: int, tokens: Sequence[int], logprobs: Sequence[float], policy_version: int) -> int:
        return self._store.append_tokens(traj_id, start, tokens, logprobs, policy_version)

    def append_packed(self, traj_id: str, start: int, tokens: bytes, logprobs: bytes, policy_version: int) -> int:
        """`append` with tokens and log-probs already packed (int32 LE, float64 LE): no conversion."""
        return self._store.append_packed(traj_id, start, tokens, logprobs, policy_version)

    def append_step(self, traj_ids: Sequence[str], positions: Sequence[int], tokens: Sequence[int],
                    logprobs: Sequence[float], policy_version: int) -> None:
        """One batched decode step, checked as a whole before anything is written, logged as one STEP record
        (one frame, one checksum); many times cheaper than one append per trajectory."""
        if stepgroup.store_step is not None:  # the step group's next row: Store._step_fast in one C call
            taken = stepgroup.store_step(self._store, traj_ids, positions, tokens, logprobs, policy_version)
            if taken:
                if taken == 2:  # the batch passed max_batch_bytes: written now, as _step_fast does
                    self._store.log.commit()
                return
        self._store.append_step(traj_ids, positions, tokens, logprobs, policy_version)

    def commit(self) -> int:
        return self._store.commit()

    def _read(self, traj_id: str, lo: int = 0, hi: int | None = None, versions: bool = True):
        """Committed positions lo..hi (clamped) as (packed tokens, packed log-probs, versions, committed length)."""
        if type(traj_id) is not str:
            codec._id_bytes(traj_id, "traj_id")  # a clear error for an id of another type
        s = self._store
        with s.mutex:
            s.log.check_open()
            traj, n = s.tokens.read(traj_id, s.log.durable_lsn)
            if traj is None:
                return b"", b"", [], 0
            hi = n if hi is None else min(hi, n)
            lo = min(max(lo, 0), hi)
            return (*traj.packed(lo, hi), traj.versions(lo, hi) if versions else [], n)

    def tokens(self, traj_id: str) -> list[int]:
        return codec.unpack_tokens(self._read(traj_id, versions=False)[0])

    def logprobs(self, traj_id: str) -> list[float]:
        return codec.unpack_logprobs(self._read(traj_id, versions=False)[1])

    def policy_versions(self, traj_id: str) -> list[int]:
        return self._read(traj_id)[2]

    def read_many(self, traj_ids: Sequence[str]) -> dict[str, Committed | None]:
        out: dict[str, Committed | None] = {}
        for traj_id in traj_ids:
            try:
                tok, lp, versions, _ = self._read(traj_id)
            except FinalizedError:
                out[traj_id] = None
                continue
            out[traj_id] = Committed(codec.unpack_tokens(tok), codec.unpack_logprobs(lp), versions)
        return out

    def read_packed(self, traj_id: str, lo: int = 0, hi: int | None = None) -> tuple[bytes, bytes, list[int], int]:
        """Committed positions lo..hi as (packed int32 tokens, packed float64 log-probs, versions, committed length)."""
        return self._read(traj_id, lo, hi)

    def length(self, traj_id: str) -> int:
        """Number of committed tokens (where a resumed decode continues)."""
        if type(traj_id) is not str:
            codec._id_bytes(traj_id, "traj_id")
        s = self._store
        with s.mutex:
            s.log.check_open()
            return s.tokens.read(traj_id, s.log.durable_lsn)[1]

    def trajectories(self) -> list[str]:
        s = self._store
        with s.mutex:
            s.log.check_open()
            durable = s.log.durable_lsn
            return sorted(t for t, traj in s.tokens.trajs.items() if traj.settle(durable) > 0)

    def finalize(self, traj_id: str) -> None:
        self._store.finalize(traj_id)

    def finalize_many(self, traj_ids: Sequence[str]) -> int:
        """One commit for all; returns the durable lsn."""
        return self._store.finalize_many(traj_ids)

    def reclaim(self) -> int:
        """Run retention now (it also runs in the background after each segment roll)."""
        return self._store.reclaim()

    def envlog(self):
        """The environment log sharing this WAL's directory and group commit."""
        from wal.envlog import EnvLog

        return EnvLog(self._store, owns_store=False)

    def stats(self) -> dict:
        return self._store.stats()

    def close(self) -> None:
        self._store.close()
