"""Bulk column transfer from the catalog (pure; the SQL comes from the backend): a selection arrives as a
few values, not as one Python tuple per row (which costs ~7 us per row, seconds at a million
trajectories).

- numbers: the column's values joined by ',' (parsed by numpy in C);
- packed records: each row's write-once numbers and the UTF-8 byte lengths of its names as one
  fixed-width record (`PACK`), all records concatenated into one binary value (read by numpy as a
  structured array);
- names: each row's names concatenated with no separator (split by the lengths in its record), rebuilt
  as Arrow binary arrays without a Python object per value.

Every value is one aggregate of the same single-group query, so all of them see the rows in the same
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


# -- packed per-trajectory metadata ---------------------------------------------------------------------
# Each catalogued trajectory also carries its write-once numbers and the UTF-8 byte lengths of its names
# as one fixed-width little-endian record (`pack`); select concatenates the records of the selected rows
# into one binary value, read by numpy as a structured array without parsing text.
PACK = np.dtype([("length", "<i8"), ("shard_id", "<i8"), ("reward", "<f8"), ("policy_min", "<i4"),
                 ("policy_max", "<i4"), ("row", "<i4"), ("checksum", "<u4"), ("id_bytes", "<u4"),
                 ("group_id_bytes", "<u4"), ("run_bytes", "<u4"), ("teacher_bytes", "<u4")])
NAMES = ("id", "group_id", "run", "teacher")  # concatenated per row in this order ("" for no teacher)


def pack(length, shard_id, reward, policy_min, policy_max, row, checksum, ids, group_ids, runs, teachers) -> list[bytes]:
    """One PACK record per trajectory from aligned sequences (names as str; None teacher = "")."""
    n = len(ids)
    rec = np.zeros(n, dtype=PACK)
    for name, vals in (("length", length), ("shard_id", shard_id), ("reward", reward), ("policy_min", policy_min),
                       ("policy_max", policy_max), ("row", row), ("checksum", checksum)):
        rec[name] = vals
    for name, vals in zip(NAMES, (ids, group_ids, runs, teachers)):
        rec[f"{name}_bytes"] = [len((v or "").encode("utf-8")) for v in vals]
    buf, w = rec.tobytes(), PACK.itemsize
    return [buf[k * w:(k + 1) * w] for k in range(n)]


def unpack(packed: bytes | None, names: bytes | None, n: int) -> tuple[np.ndarray, dict[str, pa.Array]]:
    """n PACK records concatenated, and the rows' names concatenated (id, group id, run, teacher per row):
    the structured records and one Arrow binary array per name."""
    packed, names = packed or b"", names or b""
    if len(packed) != n * PACK.itemsize:
        raise ColumnError(f"catalog packed metadata: expected {n} records of {PACK.itemsize} B, got {len(packed)} B")
    rec = np.frombuffer(packed, dtype=PACK)
    lengths = np.stack([rec[f"{name}_bytes"] for name in NAMES], axis=1).reshape(-1).astype(np.int64)
    every = _binary(names.encode("utf-8") if isinstance(names, str) else names, lengths)
    return rec, {name: every.take(pa.array(np.arange(k, 4 * n, 4))) for k, name in enumerate(NAMES)}


def _binary(data: bytes, byte_lengths: np.ndarray) -> pa.Array:
    offsets = np.zeros(byte_lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(byte_lengths, out=offsets[1:])
    if int(offsets[-1]) != len(data):
        raise ColumnError(f"catalog column: lengths add up to {int(offsets[-1])} bytes, got {len(data)}")
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), byte_lengths.shape[0],
                                            [None, pa.py_buffer(offsets), pa.py_buffer(data)])
