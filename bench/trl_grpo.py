"""TRL's `GRPOTrainer` on postrain's GRPO workload: the baseline side of `bench/grpo_vs_trl.py`.

The mapping from a resolved `postrain grpo` config (the `config.json` a run writes) to TRL:

| postrain (`configs/grpo_loop.toml`) | TRL `GRPOConfig` / trainer |
| --- | --- |
| train prompts of iteration k: `domain.prompts("train", P, loop.seed·1000003 + k)` | the dataset, in that order, `shuffle_dataset=False` |
| `loop.group_size` G | `num_generations` |
| `loop.prompts_per_iteration` P × G per iteration, `loop.minibatches` M steps | `per_device_train_batch_size = P·G/M`, `steps_per_generation = M` |
| `sampling.temperature`, top-p 1, top-k 0, `sampling.max_new_tokens` | `temperature`, `top_p=1`, `top_k=0`, `max_completion_length` |
| reward `rewards.domain(d).verify(prompt, completion)` | the one reward function (same call) |
| `advantages.std_normalise`, group mean | `scale_rewards="group"` (or `"none"`) |
| `loss.eps_low` / `eps_high` | `epsilon` / `epsilon_high` |
| `loss.kl_coef` 0 | `beta` 0 (no reference model) |
| `loss.aggregation = "token-mean"` over each optimizer step | `loss_type="bnpo"` (token mean of the step's minibatch) |
| AdamW `optim.lr`, betas, eps, weight decay, `grad_clip` | the same AdamW (torch), `max_grad_norm` |
| warm-up + cosine to `min_lr_ratio` over `total_steps` (`learner.optim.lr_factor`) | the same function as a `LambdaLR` |
| `loop.seed`, `pool.seed`, `learner.seed` | `seed` |

Run as `python -m bench.trl_grpo SPEC.json` (what `bench.grpo_vs_trl` does). SPEC names the checkpoint,
domain, seed, wall budget, snapshot period, output directory and the resolved postrain config. The
clock starts before the model is loaded; every `snapshot_every_s` the policy as of that time (the
weights after the last optimizer step that ended before it) is saved, and at the end the final one;
`postrain eval`'s evaluator scores them afterwards, outside the budget. Writes OUT/trl_run.json.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PROMPT_SEED_STRIDE = 1_000_003  # fresh prompts of iteration k: seed · stride + k (as `postrain grpo` draws them)


def train_prompts(cfg: dict, domain: str, iterations: int) -> list[str]:
    """The train prompts `postrain grpo` draws for iterations 0..iterations-1, in order (fresh prompts;
    a fixed prompt pool and hard-prompt replay are not mapped)."""
    import rewards

    lp = cfg["loop"]
    if lp.get("prompt_pool") or lp.get("replay_share"):
        raise ValueError("grpo-vs-trl: loop.prompt_pool and loop.replay_share have no TRL counterpart; leave them off")
    dom = rewards.domain(domain)
    out: list[str] = []
    for k in range(iterations):
        out += dom.prompts("train", lp["prompts_per_iteration"], lp["seed"] * PROMPT_SEED_STRIDE + k)
    return out


def reward_function(domain: str):
    """TRL's reward function: `rewards.domain(domain).verify` on each (prompt, completion)."""
    import rewards

    verify = rewards.domain(domain).verify

    def reward(prompts, completions, **_):
        return [float(verify(p, c)[0]) for p, c in zip(prompts, completions)]

    reward.__name__ = f"{domain}_verify"
    return reward


def trl_kwargs(cfg: dict, seed: int, out: str) -> dict:
    """`GRPOConfig` keyword arguments equivalent to the resolved postrain config `cfg`."""
    lp, s, loss, adv, opt = cfg["loop"], cfg["sampling"], cfg["loss"], cfg["advantages"], cfg["optim"]
    batch = lp["prompts_per_iteration"] * lp["group_size"]
    if batch % lp["minibatches"]:
        raise ValueError(f"grpo-vs-trl: P·G = {batch} must split into loop.minibatches = {lp['minibatches']} steps")
    if loss["aggregation"] != "token-mean" or adv["leave_one_out"]:
        raise ValueError("grpo-vs-trl: only token-mean aggregation and a group-mean baseline are mapped")
    return dict(
        output_dir=out, report_to="none", use_cpu=True, bf16=False, seed=seed, data_seed=seed,
        num_generations=lp["group_size"], per_device_train_batch_size=batch // lp["minibatches"],
        gradient_accumulation_steps=1, steps_per_generation=lp["minibatches"], num_iterations=1,
        shuffle_dataset=False, temperature=s["temperature"], top_p=1.0, top_k=0,
        max_completion_length=s["max_new_tokens"], scale_rewards="group" if adv["std_normalise"] else "none",
        epsilon=loss["eps_low"], epsilon_high=loss["eps_high"], beta=loss["kl_coef"], loss_type="bnpo",
        max_grad_norm=opt["grad_clip"], learning_rate=opt["lr"], max_steps=10_000_000, logging_steps=1_000_000,
        save_strategy="no", disable_dropout=True, dataloader_num_workers=0, remove_unused_columns=False,
    )


def optimizer_and_schedule(model, cfg: dict):
    """postrain's AdamW (decay on matrices only) and warm-up + cosine schedule, for TRL to step."""
    from learner.grpo_config import OptimConfig
    from learner.optim import build_optimizer

    return build_optimizer(model, OptimConfig.model_validate(cfg["optim"]))


def build_trainer(model, tok, cfg: dict, domain: str, seed: int, out: str | Path, iterations: int, reward=None,
                  **overrides):
    """TRL's GRPOTrainer on `model` with the mapped config, the prompts of `iterations` postrain iterations
    in order, and `reward` (default: `reward_function(domain)`); `overrides` go to GRPOConfig."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**(trl_kwargs(cfg, seed, str(out)) | overrides))
    return GRPOTrainer(model=model, reward_funcs=[reward or reward_function(domain)], args=args,
                       train_dataset=Dataset.from_dict({"prompt": train_prompts(cfg, domain, iterations)}),
                       processing_class=tok, optimizers=optimizer_and_schedule(model, cfg))


def run(spec: dict) -> dict:
    t0 = time.monotonic()  # the clock: before anything is loaded (as `postrain grpo`'s loop.time_budget_s)
    import torch
    from transformers import TrainerCallback

    from core.hf import load_policy

    cfg, out = spec["config"], Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(spec.get("threads", 2))
    model, tok = load_policy(spec["init"])
    budget, every = float(spec["budget_s"]), float(spec["snapshot_every_s"])
    snaps: list[dict] = []
    counters = {"optimizer_steps": 0, "completions": 0, "rewards": []}

    def save(state: dict, label: str, at_s: float) -> None:
        from safetensors.torch import save_file

        path = out / "snapshots" / f"{label}.safetensors"
        path.parent.mkdir(exist_ok=True)
        save_file(state, str(path))
        snaps.append({"label": label, "time_s": round(at_s, 3), "path": str(path), "step": counters["optimizer_steps"]})

    def weights() -> dict:
        return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}

    class Clock(TrainerCallback):
        def __init__(self):
            self.prev, self.prev_end, self.next_mark, self.last = weights(), time.monotonic() - t0, every, 0.0

        def on_step_end(self, args_, state, control, **kw):
            now = time.monotonic() - t0
            counters["optimizer_steps"] = state.global_step
            while self.next_mark <= now:  # the policy as of the mark: after the last step that ended before it
                save(self.prev, f"t{int(self.next_mark):05d}", self.next_mark)
                self.next_mark += every
            self.last, self.prev_end, self.prev = now - self.prev_end, now, weights()
            # like loop.time_budget_s: no step starts that the last one's length says would overrun the budget
            if now + 2 * self.last > budget:
                control.should_training_stop = True
            return control

    verify = reward_function(spec["domain"])

    def counting_reward(prompts, completions, **kw):
        r = verify(prompts, completions, **kw)
        counters["completions"] += len(r)
        counters["rewards"].append(sum(r) / max(1, len(r)))
        return r

    counting_reward.__name__ = verify.__name__
    trainer = build_trainer(model, tok, cfg, spec["domain"], spec["seed"], out / "trainer",
                            spec.get("max_iterations", 4000), counting_reward)
    clock = Clock()
    trainer.add_callback(clock)
    save(clock.prev, "t00000", 0.0)
    t_train = time.monotonic() - t0
    trainer.train()
    end = time.monotonic() - t0
    save(weights(), "final", end)
    res = {"domain": spec["domain"], "seed": spec["seed"], "budget_s": budget, "wall_s": round(end, 3),
           "setup_s": round(t_train, 3), "optimizer_steps": counters["optimizer_steps"],
           "completions": counters["completions"], "completions_per_s": counters["completions"] / end,
           "sampled_reward_by_generation": counters["rewards"], "snapshots": snaps,
           "trl_kwargs": {k: v for k, v in trl_kwargs(cfg, spec["seed"], "").items() if k != "output_dir"}}
    (out / "trl_run.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.trl_grpo SPEC.json", file=sys.stderr)
        return 2
    res = run(json.loads(Path(argv[0]).read_text()))
    print(json.dumps({k: v for k, v in res.items() if k not in ("snapshots", "sampled_reward_by_generation")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
