"""`arith`: add a number of up to two digits and a digit, answer alone (skill: carrying)."""
from __future__ import annotations

import random
import re

from rewards import splits
from rewards.types import Domain, Verdict

_PROMPT_RE = re.compile(r"add (\d{1,3})\+(\d{1,3})=")


class Arith(Domain):
    name = "arith"
    description = "Add a number of up to two digits and a single digit; reply with the sum alone."

    def _draw(self, rng: random.Random) -> str:
        return f"add {rng.randint(0, 99)}+{rng.randint(0, 9)}="

    def prompts(self, split: str, n: int, seed: int) -> list[str]:
        return splits.sample(self._draw, split, n, seed)

    def _answer(self, prompt: str) -> int | None:
        m = _PROMPT_RE.fullmatch(prompt)
        return int(m.group(1)) + int(m.group(2)) if m else None

    def demonstration(self, prompt: str) -> str:
        answer = self._answer(prompt)
        if answer is None:
            raise ValueError(f"not an arith prompt: {prompt!r}")
        return str(answer)

    def _verify(self, prompt: str, completion: str) -> Verdict:
        answer = self._answer(prompt)
        if answer is None:
            return Verdict(0.0, "unrecognised prompt")
        got = completion.strip()
        if not got:
            return Verdict(0.0, "empty answer")
        if got == str(answer):
            return Verdict(1.0, "correct")
        return Verdict(0.0, f"wrong: expected {answer}, got {got[:32]!r}")
