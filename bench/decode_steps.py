"""Decode step time of the engine's GPU decode modes, side by side, at the GRPO bench's and the rollout
bench's shapes: the static all-slot CUDA graph (one host round trip per step), the chunked decoder
(steps fed back on the device) with the eager lean forward and with it compiled. Each mode decodes the
same prompts with the same seed; agreement of the tokens with the static mode is printed beside the
time (bf16 rounding differs between the forwards, so early divergence is expected to be rare, not
absent). With --profile, the compiled chunk's CUDA kernels by total time (torch.profiler).

    python -m bench.decode_steps [--shapes 256x16x256,64x128x256] [--chunk 16] [--profile] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from core.cli_args import positive_int
from rollout.sampling import SamplingParams

def _profile(eng, prompts, N) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from rollout.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=N, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add(f"p{i}", p, [False] * len(p), params)
    eng.accept_steps(eng.collect_steps(eng.launch(1)))  # prefill outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        pending = eng.launch(eng.chunk.max_chunk)
        eng.accept_steps(eng.collect_steps(pending))
        torch.cuda.synchronize()
    for i in range(len(prompts)):
        eng.remove(f"p{i}")
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.key and not ev.key.startswith(("ProfilerStep", "cudaGraph")):
            rows.append({"kernel": ev.key[:90], "us_total": round(t, 1), "calls": ev.count})
    rows.sort(key=lambda r: -r["us_total"])
    return rows[:25]


def forced_logit_error(model, prompts, steps: int, chunk: int) -> dict:
    """Each mode's logits along one forced continuation (random tokens fed as if drawn), against a float32
    copy of the model run over the whole sequence: ‖logits − ref‖ / ‖ref‖ and the largest log-prob
    difference. The chunked modes run without their CUDA graph here, so their forward can be watched."""
    import copy

    from rollout.engine import Draw, Engine

    B, P, V = len(prompts), len(prompts[0]), model.config.vocab_size
    dev = next(model.parameters()).device
    cont = torch.randint(3, V, (B, steps), generator=torch.Generator().manual_seed(1))
    full = torch.cat([torch.tensor(prompts), cont], 1).to(dev)
    ref_model = copy.deepcopy(model).float()
    with torch.inference_mode():
        ref = ref_model(full).logits[:, P - 1:P - 1 + steps].float()
    del ref_model
    out = {}
    for name, kw in (("static", dict(static_decode=True)), ("chunk", dict(decode_chunk=chunk)),
                     ("chunk_compiled", dict(decode_chunk=chunk, compile_decode=True))):
        eng = Engine(model, None, seed=0, max_batch=B, max_len=P + steps + 8, device=str(dev), **kw)
        seen = []
        if eng.chunk is not None:
            fwd = eng.chunk._fwd
            eng.chunk._fwd = lambda *a, fwd=fwd: seen.append(fwd(*a).float()) or seen[-1]
        else:
            fwd = eng.static.forward
            eng.static.forward = lambda rows, fwd=fwd: seen.append(fwd(rows).float()) or seen[-1]
        for i, p in enumerate(prompts):
            eng.add(f"f{i}", p, [False] * P, SamplingParams(max_new_tokens=steps, ignore_eos=True))
        for k in range(steps):
            draws = eng.collect(eng.launch(1))
            eng.accept([Draw(d.req_id, d.position, int(cont[int(d.req_id[1:]), k]), d.logprob) for d in draws])
        got = torch.stack([x[:B] for x in seen], 1)  # [B, steps, V]: slots 0..B-1 hold the rows in order
        lp_diff = (torch.log_softmax(got.double(), -1) - torch.log_softmax(ref.double(), -1)).abs().max().item()
        out[name] = {"rel_err": float(f"{((got - ref).norm() / ref.norm()).item():.3g}"), "max_logprob_diff": float(f"{lp_diff:.3g}")}
        print("forced", name, out[name], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM

    from bench.rollout import _prompts, agreement, engine_tps, qwen2_05b_config

    ap = argparse.ArgumentParser(prog="python -m bench.decode_steps", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="256x16x256,64x128x256", help="BxPxN, comma-separated")
    ap.add_argument("--chunk", type=positive_int, default=16)
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--modes", default="static,chunk,chunk_compiled")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--forced", action="store_true", help="logit error of each mode along a forced continuation")
    ap.add_argument("--out")
    ap.add_argument("--small", action="store_true", help="a toy model on the CPU (a check of the script)")
    args = ap.parse_args(argv)
    dev = "cpu" if args.small else "cuda"
    cfg = qwen2_05b_config(max_positions=4096, small=args.small)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                 dtype=torch.float32 if args.small else torch.bfloat16).eval()
    modes = {"static": dict(static=True), "chunk": dict(static=True, decode_chunk=args.chunk),
             "chunk_compiled": dict(static=True, decode_chunk=args.chunk, compile_decode=True)}
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__, "chunk": args.chunk, "shapes": []}
    if args.forced:
        res["forced_logits"] = forced_logit_error(model, _prompts(16, 16, cfg.vocab_size), 24, args.chunk)
    for shape in filter(None, args.shapes.split(",")):
        B, P, N = map(int, shape.split("x"))
        prompts = _prompts(B, P, cfg.vocab_size)
        row = {"batch": B, "prompt": P, "new_tokens": N}
        ref = None
        for name in args.modes.split(","):
            t0 = time.perf_counter()
            try:
                tps, tokens, eng = engine_tps(model, None, prompts, N, dev, reps=args.reps, stat=statistics.median,
                                              **modes[name])
            except Exception as exc:  # one mode failing must not hide the others
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                print(shape, name, row[name], flush=True)
                continue
            ref = ref if ref is not None else tokens
            row[name] = {"tokens_per_s": round(tps, 1), "step_ms": round(1e3 * B / tps, 3),
                         "agreement_with_first": round(agreement(ref, tokens), 4),
                         "wall_s_with_warmup": round(time.perf_counter() - t0, 1)}
            print(shape, name, row[name], flush=True)
            if args.profile and name == args.modes.split(",")[-1]:
                row["profile_" + name] = _profile(eng, prompts, N)
                for r in row["profile_" + name][:15]:
                    print(f"  {r['us_total']:>10.1f} us {r['calls']:>6} {r['kernel']}")
            del eng
            torch.cuda.empty_cache()
        res["shapes"].append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    print(json.dumps([{k: v for k, v in r.items() if not k.startswith("profile")} for r in res["shapes"]], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
