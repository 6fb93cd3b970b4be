"""Config of a `postrain opd` run: the learner's tables, the rollout path's, the loop and eval.

One flat file (`configs/opd.toml`): `[optim] [learner] [opd]` are the learner's
(`distill/opd_config.py`; `[opd.teachers]` names the teachers), `[engine] [sampling] [pool]` the
rollout path's, `[eval]` pass@1 on every domain, `[loop]` what composes them.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config import Config
from distill.opd_config import OPDConfig, OPDTrainConfig
from learner.config import EvalConfig
from learner.grpo_config import LearnerConfig, OptimConfig
from rollout.config import EngineConfig, PoolConfig, SamplingConfig


class OPDLoop(Config):
    """One OPD iteration: sample a domain mixture -> verify -> teacher prefill -> plan -> train -> publish."""

    prompts_per_iteration: int = Field(48, ge=1, le=1_000_000, description="train prompts per iteration, shared "
                                       "among the domains by `domain_weights`")
    samples_per_prompt: int = Field(1, ge=1, le=4096, description="student samples per prompt")
    domains: list[str] = Field(default_factory=list, description="domains to sample; empty = every teacher's domain")
    domain_weights: dict[str, float] = Field(default_factory=dict, description="share of each domain's prompts "
                                             "(relative); empty = equal shares")
    mixture: Literal["fixed", "kl"] = Field("fixed", description="fixed: `domain_weights` every iteration; kl: "
                                            "each domain gets `mixture_floor`, the rest follows the last "
                                            "iteration's per-token KL to its teachers")
    mixture_kl: Literal["token", "sequence"] = Field("token", description="the KL the kl mixture follows: per "
                                                     "token (mean over the domain's scored positions), or per "
                                                     "sequence (summed over a sample's positions, mean over the "
                                                     "domain's samples: long completions that drift a little at "
                                                     "every token weigh what their whole answer drifts)")
    mixture_floor: float = Field(0.15, ge=0.0, le=1.0, description="share every domain keeps under mixture = kl")
    async_rollouts: bool = Field(False, description="roll out batch k+1 (in a thread driving the Ray pool) while "
                                 "the teachers prefill and the learner trains on batch k: samples one policy version "
                                 "behind, and the kl mixture follows the KL of two iterations back")
    minibatches: int = Field(2, ge=1, le=4096, description="optimizer steps per iteration (teacher-ordered minibatches)")
    eval_every: int = Field(5, ge=0, le=1_000_000, description="iterations between pass@1 evals on every domain "
                                                               "(0 = only first and last)")
    final: Literal["last", "best", "ema"] = Field("last", description='what final/ holds: the last iteration\'s '
                                                  'student; "best": the one of the eval that kept most of its '
                                                  'worst-kept teacher (the lowest pass@1 over the best teacher\'s, '
                                                  'across domains; kept as OUT/best/it{k}/, ties keep the earlier); '
                                                  '"ema": an average of every iteration\'s student (loop.ema_decay), '
                                                  'evaluated once more at the end')
    ema_decay: float = Field(0.99, gt=0.0, lt=1.0, description='loop.final = "ema": the average is a uniform mean of '
                             'the first 1 / (1 - decay) iterations\' students, then an exponential moving average of '
                             'that horizon')
    checkpoint_every: int = Field(5, ge=1, le=1_000_000, description="iterations between learner checkpoints")
    time_budget_s: float = Field(0.0, ge=0.0, le=1e7, description="wall-clock budget of one `postrain opd` process; "
                                 "no iteration starts that would overrun it; 0 = none")
    chaos_faults: int = Field(2, ge=0, le=1000, description="faults injected into each iteration's rollouts under --chaos")
    keep_iterations: int = Field(2, ge=0, le=1_000_000, description="iterations whose rollouts and cache rows stay in "
                                 "the data plane once a checkpoint covers them; older ones are reclaimed; 0 = keep all")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="prompt draw seed (multiplied with the iteration: 32 bits)")
    catalog: str = Field("", description="data-plane catalog; empty = OUT/dataplane/catalog.db")
    store: str = Field("", description="data-plane shard store; empty = OUT/dataplane/store")


class OPDLoopConfig(Config):
    """`postrain opd`: the learner's tables plus rollout, eval and loop."""

    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=2e-4, warmup_steps=5),
                               description="optimiser and schedule")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="learner group")
    opd: OPDConfig = Field(default_factory=OPDConfig, description="OPD loss and teachers")
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(max_batch=32, strict=False),
                                 description="rollout inference engine")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="rollout decoding controls")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="rollout workers and pool")
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig(n=256), description="pass@1 on every domain's eval split")
    loop: OPDLoop = Field(default_factory=OPDLoop, description="the loop composing them")

    def learner_config(self) -> OPDTrainConfig:
        return OPDTrainConfig(optim=self.optim, learner=self.learner, opd=self.opd)
