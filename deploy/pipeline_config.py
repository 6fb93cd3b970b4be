"""Config of `postrain pipeline` (configs/pipeline.toml): the stages, their budgets, and what each
stage's own command reads.

Each training stage names the config file its command reads (`configs/NAME`) and `--set` overrides
laid over it; `[quick]` holds overrides of this file applied with `--quick` (a smoke run).
"""
from __future__ import annotations

from pydantic import Field, model_validator

from core.config import Config

STAGES = ("sft", "specialists", "merge", "evaluate", "report")


class PipelineTable(Config):
    domains: list[str] = Field(["arith", "reverse", "calc"], min_length=1, description="domains of the whole pipeline")
    budget_min: float = Field(30.0, gt=0, le=1e6, description="wall budget of the whole pipeline in minutes; the "
                              "stages' budgets must fit in it")
    carry_over: bool = Field(True, description="a stage that ends under its budget hands the rest on (SFT and the "
                             "specialists to the next training stage, a specialist to the ones after it), and one that "
                             "overruns takes its excess from there, so the whole keeps to the stages' sum")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of every stage (SFT data and init, prompt draws, sampling, learner); "
                                           "0 = each stage config's own seeds")


class SFTStage(Config):
    config: str = Field("job.toml", description="file of configs/ that `postrain sft` reads")
    set: list[str] = Field(default_factory=list, description="--set overrides of that file")
    budget_s: float = Field(240.0, gt=0, le=1e7, description="expected wall time of SFT (it runs its steps)")


class SpecialistsStage(Config):
    config: str = Field("grpo_loop.toml", description="file of configs/ that `postrain grpo` reads")
    set: list[str] = Field(default_factory=list, description="--set overrides of that file")
    budget_s: float = Field(1080.0, gt=0, le=1e7, description="wall budget of the whole stage, shared by the "
                            "domains that train a specialist (each run's loop.time_budget_s)")
    iterations: int = Field(1000, ge=1, le=10_000_000, description="iterations per specialist (the budget may end it first)")
    use_budget: bool = Field(True, description="end each run on its time budget; false = run `iterations` exactly "
                             "(reproducible: a resumed pipeline repeats the figures)")
    skip_at: float = Field(0.9, ge=0.0, le=1.01, description="a domain whose base is at or above this greedy pass@1 "
                           "keeps the base as its teacher")
    parallel: int = Field(1, ge=1, le=64, description="specialists trained at once")
    shares: dict[str, float] = Field(default_factory=dict, description="relative share of the stage budget per "
                                     "domain (1 when not named): a domain whose iterations cost more (tool calls, "
                                     "longer completions) can get more of the time")

    def budgets_s(self, train: list[str], stage_s: float | None = None) -> dict[str, float]:
        """Each training domain's time budget: the stage budget (`stage_s`, default budget_s) split by the
        shares of the domains in `train`, `parallel` of them running at once, none longer than the stage."""
        stage_s = self.budget_s if stage_s is None else stage_s
        weight = {d: self.shares.get(d, 1.0) for d in train}
        total = sum(weight.values()) or 1.0
        lanes = min(self.parallel, len(train))
        return {d: min(stage_s, stage_s * lanes * w / total) for d, w in weight.items()}


class MergeStage(Config):
    config: str = Field("opd.toml", description="file of configs/ that `postrain opd` reads")
    set: list[str] = Field(default_factory=list, description="--set overrides of that file")
    budget_s: float = Field(300.0, gt=0, le=1e7, description="wall budget of the OPD merge (loop.time_budget_s)")
    iterations: int = Field(1000, ge=1, le=10_000_000, description="OPD iterations (the budget may end it first)")
    use_budget: bool = Field(True, description="end the merge on its time budget; false = run `iterations` exactly")
    init: str = Field("base", description='"base" (the SFT policy) or a checkpoint directory to start the student from')


class EvaluateStage(Config):
    n: int = Field(256, ge=1, le=1_000_000, description="eval prompts per domain (greedy pass@1)")
    seed: int = Field(1234, ge=0, le=2**63 - 1, description="eval prompt seed")
    max_new_tokens: int = Field(48, ge=1, le=65536, description="generation budget per turn")
    budget_s: float = Field(120.0, gt=0, le=1e7, description="expected wall time of the evaluation")


class PipelineConfig(Config):
    """`postrain pipeline`: SFT → specialists → OPD merge → evaluate → report."""

    pipeline: PipelineTable = Field(default_factory=PipelineTable, description="the whole pipeline")
    sft: SFTStage = Field(default_factory=SFTStage, description="domain SFT of the base")
    specialists: SpecialistsStage = Field(default_factory=SpecialistsStage, description="one GRPO specialist per domain")
    merge: MergeStage = Field(default_factory=MergeStage, description="OPD of the specialists into one student")
    evaluate: EvaluateStage = Field(default_factory=EvaluateStage, description="every model on every domain")
    quick: dict = Field(default_factory=dict, description="overrides of this file that --quick applies")

    @model_validator(mode="after")
    def _quick_validates(self):
        if self.quick:
            from core import config

            config.build(PipelineConfig, config.merge(self.model_dump(exclude={"quick"}), self.quick), where="[quick]")
        return self

    def stage_budgets_s(self) -> dict[str, float]:
        return {"sft": self.sft.budget_s, "specialists": self.specialists.budget_s, "merge": self.merge.budget_s,
                "evaluate": self.evaluate.budget_s}
