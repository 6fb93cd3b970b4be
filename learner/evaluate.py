"""Pass@1 of a policy on a domain's eval split, with in-process tools for tool-using domains.

Generation uses Hugging Face `generate` turn by turn: a turn stops at EOS, at `</call>` or at the token
budget; a pending call is answered with `rewards.tools.run_pure_tool` and decoding continues.
"""
from __future__ import annotations

import torch

import rewards
from learner.config import EvalConfig
from rewards import protocol
from rewards.tools import run_pure_tool

MAX_TURNS = 4


def _generate(model, tok, texts: list[str], cfg: EvalConfig) -> list[tuple[str, bool]]:
    """One turn for each text: (new text, ended_with_eos)."""
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    greedy = cfg.temperature == 0
    out = model.generate(
        **enc, max_new_tokens=cfg.max_new_tokens, do_sample=not greedy,
        temperature=None if greedy else cfg.temperature, top_p=None, top_k=None,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        stop_strings=[protocol.CALL_CLOSE], tokenizer=tok,
    )
    new = out[:, enc.input_ids.shape[1]:]
    results = []
    for row in new.tolist():
        ended = tok.eos_token_id in row
        if ended:
            row = row[: row.index(tok.eos_token_id)]
        row = [t for t in row if t != tok.pad_token_id]
        results.append((tok.decode(row), ended))
    return results


@torch.no_grad()
def complete(model, tok, domain: rewards.Domain, prompts: list[str], cfg: EvalConfig) -> list[str]:
    """The model's completion of each prompt, tool results included."""
    completions = [""] * len(prompts)
    active = list(range(len(prompts)))
    for _turn in range(MAX_TURNS if domain.uses_tools else 1):
        if not active:
            break
        outs = _generate(model, tok, [prompts[i] + completions[i] for i in active], cfg)
        still = []
        for i, (text, ended) in zip(active, outs):
            completions[i] += text
            call = None if ended else protocol.pending_call(completions[i])
            if call is not None and domain.uses_tools:
                completions[i] += protocol.format_result(run_pure_tool(call))
                still.append(i)
        active = still
    return completions


def evaluate(model, tok, domain_name: str, cfg: EvalConfig, advance=None) -> dict:
    """`{"domain", "n", "pass_at_1", "mean_reward", "samples"}` on `cfg.n` eval prompts."""
    domain = rewards.domain(domain_name)
    prompts = domain.prompts("eval", cfg.n, seed=cfg.seed)
    model.eval()
    torch.manual_seed(cfg.seed)
    rewards_, samples = [], []
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start : start + cfg.batch_size]
        for p, c in zip(chunk, complete(model, tok, domain, chunk, cfg)):
            r, reason = domain.verify(p, c)
            rewards_.append(r)
            if len(samples) < 5:
                samples.append({"prompt": p, "completion": c, "reward": r, "reason": reason})
        if advance:
            advance(len(chunk))
    n = len(rewards_)
    return {
        "domain": domain_name, "n": n,
        "pass_at_1": sum(r >= 1.0 for r in rewards_) / n,
        "mean_reward": sum(rewards_) / n,
        "samples": samples,
    }
