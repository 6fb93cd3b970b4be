"""rollout: inference engine (any HF causal LM, batched decode, KV cache, deterministic sampling), KV
snapshots, Ray rollout workers, the pool that survives their death, the multi-turn agent loop.

    sampling.py   counter-based RNG keyed by (seed, trajectory, position); inverse-CDF draws in fp64
    kvcache.py    slot KV cache written through HF's `cache.update` protocol (requests join and leave)
    engine.py     Engine: admit / resume, launch + collect decode steps, accept, strict batch-invariant mode
    lean_forward.py  the Llama-family forward straight on the parameters (CPU decode; every slot at once on a GPU)
    static_decode.py one all-slot decode step, captured as a CUDA graph
    chunk_decode.py  several decode steps per host round trip, each draw fed back on the device (CUDA graph, compile)
    snapshot.py   KV snapshots: safetensors + validating header, chunk crc32c, local / pyarrow.fs store
    types.py      Request, Finished, WorkerReport, ENV_LOGPROB (marks prompt and tool-result tokens)
    config.py     EngineConfig, SamplingConfig, PoolConfig, RolloutConfig (configs/rollout.toml)
    agent.py      one tool turn through the sandbox service, keyed so a replay reuses the recorded result
    worker.py     RolloutWorker (WAL commit order, suspend / preempt with snapshots, resume) + RolloutActor (Ray)
    pool.py       RolloutPool: bounded in-flight, replacement on death, sink then finalize, stream audit
    sink.py       DataPlaneSink: finished trajectories into the data plane, idempotent by id
    run.py        one `postrain rollout` run and its JSON report
    local_cluster.py  LocalCluster: a real multi-node Ray cluster on one machine (head + worker raylets, free ports)
"""
