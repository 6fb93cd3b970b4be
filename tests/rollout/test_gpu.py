"""The engine on a CUDA device: the CUDA-graph decode draws what eager decode draws, strict mode is batch
invariant in bf16, and a KV snapshot restored to the GPU, whole or split, resumes to the uninterrupted
trajectory."""
import pytest
import torch

from rollout.engine import Engine
from rollout.sampling import SamplingParams
from rollout.snapshot import SnapshotStore, encode

pytestmark = pytest.mark.gpu
P = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_policy(tiny_policy):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model, tok = tiny_policy
    import copy
    return copy.deepcopy(model).to("cuda", torch.bfloat16), tok


def _prompts(tok, n):
    return [tok.encode(f"add {i * 37 % 1000}+{i * 91 % 1000}=" + "x" * (i % 5)) for i in range(n)]


def test_cuda_graph_decode_matches_eager(gpu_policy):
    model, tok = gpu_policy
    prompts, ids = _prompts(tok, 6), [f"g{i}" for i in range(6)]
    eager = [s.tokens for s in Engine(model, tok, seed=1, max_batch=4, max_len=96).generate(prompts, P, ids)]
    eng = Engine(model, tok, seed=1, max_batch=4, max_len=96, static_decode=True)
    assert eng.static is not None and eng.static.graph is not None
    graph = [s.tokens for s in eng.generate(prompts, P, ids)]
    agree = sum(a == b for x, y in zip(graph, eager) for a, b in zip(x, y)) / sum(map(len, eager))
    assert agree > 0.95


def test_strict_is_batch_invariant_on_gpu(gpu_policy):
    model, tok = gpu_policy
    prompts, ids = _prompts(tok, 5), [f"s{i}" for i in range(5)]
    alone = [Engine(model, tok, seed=2, max_batch=1, max_len=96, strict=True).generate([p], P, [i])[0].tokens
             for p, i in zip(prompts, ids)]
    batch = [s.tokens for s in Engine(model, tok, seed=2, max_batch=4, max_len=96, strict=True).generate(prompts, P, ids)]
    assert batch == alone


def test_kv_restore_on_gpu_resumes_exactly(gpu_policy, tmp_path):
    model, tok = gpu_policy
    p = _prompts(tok, 1)[0]
    eng = Engine(model, tok, seed=3, max_batch=1, max_len=96, strict=True)
    eng.add("k", p, [False] * len(p), P)
    for _ in range(9):
        eng.accept(eng.step())
    kv, covered = eng.export_kv("k")
    seq = eng.seqs["k"]
    tokens, sampled = list(seq.tokens), list(seq.sampled)
    SnapshotStore(tmp_path).put("k", encode("k", tokens[:covered], kv, eng.version, eng.fingerprint))
    while seq.state == "run":
        eng.accept(eng.step())
    want = list(seq.tokens)
    eng2 = Engine(model, tok, seed=3, max_batch=1, max_len=96, strict=True, fingerprint=eng.fingerprint)
    _, kv2 = SnapshotStore(tmp_path).load("k", tokens, eng2.version, eng2.fingerprint, eng2.dtype, "cuda")
    assert all(t.is_cuda for t in kv2.values())
    eng2.add("k", tokens, sampled, P, kv=kv2)
    while eng2.seqs["k"].state == "run":
        eng2.accept(eng2.step())
    assert eng2.seqs["k"].tokens == want


def test_split_resume_on_gpu_restores_the_snapshot_tail(gpu_policy, tmp_path, monkeypatch):
    """On the GPU the tail is read into the pinned staging buffer and uploaded on a side stream while the
    head is prefilled: the slot's KV is the snapshot's from the split on and equals a whole restore's."""
    import rollout.snapshot as snap
    from rollout import restore

    monkeypatch.setattr(snap, "BLOCK_TOKENS", 8)
    model, tok = gpu_policy
    p = _prompts(tok, 1)[0]
    eng = Engine(model, tok, seed=3, max_batch=2, max_len=96)
    eng.add("k", p, [False] * len(p), P)
    for _ in range(24):
        eng.accept(eng.step())
    kv, covered = eng.export_kv("k")
    tokens, sampled = list(eng.seqs["k"].tokens), list(eng.seqs["k"].sampled)
    store = SnapshotStore(tmp_path)
    store.put("k", encode("k", tokens[:covered], kv, eng.version, eng.fingerprint))
    got = {}
    policies = {"whole": restore.SplitPolicy(enabled=False), "split": restore.SplitPolicy(split_cached=True)}
    for name, policy in policies.items():  # the snapshot was just written: in the page cache
        e = Engine(model, tok, seed=3, max_batch=2, max_len=96, fingerprint=eng.fingerprint)
        r = restore.resume(e, store, policy, "k", tokens, sampled, P)
        assert r.rejected == "" and r.kv_tokens + r.head_tokens == covered and (r.head_tokens > 0) == (name == "split")
        slot = e.seqs["k"].slot
        got[name] = [t[slot, :, :covered].float().cpu() for t in e.kv.k + e.kv.v], r.head_tokens
    (whole, _), (split, head) = got["whole"], got["split"]
    for i, (a, b) in enumerate(zip(whole, split)):
        name = f"{'kv'[i // len(eng.kv.k)]}.{i % len(eng.kv.k)}"
        assert torch.equal(b[:, head:], kv[name][:, head:].float()) and torch.equal(a, kv[name].float())
        torch.testing.assert_close(b[:, :head], a[:, :head], rtol=0.05, atol=0.05)  # bf16 prefill of the head


def test_worker_with_cuda_graphs_resumes_a_preemption_and_decodes_live_weights(tmp_path, tiny_ckpt):
    """`engine.cuda_graphs` on a CUDA worker: the graph is captured at start, a preemption mid-decode
    resumes from its KV snapshots, and weights handed over as a same-process learner's live CUDA tensors
    (fp32) are what the graph then decodes with."""
    import copy

    from rollout.config import EngineConfig
    from rollout.worker import RolloutWorker, WorkerSpec
    from tests.rollout.test_worker import _drain, _requests

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = WorkerSpec(name="g", checkpoint=str(tiny_ckpt), wal_path=str(tmp_path / "wal"),
                      snapshot_uri=str(tmp_path / "kv"), seed=11,
                      engine=EngineConfig(max_batch=4, max_len=128, strict=False, cuda_graphs=True, device="cuda",
                                          dtype="bfloat16"))
    w = RolloutWorker(spec)
    assert w.engine.static is not None and w.engine.static.graph is not None
    w.submit(_requests(3))
    for _ in range(5):
        w.run(1)
    assert w.preempt() > 0
    w2 = RolloutWorker(spec)
    w2.submit(_requests(3))
    out = _drain(w2)
    assert len(out) == 3 and w2.counters["kv_restore"] >= 1, dict(w2.counters)
    from core.hf import load_policy

    learner, tok = load_policy(tiny_ckpt, dtype=torch.float32)
    learner.to("cuda")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn_like(p))
    w2.update_weights({k: v.detach() for k, v in learner.state_dict().items()}, 1)
    want = copy.deepcopy(learner).to(torch.bfloat16)
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in w2.engine.model.state_dict().items())
    prompts, ids = _prompts(tok, 4), [f"l{i}" for i in range(4)]
    graph = [s.tokens for s in w2.engine.generate(prompts, P, ids)]
    eager = [s.tokens for s in Engine(want, tok, seed=11, max_batch=4, max_len=128).generate(prompts, P, ids)]
    agree = sum(a == b for x, y in zip(graph, eager) for a, b in zip(x, y)) / sum(map(len, eager))
    assert agree > 0.95
    w.close()
    w2.close()


def test_device_uniforms_on_cuda_equal_the_host_function():
    from rollout.sampling import row_hash, traj_key, uniform, uniform_t

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    keys = [traj_key(f"t{i}") for i in range(64)] + [(1 << 64) - 1]
    pos = [i * 977 for i in range(len(keys))]
    got = uniform_t(torch.tensor([row_hash(12, k) for k in keys], device="cuda"), torch.tensor(pos, device="cuda"))
    assert got.tolist() == [uniform(12, k, p) for k, p in zip(keys, pos)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_cuda_graph_decode_matches_one_step_graph_decode(gpu_policy, compiled):
    """Chunks of steps fed back on the device (captured, optionally compiled) against the one-step static
    graph: bf16 rounding of the two forwards differs, so the tokens agree up to rare divergences."""
    model, tok = gpu_policy
    prompts, ids = _prompts(tok, 6), [f"g{i}" for i in range(6)]
    want = [s.tokens for s in Engine(model, tok, seed=1, max_batch=4, max_len=96, static_decode=True)
            .generate(prompts, P, ids)]
    eng = Engine(model, tok, seed=1, max_batch=4, max_len=96, static_decode=True, decode_chunk=8,
                 compile_decode=compiled)
    got = [s.tokens for s in eng.generate(prompts, P, ids)]
    assert eng.chunk is not None and eng.chunk._graphs
    assert [len(x) for x in got] == [len(x) for x in want]
    agree = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) / sum(map(len, want))
    assert agree > 0.95
