"""The strong baseline of the GRPO learner benchmark: a competent packed step built from stock parts.

Sequences packed end to end with no padding (packs merged up to the same micro-batch token budget as
ours), attention through Hugging Face's `flex_attention` implementation with a document-causal
BlockMask (padding-free: blocks of other sequences are skipped), the decoder under `torch.compile`,
the LM head fused with the log-softmax in row chunks (each chunk's logits recomputed in backward under
activation checkpointing, so no [N, V] tensor is kept; the chunk function compiled), the GRPO clipped
loss token-mean over the step, AdamW (fused where available). Same weights, data and optimizer steps
as ours; bf16 autocast over fp32 master weights.
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint as ckpt


def _chunk_logp(h_CH: torch.Tensor, w_VH: torch.Tensor, target_C: torch.Tensor, temperature: float) -> torch.Tensor:
    logits_CV = (h_CH @ w_VH.t()).float() / temperature
    return logits_CV.gather(-1, target_C[:, None]).squeeze(-1) - torch.logsumexp(logits_CV, dim=-1)


def _document_mask(cu_seqlens_S1: torch.Tensor, n: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    doc_N = torch.repeat_interleave(torch.arange(cu_seqlens_S1.numel() - 1, device=device),
                                    cu_seqlens_S1.diff().to(device))

    def causal_document(b, h, q, kv):
        return (doc_N[q] == doc_N[kv]) & (q >= kv)

    return create_block_mask(causal_document, None, None, n, n, device=device)


class StrongStep:
    def __init__(self, model, cfg, budget_tokens: int, chunk_rows: int = 4096, compile: bool = True):
        from learner.optim import build_optimizer

        self.model, self.cfg, self.budget, self.chunk_rows = model, cfg, budget_tokens, chunk_rows
        self.opt, _ = build_optimizer(model, cfg.optim)
        self.decoder = torch.compile(model.model) if compile else model.model
        self.chunk = torch.compile(_chunk_logp) if compile else _chunk_logp
        self.device = next(model.parameters()).device
        cuda = self.device.type == "cuda"
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def _merge(self, packs):
        out, cur, used = [], [], 0
        for p in packs:
            if cur and used + p.num_tokens > self.budget:
                out.append(cur)
                cur, used = [], 0
            cur.append(p)
            used += p.num_tokens
        return out + ([cur] if cur else [])

    def new_logprobs(self, ids: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        """log π(token_t | tokens before it in its sequence) for every position of a pack (0 at position 0;
        a sequence's first token is a prompt token, outside the loss)."""
        n = ids.numel()
        block_mask = _document_mask(cu, n, self.device)
        with self.autocast:
            h_NH = self.decoder(input_ids=ids[None], position_ids=pos[None], attention_mask=block_mask,
                                use_cache=False).last_hidden_state[0]
            w = self.model.lm_head.weight
            parts = [ckpt.checkpoint(self.chunk, h_NH[i:min(i + self.chunk_rows, n - 1)], w,
                                     ids[i + 1:min(i + self.chunk_rows, n - 1) + 1], self.cfg.loss.temperature,
                                     use_reentrant=False)
                     for i in range(0, n - 1, self.chunk_rows)]
        return torch.cat([torch.zeros(1, device=ids.device), torch.cat(parts)])

    def step(self, packs) -> float:
        total = sum(int(p.loss_mask_N.sum()) for p in packs)
        loss_cfg, dev = self.cfg.loss, self.device
        loss_sum = 0.0
        for group in self._merge(packs):
            ids = torch.cat([p.input_ids_N for p in group]).to(dev)
            pos = torch.cat([p.position_ids_N for p in group]).to(dev)
            lens = torch.cat([p.cu_seqlens_S1.diff() for p in group])
            cu = torch.cat([torch.zeros(1, dtype=lens.dtype), lens.cumsum(0)])
            mask = torch.cat([p.loss_mask_N for p in group]).to(dev)
            behaviour = torch.cat([p.behaviour_logprobs_N for p in group]).to(dev)
            adv = torch.cat([p.advantages_N for p in group]).to(dev)
            new = self.new_logprobs(ids, pos, cu)
            ratio = torch.exp(torch.where(mask, new - behaviour, torch.zeros_like(new)))
            surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - loss_cfg.eps_low, 1 + loss_cfg.eps_high) * adv)
            loss = torch.where(mask, -surrogate, torch.zeros_like(surrogate)).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss_sum
