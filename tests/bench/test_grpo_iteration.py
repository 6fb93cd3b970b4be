"""bench grpo_iteration (one whole GRPO iteration, ours against TRL): at a toy shape both sides generate
completions of exactly max_new_tokens, ours takes exactly M optimizer steps, the plan budget and the
target's rules."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench import grpo_iteration as gi


def _setup(tmp_path, iterations=2):
    return gi._setup(argparse.Namespace(tiny=True, work=str(tmp_path), iterations=iterations))


def _cfg(sets):
    from deploy.grpo_config import load_for_domain

    return load_for_domain(gi.ROOT / "configs" / "grpo_loop.toml", gi.DOMAIN, sets)


def test_padded_tokenizer_keeps_the_character_ids_and_decodes_every_id():
    from learner.tokenizer import char_tokenizer

    tok, chars = gi.padded_char_tokenizer(300), char_tokenizer()
    assert len(tok) == 300 and tok.encode("12+34=") == chars.encode("12+34=")
    assert tok.decode([299, 200]) == "<f200><f101>"  # 99 characters and specials first
    with pytest.raises(ValueError, match="character vocabulary"):
        gi.padded_char_tokenizer(50)


def test_plan_budget_gives_exactly_m_minibatches():
    shape = {"prompts": 8, "group": 4, "max_new_tokens": 10, "minibatches": 4}
    budget = gi.plan_budget([[5, 7, 6, 5, 6, 7, 5, 5]], shape)
    assert budget == 2 * 4 * (7 + 10) and 3 * 4 * (5 + 10) > budget
    with pytest.raises(ValueError, match="whole groups"):
        gi.plan_budget([[5] * 8], shape | {"minibatches": 3})
    with pytest.raises(ValueError, match="no budget"):
        gi.plan_budget([[1, 100, 1, 1, 1, 1, 1, 1]], shape)


def test_ours_on_the_cpu_generates_max_new_tokens_and_takes_m_steps(tmp_path):
    from deploy.grpo_stages import run_stages

    cuda, _, shape, _, ckpt, sets, tokens = _setup(tmp_path)
    cfg = _cfg(sets)
    assert not cuda and cfg.advantages.filter_zero_variance is False
    assert (tmp_path / "config.json").is_file()  # the resolved config the TRL side maps
    out = run_stages(cfg, gi.DOMAIN, ckpt, tmp_path / "ours", 2, ignore_eos=True)
    assert len(out["times_s"]) == 2 and all(t > 0 for t in out["times_s"])
    for row in out["iterations"]:
        assert row["optimizer_steps"] == shape["minibatches"]
        assert row["completion_len_min"] == row["completion_len_max"] == shape["max_new_tokens"]
        assert row["completion_tokens"] == shape["prompts"] * shape["group"] * shape["max_new_tokens"]
    summary = gi.summarise(out, 1, tokens)
    assert summary["timed_s"] == out["times_s"][1:] and summary["tokens_per_s"] == tokens[1] / out["times_s"][1]


def test_trl_on_the_cpu_generates_max_new_tokens(tmp_path):
    pytest.importorskip("trl")
    cuda, _, shape, _, ckpt, sets, _ = _setup(tmp_path)
    out = gi.run_trl(ckpt, _cfg(sets).model_dump(), tmp_path / "trl", 2, "default", cuda)
    assert len(out["times_s"]) == 2
    assert out["completion_len_min"] == out["completion_len_max"] == shape["max_new_tokens"]
    assert out["completions"] == 2 * shape["prompts"] * shape["group"]


@pytest.mark.slow
def test_the_bench_runs_ours_in_its_own_process(tmp_path):
    out = tmp_path / "res.json"
    assert gi.main(["--tiny", "--sides", "ours", "--iterations", "2", "--work", str(tmp_path / "w"),
                    "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["ours"]["times_s"]) == 2 and res["ours"]["tokens_per_s"] > 0 and "failed" not in res
    assert res["targets"][gi.TARGET]["value"] is None  # no TRL side, no H200


def test_target_is_measured_on_an_h200_only():
    ours, trl = {"tokens_per_s": 300.0}, {"default": {"tokens_per_s": 100.0}, "bf16_weights": {"tokens_per_s": 150.0}}
    t = gi.target(ours, trl, True, "NVIDIA H200")
    assert (t["value"], t["met"], t["trl_variant"]) == (2.0, False, "bf16_weights")
    cpu = gi.target(ours, trl, False, "AMD EPYC")
    assert cpu["value"] is None and cpu["measured_here"] == 2.0
    assert gi.target(None, trl, True, "NVIDIA H200")["value"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ours_on_cuda_at_a_toy_shape(tmp_path):
    from core.hf import load_tokenizer
    from deploy.grpo_stages import run_stages

    ckpt = gi.make_checkpoint(tmp_path / "init", gi.TINY_MODEL)
    shape = gi.TINY_SHAPE
    cfg = _cfg(gi.loop_sets(shape, True, gi.prompt_lengths(load_tokenizer(ckpt), shape, 2)))
    assert cfg.engine.device == "cuda" and cfg.engine.dtype == "bfloat16" and cfg.engine.cuda_graphs
    out = run_stages(cfg, gi.DOMAIN, ckpt, tmp_path / "ours", 2, ignore_eos=True)
    assert [r["optimizer_steps"] for r in out["iterations"]] == [shape["minibatches"]] * 2
