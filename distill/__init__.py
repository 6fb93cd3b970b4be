"""distill: full-vocabulary on-policy distillation.

Files:
    kl.py            `reverse_kl(h_s, W_s, h_t, W_t, ...)`: the autograd-facing loss, backend choice
    kl_chunked.py    chunked torch backend (any device): fp32 statistics, memory bounded by a chunk size
    kl_triton.py     fused Triton backend (CUDA; TRITON_INTERPRET=1 on CPU for tests)
    kl_reference.py  plain fp64 reference, used only in tests

(The teacher registry, hidden-state cache, head scheduler and OPD trainer are not built yet.)
"""
from distill.kl import reverse_kl, token_coefficients

__all__ = ["reverse_kl", "token_coefficients"]
