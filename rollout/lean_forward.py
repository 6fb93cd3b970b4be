"""A lean decoder forward for Llama-family checkpoints (Qwen2, Llama, Mistral) on the engine's slot KV cache.

On a CPU, a small model's decode step is bound by Python: the HF module tree spends most of a step in
`Module.__call__`, config attribute look-ups and wrappers, not in arithmetic. This forward runs the
same arithmetic as the HF classes (RMSNorm in fp32, rotary embedding from the model's own `inv_freq`,
grouped-query SDPA with an explicit mask, SwiGLU MLP, the LM head on the last position) straight on the
model's parameters (q/k/v and gate/up concatenated into one GEMM each: the engine rebuilds it
when it loads new weights). Anything it does
not cover (another architecture, rope scaling, sliding windows, other activations) is refused by
`LeanForward.supports` and the engine keeps the HF forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_ARCHS = {"qwen2", "llama", "mistral"}


class LeanForward:
    @staticmethod
    def supports(model) -> str | None:
        """None when this forward reproduces `model`, else the reason it does not."""
        cfg = model.config
        if getattr(cfg, "model_type", None) not in _ARCHS:
            return f"model_type {getattr(cfg, 'model_type', None)!r}"
        rope = getattr(cfg, "rope_scaling", None) or {}
        if (rope.get("rope_type") or rope.get("type") or "default") != "default":
            return f"rope scaling {rope}"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"activation {cfg.hidden_act!r}"
        if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)):
            return "sliding-window attention"
        if getattr(cfg, "mlp_bias", False):
            return "MLP biases"
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(getattr(inner, "rotary_emb", None), "inv_freq"):
            return "unexpected module layout"
        if getattr(inner.rotary_emb, "attention_scaling", 1.0) != 1.0:
            return "rotary attention scaling"
        return None

    def __init__(self, model):
        why = self.supports(model)
        if why is not None:
            raise ValueError(f"lean forward does not cover this model: {why}")
        cfg, inner = model.config, model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.inv_freq = inner.rotary_emb.inv_freq
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = []
        with torch.no_grad():  # q/k/v and gate/up as one GEMM each: copies, so rebuild after new weights
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
                b_qkv = None
                if any(b is not None for b in biases):
                    b_qkv = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for b, w in
                                       zip(biases, (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))])
                w_gu = torch.cat([m.gate_proj.weight, m.up_proj.weight])
                self.layers.append((layer.input_layernorm.weight, w_qkv, b_qkv, a.o_proj.weight, a.o_proj.bias,
                                    layer.post_attention_layernorm.weight, w_gu, m.down_proj.weight))
        self.q_dim, self.kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.inter = inner.layers[0].mlp.gate_proj.weight.shape[0] if len(inner.layers) else 0
        self._model = model

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-copy the fused q/k/v and gate/up weights from the model's parameters in place (after the model
        loaded new weights): tensors a captured CUDA graph reads keep their storage."""
        for layer, (_, w_qkv, b_qkv, _, _, _, w_gu, _) in zip(self._model.model.layers, self.layers):
            a, m = layer.self_attn, layer.mlp
            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], out=w_qkv)
            if b_qkv is not None:
                torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for b, w in
                           zip((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                               (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))], out=b_qkv)
            torch.cat([m.gate_proj.weight, m.up_proj.weight], out=w_gu)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, kv) -> torch.Tensor:
        """ids, pos [B, T]; mask [B, 1, T, kv_len] (True = attend); `kv` a bound SlotKV. Logits [B, 1, V]."""
        B, T = ids.shape
        x = F.embedding(ids, self.embed)
        freqs = pos[..., None].to(torch.float32) * self.inv_freq[None, None, :].to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        gqa, qd, kd = self.n_heads != self.n_kv, self.q_dim, self.kv_dim
        for i, (ln1, w_qkv, b_qkv, wo, bo, ln2, w_gu, wd) in enumerate(self.layers):
            qkv = F.linear(self._rms(x, ln1), w_qkv, b_qkv)
            q = qkv[..., :qd].view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
            k = qkv[..., qd:qd + kd].view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            v = qkv[..., qd + kd:].view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            k_all, v_all = kv.update(k, v, i)
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=self.head_dim ** -0.5,
                                               enable_gqa=gqa)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, -1), wo, bo)
            gu = F.linear(self._rms(x, ln2), w_gu)
            x = x + F.linear(F.silu(gu[..., :self.inter]) * gu[..., self.inter:], wd)
        return F.linear(self._rms(x[:, -1:], self.norm), self.lm_head)

    def decode_all(self, ids_S: torch.Tensor, pos_S: torch.Tensor, k_cache: list[torch.Tensor],
                   v_cache: list[torch.Tensor]) -> torch.Tensor:
        """One decode token for every slot of a static cache (k_cache[i], v_cache[i]: [S, kv_heads, L, head_dim]):
        slot s feeds ids_S[s] at position pos_S[s], writes its K/V there and attends to positions <= pos_S[s].
        Logits [S, V]. Static shapes throughout (no host value read), so it can be compiled and captured.
        Each group of query heads attends to its K/V head as a group of queries (no K/V repeat)."""
        S, L = ids_S.shape[0], k_cache[0].shape[2] if k_cache else 0
        G, D = self.n_heads // self.n_kv, self.head_dim
        x = F.embedding(ids_S, self.embed)  # [S, H]
        freqs = pos_S[:, None].to(torch.float32) * self.inv_freq[None, :].to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]  # [S, 1, D]
        rows = torch.arange(S, device=ids_S.device)
        mask = (torch.arange(L, device=ids_S.device)[None, :] <= pos_S[:, None])[:, None, None, :]  # [S, 1, 1, L]
        qd, kd = self.q_dim, self.kv_dim
        for i, (ln1, w_qkv, b_qkv, wo, bo, ln2, w_gu, wd) in enumerate(self.layers):
            qkv = F.linear(self._rms(x, ln1), w_qkv, b_qkv)
            q = self._rotate(qkv[:, :qd].view(S, self.n_heads, D), cos, sin)
            k = self._rotate(qkv[:, qd:qd + kd].view(S, self.n_kv, D), cos, sin)
            k_cache[i][rows, :, pos_S] = k
            v_cache[i][rows, :, pos_S] = qkv[:, qd + kd:].view(S, self.n_kv, D)
            o = F.scaled_dot_product_attention(q.view(S, self.n_kv, G, D), k_cache[i], v_cache[i], attn_mask=mask,
                                               scale=D ** -0.5)
            x = x + F.linear(o.reshape(S, -1), wo, bo)
            gu = F.linear(self._rms(x, ln2), w_gu)
            x = x + F.linear(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], wd)
        return F.linear(self._rms(x, self.norm), self.lm_head)
