"""`postrain grpo` end to end on real components (Ray rollout workers, the SQLite data plane, the learner):
a seeded run on `reverse` raises greedy eval pass@1; a one-step-off run under chaos (preempted and
killed rollout workers) completes every trajectory and trains on exactly what the fault-free run trains
on; a run stopped after a checkpoint and resumed repeats the uninterrupted run's metrics."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from core import config
from core.errors import UserError
from deploy.grpo_config import GRPOLoopConfig
from deploy.grpo_loop import TIMING_KEYS, run_grpo

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
# Counters of the rollout pool that legitimately differ between a chaos run and a fault-free one.
POOL_KEYS = ("faults", "faults_survived", "recovery_s_max", "replacements", "completed", "tokens_lost",
             "tokens_resampled")
BASE = ["sampling.max_new_tokens=12", "eval.max_new_tokens=12", "eval.n=16", "learner.threads=1",
        "learner.device=cpu", "pool.workers=1", "loop.eval_every=0"]


def _rows(out, stage):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if f'"{stage}"' in line]


def _seeded(row):
    return {k: v for k, v in row.items() if k not in TIMING_KEYS and k not in POOL_KEYS}


def test_grpo_run_raises_eval_pass_at_1(tmp_path, reverse_base):
    """Subprocess on the shipped loop config with one-step-off rollouts (fast batched decode, 32 prompts × 8,
    4 minibatches per iteration), lr 2e-4 for the 80k-parameter policy: greedy pass@1 on 128 fixed eval
    prompts climbs.
    An unchanged policy evaluates identically (greedy), so any gain is the training's."""
    out = tmp_path / "run"
    sets = ["sampling.max_new_tokens=12", "eval.max_new_tokens=12", "eval.n=128", "learner.device=cpu",
            "loop.eval_every=10", "optim.lr=2e-4", "loop.async_rollouts=true"]
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "grpo", "--domain", "reverse", "--init", str(reverse_base),
                          "--iterations", "30", "--out", str(out), "--quiet", *(a for kv in sets for a in ("--set", kv))],
                         capture_output=True, text=True, timeout=900, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    evals = _rows(out, "eval")
    assert [r["iteration"] for r in evals] == [0, 10, 20, 30] and all(r["eval_n"] == 128 for r in evals)
    pass_at_1 = [r["eval_pass_at_1"] for r in evals]
    assert pass_at_1[-1] >= pass_at_1[0] + 0.05, pass_at_1  # measured 0.586 -> 0.695 (21 s)
    assert max(pass_at_1[1:]) > pass_at_1[0], pass_at_1
    train = _rows(out, "train")
    assert [r["iteration"] for r in train] == list(range(1, 31))
    assert all(r["completed"] == 256 for r in train)
    assert train[0]["staleness_max"] == 0 and all(r["staleness_max"] == 1 for r in train[1:])  # one-step-off
    assert [r["policy_version"] for r in train] == list(range(1, 31))
    assert all(r["optimizer_steps"] >= 3 for r in train)  # loop.minibatches = 4 (packing keeps groups whole)
    # Outputs: curve, checkpoints, an HF checkpoint `postrain eval` takes, whose weights moved.
    from core.hf import load_policy

    assert (out / "grpo.png").stat().st_size > 0 and (out / "checkpoints" / "latest").is_file()
    before, after = load_policy(reverse_base)[0].state_dict(), load_policy(out / "final")[0].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def _cfg(*extra):
    # strict decode: a resumed or chaos run must sample exactly what the uninterrupted one samples
    return config.load(GRPOLoopConfig, None, BASE + ["engine.strict=true", "loop.minibatches=1",
                                                     "optim.lr=5e-4", "loop.prompts_per_iteration=4", "loop.group_size=4",
                                                     "loop.async_rollouts=true", "loop.checkpoint_every=1",
                                                     "staleness.bound=1", *extra])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, reverse_base):
    out = tmp_path_factory.mktemp("grpo") / "straight"
    run_grpo(_cfg(), "reverse", reverse_base, out, iterations=2, quiet=True)
    return out


def test_one_step_off_rollouts_are_one_version_stale(uninterrupted):
    train = _rows(uninterrupted, "train")
    assert train[0]["staleness_max"] == 0  # the first batch is sampled before any update
    assert abs(train[0]["ratio_mean"] - 1) < 1e-4  # the learner scores the rollout's tokens as sampled
    for r in train[1:]:  # the rest were sampled while the learner trained on the previous batch
        assert r["staleness_max"] == 1 and r["staleness_hist_1"] == r["loss_tokens"] > 0, r
        assert r["stale_tokens_removed"] == 0  # within the bound of 1


def test_resumed_run_repeats_uninterrupted_metrics(tmp_path, reverse_base, uninterrupted):
    out = tmp_path / "resumed"
    first = run_grpo(_cfg(), "reverse", reverse_base, out, iterations=2, quiet=True, stop_after=1)
    assert first["final"] is None and first["iterations_done"] == 1
    run_grpo(_cfg(), "reverse", reverse_base, out, iterations=2, quiet=True, resume=True)
    a, b = _rows(uninterrupted, "train"), _rows(out, "train")
    assert [r["iteration"] for r in b] == [1, 2]
    assert [_seeded(r) for r in a] == [_seeded(r) for r in b]
    assert [_seeded(r) for r in _rows(uninterrupted, "eval")] == [_seeded(r) for r in _rows(out, "eval")]


def test_prompt_replay_resumes_exactly(tmp_path, reverse_base):
    # Replayed prompts depend on earlier batches' rewards: a resumed run must rebuild the queue.
    cfg = _cfg("loop.replay_share=0.5", "loop.replay_max=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_grpo(cfg, "reverse", reverse_base, straight, iterations=3, quiet=True)
    run_grpo(cfg, "reverse", reverse_base, resumed, iterations=3, quiet=True, stop_after=2)
    run_grpo(cfg, "reverse", reverse_base, resumed, iterations=3, quiet=True, resume=True)
    a, b = _rows(straight, "train"), _rows(resumed, "train")
    assert [r["replayed_prompts"] for r in a][0] == 0 and sum(r["replayed_prompts"] for r in a[1:]) > 0, a
    assert all(r["replayed_prompts"] <= 2 for r in a)  # at most half of the 4 prompts
    assert [_seeded(r) for r in a] == [_seeded(r) for r in b]


def test_chaos_run_completes_and_trains_on_the_same_tokens(tmp_path, reverse_base, uninterrupted):
    out = tmp_path / "chaos"
    # one decode step per call: requests stay in flight across calls, so every fault finds one to hit
    cfg = _cfg("loop.chaos_faults=3", "pool.workers=2", "pool.steps_per_call=1")
    run_grpo(cfg, "reverse", reverse_base, out, iterations=2, chaos_seed=3, quiet=True)
    train = _rows(out, "train")
    assert all(r["completed"] == 16 and r["tokens_lost"] == 0 and r["tokens_resampled"] == 0 for r in train)
    assert all(r["faults"] == 3 == r["faults_survived"] for r in train)  # scheduled on progress: all of them fire
    # Faults (and 2 workers instead of 1) change nothing the learner sees: every trajectory resumed
    # from the WAL exactly as it would have run uninterrupted.
    assert [_seeded(r) for r in _rows(uninterrupted, "train")] == [_seeded(r) for r in train]


def test_bad_settings_are_one_clear_error(tmp_path, reverse_base):
    with pytest.raises(UserError, match="loss.temperature"):
        run_grpo(_cfg("sampling.temperature=0.5"), "reverse", reverse_base, tmp_path / "a", iterations=1)
    with pytest.raises(UserError, match="staleness.bound = 0"):
        run_grpo(_cfg("staleness.bound=0"), "reverse", reverse_base, tmp_path / "b", iterations=1)
    with pytest.raises(UserError, match="unknown domain"):
        run_grpo(_cfg(), "nope", reverse_base, tmp_path / "c", iterations=1)
    with pytest.raises(UserError, match="expected an HF checkpoint directory"):
        run_grpo(_cfg(), "reverse", tmp_path, tmp_path / "d", iterations=1)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "x").write_text("")
    with pytest.raises(UserError, match="not empty"):
        run_grpo(_cfg(), "reverse", reverse_base, tmp_path / "e", iterations=1)
    with pytest.raises(UserError, match="no GRPO run"):
        run_grpo(_cfg(), "reverse", reverse_base, tmp_path / "f", iterations=1, resume=True)


def test_a_mixture_of_domains_shares_the_prompts_and_evaluates_each(tmp_path, reverse_base):
    from deploy.grpo_loop import make_requests

    cfg = _cfg("loop.prompts_per_iteration=5")
    reqs = make_requests(cfg, ["arith", "reverse"], 0)
    by = {d: [r for r in reqs if r.domain == d] for d in ("arith", "reverse")}
    assert len(by["arith"]) == 3 * 4 and len(by["reverse"]) == 2 * 4  # 5 prompts x 4 samples, 3 + 2
    assert make_requests(cfg, ["arith", "reverse"], 0) == reqs and make_requests(cfg, ["arith", "reverse"], 1) != reqs
    run_grpo(_cfg(), ["arith", "reverse"], reverse_base, tmp_path / "mix", iterations=1, quiet=True)
    ev = _rows(tmp_path / "mix", "eval")[-1]
    assert ev["eval_pass_at_1"] == min(ev["eval_pass_at_1_arith"], ev["eval_pass_at_1_reverse"])
    assert json.loads((tmp_path / "mix" / "grpo_run.json").read_text())["domain"] == "arith+reverse"
    with pytest.raises(UserError, match="one domain at a time"):
        run_grpo(_cfg("loop.replay_share=0.5"), ["arith", "reverse"], reverse_base, tmp_path / "x", iterations=1)


def test_patience_ends_the_run_and_final_holds_the_best_eval(tmp_path, reverse_base):
    """Evals every iteration, patience 1 (this seeded run measured 0.625, 0.6875, 0.625: best at 1). The run
    ends at the first eval that beats no earlier one, final/ is the best eval's policy (it scores that eval's
    pass@1 again), and a run killed in between and resumed ends the same way with the same final/."""
    from core.hf import load_policy
    from learner.evaluate import evaluate

    cfg = _cfg("loop.eval_every=1", "loop.patience=1", "loop.final=best")
    out = tmp_path / "straight"
    res = run_grpo(cfg, "reverse", reverse_base, out, iterations=8, quiet=True)
    evals = [(r["iteration"], r["eval_pass_at_1"]) for r in _rows(out, "eval")]
    first_stale = next((i for (i, p), prev in zip(evals[1:], evals) if p <= max(q for j, q in evals if j < i)), None)
    assert first_stale is not None and first_stale >= 2, evals  # a best after the start, then a stall
    assert res["iterations_done"] == first_stale == evals[-1][0] < 8, (res, evals)
    assert _rows(out, "patience")[0]["best_iteration"] == res["best"]["iteration"]
    best_i, best_p = max(evals, key=lambda e: (e[1], -e[0]))
    assert res["best"] == {"iteration": best_i, "pass_at_1": best_p, "final": "best"}
    model, tok = load_policy(out / "final")
    assert evaluate(model, tok, "reverse", cfg.eval)["pass_at_1"] == best_p
    assert sorted(p.name for p in (out / "best").iterdir()) == [f"it{best_i}"]

    resumed = tmp_path / "resumed"
    run_grpo(cfg, "reverse", reverse_base, resumed, iterations=8, quiet=True, stop_after=max(1, first_stale - 1))
    again = run_grpo(cfg, "reverse", reverse_base, resumed, iterations=8, quiet=True, resume=True)
    assert again["iterations_done"] == res["iterations_done"] and again["best"] == res["best"]
    a, b = load_policy(out / "final")[0].state_dict(), load_policy(resumed / "final")[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_final_ema_holds_the_average_and_a_resumed_run_ends_with_the_same(tmp_path, reverse_base):
    """loop.final = "ema": final/ is the average of every iteration's policy (not the last iterate), evaluated
    once more in a `final` row; its state rides in each checkpoint, so a run stopped and resumed writes the
    same final/; a run resumed from a checkpoint saved without one starts the average afresh and says so."""
    from core.hf import load_policy
    from learner.checkpoint import latest_checkpoint, load_extra
    from learner.evaluate import evaluate

    cfg = _cfg("loop.final=ema", "loop.ema_decay=0.5")
    out = tmp_path / "straight"
    res = run_grpo(cfg, "reverse", reverse_base, out, iterations=4, quiet=True)
    final_row = _rows(out, "final")[0]
    assert res["final_eval"]["eval_pass_at_1"] == final_row["eval_pass_at_1"] and final_row["iteration"] == 4
    model, tok = load_policy(out / "final")
    assert evaluate(model, tok, "reverse", cfg.eval)["pass_at_1"] == final_row["eval_pass_at_1"]
    last = load_policy(latest_checkpoint(out / "checkpoints") / "model")[0].state_dict()
    ema = model.state_dict()
    assert any(not torch.equal(ema[k], last[k]) for k in ema)
    assert int(load_extra(latest_checkpoint(out / "checkpoints"), "ema")[1]["updates"]) == 4

    resumed = tmp_path / "resumed"
    run_grpo(cfg, "reverse", reverse_base, resumed, iterations=4, quiet=True, stop_after=2)
    run_grpo(cfg, "reverse", reverse_base, resumed, iterations=4, quiet=True, resume=True)
    again = load_policy(resumed / "final")[0].state_dict()
    assert all(torch.equal(ema[k], again[k]) for k in ema)

    plain = tmp_path / "switched"
    run_grpo(_cfg(), "reverse", reverse_base, plain, iterations=4, quiet=True, stop_after=2)
    run_grpo(cfg, "reverse", reverse_base, plain, iterations=4, quiet=True, resume=True)
    assert [{k: v for k, v in r.items() if k != "time_s"} for r in _rows(plain, "ema") if r["stage"] == "ema"] == \
        [{"stage": "ema", "iteration": 2, "restarted": True}]
    assert int(load_extra(latest_checkpoint(plain / "checkpoints"), "ema")[1]["updates"]) == 2
