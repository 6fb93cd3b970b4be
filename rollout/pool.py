"""RolloutPool: feeds Ray rollout workers, collects finished trajectories, survives worker death.

Each worker slot k owns an in-process WAL directory (RUN/wal/k) and a share of the requests (request
i goes to slot i mod W, at most `max_batch` of them in the worker at once). When a worker dies
(`ray.kill`, SIGKILL of its process, a failed call), the pool starts a replacement on the same slot
(a warm spare when one is ready) and resubmits the slot's unfinished requests: the replacement
resumes them from the WAL. The other workers keep running while a replacement starts. A preemption notice (`preempt`) costs less: the worker snapshots the KV of
its requests and resumes them itself from the snapshots. Finished trajectories go to the
sink (the data plane) first, and are acknowledged to the worker afterwards, which only then
finalizes them in its WAL.

The pool also audits the stream it received: every committed token it was shown must appear at its
position in the final trajectory (`tokens_lost`), and no position may be reported twice
(`tokens_resampled`).

The hooks at the end (`preempt`, `kill`, `worker_pid`, `worker_node`, `warm_spares`, `starting`, `incarnation`, `in_flight`, `seen`,
`snapshot_path`) are what an operator or a fault-injection drill (`chaos/`) uses from outside; the pool
holds no fault code.
"""
from __future__ import annotations

import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from rollout.config import EngineConfig, PoolConfig
from rollout.ray_cluster import init_ray
from rollout.types import Finished, Request, WorkerReport
from rollout.worker import WorkerSpec


@dataclass
class _Slot:
    index: int
    spec: WorkerSpec
    actor: object = None
    pid: int = 0
    node: str = ""  # Ray node id of the current incarnation
    nodes: list = field(default_factory=list)  # node id of every incarnation, in order
    running_since: dict = field(default_factory=dict)  # incarnation -> monotonic time its first call came back
    incarnation: int = 0
    ref: object = None  # the outstanding run() call
    boot: object = None  # the outstanding start of a new incarnation (the slot runs nothing meanwhile)
    boot_spare: bool = False  # that start is a warm spare's
    boot_since: float = 0.0  # monotonic time that start was asked for
    backlog: deque = field(default_factory=deque)  # requests not yet handed to the current incarnation
    inside: set = field(default_factory=set)  # handed to the current incarnation, not finished
    acks: list = field(default_factory=list)  # finished + stored, to finalize on the next call
    unconfirmed: list = field(default_factory=list)  # acks sent in the outstanding call


@dataclass
class PoolResult:
    finished: dict[str, Finished]
    counters: Counter
    tokens_lost: int
    tokens_resampled: int
    replacements: int
    wall_s: float
    worker_nodes: dict[int, list[str]] = field(default_factory=dict)  # slot -> Ray node id of each incarnation


class RolloutPool:
    def __init__(self, checkpoint: str | Path, run_dir: str | Path, pool: PoolConfig, engine: EngineConfig,
                 *, sink=None, max_tool_calls: int = 4, use_tools: bool = True, progress=None, spares: int = 0):
        import ray

        init_ray(num_cpus=pool.local_cpus)
        self.ray = ray
        self.cfg, self.sink, self.progress = pool, sink, progress
        self.run_dir = Path(run_dir)
        self.sandbox = None
        sandboxes = [a.strip() for a in pool.sandbox_addr.split(",") if a.strip()]
        token = os.environ.get("POSTRAIN_SANDBOX_TOKEN", "")
        target = ",".join(sandboxes)
        if use_tools and not target:  # embedded default: a local sandbox service for this run
            from rewards.sandbox.config import SandboxConfig
            from rewards.sandbox.server import SandboxServer

            self.sandbox = SandboxServer(SandboxConfig(log_dir=self.run_dir / "sandbox",
                                                       isolate_pure_tools=pool.sandbox_isolate_pure))
            target, token = self.sandbox.target, self.sandbox.token
            sandboxes = [target]
        snap = pool.snapshot_uri or str(self.run_dir / "kv")
        self.weights_ref, self.version = None, 0
        self.slots = [
            _Slot(k, WorkerSpec(name=f"w{k}", checkpoint=str(checkpoint), wal_path=str(self.run_dir / "wal" / str(k)),
                                snapshot_uri=snap, seed=pool.seed, engine=engine, threads=pool.threads_per_worker,
                                wal_addr=pool.wal_addr, wal_token=os.environ.get("POSTRAIN_WAL_TOKEN") or None,
                                sandbox_target=sandboxes[k % len(sandboxes)] if use_tools and sandboxes else "",
                                sandbox_token=token, max_tool_calls=max_tool_calls,
                                max_commit_lag=pool.max_commit_lag, commit_group_steps=pool.commit_group_steps,
                                wal_segment_bytes=pool.wal_segment_bytes, split_restore=pool.split_restore))
            for k in range(pool.workers)
        ]
        # Warm spares: actor processes with their imports done, waiting to take over a dead worker's slot
        # (a cold actor start is most of a replacement's cost).
        self.spares, self._spares = spares, deque()  # (actor, ping): the ping answers once the spare is up
        # Set before the first start: a first actor that dies starting is already a replacement.
        self.replacements = 0
        self._dead_counters: Counter = Counter()
        self._live_counters: dict[int, dict] = {}
        self._start(*self.slots)  # all at once: each actor imports torch and loads the policy in parallel

    # -- lifecycle --------------------------------------------------------------------------
    def _actor(self, *args):
        """A new rollout actor with the pool's resources per worker (config) and placement strategy."""
        from rollout.worker import RolloutActor

        c = self.cfg
        return RolloutActor.options(name=None, num_cpus=c.worker_cpus, num_gpus=c.worker_gpus,
                                    scheduling_strategy=c.worker_strategy).remote(*args)

    def _start(self, *slots: _Slot) -> None:
        """Start every slot's worker and wait until all are up (the pool's first workers)."""
        for slot in slots:
            self._boot(slot)
        self._await_boot(*slots)
        self._refill()

    def _boot(self, slot: _Slot) -> None:
        """Give `slot` its next actor without waiting: a warm spare takes the slot's spec, else a fresh actor
        starts with it. The pool keeps running its other workers meanwhile; `_booted` finishes the start."""
        if self._spares:
            slot.actor, _ = self._spares.popleft()
            slot.boot = slot.actor.start.remote(slot.spec, self.weights_ref, self.version)
            slot.boot_spare = True
        else:
            slot.actor = self._actor(slot.spec, self.weights_ref, self.version)
            slot.boot = slot.actor.ident.remote()
            slot.boot_spare = False
        slot.boot_since = time.monotonic()  # pid and node stay the last incarnation's until `_booted`

    def _recovering(self) -> bool:
        """A slot's worker is starting, or its new incarnation has not yet answered its first call."""
        return any(s.boot is not None or s.incarnation not in s.running_since for s in self.slots)

    def _refill(self) -> None:
        """Start spares up to `spares`, warming in the background (nobody waits for them). Called once no
        replacement is under way: a spare's start (a process importing torch) would otherwise take the CPU a
        replacement needs to load the policy and run its first call, and recovery would wait on both."""
        while len(self._spares) < self.spares:
            spare = self._actor()
            self._spares.append((spare, spare.pid.remote()))

    def _booted(self, slot: _Slot) -> None:
        """The start of `slot`'s actor answered: the incarnation is up, or the actor died starting (next one)."""
        ref, slot.boot = slot.boot, None
        try:
            slot.pid, slot.node = self.ray.get(ref, timeout=self.cfg.call_timeout_s)
        except self.ray.exceptions.RayActorError as exc:
            if slot.boot_spare:  # a spare that died while waiting (its node went): the next spare, or a fresh actor
                self._boot(slot)
            else:  # a fresh actor died starting: a replacement, within the pool's bound
                self._replace(slot, type(exc).__name__)
            return
        except self.ray.exceptions.GetTimeoutError:
            raise self._start_timeout(slot) from None
        slot.nodes.append(slot.node)
        slot.incarnation += 1
        slot.ref = None

    def _await_boot(self, *slots: _Slot) -> None:
        """Wait until none of `slots` is starting."""
        while True:
            booting = {s.boot: s for s in slots if s.boot is not None}
            if not booting:
                return
            ready, _ = self.ray.wait(list(booting), num_returns=1, timeout=self.cfg.call_timeout_s)
            if not ready:
                raise self._start_timeout(next(iter(booting.values())))
            self._booted(booting[ready[0]])

    def _start_timeout(self, slot: _Slot) -> RuntimeError:
        c = self.cfg
        return RuntimeError(f"rollout pool: worker {slot.index} did not start in {c.call_timeout_s}s "
                            f"(are {c.worker_cpus:g} CPU / {c.worker_gpus:g} GPU free on a node?)")

    def _replace(self, slot: _Slot, why: str) -> None:
        if self.replacements >= self.cfg.max_replacements:
            raise RuntimeError(f"rollout pool: {self.replacements} worker replacements reached the bound "
                               f"(pool.max_replacements); last cause on worker {slot.index}: {why}")
        self.replacements += 1
        try:
            self.ray.kill(slot.actor, no_restart=True)
        except Exception:  # already dead
            pass
        self._dead_counters.update(self._live_counters.pop(slot.index, {}))
        slot.backlog.extendleft(reversed(sorted(slot.inside, key=lambda r: r.traj_id)))  # resume these first
        slot.inside.clear()
        slot.acks = slot.unconfirmed + slot.acks  # the finalize may not have happened: send it again
        slot.unconfirmed = []
        slot.ref = None
        self._boot(slot)

    def update_weights(self, state: dict, version: int) -> None:
        """New policy weights on every worker (and on every replacement started later)."""
        self.weights_ref, self.version = self.ray.put(state), version
        for s in self.slots:
            self._settle_all(s)
            self.ray.get(s.actor.update_weights.remote(self.weights_ref, version), timeout=self.cfg.call_timeout_s)

    def close(self) -> None:
        for actor in [s.actor for s in self.slots] + [a for a, _ in self._spares]:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self._spares.clear()
        if self.sandbox is not None:
            self.sandbox.stop()
            self.sandbox = None
        if self.sink is not None and hasattr(self.sink, "close"):
            self.sink.close()

    # -- the run loop -------------------------------------------------------------------------
    def run(self, requests: list[Request], observer=None) -> PoolResult:
        """Roll out `requests`; `observer(pool)`, when given, is called in every round once each worker has
        its call running (a drill injects its faults from there, through the hooks below). An observer's
        `steps_per_call` and `max_in_flight` attributes, when set, cap the decode steps of each call and the
        requests a worker holds at once: faults fire between rounds, and a batch spread over rounds of a few
        steps leaves requests in flight to hit."""
        t0 = time.monotonic()
        self._steps_per_call = min(self.cfg.steps_per_call, getattr(observer, "steps_per_call", None) or self.cfg.steps_per_call)
        batch = self.slots[0].spec.engine.max_batch
        self._max_in_flight = min(batch, getattr(observer, "max_in_flight", None) or batch)
        for i, r in enumerate(requests):
            self.slots[i % len(self.slots)].backlog.append(r)
        self._want = {r.traj_id for r in requests}
        self._done: dict[str, Finished] = {}
        self._stream: dict[str, dict[int, int]] = {r.traj_id: {} for r in requests}
        self._resampled = 0
        while len(self._done) < len(self._want):
            for s in self.slots:
                if s.ref is None and s.boot is None:
                    self._call(s)
            if observer is not None:
                observer(self)
            # a slot whose worker is starting waits for it alone: the others keep decoding meanwhile
            refs = [s.ref for s in self.slots if s.ref is not None] + [s.boot for s in self.slots if s.boot is not None]
            if not refs:  # the observer collected every call (a preemption): start the next ones
                continue
            ready, _ = self.ray.wait(refs, num_returns=1, timeout=self.cfg.call_timeout_s)
            if not ready:
                booting = [s for s in self.slots if s.boot is not None]
                if booting and time.monotonic() - min(s.boot_since for s in booting) > self.cfg.call_timeout_s:
                    raise self._start_timeout(min(booting, key=lambda s: s.boot_since))
                raise RuntimeError(f"rollout pool: no worker answered in {self.cfg.call_timeout_s}s")
            for s in self.slots:
                if s.boot is not None and s.boot in ready:
                    self._booted(s)
                elif s.ref is not None and s.ref in ready:
                    self._settle(s)
        self._flush_acks()
        self._refill()  # every worker is up and idle: spares taken by replacements warm between runs
        counters = self.counters()
        lost = 0
        for traj, seen in self._stream.items():
            final = self._done[traj].tokens
            lost += sum(1 for pos, t in seen.items() if pos >= len(final) or final[pos] != t)
        return PoolResult(dict(self._done), counters, lost, self._resampled,
                          self.replacements, time.monotonic() - t0, {s.index: list(s.nodes) for s in self.slots})

    def counters(self) -> Counter:
        """The workers' counters summed over the pool's life (replaced incarnations included)."""
        out = Counter(self._dead_counters)
        for c in self._live_counters.values():
            out.update(c)
        return out

    def _flush_acks(self) -> None:
        """Let every worker finalize what the sink took since its last call (bounded retries through replacement)."""
        for s in self.slots:
            for _ in range(3):
                self._settle_all(s)
                if not s.acks:
                    break
                s.unconfirmed, s.acks = s.acks, []
                s.ref = s.actor.run.remote([], s.unconfirmed, 0)
            self._settle_all(s)

    def _call(self, s: _Slot) -> None:
        room = self._max_in_flight - len(s.inside)
        new = [s.backlog.popleft() for _ in range(min(room, len(s.backlog)))]
        s.inside.update(new)
        s.unconfirmed, s.acks = s.acks, []
        s.ref = s.actor.run.remote(new, s.unconfirmed, self._steps_per_call)

    def _settle_all(self, s: _Slot) -> None:
        """Collect the outstanding call of `s` and wait for a replacement it needed: `s` is up and idle."""
        self._settle(s)
        self._await_boot(s)

    def _settle(self, s: _Slot) -> None:
        """Collect the outstanding call of `s` (starting a replacement, not waiting for it, if the worker died)."""
        if s.ref is None:
            return
        ref, s.ref = s.ref, None
        try:
            report: WorkerReport = self.ray.get(ref, timeout=self.cfg.call_timeout_s)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError,
                self.ray.exceptions.WorkerCrashedError) as exc:
            self._replace(s, type(exc).__name__)
            return
        s.unconfirmed = []
        if s.incarnation not in s.running_since:  # this incarnation has run its requests: it is up
            s.running_since[s.incarnation] = time.monotonic()
            if len(self._spares) < self.spares and not self._recovering():
                self._refill()
        self._live_counters[s.index] = report.counters
        lost = [t for t in report.already_final if t in self._want and t not in self._done]
        if lost:  # finalized by an earlier run whose pool never got the record: it is in that run's data plane
            raise RuntimeError(f"rollout pool: {len(lost)} trajectories (e.g. {lost[0]!r}) were finalized in "
                               f"{s.spec.wal_path} by an earlier run; use a fresh run directory or other ids")
        for traj, (start, toks) in report.committed.items():
            seen = self._stream.setdefault(traj, {})
            for i, t in enumerate(toks):
                if start + i in seen:
                    self._resampled += 1
                seen[start + i] = t
        fresh = [f for f in report.finished if f.traj_id not in self._done]
        if self.sink is not None and fresh:
            self.sink.put(fresh)  # in the data plane before the worker may finalize it in its WAL
        for f in report.finished:
            if f.traj_id in self._done and self._done[f.traj_id].tokens != f.tokens:
                raise RuntimeError(f"trajectory {f.traj_id} finished twice with different tokens")
            self._done[f.traj_id] = f
            s.inside.discard(next((r for r in s.inside if r.traj_id == f.traj_id), None))
            s.acks.append(f.traj_id)
        if fresh and self.progress:
            self.progress(len(fresh))

    # -- hooks: what an operator (or a fault-injection drill) may do to a running pool ----------------
    def preempt(self, slot_index: int) -> list[str]:
        """A preemption notice for the requests of worker `slot_index`: between two calls the worker snapshots
        their KV, frees their slots and queues them again; its next call resumes them from the WAL and the
        snapshots. The worker itself stays. Returns the preempted trajectory ids ([] if the worker died)."""
        s = self.slots[slot_index]
        self._settle(s)  # the notice arrives between calls
        if s.ref is not None or s.boot is not None or s.actor is None:  # starting: its requests wait in the backlog
            return []
        try:
            return list(self.ray.get(s.actor.suspend.remote(), timeout=self.cfg.call_timeout_s))
        except self.ray.exceptions.RayActorError as exc:
            self._replace(s, type(exc).__name__)
            return []

    def kill(self, slot_index: int) -> None:
        """`ray.kill` of worker `slot_index`'s actor; the pool sees the death on its next call and replaces it."""
        self.ray.kill(self.slots[slot_index].actor, no_restart=True)

    def worker_pid(self, slot_index: int) -> int:
        """The process id of worker `slot_index`'s current actor."""
        return self.slots[slot_index].pid

    def worker_node(self, slot_index: int) -> str:
        """The Ray node id of worker `slot_index`'s current actor."""
        return self.slots[slot_index].node

    def warm_spares(self) -> int:
        """Spare actors that are up (process started, imports done): a replacement now takes no start-up."""
        pings = [p for _, p in self._spares]
        if not pings:
            return 0
        ready, _ = self.ray.wait(pings, num_returns=len(pings), timeout=0)
        return len(ready)

    def starting(self, slot_index: int) -> bool:
        """Whether worker `slot_index`'s next actor is starting (its requests wait for it)."""
        return self.slots[slot_index].boot is not None

    def incarnation(self, slot_index: int) -> int:
        """How many actors worker `slot_index` has had (1 until its first replacement)."""
        return self.slots[slot_index].incarnation

    def in_flight(self, slot_index: int) -> list[str]:
        """Trajectory ids handed to worker `slot_index` and not finished."""
        return sorted(r.traj_id for r in self.slots[slot_index].inside)

    def seen(self, traj_id: str) -> int:
        """Committed positions of `traj_id` this run's stream has shown (the prompt included)."""
        return len(self._stream.get(traj_id, ()))

    def finished(self, traj_id: str) -> bool:
        return traj_id in self._done

    def snapshot_path(self, traj_id: str) -> str:
        """Where the KV snapshot of `traj_id` is stored."""
        from rollout.snapshot import SnapshotStore

        return SnapshotStore(self.slots[0].spec.snapshot_uri).path(traj_id)
