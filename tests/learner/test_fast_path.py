"""The learner's GPU fast path, checked on CPU where it can be: per-sequence attention over a pack, merged
micro-batches, the fused LM-head chunk kernels (their math, uncompiled), backend selection."""
from __future__ import annotations

import copy

import pytest
import torch

import learner.grpo_loss as gl
from learner.packed_attention import pick_backend
from learner.train_step import Learner, LogprobModel, merge_packs, synthetic_packed_batch
from tests.learner.test_group_step import LENGTHS, config, grads, tiny_model


def test_sdpa_per_sequence_attention_equals_the_models_own():
    model, vocab = tiny_model()
    batch = synthetic_packed_batch(vocab, LENGTHS, seed=5)
    out = []
    for attention in (None, "sdpa_docs"):
        model.zero_grad()
        lm = LogprobModel(model, chunk_rows=7, attention=attention)
        logp, ent = lm(batch.input_ids_N, batch.position_ids_N, cu_seqlens_S1=batch.cu_seqlens_S1)
        (logp * batch.advantages_N.double()).sum().backward()
        out.append((logp.detach(), ent, grads(model)))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-10, atol=1e-10)
    for name, g in out[0][2].items():
        torch.testing.assert_close(out[1][2][name], g, rtol=1e-9, atol=1e-12, msg=name)
    # cu_seqlens derived from the positions when not given; the model's own attention is back after the call
    again = LogprobModel(model, attention="sdpa_docs")(batch.input_ids_N, batch.position_ids_N)[0]
    torch.testing.assert_close(again.detach(), out[0][0], rtol=1e-10, atol=1e-10)
    assert model.config._attn_implementation == "sdpa"


def test_merged_micro_batches_give_the_same_update():
    base, vocab = tiny_model()
    packs = [synthetic_packed_batch(vocab, LENGTHS[i:i + 2], seed=i) for i in range(0, 6, 2)]
    cfg = config(loss={"aggregation": "seq-mean-token-mean", "entropy_coef": 0.01}, optim={"grad_clip": 0.5},
                 learner={"micro_batch_tokens": 40})
    out = []
    for merge in (False, True):
        model = copy.deepcopy(base)
        metrics = Learner(model, cfg, merge_micro_batches=merge).train_step(packs)
        out.append((model.state_dict(), metrics))
    assert out[0][1]["micro_batches"] == 3 and out[1][1]["micro_batches"] == 2  # 23+25 > 40; 25+20 fit... by order
    for k, w in out[0][0].items():
        torch.testing.assert_close(out[1][0][k], w, rtol=1e-9, atol=1e-12, msg=k)
    for key in ("loss", "grad_norm", "entropy", "clip_frac"):
        assert out[1][1][key] == pytest.approx(out[0][1][key], rel=1e-9)


def test_merge_packs_keeps_order_budget_and_field_presence():
    a, b, c = (synthetic_packed_batch(50, n, seed=i) for i, n in enumerate(([5, 6], [7], [4, 4])))
    merged = merge_packs([a, b, c], 18)
    assert [m.num_tokens for m in merged] == [18, 8]
    assert torch.equal(merged[0].input_ids_N, torch.cat([a.input_ids_N, b.input_ids_N]))
    assert merged[0].cu_seqlens_S1.tolist() == [0, 5, 11, 18]
    merged[0].validate()
    v = synthetic_packed_batch(50, [3], seed=9, versions=(0, 1))  # has token versions; `a` has none
    assert len(merge_packs([a, v], 100)) == 2
    assert len(merge_packs([a, b, c], 1)) == 3


@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_head_kernels_match_the_eager_chunks(with_entropy, monkeypatch):
    """The compiled kernels' source functions, run eagerly on bf16 logits, against the eager fp32 path."""
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.bfloat16, requires_grad=True)
    w = (0.3 * torch.randn(61, 16)).requires_grad_()
    labels = torch.randint(0, 61, (37,))
    coef = torch.linspace(-1, 1, 37)
    out = []
    for fused in (False, True):
        monkeypatch.setitem(gl._FUSED_ENABLED, "cpu", fused)
        monkeypatch.setattr(gl, "_FUSED", (gl._chunk_forward, gl._chunk_backward))
        lp, ent = gl.logprobs_from_hidden(h, w, labels, chunk_rows=10, with_entropy=with_entropy)
        loss = (lp * coef).sum() + (0.3 * (ent * coef).sum() if with_entropy else 0)
        out.append((lp, ent, *torch.autograd.grad(loss, [h, w])))
    for got, want in zip(out[1], out[0]):
        if want is not None:
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3)
    # and the fused log-probs are the fp64 truth up to bf16 rounding of the logits
    logits = (h.double() @ w.double().t())
    truth = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(out[1][0].double(), truth, rtol=0, atol=5e-2)


def test_backend_choice():
    cpu = torch.device("cpu")
    # the CPU attends per sequence too: the model's own attention over the whole pack's [N, N] mask
    # costs a multiple of it (see the module docstring)
    assert pick_backend("auto", cpu) == "sdpa_docs" and pick_backend("hf", cpu) is None
    assert pick_backend("sdpa_docs", cpu) == "sdpa_docs"
    with pytest.raises(ValueError, match="needs CUDA"):
        pick_backend("varlen", cpu)
    with pytest.raises(ValueError, match="not in"):
        pick_backend("flash9", cpu)
    # fp32 attention (learner.bf16 = false, an fp32 model) never gets the bf16/fp16-only varlen kernel
    cuda = torch.device("cuda", 0)
    assert pick_backend("auto", cuda, torch.float32) == "sdpa_docs"
    assert pick_backend("sdpa_docs", cuda, torch.float32) == "sdpa_docs"


def test_checkpointed_blocks_attend_with_the_models_own_function():
    # the backward recomputes a checkpointed block after the packed-attention context has closed
    model, _ = tiny_model()
    cfg = config(learner={"activation_checkpointing": True})
    assert Learner(copy.deepcopy(model), cfg).attention is None
    assert Learner(copy.deepcopy(model), config()).attention == "sdpa_docs"
    with pytest.raises(ValueError, match="activation_checkpointing"):
        Learner(copy.deepcopy(model), cfg, attention="sdpa_docs")


def test_the_varlen_kernel_is_resolved_before_any_layer_runs(monkeypatch):
    """Resolved inside the compiled layers, the kernel's global flipped from None after their first trace
    and a guard on it recompiled them; use_packed_attention resolves it first."""
    import learner.packed_attention as pa

    kernel = object()
    monkeypatch.setattr(pa, "_VARLEN", None)
    monkeypatch.setattr(pa, "_varlen_call", lambda: kernel)
    model, _ = tiny_model()
    with pa.use_packed_attention(model, "sdpa_docs", torch.tensor([0, 3, 5])):
        assert pa._VARLEN is None  # only the varlen backend needs it
    with pa.use_packed_attention(model, "varlen", torch.tensor([0, 3, 5])) as kw:
        assert pa._VARLEN is kernel and kw["max_length_q"] == 3


def test_a_direct_varlen_call_resolves_the_kernel_itself(monkeypatch):
    import learner.packed_attention as pa

    calls = []

    def fake_kernel(q, k, v, cu, max_len, scale):
        calls.append((tuple(q.shape), max_len))
        return torch.zeros_like(q)

    monkeypatch.setattr(pa, "_VARLEN", None)
    monkeypatch.setattr(pa, "_varlen_call", lambda: fake_kernel)
    q = torch.zeros(1, 4, 5, 8, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 5, 8, dtype=torch.bfloat16)
    out, _ = pa.packed_attention_forward(None, q, kv, kv, None, 0.5, postrain_backend="varlen",
                                         cu_seq_lens_q=torch.tensor([0, 3, 5], dtype=torch.int32), max_length_q=3)
    assert out.shape == (1, 5, 4, 8) and calls == [((5, 4, 8), 3)] and pa._VARLEN is fake_kernel


def test_the_fused_chunk_kernels_compile_once_per_entropy_setting(monkeypatch):
    """Chunks of 10 and of fewer rows (a pack's last chunk), with and without entropy: one forward and one
    backward graph per setting. Without the rows marked dynamic, each shorter chunk compiled again."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    monkeypatch.setitem(gl._FUSED_ENABLED, "cpu", True)
    monkeypatch.setattr(gl, "_FUSED", None)
    counters.clear()
    torch.manual_seed(0)
    for n, with_entropy in ((37, False), (45, False), (23, False), (37, True), (52, True)):
        h = torch.randn(n, 16, dtype=torch.bfloat16, requires_grad=True)
        w = (0.3 * torch.randn(61, 16)).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = gl.logprobs_from_hidden(h, w, torch.randint(0, 61, (n,)), chunk_rows=10, with_entropy=with_entropy)
        (lp.sum() + (ent.sum() if with_entropy else 0)).backward()
    assert counters["stats"]["unique_graphs"] == 4
    torch._dynamo.reset()
