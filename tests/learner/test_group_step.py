"""The in-process learner step: packed forward, gradients against an unpacked reference, micro-batch ×
accumulation equivalence, staleness bound, batch structure."""
from __future__ import annotations

import copy

import pytest
import torch

from learner.config import PolicyConfig
from learner.grpo_config import GRPOConfig
from learner.policy import build_policy
from learner.train_step import Learner, LogprobModel, PackedBatch, concat, synthetic_packed_batch
from tests.learner.reference_loss import reference_logprobs, reference_loss

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=3)
LENGTHS = [9, 14, 6, 11, 8, 12]


def tiny_model(dtype=torch.float64):
    model, tok = build_policy(TINY)
    return model.to(dtype), len(tok)


def config(**sections) -> GRPOConfig:
    data = {"learner": {"device": "cpu", "threads": 1}, "optim": {"lr": 1e-2, "warmup_steps": 0, "grad_clip": 0.0}}
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return GRPOConfig.model_validate(data)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def unpacked_reference_grads(model, ref_model, batch: PackedBatch, loss_cfg) -> dict[str, torch.Tensor]:
    """Each sequence through the plain HF forward on its own, log-softmax of the full logits, the loop loss."""
    new, ent = [], []
    ref_lp = []
    for s in range(batch.num_seqs):
        seq = batch.select(s, s + 1)
        logits = model(input_ids=seq.input_ids_N[None]).logits[0] / loss_cfg.temperature
        lp, e = reference_logprobs(logits[:-1], seq.input_ids_N[1:])
        new.append(torch.cat([lp.new_zeros(1), lp]))
        ent.append(torch.cat([e.new_zeros(1), e]))
        with torch.no_grad():
            rlogits = ref_model(input_ids=seq.input_ids_N[None]).logits[0] / loss_cfg.temperature
            ref_lp.append(torch.cat([lp.new_zeros(1), reference_logprobs(rlogits[:-1], seq.input_ids_N[1:])[0]]))
    loss = reference_loss(torch.cat(new), batch.behaviour_logprobs_N.double(), batch.advantages_N.double(),
                          batch.loss_mask_N, batch.seq_ids(), ref=torch.cat(ref_lp), entropy=torch.cat(ent),
                          eps_low=loss_cfg.eps_low, eps_high=loss_cfg.eps_high,
                          dual_clip=loss_cfg.dual_clip or None, aggregation=loss_cfg.aggregation,
                          norm_len=loss_cfg.norm_len, kl_coef=loss_cfg.kl_coef, kl_estimator=loss_cfg.kl_estimator,
                          entropy_coef=loss_cfg.entropy_coef)
    model.zero_grad()
    loss.backward()
    return grads(model)


def test_packed_logprobs_equal_separate_forwards():
    model, vocab = tiny_model()
    batch = synthetic_packed_batch(vocab, LENGTHS, seed=0)
    lm = LogprobModel(model, chunk_rows=5)
    with torch.no_grad():
        packed, packed_ent = lm(batch.input_ids_N, batch.position_ids_N)
        alone = [lm(b.input_ids_N, b.position_ids_N) for b in (batch.select(s, s + 1) for s in range(batch.num_seqs))]
    torch.testing.assert_close(packed, torch.cat([a[0] for a in alone]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(packed_ent, torch.cat([a[1] for a in alone]), rtol=1e-10, atol=1e-10)
    assert (packed[batch.cu_seqlens_S1[:-1]] == 0).all()


LOSS_CASES = [
    dict(aggregation="token-mean"),
    dict(aggregation="seq-mean-token-mean", eps_low=0.1, eps_high=0.3, dual_clip=2.0, kl_coef=0.1,
         kl_estimator="k3", entropy_coef=0.01),
    dict(aggregation="seq-mean-token-sum-norm", norm_len=16, kl_coef=0.2, kl_estimator="k2", entropy_coef=0.05,
         temperature=0.7),
    dict(aggregation="token-mean", kl_coef=0.1, kl_estimator="k1"),
]


@pytest.mark.parametrize("loss", LOSS_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_step_gradients_match_unpacked_reference(loss):
    model, vocab = tiny_model()
    ref_model = copy.deepcopy(model)
    with torch.no_grad():  # a reference policy that differs, so the KL term is not zero
        for p in ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cfg = config(loss=loss)
    batch = synthetic_packed_batch(vocab, LENGTHS, seed=1)
    expected = unpacked_reference_grads(copy.deepcopy(model), ref_model, batch, cfg.loss)
    learner = Learner(model, cfg, ref_model=ref_model)
    learner.accumulate_gradients(batch.split(20))
    got = grads(model)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-8, atol=1e-11, msg=name)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_with_accumulation_equal_one_batch(aggregation):
    base, vocab = tiny_model()
    batches = [synthetic_packed_batch(vocab, LENGTHS, seed=s) for s in (10, 11)]
    cfg = config(loss={"aggregation": aggregation, "entropy_coef": 0.01, "norm_len": 16},
                 optim={"grad_clip": 0.5})
    results = []
    for budget in (10_000, 25, 1):  # one micro-batch; a few; one sequence each
        model = copy.deepcopy(base)
        learner = Learner(model, cfg)
        metrics = [learner.train_step(b.split(budget)) for b in batches]
        results.append((model.state_dict(), metrics, len(batches[0].split(budget))))
    assert [r[2] for r in results] == [1, 3, 6]
    assert [r[1][0]["micro_batches"] for r in results] == [1, 3, 6]
    w0, m0, _ = results[0]
    for w, m, _ in results[1:]:
        for k in w0:
            torch.testing.assert_close(w[k], w0[k], rtol=1e-9, atol=1e-12, msg=k)
        for a, b in zip(m, m0):
            for key in ("loss", "grad_norm", "clip_frac", "entropy", "approx_kl", "loss_tokens"):
                assert a[key] == pytest.approx(b[key], rel=1e-8, abs=1e-12), key
    assert any(p.ne(base.state_dict()[k]).any() for k, p in w0.items())  # the step did move the weights


def test_staleness_bound_masks_old_tokens():
    model, vocab = tiny_model()
    batch = synthetic_packed_batch(vocab, LENGTHS, seed=4, versions=(2, 5))
    cfg = config(staleness={"bound": 1, "mode": "mask"})
    learner = Learner(copy.deepcopy(model), cfg)
    learner.policy_version = 5
    m = learner.accumulate_gradients([batch])
    by_hand = copy.deepcopy(batch)
    by_hand.loss_mask_N = batch.loss_mask_N & (batch.token_versions_N >= 4)
    by_hand.token_versions_N = None
    plain = Learner(copy.deepcopy(model), cfg)
    m2 = plain.accumulate_gradients([by_hand])
    for name, g in grads(learner.model).items():
        torch.testing.assert_close(g, grads(plain.model)[name], msg=name)
    stale = 5 - batch.token_versions_N[batch.loss_mask_N]
    assert m["stale_tokens_removed"] == int((stale > 1).sum()) > 0
    assert m["loss_tokens"] == m2["loss_tokens"] == int(by_hand.loss_mask_N.sum())
    for k in range(4):
        assert m.get(f"staleness_hist_{k}", 0) == int((stale == k).sum())


def test_packed_batch_from_loader_dict_and_bad_input():
    b = synthetic_packed_batch(50, [4, 6, 5], seed=0)
    d = {"tokens": b.input_ids_N[None], "positions": b.position_ids_N, "loss_mask": b.loss_mask_N.int(),
         "logprobs": b.behaviour_logprobs_N, "advantages": b.advantages_N[b.cu_seqlens_S1[:-1]]}
    got = PackedBatch.from_dict(d)  # cu_seqlens derived, per-sequence advantages spread over tokens
    assert torch.equal(got.cu_seqlens_S1, b.cu_seqlens_S1)
    torch.testing.assert_close(got.advantages_N, b.advantages_N)
    assert torch.equal(concat(b.split(7)).input_ids_N, b.input_ids_N)
    with pytest.raises(ValueError, match="missing"):
        PackedBatch.from_dict({"tokens": b.input_ids_N})
    bad = dict(d, loss_mask=torch.ones_like(b.loss_mask_N))
    with pytest.raises(ValueError, match="first token"):
        PackedBatch.from_dict(bad)
    with pytest.raises(ValueError, match="position_ids"):
        PackedBatch.from_dict(dict(d, advantages=b.advantages_N, cu_seqlens=torch.tensor([0, 4, 15])))  # 3 by positions
    with pytest.raises(ValueError, match="shape"):
        PackedBatch.from_dict(dict(d, logprobs=b.behaviour_logprobs_N[:-1]))


def test_activation_checkpointing_and_entropy_switch_keep_the_gradient():
    model, vocab = tiny_model()
    batch = synthetic_packed_batch(vocab, LENGTHS, seed=6)
    got = []
    for learner_cfg in ({}, {"activation_checkpointing": True, "entropy_metric": False}):
        m = copy.deepcopy(model)
        metrics = Learner(m, config(learner=learner_cfg)).accumulate_gradients([batch])
        got.append((grads(m), metrics))
    (g0, m0), (g1, m1) = got
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-10, atol=1e-13, msg=name)
    assert "entropy" in m0 and "entropy" not in m1


def test_micro_batch_budget_cuts_oversized_batches():
    model, vocab = tiny_model()
    batch = synthetic_packed_batch(vocab, LENGTHS, seed=8)
    got = []
    for budget in (4096, 20):
        m = copy.deepcopy(model)
        metrics = Learner(m, config(learner={"micro_batch_tokens": budget})).accumulate_gradients([batch])
        got.append((grads(m), metrics["micro_batches"]))
    assert [g[1] for g in got] == [1, len(batch.split(20))] and got[1][1] > 2
    for name in got[0][0]:
        torch.testing.assert_close(got[1][0][name], got[0][0][name], rtol=1e-10, atol=1e-13, msg=name)


def test_a_step_whose_gradient_is_not_finite_is_not_taken():
    """One activation overflowing to inf (as a bf16 overflow in a long run would) makes the gradient
    non-finite: the step raises before any weight, the optimizer state or the step count changes."""
    model, vocab = tiny_model(torch.float32)
    learner = Learner(model, config(optim={"lr": 1e-3, "grad_clip": 1.0}))
    batch = synthetic_packed_batch(vocab, [9, 7], seed=1)

    def overflow(module, inputs, out):
        out = out.clone()
        out[0, 5] = float("inf")
        return out

    hook = model.model.layers[0].mlp.register_forward_hook(overflow)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with pytest.raises(FloatingPointError, match="not taken"):
        learner.train_step([batch])
    hook.remove()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert learner.step == 0 and not learner.optimizer.state
    learner.train_step([batch])  # the next finite step goes through
    assert learner.step == 1
