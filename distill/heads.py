"""Teacher output heads, one resident on the compute device at a time.

A head ([V, H_teacher], the largest tensor of a teacher at large vocabularies) is read from its
checkpoint's safetensors alone, on demand. `HeadScheduler.resident(name)` drops the head it holds
before it materialises the next one on the device, so at most one is ever resident; a background
thread reads the next scheduled head from storage into host memory (pinned on CUDA) while the
current one is in use, and on CUDA the copy to the device runs on a side stream.
"""
from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

from distill.teachers import Teacher


def read_head(teacher: Teacher, pin: bool = False) -> torch.Tensor:
    """The head tensor of `teacher` in host memory, read from its safetensors file only."""
    from safetensors import safe_open

    with safe_open(str(Path(teacher.path) / teacher.head_file), framework="pt") as st:
        head = st.get_tensor(teacher.head_key)
    return head.pin_memory() if pin else head


class HeadScheduler:
    """Hands out teacher heads on `device`; counts loads and how many were ever resident at once."""

    def __init__(self, teachers: dict[str, Teacher], device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, prefetch: bool = True):
        self.teachers = teachers
        self.device = torch.device(device)
        self.dtype = dtype
        self.prefetch = prefetch
        self.pin = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.pin else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="head-prefetch") if prefetch else None
        self._staged: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._current: tuple[str, torch.Tensor] | None = None
        self._issued: list[weakref.ref] = []  # every device head handed out, to count the live ones
        self.loads = 0
        self.loads_by_teacher: dict[str, int] = {}
        self.max_resident = 0

    def _check(self, name: str) -> Teacher:
        if name not in self.teachers:
            raise KeyError(f"unknown teacher {name!r}; known: {sorted(self.teachers)}")
        return self.teachers[name]

    def stage(self, name: str) -> None:
        """Start reading `name`'s head into host memory in the background (no device memory used)."""
        if self._pool is None or name in self._staged:
            return
        teacher = self._check(name)
        with self._lock:
            self._staged[name] = self._pool.submit(read_head, teacher, self.pin)

    def _host_copy(self, name: str) -> torch.Tensor:
        fut = self._staged.pop(name, None)
        return fut.result() if fut is not None else read_head(self._check(name), self.pin)

    def resident_heads(self) -> int:
        """Device heads handed out that are still alive (held by anyone)."""
        self._issued = [r for r in self._issued if r() is not None]
        return len(self._issued)

    def release(self) -> None:
        """Drop the resident head (e.g. at the end of a minibatch)."""
        self._current = None

    @contextmanager
    def resident(self, name: str, then: str | None = None):
        """The head of `name` on the device for the body of the `with`; `then` is staged meanwhile."""
        if self._current is None or self._current[0] != name:
            self._current = None  # drop the old head first: never two on the device
            host = self._host_copy(name)
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    head = host.to(self.device, dtype=self.dtype or host.dtype, non_blocking=True)
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            else:
                head = host.to(self.device, dtype=self.dtype or host.dtype)
            del host
            self._current = (name, head)
            self._issued.append(weakref.ref(head))
            self.loads += 1
            self.loads_by_teacher[name] = self.loads_by_teacher.get(name, 0) + 1
            self.max_resident = max(self.max_resident, self.resident_heads())
        if then is not None and then != name:
            self.stage(then)
        yield self._current[1]

    def stats(self) -> dict:
        return {"head_loads": self.loads, "max_resident_heads": self.max_resident,
                **{f"head_loads_{k}": v for k, v in sorted(self.loads_by_teacher.items())}}

    def close(self) -> None:
        self._current = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
