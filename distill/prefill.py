"""Teacher prefill: each finished trajectory through the trunk of every teacher of its domain, last-layer
hidden states after the final norm into the cache (the data plane).

`TeacherPrefill` holds one teacher trunk at a time, loaded from its checkpoint on demand, and runs in
any process; `TeacherActor` is its Ray shell. `fill_cache` drives one or more of them: it computes
only the rows the catalog does not hold yet (a killed worker is replaced and nothing durable is
recomputed), teacher by teacher, and puts each chunk of rows durably before the next.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from distill.cache import FIELD, CacheRecord, cache_id, cache_run
from distill.teachers import Teacher

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class Sampled:
    """One student trajectory, as the cache needs it."""

    traj_id: str
    domain: str
    prompt: str
    tokens: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # uint8 [L]
    logprobs: np.ndarray  # float32 [L] behaviour log-probs (0 where not sampled)
    tokens_hash: str
    policy_version: int
    reward: float = 0.0  # verified reward (a metric; the loss does not use it)


class TeacherPrefill:
    """Last-layer hidden states of one teacher at a time (the trunk of the previous one is dropped)."""

    def __init__(self, device: str = "cpu", threads: int = 1, batch_tokens: int = 8192):
        torch.set_num_threads(max(1, threads))
        self.device = torch.device(device)
        self.batch_tokens = batch_tokens
        self.name, self.fingerprint, self.trunk = None, None, None
        self.trunk_loads = 0

    def _load(self, teacher: Teacher) -> None:
        if self.name == teacher.name and self.fingerprint == teacher.fingerprint:
            return
        from core.hf import load_policy

        self.trunk = None  # one trunk at a time
        model, _ = load_policy(teacher.path)
        self.trunk = model.base_model.to(self.device).eval()
        self.name, self.fingerprint = teacher.name, teacher.fingerprint
        self.trunk_loads += 1

    @torch.no_grad()
    def hidden(self, teacher: Teacher, token_lists: list[np.ndarray], dtype: str) -> list[torch.Tensor]:
        """[L_i, H_teacher] per trajectory, in `dtype`, on the CPU. Right-padded batches: under causal
        attention a position sees only the tokens before it, so padding after the end changes nothing."""
        self._load(teacher)
        out: list[torch.Tensor | None] = [None] * len(token_lists)
        order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
        k = 0
        while k < len(order):
            longest = len(token_lists[order[k]])
            j = k
            while j < len(order) and (j - k + 1) * max(longest, len(token_lists[order[j]])) <= self.batch_tokens:
                longest = max(longest, len(token_lists[order[j]]))
                j += 1
            j = max(j, k + 1)
            chunk = order[k:j]
            width = max(len(token_lists[i]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            att = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, i in enumerate(chunk):
                t = torch.as_tensor(np.asarray(token_lists[i], dtype=np.int64))
                ids[r, : len(t)], att[r, : len(t)] = t, 1
            h = self.trunk(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                           use_cache=False).last_hidden_state
            for r, i in enumerate(chunk):
                out[i] = h[r, : len(token_lists[i])].to("cpu", DTYPES[dtype]).contiguous()
            k = j
        return out


try:
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class TeacherActor:
        """Ray shell over TeacherPrefill (the driver replaces it when it dies)."""

        def __init__(self, device: str = "cpu", threads: int = 1, batch_tokens: int = 8192):
            import os

            self.pid_ = os.getpid()
            self.p = TeacherPrefill(device, threads, batch_tokens)

        def pid(self) -> int:
            return self.pid_

        def hidden(self, teacher: Teacher, token_lists: list, dtype: str) -> list:
            return self.p.hidden(teacher, token_lists, dtype)
except ImportError:  # pragma: no cover - ray is a dependency
    TeacherActor = None


class Prefillers:
    """The teacher workers of a run: `workers` Ray actors, or one in-process TeacherPrefill when 0."""

    def __init__(self, workers: int, device: str = "cpu", threads: int = 1, batch_tokens: int = 8192,
                 max_replacements: int = 100, num_cpus: float = 0.0, num_gpus: float = 0.0):
        self.workers, self.device, self.threads, self.batch_tokens = workers, device, threads, batch_tokens
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.local = TeacherPrefill(device, threads, batch_tokens) if workers == 0 else None
        self.actors = [self._new() for _ in range(workers)]
        self.replacements, self.max_replacements = 0, max_replacements

    def _new(self):
        return TeacherActor.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus).remote(
            self.device, self.threads, self.batch_tokens)

    def pids(self) -> list[int]:
        import ray

        return [ray.get(a.pid.remote()) for a in self.actors]

    def hidden(self, teacher: Teacher, token_lists: list, dtype: str) -> list[torch.Tensor]:
        """Split over the actors; a dead actor is replaced and its share asked again."""
        if self.local is not None:
            return self.local.hidden(teacher, token_lists, dtype)
        import ray

        shares = [list(range(w, len(token_lists), len(self.actors))) for w in range(len(self.actors))]
        out: list = [None] * len(token_lists)
        pending = {w: self.actors[w].hidden.remote(teacher, [token_lists[i] for i in shares[w]], dtype)
                   for w in range(len(self.actors)) if shares[w]}
        while pending:
            for w, ref in list(pending.items()):
                try:
                    res = ray.get(ref)
                except ray.exceptions.RayActorError:
                    if self.replacements >= self.max_replacements:
                        raise RuntimeError(f"teacher workers: {self.replacements} replacements reached the bound")
                    self.replacements += 1
                    self.actors[w] = self._new()
                    pending[w] = self.actors[w].hidden.remote(teacher, [token_lists[i] for i in shares[w]], dtype)
                    continue
                for i, h in zip(shares[w], res):
                    out[i] = h
                del pending[w]
        return out

    def close(self) -> None:
        if self.actors:
            import ray

            for a in self.actors:
                ray.kill(a)
            self.actors = []


def fill_cache(dp, batch: str, sampled: list[Sampled], teachers: list[Teacher], prefill: Prefillers, *,
               run_id: str, dtype: str, chunk: int = 64) -> dict:
    """Cache rows for every (trajectory, teacher of its domain) pair the catalog does not hold yet.
    Returns counters: rows computed, rows already durable, seconds, bytes of hidden states written."""
    from dataplane import TrajectoryRecord

    t0 = time.monotonic()
    run = cache_run(batch)
    have = set(dp.select(run=run, status=None).ids.tolist())
    computed = reused = nbytes = 0
    for teacher in sorted(teachers, key=lambda t: t.name):
        todo = [s for s in sampled if s.domain == teacher.domain]
        reused += sum(cache_id(s.traj_id, teacher.name) in have for s in todo)
        todo = [s for s in todo if cache_id(s.traj_id, teacher.name) not in have]
        for k in range(0, len(todo), chunk):
            part = todo[k:k + chunk]
            states = prefill.hidden(teacher, [s.tokens for s in part], dtype)
            records = []
            for s, h in zip(part, states):
                if h.shape != (len(s.tokens), teacher.hidden_size):
                    raise RuntimeError(f"teacher {teacher.name}: hidden states of {s.traj_id} have shape "
                                       f"{tuple(h.shape)}, expected ({len(s.tokens)}, {teacher.hidden_size})")
                rec = CacheRecord(run_id, s.traj_id, teacher.name, teacher.fingerprint, dtype, 0, len(s.tokens),
                                  s.tokens_hash, teacher.hidden_size)
                records.append(TrajectoryRecord(
                    id=cache_id(s.traj_id, teacher.name), run=run, domain=s.domain, prompt=s.prompt,
                    group_id=s.traj_id, tokens=s.tokens, loss_mask=s.loss_mask, logprobs=s.logprobs,
                    policy_min=s.policy_version, policy_max=s.policy_version, teacher_id=teacher.name,
                    extras={FIELD: h}, meta=rec.to_meta()))
                nbytes += h.numel() * h.element_size()
            dp.put(records)
            computed += len(records)
    return {"cache_rows_computed": computed, "cache_rows_reused": reused, "prefill_s": round(time.monotonic() - t0, 3),
            "cache_hidden_bytes": nbytes}


def damaged_rows(dp, run: str) -> list[str]:
    """Rows of data-plane run `run` whose shard file is missing or fails its checksum (to recompute)."""
    sel = dp.select(run=run, status=None)
    if not len(sel):
        return []
    crc = {p: c for _, p, _, _, c in dp.catalog.shard_rows()}
    bad = {p for p in sel.shard_paths if not dp.store.exists(p) or dp.store.checksum(p) != int(crc[p])}
    return [str(i) for i, s in zip(sel.ids, sel.shard) if sel.shard_paths[s] in bad]
