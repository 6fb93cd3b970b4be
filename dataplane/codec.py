"""Shard codec (pure): trajectories -> one Arrow record batch of heavy per-token fields, row checksums,
and zero-copy numpy views of a batch read back. No I/O here.

Columns: `id` string; `tokens` large_list<int32>; `loss_mask` large_list<uint8>; `logprobs`
large_list<float32>; extras as `x.NAME` large_list<dtype> or large_list<fixed_size_list<dtype, D>>
(trailing shape and logical dtype in the field metadata; bfloat16 travels as its uint16 bits).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import google_crc32c
import numpy as np
import pyarrow as pa

from dataplane.errors import BadRecordError
from dataplane.types import TrajectoryRecord

EXTRA_PREFIX = "x."
CORE_DTYPES = {"tokens": np.dtype(np.int32), "loss_mask": np.dtype(np.uint8), "logprobs": np.dtype(np.float32)}


@dataclass(frozen=True)
class FieldSpec:
    """How one heavy column is stored: storage dtype, trailing per-token shape, dtype given back."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    logical: str  # numpy dtype name or "bfloat16"

    @property
    def width(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


def _to_numpy(value, where: str) -> tuple[np.ndarray, str]:
    """numpy array and logical dtype name; torch tensors allowed (bfloat16 -> its uint16 bits)."""
    if hasattr(value, "detach") and hasattr(value, "dtype"):  # a torch tensor; torch is not imported here
        t = value.detach().cpu().contiguous()
        if str(t.dtype) == "torch.bfloat16":
            import torch

            return t.view(torch.uint16).numpy(), "bfloat16"
        return t.numpy(), t.numpy().dtype.name
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise BadRecordError(f"{where}: dtype {arr.dtype} is not numeric")
    return arr, arr.dtype.name


def record_fields(rec: TrajectoryRecord) -> dict[str, tuple[np.ndarray, FieldSpec]]:
    """Validate one record's heavy fields and convert them to storage arrays (first axis = tokens)."""
    where = f"trajectory {rec.id!r}"
    n = rec.length
    if n <= 0:
        raise BadRecordError(f"{where}: empty token sequence")
    out = {}
    for name, dtype in CORE_DTYPES.items():
        arr, _ = _to_numpy(getattr(rec, name), f"{where} field {name}")
        if arr.shape != (n,):
            raise BadRecordError(f"{where}: {name} has shape {arr.shape}, expected ({n},)")
        if name == "tokens" and arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
            raise BadRecordError(f"{where}: token ids must lie in [0, 2^31)")
        if name == "loss_mask" and arr.size and not np.isin(arr, (0, 1)).all():
            raise BadRecordError(f"{where}: loss_mask must hold only 0/1")
        if name == "logprobs" and not np.isfinite(arr).all():
            raise BadRecordError(f"{where}: logprobs must be finite")
        out[name] = (np.ascontiguousarray(arr, dtype=dtype), FieldSpec(name, dtype, (), dtype.name))
    for name in sorted(rec.extras):
        if not name or "/" in name:
            raise BadRecordError(f"{where}: bad extra field name {name!r}")
        arr, logical = _to_numpy(rec.extras[name], f"{where} extra {name!r}")
        if arr.ndim < 1 or arr.shape[0] != n:
            raise BadRecordError(f"{where}: extra {name!r} has shape {arr.shape}; its first axis must be {n} tokens")
        arr = np.ascontiguousarray(arr)
        out[EXTRA_PREFIX + name] = (arr, FieldSpec(EXTRA_PREFIX + name, arr.dtype, tuple(arr.shape[1:]), logical))
    return out


def row_checksum(arrays: list[np.ndarray]) -> int:
    """crc32c over the row's heavy bytes, column after column in schema order."""
    crc = 0
    for a in arrays:
        if a.flags.writeable:
            a = a.view()
            a.flags.writeable = False
        crc = google_crc32c.extend(crc, a.reshape(-1).view(np.uint8))
    return int(crc)


def encode(records: list[TrajectoryRecord]) -> tuple[pa.RecordBatch, list[int]]:
    """One record batch holding `records` in order, and each row's checksum. All records of one
    shard must carry the same extras with the same dtype and trailing shape."""
    if not records:
        raise BadRecordError("put: no trajectories given")
    fields = [record_fields(r) for r in records]
    specs = {k: s for k, (_, s) in fields[0].items()}
    for rec, f in zip(records, fields):
        mine = {k: s for k, (_, s) in f.items()}
        if mine != specs:
            raise BadRecordError(f"trajectory {rec.id!r}: heavy fields {sorted(mine)} (dtype/shape) differ from "
                                 f"{records[0].id!r}'s {sorted(specs)}; put them in separate calls")
    checksums = [row_checksum([f[k][0] for k in specs]) for f in fields]
    lengths = np.fromiter((r.length for r in records), dtype=np.int64, count=len(records))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), type=pa.int64())
    columns = [pa.array([r.id for r in records], type=pa.string())]
    schema_fields = [pa.field("id", pa.string(), nullable=False)]
    for name, spec in specs.items():
        flat = np.concatenate([f[name][0].reshape(-1) for f in fields])
        values = pa.array(flat)
        if spec.shape:
            values = pa.FixedSizeListArray.from_arrays(values, spec.width)
        columns.append(pa.LargeListArray.from_arrays(offsets, values))
        meta = {"shape": json.dumps(list(spec.shape)), "logical": spec.logical}
        schema_fields.append(pa.field(name, columns[-1].type, nullable=False, metadata=meta))
    return pa.RecordBatch.from_arrays(columns, schema=pa.schema(schema_fields)), checksums


@dataclass
class Column:
    """Zero-copy view of one heavy column: row i's values are values[offsets[i]:offsets[i+1]]."""

    spec: FieldSpec
    offsets: np.ndarray  # [rows+1] int64
    values: np.ndarray  # [total_tokens, *shape] storage dtype, read-only


_NUMPY = {pa.from_numpy_dtype(np.dtype(t)): np.dtype(t) for t in (
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64")}


def _view(arr: pa.Array) -> np.ndarray:
    """Read-only numpy view of a primitive array's data buffer (no copy; unlike `to_numpy`, which may
    import pandas on first use)."""
    dtype = _NUMPY[arr.type]
    out = np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset:arr.offset + len(arr)]
    out.flags.writeable = False
    return out


def decode(batch: pa.RecordBatch) -> tuple[pa.Array, dict[str, Column]]:
    """The id column and zero-copy numpy views of every heavy column of a record batch."""
    cols = {}
    for i, f in enumerate(batch.schema):
        if f.name == "id":
            continue
        meta = {k.decode(): v.decode() for k, v in (f.metadata or {}).items()}
        shape = tuple(json.loads(meta.get("shape", "[]")))
        arr = batch.column(i)
        offsets = _view(arr.offsets)
        child = arr.values
        if shape:
            width = int(np.prod(shape))
            flat = _view(child.values)[child.offset * width:(child.offset + len(child)) * width]
            values = flat.reshape(-1, *shape)
        else:
            values = _view(child)
        spec = FieldSpec(f.name, values.dtype, shape, meta.get("logical", values.dtype.name))
        cols[f.name] = Column(spec, offsets, values)
    return batch.column(batch.schema.get_field_index("id")), cols
