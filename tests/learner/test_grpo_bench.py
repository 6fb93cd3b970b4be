"""bench/grpo.py: its naive baseline computes the same loss and gradient as the packed step, and the
benchmark's JSON has the agreed shape."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from bench.grpo import (CPU_MODEL, _build, main, make_micro_batches, model_flops, naive_accumulate, pad, padded_reference_loss,
                        peak_flops)
from learner.grpo_config import GRPOConfig
from learner.train_step import Learner, synthetic_packed_batch
from tests.learner.reference_loss import reference_loss


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_padded_reference_loss_equals_loop_reference(aggregation):
    b = synthetic_packed_batch(50, [9, 4, 12, 7], seed=3)
    g = torch.Generator().manual_seed(0)
    new = (b.behaviour_logprobs_N + 0.5 * torch.randn(b.num_tokens, generator=g)).double()
    p = pad(b)
    new_BL = torch.zeros(p["behaviour"].shape, dtype=torch.float64)
    for i, (a, n) in enumerate(zip(b.cu_seqlens_S1[:-1].tolist(), b.cu_seqlens_S1.diff().tolist())):
        new_BL[i, :n] = new[a:a + n]
    kw = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0, aggregation=aggregation, norm_len=16)
    got = padded_reference_loss(new_BL, p["behaviour"].double(), p["advantages"].double(), p["loss_mask"], **kw)
    want = reference_loss(new, b.behaviour_logprobs_N.double(), b.advantages_N.double(), b.loss_mask_N,
                          b.seq_ids(), **kw)
    torch.testing.assert_close(got, want)


def test_naive_step_has_the_packed_steps_gradient():
    cfg_model = dict(CPU_MODEL, vocab_size=300)
    ours = _build(cfg_model, torch.device("cpu"), torch.float64, "sdpa")
    naive = copy.deepcopy(ours)
    mbs = make_micro_batches(300, 64, 2, 8, 40, seed=1)
    cfg = GRPOConfig.model_validate({"learner": {"device": "cpu", "threads": 1}})
    Learner(ours, cfg).accumulate_gradients(mbs)
    naive_accumulate(naive, mbs, cfg.loss, torch.autocast("cpu", enabled=False), torch.device("cpu"))
    for (name, p), q in zip(ours.named_parameters(), naive.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-10, msg=name)


def test_workload_and_flops():
    mbs = make_micro_batches(100, 128, 3, 16, 64, seed=0)
    assert all(128 - 16 < mb.num_tokens <= 128 for mb in mbs)  # filled but for a remainder under min_len
    assert all(16 <= n <= 64 for mb in mbs for n in mb.cu_seqlens_S1.diff().tolist())
    cfg = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
               intermediate_size=16, vocab_size=100)
    per_layer = 8 * 8 * 2 + 2 * 8 * 4 + 3 * 8 * 16
    sq = sum(int((mb.cu_seqlens_S1.diff() ** 2).sum()) for mb in mbs)
    assert model_flops(cfg, mbs) == 6 * (2 * per_layer + 800) * sum(mb.num_tokens for mb in mbs) + 6 * 2 * 8 * sq


@pytest.mark.slow
@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 989.4e12), ("NVIDIA H100 80GB HBM3", 989.4e12),
                                        ("NVIDIA H100 SXM5 80GB", 989.4e12), ("NVIDIA H100 PCIe", None),
                                        ("NVIDIA H100 NVL", None), ("NVIDIA A100-SXM4-80GB", None)])
def test_the_targets_apply_where_the_peak_is_the_h200s(name, peak):
    assert peak_flops(name) == peak


def test_cpu_bench_json(tmp_path, capsys):
    out = tmp_path / "grpo.json"
    assert main(["--json", "--device", "cpu", "--steps", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device_kind"] == "cpu" and "cores" in res["device"]
    assert res["tokens_per_s"] > 0 and res["naive_tokens_per_s"] > 0
    for key in ("mfu_h200", "vs_naive_step_h200"):
        assert set(res["targets"][key]) >= {"value", "goal", "met"} and res["targets"][key]["met"] is None
