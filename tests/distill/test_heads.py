"""Teacher heads: the host cache keeps what fits its budget (read from storage once), and the scheduler
never holds two heads on the device, also while it copies the next one ahead."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from distill.heads import HeadScheduler, HostHeads, read_head
from distill.teachers import describe

V, H = 64, 8  # one head: 64 * 8 bf16 = 1,024 bytes


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    out = {}
    for i, name in enumerate("abc"):
        path = root / name
        path.mkdir()
        g = torch.Generator().manual_seed(i)
        save_file({"lm_head.weight": torch.randn(V, H, generator=g).to(torch.bfloat16)}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": V, "hidden_size": H,
                                                      "tie_word_embeddings": False}))
        t = describe(name, 0, str(path), 1.0)
        out[t.name] = t
    return out


def _use(sched, name):
    with sched.resident(name) as W:
        return W.clone()


def test_the_host_cache_keeps_what_fits_and_reads_each_head_once(teachers):
    a, b, c = sorted(teachers)
    sched = HeadScheduler(teachers, "cpu", dtype=torch.float32, prefetch=False, host_budget_bytes=2 * V * H * 4)
    for name in (a, b, a, b, a):
        torch.testing.assert_close(_use(sched, name), read_head(teachers[name]).float(), rtol=0, atol=0)
    assert sched.host.reads == 2 and sched.loads == 5
    _use(sched, c)  # no room for a third: the least recently used (b) goes
    assert sched.host.reads == 3 and sched.host.holds(a) and sched.host.holds(c) and not sched.host.holds(b)
    assert sched.host.bytes <= 2 * V * H * 4
    _use(sched, b)
    assert sched.host.reads == 4
    sched.close()


def test_a_head_larger_than_the_budget_is_read_for_each_load(teachers):
    a, b, _ = sorted(teachers)
    host = HostHeads(teachers, V * H * 2 - 1, pin=False, dtype=None)
    for name in (a, a, b, a):
        host.get(name)
    assert host.reads == 4 and host.bytes == 0
    with pytest.raises(ValueError, match="budget"):
        HostHeads(teachers, -1, pin=False, dtype=None)


def test_swap_drops_the_head_before_copying_the_next_and_keeps_a_held_one(teachers):
    a, b, c = sorted(teachers)
    sched = HeadScheduler(teachers, "cpu", prefetch=True)
    sched.swap(a)  # copied ahead: on the device, not yet taken into use
    assert sched.copies == 1 and sched.loads == 0 and sched.resident_heads() == 1
    _use(sched, a)
    assert sched.copies == 1 and sched.loads == 1  # the copy made ahead was taken
    sched.swap(a)  # the held head already is the next one: kept, no copy
    assert sched.copies == 1
    sched.swap(b)
    assert sched.copies == 2 and sched.resident_heads() == 1
    _use(sched, c)  # another head than the one copied ahead: that copy is dropped unused
    assert sched.unused_copies == 1 and sched.loads == 2 and sched.resident_heads() == 1
    sched.swap(None)
    assert sched.resident_heads() == 0 and sched.max_resident == 1
    sched.close()


def test_a_kept_head_counts_when_the_next_one_is_copied(teachers):
    a, b, _ = sorted(teachers)
    sched = HeadScheduler(teachers, "cpu")
    with sched.resident(a) as W:
        kept = W
    sched.swap(b)
    assert sched.max_resident == 2
    del kept
    sched.close()
