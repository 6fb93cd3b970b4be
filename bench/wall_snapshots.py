"""The policy as of fixed wall times, taken the same way on both sides of a learning-curve benchmark.

Marks every `every_s` seconds up to `budget_s` (the last mark is the budget), on a clock that started
at `clock_start_unix` (the moment the side's process was launched, so start-up counts). After each
optimizer step (a side calls `after_step(weights)` once the device has finished it), every mark
passed since the previous step gets the weights of that previous step: the policy as of a mark is the
one after the last step that ended before it ("base" where no step had ended yet). Snapshots stay on
the device as copies until the budget is spent; `write` saves them afterwards, outside the budget.
"""
from __future__ import annotations

import time
from pathlib import Path

BASE = "base"  # a mark reached before any step ended: the starting checkpoint


def marks(budget_s: float, every_s: float) -> list[float]:
    """every_s, 2·every_s, … up to budget_s, and budget_s itself."""
    if every_s <= 0 or budget_s <= 0:
        raise ValueError(f"snapshot period {every_s} s and budget {budget_s} s must be > 0")
    out, t = [], every_s
    while t < budget_s - 1e-9:
        out.append(round(t, 6))
        t += every_s
    return out + [float(budget_s)]


class WallSnapshots:
    def __init__(self, clock_start_unix: float, budget_s: float, every_s: float, clock=time.time, sync=None):
        self.start, self.budget_s, self.clock, self.sync = clock_start_unix, float(budget_s), clock, sync
        self.pending = marks(budget_s, every_s)
        self.taken: list[dict] = []  # {"mark_s", "step", "weights"}: weights a dict of copies, or BASE
        self.prev, self.prev_step, self.steps = BASE, 0, 0
        self.step_end_s: list[float] = []

    def elapsed_s(self) -> float:
        return self.clock() - self.start

    def after_step(self, weights: dict) -> bool:
        """Record one finished optimizer step (`weights`: the policy after it); True once the budget is spent."""
        if self.sync is not None:
            self.sync()  # the step's kernels have run: its end is now
        now = round(self.elapsed_s(), 6)  # the value recorded is the value compared: a rounded 2.9996 is not 3.0
        self.steps += 1
        self.step_end_s.append(now)
        while self.pending and self.pending[0] <= now:
            self.taken.append({"mark_s": self.pending.pop(0), "step": self.prev_step, "weights": self.prev})
        if not self.pending:
            return True
        self.prev = {k: v.detach().clone() for k, v in weights.items()}
        self.prev_step = self.steps
        return False

    def write(self, out: str | Path) -> list[dict]:
        """Save the snapshots (safetensors, one file per mark); marks the run never reached are left out."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        rows = []
        for snap in self.taken:
            path = None
            if snap["weights"] is not BASE:
                path = out / f"t{snap['mark_s']:08.2f}.safetensors"
                save_file({k: v.contiguous() for k, v in snap["weights"].items()}, str(path))
            rows.append({"mark_s": snap["mark_s"], "step": snap["step"], "path": str(path) if path else BASE})
        return rows
