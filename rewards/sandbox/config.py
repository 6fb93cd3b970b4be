"""Typed, bounded configuration of the sandbox service (CLI flags of `postrain sandbox serve` map onto it)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rewards.sandbox.types import Limits

RESPONSE_LIMIT_BYTES = 4 << 20  # the largest reply the service sends
ENTRY_OVERHEAD_BYTES = 64 << 10  # an entry's fields besides its request and its output (reason, ids, framing)


class SandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    host: str = Field("127.0.0.1", description="address to bind; 127.0.0.1 unless the service must be reachable from other hosts")
    port: int = Field(0, ge=0, le=65535, description="TCP port; 0 picks a free one (printed at start)")
    log_dir: Path = Field(Path("runs/sandbox"), description="state dir: environment log and counter state (hidden from sandboxes)")
    require_isolation: bool = Field(True, description="refuse to start without bubblewrap; if false, calc runs in-process (pure) and python is refused")
    allow_weaker_isolation: bool = Field(False, description="start isolated even where the seccomp filter or the ban on "
                                         "nested user namespaces is unavailable (the missing layers are printed)")
    isolate_pure_tools: bool = Field(True, description="run calc (pure, bounded, no eval) in a sandbox too; false answers it "
                                     "in the service process (~0.1 ms instead of a sandbox start; the env log's "
                                     "exactly-once is unchanged); python always runs isolated")
    max_concurrent: int = Field(8, ge=1, le=256, description="executions running at once (one uid each)")
    first_slot: int = Field(0, ge=0, le=255, description="the first of this service's execution slots (uid 61000 + "
                            "slot): replicas on one host take disjoint ranges, or one's sweep kills another's calls")
    max_queued: int = Field(64, ge=0, le=4096, description="calls waiting for a slot; beyond that RESOURCE_EXHAUSTED at once")
    queue_wait_s: float = Field(30.0, gt=0, le=600, description="longest wait for a slot before RESOURCE_EXHAUSTED")
    rpc_threads: int = Field(96, ge=4, le=1024, description="gRPC handler threads (above max_concurrent + max_queued is wasted)")
    max_request_bytes: int = Field(256 << 10, ge=1 << 10, le=16 << 20, description="largest request message accepted "
                                   "(the default holds a python call at its bound of 16384 characters, 4 bytes each)")
    entries_page: int = Field(256, ge=1, le=4096, description="entries per Entries page (fast-forward)")
    wall_s: float = Field(5.0, gt=0, le=600, description="wall clock of one execution (a call may ask for less)")
    cpu_s: int = Field(4, ge=1, le=3600, description="RLIMIT_CPU seconds per process")
    address_space_mb: int = Field(1024, ge=64, le=1 << 20, description="RLIMIT_AS per process, MiB")
    processes: int = Field(32, ge=2, le=4096, description="RLIMIT_NPROC per execution (its own uid when run as root)")
    file_size_mb: int = Field(8, ge=1, le=1 << 20, description="RLIMIT_FSIZE, MiB")
    tmp_mb: int = Field(32, ge=1, le=1 << 20, description="size of the private /tmp of one execution, MiB")
    output_bytes: int = Field(64 << 10, ge=1 << 10, le=16 << 20, description="stdout and stderr bound each; beyond: killed")
    memory_mb: int = Field(1024, ge=0, le=1 << 20, description="memory of one whole execution (every process, its /tmp), "
                           "MiB, bounded by a memory cgroup per slot; over it the kernel kills (memory_limit); 0: none")
    memory_cgroup: Literal["auto", "required", "off"] = Field(
        "auto", description="auto: bound memory_mb by a cgroup where the service may create one (root, a writable "
        "hierarchy), else per process only (printed at start); required: refuse to start without; off: none")

    @model_validator(mode="after")
    def _slots_fit_the_host(self):
        if self.first_slot + self.max_concurrent > 256:
            raise ValueError(f"first_slot ({self.first_slot}) + max_concurrent ({self.max_concurrent}) exceed the 256 "
                             "execution slots of a host")
        return self

    @model_validator(mode="after")
    def _memory_holds_an_interpreter(self):
        if 0 < self.memory_mb < 64 + self.tmp_mb:
            raise ValueError(f"memory_mb ({self.memory_mb}) must be 0 or at least 64 + tmp_mb ({self.tmp_mb}): an "
                             "interpreter and a full /tmp count against it")
        return self

    @model_validator(mode="after")
    def _an_entry_fits_a_reply(self):
        """A call's request and its result travel together in an Entries reply (a resume's fast-forward): a
        result that could not be sent would leave its sandbox stuck for good."""
        need = self.max_request_bytes + self.output_bytes + ENTRY_OVERHEAD_BYTES
        if need > RESPONSE_LIMIT_BYTES:
            raise ValueError(f"max_request_bytes ({self.max_request_bytes}) + output_bytes ({self.output_bytes}) must "
                             f"leave {ENTRY_OVERHEAD_BYTES} bytes under the {RESPONSE_LIMIT_BYTES}-byte reply bound")
        return self

    def limits(self) -> Limits:
        return Limits(wall_s=self.wall_s, cpu_s=self.cpu_s, address_space_bytes=self.address_space_mb << 20,
                      processes=self.processes, file_size_bytes=self.file_size_mb << 20,
                      tmp_bytes=self.tmp_mb << 20, output_bytes=self.output_bytes,
                      memory_bytes=0 if self.memory_cgroup == "off" else self.memory_mb << 20)
