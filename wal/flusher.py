"""Flusher: group commit for an asyncio event loop (the log service's streams).

`commit()` returns a future; one thread runs `wal.commit()` for every future registered before it started
(so for every append made before them) and resolves them together on the loop, which meanwhile keeps
receiving. A failed flush (a poisoned or closed log) reaches every waiter as that exception.
"""
from __future__ import annotations

import asyncio
import threading

from wal.tokenwal import TokenWAL


class Flusher:
    """Group commit for the event loop (see the module docstring)."""

    def __init__(self, wal: TokenWAL, loop: asyncio.AbstractEventLoop):
        self.wal, self.loop = wal, loop
        self.busy = False  # read on the loop: a flush is running, so an inline commit would only wait for it
        self._waiting: list[asyncio.Future] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="wal-flusher", daemon=True)
        self._thread.start()

    def commit(self) -> asyncio.Future:
        fut = self.loop.create_future()
        with self._lock:
            self._waiting.append(fut)
            self.busy = True
        self._wake.set()
        return fut

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                batch, self._waiting = self._waiting, []
                if not batch:
                    self.busy = False
                    if self._stop:
                        return
                    continue
            try:
                result, error = self.wal.commit(), None
            except BaseException as exc:  # every waiter gets it (a poisoned or closed log)
                result, error = None, exc
            self.loop.call_soon_threadsafe(_resolve, batch, result, error)
            self._wake.set()  # look again: more may have come while flushing

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self._wake.set()
        self._thread.join(timeout=60)


def _resolve(batch, result, error) -> None:
    for fut in batch:
        if not fut.done():
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
