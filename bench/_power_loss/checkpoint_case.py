"""Power-cut case for learner checkpoints (learner.checkpoint.save_checkpoint of a tiny HF model).

The model's files are written by safetensors and transformers, the trainer state by torch.save: they
enter the simulated disk when the checkpoint code syncs them, as unsynced writes up to then. A writer
saves several iterations (one of them twice). Properties after each cut:
- every `iter_*` directory with a state.json verifies (every file present, every sha256 right): whole,
  or (without state.json) not a checkpoint at all, which `read_checkpoint` refuses with a UserError;
- every acknowledged iteration is there with the digests it was saved with (a save of the same
  iteration in flight may have replaced it with its own, whole);
- `latest_checkpoint` finds the last acknowledged save, or the one in flight.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.errors import UserError
from learner import checkpoint as ckpt
from learner.config import PolicyConfig
from learner.policy import build_policy

TINY = PolicyConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, seed=3)


@dataclass
class Saves:
    done: dict = field(default_factory=dict)  # iteration -> sha256 digests of its files, as acknowledged
    last: int | None = None  # the iteration saved last
    busy: int | None = None  # the iteration being saved


class CheckpointCase:
    name = "checkpoint"
    new_state = Saves

    def __init__(self, saves: int = 4):
        self.saves = saves
        self._model = None

    @staticmethod
    def note(state: Saves, mark) -> None:
        if mark[0] == "save":
            state.busy = mark[1]
        else:
            state.done[mark[1]] = mark[2]
            state.last, state.busy = mark[1], None

    def run(self, live: Path, rec, seed: int) -> None:
        rng = random.Random(seed)
        if self._model is None:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            self._model = build_policy(TINY)
        model, tok = self._model
        root = live / "ckpt"
        its = list(range(1, self.saves))
        its.insert(rng.randrange(1, len(its) + 1), rng.choice(its))  # one iteration saved again
        for step, it in enumerate(its):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (seed + step + 1))
            state = {"policy_version": it, "step": it * 2, "optimizer": {"lr": 1e-3 * it}}
            rec.mark(("save", it))
            path = ckpt.save_checkpoint(root, it, model, tok if step % 2 == 0 else None, state, [ckpt.capture_rng()])
            rec.mark(("saved", it, ckpt.read_checkpoint(path)["sha256"]))

    def check(self, image: Path, state: Saves) -> list:
        problems = []
        root = image / "ckpt"
        for d in sorted(root.glob("iter_*")) if root.is_dir() else []:
            try:
                got = ckpt.read_checkpoint(d)
            except UserError as exc:
                if (d / "state.json").exists():
                    problems.append(("wrong", f"{d.name}: visible but not whole: {exc}"))
                continue
            it = int(d.name.split("_")[1])
            if it in state.done and got["sha256"] != state.done[it] and state.busy != it:
                problems.append(("wrong", f"{d.name}: not the checkpoint acknowledged for iteration {it}"))
        for it in state.done:
            if not (root / ckpt.checkpoint_name(it) / "state.json").is_file():
                problems.append(("lost", f"iteration {it} was acknowledged, its checkpoint is gone"))
        if state.last is not None:
            latest = ckpt.latest_checkpoint(root) if root.is_dir() else None
            if latest is None or int(latest.name.split("_")[1]) not in (state.last, state.busy):
                problems.append(("lost", f"latest checkpoint is {latest and latest.name}, iteration {state.last} was "
                                         "saved last"))
        return problems
