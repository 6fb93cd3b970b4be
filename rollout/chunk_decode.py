"""Chunked decode: several decode steps per host round trip, each step's draw fed back on the device.

The static all-slot decoder (`static_decode.py`) still crosses to the host every step: the engine
builds the next step's inputs in Python, the device waits while the host reads the draws. Here one
step is a pure device function: the lean forward over every slot of the static KV (`LeanForward.
decode_all`, optionally `torch.compile`d), the uniforms from (row hash, position) on the device
(`sampling.uniform_t`), the draw (`sampling.sample_dense`, the same arithmetic as `sample`), and the
drawn token becomes the slot's next input. On a GPU the step is captured as a CUDA graph and replayed
n times; the host uploads the slots' state once per chunk and reads n steps of draws at once.

A request may stop inside a chunk (EOS, a stop string, its token budget): the engine accepts a row's
draws in step order only while the row is running, and discards the rest. The K/V the device wrote
for a discarded draw's successors lie past the row's kept length, so they are overwritten before
anything reads them, as the dummy rows of the static decoder are. The draw of (trajectory, position)
is the same function of the logits as in every other path; with the lean forward instead of the HF
module the logits agree to rounding (measured in the tests), as the static path's do.
"""
from __future__ import annotations

import torch

from rollout.lean_forward import LeanForward
from rollout.sampling import row_hash, sample_dense, uniform_t


class ChunkDecoder:
    def __init__(self, engine, lean: LeanForward, max_chunk: int, use_graph: bool, compile_forward: bool = False):
        self.e = engine
        S, L, dev = engine.kv.slots, engine.max_len, engine.device
        self.lean, self.max_chunk, self.use_graph = lean, int(max_chunk), use_graph
        self.ids = torch.zeros(S, dtype=torch.long, device=dev)
        self.pos = torch.zeros(S, dtype=torch.long, device=dev)
        self.hash = torch.zeros(S, dtype=torch.long, device=dev)
        self.temp = torch.ones(S, dtype=torch.float64, device=dev)
        self.step_i = torch.zeros(1, dtype=torch.long, device=dev)
        self.tok = torch.zeros(self.max_chunk, S, dtype=torch.long, device=dev)
        self.lp = torch.zeros(self.max_chunk, S, dtype=torch.float64, device=dev)
        self._fwd = torch.compile(lean.decode_all, fullgraph=True, dynamic=False) if compile_forward else lean.decode_all
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self._row_hash: dict[str, int] = {}

    @staticmethod
    def covers(params) -> bool:
        """Whether the device draw reproduces `sample` for these params (no top-k / top-p filtering)."""
        return params.top_k <= 0 and params.top_p >= 1.0

    @torch.inference_mode()
    def _step(self, any_greedy: bool) -> None:
        e = self.e
        logits_SV = self._fwd(self.ids, self.pos, e.kv.k, e.kv.v)
        tok, lp = sample_dense(logits_SV, self.temp, uniform_t(self.hash, self.pos + 1), any_greedy)
        self.tok.index_copy_(0, self.step_i, tok[None])
        self.lp.index_copy_(0, self.step_i, lp[None])
        self.step_i.add_(1)
        self.ids.copy_(tok)
        self.pos.add_(1).clamp_(max=e.max_len - 1)

    def _upload(self, rows, any_greedy: bool) -> None:
        e = self.e
        S = e.kv.slots
        ids, pos, hashes, temp = [0] * S, [0] * S, [0] * S, [1.0] * S
        for s in e.seqs.values():  # idle rows write dummies at and past their next position (overwritten later)
            pos[s.slot] = min(s.kv_len, e.max_len - 1)
        for s in rows:
            ids[s.slot] = s.tokens[s.kv_len]
            h = self._row_hash.get(s.req_id)
            if h is None:
                h = self._row_hash[s.req_id] = row_hash(e.seed, s.key)
            hashes[s.slot] = h
            temp[s.slot] = s.params.temperature
        self.ids.copy_(torch.tensor(ids))
        self.pos.copy_(torch.tensor(pos))
        self.hash.copy_(torch.tensor(hashes))
        self.temp.copy_(torch.tensor(temp, dtype=torch.float64))
        self.step_i.zero_()

    def _capture(self, any_greedy: bool) -> torch.cuda.CUDAGraph:
        """Warm up (compiles, if asked) and capture one step. Called right after an upload: the warm-up's
        writes land at and past each slot's next position, where they are overwritten before read."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(any_greedy)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(any_greedy)
        return graph

    def launch(self, rows, n: int):
        """Enqueue n decode steps of `rows` (slot order; each with exactly one pending token)."""
        if not 1 <= n <= self.max_chunk:
            raise ValueError(f"chunk of {n} steps outside 1..{self.max_chunk}")
        any_greedy = any(s.params.temperature == 0 for s in rows)
        self._upload(rows, any_greedy)
        if self.use_graph:
            graph = self._graphs.get(any_greedy)
            if graph is None:
                graph = self._graphs[any_greedy] = self._capture(any_greedy)
                self._upload(rows, any_greedy)  # the warm-up advanced the state
            for _ in range(n):
                graph.replay()
        else:
            for _ in range(n):
                self._step(any_greedy)
        self.e.stats["forwards"] += n
        self.e.stats["decode_rows"] += n * len(rows)
        return [s.slot for s in rows], n

    def read(self, handle) -> tuple[list[list[int]], list[list[float]]]:
        """Draws of a launched chunk: tokens[i][slot], logprobs[i][slot] of step i (one device sync)."""
        _, n = handle
        return self.tok[:n].tolist(), self.lp[:n].tolist()

    def forget(self, req_id: str) -> None:
        self._row_hash.pop(req_id, None)
