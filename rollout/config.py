"""Configs of the rollout path: the engine, the pool, and a `postrain rollout` run (configs/rollout.toml)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from core.config import Config


class EngineConfig(Config):
    """The inference engine of one worker."""

    max_batch: int = Field(8, ge=1, le=4096, description="requests decoded together (KV slots)")
    max_len: int = Field(0, ge=0, le=1 << 20, description="longest trajectory in tokens; 0 = the model's max positions")
    strict: bool = Field(True, description="batch-invariant mode: one row per forward and decode-point replay on resume")
    dtype: str = Field("float32", pattern="^(float32|bfloat16|float16)$", description="weights and KV dtype")
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="torch device of the engine: cpu, cuda or "
                        "cuda:N (a CUDA device must be present when the run starts)")
    cuda_graphs: bool = Field(False, description="decode every step as one CUDA graph (the static all-slot forward, "
                              "captured when the worker starts): on a CUDA device only, a no-op on a CPU; needs "
                              "strict = false; each step attends over all max_len positions, so keep max_len near "
                              "the longest trajectory")
    decode_chunk: int = Field(1, ge=1, le=1024, description="decode steps per device launch: > 1 feeds each step's "
                              "draws back on the device (the lean forward over every slot, uniforms and the draw on "
                              "the device) and reads the chunk's draws at once; rows with top-k / top-p decode one "
                              "step at a time; needs strict = false and a Llama-family model")
    compile_decode: bool = Field(False, description="torch.compile the chunked decoder's forward (compiled on the "
                                 "first chunk: seconds to minutes once per worker)")

    @model_validator(mode="after")
    def _graphs_need_fast_path(self):
        if self.cuda_graphs and self.strict:
            raise ValueError("engine.cuda_graphs needs engine.strict = false (the strict path feeds one row per "
                             "forward; the CUDA graph decodes every slot at once)")
        if self.decode_chunk > 1 and self.strict:
            raise ValueError("engine.decode_chunk > 1 needs engine.strict = false (the strict path feeds one row per "
                             "forward and draws on the host)")
        return self


class SamplingConfig(Config):
    """Decoding controls of every episode."""

    temperature: float = Field(1.0, ge=0, le=100, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass kept")
    top_k: int = Field(0, ge=0, le=1 << 20, description="0 = off")
    max_new_tokens: int = Field(48, ge=1, le=1 << 20, description="sampled tokens per trajectory (tool results not counted)")
    max_tool_calls: int = Field(4, ge=0, le=64, description="tool calls answered per episode; more ends it")


class PoolConfig(Config):
    """Ray rollout workers and the pool that survives their death."""

    workers: int = Field(2, ge=1, le=1024, description="rollout worker actors")
    threads_per_worker: int = Field(1, ge=1, le=256, description="torch threads pinned in each actor")
    steps_per_call: int = Field(8, ge=1, le=4096, description="decode steps a worker runs per call before reporting")
    seed: int = Field(0, ge=0, description="run seed: trajectory ids and sampling follow from it")
    wal_addr: str = Field("", description="WAL service host:port, or several comma-separated (the shard map: a trajectory "
                          "goes to shard crc32(id) mod n; keep the order for the life of a run); empty = an in-process "
                          "WAL per worker under the run dir")
    wal_segment_bytes: int = Field(64 << 20, ge=4096, le=1 << 34, description="segment size of the in-process worker "
                                   "WALs: retention deletes a sealed segment once its trajectories are finalized, so "
                                   "small segments keep a worker's WAL near its live trajectories")
    sandbox_addr: str = Field("", description="sandbox service host:port, or several comma-separated (worker k uses "
                              "replica k mod n); empty = the pool starts a local one")
    worker_cpus: float = Field(0.0, ge=0, le=1024, description="Ray CPUs each rollout actor reserves (0: the embedded "
                               "default, actors share the machine and pin torch to threads_per_worker)")
    worker_gpus: float = Field(0.0, ge=0, le=64, description="Ray GPUs each rollout actor reserves")
    worker_strategy: Literal["DEFAULT", "SPREAD"] = Field("DEFAULT", description="Ray scheduling of the actors: "
                                                          "SPREAD puts them on as many nodes as it can")
    local_cpus: int = Field(2, ge=1, le=4096, description="CPUs of the local Ray started when no cluster is named")
    sandbox_isolate_pure: bool = Field(True, description="the local sandbox also isolates the pure calc tool; false "
                                       "answers it in the service process (fast; python stays isolated)")
    snapshot_uri: str = Field("", description="KV snapshot store (dir or pyarrow.fs URI); empty = RUN_DIR/kv")
    split_restore: bool = Field(True, description="a resume re-prefills the head of its tokens while the rest of the "
                                "KV snapshot is read, split where both take as long (rates measured by the worker; "
                                "engines on an accelerator outside strict mode); false reads the whole snapshot")
    commit_group_steps: int = Field(1, ge=1, le=256, description="decode steps per WAL commit (tokens are exposed only once committed)")
    max_commit_lag: int = Field(4, ge=1, le=256, description="WAL commits in flight in the background while decoding goes on")
    max_replacements: int = Field(64, ge=0, le=100_000, description="worker replacements before the pool gives up")
    call_timeout_s: float = Field(300.0, gt=0, le=86_400, description="longest a worker call may take before it is declared dead")


class RolloutConfig(Config):
    """`postrain rollout`: one file with every table."""

    engine: EngineConfig = Field(default_factory=EngineConfig, description="inference engine")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="decoding controls")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="workers and pool")
