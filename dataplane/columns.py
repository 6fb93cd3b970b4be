"""Bulk column transfer from the catalog (pure; the SQL comes from the backend): a selection's columns
arrive as one text value each, not as one Python tuple per row (which costs ~7 us per row, seconds at a
million trajectories).

- numbers: the column's values joined by ',' (parsed by numpy in C);
- strings: the values concatenated with no separator, plus their UTF-8 byte lengths as numbers,
  rebuilt as one Arrow string array (offsets from the lengths) without a Python object per value.

Every column is one aggregate of the same single-group query, so all of them see the rows in the same
order and the arrays align.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class ColumnError(ValueError):
    """A transferred column does not have the expected number of values or bytes."""


def numbers(text: str | None, n: int, dtype) -> np.ndarray:
    """n numbers from 'v1,v2,...' (None or '' for none)."""
    if not text:
        out = np.zeros(0, dtype=dtype)
    else:
        out = np.array(np.fromstring(text, dtype=np.float64 if np.dtype(dtype).kind == "f" else np.int64, sep=","),
                       dtype=dtype)
    if out.shape[0] != n:
        raise ColumnError(f"catalog column: expected {n} numbers, parsed {out.shape[0]}")
    return out


def strings(text: str | None, byte_lengths: np.ndarray) -> pa.Array:
    """An Arrow binary array (compared bytewise) from the values concatenated and their UTF-8 byte lengths."""
    data = (text or "").encode("utf-8")
    offsets = np.zeros(byte_lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(byte_lengths, out=offsets[1:])
    if int(offsets[-1]) != len(data):
        raise ColumnError(f"catalog column: lengths add up to {int(offsets[-1])} bytes, got {len(data)}")
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), byte_lengths.shape[0],
                                            [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def to_numpy_str(arr: pa.Array) -> np.ndarray:
    """A binary array of UTF-8 text as a numpy str array: padded with NUL bytes to one width in Arrow and
    read as fixed-width bytes when the text is ASCII without NUL (the usual ids), else via Python strings."""
    n = len(arr)
    if not n:
        return np.zeros(0, dtype="<U1")
    width = max(int(pc.max(pc.binary_length(arr)).as_py()), 1)
    text = arr.cast(pa.large_string())
    if not pc.all(pc.string_is_ascii(text)).as_py() or pc.any(pc.binary_contains(arr, b"\x00") if hasattr(pc, "binary_contains")
                                                               else pc.match_substring(text, "\x00")).as_py():
        return np.array(text.to_pylist(), dtype=str)
    padded = pc.utf8_rpad(text, width=width, padding="\x00")
    _, offsets, data = padded.buffers()
    start = int(np.frombuffer(offsets, dtype=np.int64)[padded.offset])
    return np.frombuffer(data, dtype=f"S{width}", count=n, offset=start).astype(f"U{width}")
