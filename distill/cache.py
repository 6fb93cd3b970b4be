"""The teacher hidden-state cache: records, names and checks (pure).

For each sampled trajectory and each teacher of its domain, the teacher's last-layer hidden states
after the final norm ([L, H_teacher], bf16 by default) go into the data plane as a heavy field of a
training row: id `TRAJ@TEACHER`, run `BATCH.cache`, `teacher_id` the teacher's name, the trajectory's
tokens, loss mask and behaviour log-probs, and a record in the catalog row's meta naming run,
trajectory, teacher, weights fingerprint, dtype, token range and a hash of the tokens. Teacher logits
are never stored. Before a row is trained on, its record is checked against the teacher set of the
run and the trajectory it claims to describe; any difference is an error, never trained on.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from core.errors import UserError

FIELD = "teacher_hidden"
DTYPES = ("bfloat16", "float32")


class CacheMismatch(UserError):
    """A cache row describes another run, teacher, weights, dtype or token sequence than expected."""


def cache_run(batch: str) -> str:
    """Data-plane run of the cache rows of batch `batch`."""
    return f"{batch}.cache"


def cache_id(traj_id: str, teacher: str) -> str:
    return f"{traj_id}@{teacher}"


@dataclass(frozen=True)
class CacheRecord:
    run_id: str  # the OPD run that computed it
    traj: str
    teacher: str
    fingerprint: str  # the teacher weights' sha256
    dtype: str
    start: int  # token range of the trajectory the states cover
    stop: int
    tokens_hash: str  # of the tokens they were computed on (rollout.types.token_hash)
    hidden_size: int

    def to_meta(self) -> dict:
        return {"cache": asdict(self)}

    @classmethod
    def from_meta(cls, meta: dict | None, row_id: str) -> "CacheRecord":
        try:
            return cls(**meta["cache"])
        except (TypeError, KeyError) as exc:
            raise CacheMismatch(f"cache row {row_id!r}: no valid cache record in its catalog meta ({exc})") from None


def check(rec: CacheRecord, *, row_id: str, run_id: str, teacher: str, fingerprint: str, dtype: str,
          length: int, tokens_hash: str, hidden_size: int) -> None:
    """Raise CacheMismatch naming the first fact of `rec` that is not the expected one."""
    expected = {"run_id": run_id, "traj": row_id.rsplit("@", 1)[0], "teacher": teacher, "fingerprint": fingerprint,
                "dtype": dtype, "start": 0, "stop": length, "tokens_hash": tokens_hash, "hidden_size": hidden_size}
    got = asdict(rec)
    for key, want in expected.items():
        if got[key] != want:
            what = {"fingerprint": "stale teacher weights", "tokens_hash": "other tokens", "teacher": "another teacher",
                    "run_id": "another run"}.get(key, key)
            raise CacheMismatch(f"cache row {row_id!r}: {what}: {key} is {str(got[key])[:24]!r}, expected "
                                f"{str(want)[:24]!r}; refusing to train on it (delete the cache rows or rerun)")
