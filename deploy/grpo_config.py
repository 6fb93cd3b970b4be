"""Config of a `postrain grpo` run: the learner's tables, the rollout path's tables, the loop and eval.

One flat file (`configs/grpo_loop.toml`): `[loss] [advantages] [staleness] [optim] [learner]` are the
learner's (`learner/grpo_config.py`), `[engine] [sampling] [pool]` the rollout path's
(`rollout/config.py`), `[eval]` pass@1 (`learner/config.py`), `[loop]` what composes them.
`[domain.NAME.*]` tables override any of those for one domain (`load_for_domain`); `--set` still wins.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from core import config
from core.config import Config
from core.errors import UserError
from learner.config import EvalConfig
from learner.grpo_config import GRPOConfig
from rollout.config import EngineConfig, PoolConfig, RolloutConfig, SamplingConfig


class LoopConfig(Config):
    """One GRPO iteration: P prompts × G samples → verify → data plane → plan → train → publish."""

    prompts_per_iteration: int = Field(8, ge=1, le=1_000_000, description="prompts drawn from the domain's train split per iteration")
    group_size: int = Field(8, ge=2, le=4096, description="samples per prompt (the GRPO group)")
    async_rollouts: bool = Field(False, description="one-step-off: rollouts of iteration k+1 run while the learner "
                                                    "trains on iteration k (their tokens are one version stale)")
    minibatches: int = Field(1, ge=1, le=4096, description="optimizer steps per iteration: the batch is planned into "
                                                          "this many group-aware minibatches (when tokens_per_rank = 0)")
    tokens_per_rank: int = Field(0, ge=0, le=1 << 30, description="plan budget per rank and minibatch (one optimizer "
                                                                  "step each); 0 = from loop.minibatches")
    eval_every: int = Field(5, ge=0, le=1_000_000, description="iterations between pass@1 evals (0 = only first and last)")
    patience: int = Field(0, ge=0, le=1_000_000, description="evals in a row without a new best pass@1 after which "
                          "the run ends as at --iterations (eval, checkpoint, final/); 0 = never (early stopping)")
    final: Literal["last", "best", "ema"] = Field("last", description='what final/ holds: the last iteration\'s policy; '
                                                  '"best": the policy of the best eval (kept as OUT/best/it{k}/; ties '
                                                  'keep the earlier); "ema": an average of every iteration\'s policy '
                                                  '(loop.ema_decay), evaluated once more at the end')
    ema_decay: float = Field(0.99, gt=0.0, lt=1.0, description='loop.final = "ema": the average is a uniform mean of '
                             'the first 1 / (1 - decay) iterations\' policies, then an exponential moving average of '
                             'that horizon')
    checkpoint_every: int = Field(5, ge=1, le=1_000_000, description="iterations between learner checkpoints (the last is always saved)")
    time_budget_s: float = Field(0.0, ge=0.0, le=1e7, description="wall-clock budget of one `postrain grpo` process, "
                                 "start-up included: no iteration starts that the last one's duration says would "
                                 "overrun it; the run then ends as at --iterations (eval, checkpoint, final/); 0 = none")
    chaos_faults: int = Field(2, ge=0, le=1000, description="faults injected into each iteration's rollouts under --chaos")
    prompt_pool: int = Field(0, ge=0, le=100_000_000, description="distinct train prompts cycled through in order "
                                                                  "(a fixed prompt set); 0 = fresh prompts every iteration")
    replay_share: float = Field(0.0, ge=0.0, le=1.0, description="share of each iteration's prompts taken from a queue "
                                "of prompts an earlier group left unsolved (hard-prompt replay); 0 = off")
    replay_max: int = Field(4, ge=1, le=1000, description="times one prompt may be replayed")
    replay_solved_below: float = Field(0.5, gt=0.0, le=1.0, description="a group whose solve rate is below this "
                                       "queues its prompt for replay (1.0 = any group not fully solved)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="prompt draw seed (fresh prompts of iteration k are a pure function of it and k)")
    keep_data: bool = Field(False, description="keep every batch's data-plane trajectories and shards, every "
                            "checkpoint and earlier starts' rollout WALs (`--keep-data`); false = retention below")
    keep_iterations: int = Field(2, ge=0, le=1_000_000, description="data-plane batches of the last K trained iterations "
                                 "kept once a durable checkpoint covers them; older ones are reclaimed")
    keep_checkpoints: int = Field(2, ge=1, le=1_000_000, description="newest learner checkpoints kept; older ones are "
                                  "deleted once a newer one is durable")
    catalog: str = Field("", description="data-plane catalog (SQLite path or PostgreSQL URL); empty = OUT/dataplane/catalog.db")
    store: str = Field("", description="data-plane shard store (dir or pyarrow.fs URI); empty = OUT/dataplane/store")


class GRPOLoopConfig(GRPOConfig):
    """`postrain grpo`: the learner's tables plus rollout, eval and loop."""

    engine: EngineConfig = Field(default_factory=EngineConfig, description="rollout inference engine")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="rollout decoding controls")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="rollout workers and pool")
    eval: EvalConfig = Field(default_factory=lambda: EvalConfig(n=64), description="pass@1 on the domain's eval split")
    loop: LoopConfig = Field(default_factory=LoopConfig, description="the loop composing them")
    domain: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-domain overrides: "
                                              "`[domain.calc.optim] lr = 1e-4` applies when --domain calc runs")

    @model_validator(mode="after")
    def _domain_tables_validate(self):
        base = self.model_dump(exclude={"domain"})
        for name, over in self.domain.items():  # a bad key in a domain's table fails now, not when that domain runs
            config.build(GRPOLoopConfig, config.merge(base, over), where=f"[domain.{name}]")
        return self

    def learner_config(self) -> GRPOConfig:
        """The learner's part alone (what the Ray learner ranks receive)."""
        return GRPOConfig.model_validate({k: getattr(self, k).model_dump() for k in GRPOConfig.model_fields})

    def rollout_config(self) -> RolloutConfig:
        return RolloutConfig(engine=self.engine, sampling=self.sampling, pool=self.pool)


def load_for_domain(path: str | Path | None, domain: str, overrides: list[str] | None = None) -> GRPOLoopConfig:
    """The config of a run on `domain`: the file's tables, its `[domain.<domain>]` tables over them, then `overrides`
    (which may also change a domain table: `--set domain.calc.optim.lr=2e-4`)."""
    overrides = overrides or []
    data = config.apply_overrides(config.read_file(path) if path else {}, overrides)
    tables = data.get("domain", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise UserError(f"{path}: [domain] must hold one table per domain, e.g. [domain.calc.optim]")
    data = config.apply_overrides(config.merge(data, tables.get(domain, {})), overrides)
    return config.build(GRPOLoopConfig, data, where=str(path) if path else "config")
