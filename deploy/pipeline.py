"""`postrain pipeline`: SFT → one GRPO specialist per domain → OPD merge → evaluate → report, as one
resumable job in `runs/NAME/`.

Each stage runs its own `postrain` command as a child process (which dies with the pipeline) and
writes its outputs under `RUN/<stage>/`, then, last and atomically, a manifest (deploy/manifest.py).
A rerun keeps every stage whose manifest still matches its settings, inputs and outputs; a stage that
runs again makes every later stage run again. Inside an interrupted stage the work continues from the
stage's latest checkpoint: a specialist or the merge resumes its run (`--resume`), a finished
specialist is kept; SFT, which has no checkpoints, starts over.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import rewards
from core import config
from core.atomic import write_atomic
from core.cli_args import run_name_problem
from core.digest import sha256_tree
from core.errors import UserError
from core.rundir import last_metrics
from deploy import manifest
from deploy.run_lock import NAME as LOCK_NAME, lock_run_dir
from deploy.run_records import read_record
from deploy.pipeline_config import STAGES, PipelineConfig
from deploy.shared_ray import shared_ray
from distill.teachers import table_entries

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _die_with_parent() -> None:  # runs in the child between fork and exec: no Python objects touched
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def config_path(name: str) -> Path:
    p = Path(name)
    return p if p.is_file() else CONFIGS / name


def refuse_uri(what: str, value: str | Path) -> None:
    """The pipeline hands its stages paths inside RUNS/NAME: a URI is one error saying what takes one."""
    from dataplane.remote import is_uri

    if is_uri(value):
        raise UserError(f"pipeline: {what} {value} is a pyarrow.fs URI, which the pipeline does not take; give a path "
                        "(on a cluster, one every node mounts), or run `postrain grpo` / `opd` / `rollout` with "
                        "--out URI stage by stage")


class Pipeline:
    def __init__(self, cfg: PipelineConfig, name: str, runs: str | Path = "runs", chaos: int | None = None,
                 quick: bool = False, force: bool = False, quiet: bool = False, progress: bool | None = None):
        refuse_uri("--runs", runs)
        refuse_uri("merge.init", cfg.merge.init)
        if quick and cfg.quick:
            cfg = config.build(PipelineConfig, config.merge(cfg.model_dump(exclude={"quick"}), cfg.quick), "[quick]")
        problem = run_name_problem(name)
        if problem:
            raise UserError(f"pipeline: the run name {problem}")
        self.cfg, self.name, self.chaos, self.quick, self.quiet = cfg, name, chaos, quick, quiet
        self.run_dir = Path(runs) / name
        self.live = progress if progress is not None else (sys.stderr.isatty() and not quiet)
        self._check()
        self._claim(force)

    # -- checks before any stage -------------------------------------------------------------------------
    def _check(self) -> None:
        cfg = self.cfg
        known = rewards.domains()
        bad = [d for d in cfg.pipeline.domains if d not in known]
        if bad:
            raise UserError(f"pipeline: unknown domain(s) {bad}; known: {', '.join(known)}")
        bad = [d for d in cfg.specialists.shares if d not in cfg.pipeline.domains]
        if bad:
            raise UserError(f"pipeline: specialists.shares names domain(s) {bad} outside pipeline.domains "
                            f"{cfg.pipeline.domains}")
        if any(v <= 0 for v in cfg.specialists.shares.values()):
            raise UserError(f"pipeline: specialists.shares must be > 0 (got {cfg.specialists.shares})")
        from deploy.grpo_config import load_for_domain
        from deploy.job_config import JobConfig
        from deploy.opd_config import OPDLoopConfig

        self.sft_cfg = config.load(JobConfig, self._file(cfg.sft.config, "sft"), self._sets("sft"))
        self.grpo_cfgs = {d: load_for_domain(self._file(cfg.specialists.config, "specialists"), d, self._sets("specialists"))
                          for d in cfg.pipeline.domains}
        self.opd_cfg = config.load(OPDLoopConfig, self._file(cfg.merge.config, "merge"), self._sets("merge"))
        missing = [d for d in self.opd_cfg.loop.domains if d not in cfg.pipeline.domains]
        if missing:
            raise UserError(f"pipeline: merge samples domain(s) {missing} that the pipeline has no teacher for "
                            f"(pipeline.domains = {cfg.pipeline.domains})")
        for d, p, _ in table_entries(self.opd_cfg.opd.teachers):
            refuse_uri(f"the merge's teacher for {d}", p)
            if not Path(p).exists():
                raise UserError(f"pipeline: the merge's teacher for {d} ({p}) does not exist")
        if cfg.merge.init != "base" and not Path(cfg.merge.init).exists():
            raise UserError(f"pipeline: merge.init {cfg.merge.init} does not exist")
        selecting = {f"specialists ({d})": g for d, g in self.grpo_cfgs.items() if g.loop.final == "best" or g.loop.patience}
        if self.opd_cfg.loop.final == "best":
            selecting["merge"] = self.opd_cfg
        same = [name for name, c in selecting.items() if c.eval.seed == cfg.evaluate.seed]
        if same:
            raise UserError(f"pipeline: {', '.join(same)} choose a policy by their own eval (loop.final = \"best\" or "
                            f"loop.patience) drawn with eval.seed = {cfg.evaluate.seed}, the evaluate stage's seed: that "
                            "selects on the prompts the report scores; give those stages another eval.seed")
        budgets = cfg.stage_budgets_s()
        total = sum(budgets.values())
        if total > cfg.pipeline.budget_min * 60:
            shown = ", ".join(f"{k} {v:.0f} s" for k, v in budgets.items())
            raise UserError(f"pipeline: the stage budgets ({shown}; {total / 60:.1f} min) do not fit "
                            f"pipeline.budget_min = {cfg.pipeline.budget_min} min")

    SEEDED = {"sft": ("sft.seed", "policy.seed"), "specialists": ("loop.seed", "pool.seed", "learner.seed"),
              "merge": ("loop.seed", "pool.seed", "learner.seed")}

    def _sets(self, stage: str) -> list[str]:
        """The stage's --set overrides, then pipeline.seed on every seed of its command (when not 0)."""
        seed = self.cfg.pipeline.seed
        return list(getattr(self.cfg, stage).set) + ([f"{k}={seed}" for k in self.SEEDED[stage]] if seed else [])

    def _file(self, name: str, stage: str) -> Path:
        p = config_path(name)
        if not p.is_file():
            raise UserError(f"pipeline: [{stage}] config {name!r} not found (looked in {CONFIGS})")
        return p

    def _claim(self, force: bool) -> None:
        """runs/NAME belongs to one pipeline config; another one needs --force (then stages whose own
        settings did not change are kept). One pipeline at a time: the run directory is locked until exit."""
        meta_path = self.run_dir / "pipeline.json"
        digest = manifest.settings_hash(self.cfg.model_dump(mode="json"))
        fresh = not self.run_dir.exists() or all(p.name == LOCK_NAME for p in self.run_dir.iterdir())
        self._lock = lock_run_dir(self.run_dir)  # held as long as this object (the run)
        try:
            self._check_owner(meta_path, digest, fresh, force)
        except BaseException:
            self._lock.close()
            raise
        write_atomic(meta_path, json.dumps({"config_hash": digest, "quick": self.quick,
                                            "config": self.cfg.model_dump(mode="json")}, indent=2).encode())

    def _check_owner(self, meta_path: Path, digest: str, fresh: bool, force: bool) -> None:
        """The run directory is fresh, or this config's pipeline run (another config's with --force)."""
        if meta_path.is_file():
            old = self._read_meta(meta_path, force)
            if old.get("config_hash") != digest and not force:
                raise UserError(f"pipeline: {self.run_dir} was made by another pipeline config; pass --force to "
                                "rerun the stages whose settings changed (and those after), or pick another --name")
        elif not fresh:
            raise UserError(f"pipeline: {self.run_dir} exists and is not a pipeline run; pick another --name")

    @staticmethod
    def _read_meta(path: Path, force: bool) -> dict:
        """pipeline.json; a damaged one is an error, or with --force replaced (as another config's would be)."""
        try:
            return read_record(path, {"config_hash": str}, "pass --force to replace it")
        except UserError:
            if force:
                return {}
            raise

    # -- the run --------------------------------------------------------------------------------------------
    def run(self) -> dict:
        from deploy.pipeline_report import write_report

        t0 = time.monotonic()
        with shared_ray(num_cpus=max(2, os.cpu_count() or 1) * max(1, self.cfg.specialists.parallel)):
            self._run_stages()
        report = write_report(self.run_dir)
        report["pipeline_wall_s_this_run"] = round(time.monotonic() - t0, 1)
        return report

    def _run_stages(self) -> None:
        redo = False  # a stage ran again: every later stage runs again
        for stage in STAGES[:-1]:
            d = self.run_dir / stage
            settings, inputs = self._settings(stage), self._inputs(stage)
            if redo:  # a stage never started has nothing to run again: it runs for the first time
                reason = "an earlier stage ran again" if d.exists() else "not finished"
            else:
                reason = manifest.stale_reason(manifest.read(d), settings, inputs)
            if reason is None:
                self._say(f"{stage}: done earlier, kept")
                continue
            if reason == "not finished":  # interrupted: resumable only under the settings it started with
                reason = manifest.started_reason(d, settings, inputs) or reason
            if manifest.read(d) is not None or reason != "not finished":
                self._say(f"{stage}: runs again: {reason}")
            (d / manifest.NAME).unlink(missing_ok=True)
            if reason != "not finished" and d.exists():
                shutil.rmtree(d)  # made from other settings or inputs: nothing in it may be resumed
            manifest.start(d, settings, inputs)
            s0 = time.monotonic()
            outputs, extra = getattr(self, f"_stage_{stage}")(d)
            manifest.write(d, settings=settings, inputs=inputs, outputs=outputs, wall_s=time.monotonic() - s0,
                           extra=extra)
            self._say(f"{stage}: done in {time.monotonic() - s0:.0f} s")
            redo = True

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(f"pipeline {self.name}: {line}", file=sys.stderr, flush=True)

    def _settings(self, stage: str) -> str:
        c = self.cfg
        common = {"domains": c.pipeline.domains}
        by = {"sft": {"job": self.sft_cfg.model_dump(mode="json")},  # SFT injects no faults: chaos is not its setting
              "specialists": {"stage": c.specialists.model_dump(mode="json"), "chaos": self.chaos,
                              "grpo": {d: g.model_dump(mode="json") for d, g in self.grpo_cfgs.items()},
                              "eval": c.evaluate.model_dump(mode="json")},
              "merge": {"stage": c.merge.model_dump(mode="json"), "opd": self.opd_cfg.model_dump(mode="json"),
                        "chaos": self.chaos},
              "evaluate": {"stage": c.evaluate.model_dump(mode="json")}}
        return manifest.settings_hash({**common, **by[stage]})

    def _inputs(self, stage: str) -> dict[str, str]:
        """sha256 of the upstream outputs this stage reads (as their manifests recorded them)."""
        upstream = {"sft": [], "specialists": ["sft"], "merge": ["sft", "specialists"],
                    "evaluate": ["sft", "specialists", "merge"]}[stage]
        out = {}
        for up in upstream:
            doc = manifest.read(self.run_dir / up) or {}
            for name, o in doc.get("outputs", {}).items():
                out[f"{up}/{name}"] = o["sha256"]
        return out

    def _output(self, stage: str, name: str) -> Path:
        doc = manifest.read(self.run_dir / stage)
        if doc is None or name not in doc["outputs"]:
            raise RuntimeError(f"pipeline: stage {stage} has no output {name}")
        return Path(doc["outputs"][name]["path"])

    # -- running a command ---------------------------------------------------------------------------------
    def _postrain(self, stage: str, args: list[str], log: Path, budget_s: float, watch: Path | None = None) -> None:
        """Run `postrain ARGS` as a child that dies with the pipeline; progress from its metrics."""
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "deploy.cli", *args]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
        with open(log, "ab") as out:
            out.write(f"$ postrain {' '.join(args)}\n".encode())
            out.flush()
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
            self._watch(proc, stage, args[0], budget_s, watch)
        if proc.returncode != 0:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise UserError(f"pipeline stage {stage}: `postrain {args[0]}` failed (exit {proc.returncode}); "
                            f"log {log}: {' | '.join(tail)}")

    def _watch(self, proc, stage: str, verb: str, budget_s: float, metrics: Path | None) -> None:
        if not self.live:
            proc.wait()
            return
        from rich.live import Live
        from rich.text import Text

        t0 = time.monotonic()
        with Live(refresh_per_second=2, transient=True) as live:
            while proc.poll() is None:
                el = time.monotonic() - t0
                eta = max(0.0, budget_s - el)
                live.update(Text(f"{stage} ({verb})  {el:5.0f} s  ETA {eta:4.0f} s  {self._latest(metrics)}"))
                time.sleep(0.5)

    @staticmethod
    def _latest(metrics: Path | None) -> str:
        if metrics is None:
            return ""
        rows = [r for r in last_metrics(metrics) if any(k.startswith("eval_pass_at_1") for k in r)]
        if not rows:
            return ""
        r = rows[-1]
        shown = {k.removeprefix("eval_pass_at_1_").removeprefix("eval_"): v for k, v in r.items()
                 if k.startswith("eval_pass_at_1") and isinstance(v, float)}
        return "pass@1 " + " ".join(f"{k} {v:.2f}" for k, v in shown.items())

    def _chaos(self, offset: int) -> list[str]:
        return ["--chaos", str(self.chaos + offset)] if self.chaos is not None else []

    # -- stages ------------------------------------------------------------------------------------------------
    def _stage_sft(self, d: Path):
        manifest.clear(d)  # no checkpoints inside SFT: an interrupted one starts over
        c = self.cfg.sft
        self._postrain("sft", ["sft", "--out", str(d), "--config", str(self._file(c.config, "sft")), "--quiet",
                               *(a for kv in self._sets("sft") for a in ("--set", kv))], d / "log.txt", c.budget_s, d / "metrics.jsonl")
        return {"base": d / "final"}, {}

    def _evaluate(self, ckpt: Path, domains: list[str]) -> dict[str, float]:
        from core.hf import load_policy
        from learner.config import EvalConfig
        from learner.evaluate import evaluate

        e = self.cfg.evaluate
        model, tok = load_policy(ckpt)
        cfg = EvalConfig(n=e.n, seed=e.seed, max_new_tokens=e.max_new_tokens)
        return {dom: evaluate(model, tok, dom, cfg)["pass_at_1"] for dom in domains}

    def _stage_specialists(self, d: Path):
        c, base = self.cfg.specialists, self._output("sft", "base")
        d.mkdir(parents=True, exist_ok=True)
        base_eval = self._evaluate(base, self.cfg.pipeline.domains)
        write_atomic(d / "base_eval.json", json.dumps(base_eval, indent=2).encode())
        train = [dom for dom in self.cfg.pipeline.domains if base_eval[dom] < c.skip_at]
        for dom in self.cfg.pipeline.domains:
            if dom not in train:
                self._say(f"specialists: {dom}: the base is at {base_eval[dom]:.3f} >= {c.skip_at}; it is its own teacher")
        stage_s = c.budget_s + self._carry_s("specialists")
        budgets = c.budgets_s(train, stage_s)
        todo = [dom for dom in train if not self._specialist_done(d / dom, self._settings("specialists"))]
        running: list[tuple[str, subprocess.Popen]] = []
        for i, dom in enumerate(todo):
            while len(running) >= c.parallel:
                running = self._reap(running)
            if c.parallel == 1 and self.cfg.pipeline.carry_over:
                budgets = self._sequential_budgets(d, train, todo[i:], stage_s)
            running.append((dom, self._start_specialist(d / dom, dom, base, budgets[dom], train.index(dom))))
        while running:
            running = self._reap(running)
        outputs = {dom: (d / dom / "final" if dom in train else base) for dom in self.cfg.pipeline.domains}
        return outputs, {"base_eval": base_eval, "trained": train}

    @staticmethod
    def _specialist_done(out: Path, settings: str) -> bool:
        """A specialist finished under the stage's current settings (a marker from before they were recorded
        in it counts as theirs) whose final/ is intact."""
        marker = out / "done.json"
        if not marker.is_file():
            return False
        try:
            doc = json.loads(marker.read_text())
            return doc.get("settings_hash", settings) == settings and doc["final_sha256"] == sha256_tree(out / "final")
        except (ValueError, KeyError, OSError, AttributeError):
            return False

    def _start_specialist(self, out: Path, dom: str, base: Path, budget_s: float, index: int):
        c = self.cfg.specialists
        resume = (out / "grpo_run.json").is_file()
        if not resume and out.exists():
            shutil.rmtree(out)  # killed before the run was set up: nothing to resume
        args = ["grpo", "--domain", dom, "--init", str(base), "--out", str(out), "--iterations", str(c.iterations),
                "--config", str(self._file(c.config, "specialists")), "--quiet", *self._chaos(index),
                *(a for kv in self._sets("specialists") for a in ("--set", kv))]
        if c.use_budget:
            args += ["--set", f"loop.time_budget_s={max(30.0, budget_s - self._spent(out)):.0f}"]
        if resume:
            args.append("--resume")
        self._say(f"specialists: {dom}: budget {budget_s:.0f} s")
        log = out.parent / f"{dom}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        f = open(log, "ab")
        f.write(f"$ postrain {' '.join(args)}\n".encode())
        f.flush()
        self._say(f"specialists: {dom}: GRPO from the base ({'resumed' if resume else 'started'}; log {log})")
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"},
                                preexec_fn=_die_with_parent)
        proc.log, proc.out, proc.dom = log, out, dom
        f.close()
        if self.cfg.specialists.parallel == 1:
            self._watch(proc, "specialists", f"grpo {dom}", budget_s, out / "metrics.jsonl")
        return proc

    def _sequential_budgets(self, d: Path, train: list[str], pending: list[str], stage_s: float) -> dict[str, float]:
        """One specialist at a time: the stage's time left after the finished ones (the wall time in their own
        metrics) split by the shares of those still to run, so one that ended early leaves the rest to them."""
        left = stage_s - sum(self._spent(d / x) for x in train if x not in pending)
        return self.cfg.specialists.budgets_s(pending, left)

    def _carry_s(self, stage: str) -> float:
        """What the training stages before `stage` left of their budgets (negative: what they overran), from
        their manifests; 0 with pipeline.carry_over off."""
        if not self.cfg.pipeline.carry_over:
            return 0.0
        budgets = self.cfg.stage_budgets_s()
        carry = 0.0
        for earlier in STAGES[:STAGES.index(stage)]:
            doc = manifest.read(self.run_dir / earlier)
            if doc is not None and "wall_s" in doc:
                carry += budgets[earlier] - float(doc["wall_s"])
        return carry

    @staticmethod
    def _spent(out: Path) -> float:
        """Wall seconds an interrupted run already spent (its last metrics row)."""
        rows = [r for r in last_metrics(out / "metrics.jsonl") if isinstance(r.get("time_s"), (int, float))]
        return float(rows[-1]["time_s"]) if rows else 0.0

    def _reap(self, running: list) -> list:
        still = []
        for dom, proc in running:
            code = proc.poll()
            if code is None:
                still.append((dom, proc))
                continue
            if code != 0:
                for _, other in running:
                    if other.poll() is None:
                        other.kill()
                tail = proc.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise UserError(f"pipeline stage specialists: GRPO on {dom} failed (exit {code}); log {proc.log}: "
                                f"{' | '.join(tail)}")
            write_atomic(proc.out / "done.json", json.dumps({"final_sha256": sha256_tree(proc.out / "final"),
                                                             "settings_hash": self._settings("specialists")}).encode())
            self._say(f"specialists: {dom}: done")
        if len(still) == len(running):
            time.sleep(0.5)
        return still

    def _stage_merge(self, d: Path):
        c = self.cfg.merge
        teachers = {dom: self._output("specialists", dom) for dom in self.cfg.pipeline.domains}
        student = self._output("sft", "base") if c.init == "base" else Path(c.init)
        if all(t == student for t in teachers.values()):
            self._say("merge: every domain's teacher is the student itself (no specialist was trained); "
                      "the merged model is the student")
            d.mkdir(parents=True, exist_ok=True)
            return {"merged": student}, {"teachers": {k: str(v) for k, v in teachers.items()},
                                         "skipped": "every teacher is the student"}
        out = d / "run"
        done = d / "done.json"
        if done.is_file() and (out / "final").is_dir():
            return {"merged": out / "final"}, {"teachers": {k: str(v) for k, v in teachers.items()}}
        resume = (out / "opd_run.json").is_file()
        if not resume:
            manifest.clear(d)
        args = ["opd", "--student", str(student), "--out", str(out), "--iterations", str(c.iterations),
                "--config", str(self._file(c.config, "merge")), "--quiet", *self._chaos(100),
                *(f"--teacher={dom}={p}" for dom, p in teachers.items()),
                *(a for kv in self._sets("merge") for a in ("--set", kv))]
        budget_s = c.budget_s + self._carry_s("merge")
        if c.use_budget:
            args += ["--set", f"loop.time_budget_s={max(30.0, budget_s - self._spent(out)):.0f}"]
            self._say(f"merge: budget {budget_s:.0f} s")
        if resume:
            args.append("--resume")
        self._postrain("merge", args, d / "log.txt", budget_s, out / "metrics.jsonl")
        write_atomic(done, b"{}")
        return {"merged": out / "final"}, {"teachers": {k: str(v) for k, v in teachers.items()}}

    def _stage_evaluate(self, d: Path):
        d.mkdir(parents=True, exist_ok=True)
        domains = self.cfg.pipeline.domains
        trained = (manifest.read(self.run_dir / "specialists") or {}).get("trained", [])
        models = {"base": self._output("sft", "base"),
                  **{f"specialist:{dom}": self._output("specialists", dom) for dom in trained},
                  "merged": self._output("merge", "merged")}
        results = {}
        for name, path in models.items():
            t0 = time.monotonic()
            results[name] = self._evaluate(path, domains)
            self._say(f"evaluate: {name}: " + "  ".join(f"{k} {v:.3f}" for k, v in results[name].items())
                      + f" ({time.monotonic() - t0:.0f} s)")
        doc = {"n": self.cfg.evaluate.n, "seed": self.cfg.evaluate.seed, "models": {k: str(v) for k, v in models.items()},
               "pass_at_1": results}
        write_atomic(d / "results.json", json.dumps(doc, indent=2).encode())
        return {"results": d / "results.json"}, {}


def run_pipeline(cfg: PipelineConfig, name: str, runs: str | Path = "runs", **kw) -> dict:
    return Pipeline(cfg, name, runs, **kw).run()


def wall_minutes(run_dir: Path) -> float:
    total = 0.0
    for stage in STAGES[:-1]:
        doc = manifest.read(Path(run_dir) / stage)
        total += doc.get("wall_s", 0.0) if doc else 0.0
    return math.ceil(total / 6) / 10
