"""The learner, driven by a plain in-test sampler, raises a verifiable reward (the sign, the ratio,
the advantages and the optimizer all have to be right for the reward to climb)."""
from __future__ import annotations

import torch

from learner.advantages import group_advantages
from learner.config import PolicyConfig
from learner.grpo_config import GRPOConfig
from learner.policy import build_policy
from learner.train_step import Learner, PackedBatch, concat

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, seed=0)
PROMPTS, GROUP, COMPLETION = 4, 8, 6


@torch.no_grad()
def sample(model, prompt_ids: list[list[int]], gen: torch.Generator):
    """GROUP completions per prompt at temperature 1, with the sampling log-probs (the behaviour policy)."""
    model.eval()
    ids = torch.tensor([p for p in prompt_ids for _ in range(GROUP)])
    logps = []
    for _ in range(COMPLETION):
        logits = model(input_ids=ids).logits[:, -1].float()
        logp_all = torch.log_softmax(logits, -1)
        tok = torch.multinomial(logp_all.exp(), 1, generator=gen)
        logps.append(logp_all.gather(-1, tok))
        ids = torch.cat([ids, tok], 1)
    model.train()
    return ids, torch.cat(logps, 1)


def test_reward_climbs():
    torch.manual_seed(0)
    model, tok = build_policy(TINY)
    target = tok.convert_tokens_to_ids("a")
    prompts = [tok(f"Q{c}", add_special_tokens=False).input_ids for c in "wxyz"[:PROMPTS]]
    cfg = GRPOConfig.model_validate({"learner": {"device": "cpu", "threads": 1},
                                     "optim": {"lr": 3e-2, "grad_clip": 1.0}})
    learner = Learner(model, cfg)
    gen = torch.Generator().manual_seed(0)
    curve = []
    for it in range(15):
        ids, logp = sample(model, prompts, gen)
        completion = ids[:, -COMPLETION:]
        reward = (completion == target).double().mean(1)  # verifiable: share of "a"
        curve.append(float(reward.mean()))
        adv = group_advantages(reward, torch.arange(len(ids)) // GROUP)
        packs = []
        for i in range(len(ids)):
            n, p = ids.shape[1], ids.shape[1] - COMPLETION
            packs.append(PackedBatch(
                input_ids_N=ids[i], position_ids_N=torch.arange(n), cu_seqlens_S1=torch.tensor([0, n]),
                loss_mask_N=torch.arange(n) >= p, behaviour_logprobs_N=torch.cat([torch.zeros(p), logp[i]]),
                advantages_N=torch.full((n,), float(adv.advantages_B[i]))))
        m = learner.train_step([concat(packs)])
        # On-policy: the learner's log-probs equal the sampler's (ratio 1, nothing clipped) at step start.
        assert abs(m["ratio_mean"] - 1) < 1e-4 and m["clip_frac"] == 0
    assert curve[0] < 0.1
    assert sum(curve[-3:]) / 3 > curve[0] + 0.3, curve
