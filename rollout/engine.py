"""The inference engine: any HF causal LM, a slot KV cache, batched decode, deterministic sampling.

Requests join and leave a running batch (each owns a KV slot). One `step()` feeds every running
request its pending tokens and draws its next token; the caller makes the draws durable and only
then `accept()`s them, so nothing downstream sees a token that is not committed.

Feeding rule (the same in every path, so a replay reproduces the computation): the pending tokens
of a request are fed as a block of all but the last, then the last alone as a decode row. A token's
KV is therefore always computed the same way whether it came from decode steps or a replay.

`strict=True` runs every forward with one row (batch size 1) and replays resumed prefixes decode
point by decode point, so a sequence's logits are bit-identical whatever shares its batch and
however its KV was rebuilt. The fast path batches decode rows and re-prefills in one block; its
agreement with strict is measured (`tests/rollout/test_engine.py`, `bench/rollout.py`).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable

import google_crc32c
import torch

from rollout.kvcache import SlotKV
from rollout.lean_forward import LeanForward
from rollout.sampling import SamplingParams, sample, traj_key, uniform


class NonFiniteLogits(RuntimeError):
    """The policy's logits for a row were NaN or infinite (bad weights or an overflow): nothing to sample."""


@dataclass
class Draw:
    """One sampled token, not yet committed."""

    req_id: str
    position: int
    token: int
    logprob: float


@dataclass
class Seq:
    req_id: str
    key: int
    tokens: list[int]
    sampled: list[bool]  # False: prompt or environment token (loss-masked)
    params: SamplingParams
    slot: int
    kv_len: int = 0  # tokens whose K/V sit in the slot
    turn_start: int = 0  # where the current sampling turn began (stop strings look from here)
    state: str = "run"  # run | paused (stop string: the environment answers) | done
    reason: str = ""
    n_sampled: int = 0
    last_step_draws: int = field(default=0, repr=False)


_LOGPROB = attrgetter("logprob")


def model_fingerprint(model: torch.nn.Module) -> str:
    """Architecture + every parameter's bytes, hashed: a KV snapshot is valid only for these weights."""
    h = hashlib.sha256(_architecture(model).encode())
    for name, p in model.state_dict().items():
        t = p.detach().contiguous().cpu()
        crc = google_crc32c.value(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{crc};".encode())
    return h.hexdigest()[:32]


def _kv_geometry(cfg) -> tuple[int, int]:
    """(key/value heads, head dim) of a decoder config, with the HF defaults for absent fields."""
    return (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _architecture(model) -> str:
    """What the forward depends on besides the weights. For a model LeanForward covers, the same string
    whether it was loaded as its HF class or as a LiteCausalLM (a snapshot stays valid across the two);
    any other model: its whole HF config."""
    if LeanForward.supports(model) is not None:
        return model.config.to_json_string(use_diff=False)
    c = model.config
    kv_heads, head_dim = _kv_geometry(c)
    inv_freq = model.model.rotary_emb.inv_freq.detach().to("cpu", torch.float32).contiguous()
    return json.dumps({"model_type": c.model_type, "hidden_size": c.hidden_size, "layers": c.num_hidden_layers,
                       "heads": c.num_attention_heads, "kv_heads": kv_heads, "head_dim": head_dim,
                       "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
                       "inv_freq_crc": google_crc32c.value(inv_freq.numpy().tobytes())}, sort_keys=True)


def decode_points(sampled: list[bool], start: int, end: int) -> list[int]:
    """Indices i in (start, end) of sampled tokens: after feeding tokens[:i] the engine drew token i."""
    return [i for i in range(start + 1, end) if sampled[i]]


class Engine:
    def __init__(self, model, tokenizer, *, seed: int = 0, max_batch: int = 16, max_len: int | None = None,
                 strict: bool = False, policy_version: int = 0, device: str | None = None,
                 static_decode: bool = False, fingerprint: str | None = None, decode_chunk: int = 1,
                 compile_decode: bool = False):
        self.model = model.eval()
        self.tok = tokenizer
        self.seed, self.strict, self.version = seed, strict, policy_version
        p = next(model.parameters())
        self.device, self.dtype = (torch.device(device) if device else p.device), p.dtype
        self.model.to(self.device)
        cfg = model.config
        kv_heads, head_dim = _kv_geometry(cfg)
        self.max_len = int(max_len or cfg.max_position_embeddings)
        self.kv = SlotKV(cfg.num_hidden_layers, max_batch, kv_heads, self.max_len, head_dim, self.dtype, self.device)
        self.eos = {cfg.eos_token_id} if isinstance(cfg.eos_token_id, int) else set(cfg.eos_token_id or [])
        self.seqs: dict[str, Seq] = {}
        self._free = list(range(max_batch))
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._fingerprint = fingerprint  # callers that share a model pass it once; else hashed on first use
        self.stats = {"forwards": 0, "decode_rows": 0, "block_tokens": 0, "prefill_rows_shared": 0}
        # On a CPU a small model's step is Python-bound: a lean forward of the same arithmetic (HF otherwise).
        self._lean = None
        if self.device.type == "cpu" and LeanForward.supports(model) is None:
            self._lean = LeanForward(model)
        self.static = None
        self.chunk = None
        if decode_chunk > 1 and not strict and LeanForward.supports(model) is None:  # steps fed back on the device
            from rollout.chunk_decode import ChunkDecoder
            self.chunk = ChunkDecoder(self, self._lean or LeanForward(model), decode_chunk, use_graph=static_decode and self.device.type == "cuda",
                                      compile_forward=compile_decode)
        if static_decode and not strict:  # all slots per step; a CUDA graph on a GPU
            from rollout.static_decode import StaticDecoder
            self.static = StaticDecoder(self, use_graph=self.device.type == "cuda")

    # -- weights ----------------------------------------------------------------------------
    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """New policy weights, copied into the engine's parameters in place (a captured CUDA graph stays
        valid; tensors already on the engine's device, a same-process learner's, copy device to device);
        tokens drawn from now on record `version`."""
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()}, strict=True)
        for lean in {id(x): x for x in (self._lean, self.chunk and self.chunk.lean) if x is not None}.values():
            lean.refresh()  # its fused q/k/v and gate/up weights are copies, refreshed in place
        self.version = version
        self._fingerprint = None

    @property
    def fingerprint(self) -> str:
        """`model_fingerprint` of the weights held now, hashed when first asked for (a KV snapshot's
        write or check), not on every weight update: hashing copies every parameter to the host."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    # -- admission --------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self._free)

    @torch.inference_mode()
    def add(self, req_id: str, tokens: list[int], sampled: list[bool], params: SamplingParams,
            kv: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor] | None] | None = None,
            kv_start: int = 0) -> int:
        """Admit a request: a fresh prompt, or a resumed trajectory (all committed tokens, and optionally the
        KV of a snapshot for the tokens from `kv_start` on). Returns the number of tokens prefilled.

        With `kv_start` > 0 the first `kv_start` tokens are prefilled first. `kv` may be a callable, called
        once that prefill is under way (so a snapshot read in another thread overlaps it); it returns the KV
        or None (no KV after all: the rest is re-prefilled too). A KV that does not fit raises ValueError
        with nothing changed, so the caller can fall back to re-prefill; whatever fails once the request is
        in (the callable, a prefill) takes it out again before the error goes on. A trajectory its last draw
        ended is admitted as done, with no KV and whatever its length (one that ended on the context holds
        `max_len` tokens)."""
        if req_id in self.seqs:
            raise ValueError(f"request {req_id!r} already in the engine")
        if not tokens or len(tokens) != len(sampled):
            raise ValueError(f"request {req_id!r}: {len(tokens)} tokens, {len(sampled)} mask entries")
        seq = Seq(req_id, traj_key(req_id), list(tokens), list(sampled), params, -1)
        seq.n_sampled = sum(sampled)
        seq.turn_start = max((i for i, s in enumerate(sampled) if not s), default=-1) + 1
        if seq.n_sampled and sampled[-1]:
            self._check_stop(seq)
        complete = seq.state == "done"
        if not complete and len(tokens) >= self.max_len:
            raise ValueError(f"request {req_id!r}: {len(tokens)} tokens do not fit max_len {self.max_len}")
        if kv_start and (kv is None or kv_start < 0 or kv_start >= len(tokens)):
            raise ValueError(f"request {req_id!r}: kv_start {kv_start} without a KV or past the tokens")
        if not self._free:
            raise RuntimeError("engine full: check capacity before add")
        deferred = callable(kv)
        if kv is not None and not deferred and not complete:
            length = self._checked(kv, kv_start, tokens, sampled)
        seq.slot = min(self._free)
        self._free.remove(seq.slot)
        self.seqs[req_id] = seq
        if complete:  # it is only finished
            return 0
        try:
            loaded = 0
            if kv is not None:
                self._feed_block(seq, seq.tokens[:kv_start])
                tensors = kv() if deferred else kv
                if tensors is not None:
                    if deferred:
                        length = self._checked(tensors, kv_start, tokens, sampled)
                    self.kv.write(seq.slot, tensors, kv_start, length)
                    loaded, seq.kv_len = length, kv_start + length
            self._replay(seq)
        except BaseException:  # a KV that does not fit, a read that failed, a prefill out of memory: not admitted
            self.remove(req_id)
            raise
        return seq.kv_len - loaded

    def _checked(self, tensors: dict[str, torch.Tensor], start: int, tokens: list[int], sampled: list[bool]) -> int:
        """The tokens a KV placed at `start` covers; ValueError unless it fits the cache and ends at a decode
        point (the next token was sampled)."""
        length = self.kv.check(tensors, start)
        end = start + length
        if not (end == 0 or (end < len(tokens) and sampled[end])):
            raise ValueError(f"kv covers {end} tokens: not a decode point of this trajectory")
        return length

    def _replay(self, seq: Seq) -> None:
        """Rebuild the KV of committed tokens up to the last decode point (pending tokens stay pending)."""
        points = decode_points(seq.sampled, seq.kv_len, len(seq.tokens))
        if not points:
            return
        if self.strict:
            for i in points:
                self._feed_block(seq, seq.tokens[seq.kv_len:i - 1])
                self._forward_rows([seq])
        else:
            self._feed_block(seq, seq.tokens[seq.kv_len:points[-1]])

    def remove(self, req_id: str) -> Seq:
        seq = self.seqs.pop(req_id)
        self._free.append(seq.slot)
        if self.chunk is not None:
            self.chunk.forget(req_id)
        return seq

    def append_env(self, req_id: str, tokens: list[int]) -> None:
        """Environment tokens (a tool result): loss-masked, never sampled; the request runs again."""
        seq = self.seqs[req_id]
        if not self.fits(req_id, len(tokens)):
            raise ValueError(f"request {req_id!r}: {len(tokens)} environment tokens overflow max_len {self.max_len}")
        seq.tokens += tokens
        seq.sampled += [False] * len(tokens)
        seq.turn_start = len(seq.tokens)
        seq.state, seq.reason = "run", ""

    def fits(self, req_id: str, extra: int) -> bool:
        """Whether `extra` more tokens leave room to decode at least one more."""
        return len(self.seqs[req_id].tokens) + extra < self.max_len - 1

    def export_kv(self, req_id: str) -> tuple[dict[str, torch.Tensor], int]:
        seq = self.seqs[req_id]
        return self.kv.export(seq.slot, seq.kv_len), seq.kv_len

    # -- decode ------------------------------------------------------------------------------
    def running(self) -> list[Seq]:
        return [s for s in self.seqs.values() if s.state == "run"]

    def step(self) -> list[Draw]:
        """Feed every running request its pending tokens and draw one token each (not yet accepted)."""
        return self.collect(self.launch())

    @torch.inference_mode()
    def launch(self, steps: int = 1):
        """Enqueue decode steps (asynchronous on a GPU); `collect_steps` reads their draws. Between the two
        the caller may commit earlier draws, so the WAL's fsync overlaps the device's work. More than one
        step only with the chunked decoder (`decode_chunk` > 1) and rows it covers; else one step. A chunk
        runs no more steps than the most any of its rows can still draw (token budget, context)."""
        seqs = sorted(self.running(), key=lambda s: s.slot)
        if not seqs:
            return None
        fresh: dict[int, list[Seq]] = {}
        for s in seqs:
            if len(s.tokens) - s.kv_len > 1:
                if s.kv_len == 0 and not self.strict:  # new prompts of one length: one batched prefill
                    fresh.setdefault(len(s.tokens), []).append(s)
                else:
                    self._feed_block(s, s.tokens[s.kv_len:-1])
        for group in fresh.values():
            self._prefill_fresh([s.slot for s in group], torch.tensor([s.tokens[:-1] for s in group], device=self.device))
            for s in group:
                s.kv_len = len(s.tokens) - 1
        if self.chunk is not None and all(self.chunk.covers(s.params) for s in seqs):
            left = max(min(s.params.max_new_tokens - s.n_sampled, self.max_len - 1 - len(s.tokens)) for s in seqs)
            n = min(steps, self.chunk.max_chunk, left)
            return "chunk", seqs, [len(s.tokens) for s in seqs], self.chunk.launch(seqs, max(1, n))
        if self.static is not None:
            rows, logits_BV = seqs, self.static.forward(seqs)
        else:
            groups = [[s] for s in seqs] if self.strict else _contiguous(seqs)
            rows, logits = [], []
            for g in groups:
                logits.append(self._forward_rows(g))
                rows += g
            logits_BV = torch.cat(logits) if len(logits) > 1 else logits[0]
        u = [uniform(self.seed, s.key, len(s.tokens)) for s in rows]
        tok_B, lp_B = sample(logits_BV, [s.params for s in rows], u)
        return "step", rows, [len(s.tokens) for s in rows], (tok_B, lp_B)

    def collect_steps(self, pending) -> list[list[Draw]]:
        """The draws of each launched step, in step order (one device sync)."""
        if pending is None:
            return []
        kind, rows, positions, out = pending
        if kind == "chunk":
            toks, lps = self.chunk.read(out)
            return [[Draw(s.req_id, p + i, t[s.slot], lp[s.slot]) for s, p in zip(rows, positions)]
                    for i, (t, lp) in enumerate(zip(toks, lps))]
        toks, lps = out[0].tolist(), out[1].tolist()
        return [[Draw(s.req_id, p, int(t), float(lp)) for s, p, t, lp in zip(rows, positions, toks, lps)]]

    def collect(self, pending) -> list[Draw]:
        """The draws of a one-step launch."""
        steps = self.collect_steps(pending)
        if len(steps) > 1:
            raise ValueError(f"collect of a {len(steps)}-step launch: use collect_steps")
        return steps[0] if steps else []

    def accept_steps(self, steps: list[list[Draw]]) -> list[tuple[list[Draw], list[Seq]]]:
        """Accept a chunk's draws step by step; a request's draws after it stopped are dropped (drawn past
        its end on the device). Per step: (the draws kept, the requests that stopped)."""
        out = []
        for draws in steps:
            draws = [d for d in draws if (s := self.seqs.get(d.req_id)) is not None and s.state == "run"]
            if not draws:
                break
            self._check_finite(draws)
            out.append((draws, self.accept(draws)))
        return out

    def _check_finite(self, draws: list[Draw]) -> None:
        """NonFiniteLogits unless every draw's log-prob is finite. A row's sampled log-prob is NaN or infinite
        exactly when its logits are not finite (weights or activations that overflowed): such a draw is no
        sample of the policy, and must never be accepted, committed or trained on."""
        if all(map(math.isfinite, map(_LOGPROB, draws))):
            return
        d = next(d for d in draws if not math.isfinite(d.logprob))
        raise NonFiniteLogits(f"trajectory {d.req_id!r}, position {d.position}: the logits of policy version "
                              f"{self.version} are not finite (log-prob {d.logprob}); the step was not accepted")

    def accept(self, draws: list[Draw]) -> list[Seq]:
        """Append committed draws; returns the requests that stopped (paused at a stop string, or done)."""
        stopped = []
        for d in draws:
            seq = self.seqs[d.req_id]
            if d.position != len(seq.tokens):
                raise ValueError(f"draw for {d.req_id!r} at {d.position}, sequence has {len(seq.tokens)} tokens")
            if seq.kv_len < d.position:  # a chunk step: the device fed the token before this draw
                seq.kv_len = d.position
            seq.tokens.append(d.token)
            seq.sampled.append(True)
            seq.n_sampled += 1
            if self._check_stop(seq):
                stopped.append(seq)
        return stopped

    def _check_stop(self, seq: Seq) -> bool:
        p = seq.params
        last = seq.tokens[-1]
        if last in self.eos and not p.ignore_eos:
            seq.state, seq.reason = "done", "eos"
        elif seq.n_sampled >= p.max_new_tokens:
            seq.state, seq.reason = "done", "max_new_tokens"
        elif len(seq.tokens) >= self.max_len - 1:
            seq.state, seq.reason = "done", "context"
        elif p.stop:
            window = max(len(s) for s in p.stop) + 8
            tail = self.tok.decode(seq.tokens[max(seq.turn_start, len(seq.tokens) - window):])
            hit = next((s for s in p.stop if tail.endswith(s)), None)
            if hit is None:
                return False
            seq.state, seq.reason = "paused", f"stop:{hit}"
        else:
            return False
        return True

    # -- forwards -----------------------------------------------------------------------------
    def _feed_block(self, seq: Seq, tokens: list[int]) -> None:
        """Write the K/V of `tokens` (one row, causal) at seq.kv_len."""
        if not tokens:
            return
        T, start = len(tokens), seq.kv_len
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.arange(start, start + T, device=self.device)
        if start == 0:  # no past: plain causal attention (flash kernels), then the K/V go into the slot
            self._prefill_fresh([seq.slot], ids)
        else:
            mask = (torch.arange(start + T, device=self.device)[None, :] <= pos[:, None])[None, None]
            self.kv.bind(seq.slot, seq.slot + 1, None, start, T, start + T)
            self._run(ids, pos[None], mask)
            self.stats["block_tokens"] += T
        seq.kv_len += T

    def _prefill_fresh(self, slots: list[int], ids_NT: torch.Tensor) -> None:
        """Prefill rows with no past (equal lengths) with plain causal attention, then move their K/V into `slots`.
        Equal rows (a GRPO group's G copies of one prompt) are run once and their K/V copied to every slot."""
        N, T = ids_NT.shape
        if N == 1 and getattr(self.model, "lean_only", False):  # one row: straight into its slot
            pos = torch.arange(T, device=self.device)
            self.kv.bind(slots[0], slots[0] + 1, None, 0, T, T)
            self._run(ids_NT, pos[None], _causal(pos))
            self.stats["block_tokens"] += T
            return
        uniq_UT, inverse = torch.unique(ids_NT, dim=0, return_inverse=True) if N > 1 else (ids_NT, None)
        if uniq_UT.shape[0] == N:  # no two rows equal: run them as they are, no gather afterwards
            uniq_UT, inverse = ids_NT, None
        keys, values = self._prefill_kv(uniq_UT)
        rows = torch.tensor(slots, device=self.device)
        for i in range(len(self.kv.k)):
            k, v = keys[i], values[i]
            self.kv.k[i][rows, :, :T] = k if inverse is None else k[inverse]
            self.kv.v[i][rows, :, :T] = v if inverse is None else v[inverse]
        self.stats["block_tokens"] += uniq_UT.shape[0] * T
        self.stats["prefill_rows_shared"] += N - uniq_UT.shape[0]

    def _prefill_kv(self, ids_UT: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the K/V [U, kv_heads, T, head_dim] of rows with no past (one causal forward)."""
        U, T = ids_UT.shape
        self.stats["forwards"] += 1
        if getattr(self.model, "lean_only", False):  # no HF forward to run: the lean one, all rows at once
            pos = torch.arange(T, device=self.device)
            held = _HeldKV(len(self.kv.k))
            self._lean(ids_UT, pos[None].expand(U, T), _causal(pos), held)
            return held.k, held.v
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        pos = torch.arange(T, device=self.device)[None].expand(U, T)
        self.model(input_ids=ids_UT, position_ids=pos, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        if hasattr(cache, "layers"):
            return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
        return list(cache.key_cache), list(cache.value_cache)

    def _forward_rows(self, group: list[Seq]) -> torch.Tensor:
        """One decode row per request of a contiguous slot range: feeds its last pending token, returns logits [B, V]."""
        lo = group[0].slot
        pos = [s.kv_len for s in group]
        pos_B = torch.tensor(pos, device=self.device)
        ids = torch.tensor([[s.tokens[s.kv_len]] for s in group], device=self.device)
        kv_len = max(pos) + 1
        mask = (torch.arange(kv_len, device=self.device)[None, :] <= pos_B[:, None])[:, None, None, :]
        self.kv.bind(lo, lo + len(group), pos_B, 0, 1, kv_len)
        logits = self._run(ids, pos_B[:, None], mask)
        for s in group:
            s.kv_len += 1
        self.stats["decode_rows"] += len(group)
        return logits[:, -1, :]

    def _run(self, ids, pos, mask) -> torch.Tensor:
        self.stats["forwards"] += 1
        if self._lean is not None:
            return self._lean(ids, pos, mask, self.kv)
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                         logits_to_keep=1, **{self._cache_kw: self.kv})
        return out.logits

    # -- convenience --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, ids: list[str] | None = None) -> list[Seq]:
        """Decode `prompts` to completion without a WAL (benchmarks, evaluation)."""
        ids = ids or [f"g{i}" for i in range(len(prompts))]
        queue, done = list(zip(ids, prompts)), []
        while queue or self.seqs:
            while queue and self.capacity:
                rid, p = queue.pop(0)
                self.add(rid, p, [False] * len(p), params)
            chunk = self.chunk.max_chunk if self.chunk is not None else 1
            for _, stopped in self.accept_steps(self.collect_steps(self.launch(chunk))):
                for s in stopped:
                    if s.state == "paused":
                        s.state, s.reason = "done", s.reason
            for s in [s for s in self.seqs.values() if s.state != "run"]:
                done.append(self.remove(s.req_id))
        order = {rid: i for i, rid in enumerate(ids)}
        return sorted(done, key=lambda s: order[s.req_id])


def _contiguous(seqs: list[Seq]) -> list[list[Seq]]:
    """Split slot-sorted requests into runs of consecutive slots (each run is one batched forward)."""
    groups: list[list[Seq]] = []
    for s in seqs:
        if groups and groups[-1][-1].slot + 1 == s.slot:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _causal(pos: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] mask of positions 0..T-1 attending to themselves and earlier ones."""
    return (pos[None, :] <= pos[:, None])[None, None]


class _HeldKV:
    """The cache a fresh prefill's lean forward writes into: each layer's K/V kept as computed (no past)."""

    def __init__(self, layers: int):
        self.k: list = [None] * layers
        self.v: list = [None] * layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.k[layer_idx], self.v[layer_idx] = key_states, value_states
        return key_states, value_states
