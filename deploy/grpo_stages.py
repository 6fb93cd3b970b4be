"""`postrain grpo`'s iteration in one process, timed: the loop's own stages without Ray's actors.

Each iteration k: the loop's requests (`GRPOLoop._requests`) → an in-process `RolloutWorker` (the
rollout engine, its token WAL, the domain's verifier) decodes them, the finished trajectories go to the
data plane through the loop's sink (acknowledged, then finalized in the WAL, as the pool does) →
`GRPOLoop._train` (group advantages from the catalog, the group-aware plan, one learner step per
minibatch on a one-rank `LearnerGroup`, in process as `learner.ranks = 1` runs) → `publish` and the new
weights into the worker (the learner's live tensors copied into the engine's parameters in place, device
to device: no host round trip; the engine hashes its weights only when a KV snapshot needs it). What `postrain grpo` adds around it is left out: the Ray pool and its calls,
the weights through Ray's object store, evals, checkpoints, retention. The device is synchronised at
the end of each iteration. `bench/grpo_iteration.py` measures it as ours against TRL.

    python -m deploy.grpo_stages SPEC.json

SPEC: `init` (HF checkpoint), `domain`, `config` (a loop config file) and `sets` (overrides), `out` (a
fresh run directory), `iterations`, `ignore_eos` (every completion max_new_tokens long), `config_out`
(the resolved config as JSON), `times_out` (the times, rewritten after every iteration; null = resolve
and write the config only). A learning curve adds `budget_s`, `snapshot_every_s`, `clock_start_unix`
(when the caller launched this process) and `snapshots_out`: the run ends once `budget_s` has passed on
that clock, and the policy as of every `snapshot_every_s` mark (`bench.wall_snapshots`) is saved there
afterwards and listed in `times_out` under `snapshots`.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_stages(cfg, domain: str, init: str | Path, out: str | Path, iterations: int, ignore_eos: bool = False,
               progress=None, after_iteration=None) -> dict:
    """`iterations` iterations; per iteration its time, rollout time, optimizer steps and completion
    lengths (`progress(result so far)` after each). `after_iteration(weights)` (the published policy's
    live tensors) returning True ends the run early."""
    import dataplane
    from deploy.grpo_loop import GRPOLoop, _IterationSink, batch_name
    from learner.group import LearnerGroup
    from rollout.worker import RolloutWorker, WorkerSpec

    out = Path(out)
    loop = GRPOLoop(cfg, domain, init, out, iterations, quiet=True)
    loop.dp = dataplane.open(loop.catalog, loop.store)
    loop.sink = _IterationSink(loop.catalog, loop.store)
    loop.group = LearnerGroup(cfg.learner_config(), str(loop.init))
    p = cfg.pool
    worker = RolloutWorker(WorkerSpec(
        name="w0", checkpoint=str(loop.init), wal_path=str(out / "rollout" / "wal"),
        snapshot_uri=str(out / "rollout" / "kv"), seed=p.seed, engine=cfg.engine, threads=p.threads_per_worker,
        max_commit_lag=p.max_commit_lag, commit_group_steps=p.commit_group_steps,
        wal_segment_bytes=p.wal_segment_bytes, split_restore=p.split_restore))
    rows = []
    try:
        for k in range(iterations):
            _sync()
            t0 = time.perf_counter()
            requests = loop._requests(k)
            if ignore_eos:
                requests = [dataclasses.replace(r, params=dataclasses.replace(r.params, ignore_eos=True))
                            for r in requests]
            loop.sink.start(batch_name(k))
            worker.submit(requests)
            left, acks, lengths = len(requests), [], []
            while left:
                worker.finalize(acks)  # acknowledged on the next call, once the sink holds them (as the pool does)
                rep = worker.run(p.steps_per_call)
                loop.sink.put(rep.finished)
                acks = [f.traj_id for f in rep.finished]
                lengths += [len(f.tokens) - f.prompt_len for f in rep.finished]
                left -= len(rep.finished)
            worker.finalize(acks)
            t_roll = time.perf_counter()
            train = loop._train(k)
            weights, version = loop.group.publish(live=True)  # same process: copied device to device
            worker.update_weights(weights, version)
            loop.dp.publish_policy_version(batch_name(k), version)
            _sync()
            t1 = time.perf_counter()
            rows.append({"iteration_s": t1 - t0, "rollout_s": t_roll - t0, "train_publish_s": t1 - t_roll,
                         "optimizer_steps": train["optimizer_steps"], "completion_tokens": sum(lengths),
                         "completion_len_min": min(lengths), "completion_len_max": max(lengths),
                         "reward_mean": train["reward_mean"]})
            print(f"[grpo stages] iteration {k}: {t1 - t0:.3f} s (rollout {t_roll - t0:.3f} s)", file=sys.stderr,
                  flush=True)
            if progress is not None:
                progress({"times_s": [r["iteration_s"] for r in rows], "iterations": rows})
            if after_iteration is not None and after_iteration(weights):
                break
    finally:
        worker.close()
        loop.group.close()
        loop.sink.close()
        loop.dp.close()
    return {"times_s": [r["iteration_s"] for r in rows], "iterations": rows}


def main(argv: list[str] | None = None) -> int:
    from deploy.grpo_config import load_for_domain

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m deploy.grpo_stages SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    cfg = load_for_domain(spec["config"], spec["domain"], spec["sets"])
    Path(spec["config_out"]).write_text(json.dumps(cfg.model_dump()))
    if spec.get("times_out"):
        def write(partial: dict) -> None:
            Path(spec["times_out"]).write_text(json.dumps(partial))

        snaps = None
        if spec.get("budget_s"):
            from bench.wall_snapshots import WallSnapshots

            snaps = WallSnapshots(spec["clock_start_unix"], spec["budget_s"], spec["snapshot_every_s"], sync=_sync)
        res = run_stages(cfg, spec["domain"], spec["init"], spec["out"], spec["iterations"], spec["ignore_eos"], write,
                         snaps.after_step if snaps else None)
        if snaps:  # written after the budget, outside it
            res |= {"snapshots": snaps.write(spec["snapshots_out"]), "step_end_s": snaps.step_end_s}
        write(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
