"""Greedy calc pass@1 of a checkpoint split by the product's length (docs/learner.md, "Why calc at 5e-5 stalled").

Usage: python docs/calc_breakdown.py CHECKPOINT_DIR   (an HF checkpoint: OUT/final of sft or grpo)
"""
import collections
import sys

import torch

import rewards
from learner.config import EvalConfig
from learner.evaluate import complete
from core.hf import load_policy


def main(checkpoint: str) -> None:
    torch.set_num_threads(1)
    model, tok = load_policy(checkpoint)
    model.eval()
    domain = rewards.domain("calc")
    cfg = EvalConfig(n=256, temperature=0.0, max_new_tokens=48)  # what `postrain grpo` evaluates
    prompts = domain.prompts("eval", cfg.n, seed=cfg.seed)
    total, right = collections.Counter(), collections.Counter()
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start:start + cfg.batch_size]
        for prompt, completion in zip(chunk, complete(model, tok, domain, chunk, cfg)):
            a, b = (int(x) for x in prompt[len("mul "):-1].split("*"))
            digits = len(str(a * b))
            total[digits] += 1
            right[digits] += domain.verify(prompt, completion)[0] >= 1.0
    for digits in sorted(total):
        print(f"{digits}-digit products: {right[digits]} / {total[digits]}")
    print(f"pass@1 {sum(right.values()) / sum(total.values()):.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
