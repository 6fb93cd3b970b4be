"""The base of a learning-curve benchmark: a model built from a config (no downloaded weights), trained
briefly with postrain's SFT pieces on one domain until its greedy pass@1 is informative; and the scorer
both sides' snapshots go through.

SFT: `learner.sft`'s batches (`sample_batch`: demonstrations of the domain, a pure function of seed and
step), loss (`masked_nll`: completion tokens and EOS) and schedule (`lr_at`: warm-up, cosine to 10 %),
AdamW as `postrain sft` builds it, on the device (fp32 weights, bf16 autocast on CUDA). Every
`check_every` steps the greedy exact-match rate on held-out train prompts is read in one teacher-forced
forward pass (a greedy completion is the demonstration exactly when every argmax under teacher forcing
matches it); the run stops once that rate reaches `stop_at` and keeps the weights (of that check or the
one before) whose rate lies closer to it. Scoring: `learner.evaluate.evaluate` (`postrain eval`'s
evaluator) with the model on the device.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

HELD_OUT_SEED = 777_777  # train-split prompts the stop rule reads (the eval split stays unseen)


class _OnDevice:
    """`evaluate`'s view of a model on a device: its generate inputs (CPU tensors) moved there."""

    def __init__(self, model):
        self.model, self.device = model, next(model.parameters()).device

    def eval(self):
        self.model.eval()
        return self

    def generate(self, **kw):
        return self.model.generate(**{k: v.to(self.device) if torch.is_tensor(v) else v for k, v in kw.items()})


def greedy_pass_at_1(model, tok, domain: str, eval_cfg: dict) -> float:
    """pass@1 by `postrain eval`'s evaluator under the run's [eval] table (`eval_cfg`), model on any device."""
    from learner.config import EvalConfig
    from learner.evaluate import evaluate

    return evaluate(_OnDevice(model), tok, domain, EvalConfig.model_validate(eval_cfg))["pass_at_1"]


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def teacher_forced_exact(model, tok, domain: str, prompts: list[str]) -> float:
    """Share of prompts whose demonstration (and EOS) is every position's argmax under teacher forcing."""
    import rewards
    from learner.sft import collate, encode_example

    dom, device = rewards.domain(domain), next(model.parameters()).device
    batch = collate([encode_example(tok, p, dom.demonstration(p)) for p in prompts], tok.pad_token_id)
    ids, mask = batch["input_ids"].to(device), batch["loss_mask"].to(device)[:, 1:] > 0
    with _autocast(device):
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"].to(device)).logits[:, :-1]
    ok = ((logits.argmax(-1) == ids[:, 1:]) | ~mask).all(dim=1)
    return float(ok.double().mean())


def sft_base(out: str | Path, model_shape: dict, domain: str, device: str, *, lr: float, batch_size: int,
             max_steps: int, stop_at: float, check_every: int, max_s: float, seed: int = 0) -> dict:
    """SFT a fresh Qwen2 model of `model_shape` on `domain` (see the module's docstring); saved to `out`
    as an HF checkpoint with the padded character tokenizer. Returns the stop rule's trace."""
    import rewards
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.grpo_iteration import padded_char_tokenizer
    from core.hf import save_policy
    from learner.config import SFTConfig
    from learner.sft import collate, lr_at, masked_nll, sample_batch

    t0 = time.monotonic()
    dev = torch.device(device)
    tok = padded_char_tokenizer(model_shape["vocab_size"])
    torch.manual_seed(seed)
    with dev:  # initialised where it trains
        model = Qwen2ForCausalLM(Qwen2Config(**model_shape, bos_token_id=None, eos_token_id=tok.eos_token_id,
                                             pad_token_id=tok.pad_token_id))
    cfg = SFTConfig(domains=[domain], steps=max_steps, batch_size=batch_size, lr=lr, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    held = rewards.domain(domain).prompts("train", 256, HELD_OUT_SEED)
    trace, prev, step = [], None, 0
    for step in range(1, max_steps + 1):
        model.train()
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, cfg)
        batch = {k: v.to(dev) for k, v in collate(sample_batch(cfg, step - 1, tok), tok.pad_token_id).items()}
        with _autocast(dev):
            loss = masked_nll(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if step % check_every and step != max_steps:
            continue
        model.eval()
        exact = teacher_forced_exact(model, tok, domain, held)
        trace.append({"step": step, "loss": round(loss.item(), 4), "exact": exact, "s": round(time.monotonic() - t0, 1)})
        if exact >= stop_at:
            if prev is not None and abs(prev[1] - stop_at) < abs(exact - stop_at):
                model.load_state_dict(prev[0])  # the check before overshot less
                step = trace[-2]["step"]
            break
        if time.monotonic() - t0 > max_s:
            break
        prev = ({k: v.detach().clone() for k, v in model.state_dict().items()}, exact)
    model.eval()
    save_policy(model, tok, out)
    return {"steps": step, "trace": trace, "lr": lr, "batch_size": batch_size, "stop_at": stop_at,
            "check_every": check_every, "held_out_prompts": len(held), "sft_s": round(time.monotonic() - t0, 1)}
