"""Records and wire structs of the data plane: trajectories in, metadata selections, plans, packed batches."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Lifecycle of a catalogued trajectory. `select` reads "complete" unless told otherwise.
STATUSES = ("complete", "truncated", "failed", "retired")

# Heavy per-token fields every trajectory has; anything else goes to `extras`.
CORE_FIELDS = ("tokens", "loss_mask", "logprobs")


@dataclass
class TrajectoryRecord:
    """One finished trajectory as a rollout worker hands it to `DataPlane.put`.

    Light fields go to the catalog; `tokens` [L] int, `loss_mask` [L] 0/1, `logprobs` [L] float (the
    behaviour policy's log-probs) and each `extras[name]` [L, ...] (any numeric dtype; torch bfloat16
    tensors are stored as their uint16 bits and come back as bfloat16) go to an Arrow shard.
    """

    id: str
    run: str
    domain: str
    prompt: str
    group_id: str
    tokens: Any
    loss_mask: Any
    logprobs: Any
    reward: float = 0.0
    policy_min: int = 0
    policy_max: int = 0
    status: str = "complete"
    teacher_id: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] | None = None  # small JSON-able facts kept in the catalog row (not per token)

    @property
    def length(self) -> int:
        return int(len(self.tokens))


@dataclass
class Selection:
    """Light metadata of selected trajectories as parallel numpy arrays (one entry per trajectory),
    in canonical order (run, group id, trajectory id; bytewise) so every catalog backend yields the same arrays."""

    ids: np.ndarray  # [N] str
    seq: np.ndarray  # [N] int64 catalog key
    length: np.ndarray  # [N] int64 tokens
    group: np.ndarray  # [N] int64 dense code of (run, group_id), ordered bytewise
    teacher: np.ndarray  # [N] int64 index into `teachers` (dense, bytewise order; "" = no teacher)
    reward: np.ndarray  # [N] float64
    policy_min: np.ndarray  # [N] int64
    policy_max: np.ndarray  # [N] int64
    shard: np.ndarray  # [N] int64 index into `shard_paths`
    row: np.ndarray  # [N] int64 row inside the shard
    checksum: np.ndarray  # [N] uint32 crc32c of the row's heavy bytes
    shard_paths: list[str]  # store-relative shard paths
    teachers: list[str]  # teacher code -> name ("" = none)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.length.sum())


_PLAN_ARRAYS = {  # name -> dtype of the plan's numpy arrays (for the JSON round trip)
    "ids": str, "seq": np.int64, "length": np.int64, "group": np.int64, "teacher": np.int64, "reward": np.float64,
    "shard": np.int64, "row": np.int64, "checksum": np.uint32,
    "seg_traj": np.int64, "seg_start": np.int64, "seg_stop": np.int64, "bin_offsets": np.int64,
    "balanced": np.bool_,
}


@dataclass
class Plan:
    """An epoch's schedule, built from metadata only; small, picklable and JSON-able, so it can be sent
    to remote learner ranks. Segment k is tokens [seg_start[k], seg_stop[k]) of trajectory seg_traj[k];
    the segments of minibatch m on rank r are seg_*[bin_offsets[m*R + r] : bin_offsets[m*R + r + 1]]."""

    store_root: str
    tokens_per_rank: int
    ranks: int
    seed: int
    epoch: int
    group_aware: bool
    by_teacher: bool
    # per trajectory
    ids: np.ndarray
    seq: np.ndarray  # catalog keys, to check cheaply that the trajectories are still there
    length: np.ndarray
    group: np.ndarray
    teacher: np.ndarray
    reward: np.ndarray
    shard: np.ndarray
    row: np.ndarray
    checksum: np.ndarray
    shard_paths: list[str]
    teachers: list[str]
    # per segment / bin / minibatch
    seg_traj: np.ndarray
    seg_start: np.ndarray
    seg_stop: np.ndarray
    bin_offsets: np.ndarray
    balanced: np.ndarray  # [M] True where the minibatch was balanced greedily (else next-fit order)

    @property
    def num_minibatches(self) -> int:
        return int(self.balanced.shape[0])

    @property
    def num_tokens(self) -> int:
        return int((self.seg_stop - self.seg_start).sum())

    def bin(self, minibatch: int, rank: int) -> slice:
        if not (0 <= minibatch < self.num_minibatches and 0 <= rank < self.ranks):
            raise IndexError(f"plan has {self.num_minibatches} minibatches x {self.ranks} ranks; "
                             f"asked for ({minibatch}, {rank})")
        k = minibatch * self.ranks + rank
        return slice(int(self.bin_offsets[k]), int(self.bin_offsets[k + 1]))

    def rank_tokens(self) -> np.ndarray:
        """[M, R] tokens per minibatch and rank."""
        seg_len = self.seg_stop - self.seg_start
        csum = np.concatenate([[0], np.cumsum(seg_len)])
        return (csum[self.bin_offsets[1:]] - csum[self.bin_offsets[:-1]]).reshape(-1, self.ranks)

    def summary(self) -> dict:
        tok = self.rank_tokens()
        per_mb = tok.sum(axis=1)
        spread = (tok.max(axis=1) - tok.min(axis=1)) if tok.size else np.zeros(0)
        return {
            "trajectories": int(self.ids.shape[0]), "segments": int(self.seg_traj.shape[0]),
            "tokens": self.num_tokens, "minibatches": self.num_minibatches, "ranks": self.ranks,
            "tokens_per_rank": self.tokens_per_rank, "seed": self.seed, "epoch": self.epoch,
            "group_aware": self.group_aware, "by_teacher": self.by_teacher,
            "split_trajectories": int((self.length > self.tokens_per_rank).sum()),
            "fill": float(per_mb.sum() / max(1, tok.size * self.tokens_per_rank)),
            "max_rank_spread_tokens": int(spread.max()) if spread.size else 0,
            "mean_rank_spread_frac": float((spread / np.maximum(1, tok.max(axis=1))).mean()) if spread.size else 0.0,
            "balanced_minibatches": int(self.balanced.sum()),
        }

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("store_root", "tokens_per_rank", "ranks", "seed", "epoch",
                                             "group_aware", "by_teacher", "shard_paths", "teachers")}
        for name in _PLAN_ARRAYS:
            out[name] = getattr(self, name).tolist()
        return out

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        kw = dict(data)
        for name, dtype in _PLAN_ARRAYS.items():
            kw[name] = np.asarray(data[name], dtype=dtype) if name != "ids" else np.asarray(data[name], dtype=str)
        if kw["ids"].shape[0] == 0:
            kw["ids"] = np.zeros(0, dtype="<U1")
        return cls(**kw)


@dataclass
class Batch:
    """One rank's share of one minibatch, packed: all segments concatenated along the token axis.

    input_ids [T] int64, position_ids [T] int64 (restart at each segment's start offset), cu_seqlens
    [S+1] int32 (segment boundaries, for varlen attention), loss_mask [T] bool, logprobs [T] float32,
    extras[name] [T, ...]; per segment: trajectory ids, token ranges, full lengths, rewards, groups.
    """

    minibatch: int
    rank: int
    input_ids: Any
    position_ids: Any
    cu_seqlens: Any
    loss_mask: Any
    logprobs: Any
    extras: dict[str, Any]
    traj_ids: list[str]
    seg_start: np.ndarray
    seg_stop: np.ndarray
    traj_length: np.ndarray
    reward: np.ndarray
    group: np.ndarray
    teacher: list[str]
    bytes_read: int = 0  # read from shard files: the delivered ranges plus bytes read only to verify
    bytes_delivered: int = 0  # heavy bytes (as stored) of the token ranges packed into this batch

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def nbytes(self) -> int:
        ts = [self.input_ids, self.position_ids, self.cu_seqlens, self.loss_mask, self.logprobs, *self.extras.values()]
        return int(sum(t.numel() * t.element_size() for t in ts))
