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
# Each catalogued trajectory also carries its write-once fields as one record (`pack`): a fixed-width
# little-endian header (PACK: the numbers and the UTF-8 byte lengths of the names), then the names
# themselves (NAMES order, no separator). select concatenates the records of the selected rows into one
# binary value and sends their sizes beside it; numpy reads the headers as a structured array and Arrow
# cuts the names, without parsing text or making a Python object per row.
PACK = np.dtype([("length", "<i8"), ("shard_id", "<i8"), ("reward", "<f8"), ("policy_min", "<i4"),
                 ("policy_max", "<i4"), ("row", "<i4"), ("checksum", "<u4"), ("id_bytes", "<u4"),
                 ("group_id_bytes", "<u4"), ("run_bytes", "<u4"), ("teacher_bytes", "<u4")])
NAMES = ("id", "group_id", "run", "teacher")  # "" for no teacher


def pack(length, shard_id, reward, policy_min, policy_max, row, checksum, ids, group_ids, runs, teachers) -> list[bytes]:
    """One record per trajectory from aligned sequences (names as str; None teacher = "")."""
    n = len(ids)
    head = np.zeros(n, dtype=PACK)
    for name, vals in (("length", length), ("shard_id", shard_id), ("reward", reward), ("policy_min", policy_min),
                       ("policy_max", policy_max), ("row", row), ("checksum", checksum)):
        head[name] = vals
    encoded = [[(v or "").encode("utf-8") for v in vals] for vals in (ids, group_ids, runs, teachers)]
    for name, vals in zip(NAMES, encoded):
        head[f"{name}_bytes"] = [len(v) for v in vals]
    buf, w = head.tobytes(), PACK.itemsize
    return [b"".join((buf[k * w:(k + 1) * w], *parts)) for k, parts in enumerate(zip(*encoded))]


def unpack(packed: bytes | None, sizes: np.ndarray) -> tuple[np.ndarray, dict[str, pa.Array]]:
    """Records concatenated and their sizes: the headers as a PACK array and one Arrow binary array per name."""
    packed, n, w = packed or b"", sizes.shape[0], PACK.itemsize
    start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=start[1:])
    if int(start[-1]) != len(packed) or (n and int(sizes.min()) < w):
        raise ColumnError(f"catalog packed metadata: {n} records of sizes adding up to {int(start[-1])} B "
                          f"(each >= {w} B), got {len(packed)} B")
    buf = pa.py_buffer(packed)
    heads = pc.binary_slice(pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(start), buf]),
                            0, w)
    _, offsets, data = heads.buffers()
    head = np.frombuffer(data, dtype=PACK, count=n, offset=int(np.frombuffer(offsets, dtype=np.int64)[heads.offset]))
    cuts = np.empty((n, len(NAMES) + 1), dtype=np.int64)  # per record: header end, then the end of each name
    cuts[:, 0] = start[:-1] + w
    for k, name in enumerate(NAMES):
        cuts[:, k + 1] = cuts[:, k] + head[f"{name}_bytes"]
    if n and not (cuts[:, -1] == start[1:]).all():
        raise ColumnError("catalog packed metadata: a record's name lengths do not match its size")
    bounds = np.concatenate([[0], cuts.reshape(-1)])  # values: header, id, group id, run, teacher, header, ...
    every = pa.LargeBinaryArray.from_buffers(pa.large_binary(), n * (len(NAMES) + 1), [None, pa.py_buffer(bounds), buf])
    step = len(NAMES) + 1
    return head, {name: every.take(pa.array(np.arange(k + 1, step * n, step))) for k, name in enumerate(NAMES)}
