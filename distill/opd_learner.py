"""The OPD learner of one rank: one optimizer step per minibatch of a teacher-ordered plan.

    L = sum_rows w_i sum_{p in row} KL(p_s(.|p) || p_t_i(.|p)) / n,  n = student positions scored
(a position scored by several teachers of its domain counts once: each row adds its positions times
w_i / sum of its domain's weights).

A trajectory's rows (one per teacher of its domain) share an optimizer step (`plan_iteration` plans
them so, `rows_apart` refuses a plan that does not): a step holding one teacher's rows of a domain
without the others' would count their positions at that teacher's share alone, and the teacher's
weight would cancel out of the step.

A step over this rank's share of minibatch m: its segments, grouped by teacher (the plan orders them
so), are loaded teacher by teacher with the cached teacher hidden states, the next group read in the
background (and made ready for the device: `opd_batches.prepare`) while the current one trains. For
each micro-batch of a group: the student's trunk forward -> hidden states h after the final norm -> the
loss against that teacher's head on a detached copy of h, and its backward -> the trunk's backward from
h's gradient. `HeadScheduler` keeps the teacher's head as the only one on the device and loads it once
per minibatch; the head is needed only by the loss, so as soon as a group's last loss backward is done
it is dropped and the next head (the next group's, or the next minibatch's first) copies to the device
while the trunk's backward and the next trunk forward run. Gradients are accumulated unnormalised
and divided by the step's global count of loss positions once every rank is done (all-reduced with
the counts), so the update does not depend on how the minibatch was split across ranks or groups.

Runs in one process or as a `LearnerWorker` rank (`learner_call("plan_step", ...)`).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from distill import opd_loss
from distill.cache import FIELD, CacheMismatch
from distill.heads import HeadScheduler
from distill.opd_batches import Part, prepare, to_device
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


def plan_iteration(dp, sel, ranks: int, minibatches: int, seed: int = 0, epoch: int = 0):
    """One iteration's cache rows `sel` in about `minibatches` optimizer steps of `ranks` ranks: a
    trajectory's rows (its group) share a minibatch, groups ordered by teacher. The per-rank budget
    holds the largest group, so no group is cut across minibatches and no row is split."""
    if not len(sel.length):
        raise ValueError("plan_iteration: no cache rows to plan")
    biggest = int(np.bincount(sel.group, weights=sel.length).max())
    budget = max(biggest, math.ceil(sel.num_tokens / (ranks * minibatches)))
    return dp.plan(sel, tokens_per_rank=budget, ranks=ranks, seed=seed, epoch=epoch, group_aware=True, by_teacher=True)


def rows_apart(plan, names: set[str]) -> list[str]:
    """Ids of cache rows of teachers `names` whose trajectory (group) has rows in another minibatch."""
    per_bin = np.diff(plan.bin_offsets).reshape(plan.num_minibatches, plan.ranks).sum(axis=1)
    minibatch = np.repeat(np.arange(plan.num_minibatches), per_bin)
    codes = [i for i, name in enumerate(plan.teachers) if name in names]
    keep = np.isin(plan.teacher[plan.seg_traj], codes)
    group, minibatch, traj = plan.group[plan.seg_traj][keep], minibatch[keep], plan.seg_traj[keep]
    pairs = np.unique(np.stack([group, minibatch]), axis=1)
    split = np.unique(pairs[0][np.flatnonzero(pairs[0][1:] == pairs[0][:-1])])
    return plan.ids[traj[np.isin(group, split)]].tolist()


def _rows_key(sub, tokens_hash: dict[str, str]) -> tuple:
    """What a one-group plan reads: the store, each segment's row, range and the tokens it must hold."""
    traj = sub.seg_traj
    return (sub.store_root, tuple(sub.ids[traj].tolist()), tuple(sub.seg_start.tolist()), tuple(sub.seg_stop.tolist()),
            tuple(sub.shard_paths[i] for i in sub.shard[traj].tolist()), tuple(sub.row[traj].tolist()),
            tuple(tokens_hash.get(str(r)) for r in sub.ids[traj].tolist()))


def _load(sub) -> object:
    import dataplane

    return next(iter(dataplane.loader(sub, rank=0, minibatches=[0], prefetch=0, extras=[FIELD])))


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
        # One thread reads teacher groups ahead (the next group; in a step's last group the next step's first).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opd-load") if cfg.opd.prefetch else None
        self._ahead: tuple[tuple, Future] | None = None

    def set_teachers(self, rank: int, teachers: list[Teacher]) -> None:
        del rank
        if self.heads is not None:
            self.heads.close()
        self.teachers = {t.name: t for t in teachers}
        per_domain: dict[str, float] = {}
        for t in teachers:
            per_domain[t.domain] = per_domain.get(t.domain, 0.0) + t.weight
        self._share = {t.name: t.weight / per_domain[t.domain] for t in teachers}
        counts = collections.Counter(t.domain for t in teachers)
        self._shared = {t.name for t in teachers if counts[t.domain] > 1}  # their rows must share a step
        head_dtype = self.model.get_output_embeddings().weight.dtype
        self.heads = HeadScheduler(self.teachers, self.device, dtype=head_dtype, prefetch=self.cfg.opd.prefetch,
                                   host_budget_bytes=int(self.cfg.opd.host_head_cache_gib * 2**30))

    # -- the step ------------------------------------------------------------------------------------
    def plan_step(self, rank: int, plan, minibatch: int, tokens_hash: dict[str, str]) -> dict[str, float]:
        """One optimizer step on this rank's share of `minibatch`; global metrics. `tokens_hash[row]` is the
        hash of the tokens each cache row must hold (checked against the loaded tokens)."""
        t0 = time.perf_counter()
        metrics = self.accumulate_gradients(rank, plan, minibatch, tokens_hash)
        return metrics | self.apply_update() | {"step_time_s": time.perf_counter() - t0}

    def apply_update(self) -> dict[str, float]:
        """Clip, step the optimizer and the schedule, clear the gradients."""
        grad_norm = self.clip_finite("OPD")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0], "step": self.step}

    def accumulate_gradients(self, rank: int, plan, minibatch: int, tokens_hash: dict[str, str]) -> dict[str, float]:
        """Backward of every teacher group of this rank's share; leaves the step's gradients (all ranks,
        normalised by the global loss positions) in `.grad`; returns the step's metrics."""
        if self.heads is None:
            raise RuntimeError("OPD learner: set_teachers before plan_step")
        apart = rows_apart(plan, self._shared) if self._shared and plan.num_minibatches > 1 else []
        if apart:
            raise ValueError(f"OPD plan puts rows {apart[:2]} of one trajectory in different minibatches, which "
                             "cancels the teacher weights of their domain; plan with opd_learner.plan_iteration")
        groups = teacher_groups(plan, minibatch, rank)
        for name, _ in groups:
            if name not in self.teachers:
                raise CacheMismatch(f"cache rows name teacher {name!r}, not one of this run's {sorted(self.teachers)}")
        following = None  # the first teacher of this rank's next minibatch: its head is copied ahead
        nxt = teacher_groups(plan, minibatch + 1, rank) if minibatch + 1 < plan.num_minibatches else []
        if nxt:
            following = nxt[0][0]
        budget, pin = self.cfg.learner.micro_batch_tokens, self.device.type == "cuda"
        cache_dtype = getattr(torch, self.cfg.opd.cache_dtype)
        prep = lambda sub: prepare(_load(sub), tokens_hash, budget, pin, cache_dtype)  # noqa: E731
        futs: list[Future | None] = [None] * len(groups)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and groups and ahead[0] == _rows_key(groups[0][1], tokens_hash):
            futs[0] = ahead[1]  # read during the previous step

        def fetch(j: int) -> list[Part]:
            if self._pool is None:
                return prep(groups[j][1])
            if futs[j] is None:
                futs[j] = self._pool.submit(prep, groups[j][1])
            if j + 1 < len(groups) and futs[j + 1] is None:
                futs[j + 1] = self._pool.submit(prep, groups[j + 1][1])
            elif j + 1 == len(groups) and nxt:  # the next minibatch's first group, read during this step's last
                self._ahead = (_rows_key(nxt[0][1], tokens_hash), self._pool.submit(prep, nxt[0][1]))
            return futs[j].result()

        try:
            loads_before = self.heads.loads
            sums = self.train_groups([name for name, _ in groups], fetch, self.heads, following)
        except BaseException:
            self._ahead = None
            for f in futs:  # nothing of a failed step is read on
                if f is not None:
                    f.cancel()
            raise
        return self.finish_gradients(sums, self.heads, self.heads.loads - loads_before)

    def train_groups(self, names: list[str], fetch, heads, following: str | None = None) -> torch.Tensor:
        """Backward of the teacher groups `names` (group j's micro-batches from `fetch(j)`), teacher heads
        from `heads`; returns the step's local sums (positions, tokens, loss, per teacher KL and positions).

        Each micro-batch: the student's trunk forward -> hidden states h; the loss against the
        teacher's head on a detached copy of h, and its backward (gradients of h and of the student's
        head); then the trunk's backward from h's gradient. After the loss of a group's last
        micro-batch the teacher head is no longer needed: it is dropped and the next group's head
        (after the last group: `following`, the next minibatch's first) starts copying to the device,
        while the trunk's backward and the next trunk forward run."""
        T = len(self.teachers)
        order = sorted(self.teachers)
        sums = torch.zeros(3 + 2 * T, dtype=torch.float64)
        dev_sums = torch.zeros(2 + T, dtype=torch.float64, device=self.device)  # loss, then per teacher KL
        W_s = self.model.get_output_embeddings().weight
        for name in dict.fromkeys(names):
            heads.stage(name)  # host reads in order, in the background
        if names:
            heads.swap(names[0])  # (already on its way when the previous step copied it ahead)
        for j, name in enumerate(names):
            parts = fetch(j)
            after = names[j + 1] if j + 1 < len(names) else following
            i, weight = order.index(name), self.teachers[name].weight
            for k, host_part in enumerate(parts):
                if host_part.n and host_part.h_t_PH.shape[1] != self.teachers[name].hidden_size:
                    raise CacheMismatch(f"cache rows of teacher {name!r}: hidden states {host_part.h_t_PH.shape[1]} wide, "
                                        f"its head takes {self.teachers[name].hidden_size}; refusing to train on them")
                part = to_device(host_part, self.device, heads.stream)
                h = None
                if part.n:
                    with self.autocast:
                        h = self.core.hidden(part.ids_N, part.pos_N, part.cu_S1, part.max_len)
                    h_d = h.detach().requires_grad_()
                    with heads.resident(name) as W_t:
                        if part.ready is not None:
                            torch.cuda.current_stream(self.device).wait_event(part.ready)
                        loss, kl_sum = self._head_loss(h_d, part, W_s, W_t, weight)
                        loss.backward()
                        del W_t
                    dev_sums[0] += loss.detach().double()
                    dev_sums[2 + i] += kl_sum.double()
                    del loss, kl_sum
                    sums[0] += part.n * self._share[name]  # a position scored by several teachers counts once
                    sums[3 + T + i] += part.n
                sums[1] += part.tokens
                if k == len(parts) - 1:
                    heads.swap(after)  # this head's last use is over; the next copies during the trunk's backward
                if h is not None:
                    h.backward(h_d.grad)
                    del h, h_d
        sums[2] = float(dev_sums[0])
        sums[3:3 + T] = dev_sums[2:].cpu()
        return sums

    def finish_gradients(self, sums: torch.Tensor, heads, loads: int) -> dict[str, float]:
        """All-reduce the sums and the gradients, normalise by the global positions; the step's metrics
        (`loads`: heads this rank loaded in the step)."""
        names = sorted(self.teachers)
        T = len(names)
        self.coll.all_reduce_sum(sums)
        n_global = max(float(sums[0]), 1.0)
        self._reduce_and_scale(1.0 / n_global)
        loads = torch.tensor([loads, heads.max_resident], dtype=torch.float64)
        self.coll.all_reduce_sum(loads)
        metrics = {"loss_positions": float(sums[0]), "tokens": float(sums[1]), "loss": float(sums[2]) / n_global,
                   "kl": float(sums[3:3 + T].sum()) / n_global, "head_loads": float(loads[0]),
                   "max_resident_heads": float(heads.max_resident)}
        for i, name in enumerate(names):
            if sums[3 + T + i] > 0:
                metrics[f"kl_{name}"] = float(sums[3 + i] / sums[3 + T + i])
                metrics[f"positions_{name}"] = float(sums[3 + T + i])
        return metrics

    def _head_loss(self, h_NH, part: Part, W_s, W_t, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(weighted loss, sum of the KL it estimates) of one micro-batch against one teacher head."""
        opd = self.cfg.opd
        h_s = h_NH.index_select(0, part.idx_P).to(W_s.dtype)
        coef = torch.full((part.n,), float(weight), dtype=torch.float32, device=self.device)
        if opd.loss == "full_vocab":
            loss = opd_loss.full_vocab_kl(h_s, W_s, part.h_t_PH, W_t, coef, opd.temperature, opd.kl_chunk_tokens or None)
            return loss, loss.detach().double() / weight
        teacher_lp = opd_loss.teacher_token_logprobs(part.h_t_PH, W_t, part.next_P, opd.temperature)
        from learner.grpo_loss import logprobs_from_hidden

        logp = logprobs_from_hidden(h_s / opd.temperature, W_s, part.next_P, self.cfg.learner.logprob_chunk_rows)[0]
        loss, k1 = opd_loss.sampled_token_pg(logp.float(), part.behaviour_P, teacher_lp, coef, opd.clip_eps)
        return loss, k1.sum()

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
