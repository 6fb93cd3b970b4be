"""`reverse`: write a lowercase word backwards (skill: position-wise copying, not arithmetic)."""
from __future__ import annotations

import random
import re
import string

from rewards import splits
from rewards.types import Domain, Verdict

_PROMPT_RE = re.compile(r"rev ([a-z]{1,16})=")


class Reverse(Domain):
    name = "reverse"
    description = "Reverse a lowercase word of 3 to 7 letters; reply with the reversed word alone."

    def _draw(self, rng: random.Random) -> str:
        return "rev " + "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 7))) + "="

    def prompts(self, split: str, n: int, seed: int) -> list[str]:
        return splits.sample(self._draw, split, n, seed)

    def _answer(self, prompt: str) -> str | None:
        m = _PROMPT_RE.fullmatch(prompt)
        return m.group(1)[::-1] if m else None

    def demonstration(self, prompt: str) -> str:
        answer = self._answer(prompt)
        if answer is None:
            raise ValueError(f"not a reverse prompt: {prompt!r}")
        return answer

    def _verify(self, prompt: str, completion: str) -> Verdict:
        answer = self._answer(prompt)
        if answer is None:
            return Verdict(0.0, "unrecognised prompt")
        got = completion.strip()
        if got == answer:
            return Verdict(1.0, "correct")
        if not got:
            return Verdict(0.0, "empty answer")
        return Verdict(0.0, f"wrong: expected {answer!r}, got {got[:32]!r}")
