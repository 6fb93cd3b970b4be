"""Deterministic sampling: a counter-based RNG and inverse-CDF draws over filtered probabilities.

The token at position t of trajectory j is a pure function of (run seed, j, t, logits): the uniform
comes from a splitmix64 hash of the three keys (no generator state, so batch composition, resume
point and worker never matter), and the draw is an inverse-CDF search over fp64 probabilities that
are sorted with a stable sort, so the reduction order per row is fixed. Pure: torch only.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding controls. temperature 0 is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64  # sampled tokens over the whole trajectory (env tokens not counted)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings, e.g. ("</call>",)
    ignore_eos: bool = False

    def __post_init__(self):
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature {self.temperature} outside [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} outside (0, 1]")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(f"top_k {self.top_k} must be >= 0 and max_new_tokens {self.max_new_tokens} >= 1")


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def traj_key(traj_id: str | int) -> int:
    """A 64-bit key of a trajectory id (stable across processes, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(str(traj_id).encode(), digest_size=8).digest(), "little")


def uniform(seed: int, traj: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, trajectory key, position)."""
    h = splitmix64(seed & _MASK64)
    h = splitmix64(h ^ (traj & _MASK64))
    h = splitmix64(h ^ (position & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def row_hash(seed: int, traj: int) -> int:
    """The position-independent part of `uniform(seed, traj, ·)`, as a signed 64-bit integer (its bits)."""
    h = splitmix64(splitmix64(seed & _MASK64) ^ (traj & _MASK64))
    return h - (1 << 64) if h >> 63 else h


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> sign-extends)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >> 63 else c


_C1, _C2, _C3 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def uniform_t(row_hash_B: torch.Tensor, position_B: torch.Tensor) -> torch.Tensor:
    """`uniform(seed, traj, position)` of each row as a float64 tensor, on the tensors' device: row_hash_B
    is `row_hash(seed, traj)` (int64), position_B int64. The splitmix64 arithmetic in int64 (bits wrap as
    uint64's do), so a decode step can draw its uniforms without leaving the device."""
    x = row_hash_B ^ position_B
    x = x + _C1
    x = (x ^ _srl(x, 30)) * _C2
    x = (x ^ _srl(x, 27)) * _C3
    x = x ^ _srl(x, 31)
    return _srl(x, 11).to(torch.float64) * (1.0 / (1 << 53))


def sample_dense(logits_BV: torch.Tensor, temperature_B: torch.Tensor, u_B: torch.Tensor,
                 any_greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` for rows without top-k / top-p filtering, every input a tensor on the logits' device
    (float64 temperatures, 0 = greedy; float64 uniforms): no host values, so a captured decode step can
    run it. `any_greedy` False skips the greedy branch (then no row may have temperature 0)."""
    V = logits_BV.shape[1]
    x = logits_BV.to(torch.float64)
    greedy = temperature_B == 0
    z = x / torch.where(greedy, torch.ones_like(temperature_B), temperature_B)[:, None]
    probs = torch.softmax(z, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    pick = torch.searchsorted(cdf, u_B[:, None] * cdf[:, -1:], right=True).clamp_(max=V - 1)
    token = pick[:, 0]
    lp = torch.log(probs.gather(1, pick)[:, 0] / cdf[:, -1])
    if not any_greedy:
        return token, lp
    token = torch.where(greedy, torch.argmax(x, dim=-1), token)  # argmax: first maximum
    logprob_greedy = torch.log_softmax(x, dim=-1).gather(1, token[:, None])[:, 0]
    return token, torch.where(greedy, logprob_greedy, lp)


def sample(logits_BV: torch.Tensor, params: list[SamplingParams], u_B: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] and their behaviour log-probs [B] (log-prob under the distribution actually sampled:
    temperature-scaled, top-k / top-p filtered and renormalised; greedy rows report the plain softmax).

    Every row is computed independently of the others in fp64, so a row's draw never depends on
    what else is in the batch.
    """
    B, V = logits_BV.shape
    if len(params) != B or len(u_B) != B:
        raise ValueError(f"sample: {B} rows but {len(params)} params and {len(u_B)} uniforms")
    dev = logits_BV.device
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=dev)
    filtered = [not (p.top_k <= 0 or p.top_k >= V) or p.top_p < 1.0 for p in params]
    if not any(filtered):  # the common RL case: one softmax + cumsum, no sort
        return sample_dense(logits_BV, temp, torch.tensor(u_B, dtype=torch.float64, device=dev),
                            any(p.temperature == 0 for p in params))
    x = logits_BV.to(torch.float64)
    greedy = temp == 0
    z = x / torch.where(greedy, torch.ones_like(temp), temp)[:, None]
    u = torch.tensor(u_B, dtype=torch.float64, device=dev)
    # A row's path depends on its own params only: filtered rows draw over the stably sorted order,
    # unfiltered rows over the vocabulary order (as `sample_dense` draws them).
    token, lp = _draw_sorted(z, params, u[:, None])
    if not all(filtered):
        tok_u, lp_u = sample_dense(logits_BV, temp, u, False)
        f = torch.tensor(filtered, device=dev)
        token, lp = torch.where(f, token, tok_u), torch.where(f, lp, lp_u)
    if not any(p.temperature == 0 for p in params):
        return token, lp
    token = torch.where(greedy, torch.argmax(x, dim=-1), token)  # argmax: first maximum
    logprob_greedy = torch.log_softmax(x, dim=-1).gather(1, token[:, None])[:, 0]
    logprob = torch.where(greedy, logprob_greedy, lp)
    return token, logprob  # on the logits' device: the caller syncs when it reads them


def _draw_sorted(z: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k / top-p filtered draw over the stably sorted probabilities."""
    B, V = z.shape
    z_sorted, idx = torch.sort(z, dim=-1, descending=True, stable=True)
    probs = torch.softmax(z_sorted, dim=-1)
    rank = torch.arange(V, device=z.device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=z.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=z.device)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each rank
    keep = (rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0))
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(kept, dim=-1)
    total = cdf[:, -1:]
    pick = torch.searchsorted(cdf, u * total, right=True).clamp_(max=V - 1)
    return idx.gather(1, pick)[:, 0], torch.log(kept.gather(1, pick)[:, 0] / total[:, 0])
