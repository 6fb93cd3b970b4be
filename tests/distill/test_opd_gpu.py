"""The OPD learner on CUDA: the same step as on the CPU (the side-stream copies of heads and hidden
states are waited for), and at most one teacher head on the device, read from the allocator's trace."""
from __future__ import annotations

import pytest
import torch

from bench._alloc_trace import live_max, recording
from core.hf import load_policy
from distill.opd_config import OPDTrainConfig
from distill.opd_learner import OPDLearner
from tests.distill.opd_fixtures import build_case, hashes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _learner(student, teachers, device):
    model, _ = load_policy(student)
    cfg = OPDTrainConfig.model_validate({"learner": {"device": device, "threads": 1, "micro_batch_tokens": 40},
                                         "optim": {"lr": 1e-3, "adam_eps": 1e-2}, "opd": {"cache_dtype": "float32"}})
    learner = OPDLearner(model, cfg)
    learner.set_teachers(0, teachers)
    return learner


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return build_case(tmp_path_factory.mktemp("opd-gpu"))


def test_cuda_steps_equal_the_cpu_steps_with_one_head_on_the_device(case):
    student, teachers, dp, sampled, sel = case
    plan = dp.plan(sel, tokens_per_rank=int(sel.length.max()) * 2, ranks=1, by_teacher=True, seed=3)
    rows = hashes(dp, sel, sampled)
    cpu, gpu = _learner(student, teachers, "cpu"), _learner(student, teachers, "cuda")
    got = gpu.accumulate_gradients(0, plan, 0, rows)
    want = cpu.accumulate_gradients(0, plan, 0, rows)
    # The trunk runs under bf16 autocast on CUDA (flash attention): bf16 tolerances. A copy not waited
    # for (a head or hidden states read before they arrived) would be off by far more.
    assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)
    for (k, p), q in zip(gpu.model.named_parameters(), cpu.model.parameters()):
        err = float((p.grad.cpu() - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
        assert err < 5e-2, (k, err)
    gpu.apply_update(), cpu.apply_update()
    with recording() as rec:
        for m in range(1, plan.num_minibatches):
            got, want = gpu.plan_step(0, plan, m, rows), cpu.plan_step(0, plan, m, rows)
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-2) and got["head_loads"] == want["head_loads"]
    live = live_max(rec["snapshot"], "distill/heads.py", "_copy_to_device")
    assert live["allocations"] > 0 and live["max_live_blocks"] == 1, live
    assert gpu.heads.max_resident == 1


def test_the_allocator_trace_sees_a_kept_head(case):
    student, teachers, *_ = case
    gpu = _learner(student, teachers, "cuda")
    kept = []
    with recording() as rec:
        for t in teachers:
            with gpu.heads.resident(t.name) as W:
                kept.append(W)
    assert live_max(rec["snapshot"], "distill/heads.py", "_copy_to_device")["max_live_blocks"] == len(teachers)
