"""Which config model parses which shipped file in configs/ (a test parses every one of them)."""
from __future__ import annotations

import importlib
from pathlib import Path

from pydantic import BaseModel

from core import config

SHIPPED: dict[str, str] = {
    "job": "deploy.job_config:JobConfig",
    "grpo": "learner.grpo_config:GRPOConfig",
    "rollout": "rollout.config:RolloutConfig",
    "dataplane": "dataplane.config:DataPlaneConfig",
    "grpo_loop": "deploy.grpo_config:GRPOLoopConfig",
    "opd": "deploy.opd_config:OPDLoopConfig",
    "pipeline": "deploy.pipeline_config:PipelineConfig",
    "cluster": "deploy.cluster_config:ClusterConfig",
}


def model_for(stem: str) -> type[BaseModel]:
    """The pydantic model class for configs/STEM.toml; KeyError when the file is not registered."""
    module, _, attr = SHIPPED[stem].partition(":")
    return getattr(importlib.import_module(module), attr)


def load_shipped(path: str | Path) -> BaseModel:
    """Parse a shipped config; a file whose only table is named after it (`[dataplane]`) is unwrapped."""
    path = Path(path)
    model = model_for(path.stem)
    data = config.read_file(path)
    if list(data) == [path.stem] and path.stem not in model.model_fields:
        data = data[path.stem]
    return config.build(model, data, where=str(path))
