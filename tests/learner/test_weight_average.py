"""The weight average behind `loop.final = "ema"`: its arithmetic against the closed form, its dtypes, and
its state through a real learner checkpoint (safetensors, checksummed, never unpickled)."""
from __future__ import annotations

import json

import pytest
import torch

from core.errors import UserError
from learner.weight_average import WeightAverage


def _iterates(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)} for _ in range(n)]


def _closed_form(ws, decay):
    """sum_i (1 - d_i) prod_{j > i} d_j w_i with d_t = min(decay, (t - 1) / t)."""
    ds = [min(decay, (t - 1) / t) for t in range(1, len(ws) + 1)]
    out = {}
    for k in ws[0]:
        acc = torch.zeros_like(ws[0][k], dtype=torch.float64)
        for i, w in enumerate(ws):
            coef = (1 - ds[i]) * torch.tensor(ds[i + 1:], dtype=torch.float64).prod()
            acc += coef * w[k].double()
        out[k] = acc
    return out


def test_a_uniform_mean_first_then_an_exponential_average_of_that_horizon():
    ws = _iterates(12)
    avg = WeightAverage(0.75)  # horizon 4
    for w in ws[:4]:
        avg.update(w)
    for k in ("a", "b"):
        assert torch.allclose(avg.weights()[k], torch.stack([w[k] for w in ws[:4]]).mean(0), atol=1e-6)
    for w in ws[4:]:
        avg.update(w)
    want = _closed_form(ws, 0.75)
    for k in ("a", "b"):
        assert torch.allclose(avg.weights()[k].double(), want[k], atol=1e-6)
    assert not torch.allclose(avg.weights()["a"], ws[-1]["a"])  # an average, not the last iterate


def test_low_precision_iterates_are_averaged_in_float32_and_returned_in_their_dtype():
    avg = WeightAverage(0.9)
    ones = torch.ones(8, dtype=torch.bfloat16)
    avg.update({"w": ones})
    up = torch.full((8,), 1 + 2 ** -7, dtype=torch.bfloat16)  # bf16's next value after 1
    for _ in range(50):
        avg.update({"w": up})  # each update moves the average < half bf16's step: a bf16 accumulator stays at 1
    tensors, _ = avg.state()
    assert tensors["w"].dtype == torch.float32 and tensors["w"][0].item() > 1.0
    assert avg.weights()["w"].dtype == torch.bfloat16


def test_state_round_trip_continues_the_same_average_and_bad_state_is_refused():
    ws = _iterates(9, seed=1)
    straight, first = WeightAverage(0.8), WeightAverage(0.8)
    for w in ws:
        straight.update(w)
    for w in ws[:5]:
        first.update(w)
    tensors, meta = first.state()
    again = WeightAverage(0.8)
    again.load_state(tensors, meta)
    for w in ws[5:]:
        again.update(w)
    assert again.updates == 9 and all(torch.equal(again.weights()[k], straight.weights()[k]) for k in ("a", "b"))
    with pytest.raises(ValueError, match="metadata"):
        WeightAverage(0.8).load_state(tensors, {k: v for k, v in meta.items() if k != "updates"})
    with pytest.raises(ValueError, match="metadata"):
        WeightAverage(0.8).load_state(tensors, meta | {"dtype.a": "os.system"})
    with pytest.raises(ValueError, match="float32"):
        WeightAverage(0.8).load_state({k: v.double() for k, v in tensors.items()}, meta)
    with pytest.raises(ValueError, match="names changed"):
        again.update({"a": ws[0]["a"]})
    with pytest.raises(ValueError, match="decay"):
        WeightAverage(1.0)
    with pytest.raises(RuntimeError, match="no iterate"):
        WeightAverage(0.5).weights()


def test_the_average_travels_in_the_learner_checkpoint_and_a_corrupt_one_is_refused(tmp_path):
    from learner.checkpoint import load_extra, save_checkpoint
    from tests.distill.opd_fixtures import save_tiny
    from core.hf import load_policy

    model, tok = load_policy(save_tiny(tmp_path / "m", 32, seed=1))
    avg = WeightAverage(0.9)
    for w in _iterates(3):
        avg.update(w)
    trainer = {"policy_version": 3, "step": 3}
    plain = save_checkpoint(tmp_path / "ck", 2, model, tok, trainer, [{}])
    assert load_extra(plain, "ema") is None  # saved without one
    path = save_checkpoint(tmp_path / "ck", 3, model, tok, trainer, [{}], extra={"ema": avg.state()})
    assert "ema.safetensors" in json.loads((path / "state.json").read_text())["sha256"]
    tensors, meta = load_extra(path, "ema")
    back = WeightAverage(0.9)
    back.load_state(tensors, meta)
    assert back.updates == 3 and torch.equal(back.weights()["a"], avg.weights()["a"])
    with pytest.raises(ValueError, match="identifiers"):
        save_checkpoint(tmp_path / "ck", 4, model, tok, trainer, [{}], extra={"../x": avg.state()})
    raw = bytearray((path / "ema.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (path / "ema.safetensors").write_bytes(bytes(raw))
    with pytest.raises(UserError, match="checksum"):
        load_extra(path, "ema")
