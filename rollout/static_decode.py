"""Static-shape decode: one forward over every KV slot with a full-length mask, captured as a CUDA graph.

Eager decode is bound by Python and kernel launches (hundreds per step for a 24-layer model); with
static shapes (all slots, all `max_len` positions, masked) the whole forward replays as one CUDA
graph. Rows that are not running are fed a dummy token at their next free position: that K/V is
overwritten before anything reads it (a row only attends to positions it has written since). The
fast path's semantics otherwise equal eager decode; it is not the strict (batch-invariant) mode.
On a CPU the same static forward runs eagerly (it is how the tests check it).
"""
from __future__ import annotations

import torch


class StaticDecoder:
    def __init__(self, engine, use_graph: bool):
        self.e = engine
        S, L, dev = engine.kv.slots, engine.max_len, engine.device
        self.ids = torch.zeros(S, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(S, dtype=torch.long, device=dev)
        self.mask = torch.zeros(S, 1, 1, L, dtype=torch.bool, device=dev)
        self.arange = torch.arange(L, device=dev)
        self.graph = None
        self.logits = None
        if use_graph:
            self._capture()

    @torch.inference_mode()
    def _body(self) -> torch.Tensor:
        e = self.e
        e.kv.bind(0, e.kv.slots, self.pos, 0, 1, e.max_len)
        out = e.model(input_ids=self.ids, position_ids=self.pos[:, None], attention_mask=self.mask, use_cache=True,
                      logits_to_keep=1, **{e._cache_kw: e.kv})
        return out.logits[:, -1, :]

    def _capture(self) -> None:
        """Capture before any request holds a slot: the warm-up writes dummy K/V at position 0."""
        if self.e.seqs:
            raise RuntimeError("static decode must be captured while the engine is empty")
        torch.le(self.arange[None, :], self.pos[:, None], out=self.mask[:, 0, 0, :])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._body()

    @torch.inference_mode()
    def forward(self, rows) -> torch.Tensor:
        """Feed each running row its last pending token; logits [len(rows), V] in `rows` order."""
        e = self.e
        ids = [0] * e.kv.slots
        pos = [0] * e.kv.slots
        for s in e.seqs.values():  # idle rows write a dummy at their next position (overwritten later)
            pos[s.slot] = min(s.kv_len, e.max_len - 1)
        for s in rows:
            ids[s.slot] = s.tokens[s.kv_len]
        self.ids.copy_(torch.tensor(ids)[:, None], non_blocking=False)
        self.pos.copy_(torch.tensor(pos), non_blocking=False)
        torch.le(self.arange[None, :], self.pos[:, None], out=self.mask[:, 0, 0, :])
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._body()
        for s in rows:
            s.kv_len += 1
        e.stats["forwards"] += 1
        e.stats["decode_rows"] += len(rows)
        idx = torch.tensor([s.slot for s in rows], device=e.device)
        return logits.index_select(0, idx)
