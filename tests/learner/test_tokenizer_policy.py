"""Char tokenizer round trips and HF save/load of the tiny policy."""
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from learner.config import PolicyConfig
from learner.policy import build_policy
from core.errors import UserError
from core.hf import load_policy, save_policy
from learner.tokenizer import CHARS, EOS, PAD, UNK, char_tokenizer

TOK = char_tokenizer()


@given(st.text(alphabet=st.sampled_from(CHARS), max_size=200))
@settings(max_examples=200, deadline=None)
def test_round_trip_one_token_per_char(text):
    assume(not any(special in text for special in (PAD, EOS, UNK)))  # those spell one special token each
    ids = TOK(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)
    assert TOK.decode(ids) == text


def test_special_token_strings_in_text_are_the_special_tokens():
    ids = TOK("a<pad>b<eos>", add_special_tokens=False).input_ids
    assert ids == [TOK("a").input_ids[0], TOK.pad_token_id, TOK("b").input_ids[0], TOK.eos_token_id]


def test_unknown_chars_map_to_unk_and_specials_are_distinct():
    ids = TOK("aé\tb", add_special_tokens=False).input_ids
    assert ids[1] == TOK.unk_token_id and ids[2] == TOK.unk_token_id
    assert len({TOK.pad_token_id, TOK.eos_token_id, TOK.unk_token_id}) == 3


def test_save_load_gives_identical_logits_and_tokenizer(tmp_path):
    model, tok = build_policy(PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                           intermediate_size=64))
    save_policy(model, tok, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    model2, tok2 = load_policy(tmp_path)
    x = torch.tensor([tok("add 1+2=").input_ids])
    torch.testing.assert_close(model(x).logits, model2(x).logits, rtol=0, atol=0)
    assert tok2.decode(tok2("rev abc=").input_ids) == "rev abc="
    assert tok2.eos_token_id == tok.eos_token_id


@pytest.mark.parametrize("damage", ["layers_up", "layers_down", "width", "truncated"])
def test_a_checkpoint_whose_weights_do_not_fit_its_config_is_refused(tmp_path, damage):
    """A config.json edited apart from its weights (more layers: some random; fewer: some dropped; another
    width) or a truncated safetensors file: a UserError naming the checkpoint, never a partly random model."""
    import json

    model, tok = build_policy(PolicyConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                           intermediate_size=64))
    save_policy(model, tok, tmp_path)
    cfg_path, weights = tmp_path / "config.json", tmp_path / "model.safetensors"
    cfg = json.loads(cfg_path.read_text())
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        key, value = {"layers_up": ("num_hidden_layers", 3), "layers_down": ("num_hidden_layers", 1),
                      "width": ("intermediate_size", 96)}[damage]
        cfg[key] = value
        cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match=f"checkpoint {tmp_path}"):
        load_policy(tmp_path)


def test_build_is_seeded():
    cfg = PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, seed=3)
    a, _ = build_policy(cfg)
    b, _ = build_policy(cfg)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
