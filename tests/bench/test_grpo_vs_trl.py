"""bench grpo-vs-trl: both sides get the same train prompts in the same order and the same reward
function scores them; the matched-time statistics."""
from __future__ import annotations

import pytest

import rewards
from bench import grpo_vs_trl, trl_grpo
from core import config
from deploy.grpo_config import GRPOLoopConfig, load_for_domain
from deploy.grpo_loop import make_requests


def _cfg(*sets):
    return config.load(GRPOLoopConfig, None, list(sets))


@pytest.mark.parametrize("domain", ["arith", "reverse"])
def test_trl_dataset_is_the_loops_prompts_in_order(domain):
    cfg = load_for_domain(grpo_vs_trl.ROOT / "configs" / "grpo_loop.toml", domain, ["loop.seed=3"])
    ours = [r.prompt for k in range(5) for r in make_requests(cfg, domain, k)[:: cfg.loop.group_size]]
    assert trl_grpo.train_prompts(cfg.model_dump(), domain, 5) == ours
    other = trl_grpo.train_prompts(cfg.model_copy(update={"loop": cfg.loop.model_copy(update={"seed": 4})}).model_dump(),
                                   domain, 5)
    assert other != ours  # the seed reaches the draw


def test_mapping_follows_the_loop_config():
    kw = trl_grpo.trl_kwargs(_cfg("loop.prompts_per_iteration=32", "loop.group_size=8", "loop.minibatches=4",
                                  "sampling.temperature=0.7", "loss.temperature=0.7", "loss.eps_high=0.28",
                                  "sampling.max_new_tokens=48", "optim.lr=5e-5").model_dump(), 1, "/tmp/x")
    assert kw["num_generations"] == 8 and kw["per_device_train_batch_size"] * kw["steps_per_generation"] == 256
    assert kw["steps_per_generation"] == 4 and kw["shuffle_dataset"] is False and kw["loss_type"] == "bnpo"
    assert (kw["temperature"], kw["epsilon"], kw["epsilon_high"], kw["beta"], kw["max_completion_length"]) == \
        (0.7, 0.2, 0.28, 0.0, 48)
    with pytest.raises(ValueError, match="prompt_pool"):
        trl_grpo.train_prompts(_cfg("loop.prompt_pool=10").model_dump(), "arith", 1)


def test_reward_is_the_domains_verify():
    dom = rewards.domain("arith")
    prompts = dom.prompts("train", 6, 0)
    completions = [dom.demonstration(p) for p in prompts[:3]] + ["12", "", "nonsense"]
    got = trl_grpo.reward_function("arith")(prompts=prompts, completions=completions, trainer_state=None)
    assert got == [float(dom.verify(p, c)[0]) for p, c in zip(prompts, completions)]
    assert got[:3] == [1.0, 1.0, 1.0] and got[4:] == [0.0, 0.0]  # the demonstrations are right


def test_the_same_prompts_reach_trl_and_the_same_reward_scores_them(tmp_path, reverse_base):
    """A real GRPOTrainer step with the mapped config: the prompts its reward function receives are the
    loop's first prompts, each G times in a row, and every reward equals the domain's verify."""
    pytest.importorskip("trl")
    from core.hf import load_policy

    cfg = _cfg("loop.prompts_per_iteration=2", "loop.group_size=2", "loop.minibatches=1",
               "sampling.max_new_tokens=4", "optim.lr=1e-4").model_dump()
    seen = []
    verify = trl_grpo.reward_function("reverse")

    def recording(prompts, completions, **kw):
        out = verify(prompts, completions, **kw)
        seen.append((list(prompts), list(completions), out))
        return out

    model, tok = load_policy(reverse_base)
    trainer = trl_grpo.build_trainer(model, tok, cfg, "reverse", 0, tmp_path / "trl", 3, recording, max_steps=2,
                                     disable_tqdm=True)
    trainer.train()
    assert len(seen) == 2
    expected = trl_grpo.train_prompts(cfg, "reverse", 2)
    assert [p for prompts, _, _ in seen for p in prompts] == [p for p in expected for _ in range(2)]
    dom = rewards.domain("reverse")
    for prompts, completions, out in seen:
        assert out == [float(dom.verify(p, c)[0]) for p, c in zip(prompts, completions)]


def test_matched_times_take_the_policy_as_of_each_time():
    curve = [(0.0, 0.5), (25.0, 0.6), (61.0, 0.7), (80.0, 0.9)]
    assert grpo_vs_trl.matched_times(100, 30) == [30, 60, 90]
    assert [grpo_vs_trl.at(curve, t) for t in (30, 60, 90)] == [0.6, 0.6, 0.9]
    run = {"domain": "arith", "seed": 0, "ours": {"evals": curve, "final_pass_at_1": 0.9},
           "trl": {"evals": [(0.0, 0.5), (30.0, 0.6), (60.0, 0.6), (90.0, 0.6)], "final_pass_at_1": 0.6}}
    ratios = grpo_vs_trl.summarise([run], 90, 30)["arith"]
    assert ratios["matched_ratio"] == pytest.approx((0.6 + 0.6 + 0.9) / 3 / 0.6)
    assert ratios["final_ratio"] == pytest.approx(1.5)


def test_ours_final_is_final_dirs_eval_when_the_loop_logs_one():
    rows = [{"stage": "eval", "time_s": 1.0, "eval_pass_at_1": 0.5},
            {"stage": "train", "time_s": 2.0, "completed": 256, "optimizer_steps": 4, "reward_mean": 0.4},
            {"stage": "eval", "time_s": 3.0, "eval_pass_at_1": 0.7},
            {"stage": "disk", "time_s": 3.0, "run_dir_mb": 1.0, "run_dir_mb_max": 2.0}]
    last = grpo_vs_trl.read_ours(rows, 4.0)
    assert last["final_pass_at_1"] == last["last_iterate_pass_at_1"] == 0.7 and last["optimizer_steps"] == 4
    avg = grpo_vs_trl.read_ours(rows + [{"stage": "final", "time_s": 3.5, "eval_pass_at_1": 0.8}], 4.0)
    assert avg["final_pass_at_1"] == 0.8 and avg["last_iterate_pass_at_1"] == 0.7
    assert avg["evals"] == [(1.0, 0.5), (3.0, 0.7)]  # the curve holds the iterates' evals inside the budget
