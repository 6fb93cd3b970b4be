"""Engine: logits and log-probs equal a plain HF forward, greedy equals HF generate, batch invariance,
resume from any decode point equals the uninterrupted run."""
import random

import pytest
import torch

from rollout.engine import Engine
from rollout.sampling import SamplingParams

P = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)


def _prompts(tok, n):
    return [tok.encode(f"add {i * 37 % 1000}+{i * 91 % 1000}=" + "x" * (i % 5)) for i in range(n)]


def test_logprobs_equal_a_full_forward(tiny_policy):
    model, tok = tiny_policy
    eng = Engine(model, tok, seed=3, max_batch=4)
    prompts = _prompts(tok, 3)
    ids = [f"a{i}" for i in range(3)]
    for rid, p in zip(ids, prompts):
        eng.add(rid, p, [False] * len(p), P)
    logged = {rid: [] for rid in ids}
    for _ in range(12):
        draws = eng.step()
        for d in draws:
            logged[d.req_id].append(d.logprob)
        eng.accept(draws)
    for rid, p in zip(ids, prompts):
        seq = eng.seqs[rid]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([seq.tokens])).logits[0].double(), -1)
        want = [ref[t - 1, seq.tokens[t]].item() for t in range(len(p), len(seq.tokens))]
        assert logged[rid] == pytest.approx(want, abs=1e-4)


def test_greedy_equals_hf_generate(tiny_policy):
    model, tok = tiny_policy
    p = _prompts(tok, 1)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    ours = Engine(model, tok, max_batch=2).generate([p], greedy)[0].tokens
    with torch.no_grad():
        hf = model.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                            pad_token_id=tok.pad_token_id)[0].tolist()
    assert ours == hf


def test_stop_strings_and_eos(tiny_policy):
    model, tok = tiny_policy
    eng = Engine(model, tok, max_batch=2)
    p = tok.encode("q=")
    eng.add("s", p, [False] * len(p), SamplingParams(max_new_tokens=200, stop=("a",), ignore_eos=True))
    while eng.seqs["s"].state == "run":
        eng.accept(eng.step())
    seq = eng.seqs["s"]
    assert seq.state == "paused" and seq.reason == "stop:a" and tok.decode(seq.tokens).endswith("a")
    eng.append_env("s", tok.encode("<result>1</result>"))
    assert seq.state == "run" and seq.sampled[-1] is False
    eng.accept(eng.step())
    assert seq.sampled[-1] is True


def test_strict_batch_invariance_and_fast_agreement(tiny_policy):
    """Strict: a sequence decoded in a batch equals it decoded alone, token for token. Fast: measured."""
    model, tok = tiny_policy
    prompts = _prompts(tok, 6)
    ids = [f"b{i}" for i in range(6)]
    alone = [Engine(model, tok, seed=9, max_batch=1, strict=True).generate([p], P, [rid])[0].tokens
             for rid, p in zip(ids, prompts)]
    strict = [s.tokens for s in Engine(model, tok, seed=9, max_batch=4, strict=True).generate(prompts, P, ids)]
    fast = [s.tokens for s in Engine(model, tok, seed=9, max_batch=4, strict=False).generate(prompts, P, ids)]
    assert strict == alone
    agree = sum(a == b for x, y in zip(fast, alone) for a, b in zip(x, y)) / sum(map(len, alone))
    assert agree > 0.9  # fast path: measured agreement (bench/rollout.py reports it); strict is exact


@pytest.mark.parametrize("strict", [True, False])
def test_resume_from_any_point_equals_uninterrupted(tiny_policy, strict):
    model, tok = tiny_policy
    p = _prompts(tok, 1)[0]
    full = Engine(model, tok, seed=5, max_batch=2, strict=True).generate([p], P, ["r"])[0]
    rng = random.Random(0)
    for cut in sorted(rng.sample(range(len(p) + 1, len(full.tokens)), 4)):
        eng = Engine(model, tok, seed=5, max_batch=2, strict=strict)
        eng.add("r", full.tokens[:cut], full.sampled[:cut], P)
        while eng.seqs["r"].state == "run":
            eng.accept(eng.step())
        assert eng.seqs["r"].tokens == full.tokens, f"cut {cut}"


def test_kv_export_restore_and_bad_kv(tiny_policy):
    model, tok = tiny_policy
    p = _prompts(tok, 1)[0]
    eng = Engine(model, tok, seed=2, max_batch=2, strict=True)
    eng.add("k", p, [False] * len(p), P)
    for _ in range(7):
        eng.accept(eng.step())
    kv, covered = eng.export_kv("k")
    seq = eng.seqs["k"]
    tokens, sampled = list(seq.tokens), list(seq.sampled)
    while seq.state == "run":
        eng.accept(eng.step())
    want = seq.tokens
    eng2 = Engine(model, tok, seed=2, max_batch=2, strict=True)
    assert eng2.add("k", tokens, sampled, P, kv=kv) == len(tokens) - 1 - covered
    while eng2.seqs["k"].state == "run":
        eng2.accept(eng2.step())
    assert eng2.seqs["k"].tokens == want
    bad = {k: v[:, :3] for k, v in kv.items()}  # 3 tokens: inside the prompt, not a decode point
    with pytest.raises(ValueError):
        Engine(model, tok, max_batch=1).add("k", tokens, sampled, P, kv=bad)


@pytest.mark.parametrize("fails", ["callable", "prefill"])
def test_a_request_whose_admission_fails_is_taken_out_again(tiny_policy, monkeypatch, fails):
    """Whatever fails once a request is in (its deferred KV's callable, the head's prefill) leaves the engine
    as it was: the request out, its slot free, the same id admitted again."""
    model, tok = tiny_policy
    p = _prompts(tok, 1)[0]
    eng = Engine(model, tok, seed=2, max_batch=2)
    eng.add("k", p, [False] * len(p), P)
    for _ in range(5):
        eng.accept(eng.step())
    kv, covered = eng.export_kv("k")
    tokens, sampled = list(eng.seqs["k"].tokens), list(eng.seqs["k"].sampled)
    eng2 = Engine(model, tok, seed=2, max_batch=2)

    def read_fails():
        raise OSError(5, "Input/output error")

    if fails == "prefill":
        def out_of_memory(*_a):
            raise RuntimeError("out of memory")
        monkeypatch.setattr(eng2, "_feed_block", out_of_memory)
    with pytest.raises(OSError if fails == "callable" else RuntimeError):
        eng2.add("k", tokens, sampled, P, kv=read_fails, kv_start=2)
    assert "k" not in eng2.seqs and eng2.capacity == 2
    monkeypatch.undo()
    assert eng2.add("k", tokens, sampled, P) == len(tokens) - 1 and eng2.capacity == 1


def test_static_decode_matches_eager_decode(tiny_policy):
    """The static all-slot forward (a CUDA graph on a GPU) draws what eager decode draws; requests join late."""
    model, tok = tiny_policy
    prompts = _prompts(tok, 5)
    ids = [f"s{i}" for i in range(5)]
    eager = [s.tokens for s in Engine(model, tok, seed=4, max_batch=3, max_len=96).generate(prompts, P, ids)]
    static = Engine(model, tok, seed=4, max_batch=3, max_len=96, static_decode=True)
    assert static.static is not None
    got = [s.tokens for s in static.generate(prompts, P, ids)]
    agree = sum(a == b for x, y in zip(got, eager) for a, b in zip(x, y)) / sum(map(len, eager))
    assert agree > 0.97 and [len(x) for x in got] == [len(x) for x in eager]


def test_load_weights_copies_in_place_and_fingerprints_what_it_holds(tiny_policy):
    """New weights go into the engine's own parameter tensors (a captured decode graph reads those); the
    caller's tensors (a learner's live ones) stay separate; the fingerprint names the weights held now."""
    import copy

    from rollout.engine import model_fingerprint

    model, tok = tiny_policy
    mine = copy.deepcopy(model)
    eng = Engine(mine, tok, seed=5, max_batch=2, max_len=96, static_decode=True)
    before, ptrs = eng.fingerprint, {k: v.data_ptr() for k, v in mine.state_dict().items()}
    torch.manual_seed(0)
    live = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    if "lm_head.weight" in live:  # tied to the embedding
        live["lm_head.weight"] = live["model.embed_tokens.weight"]
    eng.load_weights(live, 1)
    held = mine.state_dict()
    assert {k: v.data_ptr() for k, v in held.items()} == ptrs
    assert all(torch.equal(held[k], v) for k, v in live.items())
    want = copy.deepcopy(model)
    want.load_state_dict(live)
    assert eng.fingerprint == model_fingerprint(want) != before
    for v in live.values():  # the learner steps on: the engine keeps the published weights
        v.add_(1.0)
    assert eng.fingerprint == model_fingerprint(mine) == model_fingerprint(want)
    fresh = Engine(want, tok, seed=5, max_batch=2, max_len=96, static_decode=True)
    prompts, ids = _prompts(tok, 3), [f"w{i}" for i in range(3)]
    assert [s.tokens for s in eng.generate(prompts, P, ids)] == [s.tokens for s in fresh.generate(prompts, P, ids)]


@pytest.mark.parametrize("params", [P, SamplingParams(temperature=1.0, max_new_tokens=30),
                                    SamplingParams(temperature=0.0, max_new_tokens=20)], ids=["fixed", "eos", "greedy"])
def test_chunked_decode_draws_what_one_step_decode_draws(tiny_policy, params):
    """Steps fed back on the device (chunks of 1..64 steps) draw the one-step path's tokens and log-probs;
    requests stop inside a chunk (EOS) and join late (more requests than slots)."""
    model, tok = tiny_policy
    prompts, ids = _prompts(tok, 7), [f"c{i}" for i in range(7)]
    want = Engine(model, tok, seed=4, max_batch=3, max_len=60).generate(prompts, params, ids)
    for chunk in (2, 5, 64):
        eng = Engine(model, tok, seed=4, max_batch=3, max_len=60, decode_chunk=chunk)
        assert eng.chunk is not None
        got = eng.generate(prompts, params, ids)
        assert [s.tokens for s in got] == [s.tokens for s in want]
        assert [s.reason for s in got] == [s.reason for s in want]
    if not params.ignore_eos and params.temperature > 0:  # the EOS case does stop inside chunks
        assert any(s.reason == "eos" for s in want)


def test_a_chunk_stops_at_a_stop_string_and_keeps_kv_of_kept_tokens_only(tiny_policy):
    """A request paused by a stop string inside a chunk keeps only the draws up to it; the K/V it holds
    then cover exactly its kept tokens but the pending one (what the one-step path holds)."""
    model, tok = tiny_policy
    prompts = _prompts(tok, 2)
    probe = Engine(model, tok, seed=6, max_batch=2, max_len=80).generate(prompts[:1], P, ["k0"])[0]
    stop = tok.decode(probe.tokens[len(prompts[0]) + 5:len(prompts[0]) + 7])  # hit after the 7th sampled token
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, stop=(stop,))
    held = []
    for chunk in (1, 16):
        eng = Engine(model, tok, seed=6, max_batch=2, max_len=80, decode_chunk=chunk)
        eng.add("k0", prompts[0], [False] * len(prompts[0]), params)
        while eng.seqs["k0"].state == "run":
            eng.accept_steps(eng.collect_steps(eng.launch(chunk)))
        seq = eng.seqs["k0"]
        kv, covered = eng.export_kv("k0")
        held.append((list(seq.tokens), seq.reason, covered, kv))
    (t1, r1, c1, kv1), (t16, r16, c16, kv16) = held
    assert r1 == r16 == f"stop:{stop}" and t1 == t16 and c1 == c16 == len(t1) - 1
    assert all(torch.allclose(kv1[k], kv16[k], atol=1e-5) for k in kv1)


def test_chunked_decode_decodes_new_weights(tiny_policy):
    """load_weights refreshes the lean forward's fused copies in place: a chunked engine decodes the new
    weights as a fresh engine holding them does."""
    import copy

    model, tok = tiny_policy
    mine, want = copy.deepcopy(model), copy.deepcopy(model)
    eng = Engine(mine, tok, seed=5, max_batch=2, max_len=64, decode_chunk=8)
    torch.manual_seed(1)
    live = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    live["lm_head.weight"] = live["model.embed_tokens.weight"]
    eng.load_weights(live, 1)
    want.load_state_dict(live)
    prompts, ids = _prompts(tok, 3), [f"n{i}" for i in range(3)]
    fresh = Engine(want, tok, seed=5, max_batch=2, max_len=64)
    assert [s.tokens for s in eng.generate(prompts, P, ids)] == [s.tokens for s in fresh.generate(prompts, P, ids)]


def test_a_chunk_runs_no_more_steps_than_its_rows_can_draw(tiny_policy):
    """A chunk is cut at the most tokens any row may still draw (its budget, the context left)."""
    model, tok = tiny_policy
    p = _prompts(tok, 1)[0]
    eng = Engine(model, tok, seed=1, max_batch=2, max_len=len(p) + 12, decode_chunk=64)
    eng.add("a", p, [False] * len(p), SamplingParams(max_new_tokens=40, ignore_eos=True))
    steps = eng.collect_steps(eng.launch(64))
    assert len(steps) == 11 and eng.stats["decode_rows"] == 11  # max_len - 1 - len(prompt): the context ends it
    eng.accept_steps(steps)
    assert eng.seqs["a"].reason == "context" and len(eng.seqs["a"].tokens) == len(p) + 11
    eng.add("b", p, [False] * len(p), SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert len(eng.collect_steps(eng.launch(64))) == 5
