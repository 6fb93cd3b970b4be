"""A drill's result and its verdict (pure), and the context the drills of one run share.

A drill injects `asked` faults on a real workload and audits the invariants of DESIGN.md afterwards.
Its verdict passes only when every asked fault was injected and survived, no acknowledged token was
lost or sampled twice, no tool side effect happened twice, the faulted run completed what the calm
run completed with the same token hashes, and every check of the drill itself held.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from chaos.schedule import percentile


@dataclass
class Event:
    """One fault on the drill's clock: when it hit and how long recovery took (None: never recovered)."""

    kind: str
    t_s: float
    recovery_s: float | None


@dataclass
class DrillResult:
    name: str
    asked: dict[str, int]
    events: list[Event] = field(default_factory=list)
    shortfall: str = ""  # why fewer faults were injected than asked
    tokens_lost: int = 0
    tokens_resampled: int = 0
    duplicate_side_effects: int = 0
    completed: int | None = None  # units of work (trajectories, calls, rows) completed under faults
    calm_completed: int | None = None  # the same in the calm run
    hashes_equal: bool | None = None  # token hashes equal to the calm run's (None: not applicable)
    wall_s: float = 0.0
    calm_wall_s: float | None = None
    checks: dict[str, bool] = field(default_factory=dict)  # drill-specific invariants
    detail: dict = field(default_factory=dict)

    @property
    def injected(self) -> dict[str, int]:
        return dict(Counter(e.kind for e in self.events))

    @property
    def survived(self) -> dict[str, int]:
        return dict(Counter(e.kind for e in self.events if e.recovery_s is not None))

    def recovery_s(self, kind: str | None = None) -> list[float]:
        return [e.recovery_s for e in self.events if e.recovery_s is not None and kind in (None, e.kind)]

    def failures(self) -> list[str]:
        """Why the verdict fails; [] when it passes."""
        out = []
        asked, got, ok = sum(self.asked.values()), len(self.events), sum(self.survived.values())
        for kind, n in self.asked.items():
            if self.injected.get(kind, 0) < n:
                out.append(f"injected {self.injected.get(kind, 0)} of {n} {kind} faults"
                           + (f" ({self.shortfall})" if self.shortfall else ""))
        if asked == 0:
            out.append("no fault was asked for")
        if ok < got:
            out.append(f"{got - ok} of {got} faults were not survived")
        for what, n in (("tokens lost", self.tokens_lost), ("tokens re-sampled", self.tokens_resampled),
                        ("duplicate side effects", self.duplicate_side_effects)):
            if n:
                out.append(f"{n} {what}")
        if self.calm_completed is not None and self.completed != self.calm_completed:
            out.append(f"completed {self.completed} against {self.calm_completed} in the calm run")
        if self.hashes_equal is False:
            out.append("token hashes differ from the calm run's")
        out += [f"check failed: {name}" for name, good in self.checks.items() if not good]
        return out

    @property
    def passed(self) -> bool:
        return not self.failures()

    def summary(self) -> dict:
        rec = self.recovery_s()
        per_kind = {}
        for kind in self.asked:
            r = self.recovery_s(kind)
            per_kind[kind] = {"asked": self.asked[kind], "injected": self.injected.get(kind, 0),
                              "survived": self.survived.get(kind, 0),
                              "recovery_p50_s": percentile(r, 50), "recovery_p99_s": percentile(r, 99)}
        overhead = (self.wall_s / self.calm_wall_s) if self.calm_wall_s else None
        return {
            "name": self.name, "verdict": "pass" if self.passed else "fail", "failures": self.failures(),
            "faults_asked": sum(self.asked.values()), "faults_injected": len(self.events),
            "faults_survived": len(rec), "by_kind": per_kind,
            "tokens_lost": self.tokens_lost, "tokens_resampled": self.tokens_resampled,
            "duplicate_side_effects": self.duplicate_side_effects,
            "completed": self.completed, "calm_completed": self.calm_completed,
            "completion_rate": (self.completed / self.calm_completed) if self.calm_completed else None,
            "hashes_equal": self.hashes_equal,
            "recovery_p50_s": percentile(rec, 50), "recovery_p99_s": percentile(rec, 99),
            "wall_s": round(self.wall_s, 3), "calm_wall_s": round(self.calm_wall_s, 3) if self.calm_wall_s else None,
            "wall_overhead": round(overhead, 3) if overhead else None,
            "checks": dict(self.checks), "detail": self.detail,
            "events": [{"kind": e.kind, "t_s": round(e.t_s, 6), "recovery_s": e.recovery_s} for e in self.events],
        }


@dataclass
class DrillContext:
    """What the drills of one `postrain drill` run share: seed, fault count, directories, cached workloads."""

    out: Path
    seed: int = 0
    trials: int | None = None  # faults per drill; None: each drill's own default
    cache: dict = field(default_factory=dict)
    closers: list = field(default_factory=list)  # called once the run's drills are done (pools, servers)

    def close(self) -> None:
        while self.closers:
            self.closers.pop()()

    def work(self, name: str) -> Path:
        p = self.out / "work" / name
        p.mkdir(parents=True, exist_ok=True)
        return p
