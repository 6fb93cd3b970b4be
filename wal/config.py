"""WALConfig: the knobs of a log directory and of the gRPC log service (typed, bounded)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WALConfig(BaseModel):
    """How a WAL directory is written and reclaimed."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    segment_bytes: int = Field(64 << 20, ge=4096, le=1 << 34, description="roll to a new segment file once the active one reaches this size")
    preallocate_bytes: int = Field(1 << 20, ge=0, le=1 << 30, description="the active segment is zero-filled this far ahead of the write position, so commits fdatasync data only (0: grow the file on every commit)")
    spare_segments: bool = Field(False, description="once a segment has grown past its first extent, zero-fill the next segment file in a background thread and roll commits into it instead of growing the file inline: fewer commit stalls, but on the H200 host's disk 5% fewer steps/s (needs preallocate_bytes > 0)")
    recycle_segments: bool = Field(True, description="a segment that retention reclaims whole (at least segment_bytes) becomes the next segment instead of being deleted: its blocks are overwritten in place, so a log in steady state writes no zeros and journals no size change (needs preallocate_bytes > 0)")
    direct_io: bool = Field(True, description="commits inside the preallocated blocks are written with O_DIRECT and RWF_DSYNC (one call, durable on return, no page cache) instead of pwrite + fdatasync, where the platform and file system allow; off: always pwrite + fdatasync (needs preallocate_bytes > 0)")
    max_batch_bytes: int = Field(32 << 20, ge=1 << 16, le=1 << 31, description="appended-but-uncommitted bytes after which an append forces a commit (bounds memory)")
    max_record_tokens: int = Field(1 << 20, ge=1, le=4 << 20, description="longer appends are split into records of at most this many tokens")
    compact_live_fraction: float = Field(0.5, ge=0.0, le=1.0, description="an old segment whose live bytes are at most this fraction is compacted: live records copied forward, file deleted")
    retain_bytes: int = Field(1 << 30, ge=0, le=1 << 44, description="above this many bytes of sealed segments, old segments are compacted whatever their live fraction")


class ServeConfig(BaseModel):
    """The gRPC log service (`postrain wal serve`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    host: str = Field("127.0.0.1", description="interface to bind; anything but loopback requires a token")
    port: int = Field(50551, ge=0, le=65535, description="TCP port (0 picks a free one)")
    max_message_bytes: int = Field(16 << 20, ge=1 << 16, le=1 << 30, description="largest gRPC message accepted or sent")
    max_workers: int = Field(1024, ge=2, le=65536, description="concurrent streams and calls the service accepts (each "
                             "a coroutine of the aio server; beyond it a call gets RESOURCE_EXHAUSTED, which clients "
                             "wait out with backoff)")
    max_read_tokens: int = Field(1 << 18, ge=1, le=1 << 22, description="tokens per read reply (longer trajectories come in chunks)")


class WALFileConfig(BaseModel):
    """A `postrain wal serve --config FILE`: `[wal]` and `[serve]` tables."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    wal: WALConfig = Field(default_factory=WALConfig, description="log directory settings")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="gRPC service settings")
