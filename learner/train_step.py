"""One GRPO optimizer step over packed micro-batches, in one process; collectives are injected.

Legend: N tokens of a pack, S sequences in it, H hidden, V vocab. A `PackedBatch` lays sequences end
to end ([N] tensors, no padding); `position_ids` restart at 0 for each sequence, which is how the
HF attention builds a block-diagonal causal mask (flash-attention varlen on GPU). It is the shape the
data plane's loader returns; `PackedBatch.from_dict` maps its keys.

A step: staleness bound → global counts (all micro-batches, all ranks) → for each micro-batch:
forward, fused LM head + log-softmax, GRPO loss with the global normalisers, backward (gradients
synchronised on the last one only) → clip → AdamW → LR schedule. Because every loss is normalised by
the step's global counts, micro-batch × accumulation and 1 vs N ranks give the same update.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from core.hf import check_model_logits
from learner.grpo_config import GRPOConfig
from learner.grpo_loss import LossInputs, grpo_loss, logprobs_from_hidden, seq_ids_from_cu_seqlens
from learner.logprob_head import kept_bytes, logprobs_kept_grad
from learner.optim import Optimised
from learner.packed_attention import pick_backend, use_packed_attention
from learner.staleness import apply_staleness_bound

# The data plane's loader may name fields differently; each PackedBatch field accepts these keys.
KEY_ALIASES = {
    "input_ids_N": ("input_ids", "tokens"),
    "position_ids_N": ("position_ids", "positions"),
    "cu_seqlens_S1": ("cu_seqlens",),
    "loss_mask_N": ("loss_mask", "mask"),
    "behaviour_logprobs_N": ("behaviour_logprobs", "logprobs", "behavior_logprobs"),
    "advantages_N": ("advantages",),
    "ref_logprobs_N": ("ref_logprobs",),
    "token_versions_N": ("token_versions", "policy_versions", "versions"),
    "seq_loss_tokens_S": ("seq_loss_tokens",),
}


@dataclass
class PackedBatch:
    input_ids_N: torch.Tensor  # long
    position_ids_N: torch.Tensor  # long, restarting at 0 for each sequence
    cu_seqlens_S1: torch.Tensor  # long, [0, len0, len0+len1, ...]
    loss_mask_N: torch.Tensor  # bool
    behaviour_logprobs_N: torch.Tensor  # float32, log π_behaviour(token_t)
    advantages_N: torch.Tensor  # float32, the trajectory's advantage on each of its tokens
    ref_logprobs_N: torch.Tensor | None = None
    token_versions_N: torch.Tensor | None = None  # policy version that sampled each token
    seq_loss_tokens_S: torch.Tensor | None = None  # whole-trajectory loss tokens when a sequence is a piece

    @classmethod
    def from_dataplane(cls, batch, advantages: dict[str, float], versions_field: str = "policy_version",
                       trajectory_versions: dict[str, int] | None = None) -> "PackedBatch | None":
        """One rank's minibatch from the data plane's loader (`dataplane.Batch`), with each trajectory's
        advantage looked up by id (computed over whole groups, from the selection's metadata). Per-token
        policy versions come from the extra field `versions_field` when the loader was asked for it;
        else from `trajectory_versions` (e.g. the selection's `policy_min`: every token counted as old as
        the trajectory's oldest, the conservative side of the staleness bound); else none.
        None for a rank with no segment in this minibatch.

        A trajectory cut into pieces cannot be trained on here: a later piece's log-probs need the
        tokens before it, which are in another minibatch."""
        if batch.num_tokens == 0:
            return None
        split = (batch.seg_start != 0) | (batch.seg_stop != batch.traj_length)
        if split.any():
            i = int(split.argmax())
            raise ValueError(f"trajectory {batch.traj_ids[i]!r} was split (tokens {int(batch.seg_start[i])}.."
                             f"{int(batch.seg_stop[i])} of {int(batch.traj_length[i])}); the GRPO learner needs "
                             "whole trajectories: plan with tokens_per_rank >= the longest trajectory")
        missing = [t for t in batch.traj_ids if t not in advantages]
        if missing:
            raise ValueError(f"no advantage for trajectories {missing[:3]} (of {len(missing)})")
        adv_S = torch.tensor([advantages[t] for t in batch.traj_ids], dtype=torch.float32)
        d = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "cu_seqlens": batch.cu_seqlens,
             "loss_mask": batch.loss_mask, "behaviour_logprobs": batch.logprobs, "advantages": adv_S}
        if versions_field in batch.extras:
            d["token_versions"] = batch.extras[versions_field]
        elif trajectory_versions is not None:
            v_S = torch.tensor([trajectory_versions[t] for t in batch.traj_ids], dtype=torch.long)
            d["token_versions"] = torch.repeat_interleave(v_S, torch.as_tensor(batch.cu_seqlens).diff().long())
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, torch.Tensor]) -> "PackedBatch":
        """Build from a loader's dict; per-sequence advantages [S] are spread over tokens, and a
        missing `cu_seqlens` is derived from `position_ids` (a sequence starts where position is 0)."""
        got = {}
        for name, keys in KEY_ALIASES.items():
            for k in keys:
                if k in d and d[k] is not None:
                    got[name] = torch.as_tensor(d[k])
                    break
        missing = [KEY_ALIASES[n][0] for n in ("input_ids_N", "position_ids_N", "loss_mask_N",
                                                "behaviour_logprobs_N", "advantages_N") if n not in got]
        if missing:
            raise ValueError(f"packed batch is missing {missing} (has {sorted(d)})")
        got = {k: (v.reshape(-1) if v.dim() == 2 and v.shape[0] == 1 else v) for k, v in got.items()}
        if "cu_seqlens_S1" not in got:
            starts = torch.nonzero(got["position_ids_N"] == 0).flatten()
            got["cu_seqlens_S1"] = torch.cat([starts, torch.tensor([len(got["position_ids_N"])])])
        num_seqs = len(got["cu_seqlens_S1"]) - 1
        if got["advantages_N"].shape[0] == num_seqs != len(got["input_ids_N"]):
            got["advantages_N"] = torch.repeat_interleave(got["advantages_N"], got["cu_seqlens_S1"].diff())
        batch = cls(**got)
        batch.cast_().validate()
        return batch

    def cast_(self) -> "PackedBatch":
        self.input_ids_N = self.input_ids_N.long()
        self.position_ids_N = self.position_ids_N.long()
        self.cu_seqlens_S1 = self.cu_seqlens_S1.long()
        self.loss_mask_N = self.loss_mask_N.bool()
        self.behaviour_logprobs_N = self.behaviour_logprobs_N.float()
        self.advantages_N = self.advantages_N.float()
        if self.ref_logprobs_N is not None:
            self.ref_logprobs_N = self.ref_logprobs_N.float()
        return self

    def validate(self) -> "PackedBatch":
        n = len(self.input_ids_N)
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_N") and v is not None and v.shape != (n,):
                raise ValueError(f"packed batch: {f.name} has shape {tuple(v.shape)}, expected ({n},)")
        cu = self.cu_seqlens_S1
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or (cu.diff() <= 0).any():
            raise ValueError(f"packed batch: cu_seqlens {cu.tolist()[:8]}... must rise strictly from 0 to {n}")
        expected_pos_N = torch.arange(n, device=cu.device) - cu[:-1].repeat_interleave(cu.diff())
        if not torch.equal(self.position_ids_N, expected_pos_N.to(self.position_ids_N.device)):
            # Attention keeps sequences apart by their position ids; they must agree with cu_seqlens.
            raise ValueError("packed batch: position_ids must run 0, 1, ... inside each sequence of cu_seqlens")
        if self.loss_mask_N[cu[:-1]].any():
            raise ValueError("packed batch: the first token of a sequence has no context and cannot be a loss token")
        if self.seq_loss_tokens_S is not None and len(self.seq_loss_tokens_S) != len(cu) - 1:
            raise ValueError("packed batch: seq_loss_tokens needs one entry per sequence")
        return self

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids_N)

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_S1) - 1

    def seq_ids(self) -> torch.Tensor:
        return seq_ids_from_cu_seqlens(self.cu_seqlens_S1)

    def to(self, device) -> "PackedBatch":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if getattr(self, f.name) is not None})

    def select(self, first_seq: int, end_seq: int) -> "PackedBatch":
        """Sequences [first_seq, end_seq) as their own pack."""
        a, b = int(self.cu_seqlens_S1[first_seq]), int(self.cu_seqlens_S1[end_seq])
        kw = {f.name: getattr(self, f.name)[a:b] if f.name.endswith("_N") and getattr(self, f.name) is not None
              else None for f in fields(self)}
        kw["cu_seqlens_S1"] = self.cu_seqlens_S1[first_seq:end_seq + 1] - a
        if self.seq_loss_tokens_S is not None:
            kw["seq_loss_tokens_S"] = self.seq_loss_tokens_S[first_seq:end_seq]
        return PackedBatch(**kw)

    def split(self, max_tokens: int) -> list["PackedBatch"]:
        """Micro-batches of at most `max_tokens` tokens at sequence boundaries (a longer sequence alone)."""
        out, first, lengths = [], 0, self.cu_seqlens_S1.diff().tolist()
        used = 0
        for s, length in enumerate(lengths):
            if used and used + length > max_tokens:
                out.append(self.select(first, s))
                first, used = s, 0
            used += length
        out.append(self.select(first, len(lengths)))
        return out


def idle_batch() -> PackedBatch:
    """Two tokens and no loss token: a zero-gradient micro-batch for a rank the plan left empty."""
    return PackedBatch(input_ids_N=torch.zeros(2, dtype=torch.long), position_ids_N=torch.arange(2),
                       cu_seqlens_S1=torch.tensor([0, 2]), loss_mask_N=torch.zeros(2, dtype=torch.bool),
                       behaviour_logprobs_N=torch.zeros(2), advantages_N=torch.zeros(2))


def merge_packs(batches: list[PackedBatch], max_tokens: int) -> list[PackedBatch]:
    """Consecutive packs joined while together they hold at most `max_tokens` tokens (order kept;
    packs whose optional fields differ in presence stay apart)."""
    out: list[list[PackedBatch]] = []
    for b in batches:
        group = out[-1] if out else None
        if (group and sum(g.num_tokens for g in group) + b.num_tokens <= max_tokens
                and all((getattr(b, f.name) is None) == (getattr(group[0], f.name) is None) for f in fields(b))):
            group.append(b)
        else:
            out.append([b])
    return [g[0] if len(g) == 1 else concat(g) for g in out]


def concat(batches: list[PackedBatch]) -> PackedBatch:
    """One pack of several (sequences keep their order)."""
    kw = {}
    for f in fields(PackedBatch):
        vals = [getattr(b, f.name) for b in batches]
        if f.name == "cu_seqlens_S1":
            offsets = [0]
            for b in batches[:-1]:
                offsets.append(offsets[-1] + b.num_tokens)
            kw[f.name] = torch.cat([vals[0][:1]] + [v[1:] + o for v, o in zip(vals, offsets)])
        elif all(v is None for v in vals):
            kw[f.name] = None
        elif any(v is None for v in vals):
            raise ValueError(f"concat: {f.name} present in some packs only")
        else:
            kw[f.name] = torch.cat(vals)
    return PackedBatch(**kw)


class LogprobModel(torch.nn.Module):
    """The policy's trunk + a fused LM head: log π(token_t | <t) and entropy per packed token.

    A module (not a function) so DDP can wrap it and see the forward it must synchronise."""

    def __init__(self, model, chunk_rows: int = 2048, attention: str | None = None, kept_head_bytes: int = 0):
        """`kept_head_bytes`: when a forward that needs gradients would hold at most this many bytes of
        softmax gradient (2·V per row in bf16, `learner.logprob_head`), the LM head forms it in the
        forward and the backward needs one GEMM; else (and at 0) the head recomputes chunk by chunk.
        A model whose logits are not hidden @ W.T (a logit scale, a softcap, a head bias) is refused."""
        super().__init__()
        check_model_logits(model, f"policy {type(model).__name__}")
        self.model = model
        self.chunk_rows = chunk_rows
        self.attention = attention  # a learner.packed_attention backend; None: the model's own
        self.kept_head_bytes = kept_head_bytes

    def hidden(self, input_ids_N, position_ids_N, cu_seqlens_S1=None, max_seqlen: int | None = None):
        """[N, H] last-layer hidden states after the final norm of a packed batch."""
        trunk = self.model.base_model
        if self.attention is None:
            attn = contextlib.nullcontext({})
        else:
            if cu_seqlens_S1 is None:
                cu_seqlens_S1 = cu_seqlens_from_positions(position_ids_N)
            attn = use_packed_attention(self.model, self.attention, cu_seqlens_S1, max_seqlen)
        with attn as attn_kw:
            # use_cache=False: with a cache HF skips the packed-sequence (block-diagonal) mask.
            return trunk(input_ids=input_ids_N[None], position_ids=position_ids_N[None],
                         use_cache=False, **attn_kw).last_hidden_state[0]

    def forward(self, input_ids_N, position_ids_N, temperature: float = 1.0, entropy_grad: bool = False,
                with_entropy: bool = True, cu_seqlens_S1=None, max_seqlen: int | None = None):
        hidden_NH = self.hidden(input_ids_N, position_ids_N, cu_seqlens_S1, max_seqlen)
        weight_VH = self.model.get_output_embeddings().weight
        if temperature != 1.0:
            hidden_NH = hidden_NH / temperature  # (h / T) W^T = logits / T
        # Position t-1 predicts token t; a sequence's first token has no context and gets 0.
        with_entropy = with_entropy or entropy_grad
        rows, (vocab, _) = hidden_NH.shape[0] - 1, weight_VH.shape
        dev = hidden_NH.device.type
        compute_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden_NH.dtype
        if (self.kept_head_bytes and not entropy_grad and torch.is_grad_enabled() and dev == "cuda"
                and compute_dtype in (torch.bfloat16, torch.float16)
                and kept_bytes(rows, vocab, compute_dtype) <= self.kept_head_bytes):
            logp, ent = logprobs_kept_grad(hidden_NH[:-1], weight_VH, input_ids_N[1:], compute_dtype, with_entropy)
        else:
            logp, ent = logprobs_from_hidden(hidden_NH[:-1], weight_VH, input_ids_N[1:], self.chunk_rows,
                                             with_entropy=with_entropy)
        zero = logp.new_zeros(1)
        starts_N = position_ids_N == 0
        logp_N = torch.cat([zero, logp]).masked_fill(starts_N, 0.0)
        if not with_entropy:
            return logp_N, None
        ent = ent if entropy_grad else ent.detach()
        return logp_N, torch.cat([zero, ent]).masked_fill(starts_N, 0.0)


def cu_seqlens_from_positions(position_ids_N: torch.Tensor) -> torch.Tensor:
    """[0, 1, 2, 0, 1] -> [0, 3, 5]: a sequence starts where its position is 0."""
    starts = torch.nonzero(position_ids_N == 0).flatten()
    return torch.cat([starts, starts.new_tensor([len(position_ids_N)])])


def compile_layers(model) -> None:
    """Regional compilation: each decoder layer through torch.compile (fused norms, RoPE, SwiGLU and
    residuals), one compiled graph shared by all layers; the LM head and loss stay eager. Dynamic from
    the first call: a packed micro-batch's length changes every call, and `dynamic=None` compiled a
    static graph first and recompiled at the second length (seconds of a run's first iteration); the
    widths meet the parameters' static shapes and stay specialised."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in model.base_model.layers:
        layer.compile(dynamic=True)


class Collectives:
    """Sum-reductions across learner ranks; the identity in one process. NCCL reduces on the GPU."""

    def __init__(self, world_size: int = 1, device: torch.device | str = "cpu"):
        self.world_size = world_size
        self.device = torch.device(device)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In place on `t` (which stays where it is), and returned."""
        if self.world_size > 1:
            import torch.distributed as dist

            buf = t.to(self.device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            t.copy_(buf)
        return t


def pick_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("learner.device = 'cuda' but no CUDA device is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Learner(Optimised):
    """Owns the policy, its optimizer and schedule; `train_step` applies one GRPO update."""

    def __init__(self, model: torch.nn.Module, cfg: GRPOConfig, collectives: Collectives | None = None,
                 ref_model: torch.nn.Module | None = None, wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                 attention: str = "auto", compile: bool | None = None, merge_micro_batches: bool | None = None,
                 kept_head_grad: bool = True):
        """`attention`: 'auto' (flash varlen on CUDA in bf16, else per-sequence SDPA), 'hf' (the model's own), or a
        learner.packed_attention backend. `compile`: torch.compile each decoder layer; None = on CUDA.
        `merge_micro_batches`: consecutive packs that fit `micro_batch_tokens` together run as one
        micro-batch (fewer, larger launches; the update is the same, the normalisers being global);
        None = on CUDA. `kept_head_grad`: on CUDA, the LM head forms its softmax gradient in the forward
        (`learner.logprob_head`) when it fits an eighth of the GPU's memory."""
        self.cfg = cfg
        self.device = pick_device(cfg.learner.device)
        self.model = model.to(self.device)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" and cfg.learner.bf16
                         else contextlib.nullcontext())
        compute_dtype = (torch.bfloat16 if isinstance(self.autocast, torch.autocast)
                         else next(self.model.parameters()).dtype)
        if cfg.learner.activation_checkpointing and attention != "hf":
            # The backward recomputes each block after the forward's packed-attention context has closed,
            # so the recomputation would attend with the model's own function: checkpointed blocks use it
            # throughout (block-diagonal mask from the position ids).
            if attention != "auto":
                raise ValueError(f"attention {attention!r} cannot run with learner.activation_checkpointing "
                                 "(use 'auto' or 'hf')")
            attention = "hf"
        self.attention = pick_backend(attention, self.device, compute_dtype)
        self.merge_micro_batches = (merge_micro_batches if merge_micro_batches is not None
                                    else self.device.type == "cuda")
        if compile if compile is not None else self.device.type == "cuda":
            compile_layers(self.model)
        self.model.train()
        if cfg.learner.activation_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # The LM head's softmax gradient kept from forward to backward when it fits an eighth of the GPU.
        kept = (torch.cuda.get_device_properties(self.device).total_memory // 8
                if self.device.type == "cuda" and kept_head_grad else 0)
        self.core = LogprobModel(self.model, cfg.learner.logprob_chunk_rows, self.attention, kept)
        self.net = wrap(self.core) if wrap else self.core  # DDP when ranks > 1
        self.coll = collectives or Collectives(1)
        self.ref = (LogprobModel(ref_model.to(self.device).eval(), cfg.learner.logprob_chunk_rows, self.attention)
                    if ref_model else None)
        self.opts = cfg.loss.options()
        self.init_optimiser()

    # -- the step ---------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[PackedBatch]) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (every rank calls it with its share)."""
        t0 = time.perf_counter()
        metrics = self.accumulate_gradients(micro_batches)
        metrics["grad_norm"] = self.clip_finite("GRPO")  # refused before any weight changes
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        elapsed = time.perf_counter() - t0
        metrics.update(lr=self.scheduler.get_last_lr()[0], step=self.step, step_time_s=elapsed,
                       tokens_per_s=metrics["tokens"] / elapsed)
        return metrics

    def accumulate_gradients(self, micro_batches: list[PackedBatch]) -> dict[str, float]:
        """Forward and backward of every micro-batch; leaves the step's (rank-synchronised) gradients in
        `.grad` and returns the step's metrics, token-weighted over all micro-batches and ranks."""
        if not micro_batches:  # a rank with no data this step still joins the gradient all-reduce
            micro_batches = [idle_batch()]
        # Anything over the micro-batch budget is cut at sequence boundaries (global normalisers make
        # the update independent of the cut).
        budget = self.cfg.learner.micro_batch_tokens
        pieces = [piece for mb in micro_batches for piece in mb.validate().split(budget)]
        if self.merge_micro_batches:  # and consecutive packs that fit the budget together run as one
            pieces = merge_packs(pieces, budget)
        # Counts, sequence ids and lengths on the host, where the loader's tensors are: the GPU then
        # runs the step without waiting on the host for them.
        pieces, stale = self._bound_staleness(pieces)
        counts = torch.zeros(2, dtype=torch.float64)
        mbs, host = [], []
        for mb in pieces:
            mask_N, seq_ids_N, seq_tokens_S = mb.loss_mask_N.double(), mb.seq_ids(), self._seq_loss_tokens(mb)
            n = int(mask_N.sum())
            counts[0] += n
            counts[1] += float((mask_N / seq_tokens_S[seq_ids_N].clamp(min=1)).sum())
            mbs.append(mb.to(self.device))
            host.append(dict(n=n, max_len=int(mb.cu_seqlens_S1.diff().max()), seq_ids_N=seq_ids_N.to(self.device),
                             seq_tokens_S=seq_tokens_S.to(self.device)))
        self.coll.all_reduce_sum(counts)  # global loss tokens, global sequences
        total_tokens, total_seqs = float(counts[0]), float(counts[1])

        need_ref = self.opts.kl_coef > 0
        sums: dict[str, torch.Tensor] = {}
        weight, loss_total, tokens = 0.0, torch.zeros((), dtype=torch.float64, device=self.device), 0
        for i, (mb, h) in enumerate(zip(mbs, host)):
            ref_lp = mb.ref_logprobs_N if need_ref else None  # same metric keys on every rank
            if need_ref and ref_lp is None:
                if self.ref is None:
                    raise ValueError("kl_coef > 0 needs ref_logprobs in the batch or a reference model")
                with torch.no_grad(), self.autocast:
                    ref_lp = self.ref(mb.input_ids_N, mb.position_ids_N, self.cfg.loss.temperature,
                                      with_entropy=False, cu_seqlens_S1=mb.cu_seqlens_S1, max_seqlen=h["max_len"])[0]
            last = i == len(mbs) - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.net, "no_sync") else self.net.no_sync()
            with sync:
                with self.autocast:
                    logp_N, ent_N = self.net(mb.input_ids_N, mb.position_ids_N, self.cfg.loss.temperature,
                                             self.opts.entropy_coef > 0, self.cfg.learner.entropy_metric,
                                             mb.cu_seqlens_S1, h["max_len"])
                out = grpo_loss(LossInputs(
                    logprobs_N=logp_N, behaviour_logprobs_N=mb.behaviour_logprobs_N,
                    advantages_N=mb.advantages_N, loss_mask_N=mb.loss_mask_N, seq_ids_N=h["seq_ids_N"],
                    ref_logprobs_N=ref_lp, entropy_N=ent_N, seq_loss_tokens_S=h["seq_tokens_S"],
                    total_loss_tokens=total_tokens, total_seqs=total_seqs, num_loss_tokens=h["n"]), self.opts)
                # Each rank's loss is its share of the global loss; DDP averages, so scale back to a sum.
                (out.loss * self.coll.world_size).backward()
            loss_total += out.loss.detach().double()
            for k, v in out.metrics.items():
                if k != "seqs":
                    sums[k] = sums.get(k, 0.0) + v.double() * out.num_loss_tokens
            weight += out.num_loss_tokens
            tokens += mb.num_tokens
        keys = sorted(sums)
        local = torch.stack([sums[k] for k in keys] + [loss_total]).cpu()
        red = self.coll.all_reduce_sum(torch.cat([local, torch.tensor([weight, tokens], dtype=torch.float64)]))
        w = max(float(red[-2]), 1.0)
        metrics = {k: float(red[i]) / w for i, k in enumerate(keys)}
        metrics.update(loss=float(red[len(keys)]), loss_tokens=total_tokens, seqs=total_seqs,
                       tokens=float(red[-1]), micro_batches=float(len(mbs)), **stale)
        return metrics

    def _seq_loss_tokens(self, mb: PackedBatch) -> torch.Tensor:
        if mb.seq_loss_tokens_S is not None:
            return mb.seq_loss_tokens_S.to(torch.float64)
        return torch.zeros(mb.num_seqs, dtype=torch.float64, device=mb.loss_mask_N.device).index_add_(
            0, mb.seq_ids(), mb.loss_mask_N.double())

    STALENESS_BINS = 16  # histogram bins 0..15; the last also counts everything older

    def _bound_staleness(self, mbs: list[PackedBatch]) -> tuple[list[PackedBatch], dict[str, float]]:
        """Mask (or drop) tokens sampled too many versions ago; a histogram over all ranks.

        Masked tokens leave their sequence's own count, so a sequence's token-mean covers what remains
        (when the loader gave whole-trajectory counts for pieces, those counts are kept as given)."""
        bound = self.cfg.staleness.bound
        hist = torch.zeros(self.STALENESS_BINS + 1, dtype=torch.float64)  # last slot: tokens removed
        seen = torch.zeros(1, dtype=torch.float64)
        out = []
        for mb in mbs:
            if mb.token_versions_N is None:
                out.append(mb)
                continue
            seen += 1
            rep = apply_staleness_bound(self.policy_version, mb.token_versions_N, mb.loss_mask_N, mb.seq_ids(),
                                        None if bound < 0 else bound, self.cfg.staleness.mode)
            for k, c in rep.histogram.items():
                hist[min(k, self.STALENESS_BINS - 1)] += c
            hist[-1] += rep.tokens_removed
            out.append(replace(mb, loss_mask_N=rep.loss_mask_N))
        self.coll.all_reduce_sum(seen)
        if not seen.item():
            return out, {}
        self.coll.all_reduce_sum(hist)
        nz = [k for k in range(self.STALENESS_BINS) if hist[k] > 0]
        return out, {"stale_tokens_removed": float(hist[-1]), "staleness_max": float(max(nz, default=0)),
                     **{f"staleness_hist_{k}": float(hist[k]) for k in nz}}



def synthetic_packed_batch(vocab_size: int, lengths: list[int], seed: int, prompt_len: int = 3,
                           versions: tuple[int, int] | None = None) -> PackedBatch:
    """A valid random pack (for tests and benchmarks): the first `prompt_len` tokens of each sequence
    are prompt (masked), behaviour log-probs lie near log(1/V), one advantage per sequence, and token
    versions (when given) are drawn from the inclusive range."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    pos_N = torch.cat([torch.arange(length) for length in lengths])
    adv_S = torch.randn(len(lengths), generator=g)
    batch = PackedBatch(
        input_ids_N=torch.randint(0, vocab_size, (n,), generator=g), position_ids_N=pos_N,
        cu_seqlens_S1=torch.tensor([0] + list(lengths)).cumsum(0), loss_mask_N=pos_N >= max(prompt_len, 1),
        behaviour_logprobs_N=-math.log(vocab_size) + (torch.rand(n, generator=g) * 2 - 1),
        advantages_N=torch.repeat_interleave(adv_S, torch.tensor(lengths)),
        token_versions_N=torch.randint(versions[0], versions[1] + 1, (n,), generator=g) if versions else None)
    return batch.validate()
