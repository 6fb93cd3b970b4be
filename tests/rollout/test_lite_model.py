"""The rollout worker's transformers-free checkpoint load: the same parameters, fingerprint and rollouts as
the HF class, the learner's weights load into it, and what LeanForward does not cover is left to HF."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from core.hf import load_policy
from rollout.engine import Engine, model_fingerprint
from core.hf import load_tokenizer
from rollout.lite_model import LiteCausalLM, LiteTokenizer, load_lite, load_lite_tokenizer
from rollout.sampling import SamplingParams
from rollout.worker import load_for_engine


def _save(tmp_path, cfg, tok=None):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)  # non-zero biases, so a dropped one shows
    model.save_pretrained(tmp_path)
    if tok is not None:
        tok.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lite_load_matches_the_hf_class(tiny_ckpt, dtype):
    lite = load_lite(tiny_ckpt, dtype)
    hf, _ = load_policy(tiny_ckpt, dtype=dtype)
    assert isinstance(lite, LiteCausalLM)
    a, b = lite.state_dict(), hf.state_dict()
    assert list(a) == list(b)
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.values(), b.values()))
    assert lite.lm_head.weight is lite.model.embed_tokens.weight  # tied, as in the checkpoint's config
    assert torch.equal(lite.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert model_fingerprint(lite) == model_fingerprint(hf)  # a KV snapshot stays valid across the two loads


def test_lite_engine_rolls_out_what_the_hf_engine_does(tiny_ckpt):
    lite, tok = load_for_engine(str(tiny_ckpt), torch.float32, "cpu")
    hf, _ = load_policy(tiny_ckpt)
    assert isinstance(lite, LiteCausalLM)
    prompts = [tok.encode(f"add {i * 37}+{i * 91}=") for i in range(3)]
    ids = [f"r{i}" for i in range(3)]
    for params in (SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True),
                   SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)):
        out = [Engine(m, tok, seed=7, max_batch=2, strict=True).generate(prompts, params, ids) for m in (hf, lite)]
        assert [x.tokens for x in out[0]] == [y.tokens for y in out[1]]
    draws = []
    for m in (hf, lite):  # the behaviour log-probs the learner gets, step by step (prefill included)
        eng = Engine(m, tok, seed=7, max_batch=3, strict=False)
        for rid, p in zip(ids, prompts):
            eng.add(rid, p, [False] * len(p), params)
        got = []
        for _ in range(10):
            d = eng.step()
            got += [(x.req_id, x.token, x.logprob) for x in d]
            eng.accept(d)
        draws.append(got)
    assert [d[:2] for d in draws[0]] == [d[:2] for d in draws[1]]
    assert [d[2] for d in draws[0]] == pytest.approx([d[2] for d in draws[1]], abs=1e-5)
    # the learner's weights (an HF state dict) load into it and change what it samples
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    eng = Engine(lite, tok, seed=7, max_batch=2, strict=True)
    before = eng.fingerprint
    eng.load_weights(state, 1)
    assert eng.fingerprint != before and torch.equal(lite.model.layers[0].mlp.up_proj.weight, state["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("cfg", [
    LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, hidden_act="gelu"),
], ids=["rope-scaling", "gelu"])
def test_what_lean_does_not_cover_is_loaded_as_its_hf_class(tmp_path, tiny_policy, cfg):
    _save(tmp_path, cfg, tiny_policy[1])
    assert load_lite(tmp_path) is None
    model, _ = load_for_engine(str(tmp_path), torch.float32, "cpu")
    assert not isinstance(model, LiteCausalLM)


def test_llama_with_biases_and_no_tying(tmp_path):
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, attention_bias=True, tie_word_embeddings=False)
    hf = _save(tmp_path, cfg)
    lite = load_lite(tmp_path)
    assert lite.lm_head.weight is not lite.model.embed_tokens.weight
    assert all(torch.equal(x, y) for x, y in zip(lite.state_dict().values(), hf.state_dict().values()))
    assert model_fingerprint(lite) == model_fingerprint(hf)


def test_a_damaged_checkpoint_is_refused_clearly(tmp_path, tiny_ckpt):
    for f in tiny_ckpt.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] += 1  # the file lacks a layer the config asks for
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_lite(tmp_path)
    cfg["num_hidden_layers"] -= 1
    cfg["intermediate_size"] += 8  # every MLP tensor has the wrong shape
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="size mismatch"):
        load_lite(tmp_path)
    cfg["intermediate_size"] -= 8
    cfg["vocab_size"] = 1 << 40  # terabytes of embedding: refused before anything is allocated
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="asks for at least"):
        load_lite(tmp_path)
    cfg["vocab_size"], cfg["num_attention_heads"] = 64, 0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not describe a model"):
        load_lite(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="does not load"):
        load_lite(tmp_path)


def test_a_worker_process_never_imports_transformers(tiny_ckpt):
    """What the replacement of a killed worker costs: its imports. The lite path keeps transformers
    (and the torch._dynamo / sympy its model code drags in) out of the process."""
    code = ("import sys, torch; from rollout.worker import load_for_engine; "
            f"m, t = load_for_engine({str(tiny_ckpt)!r}, torch.float32, 'cpu'); "
            "bad = [n for n in ('transformers', 'torch._dynamo', 'sympy') if n in sys.modules]; "
            "print(type(m).__name__, bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LiteCausalLM", "[]"], out.stdout


def test_lite_tokenizer_encodes_and_decodes_as_the_hf_one(tiny_ckpt):
    lite, hf = load_lite_tokenizer(tiny_ckpt), load_tokenizer(tiny_ckpt)
    assert isinstance(lite, LiteTokenizer) and (lite.eos_token_id, lite.pad_token_id) == (hf.eos_token_id, hf.pad_token_id)
    texts = ["12*34=<tool>calc 12*34</tool>", "", "  two  spaces\nnew line\t", "héllo ✓ unknown", "<eos>x<pad>", "<result>408</result>"]
    for t in texts:
        assert lite.encode(t) == hf.encode(t), t
    ids = hf.encode("abc") + [hf.eos_token_id, hf.pad_token_id] + hf.encode(" z?") + [2]
    for skip in (False, True):
        assert lite.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert lite.decode(ids) == hf.decode(ids)


def test_tokenizers_transformers_would_change_are_left_to_it(tmp_path, tiny_ckpt):
    for f in tiny_ckpt.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for change in ({"add_bos_token": True}, {"clean_up_tokenization_spaces": True}, {"tokenizer_class": "Qwen2Tokenizer"}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, **change}))
        assert load_lite_tokenizer(tmp_path) is None, change


@pytest.mark.parametrize("lite", [True, False], ids=["lite", "hf"])
def test_a_groups_repeated_prompt_is_prefilled_once_with_the_kv_of_its_own_forward(tiny_ckpt, lite):
    model, tok = (load_for_engine(str(tiny_ckpt), torch.float32, "cpu") if lite else load_policy(tiny_ckpt))
    a, b = tok.encode("add 12+34="), tok.encode("add 56+78=")
    assert len(a) == len(b)
    group = [a, a, b, a, b, b]  # two prompts, G copies each, as a GRPO batch arrives
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    eng = Engine(model, tok, seed=7, max_batch=len(group), strict=False)
    for i, p in enumerate(group):
        eng.add(f"r{i}", p, [False] * len(p), params)
    eng.collect(eng.launch())
    assert eng.stats["prefill_rows_shared"] == 4 and eng.stats["block_tokens"] == 2 * (len(a) - 1)
    for p in (a, b):  # each prompt alone, in an engine of its own
        one = Engine(model, tok, seed=7, max_batch=1, strict=True)
        one.add("x", p, [False] * len(p), params)
        one.collect(one.launch())
        for i, q in enumerate(group):
            if q == p:
                slot = eng.seqs[f"r{i}"].slot
                for layer in range(len(one.kv.k)):
                    for mine, ref in ((eng.kv.k[layer], one.kv.k[layer]), (eng.kv.v[layer], one.kv.v[layer])):
                        torch.testing.assert_close(mine[slot, :, :len(p) - 1], ref[0, :, :len(p) - 1],
                                                   atol=1e-5, rtol=1e-5)
