"""The OPD learner of one rank: one optimizer step per minibatch of a teacher-ordered plan.

    L = sum_rows w_i sum_{p in row} KL(p_s(.|p) || p_t_i(.|p)) / n,  n = student positions scored
(a position scored by several teachers of its domain counts once: each row adds its positions times
w_i / sum of its domain's weights).

A step over this rank's share of minibatch m: its segments, grouped by teacher (the plan orders them
so), are loaded teacher by teacher with the cached teacher hidden states, the next group read in the
background while the current one trains. For each group: student forward -> hidden states after the
final norm -> the loss against that teacher's head, which `HeadScheduler` keeps as the only teacher
head on the device and loads once per minibatch -> backward. Gradients are accumulated unnormalised
and divided by the step's global count of loss positions once every rank is done (all-reduced with
the counts), so the update does not depend on how the minibatch was split across ranks or groups.

Runs in one process or as a `LearnerWorker` rank (`learner_call("plan_step", ...)`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from distill import opd_loss
from distill.cache import FIELD, CacheMismatch
from distill.heads import HeadScheduler
from distill.opd_config import OPDTrainConfig
from distill.teachers import Teacher
from learner.optim import Optimised
from learner.packed_attention import pick_backend
from learner.train_step import Collectives, LogprobModel, pick_device


def teacher_groups(plan, minibatch: int, rank: int) -> list[tuple[str, object]]:
    """(teacher name, one-bin plan of that teacher's segments) for this rank's bin, in plan order."""
    sl = plan.bin(minibatch, rank)
    traj, start, stop = plan.seg_traj[sl], plan.seg_start[sl], plan.seg_stop[sl]
    codes = plan.teacher[traj]
    out = []
    for code in dict.fromkeys(codes.tolist()):
        keep = codes == code
        name = plan.teachers[code] if plan.teachers else ""
        if not name:
            raise CacheMismatch(f"minibatch {minibatch}: trajectories {plan.ids[traj[keep]][:3].tolist()} have no teacher")
        out.append((name, dataclasses.replace(
            plan, ranks=1, seg_traj=traj[keep], seg_start=start[keep], seg_stop=stop[keep],
            bin_offsets=np.array([0, int(keep.sum())], dtype=np.int64), balanced=np.array([True]))))
    return out


def _load(sub) -> object:
    import dataplane

    return next(iter(dataplane.loader(sub, rank=0, minibatches=[0], prefetch=0, extras=[FIELD])))


def _micro(batch, budget: int) -> list[slice]:
    """Token slices of `batch` at sequence boundaries, each at most `budget` tokens (a longer one alone)."""
    cu = batch.cu_seqlens.tolist()
    out, first = [], 0
    for k in range(1, len(cu)):
        if cu[k] - cu[first] > budget and k - 1 > first:
            out.append(slice(cu[first], cu[k - 1]))
            first = k - 1
    out.append(slice(cu[first], cu[-1]))
    return out


class OPDLearner(Optimised):
    """Owns the student, its optimizer and schedule; `plan_step` applies one OPD update."""

    def __init__(self, model: torch.nn.Module, cfg: OPDTrainConfig, collectives: Collectives | None = None,
                 wrap=None):
        del wrap  # gradients are all-reduced explicitly after the step's backward passes
        self.cfg = cfg
        self.device = pick_device(cfg.learner.device)
        self.model = model.to(self.device).train()
        self.core = LogprobModel(self.model, cfg.learner.logprob_chunk_rows, pick_backend("auto", self.device))
        self.coll = collectives or Collectives(1)
        self.init_optimiser()
        self.teachers: dict[str, Teacher] = {}
        self.heads: HeadScheduler | None = None
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" and cfg.learner.bf16
                         else contextlib.nullcontext())

    def set_teachers(self, rank: int, teachers: list[Teacher]) -> None:
        del rank
        if self.heads is not None:
            self.heads.close()
        self.teachers = {t.name: t for t in teachers}
        per_domain: dict[str, float] = {}
        for t in teachers:
            per_domain[t.domain] = per_domain.get(t.domain, 0.0) + t.weight
        self._share = {t.name: t.weight / per_domain[t.domain] for t in teachers}
        head_dtype = self.model.get_output_embeddings().weight.dtype
        self.heads = HeadScheduler(self.teachers, self.device, dtype=head_dtype, prefetch=self.cfg.opd.prefetch)

    # -- the step ------------------------------------------------------------------------------------
    def plan_step(self, rank: int, plan, minibatch: int, tokens_hash: dict[str, str]) -> dict[str, float]:
        """One optimizer step on this rank's share of `minibatch`; global metrics. `tokens_hash[row]` is the
        hash of the tokens each cache row must hold (checked against the loaded tokens)."""
        t0 = time.perf_counter()
        metrics = self.accumulate_gradients(rank, plan, minibatch, tokens_hash)
        grad_norm = self.clip()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return metrics | {"grad_norm": float(grad_norm), "lr": self.scheduler.get_last_lr()[0], "step": self.step,
                          "step_time_s": time.perf_counter() - t0}

    def accumulate_gradients(self, rank: int, plan, minibatch: int, tokens_hash: dict[str, str]) -> dict[str, float]:
        """Backward of every teacher group of this rank's share; leaves the step's gradients (all ranks,
        normalised by the global loss positions) in `.grad`; returns the step's metrics."""
        from rollout.types import token_hash

        if self.heads is None:
            raise RuntimeError("OPD learner: set_teachers before plan_step")
        opd = self.cfg.opd
        names = sorted(self.teachers)
        T = len(names)  # sums: positions, tokens, weighted loss, then per teacher its KL sum and positions
        sums = torch.zeros(3 + 2 * T, dtype=torch.float64)
        loads_before = self.heads.loads
        W_s = self.model.get_output_embeddings().weight
        groups = teacher_groups(plan, minibatch, rank)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-load") if opd.prefetch else None
        try:
            fut = (pool.submit(_load, groups[0][1]) if pool else None) if groups else None
            for j, (name, sub) in enumerate(groups):
                batch = fut.result() if pool else _load(sub)
                if pool and j + 1 < len(groups):
                    fut = pool.submit(_load, groups[j + 1][1])
                if name not in self.teachers:
                    raise CacheMismatch(f"cache rows name teacher {name!r}, not one of this run's {names}")
                self._check_rows(batch, tokens_hash, token_hash)
                teacher = self.teachers[name]
                nxt = groups[j + 1][0] if j + 1 < len(groups) else None
                with self.heads.resident(name, then=nxt) as W_t:
                    for part in _micro(batch, self.cfg.learner.micro_batch_tokens):
                        n, kl_sum, loss_sum = self._group_backward(batch, part, W_s, W_t, teacher.weight)
                        i = names.index(name)
                        sums[0] += n * self._share[name]  # a position scored by several teachers counts once
                        sums[1] += part.stop - part.start
                        sums[2] += loss_sum
                        sums[3 + i] += kl_sum
                        sums[3 + T + i] += n
                    del W_t
            self.heads.release()
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        self.coll.all_reduce_sum(sums)
        n_global = max(float(sums[0]), 1.0)
        self._reduce_and_scale(1.0 / n_global)
        loads = torch.tensor([self.heads.loads - loads_before, self.heads.max_resident], dtype=torch.float64)
        self.coll.all_reduce_sum(loads)
        metrics = {"loss_positions": float(sums[0]), "tokens": float(sums[1]), "loss": float(sums[2]) / n_global,
                   "kl": float(sums[3:3 + T].sum()) / n_global, "head_loads": float(loads[0]),
                   "max_resident_heads": float(self.heads.max_resident)}
        for i, name in enumerate(names):
            if sums[3 + T + i] > 0:
                metrics[f"kl_{name}"] = float(sums[3 + i] / sums[3 + T + i])
                metrics[f"positions_{name}"] = float(sums[3 + T + i])
        return metrics

    def _check_rows(self, batch, tokens_hash: dict[str, str], token_hash) -> None:
        cu = batch.cu_seqlens.tolist()
        for k, row in enumerate(batch.traj_ids):
            if int(batch.seg_start[k]) != 0 or int(batch.seg_stop[k]) != int(batch.traj_length[k]):
                raise ValueError(f"cache row {row!r} was split by the plan; plan OPD minibatches with "
                                 "tokens_per_rank >= the longest trajectory")
            want = tokens_hash.get(row)
            if want is None:
                raise CacheMismatch(f"cache row {row!r} is not in this step's checked records")
            got = token_hash(batch.input_ids[cu[k]:cu[k + 1]].tolist())
            if got != want:
                raise CacheMismatch(f"cache row {row!r}: other tokens: its tokens hash to {got}, its record says "
                                    f"{want}; refusing to train on it")

    def _group_backward(self, batch, part: slice, W_s, W_t, weight: float) -> tuple[int, float, float]:
        """Backward of one teacher's micro-batch; returns (loss positions, sum of their KL, weighted loss sum)."""
        opd = self.cfg.opd
        ids, pos = batch.input_ids[part].to(self.device), batch.position_ids[part].to(self.device)
        mask = batch.loss_mask[part].to(self.device)
        starts = torch.nonzero(pos == 0).flatten()
        cu = torch.cat([starts, starts.new_tensor([len(pos)])])
        P = opd_loss.prediction_positions(mask)
        n = int(P.sum())
        if n == 0:
            return 0, 0.0, 0.0
        h_t = batch.extras[FIELD][part].to(self.device)[P]
        with self.autocast:
            h_s = self.core.hidden(ids, pos, cu, int(cu.diff().max()))
        h_s = h_s[P].to(W_s.dtype)
        coef = torch.full((n,), float(weight), dtype=torch.float32, device=self.device)
        if opd.loss == "full_vocab":
            loss = opd_loss.full_vocab_kl(h_s, W_s, h_t, W_t, coef, opd.temperature, opd.kl_chunk_tokens or None)
            kl_sum = float(loss.detach()) / weight
        else:
            nxt = torch.roll(ids, -1)[P]
            behaviour = torch.roll(batch.logprobs[part].to(self.device).float(), -1)[P]
            teacher_lp = opd_loss.teacher_token_logprobs(h_t, W_t, nxt, opd.temperature)
            from learner.grpo_loss import logprobs_from_hidden

            logp = logprobs_from_hidden(h_s / opd.temperature, W_s, nxt, self.cfg.learner.logprob_chunk_rows)[0]
            loss, k1 = opd_loss.sampled_token_pg(logp.float(), behaviour, teacher_lp, coef, opd.clip_eps)
            kl_sum = float(k1.sum())
        loss.backward()
        return n, kl_sum, float(loss.detach())

    def _reduce_and_scale(self, scale: float) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.coll.world_size > 1:
            flat = torch.cat([p.grad.reshape(-1).float() for p in params])
            self.coll.all_reduce_sum(flat)
            k = 0
            for p in params:
                p.grad.copy_(flat[k:k + p.numel()].view_as(p.grad))
                k += p.numel()
        for p in params:
            p.grad.mul_(scale)



def opd_learner(model, cfg: OPDTrainConfig, collectives: Collectives, wrap) -> OPDLearner:
    """`make_learner` of a `LearnerWorker` rank that trains with OPD."""
    return OPDLearner(model, cfg, collectives, wrap)
