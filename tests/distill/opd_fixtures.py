"""Tiny students, teachers and cache rows for the OPD tests: real HF models, a real data plane."""
from __future__ import annotations

import numpy as np
import torch

import dataplane
from core.hf import save_policy
from distill.cache import cache_run
from distill.prefill import Prefillers, Sampled, fill_cache
from distill.teachers import resolve_teachers
from learner.config import PolicyConfig
from learner.policy import build_policy
from rollout.types import token_hash

DOMAINS = ["arith", "reverse", "calc"]


def tiny(hidden: int, seed: int, layers: int = 1) -> PolicyConfig:
    return PolicyConfig(hidden_size=hidden, num_layers=layers, num_heads=2, num_kv_heads=1,
                        intermediate_size=2 * hidden, max_positions=128, seed=seed)


def save_tiny(path, hidden: int, seed: int, layers: int = 1):
    model, tok = build_policy(tiny(hidden, seed, layers))
    save_policy(model, tok, path)
    return path


def make_sampled(n: int, vocab: int, seed: int = 0, domains=DOMAINS) -> list[Sampled]:
    """n trajectories: a prompt (masked), completion tokens (loss), and one masked tool-result span."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, c = int(rng.integers(3, 7)), int(rng.integers(4, 12))
        tokens = rng.integers(3, vocab, p + c).astype(np.int32)
        mask = np.zeros(p + c, np.uint8)
        mask[p:] = 1
        if c > 6:  # a tool result the environment wrote: not the student's
            mask[p + 2:p + 4] = 0
        # behaviour log-probs near a fresh policy's (about log 1/V), so importance ratios lie near 1
        logp = np.where(mask == 1, -np.log(vocab) + rng.uniform(-0.1, 0.1, p + c), 0.0).astype(np.float32)
        out.append(Sampled(f"{domains[i % len(domains)]}-it000000-p{i:04d}-g000", domains[i % len(domains)], "",
                           tokens, mask, logp, token_hash(tokens.tolist()), 0))
    return out


def build_case(tmp, n: int = 12, weights=(0.7, 0.3), dtype: str = "float32", student_hidden: int = 32):
    """Student + 4 teachers of 3 hidden sizes (arith has two, weighted), cache rows in a data plane."""
    student = save_tiny(tmp / "student", student_hidden, seed=1)
    paths = {"a0": save_tiny(tmp / "t_a0", 48, 2), "a1": save_tiny(tmp / "t_a1", 32, 3),
             "r": save_tiny(tmp / "t_r", 64, 4), "c": save_tiny(tmp / "t_c", 48, 5)}
    entries = [("arith", str(paths["a0"]), weights[0]), ("arith", str(paths["a1"]), weights[1]),
               ("reverse", str(paths["r"]), 1.0), ("calc", str(paths["c"]), 1.0)]
    teachers = resolve_teachers(entries, student, DOMAINS, DOMAINS)
    dp = dataplane.open(tmp / "catalog.db", tmp / "store")
    vocab = teachers[0].vocab_size
    sampled = make_sampled(n, vocab)
    fill_cache(dp, "it000000", sampled, teachers, Prefillers(0, batch_tokens=1), run_id="run-x", dtype=dtype)
    sel = dp.select(run=cache_run("it000000"))
    return student, teachers, dp, sampled, sel


def hashes(dp, sel, sampled) -> dict[str, str]:
    want = {s.traj_id: s.tokens_hash for s in sampled}
    return {row: want[row.rsplit("@", 1)[0]] for row in sel.ids.tolist()}


def set_threads():
    torch.set_num_threads(1)
