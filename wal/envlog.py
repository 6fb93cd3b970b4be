"""EnvLog: the per-sandbox environment log (tool invocations and results), durable on return.

Used by the sandbox service so a tool side effect happens at most once: log the invocation, run the
tool, log the result, and only then expose it; on replay reuse the recorded result. Shares the store,
the mutex and the group commit of its log directory, so concurrent calls from many server threads
share fsyncs.
"""
from __future__ import annotations

from pathlib import Path

from wal.config import WALConfig
from wal.store import Store
from wal.types import EnvEntry

__all__ = ["EnvEntry", "EnvLog"]


class EnvLog:
    def __init__(self, store_or_path: Store | str | Path, config: WALConfig | None = None, *,
                 repair: bool = False, owns_store: bool = True):
        if isinstance(store_or_path, Store):
            self._store = store_or_path
        else:
            self._store = Store(store_or_path, config, repair=repair)
        self._owns = owns_store

    def invoke(self, sandbox_id: str, seq: int, request: bytes) -> None:
        """Durably record invocation `seq` (must be the sandbox's next; exact repeats are accepted)."""
        self._store.env_invoke(sandbox_id, seq, request)

    def result(self, sandbox_id: str, seq: int, response: bytes) -> None:
        """Durably record the result of invocation `seq` (after its invoke; exact repeats accepted)."""
        self._store.env_result(sandbox_id, seq, response)

    def release(self, sandbox_id: str) -> None:
        """Durably mark the sandbox done: its records become reclaimable and further invoke/result calls
        raise FinalizedError (until retention reclaims the release record itself; then the id is forgotten).
        Idempotent. Not needed for correctness; it keeps the disk bounded in long runs."""
        self._store.env_release(sandbox_id)

    def get(self, sandbox_id: str, seq: int) -> EnvEntry | None:
        s = self._store
        with s.mutex:
            s.log.check_open()
            return s.env.get(sandbox_id, seq, s.log.durable_lsn)

    def entries(self, sandbox_id: str) -> list[EnvEntry]:
        s = self._store
        with s.mutex:
            s.log.check_open()
            return s.env.entries(sandbox_id, s.log.durable_lsn)

    def sandboxes(self) -> list[str]:
        s = self._store
        with s.mutex:
            durable = s.log.durable_lsn
            return sorted(sid for sid, es in s.env.sandboxes.items() if es and es[0].request_lsn <= durable)

    def stats(self) -> dict:
        return self._store.stats()

    def close(self) -> None:
        if self._owns:
            self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
