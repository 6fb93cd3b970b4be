"""Records of the log (decoded form) and the small structs the views hand out.

Token ids travel packed as little-endian int32 (`TOKEN_DTYPE`), behaviour log-probs as little-endian
float64 (`LOGPROB_DTYPE`), so a record never holds one Python object per token.
"""
from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import NamedTuple

TOKEN_DTYPE = "<i4"
LOGPROB_DTYPE = "<f8"
TOKEN_BYTES = 4
LOGPROB_BYTES = 8

# record types (one byte on disk; never renumber)
TOKENS = 1
FINALIZE = 2
ENV_INVOKE = 3
ENV_RESULT = 4
ENV_RELEASE = 5
STEP = 6
RECORD_TYPES = (TOKENS, FINALIZE, ENV_INVOKE, ENV_RESULT, ENV_RELEASE, STEP)


class Committed(NamedTuple):
    """The committed part of one trajectory, as `TokenLog.read_many` hands it out."""

    tokens: list[int]
    logprobs: list[float]
    policy_versions: list[int]


class TokensRecord(NamedTuple):
    """`len(tokens) // 4` sampled tokens of `traj_id` at positions start, start+1, …"""

    lsn: int
    traj_id: str
    start: int
    policy_version: int
    tokens: bytes  # packed TOKEN_DTYPE (a read-only memoryview when decoded from disk)
    logprobs: bytes  # packed LOGPROB_DTYPE, one per token (likewise)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES


class Starts(Sequence):
    """A decoded STEP record's positions, kept as the little-endian int64 bytes of the frame (`packed`) and
    unpacked on first access: a sequence of ints, equal to the tuple of the same ints. Recovery compares
    `packed` with the positions its step group expects next and never unpacks them; unpacking 512 ints
    cost more than the rest of a record's decode."""

    __slots__ = ("packed", "_values")

    def __init__(self, packed: bytes) -> None:
        self.packed = packed
        self._values: tuple[int, ...] | None = None

    def _tuple(self) -> tuple[int, ...]:
        if self._values is None:
            values = array("q")
            values.frombytes(self.packed)
            if sys.byteorder != "little":
                values.byteswap()
            self._values = tuple(values)
        return self._values

    def __len__(self) -> int:
        return len(self.packed) // 8

    def __getitem__(self, i):
        return self._tuple()[i]

    def __iter__(self):
        return iter(self._tuple())

    def __eq__(self, other) -> bool:
        if isinstance(other, Starts):
            return self.packed == other.packed
        if isinstance(other, tuple):
            return self._tuple() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._tuple())

    def __repr__(self) -> str:
        return repr(self._tuple())


class StepRecord(NamedTuple):
    """One batched decode step: token i of `tokens` at position starts[i] of traj_ids[i] (distinct ids),
    all sampled under one policy version; one frame, one checksum. Equivalent to one one-token
    TokensRecord per trajectory under the same lsn (`items()`)."""

    lsn: int
    policy_version: int
    traj_ids: tuple[str, ...]
    starts: tuple[int, ...]  # a Starts when decoded
    tokens: bytes  # packed TOKEN_DTYPE, one per trajectory (a read-only memoryview when decoded)
    logprobs: bytes  # packed LOGPROB_DTYPE, likewise

    @property
    def n_tokens(self) -> int:
        return len(self.traj_ids)

    def items(self) -> list[TokensRecord]:
        t, lp, v, lsn = self.tokens, self.logprobs, self.policy_version, self.lsn
        return [TokensRecord(lsn, tid, start, v, t[i * TOKEN_BYTES:(i + 1) * TOKEN_BYTES],
                             lp[i * LOGPROB_BYTES:(i + 1) * LOGPROB_BYTES])
                for i, (tid, start) in enumerate(zip(self.traj_ids, self.starts))]


class FinalizeRecord(NamedTuple):
    """The trajectory is safely in the data plane; its token records may be reclaimed."""

    lsn: int
    traj_id: str


class EnvInvokeRecord(NamedTuple):
    """Tool invocation number `seq` of a sandbox, written before the tool runs."""

    lsn: int
    sandbox_id: str
    seq: int
    request: bytes


class EnvResultRecord(NamedTuple):
    """The result of invocation `seq`, written before the result is exposed."""

    lsn: int
    sandbox_id: str
    seq: int
    response: bytes


class EnvReleaseRecord(NamedTuple):
    """The sandbox is done: its environment records may be reclaimed and it takes no more entries."""

    lsn: int
    sandbox_id: str


Record = TokensRecord | StepRecord | FinalizeRecord | EnvInvokeRecord | EnvResultRecord | EnvReleaseRecord


class EnvEntry(NamedTuple):
    """One durable entry of a sandbox's environment log; `response` is None until the result is logged."""

    seq: int
    request: bytes
    response: bytes | None
