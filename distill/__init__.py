"""distill: full-vocabulary on-policy distillation.

Files:
    kl.py            `reverse_kl(h_s, W_s, h_t, W_t, ...)`: the autograd-facing loss, backend choice
    kl_chunked.py    chunked torch backend (any device): fp32 statistics, memory bounded by a chunk size
    kl_triton.py     fused Triton backend (CUDA; TRITON_INTERPRET=1 on CPU for tests)
    kl_reference.py  plain fp64 reference, used only in tests
    teachers.py      teacher registry: which checkpoint serves which domain, checked before any work
    cache.py         teacher hidden-state cache rows in the data plane, and their checks
    prefill.py       teacher workers that prefill trajectories into the cache
    heads.py         teacher heads: host cache (pinned, byte budget), one head on the device, copied ahead
    opd_batches.py   a teacher group's micro-batches made ready for the device in the prefetch thread
    opd_loss.py      OPD losses (pure): multi-teacher full-vocabulary KL, the sampled-token baseline
    opd_config.py    the OPD learner's config
    opd_learner.py   the OPD learner of one rank: teacher-ordered steps, trunk backward split from the loss's
"""
from distill.kl import reverse_kl, token_coefficients

__all__ = ["reverse_kl", "token_coefficients"]
