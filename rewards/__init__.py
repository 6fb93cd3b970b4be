"""rewards: verifiable task domains (pure prompt generators, demonstrations, verifiers) and tools.

    types.py       Domain interface and Verdict
    splits.py      seeded, disjoint train/eval splits
    protocol.py    the <call>/<result> tool protocol
    calculator.py  bounded arithmetic evaluator behind the `calc` tool
    arith.py       domain `arith`: 3-digit addition
    reverse.py     domain `reverse`: word reversal
    calc.py        domain `calc`: 3-digit multiplication through the calculator tool
    tools.py       in-process tool execution (the sandbox service wraps the same functions)
"""
from __future__ import annotations

from rewards.arith import Arith
from rewards.calc import Calc
from rewards.reverse import Reverse
from rewards.types import Domain, Verdict

_DOMAINS: dict[str, Domain] = {d.name: d for d in (Arith(), Reverse(), Calc())}


class UnknownDomain(KeyError):
    def __str__(self) -> str:
        return f"unknown domain {self.args[0]!r}; known: {', '.join(sorted(_DOMAINS))}"


def domains() -> list[str]:
    """Names of every registered domain."""
    return list(_DOMAINS)


def domain(name: str) -> Domain:
    """The domain called `name`; UnknownDomain names the known ones."""
    try:
        return _DOMAINS[name]
    except KeyError:
        raise UnknownDomain(name) from None


__all__ = ["Domain", "Verdict", "UnknownDomain", "domain", "domains"]
