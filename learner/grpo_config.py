"""Configs of the GRPO learner: loss, advantages, staleness, optimiser and the learner group."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config import Config


class GRPOLossConfig(Config):
    """The clipped policy-gradient loss (see learner/grpo_loss.py)."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="lower clip: ratio floor is 1 - eps_low")
    eps_high: float = Field(0.28, ge=0.0, le=10.0, description="upper clip: ratio ceiling is 1 + eps_high (clip-higher)")
    dual_clip: float = Field(0.0, ge=0.0, le=100.0,
                             description="dual-clip constant c > 1 bounding the loss of negative advantages; 0 = off")
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how per-token losses become one scalar")
    norm_len: int = Field(1024, ge=1, le=1 << 24, description="constant length of seq-mean-token-sum-norm, tokens")
    kl_coef: float = Field(0.0, ge=0.0, le=100.0, description="weight of the KL penalty to the reference policy; 0 = off")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="per-token KL estimator (Schulman)")
    entropy_coef: float = Field(0.0, ge=0.0, le=10.0, description="weight of the entropy bonus; 0 = off")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="sampling temperature the behaviour log-probs used")

    def options(self):
        from learner.grpo_loss import LossOptions

        return LossOptions(eps_low=self.eps_low, eps_high=self.eps_high,
                           dual_clip=self.dual_clip if self.dual_clip > 0 else None,
                           aggregation=self.aggregation, norm_len=self.norm_len, kl_coef=self.kl_coef,
                           kl_estimator=self.kl_estimator, entropy_coef=self.entropy_coef)


class AdvantageConfig(Config):
    """Group-relative advantages (see learner/advantages.py)."""

    std_normalise: bool = Field(True, description="divide by the group's reward std (GRPO); false = Dr. GRPO")
    leave_one_out: bool = Field(False, description="baseline = mean of the other samples of the group (RLOO)")
    filter_zero_variance: bool = Field(True, description="drop groups whose rewards are all equal (no signal)")


class StalenessConfig(Config):
    """Tokens sampled under older policy versions (see learner/staleness.py)."""

    bound: int = Field(-1, ge=-1, le=1_000_000, description="max versions behind the learner; -1 = unbounded")
    mode: Literal["mask", "drop"] = Field("mask", description="mask stale tokens, or drop their trajectories")


class OptimConfig(Config):
    """AdamW with linear warm-up then cosine decay, global-norm gradient clipping."""

    lr: float = Field(1e-5, gt=0.0, le=1.0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine floor as a fraction of lr")
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="linear warm-up optimizer steps")
    total_steps: int = Field(1000, ge=1, le=100_000_000, description="steps of the cosine schedule (then flat)")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2")
    adam_eps: float = Field(1e-8, gt=0.0, le=1e-2, description="AdamW epsilon")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="decoupled weight decay (matrices only)")
    grad_clip: float = Field(1.0, ge=0.0, le=1e6, description="max global grad norm; 0 = no clipping")


class LearnerConfig(Config):
    """Where and how the learner runs."""

    ranks: int = Field(1, ge=1, le=4096, description="data-parallel learner ranks (Ray actors when > 1)")
    micro_batch_tokens: int = Field(4096, ge=1, le=1 << 24,
                                    description="token budget of one micro-batch (gradient accumulation above it)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    bf16: bool = Field(True, description="bf16 autocast on GPU (CPU always runs in the model's dtype)")
    logprob_chunk_rows: int = Field(2048, ge=1, le=1 << 20, description="rows of the fused LM head per chunk")
    entropy_metric: bool = Field(True, description="report token entropy even when entropy_coef = 0 "
                                                   "(one more pass over each chunk's logits)")
    activation_checkpointing: bool = Field(False, description="recompute each block in the backward "
                                                              "(long packs: less memory, ~1/3 more compute)")
    threads: int = Field(0, ge=0, le=256, description="torch CPU threads per rank; 0 = cores / ranks")
    seed: int = Field(0, ge=0, description="learner RNG seed")
    cpus_per_rank: float = Field(0.0, ge=0, le=1024, description="Ray CPUs each learner rank reserves when ranks > 1 "
                                 "(0: the embedded default, ranks share the machine)")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="placement group strategy of the ranks when they reserve resources")


class GRPOConfig(Config):
    """The GRPO learner: one table per component in configs/grpo.toml."""

    loss: GRPOLossConfig = Field(default_factory=GRPOLossConfig, description="policy loss")
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig, description="advantage estimation")
    staleness: StalenessConfig = Field(default_factory=StalenessConfig, description="off-policy token bound")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimiser and schedule")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="learner group")
