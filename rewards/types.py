"""Records shared by every task domain: the Domain interface and verifier results."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

MAX_COMPLETION_CHARS = 4096  # anything longer is rejected unread: verifiers stay O(1) on hostile output


class Verdict(NamedTuple):
    reward: float  # in [0, 1]
    reason: str


class Domain(ABC):
    """A verifiable task domain: seeded prompts, SFT demonstrations and a pure verifier."""

    name: str
    description: str
    uses_tools: bool = False

    @abstractmethod
    def prompts(self, split: str, n: int, seed: int) -> list[str]:
        """`n` prompts of `split` ('train' or 'eval'); the splits are disjoint for every seed."""

    @abstractmethod
    def demonstration(self, prompt: str) -> str:
        """The completion an expert would write for `prompt` (tool results included)."""

    @abstractmethod
    def _verify(self, prompt: str, completion: str) -> Verdict:
        """Domain-specific check; may assume `completion` is a bounded str."""

    def verify(self, prompt: str, completion: str) -> tuple[float, str]:
        """Pure `completion -> (reward in [0, 1], reason)`. Never raises."""
        if not isinstance(prompt, str) or not isinstance(completion, str):
            return Verdict(0.0, f"not text: {type(completion).__name__}")
        if len(completion) > MAX_COMPLETION_CHARS:
            return Verdict(0.0, f"completion too long: {len(completion)} > {MAX_COMPLETION_CHARS} chars")
        try:
            return self._verify(prompt, completion)
        except Exception as exc:  # a verifier bug must not kill a rollout; it scores 0 and says why
            return Verdict(0.0, f"verifier error: {type(exc).__name__}: {exc}")
