"""Supervised fine-tuning on domain demonstrations: loss on completion tokens only (tool results and
prompts are masked), AdamW with warm-up + cosine decay, gradient clipping, metrics and a progress bar."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import rewards
from learner.config import SFTConfig
from rewards import protocol


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a target the model must learn to emit


def encode_example(tok, prompt: str, completion: str) -> Example:
    """Prompt + completion + EOS; the mask covers completion and EOS, minus environment results."""
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    comp_ids = tok(completion, add_special_tokens=False).input_ids
    if len(comp_ids) != len(completion):
        raise ValueError("encode_example expects a character-level tokenizer")  # spans are char offsets
    keep = [1] * len(completion)
    for start, end in protocol.result_spans(completion):
        keep[start:end] = [0] * (end - start)
    return Example(prompt_ids + comp_ids + [tok.eos_token_id], [0] * len(prompt_ids) + keep + [1])


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": mask}


def masked_nll(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Negative log-likelihood of the masked-in target tokens, averaged per sequence, then over sequences
    (seq-mean-token-mean), so that a domain with short answers weighs as much as one with long ones."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["input_ids"][:, 1:]
    mask = batch["loss_mask"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
    per_seq = (nll * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)
    return per_seq.mean()


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to 10% of it."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def sample_batch(cfg: SFTConfig, step: int, tok) -> list[Example]:
    """`batch_size` demonstrations, domains mixed round-robin; a pure function of (cfg.seed, step)."""
    doms = [rewards.domain(name) for name in cfg.domains]
    per = [cfg.batch_size // len(doms) + (i < cfg.batch_size % len(doms)) for i in range(len(doms))]
    out = []
    for d, k in zip(doms, per):
        for p in d.prompts("train", k, seed=cfg.seed * 1_000_003 + step):
            out.append(encode_example(tok, p, d.demonstration(p)))
    return out


def train_sft(model, tok, cfg: SFTConfig, log=None, advance=None) -> dict[str, float]:
    """Run `cfg.steps` SFT steps on `model` in place; returns the first and last logged loss."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    for name in cfg.domains:
        rewards.domain(name)  # fail before training on an unknown domain
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    model.train()
    first = last = float("nan")
    window: list[float] = []
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = collate(sample_batch(cfg, step, tok), tok.pad_token_id)
        loss = masked_nll(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        window.append(loss.item())
        if step == 0:
            first = window[0]
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            last = sum(window) / len(window)
            if log:
                log(step=step + 1, loss=last, lr=lr_at(step, cfg), grad_norm=float(grad_norm))
            window.clear()
        if advance:
            advance(1, loss=last)
    model.eval()
    return {"loss_first": first, "loss_last": last}
