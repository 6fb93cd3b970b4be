"""The interface every token log offers, in process (TokenWAL) or over gRPC (RemoteWAL)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from wal.types import Committed


class TokenLog(ABC):
    """Durable, token-granular log of sampled trajectories.

    `append` records tokens at positions start.. of a trajectory (contiguous from 0; an exact repeat is
    acknowledged, a gap or a rewrite is refused); `commit` returns once everything appended before it is
    durable; reads return committed tokens only; `finalize` says the trajectory is in the data plane.
    """

    @abstractmethod
    def append(self, traj_id: str, start: int, tokens: Sequence[int], logprobs: Sequence[float], policy_version: int) -> int:
        """Record tokens[i] at position start+i; returns start + len(tokens)."""

    def append_step(self, traj_ids: Sequence[str], positions: Sequence[int], tokens: Sequence[int],
                    logprobs: Sequence[float], policy_version: int) -> None:
        """One batched decode step: tokens[i] at positions[i] of traj_ids[i]. Same rules as append."""
        for i, traj_id in enumerate(traj_ids):
            self.append(traj_id, positions[i], [tokens[i]], [logprobs[i]], policy_version)

    @abstractmethod
    def commit(self) -> int:
        """Block until everything appended before this call is durable; returns the durable lsn."""

    @abstractmethod
    def tokens(self, traj_id: str) -> list[int]:
        """Committed token ids of the trajectory, in order ([] if unknown)."""

    @abstractmethod
    def logprobs(self, traj_id: str) -> list[float]:
        """Behaviour log-probs of the committed tokens."""

    @abstractmethod
    def policy_versions(self, traj_id: str) -> list[int]:
        """Policy version that sampled each committed token."""

    def read_many(self, traj_ids: Sequence[str]) -> dict[str, Committed | None]:
        """The committed tokens, log-probs and policy versions of each id (None for a finalized one): what
        admitting or finishing a batch of trajectories reads. A log service answers it in one round trip."""
        from wal.errors import FinalizedError

        out: dict[str, Committed | None] = {}
        for traj_id in traj_ids:
            try:
                out[traj_id] = Committed(self.tokens(traj_id), self.logprobs(traj_id), self.policy_versions(traj_id))
            except FinalizedError:
                out[traj_id] = None
        return out

    def length(self, traj_id: str) -> int:
        """Number of committed tokens: where a resumed decode continues."""
        return len(self.tokens(traj_id))

    @abstractmethod
    def trajectories(self) -> list[str]:
        """Ids of trajectories with committed tokens that are not finalized (what a restart must resume)."""

    @abstractmethod
    def finalize(self, traj_id: str) -> None:
        """Durably mark the trajectory as safely in the data plane; its records may then be reclaimed."""

    def finalize_many(self, traj_ids: Sequence[str]) -> None:
        """`finalize` each id (one already finalized is skipped); a log may make them durable with one commit."""
        from wal.errors import FinalizedError

        for traj_id in traj_ids:
            try:
                self.finalize(traj_id)
            except FinalizedError:
                pass

    @abstractmethod
    def stats(self) -> dict:
        """Counters of the log (segments, bytes, lsns, fsyncs, …)."""

    @abstractmethod
    def close(self) -> None:
        """Commit what is pending and release the log."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
