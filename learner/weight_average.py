"""An exponential moving average of a policy's weights over training iterations (`loop.final = "ema"`).

After update t (t = 1, 2, ...) the average weighs iterate i by (1 - d_i) prod_{j > i} d_j with
d_t = min(decay, (t - 1) / t): a uniform mean of the first 1 / (1 - decay) iterates, an EMA of horizon
1 / (1 - decay) iterates after. The starting weights (t = 0) never enter it. Kept in float32 whatever the
parameters' dtype; `weights()` casts back to the dtypes of the last update.
"""
from __future__ import annotations

import torch


class WeightAverage:
    def __init__(self, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"WeightAverage: decay must lie in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self._avg: dict[str, torch.Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}

    def update(self, weights: dict[str, torch.Tensor]) -> None:
        """Fold one iterate in (its tensors are read, not kept)."""
        if self._avg and weights.keys() != self._avg.keys():
            raise ValueError(f"WeightAverage: the weights' names changed ({sorted(weights.keys() ^ self._avg.keys())[:4]})")
        self.updates += 1
        d = min(self.decay, (self.updates - 1) / self.updates)
        for name, w in weights.items():
            w32 = w.detach().to("cpu", torch.float32)
            self._dtypes[name] = w.dtype
            if name not in self._avg:
                self._avg[name] = w32.clone()
            else:
                self._avg[name].lerp_(w32, 1.0 - d)

    def weights(self) -> dict[str, torch.Tensor]:
        """The average, in the dtypes of the iterates (a copy)."""
        if not self.updates:
            raise RuntimeError("WeightAverage: no iterate folded in yet")
        return {k: v.to(self._dtypes[k], copy=True) for k, v in self._avg.items()}

    # -- checkpoint state: float32 tensors and the update count -----------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors, metadata) for a safetensors file."""
        meta = {"updates": str(self.updates), "decay": repr(self.decay)}
        meta |= {f"dtype.{k}": str(t).removeprefix("torch.") for k, t in self._dtypes.items()}
        return {k: v.clone() for k, v in self._avg.items()}, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """Restore what `state()` gave; the decay stays this object's (a config may change it on resume)."""
        try:
            updates = int(meta["updates"])
            dtypes = {k: getattr(torch, meta[f"dtype.{k}"]) for k in tensors}
        except (KeyError, ValueError, AttributeError) as exc:
            raise ValueError(f"WeightAverage: state metadata incomplete or unreadable ({exc})") from None
        if updates < 1 or any(not isinstance(t, torch.dtype) for t in dtypes.values()):
            raise ValueError(f"WeightAverage: state metadata unreadable (updates {updates})")
        bad = [k for k, v in tensors.items() if v.dtype != torch.float32]
        if bad:
            raise ValueError(f"WeightAverage: state tensors must be float32 ({bad[:3]})")
        self._avg = {k: v.clone() for k, v in tensors.items()}
        self._dtypes, self.updates = dtypes, updates
