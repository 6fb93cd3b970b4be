"""learner: policy construction and checkpoints, SFT and eval, the GRPO loss (pure) and trainer.

    tokenizer.py     character-level tokenizer (tokenizers library, saved as an HF fast tokenizer)
    config.py        PolicyConfig, SFTConfig, EvalConfig
    policy.py        build a tiny HF causal LM from config; load/save any HF checkpoint directory
    sft.py           SFT on domain demonstrations (completion-only loss, warm-up + cosine, clipping)
    evaluate.py      pass@1 on a domain's eval split, tool calls answered in-process
    grpo_loss.py     GRPO loss (clipping, dual-clip, aggregations, k1/k2/k3 KL, entropy) and fused log-prob head
    logprob_head.py  log-prob head that forms its softmax gradient in the forward (CUDA, Triton): one GEMM backward
    advantages.py    group-relative advantages (std-norm and leave-one-out optional, zero-variance groups)
    staleness.py     token staleness histogram and bound (drop or mask)
    grpo_config.py   GRPO configs (loss, advantages, staleness, optimiser, learner group)
    optim.py         AdamW and LR schedule for the learner group
    train_step.py    packed batch and one optimiser step with micro-batching and accumulation
    group.py         learner group: one process, or N Ray actors over one torch.distributed group
    checkpoint.py    atomic learner checkpoints: HF weights, optimiser, RNG, iteration, policy version
"""
