"""OPD losses (pure): multi-teacher full-vocabulary reverse KL, and the sampled-token baseline.

Legend: N packed tokens, H_s / H_t student / teacher hidden, V vocab. Position p's hidden state
predicts token p+1, so the loss lives on the positions whose next token is a loss token (the
student's own completion tokens; prompt and tool-result tokens excluded).

    full vocabulary:  L = sum_i w_i sum_{p in P_i} KL(p_s(.|p) || p_t_i(.|p)) / n
    sampled token:    L = sum_i w_i sum_{p in P_i} -min(r_p A_p, clip(r_p, 1-eps, 1+eps) A_p) / n,
                      A_p = log p_t_i(y_p) - log p_behaviour(y_p),  r_p = p_s(y_p) / p_behaviour(y_p)

where P_i are the positions of the rows scored against teacher i and n the number of student positions
in the whole step (all ranks; a position scored by several teachers of its domain counts once). The sampled-token form is the per-token estimate of the
reverse KL used as the advantage of a policy-gradient loss (what verl, slime, NeMo-RL's MOPD do).
"""
from __future__ import annotations

import torch

from distill.kl import reverse_kl
from learner.grpo_loss import logprobs_from_hidden


def prediction_positions(loss_mask_N: torch.Tensor) -> torch.Tensor:
    """[N] bool: position p predicts a loss token (p + 1 is one). A packed sequence's first token is
    never a loss token, so no position predicts across a sequence boundary."""
    out = torch.zeros_like(loss_mask_N, dtype=torch.bool)
    out[:-1] = loss_mask_N[1:].bool()
    return out


def full_vocab_kl(h_s_PH: torch.Tensor, W_s: torch.Tensor, h_t_PH: torch.Tensor, W_t: torch.Tensor,
                  coef_P: torch.Tensor, temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """sum_p coef_p KL(p_s || p_t) at positions P (already selected); gradients reach h_s and W_s."""
    return reverse_kl(h_s_PH, W_s, h_t_PH.to(W_t.dtype), W_t, weights=coef_P, temperature=temperature,
                      chunk_tokens=chunk_tokens)


@torch.no_grad()
def teacher_token_logprobs(h_t_PH: torch.Tensor, W_t: torch.Tensor, next_P: torch.Tensor,
                           temperature: float = 1.0, chunk_rows: int = 2048) -> torch.Tensor:
    """log p_t(y_p) at positions P, the logits rebuilt chunk by chunk (never [P, V] at once)."""
    h = h_t_PH.to(W_t.dtype) / temperature
    return logprobs_from_hidden(h, W_t, next_P, chunk_rows)[0].float()


def sampled_token_pg(logp_P: torch.Tensor, behaviour_P: torch.Tensor, teacher_logp_P: torch.Tensor,
                     coef_P: torch.Tensor, eps: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-position k1 estimate of the reverse KL) of the sampled-token baseline."""
    adv_P = (teacher_logp_P - behaviour_P).detach()
    ratio_P = torch.exp(logp_P - behaviour_P.detach())
    pg_P = -torch.minimum(ratio_P * adv_P, ratio_P.clamp(1 - eps, 1 + eps) * adv_P)
    return (coef_P * pg_P).sum(), (logp_P.detach() - teacher_logp_P)
