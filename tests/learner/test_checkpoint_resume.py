"""Checkpoints: a resumed run continues with the same metrics and weights as an uninterrupted one;
writes are atomic; corruption is detected; the weights directory is an HF checkpoint."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from core.errors import UserError
from learner.checkpoint import latest_checkpoint, read_checkpoint
from learner.config import PolicyConfig
from learner.grpo_config import GRPOConfig
from learner.group import LearnerGroup
from core.hf import load_policy
from learner.tokenizer import char_tokenizer
from learner.tokenizer import char_tokenizer
from learner.train_step import synthetic_packed_batch

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=7)
CFG = GRPOConfig.model_validate({
    "learner": {"device": "cpu", "threads": 1, "seed": 3},
    "loss": {"entropy_coef": 0.01, "kl_coef": 0.05, "dual_clip": 3.0},
    "optim": {"lr": 3e-3, "warmup_steps": 2, "total_steps": 6, "weight_decay": 0.01, "grad_clip": 1.0},
})
BATCHES = [synthetic_packed_batch(len(char_tokenizer()), [11, 7, 13], seed=100 + i) for i in range(4)]


def run(group: LearnerGroup, steps: range) -> list[dict]:
    out = []
    for i in steps:
        group.set_policy_version(i)
        m = group.train_step([BATCHES[i].split(16)])
        m.pop("step_time_s"), m.pop("tokens_per_s")
        m["draw"] = torch.rand(2).tolist()  # the process RNG must resume where it was
        out.append(m)
    return out


def test_resume_continues_like_uninterrupted(tmp_path):
    torch.manual_seed(0)
    straight = LearnerGroup(CFG, TINY)
    want = run(straight, range(4))
    want_weights = straight.weights()

    torch.manual_seed(0)
    first = LearnerGroup(CFG, TINY)
    got = run(first, range(2))
    path = first.save_checkpoint(tmp_path / "ckpt", iteration=2)
    first.close()
    torch.manual_seed(12345)  # a fresh process would start elsewhere; the checkpoint's RNG must win
    # The same --init (it is also the KL reference policy); the trained weights must come from disk.
    resumed = LearnerGroup(CFG, TINY)
    init_weights = resumed.weights()
    state = resumed.load_checkpoint(tmp_path / "ckpt")
    assert any(not torch.equal(v, init_weights[k]) for k, v in resumed.weights().items())
    assert state["iteration"] == 2 and state["step"] == 2 and state["policy_version"] == 1
    got += run(resumed, range(2, 4))
    assert got == want  # every metric, bit for bit (lr schedule, AdamW moments, RNG included)
    for k, v in resumed.weights().items():
        assert torch.equal(v, want_weights[k]), k
    assert path.name == "iter_00000002" and latest_checkpoint(tmp_path / "ckpt") == path
    model, tok = load_policy(path / "model")  # what `postrain eval --checkpoint` takes
    assert len(tok) == len(char_tokenizer()) and sum(p.numel() for p in model.parameters()) > 0


def test_atomic_layout_and_corruption_detected(tmp_path):
    group = LearnerGroup(CFG, TINY)
    run(group, range(1))
    root = tmp_path / "ckpt"
    p1 = group.save_checkpoint(root, iteration=1)
    # A crash mid-save leaves only a temp dir, which is never taken for a checkpoint.
    shutil.copytree(p1, root / ".tmp-iter_00000002-999")
    os.remove(root / ".tmp-iter_00000002-999" / "state.json")
    assert latest_checkpoint(root) == p1
    assert sorted(x.name for x in p1.iterdir()) == ["model", "rng.pt", "state.json", "trainer.pt"]
    p1b = group.save_checkpoint(root, iteration=1)  # re-saving an iteration replaces it whole
    assert p1b == p1 and read_checkpoint(p1)["iteration"] == 1

    blob = bytearray((p1 / "trainer.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (p1 / "trainer.pt").write_bytes(bytes(blob))
    with pytest.raises(UserError, match="trainer.pt fails its checksum"):
        group.load_checkpoint(p1)
    os.remove(p1 / "rng.pt")
    with pytest.raises(UserError, match="rng.pt is missing"):
        read_checkpoint(p1)
    with pytest.raises(UserError, match="no learner checkpoint"):
        read_checkpoint(tmp_path / "nothing-here")


class _Payload:
    """Pickles as a call of exec(): what a crafted checkpoint carries to run code on --resume."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


@pytest.mark.parametrize("victim", ["trainer.pt", "rng.pt"])
def test_crafted_pickle_in_a_checkpoint_is_refused_and_runs_nothing(tmp_path, victim):
    import hashlib
    import json
    import subprocess
    import sys

    group = LearnerGroup(CFG, TINY)
    path = group.save_checkpoint(tmp_path / "ckpt", iteration=1)
    marker = tmp_path / "code-ran"
    real = torch.load(path / victim, weights_only=True)
    torch.save({"evil": _Payload(marker), "real": real}, path / victim)
    state = json.loads((path / "state.json").read_text())  # the attacker rewrites the checksum list too
    state["sha256"][victim] = hashlib.sha256((path / victim).read_bytes()).hexdigest()
    (path / "state.json").write_text(json.dumps(state))

    # Canary: the payload is real; a full unpickler runs it.
    subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(path / victim)!r}, weights_only=False)"],
                   check=False, capture_output=True, timeout=120)
    assert marker.read_text() == "code ran", "the crafted checkpoint does not carry working code: the test proves nothing"
    marker.unlink()

    with pytest.raises(UserError, match=f"{victim} holds objects other than tensors.*refused.*exec"):
        group.load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("text", ["", "{\"format\": 2", "[1, 2]"])
def test_a_damaged_state_json_is_one_clear_error(tmp_path, text):
    from core.errors import UserError
    from learner.checkpoint import read_checkpoint

    ckpt = tmp_path / "iter_00000001"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(text)
    with pytest.raises(UserError, match="state.json is not"):
        read_checkpoint(ckpt)


def _rewrite(path, rel, obj):
    """Replace `rel` by `obj` (torch.save) and its digest in state.json: a hand-edited checkpoint."""
    import hashlib
    import json

    if rel.endswith(".safetensors"):
        (path / rel).write_bytes(obj)
    else:
        torch.save(obj, path / rel)
    state = json.loads((path / "state.json").read_text())
    state["sha256"][rel] = hashlib.sha256((path / rel).read_bytes()).hexdigest()
    (path / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize("edit,needle", [
    (lambda s: s.pop("sha256"), "no sha256 table"),
    (lambda s: s.__setitem__("sha256", ["x"]), "no sha256 table"),
    (lambda s: s["sha256"].__setitem__("../../outside", "0" * 64), "not a file inside the checkpoint"),
])
def test_a_hand_edited_state_json_is_one_clear_error(tmp_path, edit, needle):
    import json

    path = LearnerGroup(CFG, TINY).save_checkpoint(tmp_path / "ckpt", iteration=1)
    state = json.loads((path / "state.json").read_text())
    edit(state)
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match=needle):
        read_checkpoint(path)


@pytest.mark.parametrize("rel,obj,needle", [
    ("rng.pt", [], "rng.pt holds no list"),
    ("rng.pt", [{"python": 3}], "rng.pt entry 0 is not an RNG state"),
    ("trainer.pt", [1, 2], "trainer.pt does not fit"),
    ("model/model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{", "do not load"),
])
def test_checkpoint_files_that_hold_the_wrong_data_are_one_clear_error(tmp_path, rel, obj, needle):
    """Files with valid digests (rewritten with them) whose contents are not what the learner saved."""
    group = LearnerGroup(CFG, TINY)
    path = group.save_checkpoint(tmp_path / "ckpt", iteration=1)
    _rewrite(path, rel, obj)
    with pytest.raises(UserError, match=needle):
        group.load_checkpoint(path)
