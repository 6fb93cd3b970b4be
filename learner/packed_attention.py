"""Attention over a packed micro-batch: each sequence of the pack attends causally to itself only.

Legend: N tokens of the pack, S sequences, Hq query heads, Hkv key/value heads, D head size.

The learner runs the HF trunk with its own attention function for the length of one forward
(`packed_attention(model, cu_seqlens_S1)`), which passes the pack's boundaries to every layer, so
no [N, N] mask is ever built. Backends:
  varlen     `torch.nn.attention.varlen.varlen_attn`: torch's flash-attention varlen kernel (CUDA,
             torch >= 2.10), one launch per layer for the whole pack, GQA without repeated heads.
  sdpa_docs  `F.scaled_dot_product_attention(is_causal=True)` once per sequence (flash backend on
             CUDA in bf16; any device), a launch per sequence.
`pick_backend("auto")`: varlen on CUDA when torch has it and the compute dtype is bf16/fp16 (the
kernel takes nothing else), else sdpa_docs, on CUDA and on the CPU. The model's own attention ('hf',
None) builds a block-diagonal [N, N] mask from the position ids and attends over the whole pack: on a
2-core CPU a learner step of the tiny policy took 1.2-1.6x as long at 8-16 sequences of 22-70 tokens and
4.8x at 180 sequences of 22. A varlen call that meets fp32 tensors anyway (autocast off, an fp32 model)
runs the sdpa_docs path instead.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F

IMPL_NAME = "postrain_packed"
BACKENDS = ("varlen", "sdpa_docs")
_registered = False


def varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


HALF = (torch.bfloat16, torch.float16)  # what the flash-attention varlen kernel takes


def pick_backend(setting: str, device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """The backend for `setting` ('auto', 'hf', or one of BACKENDS) on `device` with attention computed in
    `dtype` (None: bf16/fp16, as under the learner's autocast); None = the model's own."""
    half = dtype is None or dtype in HALF
    if setting == "hf":
        return None
    if setting == "auto":
        return "varlen" if device.type == "cuda" and half and varlen_available() else "sdpa_docs"
    if setting not in BACKENDS:
        raise ValueError(f"attention backend {setting!r} not in {('auto', 'hf') + BACKENDS}")
    if setting == "varlen" and not (device.type == "cuda" and varlen_available()):
        raise ValueError("attention 'varlen' needs CUDA and torch.nn.attention.varlen (torch >= 2.10)")
    if setting == "varlen" and not half:
        raise ValueError(f"attention 'varlen' takes bf16/fp16 only, not {dtype}: enable learner.bf16 or use "
                         "'sdpa_docs'")
    return setting


def _varlen_call():
    """varlen_attn with causal masking and GQA, across the torch versions that differ in how to ask."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params
    if gqa:
        kw["enable_gqa"] = True

    def call(q_NHD, k_NHD, v_NHD, cu_S1, max_len, scale):
        if not gqa and k_NHD.shape[1] != q_NHD.shape[1]:
            rep = q_NHD.shape[1] // k_NHD.shape[1]
            k_NHD, v_NHD = k_NHD.repeat_interleave(rep, 1), v_NHD.repeat_interleave(rep, 1)
        return varlen_attn(q_NHD, k_NHD, v_NHD, cu_S1, cu_S1, max_len, max_len, scale=scale, **kw)

    return call


_VARLEN = None  # _varlen_call(), set by use_packed_attention before any layer runs


def _ensure_varlen() -> None:
    """Resolve the varlen kernel outside the layers: set lazily inside them, the global flipped from None
    after the compiled layers' first trace, and a guard on it recompiled them all (seen on an H100)."""
    global _VARLEN
    if _VARLEN is None:
        _VARLEN = _varlen_call()


def packed_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An HF attention function (query [1, Hq, N, D], key/value [1, Hkv, N, D]) -> ([1, N, Hq, D], None)."""
    cu_S1 = kwargs.get("cu_seq_lens_q")
    if cu_S1 is None or query.shape[0] != 1:
        raise ValueError("packed attention needs one packed row and cu_seq_lens_q (use learner.packed_attention)")
    if dropout:
        raise ValueError("packed attention has no dropout")
    backend = kwargs["postrain_backend"]
    bounds = kwargs.get("postrain_bounds")
    if backend == "varlen":
        # The kernel takes bf16/fp16 only and, being a custom op, is not cast by autocast (RoPE's fp32
        # cos/sin promote q and k to fp32): cast to the autocast dtype, as autocast does for sdpa.
        dev = query.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else value.dtype
        if dtype in HALF:
            _ensure_varlen()  # a direct call; use_packed_attention resolved it before any compiled layer ran
            q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # [N, H, D]
            out_NHD = _VARLEN(q, k, v, cu_S1, kwargs["max_length_q"], scaling)
            return out_NHD[None], None
        # fp32 (no autocast, an fp32 model): the kernel cannot take it; the per-sequence path can.
        cu = cu_S1.tolist()
        bounds = list(zip(cu[:-1], cu[1:]))
    # sdpa_docs: one causal attention per sequence (bounds are host ints, read once per forward).
    outs = []
    for a, b in bounds:
        outs.append(F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                   is_causal=True, scale=scaling,
                                                   enable_gqa=key.shape[1] != query.shape[1]))
    return torch.cat(outs, dim=2).transpose(1, 2), None


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(IMPL_NAME, packed_attention_forward)
        _registered = True


@contextlib.contextmanager
def use_packed_attention(model, backend: str, cu_seqlens_S1: torch.Tensor, max_seqlen: int | None = None):
    """For the duration: the model's layers use `backend` over the sequences of `cu_seqlens_S1` (the
    longest `max_seqlen` tokens: pass it when known, it saves a device sync); yields the keyword
    arguments to pass to the trunk's forward (HF hands them to every attention call)."""
    _register()
    if max_seqlen is None:
        max_seqlen = int(cu_seqlens_S1.diff().max())
    if backend == "varlen":
        _ensure_varlen()
    kw = {"postrain_backend": backend, "max_length_q": max_seqlen,
          "cu_seq_lens_q": cu_seqlens_S1.to(torch.int32)}
    if backend == "sdpa_docs":
        cu = cu_seqlens_S1.tolist()
        kw["postrain_bounds"] = list(zip(cu[:-1], cu[1:]))
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = IMPL_NAME
    try:
        yield kw
    finally:
        config._attn_implementation = before
