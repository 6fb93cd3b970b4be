"""The pipeline driver: composes learner and rewards into the main job (SFT, then eval per domain)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import rewards
from core.errors import UserError
from deploy.job_config import JobConfig
from core.progress import progress
from core.rundir import RunDir


SFT_FILES = ("config.json", "metrics.jsonl", "final")  # what an SFT run leaves in its run directory


def run_sft(cfg: JobConfig, out: str | Path, init: str | None = None, quiet: bool = False, fresh: bool = True) -> Path:
    """SFT into run dir `out`; the policy is saved to OUT/final/ and returned. With `fresh`, an `out` that
    already holds an SFT run is refused (its metrics would be mixed with this run's)."""
    from learner.policy import build_policy
    from core.hf import count_params, load_policy, save_policy
    from learner.sft import train_sft

    for name in cfg.sft.domains:
        rewards.domain(name)
    held = [name for name in SFT_FILES if (Path(out) / name).exists()] if fresh else []
    if held:
        raise UserError(f"sft: output directory {out} already holds a run ({', '.join(held)}); pick a fresh --out "
                        "or delete it")
    run = RunDir(out)
    run.save_config(cfg)
    model, tok = load_policy(init) if init else build_policy(cfg.policy)
    t0 = time.monotonic()
    with progress(f"sft {'+'.join(cfg.sft.domains)}", cfg.sft.steps, quiet) as advance:
        res = train_sft(model, tok, cfg.sft, log=lambda **m: run.log(stage="sft", **m), advance=advance)
    final = save_policy(model, tok, run.path / "final")
    run.log(stage="sft_done", params=count_params(model), sft_seconds=round(time.monotonic() - t0, 1), **res)
    run.plot("step", ["loss", "lr", "grad_norm"], "sft.png", title="SFT")
    return final


def run_eval(cfg: JobConfig, checkpoint: Path, run: RunDir, quiet: bool = False) -> list[dict]:
    from learner.evaluate import evaluate
    from core.hf import load_policy

    model, tok = load_policy(checkpoint)
    results = []
    names = rewards.domains()
    with progress("eval", cfg.eval.n * len(names), quiet) as advance:
        for name in names:
            res = evaluate(model, tok, name, cfg.eval, advance=advance)
            results.append(res)
            run.log(stage="eval", domain=name, pass_at_1=res["pass_at_1"], mean_reward=res["mean_reward"])
    return results


def run_job(cfg: JobConfig, out: Path, quiet: bool = False) -> dict:
    (Path(out) / "metrics.jsonl").unlink(missing_ok=True)  # a rerun of the same name starts a fresh curve
    run = RunDir(out)
    t0 = time.monotonic()
    final = run_sft(cfg, out, quiet=quiet, fresh=False)  # a rerun of the same name replaces it
    sft_s = time.monotonic() - t0
    results = run_eval(cfg, final, run, quiet=quiet)
    summary = {
        "run": str(out), "checkpoint": str(final), "sft_steps": cfg.sft.steps,
        "sft_seconds": round(sft_s, 1), "total_seconds": round(time.monotonic() - t0, 1),
        "eval": [{k: r[k] for k in ("domain", "n", "pass_at_1", "mean_reward")} for r in results],
    }
    (run.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for r in summary["eval"]:
        print(f"{r['domain']:10s} pass@1={r['pass_at_1']:.3f}  (n={r['n']})")
    print(f"run directory: {out}  (sft {summary['sft_seconds']} s, total {summary['total_seconds']} s)")
    return summary
