"""`loop.final = "ema"` of the GRPO and OPD loops: final/ holds an average of the policy's iterates.

The loop folds every iteration's published weights into a `learner.weight_average.WeightAverage` and saves
it with each learner checkpoint (`ema.safetensors`, in the same atomic set), so a resumed run continues the
same average and ends with the final/ of an uninterrupted one. A checkpoint saved under another
`loop.final` holds none: the average then starts at the first iteration after it.
"""
from __future__ import annotations

from pathlib import Path

from learner.weight_average import WeightAverage

NAME = "ema"


class FinalAverage:
    def __init__(self, final: str, decay: float):
        self.avg = WeightAverage(decay) if final == NAME else None

    @property
    def on(self) -> bool:
        return self.avg is not None

    def resume(self, ckpt: Path | None) -> bool:
        """Continue the average saved with `ckpt`; False when it holds none (the average starts afresh)."""
        from core.errors import UserError
        from learner.checkpoint import load_extra

        if self.avg is None or ckpt is None:
            return False
        saved = load_extra(ckpt, NAME)
        if saved is None:
            return False
        try:
            self.avg.load_state(*saved)
        except ValueError as exc:
            raise UserError(f"checkpoint {ckpt}: {NAME}.safetensors: {exc}") from None
        return True

    def update(self, weights: dict) -> None:
        if self.avg is not None:
            self.avg.update(weights)

    def extra(self) -> dict | None:
        """The checkpoint's share (`LearnerGroup.save_checkpoint(extra=...)`)."""
        return {NAME: self.avg.state()} if self.avg is not None and self.avg.updates else None

    def final_weights(self, last: dict) -> dict:
        """What final/ holds: the average, or `last` when off (or before any iterate)."""
        return self.avg.weights() if self.avg is not None and self.avg.updates else last
