"""SFT pieces: loss masks cover completion tokens only (tool results excluded), LR schedule."""
import rewards
from learner.config import SFTConfig
from learner.sft import collate, encode_example, lr_at, sample_batch
from learner.tokenizer import char_tokenizer

TOK = char_tokenizer()


def test_mask_covers_completion_and_eos_not_prompt():
    ex = encode_example(TOK, "add 1+2=", "3")
    assert ex.loss_mask == [0] * 8 + [1, 1]
    assert ex.input_ids[-1] == TOK.eos_token_id


def test_tool_result_tokens_are_masked():
    d = rewards.domain("calc")
    p = d.prompts("train", 1, 0)[0]
    c = d.demonstration(p)
    ex = encode_example(TOK, p, c)
    masked_text = "".join(ch for ch, m in zip(p + c, ex.loss_mask) if m == 0)
    assert masked_text.startswith(p)
    assert "<result>" in masked_text and "</result>" in masked_text
    trained = "".join(ch for ch, m in zip(p + c + "\0", ex.loss_mask) if m == 1)
    assert "<result>" not in trained and "<call>calc:" in trained


def test_collate_pads_right_with_zero_mask():
    b = collate([encode_example(TOK, "rev ab=", "ba"), encode_example(TOK, "add 10+20=", "30")], TOK.pad_token_id)
    assert b["input_ids"].shape == b["loss_mask"].shape == (2, 13)
    assert b["attention_mask"][0, -1] == 0 and b["loss_mask"][0, -1] == 0


def test_lr_schedule_warms_up_then_decays_to_ten_percent():
    cfg = SFTConfig(steps=100, warmup_steps=10, lr=1.0)
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert abs(lr_at(99, cfg) - 0.1) < 1e-3
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


def test_batches_are_seeded_and_mix_domains():
    cfg = SFTConfig(batch_size=6)
    a, b = sample_batch(cfg, 5, TOK), sample_batch(cfg, 5, TOK)
    assert [e.input_ids for e in a] == [e.input_ids for e in b]
    assert [e.input_ids for e in a] != [e.input_ids for e in sample_batch(cfg, 6, TOK)]
    texts = [TOK.decode(e.input_ids[:4]) for e in a]
    assert {t[:3] for t in texts} == {"add", "rev", "mul"}
