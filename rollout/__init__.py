"""rollout: inference engine (HF causal LM, batched decode, KV cache, deterministic sampling), KV
snapshots, Ray rollout workers, the pool that survives their death, the multi-turn agent loop.
(Comes with the rollout issue.)"""
