"""Read-only inspection of a log directory: `postrain wal verify` and `postrain wal dump`."""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from core.errors import UserError
from wal import codec, segments, tombstones
from wal.errors import CorruptionError, WALError
from wal.types import EnvInvokeRecord, EnvReleaseRecord, EnvResultRecord, FinalizeRecord, Record, StepRecord, TokensRecord


class NotALogError(WALError, UserError):
    """The directory holds no log segment: a mistyped path, or the parent of a run's logs."""


def log_directory(directory: str | Path) -> Path:
    """`directory` as a log to read, or an error naming what it is: missing, or holding no segment (a log
    always has one, from its first open on), with the logs one level below it where there are some (a
    rollout pool keeps one log per worker, `wal/0`, `wal/1`, ...)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(2, "WAL directory not found", str(directory))
    if segments.list_segments(directory):
        return directory
    below = sorted(e.name for e in os.scandir(directory) if e.is_dir() and segments.list_segments(Path(e.path)))
    where = (f"; the logs in it: {', '.join(below[:8])}" + (f" and {len(below) - 8} more" if len(below) > 8 else "")
             if below else "")
    raise NotALogError(f"{directory} is not a WAL directory: it holds no segment file "
                       f"(<base lsn, 20 digits>.seg){where}")


def verify(directory: str | Path) -> dict:
    """Scan without modifying anything: segments, records, trajectories, tokens, torn tail, corruption."""
    directory = log_directory(directory)
    lengths: dict[str, int] = {}
    finalized: set[str] = set()
    counts = {"tokens_records": 0, "step_records": 0, "finalize_records": 0, "env_records": 0}
    problems: list[str] = []
    tokens_total = 0

    def on_record(rec: Record) -> None:
        nonlocal tokens_total
        if isinstance(rec, StepRecord):  # a decode step: one token per trajectory, checked like token records
            counts["step_records"] += 1
            counts["tokens_records"] -= len(rec.traj_ids)
            for item in rec.items():
                on_record(item)
        elif isinstance(rec, TokensRecord):
            counts["tokens_records"] += 1
            tokens_total += rec.n_tokens
            end = lengths.get(rec.traj_id, 0)
            if rec.start > end and len(problems) < 20:
                problems.append(f"trajectory {rec.traj_id!r}: record lsn {rec.lsn} starts at {rec.start}, after position {end}")
            lengths[rec.traj_id] = max(end, rec.start + rec.n_tokens)
        elif isinstance(rec, FinalizeRecord):
            counts["finalize_records"] += 1
            finalized.add(rec.traj_id)
        else:
            counts["env_records"] += 1

    report = segments.scan(directory, on_record, mutate=False)
    out = asdict(report)
    out.update(counts)
    out["trajectories"] = len(set(lengths) - finalized)
    out["finalized"] = len(finalized)
    out["tokens"] = tokens_total
    out["live_tokens"] = sum(n for t, n in lengths.items() if t not in finalized)
    out["order_notes"] = problems  # out-of-order starts are normal after compaction; recovery sorts them
    out["ok"] = not report.corruption
    try:
        out["finalized_forgotten"] = len(tombstones.read(directory, mutate=False))
    except CorruptionError as exc:
        out["tombstone_corruption"] = str(exc)
        out["ok"] = False
    return out


def dump(directory: str | Path, traj_id: str) -> list[dict]:
    """Every record of one trajectory, in log order, as plain dicts."""
    rows: list[dict] = []

    def on_record(rec: Record) -> None:
        if isinstance(rec, StepRecord):
            if traj_id in rec.traj_ids:
                item = rec.items()[rec.traj_ids.index(traj_id)]
                rows.append({"lsn": rec.lsn, "type": "tokens", "start": item.start, "policy_version": rec.policy_version,
                             "tokens": codec.unpack_tokens(item.tokens), "logprobs": codec.unpack_logprobs(item.logprobs),
                             "step_trajectories": len(rec.traj_ids)})  # its part of a STEP record
        elif isinstance(rec, TokensRecord) and rec.traj_id == traj_id:
            rows.append({"lsn": rec.lsn, "type": "tokens", "start": rec.start, "policy_version": rec.policy_version,
                         "tokens": codec.unpack_tokens(rec.tokens), "logprobs": codec.unpack_logprobs(rec.logprobs)})
        elif isinstance(rec, FinalizeRecord) and rec.traj_id == traj_id:
            rows.append({"lsn": rec.lsn, "type": "finalize"})
        elif isinstance(rec, EnvReleaseRecord) and rec.sandbox_id == traj_id:
            rows.append({"lsn": rec.lsn, "type": "env_release"})
        elif isinstance(rec, (EnvInvokeRecord, EnvResultRecord)) and rec.sandbox_id == traj_id:
            kind = "env_invoke" if isinstance(rec, EnvInvokeRecord) else "env_result"
            data = rec.request if kind == "env_invoke" else rec.response
            rows.append({"lsn": rec.lsn, "type": kind, "seq": rec.seq, "bytes": len(data),
                         "data": data.decode("utf-8", "backslashreplace")})

    segments.scan(log_directory(directory), on_record, mutate=False)
    return rows
