"""GRPO policy loss over packed token streams (pure: tensors in, tensors out).

Legend: N tokens of a packed minibatch (several sequences laid end to end), S sequences, V vocab,
H hidden size. Every per-token tensor is aligned with the token it scores: `logprobs_N[t]` is
log π(token_t | tokens_<t of its own sequence).

Per-token loss  l_t = pg_t + kl_coef · kl_t − entropy_coef · H_t, with
  ratio_t = exp(logπ_new − logπ_behaviour),
  pg_t    = max(−A·ratio, −A·clip(ratio, 1−ε_low, 1+ε_high))      (PPO, asymmetric clip)
  pg_t    = min(pg_t, −A·c) where A < 0                            (dual clip, c > 1)
  kl_t    = k1 | k2 | k3 estimate of KL(π_new ‖ π_ref) from the sampled token (Schulman 2020).
The scalar loss is Σ_t w_t · l_t where the weights w_t encode the aggregation; they take global
counts (all micro-batches of a step, all ranks) so that splitting a minibatch changes nothing:
  token-mean               w_t = m_t / T                  T = loss tokens in the whole step
  seq-mean-token-mean      w_t = m_t / (L_seq(t) · S)     L_seq = loss tokens of t's sequence
  seq-mean-token-sum-norm  w_t = m_t / (norm_len · S)     (Dr. GRPO: a constant length, no length bias)
A sequence split into pieces (the data plane cuts long trajectories) counts as Σ m_t / L_seq(t) = 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


@dataclass(frozen=True)
class LossOptions:
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None  # c > 1; None disables
    aggregation: Aggregation = "token-mean"
    norm_len: int = 1024  # the constant length of seq-mean-token-sum-norm, in tokens
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise ValueError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {self.aggregation!r} not in {AGGREGATIONS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator {self.kl_estimator!r} not in {KL_ESTIMATORS}")
        if self.norm_len < 1:
            raise ValueError(f"norm_len must be >= 1, got {self.norm_len}")


@dataclass
class LossInputs:
    logprobs_N: torch.Tensor  # new policy, carries the gradient
    behaviour_logprobs_N: torch.Tensor  # recorded at sampling time (the WAL)
    advantages_N: torch.Tensor
    loss_mask_N: torch.Tensor  # bool: completion tokens that are trained on
    seq_ids_N: torch.Tensor  # long, 0..S-1: which sequence of the pack each token belongs to
    ref_logprobs_N: torch.Tensor | None = None  # needed when kl_coef > 0
    entropy_N: torch.Tensor | None = None  # needed when entropy_coef > 0 (may carry gradient)
    # Loss tokens of each sequence's whole trajectory (pieces elsewhere included); None: this pack.
    seq_loss_tokens_S: torch.Tensor | None = None
    # Global normalisers across micro-batches and ranks; None: this pack alone.
    total_loss_tokens: float | None = None
    total_seqs: float | None = None
    num_loss_tokens: int | None = None  # loss tokens of this pack when the caller knows them (saves a sync)


@dataclass
class LossOutputs:
    loss: torch.Tensor  # scalar; gradients of Σ over micro-batches equal those of the whole step
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # token-means over this pack's loss tokens
    num_loss_tokens: int = 0  # the metrics' weight when averaging over micro-batches


def seq_ids_from_cu_seqlens(cu_seqlens_S1: torch.Tensor) -> torch.Tensor:
    """[0, 3, 5] -> [0, 0, 0, 1, 1]."""
    lengths_S = cu_seqlens_S1[1:] - cu_seqlens_S1[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths_S), device=cu_seqlens_S1.device), lengths_S)


def kl_estimate(logprobs_N: torch.Tensor, ref_logprobs_N: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from tokens sampled from π; log r = log π_ref − log π."""
    log_r = ref_logprobs_N - logprobs_N
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl estimator {estimator!r} not in {KL_ESTIMATORS}")


def aggregation_weights(opts: LossOptions, inp: LossInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_N, sequences counted in this pack) — see the module docstring."""
    mask_N = inp.loss_mask_N.to(torch.float64)
    if inp.seq_loss_tokens_S is None:
        num_seqs = int(inp.seq_ids_N.max().item()) + 1 if inp.seq_ids_N.numel() else 0
        seq_tokens_S = torch.zeros(num_seqs, dtype=torch.float64, device=mask_N.device)
        seq_tokens_S.index_add_(0, inp.seq_ids_N, mask_N)
    else:
        seq_tokens_S = inp.seq_loss_tokens_S.to(torch.float64)
    seq_tokens_N = seq_tokens_S[inp.seq_ids_N]
    # A sequence with no loss tokens counts for nothing (its tokens all have m_t = 0).
    seq_share_N = torch.where(mask_N > 0, mask_N / seq_tokens_N.clamp(min=1), torch.zeros_like(mask_N))
    seqs_here = seq_share_N.sum()
    if opts.aggregation == "token-mean":
        total = inp.total_loss_tokens if inp.total_loss_tokens is not None else mask_N.sum().item()
        w_N = mask_N / max(total, 1.0)
    else:
        total_seqs = inp.total_seqs if inp.total_seqs is not None else seqs_here.item()
        if opts.aggregation == "seq-mean-token-mean":
            w_N = seq_share_N / max(total_seqs, 1e-12)
        else:
            w_N = mask_N / (opts.norm_len * max(total_seqs, 1e-12))
    return w_N, seqs_here


def grpo_loss(inp: LossInputs, opts: LossOptions) -> LossOutputs:
    mask_N = inp.loss_mask_N.bool()
    if not (inp.logprobs_N.shape == inp.behaviour_logprobs_N.shape == inp.advantages_N.shape == mask_N.shape
            == inp.seq_ids_N.shape):
        raise ValueError("grpo_loss: logprobs, behaviour logprobs, advantages, loss mask and seq ids need one shape [N]")
    if opts.kl_coef > 0 and inp.ref_logprobs_N is None:
        raise ValueError("grpo_loss: kl_coef > 0 needs ref_logprobs_N")
    if opts.entropy_coef > 0 and inp.entropy_N is None:
        raise ValueError("grpo_loss: entropy_coef > 0 needs entropy_N")
    adv_N = inp.advantages_N.to(inp.logprobs_N.dtype)
    # Masked tokens may hold anything (padding, tool results); keep them out of exp().
    log_ratio_N = torch.where(mask_N, inp.logprobs_N - inp.behaviour_logprobs_N, torch.zeros_like(inp.logprobs_N))
    ratio_N = torch.exp(log_ratio_N)
    pg_unclipped_N = -adv_N * ratio_N
    pg_clipped_N = -adv_N * torch.clamp(ratio_N, 1.0 - opts.eps_low, 1.0 + opts.eps_high)
    pg_N = torch.maximum(pg_unclipped_N, pg_clipped_N)
    dual_clipped_N = torch.zeros_like(mask_N)
    if opts.dual_clip is not None:
        bound_N = -adv_N * opts.dual_clip
        dual_clipped_N = (adv_N < 0) & (pg_N > bound_N)
        pg_N = torch.where(adv_N < 0, torch.minimum(pg_N, bound_N), pg_N)
    per_token_N = pg_N
    kl_N = None
    if inp.ref_logprobs_N is not None:
        ref_N = torch.where(mask_N, inp.ref_logprobs_N, inp.logprobs_N.detach())
        kl_N = kl_estimate(inp.logprobs_N, ref_N, opts.kl_estimator)
        if opts.kl_coef > 0:
            per_token_N = per_token_N + opts.kl_coef * kl_N
    if inp.entropy_N is not None and opts.entropy_coef > 0:
        per_token_N = per_token_N - opts.entropy_coef * inp.entropy_N
    w_N, seqs_here = aggregation_weights(opts, inp)
    per_token_N = torch.where(mask_N, per_token_N, torch.zeros_like(per_token_N))
    loss = (per_token_N * w_N.to(per_token_N.dtype)).sum()

    with torch.no_grad():
        n = inp.num_loss_tokens if inp.num_loss_tokens is not None else int(mask_N.sum().item())
        denom = max(n, 1)

        def mean(x_N: torch.Tensor) -> torch.Tensor:
            return torch.where(mask_N, x_N.double(), 0.0).sum() / denom

        clipped_N = (pg_clipped_N > pg_unclipped_N)
        metrics = {
            "pg_loss": mean(pg_N),
            "clip_frac": mean(clipped_N.float()),
            "clip_frac_low": mean((clipped_N & (ratio_N < 1.0)).float()),
            "clip_frac_high": mean((clipped_N & (ratio_N > 1.0)).float()),
            "dual_clip_frac": mean(dual_clipped_N.float()),
            # KL(behaviour ‖ new) on the sampled tokens, k3 (always >= 0, low variance).
            "approx_kl": mean(torch.expm1(log_ratio_N) - log_ratio_N),
            "ratio_mean": mean(ratio_N),
            "advantage_mean": mean(adv_N),
            "seqs": seqs_here.float(),
        }
        if kl_N is not None:
            metrics["kl_ref"] = mean(kl_N)
        if inp.entropy_N is not None:
            metrics["entropy"] = mean(inp.entropy_N)
    return LossOutputs(loss=loss, metrics=metrics, num_loss_tokens=n)


# ---------------------------------------------------------------------------------------------
# Token log-probs (and entropy) without an fp32 [N, V] tensor.


def _chunk_logprobs(logits_CV: torch.Tensor, labels_C: torch.Tensor, with_entropy: bool):
    logits_CV = logits_CV.to(torch.promote_types(logits_CV.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    logp_C = logits_CV.gather(-1, labels_C.unsqueeze(-1)).squeeze(-1) - lse_C
    if not with_entropy:
        return logp_C, None
    p_CV = torch.softmax(logits_CV, dim=-1)
    entropy_C = lse_C - (p_CV * logits_CV).sum(-1)
    return logp_C, entropy_C


def selective_log_softmax(logits_NV: torch.Tensor, labels_N: torch.Tensor, chunk_rows: int = 1024,
                          with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[label] per row (and the entropy), up-cast to fp32 one chunk of rows at a time."""
    logps, ents = [], []
    for start in range(0, logits_NV.shape[0], chunk_rows):
        lp, ent = _chunk_logprobs(logits_NV[start:start + chunk_rows], labels_N[start:start + chunk_rows], with_entropy)
        logps.append(lp)
        ents.append(ent)
    logp_N = torch.cat(logps) if logps else logits_NV.new_zeros(0, dtype=torch.float32)
    ent_N = (torch.cat(ents) if ents else logp_N.new_zeros(0)) if with_entropy else None
    return logp_N, ent_N


def _compute_dtype(hidden_NH: torch.Tensor) -> torch.dtype:
    dev = hidden_NH.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return hidden_NH.dtype


class _FusedLogprobHead(torch.autograd.Function):
    """logits = hidden @ weightᵀ one chunk of rows at a time; only [N] results and the row logsumexp
    are kept. The backward recomputes each chunk's logits and forms dlogits in place:
      d logp_label / dz = onehot(label) − p,      d H / dz = −p · (log p + H)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, chunk_rows: int, with_entropy: bool, compute_dtype):
        out_dtype = torch.promote_types(compute_dtype, torch.float32)
        n = hidden_NH.shape[0]
        logp_N = torch.empty(n, dtype=out_dtype, device=hidden_NH.device)
        lse_N = torch.empty_like(logp_N)
        ent_N = torch.empty_like(logp_N) if with_entropy else None
        w_VH = weight_VH.to(compute_dtype)
        fused = _fused_kernels(hidden_NH, compute_dtype)
        for a in range(0, n, chunk_rows):
            b = min(n, a + chunk_rows)
            logits_CV = hidden_NH[a:b].to(compute_dtype) @ w_VH.t()
            if fused is not None:  # one kernel reads the low-precision logits, fp32 inside
                lse_N[a:b], logp_N[a:b], ent_C = fused[0](logits_CV, labels_N[a:b], with_entropy)
                if with_entropy:
                    ent_N[a:b] = ent_C
                continue
            logits_CV = logits_CV.to(out_dtype)
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            lse_N[a:b] = lse_C
            logp_N[a:b] = logits_CV.gather(-1, labels_N[a:b, None]).squeeze(-1) - lse_C
            if with_entropy:
                logits_CV.sub_(lse_C[:, None])  # now log p
                ent_N[a:b] = -(logits_CV.exp() * logits_CV).sum(-1)
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N, lse_N, ent_N if with_entropy else lse_N)
        ctx.chunk_rows, ctx.with_entropy, ctx.compute_dtype = chunk_rows, with_entropy, compute_dtype
        ctx.fused = fused is not None
        if with_entropy:
            return logp_N, ent_N
        return logp_N, torch.zeros(0, dtype=out_dtype, device=hidden_NH.device)

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):
        hidden_NH, weight_VH, labels_N, lse_N, ent_N = ctx.saved_tensors
        cd = ctx.compute_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_ent = ctx.with_entropy and g_ent_N is not None and g_ent_N.numel() > 0
        w_VH = weight_VH.to(cd)
        grad_h_NH = torch.zeros_like(hidden_NH) if need_h else None
        grad_w_VH = torch.zeros(weight_VH.shape, dtype=torch.promote_types(weight_VH.dtype, torch.float32),
                                device=weight_VH.device) if need_w else None
        g_logp_N = g_logp_N if g_logp_N is not None else torch.zeros_like(lse_N)
        n = hidden_NH.shape[0]
        fused = _fused_kernels(hidden_NH, cd) if ctx.fused else None
        for a in range(0, n, ctx.chunk_rows):
            b = min(n, a + ctx.chunk_rows)
            h_CH = hidden_NH[a:b].to(cd)
            if fused is not None:  # dlogits in one kernel, written in the compute dtype
                grad_CV = fused[1](h_CH @ w_VH.t(), lse_N[a:b], labels_N[a:b], g_logp_N[a:b],
                                   ent_N[a:b] if use_ent else None, g_ent_N[a:b] if use_ent else None)
                if need_h:
                    grad_h_NH[a:b] = (grad_CV @ w_VH).to(hidden_NH.dtype)
                if need_w:
                    grad_w_VH += (grad_CV.t() @ h_CH).to(grad_w_VH.dtype)
                continue
            logp_CV = (h_CH @ w_VH.t()).to(lse_N.dtype).sub_(lse_N[a:b, None])
            p_CV = logp_CV.exp()
            if use_ent:  # g_H · (−p (log p + H))
                grad_CV = logp_CV.add_(ent_N[a:b, None]).mul_(p_CV).mul_(-g_ent_N[a:b, None])
                grad_CV.sub_(p_CV.mul_(g_logp_N[a:b, None]))
            else:
                grad_CV = p_CV.mul_(-g_logp_N[a:b, None])
            grad_CV.scatter_add_(1, labels_N[a:b, None], g_logp_N[a:b, None].to(grad_CV.dtype))
            grad_CV = grad_CV.to(cd)
            if need_h:
                grad_h_NH[a:b] = (grad_CV @ w_VH).to(hidden_NH.dtype)
            if need_w:
                grad_w_VH += (grad_CV.t() @ h_CH).to(grad_w_VH.dtype)
        return grad_h_NH, grad_w_VH.to(weight_VH.dtype) if need_w else None, None, None, None, None


# -- the chunk's elementwise work as single kernels (torch.compile), for CUDA in bf16/fp16 ----------
_FUSED: tuple | None = None
_FUSED_ENABLED = {"cuda": True}  # device types on which the compiled kernels are used (tests add "cpu")


def _chunk_forward(logits_CV, labels_C, with_entropy: bool):
    x_CV = logits_CV.float()
    lse_C = torch.logsumexp(x_CV, dim=-1)
    logp_C = x_CV.gather(-1, labels_C[:, None]).squeeze(-1) - lse_C
    ent_C = lse_C - (torch.exp(x_CV - lse_C[:, None]) * x_CV).sum(-1) if with_entropy else None
    return lse_C, logp_C, ent_C


def _chunk_backward(logits_CV, lse_C, labels_C, g_logp_C, ent_C, g_ent_C):
    """dL/dlogits = g_logp (onehot − p) [− g_H p (log p + H)], in the logits' dtype."""
    logp_CV = logits_CV.float() - lse_C[:, None]
    p_CV = torch.exp(logp_CV)
    grad_CV = -p_CV * g_logp_C[:, None]
    if ent_C is not None:
        grad_CV = grad_CV - g_ent_C[:, None] * p_CV * (logp_CV + ent_C[:, None])
    hit_CV = torch.arange(logits_CV.shape[1], device=logits_CV.device)[None, :] == labels_C[:, None]
    grad_CV = grad_CV + torch.where(hit_CV, g_logp_C[:, None], 0.0)
    return grad_CV.to(logits_CV.dtype)


def _fused_kernels(hidden_NH: torch.Tensor, compute_dtype: torch.dtype):
    """(forward, backward) compiled chunk kernels where they apply (low-precision logits on an enabled
    device), else None: the eager path keeps fp32/fp64 logits exactly as before."""
    global _FUSED
    if not _FUSED_ENABLED.get(hidden_NH.device.type) or compute_dtype not in (torch.bfloat16, torch.float16):
        return None
    if _FUSED is None:
        _FUSED = (_rows_dynamic(torch.compile(_chunk_forward, dynamic=None)),
                  _rows_dynamic(torch.compile(_chunk_backward, dynamic=None)))
    return _FUSED


def _rows_dynamic(compiled):
    """`compiled` with every tensor argument's rows (dim 0) dynamic from the first call: a pack's last chunk
    is shorter than the others, and a static first graph was compiled again at the second row count
    (seconds of a run's first iteration). The vocabulary width stays static. (`torch.compile` has imported
    torch._dynamo.)"""
    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim():
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)
    return call


def logprobs_from_hidden(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor,
                         chunk_rows: int = 2048, with_entropy: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head fused with the log-softmax (and entropy): logits exist for one chunk of rows at a
    time, in the forward and (recomputed) in the backward, so peak memory is O(chunk_rows · V), not
    O(N · V). Matmuls run in the autocast dtype when autocast is on; results are at least fp32."""
    logp_N, ent_N = _FusedLogprobHead.apply(hidden_NH, weight_VH, labels_N, chunk_rows, with_entropy,
                                            _compute_dtype(hidden_NH))
    return logp_N, (ent_N if with_entropy else None)
