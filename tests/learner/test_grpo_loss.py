"""The vectorised GRPO loss against the plain reference, in value and gradients, for every option combination."""
from __future__ import annotations

import itertools

import pytest
import torch

from learner.grpo_loss import (LossInputs, LossOptions, grpo_loss, logprobs_from_hidden, selective_log_softmax,
                               seq_ids_from_cu_seqlens)
from tests.learner.reference_loss import reference_logprobs, reference_loss



@pytest.fixture(autouse=True)
def float64_default():
    """These tests compare at fp64 precision; restore the default for the rest of the suite."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make_pack(seed: int, lengths=(7, 12, 5, 9, 6, 8), spread=0.6):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    seq_ids = seq_ids_from_cu_seqlens(cu)
    behaviour = -torch.rand(n, generator=g) * 3 - 0.05
    # Spread wide enough that ratios land both inside and outside [1-eps, 1+eps].
    new = (behaviour + spread * torch.randn(n, generator=g)).clamp(max=-1e-3)
    ref = behaviour + 0.3 * torch.randn(n, generator=g)
    adv_S = torch.randn(len(lengths), generator=g)
    adv = adv_S[seq_ids]
    mask = torch.rand(n, generator=g) > 0.3
    mask[cu[:-1]] = False  # a sequence's first token is prompt
    entropy = torch.rand(n, generator=g) * 2
    return dict(new=new, behaviour=behaviour, ref=ref, adv=adv, mask=mask, seq_ids=seq_ids, entropy=entropy)


def run_both(pack, opts: LossOptions):
    lib_new = pack["new"].clone().requires_grad_()
    lib_ent = pack["entropy"].clone().requires_grad_()
    out = grpo_loss(LossInputs(lib_new, pack["behaviour"], pack["adv"], pack["mask"], pack["seq_ids"],
                               ref_logprobs_N=pack["ref"] if opts.kl_coef else None,
                               entropy_N=lib_ent if opts.entropy_coef else None), opts)
    out.loss.backward()
    ref_new = pack["new"].clone().requires_grad_()
    ref_ent = pack["entropy"].clone().requires_grad_()
    expected = reference_loss(ref_new, pack["behaviour"], pack["adv"], pack["mask"], pack["seq_ids"],
                              ref=pack["ref"], entropy=ref_ent, eps_low=opts.eps_low, eps_high=opts.eps_high,
                              dual_clip=opts.dual_clip, aggregation=opts.aggregation, norm_len=opts.norm_len,
                              kl_coef=opts.kl_coef, kl_estimator=opts.kl_estimator, entropy_coef=opts.entropy_coef)
    expected.backward()
    return out, expected, (lib_new.grad, ref_new.grad), (lib_ent.grad, ref_ent.grad)


CLIPS = [(0.2, 0.2), (0.1, 0.3)]
DUAL = [None, 3.0]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLS = [(0.0, "k3"), (0.1, "k1"), (0.1, "k2"), (0.1, "k3")]
ENTS = [0.0, 0.01]


@pytest.mark.parametrize("clip,dual,agg,kl,ent", list(itertools.product(CLIPS, DUAL, AGGS, KLS, ENTS)))
def test_loss_matches_reference(clip, dual, agg, kl, ent):
    opts = LossOptions(eps_low=clip[0], eps_high=clip[1], dual_clip=dual, aggregation=agg, norm_len=16,
                       kl_coef=kl[0], kl_estimator=kl[1], entropy_coef=ent)
    for seed in (0, 1):
        pack = make_pack(seed)
        out, expected, (g_new, g_new_ref), (g_ent, g_ent_ref) = run_both(pack, opts)
        torch.testing.assert_close(out.loss, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g_new, g_new_ref, rtol=1e-10, atol=1e-12)
        if ent:
            torch.testing.assert_close(g_ent, g_ent_ref, rtol=1e-10, atol=1e-12)


def test_packs_exercise_every_branch():
    """The test data must reach clipping on both sides and the dual clip, else the comparison proves little."""
    for seed in (0, 1):
        out, *_ = run_both(make_pack(seed), LossOptions(eps_low=0.2, eps_high=0.2, dual_clip=1.5))
        assert 0 < out.metrics["clip_frac_low"] < 1 and 0 < out.metrics["clip_frac_high"] < 1
        assert 0 < out.metrics["dual_clip_frac"] < 1


def test_metrics_by_hand():
    new = torch.tensor([-1.0, -1.0, -1.0, -2.0])
    beh = torch.tensor([-1.0, -1.5, -0.5, -2.0])  # ratios 1, e^.5, e^-.5, 1 (last masked)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0])
    mask = torch.tensor([True, True, True, False])
    out = grpo_loss(LossInputs(new, beh, adv, mask, torch.zeros(4, dtype=torch.long),
                               entropy_N=torch.tensor([1.0, 2.0, 3.0, 100.0])), LossOptions(eps_low=0.2, eps_high=0.2))
    # A > 0: ratio e^.5 > 1.2 is clipped (high); ratio e^-.5 < 0.8 is not (min picks the unclipped one).
    assert out.metrics["clip_frac"] == pytest.approx(1 / 3)
    assert out.metrics["clip_frac_high"] == pytest.approx(1 / 3)
    assert out.metrics["entropy"] == pytest.approx(2.0)
    import math
    k3 = lambda d: math.expm1(d) - d  # noqa: E731
    assert out.metrics["approx_kl"] == pytest.approx((k3(0) + k3(0.5) + k3(-0.5)) / 3)
    assert out.loss.item() == pytest.approx(-(1.0 + 1.2 + math.exp(-0.5)) / 3)
    assert out.num_loss_tokens == 3


def test_masked_garbage_does_not_leak():
    pack = make_pack(3)
    pack["new"][~pack["mask"]] = 80.0  # exp(80 - behaviour) would overflow in fp32 and poison the gradient
    opts = LossOptions(kl_coef=0.1, entropy_coef=0.01)
    out, expected, (g, g_ref), _ = run_both(pack, opts)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(g, g_ref)
    assert (g[~pack["mask"]] == 0).all()


@pytest.mark.parametrize("agg", AGGS)
def test_split_pack_with_global_counts_equals_whole(agg):
    """Micro-batches carrying the step's global counts sum to the whole pack's loss and gradient, even when
    a sequence is cut in two (the data plane splits long trajectories)."""
    pack = make_pack(5)
    opts = LossOptions(aggregation=agg, kl_coef=0.05, entropy_coef=0.01, norm_len=16)
    whole_new = pack["new"].clone().requires_grad_()
    whole = grpo_loss(LossInputs(whole_new, pack["behaviour"], pack["adv"], pack["mask"], pack["seq_ids"],
                                 ref_logprobs_N=pack["ref"], entropy_N=pack["entropy"]), opts)
    whole.loss.backward()
    seq_tokens = torch.zeros(6).index_add_(0, pack["seq_ids"], pack["mask"].double())
    cut = 13  # inside the second sequence (7 + 12 tokens)
    split_new = pack["new"].clone().requires_grad_()
    total = 0.0
    for sl in (slice(0, cut), slice(cut, None)):
        ids = pack["seq_ids"][sl]
        local = ids - ids.min()
        out = grpo_loss(LossInputs(split_new[sl], pack["behaviour"][sl], pack["adv"][sl], pack["mask"][sl], local,
                                   ref_logprobs_N=pack["ref"][sl], entropy_N=pack["entropy"][sl],
                                   seq_loss_tokens_S=seq_tokens[ids.min():ids.max() + 1],
                                   total_loss_tokens=float(pack["mask"].sum()), total_seqs=6.0), opts)
        total = total + out.loss
    total.backward()
    torch.testing.assert_close(total, whole.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_new.grad, whole_new.grad, rtol=1e-12, atol=1e-14)


def test_bad_options_and_inputs():
    with pytest.raises(ValueError, match="dual_clip"):
        LossOptions(dual_clip=0.5)
    with pytest.raises(ValueError, match="aggregation"):
        LossOptions(aggregation="mean")
    pack = make_pack(0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(LossInputs(pack["new"], pack["behaviour"], pack["adv"], pack["mask"], pack["seq_ids"]),
                  LossOptions(kl_coef=0.1))
    with pytest.raises(ValueError, match="one shape"):
        grpo_loss(LossInputs(pack["new"][:-1], pack["behaviour"], pack["adv"], pack["mask"], pack["seq_ids"]),
                  LossOptions())


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_selective_log_softmax_and_fused_head(chunk):
    g = torch.Generator().manual_seed(0)
    n, h, v = 23, 8, 50
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    up_lp, up_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    exp_lp, exp_ent = reference_logprobs(hidden @ weight.t(), labels)
    (exp_lp * up_lp + exp_ent * up_ent).sum().backward()
    exp_gh, exp_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    lp, ent = logprobs_from_hidden(hidden, weight, labels, chunk_rows=chunk, with_entropy=True)
    torch.testing.assert_close(lp.double(), exp_lp)
    torch.testing.assert_close(ent.double(), exp_ent)
    (lp * up_lp + ent * up_ent).sum().backward()
    torch.testing.assert_close(hidden.grad, exp_gh)
    torch.testing.assert_close(weight.grad, exp_gw)

    lp2, ent2 = selective_log_softmax((hidden @ weight.t()).detach(), labels, chunk_rows=chunk, with_entropy=True)
    torch.testing.assert_close(lp2.double(), exp_lp)
    torch.testing.assert_close(ent2.double(), exp_ent)


def test_fused_head_bf16_close_to_fp64():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 16, generator=g)
    weight = torch.randn(300, 16, generator=g) * 0.3
    labels = torch.randint(0, 300, (40,), generator=g)
    exp_lp, _ = reference_logprobs(hidden @ weight.t(), labels)
    lp, _ = logprobs_from_hidden(hidden.bfloat16(), weight.bfloat16(), labels, chunk_rows=7)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), exp_lp, rtol=0.05, atol=0.1)


def test_fused_head_without_entropy_and_frozen_weight():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(17, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g)  # frozen: no weight gradient is formed
    labels = torch.randint(0, 40, (17,), generator=g)
    up = torch.randn(17, generator=g)
    exp_lp, _ = reference_logprobs(hidden @ weight.t(), labels)
    (exp_lp * up).sum().backward()
    expected = hidden.grad.clone()
    hidden.grad = None
    lp, ent = logprobs_from_hidden(hidden, weight, labels, chunk_rows=6)
    assert ent is None
    (lp * up).sum().backward()
    torch.testing.assert_close(hidden.grad, expected)


def test_fused_head_under_autocast_matches_fp64():
    """With autocast on, the chunk matmuls run in bf16 (forward and the recomputation in the backward),
    results stay fp32, and gradients come back in the inputs' dtypes."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(30, 16, generator=g, dtype=torch.float32, requires_grad=True)
    weight = (0.3 * torch.randn(64, 16, generator=g, dtype=torch.float32)).requires_grad_()
    labels = torch.randint(0, 64, (30,), generator=g)
    exp_lp, exp_ent = reference_logprobs(hidden.double() @ weight.double().t(), labels)
    (exp_lp.sum() + exp_ent.sum()).backward()
    exp_gh, exp_gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = logprobs_from_hidden(hidden, weight, labels, chunk_rows=8, with_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(lp.double(), exp_lp, rtol=0.02, atol=0.05)
    assert (lp.double() - exp_lp).abs().max() > 1e-5  # bf16 was used, not fp32
    torch.testing.assert_close(hidden.grad.double(), exp_gh.double(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(weight.grad.double(), exp_gw.double(), rtol=0.05, atol=0.05)
