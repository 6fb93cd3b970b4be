"""A memory cgroup per execution slot: one bound on the memory of a whole execution, all its processes and
its /tmp, and an out-of-memory kill the service reads from the kernel, not from the tool's own output.

RLIMIT_AS bounds each process; an execution of `processes` processes could hold that many times as much. A
cgroup counts what the execution's processes touch (anonymous memory, tmpfs pages, page cache) together and
has the kernel kill a process of it when the sum passes the limit; its `oom_kill` counter, read before and
after a run, says whether that happened.

Both hierarchies are handled: cgroup v2 (a `cgroup2` mount whose controllers include memory: `memory.max`,
`memory.swap.max`, `memory.events`) and the v1 memory controller (`memory.limit_in_bytes`,
`memory.memsw.limit_in_bytes`, `memory.oom_control`). The slot cgroups live under one directory per service
process, `postrain-sandbox-<pid>`: v1 below the service's own memory cgroup (the limits nest inside its
own), v2 beside it (a v2 cgroup that holds processes may not also hold children with controllers).
Creating them needs write access to the hierarchy, in practice root; `find()` says why not where it fails.

A process enters its slot's cgroup before bubblewrap starts (`enter_argv`: a shell writes its own pid to
`cgroup.procs`, then execs the sandbox), so everything the execution forks is counted from its first page.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from core.procs import pid_alive

PREFIX = "postrain-sandbox-"


class CgroupUnavailable(RuntimeError):
    """No memory cgroup hierarchy this process may create cgroups in."""


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, options) of every cgroup mount."""
    out = []
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            out.append((parts[1].replace("\\040", " "), parts[2], set(parts[3].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per hierarchy: key 'v2' for the unified one, else each v1 controller."""
    paths = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in (controllers.split(",") if controllers else ["v2"]):
            paths[c] = path
    return paths


def _within(mount: str, path: str) -> Path:
    return Path(mount) / path.lstrip("/")


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def find() -> tuple[int, Path]:
    """(version, the directory the service's cgroups go in): v2 where its memory controller is available,
    else v1's memory controller. Raises CgroupUnavailable saying why neither is usable."""
    own = _own_paths()
    why = []
    for mount, kind, opts in _mounts():
        if kind == "cgroup2" and "v2" in own:
            path = own["v2"]
            parent = _within(mount, path if path == "/" else os.path.dirname(path))
            try:
                controllers = (parent / "cgroup.controllers").read_text().split()
            except OSError as exc:
                why.append(f"cgroup v2 at {mount}: {exc.strerror}")
                continue
            if "memory" not in controllers:
                why.append(f"cgroup v2 at {mount}: no memory controller in {parent}")
                continue
            return 2, parent
    for mount, kind, opts in _mounts():
        if kind == "cgroup" and "memory" in opts and "memory" in own:
            return 1, _within(mount, own["memory"])
    why.append("no cgroup v1 memory controller mounted")
    raise CgroupUnavailable("; ".join(why))


def _current(path: Path) -> int:
    """A v1 limit file's value (0 where it cannot be read: a fresh cgroup, whose limit is unlimited)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


    return True


class SlotCgroups:
    """The memory cgroups of one Isolator's execution slots. Each slot's limit is set when a process enters
    it (swap included where the kernel accounts it). Raises CgroupUnavailable where they cannot be created
    and limited."""

    _made = 0  # Isolators of this process so far: each has a directory of its own

    def __init__(self):
        self.version, parent = find()
        _remove_stale(parent)
        SlotCgroups._made += 1
        self.base = parent / f"{PREFIX}{os.getpid()}-{SlotCgroups._made}"
        self._slots: dict[int, tuple[Path, int]] = {}  # slot -> (its directory, its limit now)
        try:
            self.base.mkdir(exist_ok=True)
            if self.version == 2:
                if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                    _write(parent / "cgroup.subtree_control", "+memory")
                _write(self.base / "cgroup.subtree_control", "+memory")
                _write(self.base / "memory.max", "max")
            else:
                _write(self.base / "memory.limit_in_bytes", "-1")
        except OSError as exc:
            self.close()
            raise CgroupUnavailable(f"cannot create memory cgroups in {parent}: {exc.strerror}") from None

    def _limit(self, d: Path, limit: int) -> None:
        try:
            d.mkdir(exist_ok=True)
            if self.version == 2:
                _write(d / "memory.max", str(limit))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
            else:  # v1 keeps memsw (memory + swap) >= the plain limit: raise memsw first, lower it last
                files = ["memory.limit_in_bytes"]
                if (d / "memory.memsw.limit_in_bytes").exists():
                    raising = limit >= _current(d / files[0])
                    files = ["memory.memsw.limit_in_bytes", *files] if raising else [*files, "memory.memsw.limit_in_bytes"]
                for name in files:
                    _write(d / name, str(limit))
        except OSError as exc:
            raise CgroupUnavailable(f"cannot limit memory cgroup {d} to {limit} bytes: {exc.strerror}") from None

    def procs(self, slot: int, limit: int) -> str:
        """The `cgroup.procs` file a process writes its pid to, to enter slot `slot`'s cgroup, limited to
        `limit` bytes."""
        d, now = self._slots.get(slot, (self.base / f"slot-{slot}", 0))
        if now != limit:
            self._limit(d, limit)
            self._slots[slot] = (d, limit)
        return str(d / "cgroup.procs")

    def enter_argv(self, slot: int, limit: int, argv: list[str]) -> list[str]:
        """`argv` run from inside slot `slot`'s cgroup: the shell moves itself in, then execs it."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', self.procs(slot, limit), *argv]

    def oom_kills(self, slot: int) -> int:
        """How many processes the kernel has killed for memory in slot `slot`'s cgroup so far."""
        if slot not in self._slots:
            return 0
        d = self._slots[slot][0]
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (d / name).read_text()
        except OSError:
            return 0
        m = re.search(r"^oom_kill (\d+)$", text, re.M)
        return int(m.group(1)) if m else 0

    def slots(self) -> list[int]:
        """The slots whose cgroups exist."""
        return sorted(self._slots)

    def close(self, wait_s: float = 2.0) -> None:
        """Remove the slot cgroups and the service's directory. The kernel tears a killed sandbox down
        asynchronously, so removal is retried for `wait_s` (the caller has killed what ran in them)."""
        dirs = [*(d for d, _ in self._slots.values()), self.base]
        deadline = time.monotonic() + wait_s
        for d in dirs:
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.01)
        self._slots = {}


def _remove_stale(parent: Path) -> None:
    """Remove the empty cgroups of services that are gone (a crash leaves them behind)."""
    try:
        entries = [e for e in parent.iterdir() if e.name.startswith(PREFIX)]
    except OSError:
        return
    for e in entries:
        pid = e.name[len(PREFIX):].split("-")[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        for d in [*e.glob("slot-*"), e]:
            try:
                d.rmdir()
            except OSError:
                pass
