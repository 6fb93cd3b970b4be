"""distill: teacher registry, teacher hidden-state cache, one-head-at-a-time scheduler,
full-vocab reverse-KL (Triton kernel + chunked torch reference), OPD trainer.
(Comes with the distill issue.)"""
