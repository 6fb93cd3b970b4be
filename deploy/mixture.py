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
