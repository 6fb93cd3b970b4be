"""PoolInjector: drives a RolloutPool's hooks from outside on a seeded schedule and times each recovery.

The pool calls the injector in every round, once each worker has its call running
(`RolloutPool.run(observer=)`): a kill lands in a running call, a preemption after it.
Each fault waits its gap in rounds, then fires on a worker that holds requests in flight:

    preempt           `pool.preempt(k)`: the worker snapshots the KV of its requests and resumes them
    snapshot_corrupt  preempt, then one bit of every written snapshot flipped (resume re-prefills)
    snapshot_delete   preempt, then the written snapshots deleted (resume re-prefills)
    actor_kill        `pool.kill(k)`: `ray.kill` of the actor (a warm spare takes its slot)
    sigkill           SIGKILL to the worker's process
    node_loss         `kill_node(pool.worker_node(k))`: the worker's whole Ray node killed (its raylet and
                      every process under it; a cluster drill passes the function)

Recovery time of a fault: from the moment it took effect (a kill when sent; a preemption once the
worker has stopped the requests, which waits for its call in progress) until every trajectory it hit
has shown a new committed token (or finished); for a kill, a token reported by the replacement. A fault counts as survived once recovered; the run's audit (tokens lost, re-sampled,
token hashes) is the drill's.
"""
from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from chaos.files import flip_bit
from chaos.schedule import Fault

PREEMPTIONS = ("preempt", "snapshot_corrupt", "snapshot_delete")


@dataclass
class FaultEvent:
    kind: str
    slot: int
    t_s: float  # since the injector's first round
    trajectories: dict[str, int]  # hit trajectory -> committed positions seen at the fault
    incarnation: int = 0  # of the hit worker at the fault (a kill recovers on a later one)
    replaced: bool = False  # a kill: the replacement runs; progress counts from here
    recovery_s: float | None = None


@dataclass
class PoolInjector:
    faults: list[Fault]
    seed: int = 0
    clock: object = time.monotonic
    events: list[FaultEvent] = field(default_factory=list)
    rounds: int = 0
    # a kill waits until the pool has a warm spare: failures no closer together than a spare's start-up
    # (the spare capacity a drill sizes); off for --chaos, whose faults must fire within one batch
    wait_for_spare: bool = False
    spare_waits: int = 0  # rounds a kill waited for a warm spare
    kill_node: Callable[[str], None] | None = None  # node_loss: kills the Ray node with this id
    # a fault fires only on a worker some of whose requests in flight have shown committed positions: it
    # lands mid-decode however slowly that worker started (a loaded machine runs the gap's rounds on the
    # others); the node-loss drill checks that the lost node held committed tokens
    mid_decode: bool = False
    # decode steps per worker call and requests a worker holds at once while injecting (the pool takes the
    # smaller of each and its own): a fault fires between rounds, and long calls over a wide batch can finish
    # a short batch before any fault finds a request in flight
    steps_per_call: int = 2
    max_in_flight: int = 32

    def __post_init__(self):
        self._pending = deque(self.faults)
        self._wait = self._pending[0].gap if self._pending else 0
        self._t0 = None
        self._rng = random.Random(self.seed)
        self._killed: dict[int, int] = {}  # slot -> incarnation a kill hit

    @property
    def asked(self) -> int:
        return len(self.faults)

    @property
    def injected(self) -> int:
        return len(self.events)

    def __call__(self, pool) -> None:
        now = self.clock()
        if self._t0 is None:
            self._t0 = now
        self.rounds += 1
        self._note_recoveries(pool, now)
        if not self._pending:
            return
        if self._wait > 0:
            self._wait -= 1
            return
        f = self._pending[0]
        n = len(pool.slots)
        # a worker killed and not yet replaced is not a target: a second kill there would change nothing
        slot = next((k % n for k in range(f.slot, f.slot + n) if self._target(pool, k % n)), None)
        if slot is None:
            return  # nothing in flight anywhere this round (or, mid_decode, nothing committed yet): the fault waits
        if self.wait_for_spare and f.kind not in PREEMPTIONS and pool.spares and pool.warm_spares() <= self._owed(pool):
            self.spare_waits += 1
            return
        hit = self._inject(pool, f.kind, slot)
        if not hit:
            return
        if f.kind not in PREEMPTIONS:
            self._killed[slot] = pool.incarnation(slot)
        if f.kind in PREEMPTIONS:  # a preemption takes effect once the worker has stopped the requests
            now = self.clock()
        self.events.append(FaultEvent(f.kind, slot, round(now - self._t0, 6), {t: pool.seen(t) for t in hit},
                                      pool.incarnation(slot)))
        self._pending.popleft()
        self._wait = self._pending[0].gap if self._pending else 0

    def _target(self, pool, k: int) -> bool:
        """Whether worker k may take the next fault: it holds requests in flight (with mid_decode, some that
        have shown committed positions) and no kill already hit this incarnation of it."""
        held = pool.in_flight(k)
        return (bool(held) and self._killed.get(k) != pool.incarnation(k)
                and (not self.mid_decode or any(pool.seen(t) for t in held)))

    def _owed(self, pool) -> int:
        """Warm spares already due to earlier kills: workers killed whose death the pool has not seen yet (it
        sees a SIGKILL only when Ray reports it, some rounds later) and will replace from the same spares."""
        return sum(1 for k, inc in self._killed.items() if pool.incarnation(k) == inc and not pool.starting(k))

    def _inject(self, pool, kind: str, slot: int) -> list[str]:
        if kind in PREEMPTIONS:
            hit = pool.preempt(slot)
            if kind != "preempt":
                paths = [p for p in map(pool.snapshot_path, hit) if os.path.isfile(p)]
                if not paths:
                    return []  # no snapshot to spoil (the requests were only queued): try again next round
                for p in paths:
                    if kind == "snapshot_delete":
                        os.unlink(p)
                    else:
                        flip_bit(p, self._rng, lo=8)
            return hit
        hit = pool.in_flight(slot)
        if kind == "actor_kill":
            pool.kill(slot)
        elif kind == "sigkill":
            pid = pool.worker_pid(slot)
            if pid <= 0:  # never signal a process group
                raise ValueError(f"worker {slot} has no process id yet")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif kind == "node_loss" and self.kill_node is not None:
            self.kill_node(pool.worker_node(slot))
        else:
            raise ValueError(f"unknown rollout fault kind {kind!r}")
        return hit

    def _note_recoveries(self, pool, now: float) -> None:
        for e in self.events:
            if e.recovery_s is not None:
                continue
            if e.kind not in PREEMPTIONS and not e.replaced:
                # a kill: tokens the dead worker reported before it died are no recovery; count from the
                # first round that sees its replacement, when the old worker's last report is settled
                if pool.incarnation(e.slot) == e.incarnation and not all(map(pool.finished, e.trajectories)):
                    continue
                e.replaced, e.trajectories = True, {t: pool.seen(t) for t in e.trajectories}
            if all(pool.finished(t) or pool.seen(t) > k for t, k in e.trajectories.items()):
                e.recovery_s = round(now - self._t0 - e.t_s, 6)

    def finish(self, pool) -> None:
        """After the run: trajectories that finished since the last round count as recovered now."""
        self._note_recoveries(pool, self.clock())

    def shortfall(self) -> str:
        """Why fewer faults were injected than asked ('' when all were)."""
        if self.injected >= self.asked:
            return ""
        left = Counter(f.kind for f in list(self._pending))
        spare = f" ({self.spare_waits} rounds a kill waited for a warm spare)" if self.spare_waits else ""
        return (f"injected {self.injected} of {self.asked} faults: the run ended after {self.rounds} pool rounds "
                f"with {dict(left)} still waiting for requests in flight{spare}; give the run more work "
                f"(more episodes or longer completions), lower pool.steps_per_call (a call that finishes its "
                f"requests leaves nothing to preempt) or ask for fewer faults")

    def summary(self) -> dict:
        by_kind = Counter(e.kind for e in self.events)
        survived = Counter(e.kind for e in self.events if e.recovery_s is not None)
        return {"asked": self.asked, "injected": dict(by_kind), "survived": dict(survived),
                "shortfall": self.shortfall(), "rounds": self.rounds, "spare_waits": self.spare_waits,
                "events": [{"kind": e.kind, "slot": e.slot, "t_s": e.t_s, "recovery_s": e.recovery_s,
                            "trajectories": len(e.trajectories)} for e in self.events]}
