"""One whole GRPO iteration on one device, `postrain grpo` against TRL's `GRPOTrainer`: tokens per second.

An iteration: P prompts × G completions generated, each scored by the domain's verifier, group
advantages, M optimizer steps over the batch. Both sides get the same model (a Qwen2 config with random
weights, saved once as an HF checkpoint: GPU `bench.grpo.GPU_MODEL`, Qwen2.5-0.5B dimensions, vocab
151,936; `--tiny` a toy shape for a CPU check), the same prompts of the same iterations in the same
order (`bench/trl_grpo.py`'s mapping of the resolved config), the same G, P·G completions and M
optimizer steps per iteration, the same max_new_tokens, and bf16 on a GPU (fp32 master weights under
bf16 autocast for training on both; our rollout engine holds bf16 weights).

Equal lengths: random weights would end some completions at a sampled EOS, differently on each side,
so neither side stops early: ours samples with `ignore_eos`, TRL generates with
`min_new_tokens = max_new_tokens`. Every completion is max_new_tokens long on both sides, and an
iteration holds the same tokens on both (P·G·(prompt + max_new_tokens)). Random weights also make
every reward 0 (every group's advantage 0): ours trains every group anyway
(`advantages.filter_zero_variance = false`), as TRL does, so both take M full optimizer steps (ours:
`loop.tokens_per_rank` set so that the group-aware plan cuts every batch into exactly M minibatches;
at `loop.minibatches = M` alone it may cut M + 1).

Ours: `python -m deploy.grpo_stages` (a process of its own): the loop's own stage code
(`deploy/grpo_loop.py`'s requests, data-plane sink and `_train`: advantages from the catalog, the
group-aware plan, one learner step per minibatch; `publish`) driving an in-process `RolloutWorker` (the
rollout engine, its token WAL, the verifier) and a one-rank `LearnerGroup`, then the new weights into
the worker. What `postrain grpo` adds around this is left out: Ray actors (the pool's calls, the weights
through the object store), the evals, checkpoints and retention.
TRL: `GRPOTrainer` (`bench.trl_grpo.build_trainer`, `use_cpu` off on a GPU, `bf16`), HF generate
without vLLM; `--trl-variants` picks its generation settings (all are measured, the fastest is the
baseline): `default` (dynamic cache), `static` (`cache_implementation="static"`; TRL turns generate's
compile off), `batching` (`use_transformers_continuous_batching`: transformers' continuous batching; TRL
casts the model to bf16 for it, so training then runs on bf16 weights), `bf16_weights` (the model
loaded in bf16: pure bf16 training, default generation).

Timing: each side runs `--warmup` iterations, then `--iterations` timed ones (device synchronised at
each iteration's end); tokens/s = the iteration's tokens over the median iteration time. TRL's
iteration k spans from the end of its optimizer step k·M to the end of step (k+1)·M (its generation
runs inside the first of those steps).

    python -m bench.grpo_iteration --json [--tiny] [--iterations 3] [--warmup 1] [--out FILE]
        [--trl-variants default,static,batching,bf16_weights] [--sides ours,trl]
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

from bench.trl_grpo import train_prompts
from core.cli_args import nonneg_int, positive_float, positive_int

ROOT = Path(__file__).resolve().parents[1]
DOMAIN = "arith"
GPU_SHAPE = {"prompts": 32, "group": 8, "max_new_tokens": 256, "minibatches": 4}
TINY_SHAPE = {"prompts": 4, "group": 4, "max_new_tokens": 8, "minibatches": 2}
TINY_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True)
TRL_VARIANTS = ("default", "static", "batching", "bf16_weights")
DECODE_CHUNK = 32  # ours on a GPU: decode steps per device launch (engine.decode_chunk)
TARGET = "iteration_tokens_s_vs_trl_h200"
GOAL = 3.0


def _log(msg: str) -> None:
    print(f"[bench grpo-iteration] {msg}", file=sys.stderr, flush=True)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def padded_char_tokenizer(vocab_size: int):
    """postrain's character tokenizer with filler tokens up to `vocab_size` (a model's sampled ids all
    decode; text never encodes to a filler)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from learner.tokenizer import CHARS, EOS, PAD, UNK

    names = [PAD, EOS, UNK] + CHARS
    if vocab_size < len(names):
        raise ValueError(f"vocab_size {vocab_size} < the character vocabulary ({len(names)})")
    names += [f"<f{i}>" for i in range(vocab_size - len(names))]
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(names)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   padding_side="left", model_max_length=4096)


def make_checkpoint(path: Path, model_shape: dict, seed: int = 0) -> Path:
    """A Qwen2 model of `model_shape` with random weights (fp32) and the padded tokenizer, as an HF checkpoint."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from core.hf import save_policy

    tok = padded_char_tokenizer(model_shape["vocab_size"])
    cfg = Qwen2Config(**model_shape, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    return save_policy(Qwen2ForCausalLM(cfg), tok, path)


def plan_budget(prompt_tokens: list[list[int]], shape: dict) -> int:
    """`loop.tokens_per_rank` under which the loop's group-aware plan cuts every iteration's batch into
    exactly M minibatches (TRL's M optimizer steps): P/M of the largest groups fit, one group more never
    does. `prompt_tokens[k]`: the prompt lengths of iteration k."""
    p, g, n, m = shape["prompts"], shape["group"], shape["max_new_tokens"], shape["minibatches"]
    if p % m:
        raise ValueError(f"P = {p} prompts must split into M = {m} minibatches of whole groups")
    groups = [g * (t + n) for lens in prompt_tokens for t in lens]
    budget = p // m * max(groups)
    if (p // m + 1) * min(groups) <= budget:
        raise ValueError(f"group sizes {min(groups)}..{max(groups)} tokens: no budget gives exactly {m} minibatches")
    return budget


def device_sets(shape: dict, cuda: bool, longest_prompt: int) -> list[str]:
    """`--set` overrides that place one in-process rollout worker and learner on this device: every
    request of an iteration in one engine wave, and on a GPU the settings below."""
    sets = [f"engine.max_batch={shape['prompts'] * shape['group']}",
            f"engine.max_len={longest_prompt + shape['max_new_tokens'] + 8}"]
    if cuda:  # the learner's GPU micro-batch budget (bench/grpo.py's), the engine in bf16 on the GPU, CUDA-graph decode
        # in chunks of DECODE_CHUNK steps fed back on the device (compiled forward), one WAL commit per chunk
        return sets + ["engine.device=cuda", "engine.dtype=bfloat16", "engine.cuda_graphs=true", "learner.device=cuda",
                       f"engine.decode_chunk={DECODE_CHUNK}", "engine.compile_decode=true",
                       f"pool.steps_per_call={2 * DECODE_CHUNK}", f"pool.commit_group_steps={DECODE_CHUNK}",
                       "learner.micro_batch_tokens=32768", "learner.logprob_chunk_rows=4096", "learner.threads=4"]
    return sets + ["learner.device=cpu", "learner.threads=2"]


def loop_sets(shape: dict, cuda: bool, prompt_tokens: list[list[int]]) -> list[str]:
    """`--set` overrides of the shipped `configs/grpo_loop.toml` for this shape on this device."""
    return [f"loop.prompts_per_iteration={shape['prompts']}", f"loop.group_size={shape['group']}",
            f"loop.minibatches={shape['minibatches']}", f"sampling.max_new_tokens={shape['max_new_tokens']}",
            f"loop.tokens_per_rank={plan_budget(prompt_tokens, shape)}",
            "advantages.filter_zero_variance=false", "loop.async_rollouts=false",
            ] + device_sets(shape, cuda, max(max(lens) for lens in prompt_tokens))


def prompt_lengths(tok, shape: dict, iterations: int) -> list[list[int]]:
    """Token counts of the prompts of iterations 0..iterations-1 (loop.seed 0)."""
    per = shape["prompts"]
    prompts = train_prompts({"loop": {"prompts_per_iteration": per, "seed": 0}}, DOMAIN, iterations)
    return [[len(tok.encode(q)) for q in prompts[k * per:(k + 1) * per]] for k in range(iterations)]


def iteration_tokens(shape: dict, prompt_tokens: list[list[int]]) -> list[int]:
    """Tokens of each iteration's trajectories: G·Σ(prompt + max_new_tokens) over its P prompts."""
    return [shape["group"] * sum(t + shape["max_new_tokens"] for t in lens) for lens in prompt_tokens]


def stages_spec(ckpt: Path, work: Path, iterations: int, sets: list[str], times_out: Path | None = None) -> Path:
    """The spec of `python -m deploy.grpo_stages` for ours (without `times_out`: resolve the config only)."""
    spec = {"init": str(ckpt), "domain": DOMAIN, "config": str(ROOT / "configs" / "grpo_loop.toml"), "sets": sets,
            "out": str(work / "ours"), "iterations": iterations, "ignore_eos": True,
            "times_out": str(times_out) if times_out else None, "config_out": str(work / "config.json")}
    path = work / ("ours_spec.json" if times_out else "config_spec.json")
    path.write_text(json.dumps(spec))
    return path


def run_trl(ckpt: Path, cfg: dict, out: Path, iterations: int, variant: str, cuda: bool) -> dict:
    """TRL's GRPOTrainer on the same work (`cfg`: the resolved loop config, as ours wrote it): the time of
    each iteration (M optimizer steps)."""
    import torch
    from transformers import TrainerCallback

    from bench.trl_grpo import build_trainer
    from core.hf import load_policy

    if variant not in TRL_VARIANTS:
        raise ValueError(f"TRL variant {variant!r} not in {TRL_VARIANTS}")
    n, m = cfg["sampling"]["max_new_tokens"], cfg["loop"]["minibatches"]
    model, tok = load_policy(ckpt, dtype=torch.bfloat16 if variant == "bf16_weights" else torch.float32)
    over = {"use_cpu": not cuda, "bf16": cuda, "max_steps": m * iterations,
            "generation_kwargs": {"min_new_tokens": n}}
    if variant == "static":
        over["cache_implementation"] = "static"
    if variant == "batching":
        over["use_transformers_continuous_batching"] = True
    stamps, lengths = [], []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            _sync()
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % m == 0:
                _sync()
                stamps.append(time.perf_counter())
                _log(f"TRL {variant} iteration {len(stamps) - 2}: {stamps[-1] - stamps[-2]:.3f} s")

    def length_reward(prompts, completions, completion_ids=None, **kw):
        lengths.extend(len(c) for c in completion_ids or [])  # what TRL generated, before decoding
        return reward(prompts, completions)

    from bench.trl_grpo import reward_function

    reward = reward_function(DOMAIN)
    length_reward.__name__ = reward.__name__
    trainer = build_trainer(model, tok, cfg, DOMAIN, cfg["loop"]["seed"], out, iterations, length_reward, **over)
    trainer.add_callback(Clock())
    trainer.train()
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"times_s": times, "completion_len_min": min(lengths, default=None),
            "completion_len_max": max(lengths, default=None),
            "completions": len(lengths), "generation_kwargs": over["generation_kwargs"],
            "cache_implementation": over.get("cache_implementation"),
            "use_transformers_continuous_batching": over.get("use_transformers_continuous_batching", False),
            "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def summarise(side: dict, warmup: int, tokens: list[int]) -> dict:
    """Median over the timed iterations (after `warmup`); tokens/s = median tokens over median time."""
    timed = side["times_s"][warmup:]
    if not timed:
        raise ValueError("no timed iteration: raise --iterations above --warmup")
    med = statistics.median(timed)
    tok = statistics.median(tokens[warmup:len(side["times_s"])])
    return side | {"timed_s": timed, "median_s": med, "tokens_per_iteration": tok, "tokens_per_s": tok / med}


def target(ours: dict | None, trl: dict, cuda: bool, device: str) -> dict:
    if ours is None or not trl:
        return {"value": None, "goal": f">= {GOAL:g}", "met": None, "note": "not measured: a side did not run"}
    best = max(trl, key=lambda v: trl[v]["tokens_per_s"])
    ratio = ours["tokens_per_s"] / trl[best]["tokens_per_s"]
    out = {"value": ratio if cuda else None, "goal": f">= {GOAL:g}", "met": (ratio >= GOAL) if cuda else None,
           "trl_variant": best}
    if not cuda or "H200" not in device:
        out |= {"measured_here": ratio, "note": f"measured on {device}, not an H200: the target stays unmeasured"}
        out["value"], out["met"] = None, None
    return out


def _setup(args) -> tuple:
    """(cuda, device name, shape, model shape, checkpoint, `--set` overrides, tokens per iteration); the
    resolved loop config in WORK/config.json."""
    import torch

    from bench._device import cpu_name
    from bench.grpo import GPU_MODEL
    from core.hf import load_tokenizer

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.cuda.get_device_name() if cuda else cpu_name()
    shape, model_shape = (TINY_SHAPE, TINY_MODEL) if args.tiny else (GPU_SHAPE, GPU_MODEL)
    work = Path(args.work)
    ckpt = work / "init"
    if not (ckpt / "config.json").is_file():
        make_checkpoint(ckpt, model_shape)
    lens = prompt_lengths(load_tokenizer(ckpt), shape, args.iterations)
    sets = loop_sets(shape, cuda, lens)
    if not (work / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "deploy.grpo_stages", str(stages_spec(ckpt, work, args.iterations, sets))],
                       cwd=ROOT, check=True)
    return cuda, device, shape, model_shape, ckpt, sets, iteration_tokens(shape, lens)


def run_part(args) -> None:
    """One TRL variant in this process (`--part trl:VARIANT`); raw times to `--part-out`."""
    cuda, _, _, _, ckpt, _, _ = _setup(args)
    variant = args.part.split(":", 1)[1]
    cfg = json.loads((Path(args.work) / "config.json").read_text())
    out = run_trl(ckpt, cfg, Path(args.work) / f"trl-{variant}", args.iterations, variant, cuda)
    Path(args.part_out).write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpo_iteration", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.add_argument("--tiny", action="store_true", help="the toy shape (a CPU check of the code path)")
    p.add_argument("--iterations", type=positive_int, default=4, help="iterations per side, warm-up included")
    p.add_argument("--warmup", type=nonneg_int, default=1, help="untimed iterations first")
    p.add_argument("--trl-variants", default=",".join(TRL_VARIANTS), help="TRL generation settings to measure")
    p.add_argument("--sides", default="ours,trl", help="which sides run")
    p.add_argument("--part-timeout-s", type=positive_float, default=None, help="longest one side's process may run")
    p.add_argument("--work", help="scratch directory (default: a temporary one)")
    p.add_argument("--out", help="write the JSON here (after each side, so a cut-short run keeps what it measured)")
    p.add_argument("--part", help=argparse.SUPPRESS)  # one TRL variant, in a process of its own
    p.add_argument("--part-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.work = args.work or tempfile.mkdtemp(prefix="grpo_iteration_")
    if args.part:
        run_part(args)
        return 0
    import torch
    import transformers

    from bench._device import run_meta

    cuda, device, shape, model_shape, ckpt, sets, tokens = _setup(args)
    res = {"benchmark": "grpo_iteration", "device": device, "cuda": cuda, "domain": DOMAIN, "shape": shape,
           "model": {"arch": "qwen2", "random_init": True, **model_shape},
           "iterations": args.iterations, "warmup": args.warmup, "statistic": "median over the timed iterations",
           "equal_lengths": "ours: ignore_eos; TRL: min_new_tokens = max_new_tokens",
           "transformers_version": transformers.__version__, "torch_version": torch.__version__, "trl": {}}
    resolved = json.loads((Path(args.work) / "config.json").read_text())
    res["ours_engine"] = resolved["engine"]
    res["ours_pool"] = {k: resolved["pool"][k] for k in ("steps_per_call", "commit_group_steps", "max_commit_lag")}
    try:
        import trl

        res["trl_version"] = trl.__version__
    except ImportError:
        trl = None

    def save():
        res["targets"] = {TARGET: target(res.get("ours"), res["trl"], cuda, device)}
        res["meta"] = run_meta(device)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")

    sides = args.sides.split(",")
    if "trl" in sides and trl is None:
        print("grpo-iteration: TRL is not installed; pip install 'postrain[bench]'", file=sys.stderr)
        return 2
    parts = (["ours"] if "ours" in sides else []) + ([f"trl:{v}" for v in args.trl_variants.split(",")]
                                                     if "trl" in sides else [])
    for part in parts:  # each side in its own process: no memory, threads or compiled state carried over
        _log(f"{part}: {args.iterations} iterations on {device}")
        part_out = Path(args.work) / f"part-{part.replace(':', '-')}.json"
        if part == "ours":  # postrain's side (deploy/grpo_stages.py; it writes its times after every iteration)
            cmd = [sys.executable, "-m", "deploy.grpo_stages",
                   str(stages_spec(ckpt, Path(args.work), args.iterations, sets, part_out))]
        else:
            cmd = [sys.executable, "-m", "bench.grpo_iteration", "--part", part, "--part-out", str(part_out),
                   "--work", args.work, "--iterations", str(args.iterations)] + (["--tiny"] if args.tiny else [])
        try:
            try:
                done = subprocess.run(cmd, cwd=ROOT, timeout=args.part_timeout_s)
                if done.returncode != 0:
                    raise RuntimeError(f"exit {done.returncode}")
            except subprocess.TimeoutExpired as exc:
                if not part_out.is_file():
                    raise
                res.setdefault("cut_short", {})[part] = str(exc)  # what it finished still counts, marked
            summary = summarise(json.loads(part_out.read_text()), args.warmup, tokens)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError, OSError) as exc:  # recorded, the rest still run
            res.setdefault("failed", {})[part] = f"{type(exc).__name__}: {exc}"
            _log(f"{part} failed: {exc}")
            continue
        if part == "ours":
            res["ours"] = summary
        else:
            res["trl"][part.split(":", 1)[1]] = summary
        save()
    save()
    brief = {"ours_tokens_per_s": res.get("ours", {}).get("tokens_per_s"),
             "trl_tokens_per_s": {v: r["tokens_per_s"] for v, r in res["trl"].items()}, "targets": res["targets"]}
    print(json.dumps(res if args.json else brief, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
