"""A plain, obviously correct GRPO loss: one Python loop over sequences and tokens, textbook formulas.

Test-only: the library's vectorised loss (`learner/grpo_loss.py`) is checked against this in value and
gradients. Written from the PPO objective (maximise min of the two surrogates), independently of the
library's "max of negated surrogates" form.
"""
from __future__ import annotations

import torch


def reference_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    # Schulman, "Approximating KL divergence": with r = pi_ref / pi on tokens sampled from pi,
    # k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r.
    r = torch.exp(ref_logp - logp)
    if estimator == "k1":
        return -torch.log(r)
    if estimator == "k2":
        return 0.5 * torch.log(r) ** 2
    return (r - 1) - torch.log(r)


def reference_loss(new, behaviour, advantages, loss_mask, seq_ids, *, ref=None, entropy=None,
                   eps_low=0.2, eps_high=0.2, dual_clip=None, aggregation="token-mean", norm_len=16,
                   kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0) -> torch.Tensor:
    per_seq: dict[int, list[torch.Tensor]] = {}
    for t in range(len(new)):
        if not bool(loss_mask[t]):
            continue
        ratio = torch.exp(new[t] - behaviour[t])
        a = advantages[t]
        surrogate = torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
        if dual_clip is not None and a < 0:
            surrogate = torch.max(surrogate, dual_clip * a)
        loss_t = -surrogate
        if kl_coef:
            loss_t = loss_t + kl_coef * reference_kl(new[t], ref[t], kl_estimator)
        if entropy_coef:
            loss_t = loss_t - entropy_coef * entropy[t]
        per_seq.setdefault(int(seq_ids[t]), []).append(loss_t)
    if aggregation == "token-mean":
        terms = [x for seq in per_seq.values() for x in seq]
        return sum(terms) / len(terms)
    if aggregation == "seq-mean-token-mean":
        return sum(sum(seq) / len(seq) for seq in per_seq.values()) / len(per_seq)
    if aggregation == "seq-mean-token-sum-norm":
        return sum(sum(seq) / norm_len for seq in per_seq.values()) / len(per_seq)
    raise ValueError(aggregation)


def reference_logprobs(logits, labels):
    """log p(label) and entropy by the definitions, in float64."""
    logits = logits.double()
    probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    logp = torch.log(probs)
    return logp[torch.arange(len(labels)), labels], -(probs * logp).sum(-1)

