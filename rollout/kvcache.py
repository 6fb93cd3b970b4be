"""A slot KV cache that HF attention layers write into through the `cache.update` protocol.

Each request owns a slot (one row of [slots, kv_heads, max_len, head_dim] per layer), so requests
join and leave a running batch without re-padding anyone. A forward names its rows (a contiguous
slot range, so K/V are views, not copies) and each row's start position; `update` writes the new
keys/values at those positions and returns the rows' K/V up to the longest live length.
"""
from __future__ import annotations

import torch


class SlotKV:
    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slots, self.max_len = slots, max_len
        self._lo = self._hi = 0
        self._pos_B: torch.Tensor | None = None
        self._start = 0
        self._T = 0
        self._kv_len = 0

    # -- per-forward addressing -------------------------------------------------------------
    def bind(self, lo: int, hi: int, pos_B: torch.Tensor | None, start: int, T: int, kv_len: int) -> None:
        """Rows [lo, hi); decode (T == 1): row b writes at pos_B[b]; block (one row): at start..start+T."""
        if not (0 <= lo < hi <= self.slots) or kv_len > self.max_len:
            raise ValueError(f"kv bind out of range: rows [{lo}, {hi}) of {self.slots}, kv_len {kv_len} > {self.max_len}")
        self._lo, self._hi, self._pos_B, self._start, self._T, self._kv_len = lo, hi, pos_B, start, T, kv_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        lo, hi = self._lo, self._hi
        if self._pos_B is not None:  # one new token per row, each at its own position
            rows = torch.arange(lo, hi, device=k.device)
            k[rows, :, self._pos_B] = key_states[:, :, 0]
            v[rows, :, self._pos_B] = value_states[:, :, 0]
        else:
            k[lo:hi, :, self._start:self._start + self._T] = key_states
            v[lo:hi, :, self._start:self._start + self._T] = value_states
        return k[lo:hi, :, :self._kv_len], v[lo:hi, :, :self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    # -- slot management --------------------------------------------------------------------
    def move(self, src: int, dst: int, length: int) -> None:
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]

    def export(self, slot: int, length: int) -> dict[str, torch.Tensor]:
        out = {}
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            out[f"k.{i}"] = k[slot, :, :length].contiguous().cpu()
            out[f"v.{i}"] = v[slot, :, :length].contiguous().cpu()
        return out

    def check(self, tensors: dict[str, torch.Tensor], start: int = 0) -> int:
        """The token count exported tensors cover, placed at `start`; ValueError when they do not fit."""
        length = None
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            for name, dst in ((f"k.{i}", k), (f"v.{i}", v)):
                src = tensors.get(name)
                if src is None or src.dim() != 3 or src.shape[0] != dst.shape[1] or src.shape[2] != dst.shape[3]:
                    raise ValueError(f"kv tensor {name} missing or of wrong shape")
                if src.dtype != dst.dtype:
                    raise ValueError(f"kv tensor {name} has dtype {src.dtype}, cache holds {dst.dtype}")
                if length is None:
                    length = src.shape[1]
                if src.shape[1] != length or start + length > self.max_len:
                    raise ValueError(f"kv tensor {name} covers {src.shape[1]} tokens from {start}, expected {length} "
                                     f"within {self.max_len}")
        if len(tensors) != 2 * len(self.k):
            raise ValueError(f"kv snapshot holds {len(tensors)} tensors, model has {2 * len(self.k)}")
        return int(length or 0)

    def write(self, slot: int, tensors: dict[str, torch.Tensor], start: int, length: int) -> None:
        """Copy tensors that `check` passed (covering `length` tokens) into `slot` from position `start` on."""
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            k[slot, :, start:start + length] = tensors[f"k.{i}"].to(k.device)
            v[slot, :, start:start + length] = tensors[f"v.{i}"].to(v.device)
