"""Config of the OPD learner: the loss and the teacher set (the `[opd]` table)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from core.config import Config
from learner.grpo_config import LearnerConfig, OptimConfig


class OPDConfig(Config):
    """Multi-teacher on-policy distillation (distill/opd_loss.py)."""

    loss: Literal["full_vocab", "sampled_token"] = Field(
        "full_vocab", description="full_vocab: exact reverse KL over the whole vocabulary at every student token; "
                                  "sampled_token: its estimate on the sampled token as a policy-gradient advantage (baseline)")
    temperature: float = Field(1.0, gt=0.0, le=10.0, description="temperature of both distributions (= sampling.temperature)")
    clip_eps: float = Field(0.2, ge=0.0, lt=1.0, description="ratio clip of the sampled_token loss")
    cache_dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="dtype of cached teacher hidden states")
    kl_chunk_tokens: int = Field(0, ge=0, le=1 << 20, description="token chunk of the KL kernel; 0 = from the vocabulary size")
    prefetch: bool = Field(True, description="read the next teacher head and hidden states while the current ones train, "
                                             "and copy the next head to the device during the student's trunk backward")
    host_head_cache_gib: float = Field(16.0, ge=0.0, le=4096.0,
                                       description="host memory per learner rank (pinned on CUDA) that keeps teacher heads "
                                                   "once read from storage; a head that does not fit is read for each load")
    teacher_workers: int = Field(1, ge=0, le=1024, description="teacher prefill Ray actors; 0 = in the driver's process")
    teacher_cpus: float = Field(0.0, ge=0, le=1024, description="Ray CPUs each teacher actor reserves (0: shares the machine)")
    teacher_gpus: float = Field(0.0, ge=0, le=64, description="Ray GPUs each teacher actor reserves")
    prefill_batch_tokens: int = Field(8192, ge=16, le=1 << 26, description="tokens per teacher prefill forward")
    teachers: dict[str, Any] = Field(default_factory=dict, description='domain -> checkpoint dir, or a list of '
                                     '{path = "...", weight = w}; --teacher D=DIR adds to it')


class OPDTrainConfig(Config):
    """What an OPD learner rank receives: the optimiser, the learner group and the OPD table."""

    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimiser and schedule")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="learner group")
    opd: OPDConfig = Field(default_factory=OPDConfig, description="OPD loss and teachers")
