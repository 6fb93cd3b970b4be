"""In-memory per-sandbox environment log index (pure; the caller holds the log's mutex).

A sandbox's entries are numbered 0, 1, 2, … Invocation `seq` must be the next one; its result may only
follow its invocation. Exact repeats are acknowledged without writing; a different payload at a
recorded place is a ConflictError. Reads return durable entries only.
"""
from __future__ import annotations

from wal.errors import ConflictError, CorruptionError, FinalizedError, GapError
from wal.types import EnvEntry


class _Entry:
    __slots__ = ("request", "request_lsn", "response", "response_lsn")

    def __init__(self, request: bytes, request_lsn: int):
        self.request, self.request_lsn = request, request_lsn
        self.response: bytes | None = None
        self.response_lsn = -1


class EnvIndex:
    def __init__(self) -> None:
        self.sandboxes: dict[str, list[_Entry]] = {}
        self.released: set[str] = set()  # forgotten again when their release record is reclaimed
        self._replay: dict[str, dict[int, list]] = {}

    def _check_live(self, sandbox_id: str) -> None:
        if sandbox_id in self.released:
            raise FinalizedError(f"sandbox {sandbox_id!r} was released; its log takes no more entries")

    def release(self, sandbox_id: str) -> bool:
        """Mark released and drop its entries; False if it already was."""
        if sandbox_id in self.released:
            return False
        self.sandboxes.pop(sandbox_id, None)
        self._replay.pop(sandbox_id, None)
        self.released.add(sandbox_id)
        return True

    def needs_invoke(self, sandbox_id: str, seq: int, request: bytes) -> bool:
        self._check_live(sandbox_id)
        entries = self.sandboxes.get(sandbox_id, ())
        if seq < 0:
            raise GapError(f"sandbox {sandbox_id!r}: seq {seq} is negative")
        if seq < len(entries):
            if entries[seq].request != request:
                raise ConflictError(f"sandbox {sandbox_id!r}: invocation {seq} is recorded with a different request "
                                    f"({len(entries[seq].request)} B recorded, {len(request)} B given)")
            return False
        if seq > len(entries):
            raise GapError(f"sandbox {sandbox_id!r}: invocation {seq} skips ahead; the next one is {len(entries)}")
        return True

    def needs_result(self, sandbox_id: str, seq: int, response: bytes) -> bool:
        self._check_live(sandbox_id)
        entries = self.sandboxes.get(sandbox_id, ())
        if not 0 <= seq < len(entries):
            raise GapError(f"sandbox {sandbox_id!r}: result for invocation {seq}, which is not recorded "
                           f"({len(entries)} invocations so far)")
        have = entries[seq].response
        if have is None:
            return True
        if have != response:
            raise ConflictError(f"sandbox {sandbox_id!r}: invocation {seq} already has a different result "
                                f"({len(have)} B recorded, {len(response)} B given); replay must reuse the recorded result")
        return False

    def apply_invoke(self, sandbox_id: str, seq: int, request: bytes, lsn: int) -> None:
        entries = self.sandboxes.setdefault(sandbox_id, [])
        if seq != len(entries):
            raise AssertionError(f"apply_invoke {seq} on {len(entries)} entries")
        entries.append(_Entry(bytes(request), lsn))

    def apply_result(self, sandbox_id: str, seq: int, response: bytes, lsn: int) -> None:
        entry = self.sandboxes[sandbox_id][seq]
        entry.response, entry.response_lsn = bytes(response), lsn

    def get(self, sandbox_id: str, seq: int, durable_lsn: int) -> EnvEntry | None:
        entries = self.sandboxes.get(sandbox_id, ())
        if not 0 <= seq < len(entries) or entries[seq].request_lsn > durable_lsn:
            return None
        e = entries[seq]
        return EnvEntry(seq, e.request, e.response if e.response_lsn <= durable_lsn and e.response is not None else None)

    def entries(self, sandbox_id: str, durable_lsn: int) -> list[EnvEntry]:
        out = []
        for seq in range(len(self.sandboxes.get(sandbox_id, ()))):
            e = self.get(sandbox_id, seq, durable_lsn)
            if e is None:
                break
            out.append(e)
        return out

    # --- recovery: records may arrive out of seq order (compaction copies them forward) ---
    def replay(self, kind: str, sandbox_id: str, seq: int, data: bytes, lsn: int) -> None:
        if sandbox_id in self.released:
            return  # a dead copy
        slot = self._replay.setdefault(sandbox_id, {}).setdefault(seq, [None, None])
        i = 0 if kind == "invoke" else 1
        if slot[i] is not None and slot[i] != data:
            raise CorruptionError(f"sandbox {sandbox_id!r}: two different {kind} records for seq {seq} in the log")
        slot[i] = data

    def finish_replay(self, lsn: int) -> None:
        for sid, by_seq in self._replay.items():
            entries = self.sandboxes.setdefault(sid, [])
            for seq in range(len(by_seq)):
                if seq not in by_seq or by_seq[seq][0] is None:
                    raise CorruptionError(f"sandbox {sid!r}: the log lacks invocation {seq} but holds later entries")
                request, response = by_seq[seq]
                entries.append(_Entry(request, lsn))
                if response is not None:
                    entries[-1].response, entries[-1].response_lsn = response, lsn
        self._replay = {}
