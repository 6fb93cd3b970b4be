"""Teacher output heads, one resident on the compute device at a time.

A head ([V, H_teacher], the largest tensor of a teacher at large vocabularies) is read from its
checkpoint's safetensors alone. `HostHeads` keeps the heads read so far in host memory (pinned on
CUDA, already in the dtype the device wants) under a byte budget, so a head is read from storage and
pinned once per run and a load is then only the copy to the device.

`HeadScheduler` hands heads out on the device and never holds two: `resident(name)` drops the head it
holds before it materialises the next; `swap(name)` drops the resident head as soon as its last user
is done and starts copying the next one to the device on a side stream (CUDA), so the copy runs
while the caller computes something that needs no teacher head (the student's trunk backward and
forward) and the next `resident(name)` only waits for what is left of it. A background thread reads
heads that are not in host memory yet (`stage`). Every device head it hands out is counted while it
is alive (weak references), so a head someone kept shows up in `max_resident`.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from distill.teachers import Teacher


def read_head(teacher: Teacher, pin: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The head tensor of `teacher` in host memory (in `dtype` when given), read from its safetensors file only."""
    from safetensors import safe_open

    with safe_open(str(Path(teacher.path) / teacher.head_file), framework="pt") as st:
        head = st.get_tensor(teacher.head_key)
    if dtype is not None and head.dtype != dtype:
        head = head.to(dtype)
    if not pin:
        return head
    out = torch.empty(head.shape, dtype=head.dtype, pin_memory=True)
    out.copy_(head)
    return out


class HostHeads:
    """Heads in host memory, least recently used dropped first, at most `budget_bytes` in all.

    A head larger than the whole budget is read for each use and not kept."""

    def __init__(self, teachers: dict[str, Teacher], budget_bytes: int, pin: bool, dtype: torch.dtype | None):
        if budget_bytes < 0:
            raise ValueError(f"host head budget must be >= 0 bytes, got {budget_bytes}")
        self.teachers, self.budget_bytes, self.pin, self.dtype = teachers, int(budget_bytes), pin, dtype
        self._kept: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0  # heads read from storage

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._kept.values())

    def get(self, name: str) -> torch.Tensor:
        with self._lock:
            head = self._kept.get(name)
            if head is not None:
                self._kept.move_to_end(name)
                return head
        head = read_head(self.teachers[name], self.pin, self.dtype)
        size = head.numel() * head.element_size()
        with self._lock:
            self.reads += 1
            if size <= self.budget_bytes and name not in self._kept:
                while self._kept and sum(t.numel() * t.element_size() for t in self._kept.values()) + size > self.budget_bytes:
                    self._kept.popitem(last=False)
                self._kept[name] = head
        return head

    def holds(self, name: str) -> bool:
        with self._lock:
            return name in self._kept

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


class HeadScheduler:
    """Hands out teacher heads on `device`; counts loads and how many were ever resident at once."""

    def __init__(self, teachers: dict[str, Teacher], device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, prefetch: bool = True, host_budget_bytes: int = 16 << 30):
        self.teachers = teachers
        self.device = torch.device(device)
        self.dtype = dtype
        self.prefetch = prefetch
        cuda = self.device.type == "cuda"
        self.host = HostHeads(teachers, host_budget_bytes, pin=cuda, dtype=dtype)
        self.stream = torch.cuda.Stream(self.device) if cuda and prefetch else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="head-read") if prefetch else None
        self._staged: dict[str, Future] = {}
        self._current: tuple[str, torch.Tensor] | None = None
        self._pending: tuple[str, torch.Tensor, object] | None = None  # (name, head, copy-done event)
        self._issued: list[weakref.ref] = []  # every device head made, to count the live ones
        self.loads = 0  # heads taken into use
        self.copies = 0  # heads copied to the device
        self.unused_copies = 0  # copied ahead and dropped unused (the next head was another)
        self.loads_by_teacher: dict[str, int] = {}
        self.max_resident = 0

    def _check(self, name: str) -> Teacher:
        if name not in self.teachers:
            raise KeyError(f"unknown teacher {name!r}; known: {sorted(self.teachers)}")
        return self.teachers[name]

    def stage(self, name: str) -> None:
        """Start reading `name`'s head into host memory in the background (no device memory used)."""
        self._check(name)
        if self._pool is None or name in self._staged or self.host.holds(name):
            return
        self._staged[name] = self._pool.submit(self.host.get, name)

    def _host_copy(self, name: str) -> torch.Tensor:
        fut = self._staged.pop(name, None)
        if fut is not None:
            return fut.result()
        self._check(name)
        return self.host.get(name)

    def resident_heads(self) -> int:
        """Device heads made that are still alive (held by anyone)."""
        self._issued = [r for r in self._issued if r() is not None]
        return len(self._issued)

    def _drop(self) -> None:
        if self._pending is not None:
            self.unused_copies += 1
        self._current = self._pending = None

    def _copy_to_device(self, name: str) -> tuple[torch.Tensor, object]:
        """Drop every head held, then start `name`'s copy to the device; (head, event marking its end)."""
        self._drop()  # never two on the device
        host = self._host_copy(name)
        if self.device.type != "cuda":
            head = host.to(self.dtype or host.dtype, copy=True)  # a device head apart from the host copy
            done = None
        else:
            compute = torch.cuda.current_stream(self.device)
            # Made on the compute stream: it reuses the block of the head just dropped.
            head = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            side = self.stream or compute
            side.wait_stream(compute)  # the block's earlier users finish before the copy writes it
            with torch.cuda.stream(side):
                head.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        self._issued.append(weakref.ref(head))
        self.copies += 1
        self.max_resident = max(self.max_resident, self.resident_heads())
        return head, done

    def swap(self, name: str | None) -> None:
        """Drop the resident head now (its users must be done with it and hold no reference) and, when
        `name` is given, start copying that head to the device; the next `resident(name)` takes it.
        Keeps the resident head when it already is `name`."""
        held = (self._current or self._pending or (None,))[0]
        if name is not None and held == name:
            return
        if name is None:
            self._drop()
            return
        head, done = self._copy_to_device(name)
        self._pending = (name, head, done)

    def release(self) -> None:
        """Drop every head on the device (e.g. at the end of a minibatch)."""
        self._drop()

    @contextmanager
    def resident(self, name: str, then: str | None = None):
        """The head of `name` on the device for the body of the `with`; `then` is read into host memory meanwhile."""
        if self._current is None or self._current[0] != name:
            if self._pending is not None and self._pending[0] == name:
                _, head, done = self._pending
                self._pending = None
            else:
                head, done = self._copy_to_device(name)
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
            self._current = (name, head)
            del head
            self.loads += 1
            self.loads_by_teacher[name] = self.loads_by_teacher.get(name, 0) + 1
        if then is not None and then != name:
            self.stage(then)
        yield self._current[1]

    def stats(self) -> dict:
        return {"head_loads": self.loads, "max_resident_heads": self.max_resident,
                "head_reads_from_storage": self.host.reads,
                **{f"head_loads_{k}": v for k, v in sorted(self.loads_by_teacher.items())}}

    def close(self) -> None:
        self._drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.host.clear()
