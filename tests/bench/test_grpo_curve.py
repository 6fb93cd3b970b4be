"""bench grpo_curve_h200 (pass@1 per minute, ours against TRL, from one SFT base): the wall-time snapshot
rule both sides share, the curve summary, the config both sides are given, ours' stage code under a wall
budget, and (slow) the whole benchmark at a toy shape on the CPU."""
from __future__ import annotations

import json
import time

import pytest
import torch

from bench import grpo_curve_h200 as gc
from bench.wall_snapshots import BASE, WallSnapshots, marks


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _weights(v: float) -> dict:
    return {"w": torch.full((2, 3), v), "b": torch.tensor([v])}


def test_marks_end_at_the_budget():
    assert marks(60, 20) == [20, 40, 60.0]
    assert marks(50, 20) == [20, 40, 50.0]
    with pytest.raises(ValueError):
        marks(60, 0)


def test_a_mark_gets_the_policy_after_the_last_step_that_ended_before_it(tmp_path):
    clock = FakeClock()
    snaps = WallSnapshots(0.0, 20, 5, clock=clock)
    steps = [(6.0, 1.0), (7.0, 2.0), (12.0, 3.0), (26.0, 4.0)]  # (end time, weights after the step)
    stops = []
    for end, v in steps:
        clock.now = end
        stops.append(snaps.after_step(_weights(v)))
    assert stops == [False, False, False, True] and snaps.steps == 4
    rows = snaps.write(tmp_path)
    assert [(r["mark_s"], r["step"]) for r in rows] == [(5, 0), (10, 2), (15, 3), (20.0, 3)]
    assert rows[0]["path"] == BASE  # no step had ended by 5 s
    from safetensors.torch import load_file

    assert float(load_file(rows[1]["path"])["b"]) == 2.0  # the step that ended at 7 s, not the one at 12 s
    assert float(load_file(rows[3]["path"])["b"]) == 3.0  # at 20 s: the step of 12 s (the next ended at 26 s)


def test_a_step_recorded_before_the_budget_ended_before_it():
    clock = FakeClock()
    snaps = WallSnapshots(0.0, 3, 1, clock=clock)
    clock.now = 2.9996  # just short of the budget: the run goes on, and the record must say so
    assert not snaps.after_step(_weights(1.0))
    assert snaps.step_end_s[-1] < 3.0
    clock.now = 3.02
    assert snaps.after_step(_weights(2.0)) and snaps.step_end_s[-1] >= 3.0


def test_snapshots_are_copies_not_the_live_tensors():
    clock, live = FakeClock(), _weights(1.0)
    snaps = WallSnapshots(0.0, 10, 5, clock=clock)
    clock.now = 1.0
    snaps.after_step(live)
    live["b"].fill_(9.0)  # the optimizer updates the parameters in place
    clock.now = 6.0
    snaps.after_step(live)
    assert float(snaps.taken[0]["weights"]["b"]) == 1.0


def test_curve_summary_reads_matched_marks_only():
    ours = [{"t_s": 20, "pass_at_1": 0.5}, {"t_s": 40, "pass_at_1": 0.7}, {"t_s": 60.0, "pass_at_1": 0.8}]
    trl = [{"t_s": 20, "pass_at_1": 0.4}, {"t_s": 40, "pass_at_1": 0.5}]
    s = gc.curve_summary(ours, trl, base=0.4, budget_s=60)
    assert s["matched_times_s"] == [20, 40] and s["final_time_s"] == 40 and not s["final_is_budget"]
    assert s["mean_ours"] == pytest.approx(0.6) and s["mean_trl"] == pytest.approx(0.45)
    assert s["final_ratio"] == pytest.approx(0.7 / 0.5)
    assert s["gain_per_minute_ours"] == pytest.approx(0.3 * 60 / 40) and s["gain_per_minute_trl"] == pytest.approx(0.15)
    assert gc.curve_summary(ours, [], 0.4, 60) == {"matched_times_s": []}


def test_both_sides_get_the_shipped_config_but_placement_and_lr():
    from bench.trl_grpo import trl_kwargs
    from deploy.grpo_config import load_for_domain

    toml = gc.ROOT / "configs" / "grpo_loop.toml"
    shipped = load_for_domain(toml, gc.DOMAIN, [])
    cfg = load_for_domain(toml, gc.DOMAIN, gc.curve_sets(False, 7e-6, 9))
    assert cfg.optim.lr == 7e-6 and cfg.optim.model_dump() == shipped.optim.model_copy(update={"lr": 7e-6}).model_dump()
    for table in ("loss", "advantages", "sampling", "loop", "staleness"):
        assert getattr(cfg, table) == getattr(shipped, table), table
    assert cfg.engine.max_batch == 256 and cfg.engine.max_len == 9 + 48 + 8
    kw = trl_kwargs(cfg.model_dump(), 0, "x")
    assert (kw["learning_rate"], kw["num_generations"], kw["per_device_train_batch_size"], kw["temperature"]) == \
        (7e-6, 8, 64, 0.7)


def test_ours_stops_at_the_wall_budget_and_saves_its_snapshots(tmp_path):
    from bench.grpo_iteration import TINY_MODEL, make_checkpoint
    from deploy.grpo_stages import main

    ckpt = make_checkpoint(tmp_path / "init", TINY_MODEL)
    spec = {"init": str(ckpt), "domain": gc.DOMAIN, "config": str(gc.ROOT / "configs" / "grpo_loop.toml"),
            "sets": gc.curve_sets(False, 1e-4, 9) + ["loop.prompts_per_iteration=4", "loop.group_size=2",
                                                     "sampling.max_new_tokens=4"],
            "out": str(tmp_path / "ours"), "iterations": 1000, "ignore_eos": False,
            "times_out": str(tmp_path / "times.json"), "config_out": str(tmp_path / "config.json"),
            "budget_s": 3.0, "snapshot_every_s": 1.0, "clock_start_unix": time.time(),
            "snapshots_out": str(tmp_path / "snaps")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert main([str(tmp_path / "spec.json")]) == 0
    res = json.loads((tmp_path / "times.json").read_text())
    assert [r["mark_s"] for r in res["snapshots"]] == [1.0, 2.0, 3.0]
    ends = res["step_end_s"]
    assert ends[-1] >= 3.0 and all(e < 3.0 for e in ends[:-1])  # the run ended at the first update past the budget
    assert len(res["iterations"]) == len(res["step_end_s"]) < 1000
    assert all(r["path"] == BASE or (tmp_path / "snaps").joinpath(r["path"].rsplit("/", 1)[1]).is_file()
               for r in res["snapshots"])


def test_a_used_work_directory_is_refused(tmp_path, capsys):
    (tmp_path / "ours").mkdir()
    assert gc.main(["--tiny", "--work", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.slow
def test_the_benchmark_at_a_toy_shape_on_the_cpu(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "res.json"
    assert gc.main(["--tiny", "--budget-s", "20", "--every-s", "10", "--work", str(tmp_path / "w"),
                    "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "failed" not in res and res["summary"]["matched_times_s"] == [10.0, 20.0]
    assert res["ours"]["iterations"] > 0 and res["trl"]["optimizer_steps"] >= 0
    assert set(res["curves"]) == {"ours", "trl"} and res["eval"]["n"] == 256
