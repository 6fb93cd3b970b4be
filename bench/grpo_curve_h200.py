"""Greedy pass@1 per minute of wall time on arith: `postrain grpo`'s stage code against TRL's `GRPOTrainer`
on one GPU, from the same short SFT base.

1. Base (`bench.curve_base.sft_base`, a process of its own): the Qwen2.5-0.5B shape (`bench.grpo.GPU_MODEL`:
   vocab 151,936 with the padded character tokenizer; `--tiny` a toy shape for a CPU check) built from its
   config, no downloaded weights, SFT on arith demonstrations until its greedy exact-match rate on
   held-out train prompts reaches `stop_at`; saved once, both sides start from it.
2. Ours: `python -m deploy.grpo_stages` (the loop's stage code in one process: rollout worker with its WAL,
   data plane, one-rank learner, weights published device to device; no Ray, no evals) with the shipped
   `configs/grpo_loop.toml` (32 prompts × 8 at T 0.7, 48 new tokens, 4 group-aware minibatches, on-policy,
   zero-variance groups left out, clip 0.2 / 0.28, no KL, token-mean, warm-up 20 + cosine over 1,000
   steps), the GPU placement of `bench.grpo_iteration.device_sets`, and `optim.lr` = `--lr`.
3. TRL: `GRPOTrainer` (HF generate, no vLLM) on the same base with `bench.trl_grpo`'s mapping of the
   resolved config ours wrote (same prompts in the same order, same reward `rewards.domain("arith").verify`,
   same optimizer and schedule), fp32 weights under bf16 autocast as ours' learner.
4. Each side's clock starts when its process is launched (start-up, model load and compilation count);
   it ends at the first update that ends past `--budget-s`. The policy as of every `--every-s` mark
   (`bench.wall_snapshots`: after the last update that ended before the mark; ours updates once per
   iteration, TRL once per optimizer step) is kept on the device, then saved. After both sides, one
   scoring process scores every snapshot with `postrain eval`'s evaluator and the run's `[eval]` table
   (greedy, 256 eval prompts): the same code on the same files for both.

JSON: both curves, pass@1 at each matched mark, their mean, the final, the gain per minute, each side's
iterations, optimizer steps, time to its first update and sampled reward per iteration. On an H200 at
the defaults a run takes about 6 minutes (base ~25 s, each side ~135 s, scoring ~40 s): give its
command a limit of 7 minutes or more, and a fresh `--work`.

    python -m bench.grpo_curve_h200 [--json] [--tiny] [--budget-s 120] [--every-s 20] [--lr 7e-6]
        [--work DIR] [--out FILE] [--commit SHA]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.grpo_iteration import DOMAIN, ROOT, TINY_MODEL, device_sets
from bench.trl_grpo import train_prompts
from core.cli_args import positive_float

SHAPE = {"prompts": 32, "group": 8, "max_new_tokens": 48}  # the shipped loop's iteration
# optim.lr on both sides: the shipped 5e-5 (tuned on the 128-wide default policy) scaled by 128/896 for
# the 0.5B shape's width, as Adam's per-matrix step is (muP-style); below the ~4e-5 where the same
# scaling of the 3e-4 that collapsed the default policy lands
LR = 7e-6
SFT_GPU = dict(lr=2e-4, batch_size=128, max_steps=3000, stop_at=0.4, check_every=5, max_s=75.0)
SFT_TINY = dict(lr=1e-3, batch_size=32, max_steps=30, stop_at=0.4, check_every=10, max_s=30.0)
MAX_ITERATIONS = 2000  # prompts drawn for; the budget ends both sides long before
EVAL_BATCH = 256  # the [eval] table's 256 prompts in one generate call (its default 64 takes 4)


def _log(msg: str) -> None:
    print(f"[bench grpo-curve] {msg}", file=sys.stderr, flush=True)


def curve_sets(cuda: bool, lr: float, longest_prompt: int) -> list[str]:
    """`--set` overrides of the shipped config: the device placement and the learning rate, nothing else."""
    return [f"optim.lr={lr}"] + device_sets(SHAPE, cuda, longest_prompt)


def curve_summary(ours: list[dict], trl: list[dict], base: float, budget_s: float) -> dict:
    """pass@1 at the marks both curves hold (`[{"t_s", "pass_at_1"}]`), their means, the final and the gain per minute."""
    o, t = ({r["t_s"]: r["pass_at_1"] for r in side} for side in (ours, trl))
    matched = sorted(set(o) & set(t))
    if not matched:
        return {"matched_times_s": []}
    mean_o, mean_t = statistics.mean(o[m] for m in matched), statistics.mean(t[m] for m in matched)
    last = matched[-1]
    return {"matched_times_s": matched, "ours_pass_at_1": [o[m] for m in matched],
            "trl_pass_at_1": [t[m] for m in matched], "base_pass_at_1": base,
            "mean_ours": mean_o, "mean_trl": mean_t, "mean_ratio": mean_o / mean_t if mean_t else None,
            "final_time_s": last, "final_ours": o[last], "final_trl": t[last],
            "final_ratio": o[last] / t[last] if t[last] else None,
            "gain_per_minute_ours": (o[last] - base) * 60 / last, "gain_per_minute_trl": (t[last] - base) * 60 / last,
            "final_is_budget": last == budget_s}


def run_trl_side(spec: dict) -> dict:
    """TRL's GRPOTrainer from the base for the wall budget; its snapshots saved afterwards."""
    import torch
    from transformers import TrainerCallback

    from bench.trl_grpo import build_trainer, reward_function
    from bench.wall_snapshots import WallSnapshots
    from core.hf import load_policy

    cuda, out = spec["cuda"], Path(spec["out"])
    snaps = WallSnapshots(spec["clock_start_unix"], spec["budget_s"], spec["every_s"],
                          sync=torch.cuda.synchronize if cuda else None)
    cfg = json.loads(Path(spec["config"]).read_text())
    model, tok = load_policy(spec["init"])  # fp32 weights; bf16 autocast in training on a GPU
    verify, sampled = reward_function(DOMAIN), []

    def reward(prompts, completions, **kw):
        r = verify(prompts, completions, **kw)
        sampled.append(sum(r) / len(r))
        return r

    reward.__name__ = verify.__name__

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if snaps.after_step(model.state_dict()):
                control.should_training_stop = True
            return control

    trainer = build_trainer(model, tok, cfg, DOMAIN, cfg["loop"]["seed"], out / "trainer", MAX_ITERATIONS, reward,
                            use_cpu=not cuda, bf16=cuda)
    trainer.add_callback(Clock())
    trainer.train()
    wall = snaps.elapsed_s()
    return {"snapshots": snaps.write(out / "snapshots"), "step_end_s": snaps.step_end_s, "optimizer_steps": snaps.steps,
            "iterations": len(sampled), "sampled_reward_by_iteration": sampled, "wall_s": wall}


def score(spec: dict, write=None) -> dict:
    """Greedy pass@1 of the base and of every snapshot of both sides, mark by mark (`write(partial)` after each)."""
    import torch
    from safetensors.torch import load_file

    from bench.curve_base import greedy_pass_at_1
    from core.hf import load_policy

    device = "cuda" if spec["cuda"] else "cpu"
    model, tok = load_policy(spec["init"])
    model.to(device)
    res = {"base_pass_at_1": greedy_pass_at_1(model, tok, DOMAIN, spec["eval"]),
           "device": torch.cuda.get_device_name() if spec["cuda"] else None,
           "curves": {side: [] for side in spec["snapshots"]}} | _versions()
    by_mark = sorted((row["mark_s"], side, row) for side, rows in spec["snapshots"].items() for row in rows)
    for mark, side, row in by_mark:  # both sides at each mark before the next: a cut-short scoring keeps matched marks
        if row["path"] == "base":
            p = res["base_pass_at_1"]
        else:
            state = {k.replace("_orig_mod.", ""): v for k, v in load_file(row["path"], device=device).items()}
            missing, unexpected = model.load_state_dict(state, strict=False)  # tied lm_head may be left out
            if unexpected or set(missing) - {"lm_head.weight"}:
                raise RuntimeError(f"{row['path']}: missing {missing}, unexpected {unexpected}")
            p = greedy_pass_at_1(model, tok, DOMAIN, spec["eval"])
        res["curves"][side].append({"t_s": mark, "pass_at_1": p, "updates": row["step"]})
        _log(f"{side} at {mark:g} s: pass@1 {p:.3f}")
        if write is not None:
            write(res)
    return res


def run_part(name: str, spec: dict, out: Path) -> None:
    """One part in this process (`--part`): its result to `out` (the scorer's after every snapshot too)."""
    if name == "sft":
        from bench.curve_base import sft_base

        res = sft_base(spec["init"], spec["model"], DOMAIN, spec["device"], **spec["sft"])
    elif name == "trl":
        res = run_trl_side(spec)
    else:
        res = score(spec, lambda partial: out.write_text(json.dumps(partial)))
    out.write_text(json.dumps(res))


def _part(name: str, spec: dict, work: Path, timeout_s: float) -> tuple[dict, float]:
    """`--part NAME` in a process of its own (launched now: a side's clock starts here); its result and wall time."""
    spec_path, out_path = work / f"{name}_spec.json", work / f"{name}_out.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "bench.grpo_curve_h200", "--part", name, "--part-spec", str(spec_path),
           "--part-out", str(out_path)]
    subprocess.run(cmd, cwd=ROOT, timeout=timeout_s, check=True)
    return json.loads(out_path.read_text()), time.monotonic() - t0


def _ours(spec: dict, work: Path, timeout_s: float) -> tuple[dict, float]:
    spec_path = work / "ours_spec.json"
    spec["clock_start_unix"] = time.time()
    spec_path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "deploy.grpo_stages", str(spec_path)], cwd=ROOT, timeout=timeout_s, check=True)
    return json.loads(Path(spec["times_out"]).read_text()), time.monotonic() - t0


def _side_row(res: dict, wall_s: float, updates_per_iteration: str) -> dict:
    ends = res["step_end_s"]
    return {"iterations": res["iterations"], "optimizer_steps": res["optimizer_steps"], "update": updates_per_iteration,
            "first_update_end_s": ends[0] if ends else None, "last_update_end_s": ends[-1] if ends else None,
            "update_end_s": ends, "sampled_reward_by_iteration": res["sampled_reward_by_iteration"],
            "process_wall_s": round(wall_s, 1)} | {k: res[k] for k in ("iteration_s", "rollout_s") if k in res}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpo_curve_h200", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.add_argument("--tiny", action="store_true", help="the toy shape on the CPU (a check of the code path)")
    p.add_argument("--budget-s", type=positive_float, default=120.0, help="wall budget per side, from its process launch")
    p.add_argument("--every-s", type=positive_float, default=20.0, help="snapshot period")
    p.add_argument("--lr", type=positive_float, default=LR, help="optim.lr on both sides")
    p.add_argument("--work", help="scratch directory (default: a temporary one)")
    p.add_argument("--out", help="write the JSON here (after every stage)")
    p.add_argument("--commit", help="the commit measured, where the tree is no git checkout")
    p.add_argument("--part", choices=["sft", "trl", "score"], help=argparse.SUPPRESS)
    p.add_argument("--part-spec", help=argparse.SUPPRESS)
    p.add_argument("--part-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        run_part(args.part, json.loads(Path(args.part_spec).read_text()), Path(args.part_out))
        return 0
    return run(args)


def run(args) -> int:
    from bench._device import run_meta
    from bench.grpo import GPU_MODEL

    cuda = not args.tiny
    work = Path(args.work or tempfile.mkdtemp(prefix="grpo_curve_"))
    if work.exists() and any(work.iterdir()):  # a side's run directory must start empty
        print(f"grpo-curve: --work {work} is not empty; give a fresh directory", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    model, sft = (TINY_MODEL, SFT_TINY) if args.tiny else (GPU_MODEL, SFT_GPU)
    init = work / "base"
    res = {"benchmark": "grpo_curve", "domain": DOMAIN, "shape": SHAPE, "budget_s": args.budget_s,
           "every_s": args.every_s, "lr": args.lr, "model": {"arch": "qwen2", **model}}

    def save():
        res["meta"] = run_meta(res.get("device")) | ({"commit": args.commit} if args.commit else {})
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")

    _log("base: SFT")
    res["sft"], wall = _part("sft", {"init": str(init), "model": model, "device": "cuda" if cuda else "cpu", "sft": sft},
                             work, sft["max_s"] + 120)
    res["sft"]["process_wall_s"] = round(wall, 1)
    save()
    longest = max(len(q) for q in train_prompts({"loop": {"prompts_per_iteration": SHAPE["prompts"], "seed": 0}},
                                                DOMAIN, MAX_ITERATIONS))  # a character a token
    ours_spec = {"init": str(init), "domain": DOMAIN, "config": str(ROOT / "configs" / "grpo_loop.toml"),
                 "sets": curve_sets(cuda, args.lr, longest), "out": str(work / "ours"), "iterations": MAX_ITERATIONS,
                 "ignore_eos": False, "times_out": str(work / "ours_times.json"), "config_out": str(work / "config.json"),
                 "budget_s": args.budget_s, "snapshot_every_s": args.every_s, "snapshots_out": str(work / "ours_snaps")}
    snapshots = {}
    timeout = args.budget_s + 180
    for side in ("ours", "trl"):
        _log(f"{side}: {args.budget_s:g} s from the base")
        try:
            if side == "ours":
                out, wall = _ours(ours_spec, work, timeout)
                rows = out["iterations"]
                out |= {"iterations": len(rows), "optimizer_steps": sum(r["optimizer_steps"] for r in rows),
                        "sampled_reward_by_iteration": [r["reward_mean"] for r in rows],
                        "iteration_s": [round(r["iteration_s"], 3) for r in rows],
                        "rollout_s": [round(r["rollout_s"], 3) for r in rows]}
            else:
                out, wall = _part("trl", {"cuda": cuda, "init": str(init), "config": str(work / "config.json"),
                                          "out": str(work / "trl"), "budget_s": args.budget_s, "every_s": args.every_s,
                                          "clock_start_unix": time.time()}, work, timeout)
        except (subprocess.SubprocessError, OSError, KeyError, ValueError) as exc:  # recorded; the other side still runs
            res.setdefault("failed", {})[side] = f"{type(exc).__name__}: {exc}"
            _log(f"{side} failed: {exc}")
            continue
        res[side] = _side_row(out, wall, "iteration" if side == "ours" else "optimizer step")
        snapshots[side] = out["snapshots"]
        save()
    cfg = json.loads((work / "config.json").read_text())
    res["config"] = {k: cfg[k] for k in ("optim", "loss", "advantages", "sampling")} | {
        "loop": {k: cfg["loop"][k] for k in ("prompts_per_iteration", "group_size", "minibatches", "async_rollouts")}}
    _log("scoring every snapshot")
    res["eval"] = cfg["eval"] | {"batch_size": EVAL_BATCH}
    try:
        scored, wall = _part("score", {"cuda": cuda, "init": str(init), "eval": res["eval"], "snapshots": snapshots},
                             work, 300)
    except (subprocess.SubprocessError, OSError) as exc:  # what it scored before failing still counts, marked
        res.setdefault("failed", {})["score"] = f"{type(exc).__name__}: {exc}"
        partial = work / "score_out.json"
        scored, wall = (json.loads(partial.read_text()) if partial.is_file() else
                        {"base_pass_at_1": None, "curves": {}, "device": None}), None
    res |= {k: v for k, v in scored.items() if k != "device"} | {"device": scored["device"] or "cpu (tiny check)",
                                                                  "scoring_wall_s": wall and round(wall, 1)}
    if scored["base_pass_at_1"] is not None:
        res["summary"] = curve_summary(scored["curves"].get("ours", []), scored["curves"].get("trl", []),
                                       scored["base_pass_at_1"], args.budget_s)
    save()
    print(json.dumps(res if args.json else res.get("summary"), indent=1))
    return 0


def _versions() -> dict:
    import torch
    import transformers

    out = {"torch_version": torch.__version__, "transformers_version": transformers.__version__}
    try:
        import trl

        out["trl_version"] = trl.__version__
    except ImportError:
        out["trl_version"] = None
    try:
        out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["nvidia_smi"] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
