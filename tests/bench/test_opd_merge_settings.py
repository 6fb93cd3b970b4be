"""bench.opd_merge runs each method as the pipeline runs it and scores what a run leaves in final/."""
import json

from bench.opd_merge import _last_eval, pipeline_sets


def test_the_pipeline_settings_come_from_its_config_without_per_domain_keys(tmp_path):
    sets = pipeline_sets()
    assert "loop.final=ema" in sets["opd"] and "loop.final=ema" in sets["grpo"]
    assert not any(x.startswith("domain.") for x in sets["grpo"])
    toml = tmp_path / "pipeline.toml"
    toml.write_text('[merge]\nset = ["optim.lr=1e-4"]\n[specialists]\nset = ["loop.seed=3", "domain.calc.optim.lr=1"]\n')
    assert pipeline_sets(toml) == {"opd": ["optim.lr=1e-4"], "grpo": ["loop.seed=3"]}


def test_an_averaged_final_is_scored_by_its_own_evaluation(tmp_path):
    rows = [{"stage": "eval", "iteration": 10, "eval_pass_at_1_a": 0.5},
            {"stage": "train", "iteration": 11},
            {"stage": "eval", "iteration": 20, "eval_pass_at_1_a": 0.7}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _last_eval(tmp_path, ["a"]) == {"a": 0.7}  # final/ is the last iterate
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"stage": "final", "iteration": 20, "eval_pass_at_1_a": 0.8}) + "\n")
    assert _last_eval(tmp_path, ["a"]) == {"a": 0.8}  # final/ is the average: its own row
