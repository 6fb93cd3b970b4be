"""KV snapshots: a request's KV cache as safetensors with a validating header, in a snapshot store.

Header (safetensors `__metadata__`): trajectory id, token count, hash of the covered token ids,
policy version, model fingerprint, dtype, the crc32c of every piece of the tensor bytes, and crc32c of
the tensor index (names, dtypes, shapes, offsets: a bit flipped there names or shapes a tensor wrongly
while every other field still checks out). A snapshot is trusted only when every field matches the WAL
and the current weights; anything else is a `SnapshotRejected` whose reason the caller counts before
falling back to re-prefill from the WAL.

Tensors are [kv_heads, tokens, head_dim]. A piece is one head's rows of one block of `block_tokens`
tokens, so the KV of the tokens from any block boundary on can be read and verified without the rest:
a resume re-prefills the head of a trajectory while the tail of its snapshot is read (`restore.py`).

The store is a local directory (atomic write through `core.fileio`: temp, fsync, rename, fsync dir)
or any `pyarrow.fs` URI through `dataplane.remote` (temp object then move; object stores have no fsync).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np
import torch
from safetensors.torch import save as st_save

from core import fileio
from core.procs import pid_alive
from core.atomic import write_atomic

try:  # the checked read in C (rollout/_kvread.c), built by `pip install` where a compiler is
    from rollout import _kvread
except ImportError:  # pragma: no cover - the Python readers below do the same
    _kvread = None
READER = "c"  # "python": the pool of Python threads even where the C reader is built (tests, bench A/B)

FORMAT = "postrain-kv-4"  # 3: the tensor index is checksummed; 4: one checksum per head and token block
BLOCK_TOKENS = 1024  # tokens per checksummed piece: the granularity of a partial read
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}


class SnapshotRejected(Exception):
    """A snapshot that must not be used; `reason` is one of missing, corrupt, mismatch, stale, unreadable (an
    I/O error opening or reading it)."""

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
    block_tokens: int
    checksums: tuple[int, ...]  # crc32c of each piece (`pieces`), in that order
    tensors: dict  # name -> (dtype code, shape, [begin, end) in the payload)
    payload_offset: int  # where the tensor payload starts in the file


def tokens_hash(tokens: list[int]) -> str:
    return hashlib.blake2b(struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).hexdigest()


def _index_crc(tensors: dict) -> str:
    """crc32c of the tensor index (name -> dtype, shape, offsets) in one canonical form."""
    canon = json.dumps(sorted((k, v[0], list(v[1]), list(v[2])) for k, v in tensors.items()), separators=(",", ":"))
    return f"{crc32c.crc32c(canon.encode()):08x}"


def _index(head: bytes) -> dict:
    doc = json.loads(head)
    doc.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"])) for k, v in doc.items()}


def _ordered(tensors: dict) -> list[tuple[str, tuple]]:
    """The tensors in payload order (by begin offset)."""
    return sorted(tensors.items(), key=lambda item: item[1][2][0])


def _head_pieces(tensors: dict, block_tokens: int, start: int = 0):
    """For each tensor [H, T, D] in payload order and each head: (tensor name, head, [(checksum index, begin,
    end) in the payload of each block of `block_tokens` tokens holding tokens from `start` on])."""
    k = 0
    for name, (code, (H, T, D), (a, _)) in _ordered(tensors):
        row, blocks = D * _ITEMSIZE[code], -(-T // block_tokens)
        for h in range(H):
            base = a + h * T * row
            yield name, h, [(k + j, base + j * block_tokens * row, base + min(T, (j + 1) * block_tokens) * row)
                            for j in range(start // block_tokens, blocks)]
            k += blocks


def pieces(tensors: dict, block_tokens: int, start: int = 0) -> list[tuple[int, int, int]]:
    """(checksum index, begin, end) in the payload of every piece holding tokens from `start` on: for each
    tensor [H, T, D] in payload order, each head, each block of `block_tokens` tokens."""
    return [p for _, _, run in _head_pieces(tensors, block_tokens, start) for p in run]


def _piece_crcs(payload, tensors: dict, block_tokens: int) -> list[int]:
    view = memoryview(payload)
    return [crc32c.crc32c(view[a:b]) for _, a, b in pieces(tensors, block_tokens)]


def encode(traj_id: str, tokens: list[int], tensors: dict[str, torch.Tensor], policy_version: int,
           fingerprint: str) -> bytes:
    """Snapshot bytes of `tensors`, the KV of `tokens` (the covered prefix)."""
    dtypes = {str(t.dtype) for t in tensors.values()}
    if len(dtypes) > 1:
        raise ValueError(f"kv tensors of mixed dtypes {dtypes}")
    meta = {"format": FORMAT, "traj_id": str(traj_id), "token_count": str(len(tokens)),
            "tokens_hash": tokens_hash(tokens), "policy_version": str(policy_version),
            "fingerprint": fingerprint, "dtype": dtypes.pop() if dtypes else "", "block_tokens": str(BLOCK_TOKENS)}
    for name, t in tensors.items():
        if t.dim() != 3 or t.shape[1] != len(tokens):
            raise ValueError(f"kv tensor {name} of shape {tuple(t.shape)}: expected [heads, {len(tokens)}, head_dim]")
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    first = st_save(tensors, metadata={**meta, "checksum": "", "index_crc": ""})
    (n,) = struct.unpack("<Q", first[:8])
    index = _index(first[8:8 + n])  # neither the payload nor its offsets depend on the metadata
    crcs = _piece_crcs(first[8 + n:], index, BLOCK_TOKENS)
    data = st_save(tensors, metadata={**meta, "checksum": ",".join(f"{c:08x}" for c in crcs),
                                      "index_crc": _index_crc(index)})
    (n2,) = struct.unpack("<Q", data[:8])
    if len(data) - 8 - n2 != len(first) - 8 - n:
        raise AssertionError("snapshot payload changed between the two encodings")
    return data


def _parse_header(head: bytes, n: int) -> SnapshotHeader:
    try:
        doc = json.loads(head)
        meta = doc.pop("__metadata__")
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}")
        crcs = tuple(int(c, 16) for c in meta["checksum"].split(",") if c)
        tensors = {k: (v["dtype"], tuple(v["shape"]), tuple(v["data_offsets"])) for k, v in doc.items()}
        if _index_crc(tensors) != meta["index_crc"]:
            raise ValueError("tensor index checksum mismatch")
        return SnapshotHeader(meta["traj_id"], int(meta["token_count"]), meta["tokens_hash"],
                              int(meta["policy_version"]), meta["fingerprint"], meta["dtype"],
                              int(meta["block_tokens"]), crcs, tensors, 8 + n)
    except Exception as exc:  # any malformed header is the same operating condition: unusable snapshot
        raise SnapshotRejected("corrupt", f"unreadable header ({type(exc).__name__}: {exc})") from None


def read_header(data: bytes) -> SnapshotHeader:
    try:
        (n,) = struct.unpack("<Q", data[:8])
    except struct.error:
        raise SnapshotRejected("corrupt", "truncated before the header") from None
    if n > len(data) - 8:
        raise SnapshotRejected("corrupt", f"header of {n} bytes in a file of {len(data)}")
    return _parse_header(data[8:8 + n], n)


def validate(h: SnapshotHeader, traj_id: str, wal_tokens: list[int], policy_version: int, fingerprint: str,
             dtype: torch.dtype, payload_bytes: int) -> None:
    """Raise SnapshotRejected unless `h` belongs to this trajectory's committed tokens and these weights."""
    if h.traj_id != str(traj_id):
        raise SnapshotRejected("mismatch", f"snapshot is of {h.traj_id!r}, not {traj_id!r}")
    if h.token_count > len(wal_tokens) or tokens_hash(wal_tokens[:h.token_count]) != h.tokens_hash:
        raise SnapshotRejected("mismatch", f"snapshot's {h.token_count} tokens are not a prefix of the WAL's {len(wal_tokens)}")
    if h.policy_version != policy_version or h.fingerprint != fingerprint:
        raise SnapshotRejected("stale", f"snapshot of policy v{h.policy_version} ({h.fingerprint[:8]}), "
                                        f"engine holds v{policy_version} ({fingerprint[:8]})")
    if h.dtype != str(dtype):
        raise SnapshotRejected("mismatch", f"snapshot dtype {h.dtype}, engine {dtype}")
    end = max((t[2][1] for t in h.tensors.values()), default=0)
    if end != payload_bytes or h.block_tokens < 1:
        raise SnapshotRejected("corrupt", f"payload of {payload_bytes} bytes, header expects {end} "
                                          f"(blocks of {h.block_tokens} tokens)")
    for name, (code, shape, (a, b)) in h.tensors.items():
        if code not in _DTYPES:
            raise SnapshotRejected("corrupt", f"tensor {name} of unknown dtype {code}")
        if len(shape) != 3 or shape[1] != h.token_count or b - a != shape[0] * shape[1] * shape[2] * _ITEMSIZE[code]:
            raise SnapshotRejected("corrupt", f"tensor {name} of shape {shape} at [{a}, {b}) does not hold "
                                              f"{h.token_count} tokens")
    expected = sum(shape[0] * -(-shape[1] // h.block_tokens) for _, shape, _ in h.tensors.values())
    if expected != len(h.checksums):
        raise SnapshotRejected("corrupt", f"{len(h.checksums)} checksums for {expected} pieces")


def _views(buf: torch.Tensor, tensors: dict) -> dict[str, torch.Tensor]:
    return {name: buf[a:b].view(_DTYPES[code]).view(shape) for name, (code, shape, (a, b)) in tensors.items()}


def decode(data: bytes | None, traj_id: str, wal_tokens: list[int], policy_version: int, fingerprint: str,
           dtype: torch.dtype) -> tuple[SnapshotHeader, dict[str, torch.Tensor]]:
    """The snapshot's KV if it matches this trajectory's committed tokens and the current weights."""
    if data is None:
        raise SnapshotRejected("missing", f"no snapshot for {traj_id}")
    h = read_header(data)
    payload = data[h.payload_offset:]
    validate(h, traj_id, wal_tokens, policy_version, fingerprint, dtype, len(payload))
    if _piece_crcs(payload, h.tensors, h.block_tokens) != list(h.checksums):
        raise SnapshotRejected("corrupt", "checksum mismatch")
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    return h, _views(buf, h.tensors)


_staging: dict[str, torch.Tensor] = {}
_staging_lock = threading.Lock()  # one read fills the pinned staging buffer at a time
_upload_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def _staging_buffer(nbytes: int) -> torch.Tensor:
    """The reused page-locked host buffer a read to a GPU lands in (the upload is then one fast DMA);
    the caller holds `_staging_lock`."""
    buf = _staging.get("pinned")
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        _staging["pinned"] = buf
    return buf[:nbytes]


READ_BYTES = 1 << 20  # one read request of a restore. A cold read is bound by the requests in flight: on a
# virtio disk, 8 reads of 8 MiB at a time gave 1.3 GB/s and 32 of 1 MiB 1.8 GB/s (an NVIDIA H100 host)


def pread_into(fd: int, view: memoryview, offset: int) -> bool:
    """Fill `view` from `fd` at `offset` (pread until full); False on a short file."""
    got, want = 0, len(view)
    while got < want:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            return False
        got += n
    return True


def _tail_layout(h: SnapshotHeader, start: int) -> tuple[dict, int]:
    """Where each tensor's rows from token `start` on go in a read buffer: name -> (code, shape, [a, b))
    with the tensors in payload order, and the buffer's size."""
    out, at = {}, 0
    for name, (code, (H, T, D), _) in _ordered(h.tensors):
        n = H * (T - start) * D * _ITEMSIZE[code]
        out[name] = (code, (H, T - start, D), (at, at + n))
        at += n
    return out, at


def _read_requests(h: SnapshotHeader, start: int, layout: dict) -> list[tuple[int, int, int, list]]:
    """(file offset, buffer offset, length, [(checksum index, begin, end) in the buffer]) of each read
    request: runs of whole pieces of one head, at most READ_BYTES (or one piece) each."""
    reqs = []
    for name, hh, blocks in _head_pieces(h.tensors, h.block_tokens, start):
        code, (_, T, D), _ = h.tensors[name]
        row, (_, (_, tail, _), (ta, _)) = D * _ITEMSIZE[code], layout[name]
        per = max(1, READ_BYTES // (h.block_tokens * row))  # pieces per request
        shift = ta + hh * tail * row - blocks[0][1] if blocks else 0  # payload offset -> buffer offset
        for r in range(0, len(blocks), per):
            run = blocks[r:r + per]
            lo, hi = run[0][1], run[-1][2]
            reqs.append((h.payload_offset + lo, lo + shift, hi - lo, [(k, x + shift, y + shift) for k, x, y in run]))
    return reqs


def _read_checked(fd: int, dst, h: SnapshotHeader, reqs: list, threads: int) -> bool:
    """Run the read requests into `dst`, up to `threads` at a time, each checksumming its pieces as it
    lands. False on a short read or a checksum mismatch. In C where the module is built (`_kvread`: the
    readers never take the GIL, so a prefill launched beside them is not kept waiting for it), else on a
    pool of Python threads (the same reads and checks)."""
    if _kvread is not None and READER == "c":
        counts = [len(cs) for *_, cs in reqs]
        ends = np.cumsum(counts, dtype=np.int64)
        packed = np.array([(off, at, n, e - c, e) for (off, at, n, _), c, e in zip(reqs, counts, ends)], np.int64)
        checks = np.array([(a, b, h.checksums[k]) for *_, cs in reqs for k, a, b in cs], np.int64)
        return _kvread.read_checked(fd, memoryview(dst).cast("B"), packed.tobytes(), checks.tobytes(),
                                    threads) == 0

    def one(req) -> bool:
        off, at, n, checks = req
        # straight into the destination buffer: one copy out of the page cache, no fresh pages
        if not pread_into(fd, memoryview(dst[at:at + n]).cast("B"), off):
            return False
        # crc32c checksums a writable buffer in place, without the GIL (google_crc32c takes only bytes)
        return all(crc32c.crc32c(memoryview(dst[a:b]).cast("B")) == h.checksums[k] for k, a, b in checks)

    if threads <= 1 or len(reqs) <= 1:  # one request (a small KV): a hand-off would cost more than the read
        return all(map(one, reqs))
    return all(list(reader_pool(threads).map(one, reqs)))  # list: every read has landed before we return


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def reader_pool(threads: int) -> ThreadPoolExecutor:
    """One lasting reader pool per size: a restore starts no threads."""
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="kv-read")
        return _pools[threads]


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy `host` to the GPU on a side stream and wait for it. The destination is allocated on that stream,
    so the copy waits for nothing queued on the device's current stream (beside a split, the head's
    prefill) and runs while it does; `record_stream` then tells the caching allocator that the current
    stream uses the buffer from here on, so its memory is not handed out again before that stream is done.
    The cost: once freed, that memory stays cached in the side stream's pool (for the next upload), not in
    the engine's, until `torch.cuda.empty_cache()`: up to the largest KV one read uploads."""
    stream = _upload_streams.get(device)
    if stream is None:
        stream = _upload_streams[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        buf = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        buf.copy_(host, non_blocking=True)
    stream.synchronize()
    buf.record_stream(torch.cuda.current_stream(device))
    return buf


class SnapshotFile:
    """An open local snapshot whose header is validated: `read(start)` reads and checks the KV of the tokens
    from `start` (a multiple of `block_tokens`) on."""

    def __init__(self, fd: int, header: SnapshotHeader, resident: float):
        self.fd, self.header, self.resident = fd, header, resident  # the fraction in the page cache at open
        self.read_s: float | None = None  # the last read's reads and checks (`read`)
        self.bytes_per_token = sum(H * D * _ITEMSIZE[code] for code, (H, _, D), _ in header.tensors.values())

    @property
    def token_count(self) -> int:
        return self.header.token_count

    @property
    def block_tokens(self) -> int:
        return self.header.block_tokens

    def cached(self) -> bool:
        """Whether the file was in the page cache when it was opened, before its header was read (at least
        CACHED_FRACTION of its pages): a snapshot written or read whole on this machine moments ago reads at
        memory speed."""
        return self.resident >= CACHED_FRACTION

    def cold(self) -> bool:
        """Whether at most COLD_FRACTION of it was: it reads at the disk's speed. A snapshot neither cached
        nor cold (a split resume read its tails only) reads at neither."""
        return self.resident <= COLD_FRACTION

    def read(self, start: int = 0, device: torch.device | str = "cpu", threads: int = 32) -> dict[str, torch.Tensor]:
        """The KV of tokens [start, token_count), each tensor [H, token_count - start, D], on `device`; read
        in parallel straight into a buffer (page-locked when going to a GPU), each piece checksummed as it
        lands, then uploaded once. SnapshotRejected on a short file, a checksum mismatch or a read that fails. `read_s`: the
        seconds its reads and checks took, without the upload (a copy on a side stream, beside whatever the
        device's current stream runs: a split's prefill)."""
        h = self.header
        if start < 0 or start % h.block_tokens or (start and start >= h.token_count):
            raise ValueError(f"read from token {start}: not a block boundary before {h.token_count}")
        layout, nbytes = _tail_layout(h, start)
        reqs = _read_requests(h, start, layout)
        device = torch.device(device)
        cuda = device.type == "cuda"
        with _staging_lock if cuda else contextlib.nullcontext():
            t = time.perf_counter()
            host = _staging_buffer(nbytes) if cuda else torch.empty(nbytes, dtype=torch.uint8)
            try:
                ok = _read_checked(self.fd, host.numpy(), h, reqs, threads)
            except OSError as exc:  # an I/O error (a failing disk, a shared file system gone stale)
                raise SnapshotRejected("unreadable", f"read failed ({exc})") from None
            self.read_s = time.perf_counter() - t
            if not ok:
                raise SnapshotRejected("corrupt", "checksum mismatch")
            return _views(_upload(host, device) if cuda else host, layout)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


CACHED_FRACTION = 0.9  # of a snapshot's pages in the page cache: read at memory speed (`SnapshotFile.cached`)
COLD_FRACTION = 0.1  # at most this much: read at the disk's speed (`SnapshotFile.cold`)


def _resident_fraction(fd: int, size: int) -> float:
    """The fraction of the file's pages in the page cache (`mincore`, through the C reader's module), or,
    without it, 1.0 or 0.0 by whether its last byte reads without blocking (`RWF_NOWAIT`; 0.0 where
    unsupported). Asked before anything of the file is read."""
    if size == 0:
        return 0.0
    if _kvread is not None:
        try:
            resident, pages = _kvread.resident(fd, size)
            return resident / pages
        except OSError:
            pass
    if not hasattr(os, "RWF_NOWAIT"):
        return 0.0
    try:
        return float(os.preadv(fd, [bytearray(1)], size - 1, os.RWF_NOWAIT) == 1)
    except OSError:
        return 0.0


def open_file(path: str | Path, traj_id: str, wal_tokens: list[int], policy_version: int, fingerprint: str,
              dtype: torch.dtype) -> SnapshotFile:
    """Open a local snapshot and validate its header against the WAL and the weights (nothing of the payload
    is read yet); SnapshotRejected otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SnapshotRejected("missing", f"no snapshot for {traj_id}") from None
    except OSError as exc:
        raise SnapshotRejected("unreadable", f"cannot open the snapshot of {traj_id} ({exc})") from None
    try:
        size = os.fstat(fd).st_size
        resident = _resident_fraction(fd, size)
        head8 = os.pread(fd, 8, 0)
        if len(head8) < 8:
            raise SnapshotRejected("corrupt", "truncated before the header")
        (n,) = struct.unpack("<Q", head8)
        if n > size - 8:
            raise SnapshotRejected("corrupt", f"header of {n} bytes in a file of {size}")
        h = _parse_header(os.pread(fd, n, 8), n)
        validate(h, traj_id, wal_tokens, policy_version, fingerprint, dtype, size - h.payload_offset)
        return SnapshotFile(fd, h, resident)
    except OSError as exc:
        os.close(fd)
        raise SnapshotRejected("unreadable", f"header read failed ({exc})") from None
    except BaseException:
        os.close(fd)
        raise


def load_file(path: str | Path, traj_id: str, wal_tokens: list[int], policy_version: int, fingerprint: str,
              dtype: torch.dtype, device: torch.device | str = "cpu", threads: int = 32
              ) -> tuple[SnapshotHeader, dict[str, torch.Tensor]]:
    """The whole validated KV of a local snapshot on `device` (`open_file`, then `read(0)`)."""
    f = open_file(path, traj_id, wal_tokens, policy_version, fingerprint, dtype)
    try:
        return f.header, f.read(0, device, threads)
    finally:
        f.close()


class _Decoded:
    """A snapshot fetched and verified whole (a remote store has no partial read): `read(start)` slices it."""

    def __init__(self, header: SnapshotHeader, kv: dict[str, torch.Tensor]):
        self.header, self._kv = header, kv
        self.bytes_per_token = sum(t.shape[0] * t.shape[2] * t.element_size() for t in kv.values())
        self.token_count, self.block_tokens = header.token_count, header.block_tokens

    resident = 1.0  # in memory
    read_s = 0.0  # fetched whole when opened

    def cached(self) -> bool:
        return True

    def cold(self) -> bool:
        return False

    def read(self, start: int = 0, device: torch.device | str = "cpu", threads: int = 32) -> dict[str, torch.Tensor]:
        return {k: v[:, start:].to(device) for k, v in self._kv.items()}

    def close(self) -> None:
        self._kv = {}


NAME_BYTES = 200  # of a trajectory id's safe part in a file name: with its hash, suffix and a temp file's
                  # ".NAME.tmp.PID" the name stays under the 255 bytes of a file name (ids within keep their names)
TEMP_GRACE_S = 60.0  # a dead writer's temp file younger than this is left to its trajectory's delete (shared stores)
REMOTE_TEMP_GRACE_S = 3600.0  # a remote store's temp keys carry no pid: one older than this lost its writer


class SnapshotStore:
    """Snapshots by trajectory id under a directory or a `pyarrow.fs` URI (s3://, gs://, file://, …).

    A store that fails (a full disk, an object store that does not answer) raises OSError on a write or a
    delete, and a read of it is an `unreadable` SnapshotRejected: the WAL holds every committed token, so the
    caller counts the failure and re-prefills. A local store removes the temp files of writers killed mid-write
    (`core.atomic` names them `.NAME.tmp.PID`): a dead process's older than `TEMP_GRACE_S` when the store is
    opened, and a trajectory's own when it is deleted. A remote store removes, when opened, the temp keys of
    writes that never reached their move (`RemoteStore.put`) older than `REMOTE_TEMP_GRACE_S`."""

    def __init__(self, uri: str | Path):
        uri = str(uri)
        self.uri = uri
        self._orphans: dict[str, list[Path]] = {}  # file name -> temp files of dead writers, left at open
        if "://" in uri and not uri.startswith("file://"):
            from dataplane.remote import RemoteStore

            self._remote, self._local = RemoteStore(uri), None
            self._remote.sweep_temps("", REMOTE_TEMP_GRACE_S)
        else:
            self._local = Path(uri.removeprefix("file://"))
            fileio.makedirs(self._local)
            self._sweep_temps()

    def _name(self, traj_id: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(traj_id))
        safe = safe.encode()[:NAME_BYTES].decode(errors="ignore")  # the hash below tells ids cut here apart
        return f"{safe}-{hashlib.blake2b(str(traj_id).encode(), digest_size=4).hexdigest()}.kv.safetensors"

    def _sweep_temps(self) -> None:
        """Remove the temp files of dead writers older than `TEMP_GRACE_S`; remember the younger ones for their
        trajectory's delete. Another host's writer sharing the directory looks dead here: a live one touches its
        file more often than that."""
        now = time.time()
        with os.scandir(self._local) as entries:
            for entry in entries:
                final, pid = _temp_of(entry.name)
                if final is None or pid_alive(pid):
                    continue
                with contextlib.suppress(FileNotFoundError):  # another worker opening the store took it first
                    if now - entry.stat().st_mtime > TEMP_GRACE_S:
                        fileio.unlink(entry.path)
                    else:
                        self._orphans.setdefault(final, []).append(Path(entry.path))

    def path(self, traj_id: str) -> str:
        name = self._name(traj_id)
        return str(self._local / name) if self._local else self._remote.path(name)

    def put(self, traj_id: str, data: bytes) -> None:
        if self._local:
            write_atomic(self._local / self._name(traj_id), data)
        else:
            self._remote_call("write", traj_id, self._remote.put, self._name(traj_id), data)

    def get(self, traj_id: str) -> bytes | None:
        if self._local:
            p = self._local / self._name(traj_id)
            return p.read_bytes() if p.is_file() else None
        return self._remote_call("read", traj_id, self._remote.get, self._name(traj_id))

    def _remote_call(self, what: str, traj_id: str, fn, *args):
        """`fn(*args)` on the remote store, whatever it raises on failure (UserError, pyarrow's errors) as OSError."""
        import pyarrow as pa

        from core.errors import UserError
        try:
            return fn(*args)
        except (UserError, OSError, pa.ArrowException) as exc:
            raise OSError(errno.EIO, f"snapshot store {self.uri}: {what} of {traj_id} failed ({exc})") from None

    def load(self, traj_id: str, wal_tokens: list[int], policy_version: int, fingerprint: str, dtype: torch.dtype,
             device: torch.device | str = "cpu") -> tuple[SnapshotHeader, dict[str, torch.Tensor]]:
        """The validated KV of `traj_id` on `device`, or SnapshotRejected (missing, corrupt, mismatch, stale,
        unreadable)."""
        if self._local:
            return load_file(self._local / self._name(traj_id), traj_id, wal_tokens, policy_version, fingerprint,
                             dtype, device)
        h, kv = decode(self._fetch(traj_id), traj_id, wal_tokens, policy_version, fingerprint, dtype)
        return h, {k: v.to(device) for k, v in kv.items()}

    def open(self, traj_id: str, wal_tokens: list[int], policy_version: int, fingerprint: str,
             dtype: torch.dtype) -> "SnapshotFile | _Decoded":
        """The snapshot of `traj_id` with its header validated, ready to `read(start)`; SnapshotRejected
        (missing, corrupt, mismatch, stale, unreadable) otherwise. A remote snapshot is fetched and verified whole
        here."""
        if self._local:
            return open_file(self._local / self._name(traj_id), traj_id, wal_tokens, policy_version, fingerprint, dtype)
        return _Decoded(*decode(self._fetch(traj_id), traj_id, wal_tokens, policy_version, fingerprint, dtype))

    def _fetch(self, traj_id: str) -> bytes | None:
        """A remote snapshot's bytes (None: not there); SnapshotRejected when the store fails to answer."""
        try:
            return self.get(traj_id)
        except OSError as exc:
            raise SnapshotRejected("unreadable", f"fetch of {traj_id} failed ({exc})") from None

    def delete(self, traj_id: str) -> bool:
        """Remove the snapshot of `traj_id` (and a local one's temp files of dead writers); False when there was
        none; OSError when the store fails."""
        if not self._local:
            return self._remote_call("delete", traj_id, self._remote.delete, self._name(traj_id))
        name = self._name(traj_id)
        for tmp in self._orphans.pop(name, []):
            with contextlib.suppress(FileNotFoundError):
                fileio.unlink(tmp)
        p = self._local / name
        if p.is_file():
            fileio.unlink(p)
            return True
        return False

    def ids_on_disk(self) -> list[str]:
        """File paths of every stored snapshot (a drill picks victims from these)."""
        if self._local:
            return sorted(str(p) for p in self._local.glob("*.kv.safetensors"))
        return [self._remote.path(k) for k in self._remote.list() if k.endswith(".kv.safetensors")]


def _temp_of(name: str) -> tuple[str | None, int]:
    """(snapshot file name, writer pid) of a `core.atomic` temp file name `.NAME.tmp.PID`; (None, 0) otherwise."""
    final, sep, pid = name.removeprefix(".").rpartition(".tmp.")
    if not (name.startswith(".") and sep and final.endswith(".kv.safetensors") and pid.isdigit()):
        return None, 0
    return final, int(pid)
