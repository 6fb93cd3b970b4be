"""KV snapshots: a request's KV cache as safetensors with a validating header, in a snapshot store.

Header (safetensors `__metadata__`): trajectory id, token count, hash of the covered token ids,
policy version, model fingerprint, dtype, crc32c of the tensor bytes. A snapshot is trusted only
when every field matches the WAL and the current weights; anything else is a `SnapshotRejected`
whose reason the caller counts before falling back to re-prefill from the WAL.

The store is a local directory (atomic write: temp, fsync, rename, fsync dir) or any `pyarrow.fs`
URI (temp object then move).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deploy.atomic import write_atomic

FORMAT = "postrain-kv-1"


class SnapshotRejected(Exception):
    """A snapshot that must not be used; `reason` is one of missing, corrupt, mismatch, stale."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class SnapshotHeader:
    traj_id: str
    token_count: int
    tokens_hash: str
    policy_version: int
    fingerprint: str
    dtype: str
    checksum: int


def tokens_hash(tokens: list[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).hexdigest()


def _checksum(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = google_crc32c.extend(crc, name.encode())
        crc = google_crc32c.extend(crc, t.view(torch.uint8).numpy().tobytes())
    return crc


def encode(traj_id: str, tokens: list[int], tensors: dict[str, torch.Tensor], policy_version: int,
           fingerprint: str) -> bytes:
    """Snapshot bytes of `tensors`, the KV of `tokens` (the covered prefix)."""
    dtypes = {str(t.dtype) for t in tensors.values()}
    if len(dtypes) > 1:
        raise ValueError(f"kv tensors of mixed dtypes {dtypes}")
    meta = {"format": FORMAT, "traj_id": str(traj_id), "token_count": str(len(tokens)),
            "tokens_hash": tokens_hash(tokens), "policy_version": str(policy_version),
            "fingerprint": fingerprint, "dtype": dtypes.pop() if dtypes else "", "checksum": str(_checksum(tensors))}
    return st_save(tensors, metadata=meta)


def read_header(data: bytes) -> SnapshotHeader:
    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + n])["__metadata__"]
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
        return SnapshotHeader(meta["traj_id"], int(meta["token_count"]), meta["tokens_hash"],
                              int(meta["policy_version"]), meta["fingerprint"], meta["dtype"], int(meta["checksum"]))
    except Exception as exc:  # any malformed header is the same operating condition: unusable snapshot
        raise SnapshotRejected("corrupt", f"unreadable header ({type(exc).__name__}: {exc})") from None


def decode(data: bytes | None, traj_id: str, wal_tokens: list[int], policy_version: int, fingerprint: str,
           dtype: torch.dtype) -> tuple[SnapshotHeader, dict[str, torch.Tensor]]:
    """The snapshot's KV if it matches this trajectory's committed tokens and the current weights."""
    if data is None:
        raise SnapshotRejected("missing", f"no snapshot for {traj_id}")
    h = read_header(data)
    if h.traj_id != str(traj_id):
        raise SnapshotRejected("mismatch", f"snapshot is of {h.traj_id!r}, not {traj_id!r}")
    if h.token_count > len(wal_tokens) or tokens_hash(wal_tokens[:h.token_count]) != h.tokens_hash:
        raise SnapshotRejected("mismatch", f"snapshot's {h.token_count} tokens are not a prefix of the WAL's {len(wal_tokens)}")
    if h.policy_version != policy_version or h.fingerprint != fingerprint:
        raise SnapshotRejected("stale", f"snapshot of policy v{h.policy_version} ({h.fingerprint[:8]}), "
                                        f"engine holds v{policy_version} ({fingerprint[:8]})")
    if h.dtype != str(dtype):
        raise SnapshotRejected("mismatch", f"snapshot dtype {h.dtype}, engine {dtype}")
    try:
        tensors = st_load(data)
    except Exception as exc:
        raise SnapshotRejected("corrupt", f"tensors unreadable ({type(exc).__name__})") from None
    if _checksum(tensors) != h.checksum:
        raise SnapshotRejected("corrupt", "checksum mismatch")
    return h, tensors


class SnapshotStore:
    """Snapshots by trajectory id under a directory or a `pyarrow.fs` URI (s3://, gs://, file://, …)."""

    def __init__(self, uri: str | Path):
        uri = str(uri)
        self.uri = uri
        if "://" in uri and not uri.startswith("file://"):
            from pyarrow import fs as pafs
            self._fs, root = pafs.FileSystem.from_uri(uri)
            self._root, self._local = root.rstrip("/"), None
            self._fs.create_dir(self._root, recursive=True)
        else:
            self._local = Path(uri.removeprefix("file://"))
            self._local.mkdir(parents=True, exist_ok=True)

    def _name(self, traj_id: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(traj_id))
        return f"{safe}-{hashlib.blake2b(str(traj_id).encode(), digest_size=4).hexdigest()}.kv.safetensors"

    def path(self, traj_id: str) -> str:
        name = self._name(traj_id)
        return str(self._local / name) if self._local else f"{self._root}/{name}"

    def put(self, traj_id: str, data: bytes) -> None:
        if self._local:
            write_atomic(self._local / self._name(traj_id), data)
            return
        final = self.path(traj_id)
        tmp = final + ".tmp"
        with self._fs.open_output_stream(tmp) as f:
            f.write(data)
        self._fs.move(tmp, final)

    def get(self, traj_id: str) -> bytes | None:
        if self._local:
            p = self._local / self._name(traj_id)
            return p.read_bytes() if p.is_file() else None
        from pyarrow import fs as pafs
        p = self.path(traj_id)
        if self._fs.get_file_info(p).type != pafs.FileType.File:
            return None
        with self._fs.open_input_stream(p) as f:
            return f.read()

    def delete(self, traj_id: str) -> bool:
        if self._local:
            p = self._local / self._name(traj_id)
            if p.is_file():
                p.unlink()
                return True
            return False
        from pyarrow import fs as pafs
        p = self.path(traj_id)
        if self._fs.get_file_info(p).type != pafs.FileType.File:
            return False
        self._fs.delete_file(p)
        return True

    def ids_on_disk(self) -> list[str]:
        """File paths of every stored snapshot (the chaos injector picks victims from these)."""
        if self._local:
            return sorted(str(p) for p in self._local.glob("*.kv.safetensors"))
        from pyarrow import fs as pafs
        infos = self._fs.get_file_info(pafs.FileSelector(self._root))
        return sorted(i.path for i in infos if i.path.endswith(".kv.safetensors"))
