"""The OPD step against an fp64 reference, one teacher head resident, and the cache checks.

Real HF models (a student and four teachers of three widths), real teacher prefill into a real data
plane, the real learner reading its share back by teacher."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from core.hf import load_policy
from distill.cache import CacheMismatch, CacheRecord, check
from distill.opd_config import OPDTrainConfig
from distill.opd_learner import OPDLearner, plan_iteration
from tests.distill.opd_fixtures import build_case, hashes, set_threads


def _learner(student, teachers, **opd):
    set_threads()
    model, _ = load_policy(student)
    cfg = OPDTrainConfig.model_validate({"learner": {"device": "cpu", "threads": 1, "micro_batch_tokens": 40},
                                         "optim": {"lr": 1e-3}, "opd": {"kl_chunk_tokens": 8, "cache_dtype": "float32", **opd}})
    learner = OPDLearner(model, cfg)
    learner.set_teachers(0, teachers)
    return learner


def _reference(student, teachers, sampled):
    """sum_i w_i sum_t sum_v p_s (log p_s - log p_t) / n over the student's completion positions, fp64."""
    model = load_policy(student)[0].double()
    tmodels = {t.name: load_policy(t.path)[0].double() for t in teachers}
    share_den = {}
    for t in teachers:
        share_den[t.domain] = share_den.get(t.domain, 0.0) + t.weight
    total, n = torch.zeros((), dtype=torch.float64), 0.0
    for s in sampled:
        ids = torch.as_tensor(s.tokens, dtype=torch.long)[None]
        P = torch.as_tensor(s.loss_mask[1:], dtype=torch.bool)
        n += float(P.sum())
        log_ps = torch.log_softmax(model(ids).logits[0, :-1][P], -1)
        for t in (t for t in teachers if t.domain == s.domain):
            with torch.no_grad():
                log_pt = torch.log_softmax(tmodels[t.name](ids).logits[0, :-1][P], -1)
            total = total + t.weight * (log_ps.exp() * (log_ps - log_pt)).sum()
    loss = total / n
    loss.backward()
    return float(loss.detach()), {k: p.grad for k, p in model.named_parameters()}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return build_case(tmp_path_factory.mktemp("opd"))


def test_loss_and_gradients_equal_the_fp64_reference(case):
    student, teachers, dp, sampled, sel = case
    learner = _learner(student, teachers)
    plan = dp.plan(sel, tokens_per_rank=sel.num_tokens, ranks=1, by_teacher=True)
    assert plan.num_minibatches == 1
    metrics = learner.accumulate_gradients(0, plan, 0, hashes(dp, sel, sampled))
    want_loss, want_grads = _reference(student, teachers, sampled)
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5)
    got = dict(learner.model.named_parameters())
    assert set(want_grads) == set(got)
    for name, g in want_grads.items():  # trunk and head (tied with the embedding) alike
        torch.testing.assert_close(got[name].grad.double(), g, rtol=2e-4, atol=1e-7, msg=name)
    assert any(got[k].grad.abs().sum() > 0 for k in got if "embed" in k)
    assert metrics["head_loads"] == len(teachers) and metrics["max_resident_heads"] == 1


def test_a_wrong_normaliser_or_a_dropped_teacher_would_be_seen(case):
    """The comparison above can fail: the same step with one teacher's weight changed differs."""
    student, teachers, dp, sampled, sel = case
    plan = dp.plan(sel, tokens_per_rank=sel.num_tokens, ranks=1, by_teacher=True)
    bent = [t if t.name != "arith:1" else dataclasses.replace(t, weight=0.9) for t in teachers]
    metrics = _learner(student, bent).accumulate_gradients(0, plan, 0, hashes(dp, sel, sampled))
    assert metrics["loss"] != pytest.approx(_reference(student, teachers, sampled)[0], rel=1e-3)


def test_one_teacher_head_resident_and_each_loaded_once_per_minibatch(case):
    student, teachers, dp, sampled, sel = case
    learner = _learner(student, teachers)
    plan = plan_iteration(dp, sel, ranks=1, minibatches=6, seed=3)
    assert plan.num_minibatches >= 3
    live = []
    real = learner.heads.resident

    def watching(name, then=None):  # count every live head tensor the moment a new one is in use
        ctx = real(name, then)

        class Probe:
            def __enter__(self):
                head = ctx.__enter__()
                live.append(learner.heads.resident_heads())
                return head

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)
        return Probe()

    learner.heads.resident = watching
    last, kept_over = None, 0
    for m in range(plan.num_minibatches):
        sl = plan.bin(m, 0)
        order = list(dict.fromkeys(plan.teachers[c] for c in plan.teacher[plan.seg_traj[sl]].tolist()))
        metrics = learner.plan_step(0, plan, m, hashes(dp, sel, sampled))
        # once per teacher present, in teacher order; a head the previous minibatch ended with stays
        kept = order[0] == last
        kept_over += kept
        assert metrics["head_loads"] == len(order) - kept, (m, order, last)
        last = order[-1]
    assert kept_over > 0  # the plan has a minibatch that starts with the previous one's teacher
    assert live and max(live) == 1, live
    assert learner.heads.max_resident == 1
    assert learner.heads.host.reads == len(teachers)  # each head read from storage once, then from host memory


def _minibatch_trajectories(plan, m: int) -> set[str]:
    return {row.rsplit("@", 1)[0] for row in plan.ids[plan.seg_traj[plan.bin(m, 0)]].tolist()}


def test_every_step_of_a_many_minibatch_plan_weights_its_teachers(case):
    """Each optimizer step of the loop's plan is the fp64 objective sum_i w_i KL_i / n over the
    trajectories it holds: a trajectory's rows for arith's two teachers share a step, so neither
    teacher's weight cancels against the step's normaliser. One teacher head stays resident."""
    student, teachers, dp, sampled, sel = case
    learner = _learner(student, teachers)
    plan = plan_iteration(dp, sel, ranks=1, minibatches=6, seed=0)
    assert plan.num_minibatches >= 3
    one_teacher_steps = 0
    for m in range(plan.num_minibatches):
        trajs = _minibatch_trajectories(plan, m)
        names = {plan.teachers[c] for c in plan.teacher[plan.seg_traj[plan.bin(m, 0)]].tolist()}
        one_teacher_steps += len(names & {"arith:0", "arith:1"}) == 1
        metrics = learner.accumulate_gradients(0, plan, m, hashes(dp, sel, sampled))
        want_loss, want_grads = _reference(student, teachers, [s for s in sampled if s.traj_id in trajs])
        assert metrics["loss"] == pytest.approx(want_loss, rel=1e-5), m
        for name, p in learner.model.named_parameters():
            torch.testing.assert_close(p.grad.double(), want_grads[name], rtol=2e-4, atol=1e-7, msg=f"{m} {name}")
        learner.optimizer.zero_grad(set_to_none=True)
    assert one_teacher_steps == 0
    assert learner.heads.max_resident == 1


def test_a_plan_that_puts_a_trajectorys_rows_in_different_steps_is_refused(case):
    """Teacher-sorted rows without their trajectory's grouping (arith:0's rows in steps of their own)
    would divide each teacher's weight out of its step: refused by name before any gradient."""
    student, teachers, dp, sampled, sel = case
    learner = _learner(student, teachers)
    plan = dp.plan(sel, tokens_per_rank=int(sel.length.max()), ranks=1, by_teacher=True, seed=0)
    with pytest.raises(ValueError, match="cancels the teacher weights"):
        learner.accumulate_gradients(0, plan, 0, hashes(dp, sel, sampled))
    assert all(p.grad is None for p in learner.model.parameters())


def test_the_residency_count_sees_a_leaked_head(case):
    """A learner that kept a reference to each head it used would hold several: the count says so."""
    student, teachers, dp, sampled, sel = case
    learner = _learner(student, teachers)
    kept = []
    for t in teachers:
        with learner.heads.resident(t.name) as W:
            kept.append(W)
    assert learner.heads.max_resident == len(teachers)


def test_record_checks_name_what_differs(case):
    student, teachers, dp, sampled, sel = case
    row = sel.ids.tolist()[0]
    rec = CacheRecord.from_meta(dp.meta([row])[row], row)
    t = next(t for t in teachers if t.name == rec.teacher)
    good = dict(row_id=row, run_id="run-x", teacher=t.name, fingerprint=t.fingerprint, dtype="float32",
                length=rec.stop, tokens_hash=rec.tokens_hash, hidden_size=t.hidden_size)
    check(rec, **good)
    for key, value, words in [("fingerprint", "0" * 64, "stale teacher weights"), ("tokens_hash", "f" * 16, "other tokens"),
                              ("teacher", "calc:9", "another teacher"), ("run_id", "run-y", "another run"),
                              ("dtype", "bfloat16", "dtype")]:
        with pytest.raises(CacheMismatch, match=words):
            check(rec, **{**good, key: value})


def test_rows_whose_tokens_differ_from_their_record_are_refused(case):
    student, teachers, dp, sampled, sel = case
    learner = _learner(student, teachers)
    plan = dp.plan(sel, tokens_per_rank=sel.num_tokens, ranks=1, by_teacher=True)
    wrong = hashes(dp, sel, sampled)
    wrong[sel.ids.tolist()[3]] = "0" * 16
    with pytest.raises(CacheMismatch, match="other tokens"):
        learner.accumulate_gradients(0, plan, 0, wrong)


def test_sampled_token_baseline_runs_the_same_path(case):
    student, teachers, dp, sampled, sel = case
    learner = _learner(student, teachers, loss="sampled_token")
    plan = dp.plan(sel, tokens_per_rank=sel.num_tokens, ranks=1, by_teacher=True)
    before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    metrics = learner.plan_step(0, plan, 0, hashes(dp, sel, sampled))
    assert metrics["head_loads"] == len(teachers) and metrics["max_resident_heads"] == 1
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())


@pytest.mark.parametrize("damage,words", [("nan", "NaN or an infinity"), ("dtype", "this run caches"),
                                          ("width", "wide, its head takes")])
def test_cached_hidden_states_that_would_poison_the_student_are_refused(case, monkeypatch, damage, words):
    """One NaN at a scored position (it would make every weight NaN), hidden states of another dtype than
    the run caches (silently cast before) or of another width than the teacher's head: refused by name,
    before any weight changes."""
    import distill.opd_learner as ol

    student, teachers, dp, sampled, sel = case
    learner = _learner(student, teachers)
    plan = dp.plan(sel, tokens_per_rank=sel.num_tokens, ranks=1, by_teacher=True)
    load = ol._load

    def damaged(sub):
        batch = load(sub)
        h = batch.extras["teacher_hidden"]
        if damage == "nan":
            h = h.clone()
            h[int(batch.loss_mask.nonzero()[0, 0])] = float("nan")
        elif damage == "dtype":
            h = h.to(torch.float16)
        else:
            h = h[:, :-1]
        return dataclasses.replace(batch, extras={**batch.extras, "teacher_hidden": h})

    monkeypatch.setattr(ol, "_load", damaged)
    before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    with pytest.raises(CacheMismatch, match=words):
        learner.plan_step(0, plan, 0, hashes(dp, sel, sampled))
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())


def test_a_step_whose_gradient_is_not_finite_is_not_taken(case, monkeypatch):
    student, teachers, dp, sampled, sel = case
    learner = _learner(student, teachers)
    plan = dp.plan(sel, tokens_per_rank=sel.num_tokens, ranks=1, by_teacher=True)
    learner.accumulate_gradients(0, plan, 0, hashes(dp, sel, sampled))
    next(iter(learner.model.parameters())).grad.view(-1)[0] = float("inf")
    before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    with pytest.raises(FloatingPointError, match="not taken"):
        learner.apply_update()
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    assert all(p.grad is None for p in learner.model.parameters())
