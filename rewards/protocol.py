"""The tool-call protocol of the tool domains.

The model writes ``<call>TOOL: ARGS</call>``; the environment appends ``<result>OUTPUT</result>``
(loss-masked, never sampled) and the model continues. Example::

    mul 37*41=<call>calc: 37*41</call><result>1517</result>1517
"""
from __future__ import annotations

import re
from typing import NamedTuple

CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"
ERROR_PREFIX = "error: "
MAX_RESULT_CHARS = 256

_CALL_RE = re.compile(r"<call>([a-z_]{1,32}):\s?(.{0,256}?)</call>", re.S)
_STEP_RE = re.compile(r"<call>([a-z_]{1,32}):\s?(.{0,256}?)</call><result>(.{0,256}?)</result>", re.S)


class Call(NamedTuple):
    tool: str
    args: str


class Step(NamedTuple):
    tool: str
    args: str
    result: str


def pending_call(text: str) -> Call | None:
    """The call the environment must answer now: `text` ends with a complete, unanswered call."""
    if not text.endswith(CALL_CLOSE):
        return None
    start = text.rfind(CALL_OPEN)
    if start < 0:
        return None
    m = _CALL_RE.fullmatch(text[start:])
    return Call(m.group(1), m.group(2)) if m else None


def format_result(output: str) -> str:
    """The text appended after a call: bounded and free of protocol tags."""
    clean = output.replace("<", "(").replace(">", ")")[:MAX_RESULT_CHARS]
    return f"{RESULT_OPEN}{clean}{RESULT_CLOSE}"


def steps(text: str) -> list[Step]:
    """Every answered call in `text`, in order."""
    return [Step(*m.groups()) for m in _STEP_RE.finditer(text)]


def final_answer(text: str) -> str:
    """What the model wrote after its last tool result (or the whole text if it made no call)."""
    cut = text.rfind(RESULT_CLOSE)
    return text[cut + len(RESULT_CLOSE):] if cut >= 0 else text


def result_spans(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of every `<result>…</result>` block: environment text, never trained on."""
    spans, pos = [], 0
    while (start := text.find(RESULT_OPEN, pos)) >= 0:
        end = text.find(RESULT_CLOSE, start)
        end = len(text) if end < 0 else end + len(RESULT_CLOSE)
        spans.append((start, end))
        pos = end
    return spans
