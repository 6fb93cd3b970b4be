"""A prompt budget shared among domains (largest remainder): the mixture of a multi-domain run."""
from __future__ import annotations

import numpy as np

from core.errors import UserError


def domain_shares(total: int, domains: list[str], weights: dict[str, float] | None = None) -> dict[str, int]:
    """`total` prompts split over `domains` in proportion to `weights` (equal when empty)."""
    weights = weights or {}
    w = np.array([float(weights.get(d, 0.0 if weights else 1.0)) for d in domains])
    if (w < 0).any() or w.sum() <= 0:
        raise UserError(f"domain weights {weights} must be >= 0 with a positive sum over {domains}")
    exact = total * w / w.sum()
    base = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - base), kind="stable")[: total - int(base.sum())]:
        base[i] += 1
    return dict(zip(domains, base.tolist()))


def kl_weights(domains: list[str], kl: dict[str, float], floor: float) -> dict[str, float]:
    """Shares that follow the student's distance to its teachers: each domain gets `floor`, the rest is
    split in proportion to its per-token KL of the last iteration (equal where no KL is known yet or
    every KL is zero). A domain the student has already caught up with keeps `floor` of the samples, so
    it stays watched, and the budget goes where the teachers still disagree."""
    if not 0.0 <= floor * len(domains) <= 1.0:
        raise UserError(f"mixture floor {floor} x {len(domains)} domains must lie in [0, 1]")
    k = np.array([float(kl.get(d, 0.0)) for d in domains])
    if not np.isfinite(k).all():
        raise UserError(f"per-domain KL {kl} is not finite: cannot set the mixture from it")
    k = np.maximum(k, 0.0)  # the chunked estimate can round a zero KL to a tiny negative
    if len(kl) < len(domains) or k.sum() <= 0:
        return {d: 1.0 for d in domains}
    rest = 1.0 - floor * len(domains)
    return {d: floor + rest * float(v) / float(k.sum()) for d, v in zip(domains, k)}


def domain_kl(row: dict, teachers: list[tuple[str, str, float]], domains: list[str], per: str = "token",
              samples_per_prompt: int = 1) -> dict[str, float]:
    """Each domain's KL to its teachers from one iteration's train row: the weighted mean of `kl_{name}` (per
    token) over the domain's teachers (name, domain, weight); per "sequence", times the domain's scored
    positions per sample (`positions_{name}` over `prompts_{domain}` x samples_per_prompt). A domain whose
    figures the row lacks is left out."""
    out = {}
    for d in domains:
        mine = [(name, w) for name, dom, w in teachers if dom == d and f"kl_{name}" in row]
        if not mine:
            continue
        total = sum(w for _, w in mine)
        kl = sum(w * row[f"kl_{name}"] for name, w in mine) / total
        if per == "sequence":
            samples = row.get(f"prompts_{d}", 0) * samples_per_prompt
            if not samples or any(f"positions_{name}" not in row for name, _ in mine):
                continue
            kl *= sum(w * row[f"positions_{name}"] for name, w in mine) / total / samples
        out[d] = kl
    return out
