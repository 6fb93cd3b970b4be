"""An OPD learner group of 2 Ray ranks (gloo) takes the same step as one rank in one process.

Adam's epsilon is set large so that the update is close to linear in the gradient: a first Adam step
is otherwise lr * sign(g), and the sign of a gradient that is zero up to rounding differs between
summation orders."""
from __future__ import annotations

import ray
import torch

from core.hf import load_policy
from distill.opd_config import OPDTrainConfig
from distill.opd_learner import opd_learner
from learner.group import LearnerGroup
from tests.distill.opd_fixtures import build_case, hashes


def test_two_ranks_take_the_one_rank_step(tmp_path):
    student, teachers, dp, sampled, sel = build_case(tmp_path, n=15)
    rows = hashes(dp, sel, sampled)
    weights = {}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        for ranks in (1, 2):
            cfg = OPDTrainConfig.model_validate({"learner": {"device": "cpu", "threads": 1, "ranks": ranks},
                                                 "optim": {"lr": 1e-2, "grad_clip": 0.0, "adam_eps": 1e-2},
                                                 "opd": {"cache_dtype": "float32"}})
            group = LearnerGroup(cfg, str(student), num_cpus_per_rank=0, make_learner=opd_learner)
            try:
                group.learner_call("set_teachers", teachers)
                plan = dp.plan(sel, tokens_per_rank=sel.num_tokens // ranks + 40, ranks=ranks, by_teacher=True)
                assert plan.num_minibatches == 1
                m = group.learner_call("plan_step", plan, 0, rows)
                assert m["max_resident_heads"] == 1 and m["loss_positions"] > 0
                weights[ranks] = group.weights()
            finally:
                group.close()
    finally:
        ray.shutdown()
    for k, w1 in weights[1].items():
        torch.testing.assert_close(weights[2][k], w1, rtol=1e-5, atol=1e-6, msg=k)
    base = load_policy(student)[0].state_dict()
    assert any(not torch.equal(base[k], weights[1][k]) for k in base)
