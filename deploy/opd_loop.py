"""The OPD loop: the student samples a mixture of domains → verify → teacher prefill into the cache →
teacher-ordered plan → learner group → publish weights → repeat; every k iterations pass@1 on every
domain.

One iteration k:
  1. P prompts of every domain's train split (shares by `loop.domain_weights`, a pure function of
     loop.seed and k) go to the Ray rollout pool with the student's weights; workers verify each
     finished trajectory (reward logged as a metric; the loss does not use it) and the pool puts it
     into the data plane as run `it{k}` (its catalog meta holds the hash of its tokens).
  2. Teacher workers prefill every trajectory with each teacher of its domain; last-layer hidden states
     go into the cache rows of run `it{k}.cache` (distill/cache.py). Rows already durable are not
     recomputed; cache shard files that fail their checksum are dropped and recomputed.
  3. Every cache row's record is checked against the run's teachers and the trajectory's tokens; a
     mismatch is an error. The rows are planned into `loop.minibatches` teacher-ordered minibatches,
     one optimizer step each (distill/opd_learner.py); one teacher head resident at a time.
  4. The learner group publishes policy version v+1 to the pool.

With `loop.async_rollouts` batch k+1 is rolled out (in a thread driving the Ray pool) while the
teachers prefill batch k and the learner trains on it: its tokens are sampled one policy version behind
(`staleness_max` in the train row), its mixture follows the KL that iteration k-1 logged, and weights
reach the workers between rollout batches only. A checkpoint is written once the batch after it is
complete, so a resumed run finds that batch as the uninterrupted run sampled it.

Resume: from `OUT/checkpoints/latest`, as `postrain grpo` (the same teacher set is required). A URI run
directory (deploy/run_storage.py) is laid out as grpo's: checkpoints, final/ and the run files are published
there, the data plane's shards (the teacher hidden-state cache among them) are written there directly, and
the student and teachers may be URIs of committed checkpoints (downloaded, every file checked). Prompts
and sampling are pure functions of (seed, iteration, trajectory id, position) and, in strict mode, so
are prefill and training: a resumed or chaos run repeats the calm run's metrics.
"""
from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import rewards
from core.errors import UserError
from core.hf import resolve_checkpoint
from core.rundir import RunDir
from core.rundir import SERVICES_DIR
from dataplane.remote import is_uri
from deploy.rollout_row import rollout_row
from deploy.final_average import FinalAverage
from deploy.grpo_loop import _IterationSink, batch_name, check_engine_device
from deploy.mixture import domain_kl, domain_shares, kl_weights
from deploy.opd_config import OPDLoopConfig
from deploy.run_lock import lock_run_dir
from deploy.run_storage import local_checkpoint
from distill.cache import CacheMismatch, CacheRecord, cache_run, check
from distill.teachers import Teacher, resolve_teachers, table_entries

TIMING_KEYS = ("time_s", "rollout_s", "prefill_s", "train_s", "eval_s", "step_time_s", "iteration_s",
               "teacher_eval_s")


def make_requests(cfg: OPDLoopConfig, domains: list[str], iteration: int,
                  weights: dict[str, float] | None = None) -> list:
    """Iteration `iteration`'s prompts: `weights` (else `loop.domain_weights`) share them among `domains`."""
    from rollout.sampling import SamplingParams
    from rollout.types import Request

    s, lp = cfg.sampling, cfg.loop
    out = []
    shares = domain_shares(lp.prompts_per_iteration, domains, lp.domain_weights if weights is None else weights)
    for di, (domain, n) in enumerate(shares.items()):
        dom = rewards.domain(domain)
        params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_new_tokens=s.max_new_tokens, stop=("</call>",) if dom.uses_tools else ())
        prompts = dom.prompts("train", n, lp.seed * 1_000_003 + iteration * 101 + di) if n else []
        out += [Request(f"{domain}-{batch_name(iteration)}-p{j:04d}-g{g:03d}", domain, p, params)
                for j, p in enumerate(prompts) for g in range(lp.samples_per_prompt)]
    return out


def check_config(cfg: OPDLoopConfig) -> None:
    check_engine_device("opd", cfg.engine.device)
    s = cfg.sampling
    if s.temperature <= 0:
        raise UserError("opd: sampling.temperature must be > 0 (the student samples its own trajectories)")
    if abs(s.temperature - cfg.opd.temperature) > 1e-9:
        raise UserError(f"opd: sampling.temperature {s.temperature} != opd.temperature {cfg.opd.temperature}; "
                        "the loss must compare the distributions the student sampled from")
    if cfg.opd.loss == "sampled_token" and (s.top_p < 1.0 or s.top_k > 0):
        raise UserError("opd: the sampled_token loss needs unfiltered sampling (sampling.top_p = 1, top_k = 0)")


class OPDLoop:
    """`postrain opd` as an object: `run_loop()` trains `iterations` iterations (in total, across resumes)."""

    def __init__(self, cfg: OPDLoopConfig, student: str | Path, teacher_args: list[tuple[str, str, float]],
                 out: str | Path, iterations: int, chaos_seed: int | None = None, resume: bool = False,
                 quiet: bool = False, stop_after: int | None = None, storage=None):
        check_config(cfg)
        if iterations < 1:
            raise UserError("opd: --iterations must be >= 1")
        if stop_after is not None and not 1 <= stop_after <= iterations:
            raise UserError(f"opd: --stop-after {stop_after} must lie in 1..--iterations ({iterations})")
        self.cfg, self.iterations, self.chaos_seed, self.quiet, self.stop_after = cfg, iterations, chaos_seed, quiet, stop_after
        self.t_start = time.monotonic()
        self.storage = storage  # deploy.run_storage.RunStorage of a URI run directory: checkpoints and run files go there too
        self.student = resolve_checkpoint(local_checkpoint(student))
        self.student_source = str(student) if is_uri(student) else str(self.student)
        known = rewards.domains()
        entries = table_entries(cfg.opd.teachers) + list(teacher_args)
        specs = [p for _, p, _ in entries]  # as given: a URI names its teacher across machines, a staging path does not
        entries = [(d, local_checkpoint(p) if d in known else p, w) for d, p, w in entries]
        for d in cfg.loop.domains:
            if d not in known:
                raise UserError(f"opd: unknown domain {d!r} in loop.domains; known: {', '.join(known)}")
        self.domains = list(cfg.loop.domains) or [d for d in known if d in {e[0] for e in entries}]
        if not self.domains:
            raise UserError("opd: no teachers given: pass --teacher DOMAIN=DIR (one per domain) or [opd.teachers]")
        self.teachers = resolve_teachers(entries, self.student, self.domains, known)
        self.sources = {t.name: spec if is_uri(spec) else t.path for t, spec in zip(self.teachers, specs)}
        self.teachers = [t for t in self.teachers if t.domain in self.domains]
        self.by_name = {t.name: t for t in self.teachers}
        domain_shares(cfg.loop.prompts_per_iteration, self.domains, cfg.loop.domain_weights)  # checks the weights
        kl_weights(self.domains, {}, cfg.loop.mixture_floor if cfg.loop.mixture == "kl" else 0.0)  # checks the floor
        self.out = Path(out)
        self._lock = lock_run_dir(self.out)  # held until the run ends (run_loop) or this object goes
        try:
            self.run_id = self._prepare_out(resume)
        except BaseException:
            self._lock.close()
            raise
        self.run = RunDir(self.out)
        self.run.save_config(cfg)
        self.catalog = cfg.loop.catalog or str(self.out / "dataplane" / "catalog.db")
        self.store = cfg.loop.store or str(self.out / "dataplane" / "store")

    def _prepare_out(self, resume: bool) -> str:
        """A fresh run (OUT empty but for its lock) records its teachers and identity (deploy/run_records.py)
        in opd_run.json; a resumed one must match both."""
        from core.atomic import write_atomic
        from deploy.run_lock import NAME as LOCK_NAME
        from deploy.run_records import check_resume, identity, identity_config, read_record
        from distill.teachers import weights_fingerprint

        meta_path = self.out / "opd_run.json"
        teachers = [{k: t.to_json()[k] for k in ("name", "domain", "weight", "fingerprint")} | {"path": self.sources[t.name]}
                    for t in self.teachers]
        fresh = all(p.name in (SERVICES_DIR, LOCK_NAME) for p in self.out.iterdir())  # OUT exists: it is locked
        config = identity_config(self.cfg)
        settings = identity(config=config, student=weights_fingerprint(self.student), domains=self.domains)
        if resume:
            if not meta_path.is_file():
                raise UserError(f"opd: --resume but {self.out} holds no OPD run (opd_run.json missing)")
            old = read_record(meta_path, {"run_id": str, "teachers": list}, "start the run afresh in another --out")
            if [_without_path(t) for t in old["teachers"]] != [_without_path(t) for t in teachers]:
                raise UserError(f"opd: {self.out} was trained with other teachers ({[t.get('name', '?') + ' ' + str(t.get('path')) for t in old['teachers'] if isinstance(t, dict)]}); "
                                "--resume needs the same teacher set (domains, weights and weights fingerprints)")
            check_resume("opd", meta_path, old.get("settings"), settings, config)
            if old["teachers"] != teachers:  # the same weights found elsewhere (a moved run directory): recorded there
                write_atomic(meta_path, json.dumps(old | {"teachers": teachers}, indent=2).encode())
            return old["run_id"]
        if not fresh:
            raise UserError(f"opd: output directory {self.out} is not empty; pick a fresh --out or pass --resume")
        run_id = uuid.uuid4().hex
        write_atomic(meta_path, json.dumps({"run_id": run_id, "student": self.student_source, "domains": self.domains,
                                            "teachers": teachers, "settings": settings}, indent=2).encode())
        return run_id

    # -- the run ---------------------------------------------------------------------------------------
    def run_loop(self) -> dict:
        import dataplane
        from core.hf import load_policy
        from distill.opd_learner import opd_learner
        from distill.prefill import Prefillers
        from learner.checkpoint import latest_checkpoint
        from learner.group import LearnerGroup
        from rollout.pool import RolloutPool

        cfg = self.cfg
        ckpt = latest_checkpoint(self.run.checkpoints) if self.run.checkpoints.exists() else None
        self.dp = dataplane.open(self.catalog, self.store)
        self.sink = _IterationSink(self.catalog, self.store)
        starts = sorted((self.out / "rollout").glob("start-*")) if (self.out / "rollout").exists() else []
        pool_dir = self.out / "rollout" / f"start-{len(starts):03d}"
        pool_init = str(Path(ckpt) / "model") if ckpt else str(self.student)
        self.pool = RolloutPool(pool_init, pool_dir, cfg.pool, cfg.engine, sink=self.sink,
                                max_tool_calls=cfg.sampling.max_tool_calls,
                                use_tools=any(rewards.domain(d).uses_tools for d in self.domains),
                                spares=cfg.loop.chaos_faults if self.chaos_seed is not None else 0)
        self.group = self.prefill = None
        try:
            self.prefill = Prefillers(cfg.opd.teacher_workers, threads=1,
                                      batch_tokens=1 if cfg.engine.strict else cfg.opd.prefill_batch_tokens,
                                      num_cpus=cfg.opd.teacher_cpus, num_gpus=cfg.opd.teacher_gpus)
            self.group = LearnerGroup(cfg.learner_config(), str(self.student), num_cpus_per_rank=0,
                                      make_learner=opd_learner)
            self.group.learner_call("set_teachers", self.teachers)
            start = 0
            self.average = FinalAverage(cfg.loop.final, cfg.loop.ema_decay)
            if ckpt is not None:
                start = int(self.group.load_checkpoint(ckpt)["iteration"])
                if self.average.on and not self.average.resume(ckpt):
                    self.run.log(stage="ema", iteration=start, restarted=True)  # saved under another loop.final
                self._truncate_metrics(start)
                self._drop_batches_after(start)
                self.pool.update_weights(self.group.weights(), self.group.policy_version)
            elif self.run.metrics_path.exists():
                self._truncate_metrics(-1)
                self._drop_batches_after(0)
            self.eval_model, self.tok = load_policy(self.student)
            self.teacher_pass = self._teacher_evals()
            if self.storage is not None:  # the run's record before its first checkpoint
                self.storage.publish_files()
            return self._iterate(start)
        finally:
            self.pool.close()
            if self.prefill is not None:
                self.prefill.close()
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
        self.teacher_best = {d: max((self.teacher_pass.get(t.name, 0.0) for t in self.teachers if t.domain == d),
                                    default=0.0) for d in self.domains}  # each domain's best teacher, own pass@1
        self.best.resume([(r["iteration"], r["eval_retention_min"]) for r in self.run.read_metrics()
                          if r.get("stage") == "eval" and "eval_retention_min" in r], start)
        last_eval = self._evaluate(0, self.group.weights()) if start == 0 else None
        self._kl_rows: dict[int, dict] = {0: {}}  # train rows by the iteration they logged, as `_mixture` reads them
        done, batch = start, None  # batch: (requests, mixture, rollout row) of the iteration about to train
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if lp.async_rollouts else None
        try:
            for k in range(start, self.iterations):
                t0 = time.monotonic()
                if batch is None:  # not rolled out ahead: now (a partial batch of an interrupted attempt goes first)
                    requests, mix, todo = self._batch(k)
                    batch = (requests, mix, self._rollout(k, requests) if todo else {})
                requests, mix, roll = batch
                ahead = None
                if executor is not None and k + 1 < self.iterations:  # batch k+1 samples while k trains
                    nxt_requests, nxt_mix, todo = self._batch(k + 1)
                    ahead = (nxt_requests, nxt_mix, executor.submit(self._rollout, k + 1, nxt_requests) if todo else None)
                sampled = self._sampled(k, requests)
                cache = self._fill(k, sampled)
                t_train = time.monotonic()
                train = self._train(k, sampled)
                shares = domain_shares(lp.prompts_per_iteration, self.domains, mix) if mix else {}
                train |= {f"prompts_{d}": n for d, n in shares.items()}  # the row a later mixture reads
                self._kl_rows = {k + 1: train}
                t1 = time.monotonic()
                weights, version = self.group.publish()
                batch = None
                if ahead is not None:  # its rollout done before the weights change
                    batch = (ahead[0], ahead[1], ahead[2].result() if ahead[2] is not None else {})
                self.average.update(weights)
                self.pool.update_weights(weights, version)
                self.dp.publish_policy_version(batch_name(k), version)
                rewards_by_domain = {}
                for s in sampled:
                    rewards_by_domain.setdefault(s.domain, []).append(s.reward)
                self.run.log(stage="train", iteration=k + 1, policy_version=version, **roll, **cache, **train,
                             **{f"reward_{d}": float(np.mean(r)) for d, r in sorted(rewards_by_domain.items())},
                             train_s=round(t1 - t_train, 3), iteration_s=round(time.monotonic() - t0, 3))
                done = k + 1
                if lp.time_budget_s and done < self.iterations and self._over_budget(time.monotonic() - t0):
                    self.iterations = done
                    self.run.log(stage="budget", iteration=done, time_budget_s=lp.time_budget_s)
                if (lp.eval_every and done % lp.eval_every == 0) or done == self.iterations:
                    last_eval = self._evaluate(done, weights)
                stop = done == self.stop_after
                if done % lp.checkpoint_every == 0 or done == self.iterations or stop:
                    saved = self.group.save_checkpoint(self.run.checkpoints, done,  # batch `done` is complete by now
                                                       extra=self.average.extra())
                    self.best.after_checkpoint(done)
                    self._reclaim(done)
                    if self.storage is not None:  # every checkpoint is kept, as in a local run directory
                        self.storage.publish_checkpoint(saved)
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
        self.plot()
        if self.storage is not None:
            if final:
                self.storage.publish_final(final)
            self.storage.publish_files()
        evals = [r for r in self.run.read_metrics() if r.get("stage") == "eval"]
        return {"out": str(self.out), "final": final, "iterations_done": done, "iterations": self.iterations,
                "teachers": {t.name: t.path for t in self.teachers}, "teacher_pass_at_1": self.teacher_pass,
                "eval": evals, "last_eval": last_eval, "final_eval": final_eval,
                "best": {"iteration": self.best.iteration, "retention_min": self.best.value, "final": lp.final}}

    def _batch(self, k: int) -> tuple[list, dict[str, float] | None, bool]:
        """Batch k's requests, the mixture they were drawn from, and whether the batch still has to be rolled
        out (an incomplete batch of an interrupted attempt is dropped first)."""
        mix = self._mixture(k)
        requests = make_requests(self.cfg, self.domains, k, mix)
        if self._complete(k, len(requests)):
            return requests, mix, False
        self._drop(batch_name(k))
        return requests, mix, True

    def _mixture(self, k: int) -> dict[str, float] | None:
        """Batch k's domain weights under `loop.mixture = "kl"` (None: the fixed `domain_weights`): from the
        per-teacher KL of the last train row logged before batch k is drawn: iteration k-1's, or k-2's when
        batch k is rolled out one step ahead (`loop.async_rollouts`). A resumed run reads that row back from
        metrics.jsonl (JSON keeps the floats exact), so it draws what the uninterrupted run drew."""
        lp = self.cfg.loop
        if lp.mixture != "kl":
            return None
        logged = max(0, k - 1 if lp.async_rollouts else k)  # the `iteration` of the row that KL comes from
        row = self._kl_rows.get(logged)
        if row is None:  # a resumed run: the row that iteration logged, read back once
            row = next((r for r in self.run.read_metrics()
                        if r.get("stage") == "train" and r.get("iteration") == logged), {})
            self._kl_rows[logged] = row
        kl = domain_kl(row, [(t.name, t.domain, t.weight) for t in self.teachers], self.domains,
                       lp.mixture_kl, lp.samples_per_prompt)
        return kl_weights(self.domains, kl, lp.mixture_floor)

    def _over_budget(self, iteration_s: float) -> bool:
        return time.monotonic() - self.t_start + 2 * iteration_s > self.cfg.loop.time_budget_s

    # -- stages ------------------------------------------------------------------------------------------
    def _rollout(self, k: int, requests: list) -> dict:
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
        return rollout_row("opd", k, len(requests), res, before, t0, injector, self.pool)

    def _complete(self, k: int, n: int) -> bool:
        return len(self.dp.select(run=batch_name(k), status=None)) == n

    def _drop(self, run: str) -> None:
        sel = self.dp.select(run=run, status=None)
        if len(sel):
            self.dp.delete(list(sel.ids))

    def _drop_batches_after(self, start: int) -> None:
        """After a resume from iteration `start`: rollouts and cache rows of later iterations go; the batch
        at `start` stays when complete (the checkpoint's policy sampled it), with whatever of its cache is
        durable (checked, and completed, before training)."""
        n = len(make_requests(self.cfg, self.domains, start))
        for k in range(start, self.iterations + 1):
            if k > start or not self._complete(k, n):
                self._drop(batch_name(k))
                self._drop(cache_run(batch_name(k)))

    def _sampled(self, k: int, requests: list) -> list:
        """Batch k's trajectories from the data plane (tokens, mask, behaviour log-probs, token hash)."""
        from distill.prefill import Sampled

        asked = {r.traj_id: r for r in requests}
        sel = self.dp.select(run=batch_name(k))
        hashes = self.dp.meta(sel.ids)
        version = dict(zip(sel.ids.tolist(), sel.policy_min.tolist()))
        plan = self.dp.plan(sel, tokens_per_rank=max(1, sel.num_tokens), ranks=1)  # one pass over the batch
        out = []
        for b in self.dp.loader(plan, rank=0, prefetch=0):
            cu = b.cu_seqlens.tolist()
            for j, traj in enumerate(b.traj_ids):
                lo, hi = cu[j], cu[j + 1]
                if traj not in hashes:
                    raise UserError(f"opd: trajectory {traj!r} has no token hash in the catalog; was it written by an "
                                    "older postrain? start a fresh --out")
                if traj not in asked:
                    raise UserError(f"opd: the data plane holds trajectory {traj!r} that iteration {k} did not ask "
                                    "for; is another run writing into this catalog?")
                out.append(Sampled(traj, asked[traj].domain, asked[traj].prompt,
                                   b.input_ids[lo:hi].numpy().astype(np.int32),
                                   b.loss_mask[lo:hi].numpy().astype(np.uint8), b.logprobs[lo:hi].numpy().copy(),
                                   hashes[traj]["tokens_hash"], int(version[traj]), float(b.reward[j])))
        return sorted(out, key=lambda s: s.traj_id)

    def _fill(self, k: int, sampled: list) -> dict:
        from distill.prefill import damaged_rows, fill_cache

        run = cache_run(batch_name(k))
        bad = damaged_rows(self.dp, run)
        if bad:
            self.dp.delete(bad)
            if not self.quiet:
                print(f"opd iteration {k}: {len(bad)} cache rows in damaged shard files are recomputed", flush=True)
        res = fill_cache(self.dp, batch_name(k), sampled, self.teachers, self.prefill, run_id=self.run_id,
                         dtype=self.cfg.opd.cache_dtype)
        return res | {"cache_rows_recomputed_corrupt": len(bad), "cache_bytes": self._cache_bytes(run)}

    def _cache_bytes(self, run: str) -> int:
        sel = self.dp.select(run=run, status=None)
        sizes = {p: b for _, p, _, b, _ in self.dp.catalog.shard_rows()}
        return int(sum(sizes.get(p, 0) for p in sel.shard_paths))

    def _check_cache(self, plan, sampled: list) -> dict[str, str]:
        """Every planned cache row's record against the run's teachers and its trajectory; the tokens hash
        each row must hold (the learner checks the loaded tokens against it)."""
        want = {s.traj_id: s.tokens_hash for s in sampled}
        metas = self.dp.meta(plan.ids)
        hashes = {}
        for i, row in enumerate(plan.ids.tolist()):
            name = plan.teachers[plan.teacher[i]] if plan.teachers else ""
            teacher: Teacher | None = self.by_name.get(name)
            if teacher is None:
                raise CacheMismatch(f"cache row {row!r}: teacher {name!r} is not one of this run's {sorted(self.by_name)}")
            rec = CacheRecord.from_meta(metas.get(row), row)
            if rec.traj not in want:
                raise CacheMismatch(f"cache row {row!r}: trajectory {rec.traj!r} is not in this batch (another run)")
            check(rec, row_id=row, run_id=self.run_id, teacher=name, fingerprint=teacher.fingerprint,
                  dtype=self.cfg.opd.cache_dtype, length=int(plan.length[i]), tokens_hash=want[rec.traj],
                  hidden_size=teacher.hidden_size)
            hashes[row] = rec.tokens_hash
        return hashes

    def _train(self, k: int, sampled: list) -> dict:
        from distill.opd_learner import plan_iteration

        cfg = self.cfg
        sel = self.dp.select(run=cache_run(batch_name(k)))
        plan = plan_iteration(self.dp, sel, cfg.learner.ranks, cfg.loop.minibatches, seed=cfg.loop.seed, epoch=k)
        hashes = self._check_cache(plan, sampled)
        steps = [self.group.learner_call("plan_step", plan, m, hashes) for m in range(plan.num_minibatches)]
        out = {key: float(np.mean([s[key] for s in steps])) for key in ("loss", "kl", "grad_norm", "step_time_s")}
        for t in self.teachers:  # per-teacher KL over the iteration, weighted by the positions of each step
            w = [s.get(f"positions_{t.name}", 0.0) for s in steps]
            if sum(w):
                out[f"kl_{t.name}"] = float(np.dot(w, [s.get(f"kl_{t.name}", 0.0) for s in steps]) / sum(w))
                out[f"positions_{t.name}"] = float(sum(w))
        out |= {"lr": steps[-1]["lr"], "optimizer_step": int(steps[-1]["step"]), "optimizer_steps": len(steps),
                "tokens": float(sum(s["tokens"] for s in steps)),
                "loss_positions": float(sum(s["loss_positions"] for s in steps)),
                "head_loads": float(sum(s["head_loads"] for s in steps)),
                "head_loads_per_minibatch_max": float(max(s["head_loads"] for s in steps)),
                "max_resident_heads": float(max(s["max_resident_heads"] for s in steps)),
                "staleness_max": float(max(0, self.group.policy_version - min(s.policy_version for s in sampled)))}
        return out

    def _reclaim(self, done: int) -> None:
        """Once a checkpoint covers iteration `done`, drop the data of iterations older than the kept ones."""
        keep = self.cfg.loop.keep_iterations
        if not keep:
            return
        for k in range(0, max(0, done - keep)):
            for run in (batch_name(k), cache_run(batch_name(k))):
                self._drop(run)
        self.dp.gc(min_age_s=0.0)

    def _evaluate(self, iteration: int, weights: dict | None, stage: str = "eval") -> dict:
        """Greedy pass@1 of `weights` (None: the eval model as it is) on every domain, logged as a `stage`
        row; an eval row also counts towards loop.final = "best"."""
        from learner.evaluate import evaluate

        t0 = time.monotonic()
        if weights is not None:
            self.eval_model.load_state_dict(weights)
        row = {}
        for d in self.domains:
            res = evaluate(self.eval_model, self.tok, d, self.cfg.eval)
            row[f"eval_pass_at_1_{d}"] = res["pass_at_1"]
        row["eval_pass_at_1_min"] = min(row.values())
        kept = [row[f"eval_pass_at_1_{d}"] / self.teacher_best[d] for d in self.domains if self.teacher_best[d] > 0]
        if kept:  # the student over the best of its teachers, on the domain it keeps least of
            row["eval_retention_min"] = min(kept)
        self.run.log(stage=stage, iteration=iteration, **row, eval_n=self.cfg.eval.n, eval_s=round(time.monotonic() - t0, 3))
        if "eval_retention_min" in row and stage == "eval":
            self.best.observe(iteration, row["eval_retention_min"])
        if not self.quiet:
            shown = "  ".join(f"{d} {row[f'eval_pass_at_1_{d}']:.3f}" for d in self.domains)
            what = f"iteration {iteration}" if stage == "eval" else f"{stage}/ ({self.cfg.loop.final})"
            print(f"opd {what}: eval pass@1 {shown} (n={self.cfg.eval.n})", flush=True)
        return row

    def _teacher_evals(self) -> dict[str, float]:
        """Each teacher's own greedy pass@1 on its domain (kept in OUT/teacher_eval.json by fingerprint)."""
        from core.atomic import write_atomic
        from core.hf import load_policy
        from learner.evaluate import evaluate

        path = self.out / "teacher_eval.json"
        known = json.loads(path.read_text()) if path.is_file() else {}
        out = {}
        for t in self.teachers:
            key = f"{t.fingerprint}:{t.domain}:{self.cfg.eval.n}:{self.cfg.eval.seed}"
            if key not in known:
                t0 = time.monotonic()
                model, tok = load_policy(t.path)
                known[key] = evaluate(model, tok, t.domain, self.cfg.eval)["pass_at_1"]
                self.run.log(stage="teacher_eval", teacher=t.name, domain=t.domain, pass_at_1=known[key],
                             teacher_eval_s=round(time.monotonic() - t0, 3))
                write_atomic(path, json.dumps(known, indent=2).encode())
            out[t.name] = known[key]
        return out

    def _truncate_metrics(self, start: int) -> None:
        from core.atomic import write_atomic

        rows = [r for r in self.run.read_metrics()
                if r.get("stage") == "teacher_eval" or r.get("iteration", 0) <= start]
        write_atomic(self.run.metrics_path, "".join(json.dumps(r) + "\n" for r in rows).encode())

    def plot(self) -> Path | None:
        """opd.png: per-domain pass@1 against wall time, each teacher's own pass@1 dashed."""
        rows = [r for r in self.run.read_metrics() if r.get("stage") == "eval"]
        if not rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(self.domains), figsize=(4.2 * len(self.domains), 3.2), squeeze=False)
        for ax, d in zip(axes[0], self.domains):
            pts = [(r["time_s"] / 60, r[f"eval_pass_at_1_{d}"]) for r in rows if f"eval_pass_at_1_{d}" in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label="student")
            for t in self.teachers:
                if t.domain == d and t.name in self.teacher_pass:
                    ax.axhline(self.teacher_pass[t.name], ls="--", color="gray", label=f"teacher {t.name}")
            ax.set_title(f"{d}: greedy pass@1")
            ax.set_xlabel("wall time (min)")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
        fig.suptitle("OPD: student against each teacher")
        fig.tight_layout()
        out = self.out / "opd.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out


def run_opd(cfg: OPDLoopConfig, student, teacher_args, out, iterations: int, chaos_seed=None, resume=False,
            quiet=False, stop_after=None, storage=None) -> dict:
    return OPDLoop(cfg, student, teacher_args, out, iterations, chaos_seed, resume, quiet, stop_after,
                   storage).run_loop()


def _without_path(teacher) -> object:
    """A recorded teacher as its identity: where its weights lie is not part of it (a run directory holding its
    teachers can move), its fingerprint is."""
    return {k: v for k, v in teacher.items() if k != "path"} if isinstance(teacher, dict) else teacher
