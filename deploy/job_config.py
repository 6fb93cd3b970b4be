"""The main job's config: one table per component."""
from __future__ import annotations

from pydantic import Field

from core.config import Config
from learner.config import EvalConfig, PolicyConfig, SFTConfig


class JobConfig(Config):
    """The embedded-default pipeline: domain SFT, then eval on every domain."""

    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="policy built when no init checkpoint")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="domain SFT")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="pass@1 eval after each stage")
