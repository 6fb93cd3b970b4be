"""Typed configs: every shipped file parses; overrides, unknown keys and bounds give one clear line."""
from pathlib import Path

import pytest

from core import config
from deploy.config_registry import SHIPPED, load_shipped
from core.errors import UserError
from deploy.job_config import JobConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.*"))


def test_configs_dir_not_empty():
    assert any(p.stem == "job" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    assert path.stem in SHIPPED, f"{path.name} is not registered in deploy/config_registry.py"
    cfg = load_shipped(path)
    assert cfg.model_dump()  # validated, non-empty


def test_overrides_apply_with_types():
    cfg = config.load(JobConfig, None, ["sft.steps=7", "sft.domains=[\"arith\"]", "eval.temperature=0.5"])
    assert (cfg.sft.steps, cfg.sft.domains, cfg.eval.temperature) == (7, ["arith"], 0.5)


def test_unknown_key_names_it_and_lists_known():
    with pytest.raises(UserError, match=r"unknown key 'sft\.stepz'.*steps"):
        config.load(JobConfig, None, ["sft.stepz=7"])


@pytest.mark.parametrize("override,key", [("sft.lr=-1", "sft.lr"), ("policy.num_layers=0", "policy.num_layers"),
                                          ("eval.n=abc", "eval.n")])
def test_out_of_bounds_or_wrong_type(override, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        config.load(JobConfig, None, [override])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="KEY=VALUE"):
        config.load(JobConfig, None, ["sft.steps"])
    with pytest.raises(UserError, match="not found"):
        config.load(JobConfig, tmp_path / "nope.toml")


def test_yaml_and_toml_agree_and_dump_round_trips(tmp_path):
    (tmp_path / "a.yaml").write_text("sft:\n  steps: 11\n")
    (tmp_path / "a.toml").write_text("[sft]\nsteps = 11\n")
    a, b = config.load(JobConfig, tmp_path / "a.yaml"), config.load(JobConfig, tmp_path / "a.toml")
    assert a == b and a.sft.steps == 11
    config.dump(a, tmp_path / "out.json")
    import json

    assert JobConfig.model_validate(json.loads((tmp_path / "out.json").read_text())) == a


def test_bad_toml_is_one_clear_error(tmp_path):
    (tmp_path / "bad.toml").write_text("[sft\nsteps=")
    with pytest.raises(UserError, match="does not parse"):
        config.load(JobConfig, tmp_path / "bad.toml")


def test_every_field_documented_and_bounded_numbers():
    from pydantic import BaseModel

    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann)
            elif ann in (int, float):
                assert field.metadata, f"{model.__name__}.{name} has no bounds"

    walk(JobConfig)


def test_grpo_domain_tables_apply_to_their_domain_and_set_wins(tmp_path):
    from deploy.grpo_config import load_for_domain

    p = tmp_path / "g.toml"
    p.write_text("[optim]\nlr = 5e-5\n[loop]\ngroup_size = 4\n[domain.calc.optim]\nlr = 1e-4\n[domain.calc.loop]\ngroup_size = 6\n")
    calc, arith = load_for_domain(p, "calc"), load_for_domain(p, "arith")
    assert (calc.optim.lr, calc.loop.group_size) == (1e-4, 6)
    assert (arith.optim.lr, arith.loop.group_size) == (5e-5, 4)
    assert load_for_domain(p, "calc", ["optim.lr=2e-5"]).optim.lr == 2e-5  # the command line beats the file
    assert load_for_domain(p, "calc", ["domain.calc.optim.lr=3e-5"]).optim.lr == 3e-5  # ... and may edit a domain table
    assert load_for_domain(p, "arith", ["domain.calc.optim.lr=3e-5"]).optim.lr == 5e-5
    assert load_for_domain(p, "calc").optim.warmup_steps == arith.optim.warmup_steps  # untouched keys kept


def test_grpo_domain_table_with_a_bad_key_fails_at_load(tmp_path):
    from deploy.grpo_config import load_for_domain

    p = tmp_path / "g.toml"
    p.write_text("[domain.calc.optim]\nlrr = 1e-4\n")
    with pytest.raises(UserError, match=r"\[domain\.calc\].*optim\.lrr"):
        load_for_domain(p, "arith")  # checked even when another domain runs
    p.write_text("[domain]\ncalc = 3\n")
    with pytest.raises(UserError, match="one table per domain"):
        load_for_domain(p, "calc")


def test_shipped_grpo_config_gives_calc_its_own_lr():
    from deploy.commands._common import default_config
    from deploy.grpo_config import load_for_domain

    path = default_config("grpo_loop")
    assert load_for_domain(path, "calc").optim.lr == 2 * load_for_domain(path, "arith").optim.lr
