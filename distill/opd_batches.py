"""A teacher group's micro-batches, made ready for the device away from the training thread.

Legend: N tokens of a micro-batch, S sequences, P positions scored (those whose next token is the
student's own), H_t teacher hidden size.

`prepare(batch, ...)` runs in the prefetch thread: it checks each row's tokens against the hash its
record names, cuts the group at sequence boundaries into micro-batches of at most `budget` tokens,
works out on the host what the step needs as integers (sequence boundaries, scored positions and
their count, so the training thread never waits on the device for them) and gathers the teacher's
hidden states at the scored positions, in pinned memory on CUDA. `to_device(part, ...)` then copies
the small index tensors on the compute stream and the hidden states on the side stream, where
their copy overlaps the student's trunk forward.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from distill import opd_loss
from distill.cache import FIELD, CacheMismatch


@dataclass
class Part:
    """One micro-batch of one teacher group."""

    ids_N: torch.Tensor  # int64 token ids
    pos_N: torch.Tensor  # int64 positions (0 starts a sequence)
    cu_S1: torch.Tensor  # int64 sequence boundaries
    max_len: int  # longest sequence
    idx_P: torch.Tensor  # int64 indices of the scored positions
    n: int  # scored positions (len(idx_P))
    tokens: int  # N
    h_t_PH: torch.Tensor  # the teacher's cached hidden states at the scored positions
    next_P: torch.Tensor  # int64 the token each scored position predicts
    behaviour_P: torch.Tensor  # float32 the sampler's log-prob of that token
    ready: object = None  # CUDA event: h_t_PH has arrived on the device


def micro_slices(cu_seqlens: list[int], budget: int) -> list[slice]:
    """Token slices at sequence boundaries, each at most `budget` tokens (a longer sequence alone)."""
    cu = cu_seqlens
    out, first = [], 0
    for k in range(1, len(cu)):
        if cu[k] - cu[first] > budget and k - 1 > first:
            out.append(slice(cu[first], cu[k - 1]))
            first = k - 1
    out.append(slice(cu[first], cu[-1]))
    return out


def check_rows(batch, tokens_hash: dict[str, str]) -> None:
    """Every row whole, and holding the tokens its record's hash names."""
    from rollout.types import token_hash

    cu = batch.cu_seqlens.tolist()
    for k, row in enumerate(batch.traj_ids):
        if int(batch.seg_start[k]) != 0 or int(batch.seg_stop[k]) != int(batch.traj_length[k]):
            raise ValueError(f"cache row {row!r} was split by the plan; plan OPD minibatches with "
                             "tokens_per_rank >= the longest trajectory")
        want = tokens_hash.get(row)
        if want is None:
            raise CacheMismatch(f"cache row {row!r} is not in this step's checked records")
        got = token_hash(batch.input_ids[cu[k]:cu[k + 1]].tolist())
        if got != want:
            raise CacheMismatch(f"cache row {row!r}: other tokens: its tokens hash to {got}, its record says "
                                f"{want}; refusing to train on it")


def _pinned(x: torch.Tensor, pin: bool) -> torch.Tensor:
    return x.pin_memory() if pin else x


def prepare(batch, tokens_hash: dict[str, str], budget: int, pin: bool, dtype: torch.dtype | None = None) -> list[Part]:
    """The group's micro-batches with everything computed on the host (see the module docstring). The cached
    hidden states must be of `dtype` (the run's cache dtype, where given) and finite where they are scored:
    one NaN would turn every weight of the student into NaN."""
    check_rows(batch, tokens_hash)
    if dtype is not None and batch.extras[FIELD].dtype != dtype:
        raise CacheMismatch(f"cache rows {list(batch.traj_ids)[:3]}: hidden states are {batch.extras[FIELD].dtype}, "
                            f"this run caches {dtype}; refusing to train on them")
    parts = []
    for sl in micro_slices(batch.cu_seqlens.tolist(), budget):
        ids, pos = batch.input_ids[sl].long(), batch.position_ids[sl].long()
        starts = torch.nonzero(pos == 0).flatten()
        cu = torch.cat([starts, starts.new_tensor([len(pos)])])
        idx = torch.nonzero(opd_loss.prediction_positions(batch.loss_mask[sl])).flatten()
        h_src = batch.extras[FIELD][sl]
        h_t = torch.empty((len(idx), *h_src.shape[1:]), dtype=h_src.dtype, pin_memory=pin)
        torch.index_select(h_src, 0, idx, out=h_t)
        if len(idx) and not bool(torch.isfinite(h_t).all()):
            bad = int(torch.nonzero(~torch.isfinite(h_t).all(dim=1))[0, 0])
            k = int(torch.searchsorted(batch.cu_seqlens, sl.start + int(idx[bad]), right=True)) - 1
            raise CacheMismatch(f"cache row {batch.traj_ids[k]!r}: hidden states hold a NaN or an infinity at a scored "
                                "position; refusing to train on it (delete the cache rows or rerun)")
        nxt = torch.roll(ids, -1).index_select(0, idx)
        behaviour = torch.roll(batch.logprobs[sl].float(), -1).index_select(0, idx)
        parts.append(Part(ids_N=_pinned(ids, pin), pos_N=_pinned(pos, pin), cu_S1=_pinned(cu, pin),
                          max_len=int(cu.diff().max()) if len(cu) > 1 else 0, idx_P=_pinned(idx, pin), n=len(idx),
                          tokens=sl.stop - sl.start, h_t_PH=h_t, next_P=_pinned(nxt, pin),
                          behaviour_P=_pinned(behaviour, pin)))
    return parts


def to_device(part: Part, device: torch.device, side: torch.cuda.Stream | None) -> Part:
    """`part` on `device`: small tensors on the compute stream, the hidden states on `side` (CUDA)."""
    if device.type != "cuda" or part.h_t_PH.is_cuda:
        return part
    moved = {f.name: getattr(part, f.name) for f in fields(part)}
    for name in ("ids_N", "pos_N", "cu_S1", "idx_P", "next_P", "behaviour_P"):
        moved[name] = moved[name].to(device, non_blocking=True)
    h = torch.empty(part.h_t_PH.shape, dtype=part.h_t_PH.dtype, device=device)  # a compute-stream block
    stream = side or torch.cuda.current_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # its earlier users are done before we write it
    with torch.cuda.stream(stream):
        h.copy_(part.h_t_PH, non_blocking=True)
    moved["h_t_PH"] = h
    moved["ready"] = torch.cuda.Event()
    moved["ready"].record(stream)
    return Part(**moved)
