"""`calc`: multiply two 3-digit numbers with the calculator tool (skill: multi-turn tool use).

The product is out of reach of a small model's mental arithmetic, so the right answer needs a
``<call>calc: A*B</call>`` whose ``<result>`` the environment supplies; see `rewards.protocol`.
A wrong final answer after a truthful transcript earns partial credit, at most `PARTIAL_CREDIT`, for
the digits it has in the right place: a near-right copy of the result beats a far one, so a group
whose samples all miss still ranks them (pass@1 counts only reward 1).
"""
from __future__ import annotations

import random
import re

from rewards import protocol, splits
from rewards.calculator import CalcError, calculate
from rewards.types import Domain, Verdict

_PROMPT_RE = re.compile(r"mul (\d{1,4})\*(\d{1,4})=")
MAX_CALLS = 4
PARTIAL_CREDIT = 0.5  # the most a wrong answer earns, for the digits it has right (a near-right copy of the result)


def digit_agreement(got: str, want: str) -> float:
    """Share of positions where `got` and `want` hold the same character, over the longer of the two."""
    if not got or not want:
        return 0.0
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))


class Calc(Domain):
    name = "calc"
    description = "Multiply two 3-digit integers by calling the calculator tool, then state the product."
    uses_tools = True

    def _draw(self, rng: random.Random) -> str:
        return f"mul {rng.randint(100, 999)}*{rng.randint(100, 999)}="

    def prompts(self, split: str, n: int, seed: int) -> list[str]:
        return splits.sample(self._draw, split, n, seed)

    def _operands(self, prompt: str) -> tuple[int, int] | None:
        m = _PROMPT_RE.fullmatch(prompt)
        return (int(m.group(1)), int(m.group(2))) if m else None

    def demonstration(self, prompt: str) -> str:
        ops = self._operands(prompt)
        if ops is None:
            raise ValueError(f"not a calc prompt: {prompt!r}")
        a, b = ops
        call = f"{protocol.CALL_OPEN}calc: {a}*{b}{protocol.CALL_CLOSE}"
        return call + protocol.format_result(str(a * b)) + str(a * b)

    def _verify(self, prompt: str, completion: str) -> Verdict:
        ops = self._operands(prompt)
        if ops is None:
            return Verdict(0.0, "unrecognised prompt")
        answer = ops[0] * ops[1]
        steps = protocol.steps(completion)
        if not steps:
            return Verdict(0.0, "no calculator call")
        if len(steps) > MAX_CALLS:
            return Verdict(0.0, f"too many calls: {len(steps)} > {MAX_CALLS}")
        for step in steps:
            if step.tool != "calc":
                return Verdict(0.0, f"unknown tool {step.tool[:16]!r}")
            try:
                expected = str(calculate(step.args))
            except CalcError as exc:
                expected = protocol.ERROR_PREFIX + str(exc)
            if step.result != expected:  # a result the environment did not give: forged transcript
                return Verdict(0.0, "tool result does not match the calculator")
        got = protocol.final_answer(completion).strip()
        if got == str(answer):
            return Verdict(1.0, "correct")
        if not got:
            return Verdict(0.0, "no final answer after the tool result")
        return Verdict(PARTIAL_CREDIT * digit_agreement(got, str(answer)), f"wrong: expected {answer}, got {got[:32]!r}")
