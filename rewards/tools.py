"""In-process execution of the protocol's tools: what an episode does when no sandbox is configured.

The sandbox service runs the same tools isolated and logged; this module is the pure core.
"""
from __future__ import annotations

from rewards import protocol
from rewards.calculator import CalcError, calculate


def run_pure_tool(call: protocol.Call) -> str:
    """The result text of `call` for the pure tools (calculator); an error is a result, not a raise."""
    if call.tool == "calc":
        try:
            return str(calculate(call.args))
        except CalcError as exc:
            return protocol.ERROR_PREFIX + str(exc)
    return protocol.ERROR_PREFIX + f"unknown tool {call.tool[:16]!r}"
