"""The GRPO loop: rollout pool → verify → data plane → plan → learner group → publish weights → repeat.

One iteration k (DESIGN.md, "Data flow of one GRPO iteration"):
  1. P prompts of the domain's train split (a pure function of loop.seed and k), G samples each, go to
     the Ray rollout pool; workers verify each finished trajectory and the pool puts it into the data
     plane under the run name `it{k}` (group id = prompt) before the worker may finalize it.
  2. The learner selects the batch's metadata, computes group-relative advantages from the catalog's
     rewards (zero-variance groups counted, optionally left out), plans group-aware minibatches and
     takes one optimizer step per minibatch; every rank loads its own share from the shards.
  3. The learner group publishes policy version v+1; the pool's workers get the weights.
  4. Every `eval_every` iterations: greedy pass@1 on the eval split; every `checkpoint_every`: a
     learner checkpoint (weights, optimizer, RNG, iteration, policy version).

With `loop.async_rollouts` the rollouts of k+1 run (in a thread driving the Ray pool) while the
learner trains on k: their tokens are sampled one policy version behind, which the learner's
staleness bound sees. Weights reach the workers between rollout batches only.

With `loop.replay_share` > 0, up to that share of each iteration's prompts are prompts an earlier
group left unsolved (`learner.prompt_replay`): iteration k's prompts then also depend on the results
of batches before k, which a resumed run reads back from the data plane.

Resume: the run continues from `OUT/checkpoints/latest`. Prompts and sampling are pure functions of
(seed, iteration, earlier batches, trajectory id, position), a complete batch already in the data plane was sampled by
the checkpoint's policy (or, one-step-off, by the one before it, which is why the checkpoint is only
written after that batch is durable), so the resumed run repeats the uninterrupted run's metrics.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

import rewards
from core.errors import UserError
from core.hf import resolve_checkpoint
from deploy.rollout_row import rollout_row
from deploy.grpo_config import GRPOLoopConfig
from deploy.final_average import FinalAverage
from deploy.mixture import domain_shares
from core.rundir import RunDir
from core.rundir import SERVICES_DIR
from deploy.run_lock import lock_run_dir

# Metrics that depend on wall time, machine load or the file system, not on the seeded computation.
TIMING_KEYS = ("time_s", "rollout_s", "train_s", "eval_s", "step_time_s", "tokens_per_s", "iteration_s", "run_dir_mb")


_PROMPT_INDEX = re.compile(r"-p(\d+)-g\d+$")  # prompt j of a trajectory id (make_requests)


def batch_name(iteration: int) -> str:
    """Data-plane run name of iteration k's rollouts."""
    return f"it{iteration:06d}"


def make_requests(cfg: GRPOLoopConfig, domain: str | Sequence[str], iteration: int,
                  replayed: Sequence[str] = ()) -> list:
    """P prompts × G samples (`replayed` prompts first, fresh ones after); each sample has its own
    trajectory id, hence its own RNG stream. Several domains share the P prompts equally (a mixture)."""
    from rollout.sampling import SamplingParams
    from rollout.types import Request

    if not isinstance(domain, str):
        if len(domain) == 1:
            return make_requests(cfg, domain[0], iteration, replayed)
        out = []
        for di, (d, n) in enumerate(domain_shares(cfg.loop.prompts_per_iteration, list(domain)).items()):
            part = make_requests(cfg.model_copy(update={"loop": cfg.loop.model_copy(update={
                "prompts_per_iteration": max(1, n), "seed": cfg.loop.seed * 7919 + di})}), d, iteration)
            out += part if n else []
        return out
    dom = rewards.domain(domain)
    s, lp = cfg.sampling, cfg.loop
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                            stop=("</call>",) if dom.uses_tools else ())
    if lp.prompt_pool:
        pool = dom.prompts("train", lp.prompt_pool, lp.seed)
        first = iteration * lp.prompts_per_iteration
        prompts = [pool[(first + j) % len(pool)] for j in range(lp.prompts_per_iteration)]
    else:
        prompts = dom.prompts("train", lp.prompts_per_iteration, lp.seed * 1_000_003 + iteration)
    prompts = (list(replayed) + prompts)[: lp.prompts_per_iteration]
    return [Request(f"{domain}-{batch_name(iteration)}-p{j:04d}-g{g:03d}", domain, p, params)
            for j, p in enumerate(prompts) for g in range(lp.group_size)]


def subset(sel, keep: np.ndarray):
    """The trajectories of a data-plane Selection where `keep` is True (shard paths unchanged)."""
    per_traj = {f.name for f in dataclasses.fields(sel) if f.name not in ("shard_paths", "teachers")}
    return dataclasses.replace(sel, **{name: getattr(sel, name)[keep] for name in per_traj})


def check_engine_device(verb: str, device: str) -> None:
    """engine.device = cuda[:N] needs that CUDA device here; checked at the start, since rollout actors that
    cannot start are otherwise replaced up to pool.max_replacements times before the run fails. On a Ray
    cluster (RAY_ADDRESS) the workers' nodes may hold GPUs the driver's lacks: left to them."""
    import os

    if not device.startswith("cuda") or os.environ.get("RAY_ADDRESS"):
        return
    index = int(device.partition(":")[2] or 0)
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise UserError(f"{verb}: engine.device = {device!r} but this machine has "
                        f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA device(s); "
                        "set engine.device = \"cpu\" or run where the GPU is")


def check_config(cfg: GRPOLoopConfig) -> None:
    check_engine_device("grpo", cfg.engine.device)
    s = cfg.sampling
    if s.temperature <= 0:
        raise UserError("grpo: sampling.temperature must be > 0 (GRPO needs sampled groups and their log-probs)")
    if abs(s.temperature - cfg.loss.temperature) > 1e-9:
        raise UserError(f"grpo: sampling.temperature {s.temperature} != loss.temperature {cfg.loss.temperature}; "
                        "the learner must score tokens at the temperature they were sampled with")
    if s.top_p < 1.0 or s.top_k > 0:
        raise UserError("grpo: top_p / top_k filtering changes the behaviour log-probs the learner does not model; "
                        "set sampling.top_p = 1.0 and sampling.top_k = 0")
    if cfg.loop.async_rollouts and cfg.staleness.bound == 0:
        raise UserError("grpo: loop.async_rollouts samples every batch one version behind; staleness.bound = 0 "
                        "would mask every token (use bound >= 1, or -1 for none)")


class _IterationSink:
    """The pool's sink: finished trajectories into the data plane under the current iteration's name."""

    def __init__(self, catalog: str, store: str):
        self.catalog, self.store, self.current = catalog, store, None

    def start(self, name: str) -> None:
        from rollout.sink import DataPlaneSink

        self.close()
        self.current = DataPlaneSink(self.catalog, self.store, run=name)

    def put(self, finished) -> int:
        if self.current is None:
            raise RuntimeError("rollout sink: no iteration started")
        return self.current.put(finished)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


class GRPOLoop:
    """`postrain grpo` as an object: `run()` trains `iterations` iterations (in total, across resumes)."""

    def __init__(self, cfg: GRPOLoopConfig, domain: str, init: str | Path, out: str | Path, iterations: int,
                 chaos_seed: int | None = None, resume: bool = False, quiet: bool = False,
                 stop_after: int | None = None, storage=None):
        check_config(cfg)
        self.storage = storage  # deploy.run_storage.RunStorage of a URI run directory: checkpoints and reports go there too
        self.domains = [domain] if isinstance(domain, str) else list(domain)
        try:
            self.doms = [rewards.domain(d) for d in self.domains]
        except rewards.UnknownDomain as exc:
            raise UserError(str(exc)) from None
        if not self.domains or len(set(self.domains)) != len(self.domains):
            raise UserError(f"grpo: --domain {self.domains}: give each domain once")
        if len(self.domains) > 1 and cfg.loop.replay_share > 0:
            raise UserError("grpo: hard-prompt replay (loop.replay_share) works on one domain at a time")
        if iterations < 1:
            raise UserError("grpo: --iterations must be >= 1")
        domain = "+".join(self.domains)  # a mixture's name (`arith+reverse+calc`)
        self.cfg, self.domain, self.init, self.iterations = cfg, domain, resolve_checkpoint(init), iterations
        if stop_after is not None and not 1 <= stop_after <= iterations:
            raise UserError(f"grpo: --stop-after {stop_after} must lie in 1..--iterations ({iterations})")
        self.chaos_seed, self.quiet, self.stop_after = chaos_seed, quiet, stop_after
        self.t_start = time.monotonic()  # loop.time_budget_s counts from here
        self.out = Path(out)
        self._lock = lock_run_dir(self.out)  # held until the run ends (run_loop) or this object goes
        try:
            self._prepare_out(resume)
        except BaseException:
            self._lock.close()
            raise
        self.run = RunDir(self.out)
        self.run.save_config(cfg)
        self.catalog = cfg.loop.catalog or str(self.out / "dataplane" / "catalog.db")
        self.store = cfg.loop.store or str(self.out / "dataplane" / "store")
        self.batch_size = cfg.loop.prompts_per_iteration * cfg.loop.group_size
        self.replay = None
        if cfg.loop.replay_share > 0:
            from learner.prompt_replay import PromptReplay

            lp = cfg.loop  # the queue keeps 4 iterations' worth of prompts: older entries describe an older policy
            self.replay = PromptReplay(lp.replay_share, lp.replay_max, lp.replay_solved_below,
                                       capacity=4 * lp.prompts_per_iteration)
        self._drawn: dict[int, list] = {}  # iteration -> its requests (drawn once, in iteration order)
        self._observed = 0  # batches the replay queue has seen
        self._replayed: dict[int, dict] = {}  # iteration -> its replay metrics (replayed prompts, queue left)

    def _prepare_out(self, resume: bool) -> None:
        """A fresh run (OUT empty but for its lock) records its identity (deploy/run_records.py) in
        grpo_run.json; a resumed one must match it."""
        from deploy.run_lock import NAME as LOCK_NAME
        from deploy.run_records import check_resume, identity, identity_config, read_record
        from distill.teachers import weights_fingerprint

        meta_path = self.out / "grpo_run.json"
        fresh = all(p.name in (SERVICES_DIR, LOCK_NAME) for p in self.out.iterdir())  # OUT exists: it is locked
        config = identity_config(self.cfg)
        settings = identity(domain=self.domain, config=config, init=weights_fingerprint(self.init))
        if resume:
            if not meta_path.is_file():
                raise UserError(f"grpo: --resume but {self.out} holds no GRPO run (grpo_run.json missing)")
            old = read_record(meta_path, {"domain": str}, "start the run afresh in another --out")
            if old["domain"] != self.domain:
                raise UserError(f"grpo: {self.out} trains domain {old['domain']!r}, not {self.domain!r}")
            check_resume("grpo", meta_path, old.get("settings"), settings, config)
            return
        if not fresh:
            raise UserError(f"grpo: output directory {self.out} is not empty; pick a fresh --out or pass --resume")
        from core.atomic import write_atomic

        meta = {"domain": self.domain, "init": str(self.init), "settings": settings}
        write_atomic(meta_path, json.dumps(meta, indent=2).encode())

    # -- the run ---------------------------------------------------------------------------------------
    def run_loop(self) -> dict:
        import dataplane
        from learner.checkpoint import latest_checkpoint
        from learner.group import LearnerGroup
        from core.hf import load_policy
        from rollout.pool import RolloutPool

        cfg = self.cfg
        ckpt = latest_checkpoint(self.run.checkpoints) if self.run.checkpoints.exists() else None
        self.dp = dataplane.open(self.catalog, self.store)
        self.sink = _IterationSink(self.catalog, self.store)
        # A fresh rollout directory per start: WAL state of an interrupted attempt is not resumed across
        # checkpoints (its trajectories are either complete in the data plane, or re-sampled identically).
        starts = sorted((self.out / "rollout").glob("start-*")) if (self.out / "rollout").exists() else []
        pool_dir = self.out / "rollout" / (f"start-{int(starts[-1].name[6:]) + 1:03d}" if starts else "start-000")
        self.retention = None
        if not cfg.loop.keep_data:
            from deploy.retention import Retention

            self.retention = Retention(self.dp, self.out, self.run.checkpoints, cfg.loop.keep_iterations,
                                       cfg.loop.keep_checkpoints, keep_batches=self.replay is not None,
                                       batch_name=batch_name)
            self.retention.drop_earlier_starts(pool_dir)
        self.run_dir_mb_max = 0.0
        pool_init = str(Path(ckpt) / "model") if ckpt else str(self.init)
        self.pool = RolloutPool(pool_init, pool_dir, cfg.pool, cfg.engine, sink=self.sink,
                                max_tool_calls=cfg.sampling.max_tool_calls, use_tools=any(d.uses_tools for d in self.doms),
                                spares=cfg.loop.chaos_faults if self.chaos_seed is not None else 0)
        self.group = None
        try:
            self.group = LearnerGroup(cfg.learner_config(), str(self.init), num_cpus_per_rank=0)
            start = 0
            self.average = FinalAverage(cfg.loop.final, cfg.loop.ema_decay)
            if ckpt is not None:
                start = int(self.group.load_checkpoint(ckpt)["iteration"])
                if self.average.on and not self.average.resume(ckpt):
                    self.run.log(stage="ema", iteration=start, restarted=True)  # saved under another loop.final
                self._truncate_metrics(start)
                self._drop_incomplete_batches(start)
                self.pool.update_weights(self.group.weights(), self.group.policy_version)
            elif self.run.metrics_path.exists():  # resumed before the first checkpoint: start over
                self._truncate_metrics(-1)
                self._drop_incomplete_batches(0)
            self.eval_model, self.tok = load_policy(self.init)
            return self._iterate(start)
        finally:
            self.pool.close()
            if self.group is not None:
                self.group.close()
            self.sink.close()
            self.dp.close()
            self._lock.close()

    def _iterate(self, start: int) -> dict:
        from core.hf import save_policy
        from deploy.best_policy import BestPolicy

        lp = self.cfg.loop
        self.best = BestPolicy(self.out / "best", save=lp.final == "best",
                               write=lambda d: save_policy(self.eval_model, self.tok, d))
        self.best.resume([(r["iteration"], r["eval_pass_at_1"]) for r in self.run.read_metrics()
                          if r.get("stage") == "eval"], start)
        if start and self.best.exhausted(lp.patience):
            self.iterations = start  # it had ended on loop.patience: resuming it only writes final/
        last_eval = None
        if start == 0:
            last_eval = self._evaluate(0, self.group.weights())
            self.best.observe(0, last_eval["eval_pass_at_1"])
        roll, done = None, start
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if lp.async_rollouts else None
        try:
            for k in range(start, self.iterations):
                t0 = time.monotonic()
                if roll is None:  # not rolled out ahead: now (a partial batch of an interrupted attempt goes first)
                    requests = self._requests(k)  # drawn in order, whether or not it is rolled out
                    if not self._complete(k):
                        self._drop_batch(k)
                    roll = self._rollout(k, requests) if not self._complete(k) else {}
                ahead = None
                if executor is not None and k + 1 < self.iterations:
                    requests = self._requests(k + 1)  # drawn here, in order, whether or not it is rolled out
                    if not self._complete(k + 1):
                        self._drop_batch(k + 1)
                        ahead = executor.submit(self._rollout, k + 1, requests)
                t_train = time.monotonic()
                train = self._train(k)
                t1 = time.monotonic()
                weights, version = (self.group.publish() if train.get("optimizer_steps") else
                                    (self.group.weights(), self.group.policy_version))
                nxt = ahead.result() if ahead is not None else None
                self.average.update(weights)
                self.pool.update_weights(weights, version)
                self.dp.publish_policy_version(batch_name(k), version)
                self.run.log(stage="train", iteration=k + 1, policy_version=version, **roll, **self._replayed.pop(k, {}), **train,
                             train_s=round(t1 - t_train, 3), iteration_s=round(time.monotonic() - t0, 3),
                             run_dir_mb=self._run_dir_mb())
                done = k + 1
                if lp.time_budget_s and done < self.iterations and self._over_budget(time.monotonic() - t0):
                    self.iterations = done  # out of wall-clock budget: end here as at --iterations
                    self.run.log(stage="budget", iteration=done, time_budget_s=lp.time_budget_s)
                if (lp.eval_every and done % lp.eval_every == 0) or done == self.iterations:
                    last_eval = self._evaluate(done, weights)
                    self.best.observe(done, last_eval["eval_pass_at_1"])
                    if self.best.exhausted(lp.patience) and done < self.iterations:
                        self.iterations = done  # no new best for loop.patience evals: end here as at --iterations
                        self.run.log(stage="patience", iteration=done, best_iteration=self.best.iteration,
                                     best_pass_at_1=self.best.pass_at_1, patience=lp.patience)
                stop = done == self.stop_after
                if done % lp.checkpoint_every == 0 or done == self.iterations or stop:
                    saved = self.group.save_checkpoint(self.run.checkpoints, done, extra=self.average.extra())
                    self.best.after_checkpoint(done)
                    if self.retention is not None:
                        self.retention.after_checkpoint(done)
                    if self.storage is not None:
                        self.storage.publish_checkpoint(saved, keep=0 if lp.keep_data else lp.keep_checkpoints)
                roll = nxt
                if stop or done == self.iterations:
                    break
        finally:
            if executor is not None:
                executor.shutdown(wait=True)
        final = final_eval = None
        if done == self.iterations:
            self.eval_model.load_state_dict(self.average.final_weights(self.group.weights()))
            final = str(self.best.write_final(self.out / "final"))
            if self.average.on:  # final/ is no iterate the loop evaluated: evaluate it
                final_eval = self._evaluate(done, None, stage="final")
        self.run.plot("iteration", ["reward_mean", "solve_rate", "eval_pass_at_1"], "grpo.png",
                      title=f"GRPO on {self.domain}")
        disk = {"run_dir_mb": self._run_dir_mb(), "run_dir_mb_max": self.run_dir_mb_max,
                "keep_data": self.retention is None} | (self.retention.stats() if self.retention is not None else {})
        self.run.log(stage="disk", iteration=done, **disk)
        if self.storage is not None:
            if final:
                self.storage.publish_final(final)
            self.storage.publish_files()
        evals = [r for r in self.run.read_metrics() if r.get("stage") == "eval"]
        return {"out": str(self.out), "final": final, "iterations_done": done, "iterations": self.iterations,
                "best": {"iteration": self.best.iteration, "pass_at_1": self.best.value, "final": lp.final},
                "eval": [{"iteration": r["iteration"], "pass_at_1": r["eval_pass_at_1"]} for r in evals],
                "last_eval": last_eval, "final_eval": final_eval, **disk}

    def _run_dir_mb(self) -> float:
        """OUT's size on disk in MB (a catalog or store configured elsewhere is not counted)."""
        mb = round(self.run.disk_bytes() / 1e6, 3)
        self.run_dir_mb_max = max(self.run_dir_mb_max, mb)
        return mb

    def _over_budget(self, iteration_s: float) -> bool:
        """Would one more iteration (as long as the last, plus an eval) overrun loop.time_budget_s?"""
        return time.monotonic() - self.t_start + 2 * iteration_s > self.cfg.loop.time_budget_s

    # -- stages ------------------------------------------------------------------------------------------
    def _requests(self, k: int) -> list:
        """Iteration k's requests, drawn once: with prompt replay, after batches < k have been observed."""
        if k not in self._drawn:
            replayed = []
            if self.replay is not None:
                for j in range(self._observed, k):
                    self._requests(j)  # earlier draws take from the queue first (a resumed run rebuilds it)
                    self._observe(j)
                replayed = self.replay.take(self.cfg.loop.prompts_per_iteration)
                self._replayed[k] = {"replayed_prompts": len(replayed), "replay_queue": len(self.replay)}
            self._drawn[k] = make_requests(self.cfg, self.domains, k, replayed)
            self._drawn.pop(k - 2, None)
        return self._drawn[k]

    def _observe(self, j: int) -> None:
        """Batch j's groups into the replay queue (prompt index p{NNNN} of each trajectory id)."""
        sel = self.dp.select(run=batch_name(j), status=None)
        if len(sel) != self.batch_size:
            raise RuntimeError(f"grpo: prompt replay: batch {j} holds {len(sel)} of {self.batch_size} trajectories")
        prompts = [r.prompt for r in self._requests(j)[:: self.cfg.loop.group_size]]
        solved, count = np.zeros(len(prompts)), np.zeros(len(prompts))
        for traj_id, reward in zip(sel.ids, sel.reward):
            p = int(_PROMPT_INDEX.search(str(traj_id)).group(1))
            solved[p] += reward >= 1.0
            count[p] += 1
        self.replay.observe(prompts, (solved / np.maximum(count, 1)).tolist())
        self._observed = j + 1

    def _rollout(self, k: int, requests: list) -> dict:
        """Iteration k's P×G rollouts through the pool into the data plane; the pool's counters."""
        from chaos.pool_faults import PoolInjector
        from chaos.schedule import schedule

        t0 = time.monotonic()
        injector = None
        if self.chaos_seed is not None and self.cfg.loop.chaos_faults:
            seed = self.chaos_seed * 1_000_003 + k
            injector = PoolInjector(schedule(seed, self.cfg.pool.workers, self.cfg.loop.chaos_faults), seed=seed)
        before = self.pool.replacements  # cumulative over the pool's life: report this batch's
        self.sink.start(batch_name(k))
        res = self.pool.run(requests, injector)
        (self.out / "rollout").mkdir(parents=True, exist_ok=True)
        with open(self.out / "rollout" / "worker_nodes.jsonl", "a") as f:  # where each worker ran (Ray node ids)
            f.write(json.dumps({"iteration": k, "worker_nodes": res.worker_nodes}) + "\n")
        return rollout_row("grpo", k, len(requests), res, before, t0, injector, self.pool)

    def _complete(self, k: int) -> bool:
        return len(self.dp.select(run=batch_name(k), status=None)) == self.batch_size

    def _drop_batch(self, k: int) -> None:
        sel = self.dp.select(run=batch_name(k), status=None)
        if len(sel):
            self.dp.delete(list(sel.ids))

    def _drop_incomplete_batches(self, start: int) -> None:
        """After a resume from iteration `start`: batches past it, and an incomplete one at it, go."""
        for k in range(start, self.iterations + 1):
            if k > start or not self._complete(k):
                self._drop_batch(k)

    def _train(self, k: int) -> dict:
        """Advantages over whole groups from the catalog, a group-aware plan, one step per minibatch."""
        from learner.advantages import group_advantages

        cfg = self.cfg
        sel = self.dp.select(run=batch_name(k))
        if len(sel) != self.batch_size:
            raise RuntimeError(f"grpo: iteration {k}: {len(sel)} of {self.batch_size} trajectories in the data plane")
        reward_B = torch.from_numpy(np.asarray(sel.reward, dtype=np.float64))
        adv = group_advantages(reward_B, torch.from_numpy(np.asarray(sel.group)), std_normalise=cfg.advantages.std_normalise,
                               leave_one_out=cfg.advantages.leave_one_out,
                               filter_zero_variance=cfg.advantages.filter_zero_variance)
        stats = {"reward_mean": float(reward_B.mean()), "solve_rate": float((reward_B >= 1.0).double().mean()),
                 "length_mean": float(np.mean(sel.length)), "groups": adv.groups,
                 "zero_variance_groups": adv.zero_variance_groups}
        keep = adv.keep_B.numpy()
        if not keep.any():
            return stats | {"optimizer_steps": 0, "trained_trajectories": 0}
        sub = subset(sel, keep)
        ranks = cfg.learner.ranks
        longest = int(sub.length.max())
        # loop.minibatches sets each step's share; packing keeps whole groups, so a step may hold a little more or less.
        budget = cfg.loop.tokens_per_rank or max(longest, math.ceil(sub.num_tokens / (ranks * cfg.loop.minibatches)))
        if budget < longest:
            raise UserError(f"grpo: loop.tokens_per_rank {budget} is below the longest trajectory ({longest} tokens); "
                            "the learner trains whole trajectories")
        plan = self.dp.plan(sub, tokens_per_rank=budget, ranks=ranks, seed=cfg.loop.seed, epoch=k, group_aware=True)
        ids = [str(i) for i in sel.ids]
        advantages = dict(zip(ids, adv.advantages_B.tolist()))
        versions = dict(zip(ids, (int(v) for v in sel.policy_min)))
        steps = [self.group.train_plan_step(plan, m, advantages, versions) for m in range(plan.num_minibatches)]
        learner = {key: float(np.mean([s.get(key, 0.0) for s in steps])) for key in steps[-1]
                   if key not in ("step", "lr")}
        for key in ("tokens", "loss_tokens", "seqs"):
            learner[key] = float(sum(s.get(key, 0.0) for s in steps))
        learner |= {"lr": steps[-1]["lr"], "optimizer_step": int(steps[-1]["step"])}
        return stats | learner | {"optimizer_steps": len(steps), "trained_trajectories": int(keep.sum())}

    def _evaluate(self, iteration: int, weights: dict | None, stage: str = "eval") -> dict:
        """Greedy pass@1 of `weights` (None: the eval model as it is), logged as a `stage` row."""
        from learner.evaluate import evaluate

        t0 = time.monotonic()
        if weights is not None:
            self.eval_model.load_state_dict(weights)
        res = {d: evaluate(self.eval_model, self.tok, d, self.cfg.eval) for d in self.domains}
        if len(self.domains) == 1:
            r = res[self.domains[0]]
            row = {"eval_pass_at_1": r["pass_at_1"], "eval_mean_reward": r["mean_reward"], "eval_n": r["n"]}
        else:  # a mixture: every domain's pass@1, and the worst as eval_pass_at_1
            row = {f"eval_pass_at_1_{d}": r["pass_at_1"] for d, r in res.items()}
            row |= {"eval_pass_at_1": min(row.values()), "eval_n": self.cfg.eval.n}
        self.run.log(stage=stage, iteration=iteration, **row, eval_s=round(time.monotonic() - t0, 3))
        if not self.quiet:
            shown = "  ".join(f"{d} {r['pass_at_1']:.3f}" for d, r in res.items())
            what = f"iteration {iteration}" if stage == "eval" else f"{stage}/ ({self.cfg.loop.final})"
            print(f"grpo {self.domain} {what}: eval pass@1 {shown} (n={self.cfg.eval.n})", flush=True)
        return row

    def _truncate_metrics(self, start: int) -> None:
        """Drop metric rows of iterations after the checkpoint (they are run again)."""
        from core.atomic import write_atomic

        rows = [r for r in self.run.read_metrics() if r.get("iteration", 0) <= start]
        write_atomic(self.run.metrics_path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def run_grpo(cfg: GRPOLoopConfig, domain: str, init: str | Path, out: str | Path, iterations: int,
             chaos_seed: int | None = None, resume: bool = False, quiet: bool = False,
             stop_after: int | None = None, storage=None) -> dict:
    return GRPOLoop(cfg, domain, init, out, iterations, chaos_seed, resume, quiet, stop_after, storage).run_loop()
