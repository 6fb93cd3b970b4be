"""Hard-prompt replay: prompts a group did not fully solve come back in later iterations.

Prioritised sampling of unsolved problems (Kimi k1.5 samples problems in proportion to their failure
rate): a prompt whose group solved less than `solved_below` of its samples joins a FIFO queue; later
iterations fill up to `share` of their prompts from the queue head, fresh prompts fill the rest. A
prompt is replayed at most `max_replays` times, so one the policy cannot solve does not crowd out the
rest, and the queue keeps the `capacity` most recent entries (older ones describe an older policy). Pure and
deterministic: the queue is a function of the order of `take` and `observe` calls, so a resumed run
rebuilds it by replaying its finished batches.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence


class PromptReplay:
    def __init__(self, share: float, max_replays: int, solved_below: float = 1.0, capacity: int = 100_000):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"replay share must lie in [0, 1], got {share}")
        if not 0.0 < solved_below <= 1.0:
            raise ValueError(f"solved_below must lie in (0, 1], got {solved_below}")
        if max_replays < 1 or capacity < 1:
            raise ValueError("max_replays and capacity must be >= 1")
        self.share, self.max_replays, self.solved_below = share, max_replays, solved_below
        self._queue: deque[tuple[str, int]] = deque(maxlen=capacity)  # (prompt, times replayed so far)
        self._taken: dict[str, int] = {}  # prompt -> its replay count, while its replayed group is out

    def __len__(self) -> int:
        return len(self._queue)

    def take(self, prompts_per_iteration: int) -> list[str]:
        """Up to floor(share × P) prompts from the queue head (each replayed once more)."""
        n = min(len(self._queue), math.floor(self.share * prompts_per_iteration))
        out = []
        for _ in range(n):
            prompt, count = self._queue.popleft()
            self._taken[prompt] = count + 1
            out.append(prompt)
        return out

    def observe(self, prompts: Sequence[str], solve_rates: Sequence[float]) -> None:
        """One finished batch, group by group: a group solved below the bar is queued (again, if it may be)."""
        if len(prompts) != len(solve_rates):
            raise ValueError(f"{len(prompts)} prompts but {len(solve_rates)} solve rates")
        for prompt, rate in zip(prompts, solve_rates):
            count = self._taken.pop(prompt, 0)
            if rate < self.solved_below and count < self.max_replays:
                self._queue.append((prompt, count))  # a full queue drops its oldest entry
