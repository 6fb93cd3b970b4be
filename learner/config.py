"""Configs of the learner's components: the policy architecture, SFT and eval."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.config import Config


class PolicyConfig(Config):
    """A tiny causal LM built from a Hugging Face architecture config (used when no checkpoint is given)."""

    arch: Literal["qwen2", "llama"] = Field("qwen2", description="HF architecture family")
    hidden_size: int = Field(128, ge=16, le=16384, description="model width")
    num_layers: int = Field(3, ge=1, le=128, description="transformer blocks")
    num_heads: int = Field(4, ge=1, le=128, description="attention heads")
    num_kv_heads: int = Field(2, ge=1, le=128, description="key/value heads (GQA)")
    intermediate_size: int = Field(384, ge=16, le=65536, description="MLP width")
    max_positions: int = Field(256, ge=16, le=1 << 20, description="longest sequence in tokens")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="initialisation seed (torch.manual_seed takes 64 bits)")


class SFTConfig(Config):
    """Supervised fine-tuning on domain demonstrations, loss on completion tokens only."""

    domains: list[str] = Field(["arith", "reverse", "calc"], min_length=1, description="domains mixed uniformly")
    steps: int = Field(600, ge=1, le=10_000_000, description="optimizer steps")
    batch_size: int = Field(32, ge=1, le=65536, description="sequences per step")
    lr: float = Field(1e-3, gt=0, le=1.0, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(20, ge=0, description="linear warm-up steps, then cosine decay to 10%")
    weight_decay: float = Field(0.01, ge=0, le=1.0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="data order and dropout seed (torch.manual_seed takes 64 bits)")
    threads: int = Field(1, ge=1, le=256, description="torch CPU threads (1: a tiny model gains little from more, and oversubscribed cores lose a lot)")
    log_every: int = Field(10, ge=1, description="steps between metrics lines")


class EvalConfig(Config):
    """Pass@1 on a domain's eval split."""

    n: int = Field(100, ge=1, le=1_000_000, description="eval prompts per domain")
    seed: int = Field(1234, ge=0, le=2**63 - 1, description="prompt draw and sampling seed (torch.manual_seed takes 64 bits)")
    temperature: float = Field(0.0, ge=0, le=10, description="0 = greedy")
    max_new_tokens: int = Field(48, ge=1, le=65536, description="generation budget per turn")
    batch_size: int = Field(64, ge=1, le=65536, description="prompts decoded together")
