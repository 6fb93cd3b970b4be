"""Records of the rollout path: a request, a finished trajectory, a worker's report of one call."""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from rollout.sampling import SamplingParams

# Prompt and environment (tool result) tokens are logged with this log-prob: a real log-prob is <= 0,
# so the value marks a token as not sampled (loss-masked) without a second field in the WAL record.
ENV_LOGPROB = 1.0


def is_sampled(logprob: float) -> bool:
    return logprob <= 0.0


def token_hash(tokens: list[int]) -> str:
    """Hash over the token ids of a whole trajectory (what two runs compare)."""
    return hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()[:16]


@dataclass(frozen=True)
class Request:
    """One episode to roll out: its id names its RNG stream, so the same id gives the same trajectory."""

    traj_id: str
    domain: str
    prompt: str
    params: SamplingParams


@dataclass
class Finished:
    """A complete trajectory as it goes to the data plane."""

    traj_id: str
    domain: str
    prompt: str
    tokens: list[int]
    logprobs: list[float]  # ENV_LOGPROB where not sampled
    policy_versions: list[int]
    prompt_len: int
    completion: str
    reward: float
    reason: str
    stop_reason: str

    @property
    def loss_mask(self) -> list[bool]:
        return [is_sampled(lp) for lp in self.logprobs]

    @property
    def token_hash(self) -> str:
        return token_hash(self.tokens)


@dataclass
class WorkerReport:
    """What one `run` call of a worker returns to the pool."""

    committed: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # traj -> (start, tokens) newly durable
    finished: list[Finished] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)  # cumulative for this worker incarnation
    already_final: list[str] = field(default_factory=list)  # submitted ids the WAL had finalized earlier
    idle: bool = False
