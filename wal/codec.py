"""Record codec (pure): framing, CRC32C, encode and decode of every record type, segment headers.

Frame on disk::

    u32 body_len | u32 crc32c(body) | body
    body = u64 lsn | u8 type | payload
    TOKENS      payload = u64 start | u64 policy_version | u32 n | u16 id_len | id | n*i32 | n*f64
    STEP        payload = u64 policy_version | u32 n | n*u16 id_len | n*u64 start | n*i32 | n*f64 | ids
                (one decode step: token i at position start[i] of trajectory i, ids distinct)
    FINALIZE    payload = u16 id_len | id
    ENV_INVOKE  payload = u64 seq | u16 id_len | u32 data_len | id | request
    ENV_RESULT  payload = u64 seq | u16 id_len | u32 data_len | id | response
    ENV_RELEASE payload = u16 id_len | id

All integers little-endian. CRC32C from the crc32c package (hardware-accelerated where the CPU has it; it takes
any buffer, so recovery checks frames in place in the segment it read).

The first frame of each flush (the batch one group commit writes and syncs) stores
crc32c(body) XOR FLUSH_MARK instead of crc32c(body): recovery can then tell a frame written by a later
flush, which proves the flushes before it were durable, from the rest of the last flush, whose sectors
may reach the disk in any order when the power fails before its fdatasync returns.
"""
from __future__ import annotations

import struct
import sys
from array import array
from typing import Iterator

import crc32c as _crc32c
import numpy as np

from wal.types import (
    ENV_INVOKE,
    LOGPROB_DTYPE,
    TOKEN_DTYPE,
    ENV_RELEASE,
    ENV_RESULT,
    FINALIZE,
    LOGPROB_BYTES,
    TOKEN_BYTES,
    RECORD_TYPES,
    STEP,
    TOKENS,
    EnvInvokeRecord,
    EnvReleaseRecord,
    EnvResultRecord,
    FinalizeRecord,
    Record,
    Starts,
    StepRecord,
    TokensRecord,
)

FRAME = struct.Struct("<II")
BODY = struct.Struct("<QB")
TOKENS_HEAD = struct.Struct("<QQIH")
STEP_HEAD = struct.Struct("<QI")
ID_HEAD = struct.Struct("<H")
ENV_HEAD = struct.Struct("<QHI")
MAX_BODY_BYTES = 64 << 20
MAX_ID_BYTES = 1024
MAX_LSN_JUMP = 1 << 40  # resync sanity bound: a valid frame's lsn is close to the last good one

SEGMENT_MAGIC = b"PTWALSG1"
RECYCLED_MAGIC = b"PTWALSR1"  # a segment written over a reclaimed one: frames of lower lsns may follow its end
SEGMENT_HEAD = struct.Struct("<8sQI")  # magic, base lsn, crc32c(magic + base)
SEGMENT_HEAD_BYTES = SEGMENT_HEAD.size

crc32c = _crc32c.crc32c
FLUSH_MARK = 0x5F4C5553  # XORed into the stored checksum of a flush's first frame
_I32_MAX = (1 << 31) - 1
U64_LIMIT = 1 << 64  # policy versions and positions are stored as u64


def ids_within(ids, start: int, room: int) -> int:
    """The end of the run of `ids` from `start` whose UTF-8 (and a few bytes of framing each) fits `room`
    bytes, at least one id past `start`: how many ids one message of a bounded size carries."""
    end = start
    while end < len(ids):
        room -= len(_id_bytes(ids[end], "traj_id")) + 4
        if end > start and room < 0:
            break
        end += 1
    return end


def check_u64(value: int, what: str) -> int:
    """`value` (an integer) if it fits a record's u64 field, else CodecError naming the field."""
    if not 0 <= value < U64_LIMIT:
        raise CodecError(f"{what} must lie in 0..2**64-1, got {value}")
    return value
_I64_MAX = (1 << 63) - 1
_SMALL = 64  # lists up to this length are packed with the array module
_LITTLE = sys.byteorder == "little"
_TOKEN_NP = np.dtype(TOKEN_DTYPE)
_LOGPROB_NP = np.dtype(LOGPROB_DTYPE)


def _has_negative(x: np.ndarray) -> bool:
    """Whether non-empty integer `x` holds a negative: its smallest element, found by argmin (0.3 us at 512
    int32, a fifth of a ufunc reduction's `min`, whose set-up dominates at this size)."""
    return x[x.argmin()] < 0


def _has_nan(x: np.ndarray) -> bool:
    """Whether non-empty float64 `x` holds a NaN: argmin returns the first NaN where there is one (0.35 us at
    512, a third of isnan + any). A dot product x . x was as fast but overflowed, with a warning, on
    values past 1e154, and handed the work to BLAS."""
    v = x[x.argmin()]
    return v != v


class CodecError(ValueError):
    """A record cannot be encoded (bad id, too large) or a frame does not decode."""


def _id_bytes(name: str, what: str) -> bytes:
    if not isinstance(name, str) or not name:
        raise CodecError(f"{what} must be a non-empty string, got {name!r}")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise CodecError(f"{what} {name!r} is not valid Unicode ({exc.reason} at {exc.start})") from None
    if len(raw) > MAX_ID_BYTES:
        raise CodecError(f"{what} is {len(raw)} bytes in UTF-8; the limit is {MAX_ID_BYTES}")
    return raw


def _frame(body: bytes, mark: int = 0) -> bytes:
    """The frame of `body`; mark=FLUSH_MARK for the first frame of a flush (see the module docstring)."""
    if len(body) > MAX_BODY_BYTES:
        raise CodecError(f"record body of {len(body)} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
    return FRAME.pack(len(body), crc32c(body) ^ mark) + body


def encode_tokens(lsn: int, traj_id: str, start: int, policy_version: int, tokens: bytes, logprobs: bytes,
                  mark: int = 0) -> bytes:
    return encode_tokens_id(lsn, _id_bytes(traj_id, "traj_id"), start, policy_version, tokens, logprobs, mark)


def encode_tokens_id(lsn: int, tid: bytes, start: int, policy_version: int, tokens: bytes, logprobs: bytes,
                     mark: int = 0) -> bytes:
    """encode_tokens with the trajectory id already checked and encoded (UTF-8)."""
    n = len(tokens) // TOKEN_BYTES
    if len(tokens) != n * TOKEN_BYTES or len(logprobs) != n * LOGPROB_BYTES:
        raise CodecError(f"packed tokens ({len(tokens)} B) and logprobs ({len(logprobs)} B) do not describe the same count")
    if start < 0 or policy_version < 0:
        raise CodecError(f"start ({start}) and policy_version ({policy_version}) must be >= 0")
    return _frame(b"".join((BODY.pack(lsn, TOKENS), TOKENS_HEAD.pack(start, policy_version, n, len(tid)), tid, tokens, logprobs)),
                  mark)


def encode_step_record(lsn: int, ids: list[bytes], starts: bytes, policy_version: int, tokens: bytes,
                       logprobs: bytes, mark: int = 0) -> bytes:
    """A STEP frame: one decode step of len(ids) trajectories (ids UTF-8 and distinct; starts packed u64,
    tokens and log-probs packed, one each per id). A few joins and one checksum, whatever the batch."""
    n = len(ids)
    if len(starts) != n * 8 or len(tokens) != n * TOKEN_BYTES or len(logprobs) != n * LOGPROB_BYTES:
        raise CodecError(f"step record: {n} ids but {len(starts)} B of starts, {len(tokens)} B of tokens, "
                         f"{len(logprobs)} B of logprobs")
    lens = array("H", map(len, ids))
    if not _LITTLE:
        lens.byteswap()
    return _frame(b"".join((BODY.pack(lsn, STEP), STEP_HEAD.pack(policy_version, n), lens.tobytes(), starts, tokens,
                            logprobs, *ids)), mark)


def encode_step_blob(lsn: int, n: int, lens: bytes, ids_blob: bytes, starts: bytes, policy_version: int, tokens: bytes,
                     logprobs: bytes, mark: int = 0) -> bytes:
    """encode_step_record with the ids already laid out (`lens`: n packed u16 id lengths, `ids_blob`: the
    ids joined), as a run of steps over the same trajectories reuses them. Same bytes."""
    if (len(lens) != 2 * n or len(starts) != n * 8 or len(tokens) != n * TOKEN_BYTES
            or len(logprobs) != n * LOGPROB_BYTES):
        raise CodecError(f"step record: {n} ids but {len(lens)} B of id lengths, {len(starts)} B of starts, "
                         f"{len(tokens)} B of tokens, {len(logprobs)} B of logprobs")
    return _frame(b"".join((BODY.pack(lsn, STEP), STEP_HEAD.pack(policy_version, n), lens, starts, tokens, logprobs,
                            ids_blob)), mark)


def positions_bytes(positions) -> bytes:
    """Integer numpy positions as packed little-endian u64 without the range check (a caller that finds
    them equal to known-good positions needs none; anything else goes through pack_positions)."""
    if isinstance(positions, np.ndarray) and positions.ndim == 1 and positions.dtype.kind == "i":
        return positions.astype("<i8", copy=False).tobytes()
    return pack_positions(positions)


def pack_positions(positions) -> bytes:
    """Positions (ints, numpy integers) -> packed little-endian u64; floats, negatives and bytes refused."""
    if isinstance(positions, (bytes, bytearray, memoryview, str)):
        raise CodecError("positions must be a sequence of ints")
    if isinstance(positions, np.ndarray) and positions.ndim == 1 and positions.dtype.kind in "iu":
        if positions.size and (positions.min() < 0 or (positions.dtype.kind == "u" and positions.max() > _I64_MAX)):
            raise CodecError(f"positions must be integers in 0..2^63-1, got {positions.min()}..{positions.max()}")
        return positions.astype("<i8", copy=False).tobytes()
    try:
        arr = array("q", positions)
    except (TypeError, OverflowError) as exc:
        raise CodecError(f"positions must be integers in 0..2^63-1: {exc}") from None
    if arr and (min(arr) < 0 if len(arr) <= _SMALL else _has_negative(np.frombuffer(arr, np.int64))):
        raise CodecError(f"positions must be >= 0, got {min(arr)}")
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def encode_finalize(lsn: int, traj_id: str, mark: int = 0) -> bytes:
    tid = _id_bytes(traj_id, "traj_id")
    return _frame(BODY.pack(lsn, FINALIZE) + ID_HEAD.pack(len(tid)) + tid, mark)


def _encode_env(kind: int, lsn: int, sandbox_id: str, seq: int, data: bytes, mark: int = 0) -> bytes:
    if seq < 0:
        raise CodecError(f"seq must be >= 0, got {seq}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"environment payload must be bytes, got {type(data).__name__}")
    sid = _id_bytes(sandbox_id, "sandbox_id")
    return _frame(b"".join((BODY.pack(lsn, kind), ENV_HEAD.pack(seq, len(sid), len(data)), sid, bytes(data))), mark)


def encode_env_invoke(lsn: int, sandbox_id: str, seq: int, request: bytes, mark: int = 0) -> bytes:
    return _encode_env(ENV_INVOKE, lsn, sandbox_id, seq, request, mark)


def encode_env_result(lsn: int, sandbox_id: str, seq: int, response: bytes, mark: int = 0) -> bytes:
    return _encode_env(ENV_RESULT, lsn, sandbox_id, seq, response, mark)


def encode_env_release(lsn: int, sandbox_id: str, mark: int = 0) -> bytes:
    sid = _id_bytes(sandbox_id, "sandbox_id")
    return _frame(BODY.pack(lsn, ENV_RELEASE) + ID_HEAD.pack(len(sid)) + sid, mark)


def encode(record: Record, lsn: int | None = None, mark: int = 0) -> bytes:
    """Encode a decoded record again (compaction copies records forward under a new lsn)."""
    lsn = record.lsn if lsn is None else lsn
    if isinstance(record, TokensRecord):
        return encode_tokens(lsn, record.traj_id, record.start, record.policy_version, record.tokens, record.logprobs, mark)
    if isinstance(record, StepRecord):
        starts = array("q", record.starts)
        if not _LITTLE:
            starts.byteswap()
        return encode_step_record(lsn, [_id_bytes(t, "traj_id") for t in record.traj_ids], starts.tobytes(),
                                  record.policy_version, bytes(record.tokens), bytes(record.logprobs), mark)
    if isinstance(record, FinalizeRecord):
        return encode_finalize(lsn, record.traj_id, mark)
    if isinstance(record, EnvInvokeRecord):
        return encode_env_invoke(lsn, record.sandbox_id, record.seq, record.request, mark)
    if isinstance(record, EnvResultRecord):
        return encode_env_result(lsn, record.sandbox_id, record.seq, record.response, mark)
    if isinstance(record, EnvReleaseRecord):
        return encode_env_release(lsn, record.sandbox_id, mark)
    raise CodecError(f"not a record: {record!r}")


def decode_body(body: bytes, ids_cache: list | None = None) -> Record:
    """Decode a checksum-verified body (bytes, or a read-only memoryview of a segment read whole); raises
    CodecError when its inner lengths do not add up. Token and log-prob payloads are zero-copy views of
    `body`; ids and environment payloads are copied out. `ids_cache`: see _decode_step."""
    if len(body) < BODY.size:
        raise CodecError("body shorter than its header")
    lsn, kind = BODY.unpack_from(body, 0)
    off = BODY.size
    try:
        if kind == TOKENS:
            start, version, n, id_len = TOKENS_HEAD.unpack_from(body, off)
            off += TOKENS_HEAD.size
            tok_end = off + id_len + n * TOKEN_BYTES
            if tok_end + n * LOGPROB_BYTES != len(body):
                raise CodecError("tokens record length mismatch")
            traj = str(body[off:off + id_len], "utf-8")
            view = memoryview(body)  # zero-copy slices; each record's views pin only its own body
            return TokensRecord(lsn, traj, start, version, view[off + id_len:tok_end], view[tok_end:])
        if kind == STEP:
            return _decode_step(body, lsn, off, ids_cache)
        if kind in (FINALIZE, ENV_RELEASE):
            (id_len,) = ID_HEAD.unpack_from(body, off)
            if off + ID_HEAD.size + id_len != len(body):
                raise CodecError("finalize/release record length mismatch")
            return (FinalizeRecord if kind == FINALIZE else EnvReleaseRecord)(lsn, str(body[off + ID_HEAD.size:], "utf-8"))
        if kind in (ENV_INVOKE, ENV_RESULT):
            seq, id_len, data_len = ENV_HEAD.unpack_from(body, off)
            off += ENV_HEAD.size
            if off + id_len + data_len != len(body):
                raise CodecError("environment record length mismatch")
            sid = str(body[off:off + id_len], "utf-8")
            data = bytes(body[off + id_len:])
            return (EnvInvokeRecord if kind == ENV_INVOKE else EnvResultRecord)(lsn, sid, seq, data)
    except (struct.error, UnicodeDecodeError) as exc:
        raise CodecError(f"malformed body: {exc}") from None
    raise CodecError(f"unknown record type {kind}")


def _decode_step(body: bytes, lsn: int, off: int, ids_cache: list | None = None) -> StepRecord:
    """`ids_cache`: [lengths bytes, ids bytes, ids tuple] of the last STEP record a scan decoded. A run of
    steps over the same trajectories carries the same id bytes in every record: they are then checked and
    decoded once, and the records share one tuple of ids (recovery's replay relies on that identity)."""
    version, n = STEP_HEAD.unpack_from(body, off)
    off += STEP_HEAD.size
    starts_at = off + 2 * n
    tok_at = starts_at + 8 * n
    lp_at = tok_at + TOKEN_BYTES * n
    ids_at = lp_at + LOGPROB_BYTES * n
    if ids_at > len(body):
        raise CodecError("step record length mismatch")
    starts = bytes(body[starts_at:tok_at])
    if n and _has_negative(np.frombuffer(starts, "<i8")):
        raise CodecError("step record length mismatch")
    lens_raw, ids_raw = bytes(body[off:starts_at]), bytes(body[ids_at:])
    if ids_cache is not None and ids_cache[1] == ids_raw and ids_cache[0] == lens_raw:
        ids = ids_cache[2]
    else:
        lens = array("H")
        lens.frombytes(lens_raw)
        if not _LITTLE:
            lens.byteswap()
        if sum(lens) != len(ids_raw):
            raise CodecError("step record length mismatch")
        names, at = [], 0
        for k in lens:
            names.append(str(ids_raw[at:at + k], "utf-8"))
            at += k
        if len(set(names)) != n:
            raise CodecError("step record names a trajectory twice")
        ids = tuple(names)
        if ids_cache is not None:
            ids_cache[:] = [lens_raw, ids_raw, ids]
    view = memoryview(body)
    return StepRecord(lsn, version, ids, Starts(starts), view[tok_at:lp_at], view[lp_at:ids_at])


def decode(frame: bytes) -> Record:
    """Decode exactly one frame (tests and tools); raises CodecError on any damage."""
    rec, end, err = read_frame(frame, 0, None)
    if err is not None:
        raise CodecError(err)
    if end != len(frame):
        raise CodecError(f"{len(frame) - end} trailing bytes after the frame")
    return rec


def starts_flush(buf, off: int) -> bool:
    """Whether the (valid) frame at `off` is the first frame of a flush."""
    body_len, crc = FRAME.unpack_from(buf, off)
    return crc32c(buf[off + FRAME.size:off + FRAME.size + body_len]) ^ FLUSH_MARK == crc


def read_frame(buf: bytes, off: int, expect_lsn: int | None) -> tuple[Record | None, int, str | None]:
    """Decode the frame at `off`: (record, end offset, None) or (None, off, why it is bad)."""
    if off + FRAME.size > len(buf):
        return None, off, "incomplete frame header"
    body_len, crc = FRAME.unpack_from(buf, off)
    if body_len < BODY.size or body_len > MAX_BODY_BYTES:
        return None, off, f"implausible body length {body_len}"
    end = off + FRAME.size + body_len
    if end > len(buf):
        return None, off, f"frame of {body_len} bytes runs past the end of the segment"
    body = buf[off + FRAME.size:end]
    c = crc32c(body)
    if c != crc and c ^ FLUSH_MARK != crc:
        return None, off, "checksum mismatch"
    try:
        rec = decode_body(body)
    except CodecError as exc:
        return None, off, str(exc)
    if expect_lsn is not None and rec.lsn != expect_lsn:
        return None, off, f"lsn {rec.lsn} where {expect_lsn} was expected"
    return rec, end, None


def scan_frames(buf, off: int, expect_lsn: int, on_record) -> tuple[int, int]:
    """Recovery's hot loop: decode good frames with consecutive lsns from `off`, calling on_record(rec);
    returns (offset where the good frames end, how many). Same checks as read_frame, inlined."""
    n = len(buf)
    count = 0
    unpack_frame, unpack_body = FRAME.unpack_from, BODY.unpack_from
    head = FRAME.size
    ids_cache: list = [None, None, None]
    while off + head <= n:
        body_len, crc = unpack_frame(buf, off)
        end = off + head + body_len
        if body_len < BODY.size or body_len > MAX_BODY_BYTES or end > n:
            break
        body = buf[off + head:end]
        c = crc32c(body)
        if (c != crc and c ^ FLUSH_MARK != crc) or unpack_body(body, 0)[0] != expect_lsn:
            break
        try:
            rec = decode_body(body, ids_cache)
        except CodecError:
            break
        on_record(rec)
        count += 1
        expect_lsn += 1
        off = end
    return off, count


def iter_frames(buf: bytes, off: int, expect_lsn: int | None) -> Iterator[tuple[int, Record]]:
    """Yield (offset, record) while frames are good and lsns consecutive; stops at the first bad one."""
    while off < len(buf):
        rec, end, err = read_frame(buf, off, expect_lsn)
        if err is not None:
            return
        yield off, rec
        off = end
        expect_lsn = rec.lsn + 1


def find_valid_after(buf, off: int, last_lsn: int, stop: int | None = None, dense: bool = False) -> int | None:
    """The first offset > `off` (and < `stop`, when given) where a checksum-valid frame with a later lsn
    starts, else None. (A frame starting at or after the last non-zero byte has a zero length: invalid.)

    Used to tell a torn tail (nothing valid follows) from corruption in the middle (valid records
    follow the bad one)."""
    return next(valid_frames_after(buf, off, last_lsn, stop, dense), None)


def valid_frames_after(buf, off: int, last_lsn: int, stop: int | None = None, dense: bool = False) -> Iterator[int]:
    """Every offset > `off` (and < `stop`), ascending, where a checksum-valid frame with an lsn above
    `last_lsn` starts. Vectorised header checks (the lsn within reach of `last_lsn`, a known record type, a
    length that fits) leave few offsets for the checksum, also across megabytes of a recycled segment's
    stale frames (whose lsns are lower). `dense`: the lsns after `last_lsn` are consecutive (a segment),
    so a valid frame's lsn is at most one per smallest frame above it."""
    hi = len(buf) - FRAME.size - BODY.size + 1
    for p in _frame_candidates(buf, off + 1, hi if stop is None else min(hi, stop), last_lsn, dense):
        if read_frame(buf, p, None)[2] is None:
            yield p


def _frame_candidates(buf, lo: int, hi: int, last_lsn: int, dense: bool):
    """Offsets p in [lo, hi), ascending, where a frame header with an lsn in (last_lsn, last_lsn + jump], a
    known record type and a body that fits could start (jump: MAX_LSN_JUMP, or when `dense` how many of
    the smallest frames fit in the rest of the buffer); yielded per 1 MiB, so an early hit ends the search."""
    n = len(buf)
    if hi <= lo:
        return
    jump = min(MAX_LSN_JUMP, (n - lo) // (FRAME.size + BODY.size) + 1) if dense else MAX_LSN_JUMP
    data = np.frombuffer(buf, dtype=np.uint8)
    kinds = np.zeros(256, dtype=bool)
    kinds[list(RECORD_TYPES)] = True
    chunk = 1 << 20
    for start in range(lo, hi, chunk):
        end = min(hi, start + chunk)
        found = []
        for r in range(8):  # the u64 lsn at p + 8 read at each of the eight alignments
            q = start + FRAME.size + r
            count = (end - start - r + 7) // 8
            if count <= 0:
                continue
            lsn = np.frombuffer(buf, dtype="<u8", count=count, offset=q)
            ok = np.flatnonzero(lsn - np.uint64(last_lsn + 1) < np.uint64(jump))  # lower lsns wrap around: huge
            if ok.size:
                found.append(start + r + 8 * ok)
        if not found:
            continue
        ps = np.sort(np.concatenate(found))
        ps = ps[kinds[data[ps + FRAME.size + 8]]]
        body = (data[ps].astype(np.int64) | data[ps + 1].astype(np.int64) << 8 | data[ps + 2].astype(np.int64) << 16
                | data[ps + 3].astype(np.int64) << 24)
        ps = ps[(body >= BODY.size) & (body <= MAX_BODY_BYTES) & (ps + FRAME.size + body <= n)]
        yield from ps.tolist()


def later_flush_after(buf, off: int, lsn: int, stop: int | None = None) -> int | None:
    """The offset of the first valid frame after `off` (before `stop`) that starts a flush and has an lsn
    above `lsn`, else None. Such a frame was written after the flush holding `lsn` was durable."""
    while True:
        p = find_valid_after(buf, off, lsn, stop, dense=True)
        if p is None:
            return None
        prev = lsn
        while stop is None or p < stop:
            rec, end, err = read_frame(buf, p, None)
            if err is not None or not prev < rec.lsn <= prev + MAX_LSN_JUMP:
                break
            if starts_flush(buf, p):
                return p
            prev, p = rec.lsn, end
        off = p


def encode_segment_header(base_lsn: int, recycled: bool = False) -> bytes:
    magic = RECYCLED_MAGIC if recycled else SEGMENT_MAGIC
    return SEGMENT_HEAD.pack(magic, base_lsn, crc32c(magic + struct.pack("<Q", base_lsn)))


def segment_header(buf) -> tuple[int, bool]:
    """(base lsn, recycled) of a segment; raises CodecError when the header is short or damaged."""
    if len(buf) < SEGMENT_HEAD_BYTES:
        raise CodecError(f"segment header is {len(buf)} bytes, expected {SEGMENT_HEAD_BYTES}")
    magic, base, crc = SEGMENT_HEAD.unpack_from(buf, 0)
    if magic not in (SEGMENT_MAGIC, RECYCLED_MAGIC) or crc32c(buf[:16]) != crc:
        raise CodecError("segment header damaged (bad magic or checksum)")
    return base, magic == RECYCLED_MAGIC


def decode_segment_header(buf) -> int:
    """The base lsn of a segment; raises CodecError when the header is short or damaged."""
    return segment_header(buf)[0]


def pack_tokens(tokens) -> bytes:
    """Token ids (list, array or numpy integers) -> packed little-endian int32; rejects non-integers and ids outside 0..2^31-1."""
    if type(tokens) is np.ndarray and tokens.dtype == _TOKEN_NP and tokens.ndim == 1:  # what a decode loop holds
        if tokens.size and _has_negative(tokens):
            raise CodecError(f"token ids must lie in 0..{_I32_MAX}, got {int(tokens.min())}..{int(tokens.max())}")
        return tokens.tobytes()
    if type(tokens) is list:  # Python lists: the array module converts them faster than numpy
        try:
            packed = array("i", tokens)
        except (TypeError, OverflowError):
            packed = None  # let the numpy path produce the precise error
        if packed is not None and (not tokens or (min(packed) >= 0 if len(packed) <= _SMALL
                                                  else not _has_negative(np.frombuffer(packed, np.int32)))):
            if not _LITTLE:
                packed.byteswap()
            return packed.tobytes()
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raise CodecError("tokens must be a sequence of ints, not bytes")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        if arr.size == 0:
            return b""
        raise CodecError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise CodecError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype == _TOKEN_NP:  # int32 LE: only negatives are out of range
        if arr.min() < 0:
            raise CodecError(f"token ids must lie in 0..{_I32_MAX}, got {int(arr.min())}..{int(arr.max())}")
        return arr.tobytes()
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _I32_MAX:
        raise CodecError(f"token ids must lie in 0..{_I32_MAX}, got {lo}..{hi}")
    return arr.astype(TOKEN_DTYPE).tobytes()


def pack_logprobs(logprobs, n: int) -> bytes:
    """Log-probs -> packed little-endian float64; exactly `n` of them, no NaN."""
    if type(logprobs) is np.ndarray and logprobs.dtype == _LOGPROB_NP and logprobs.ndim == 1 and logprobs.size == n:
        if n and _has_nan(logprobs):
            raise CodecError("logprobs contain NaN")
        return logprobs.tobytes()
    if type(logprobs) is list and len(logprobs) == n:
        try:
            packed = array("d", logprobs)
        except TypeError:
            packed = None
        if packed is not None and (all(x == x for x in packed) if n <= _SMALL  # x != x only for NaN
                                   else not _has_nan(np.frombuffer(packed, np.float64))):
            if not _LITTLE:
                packed.byteswap()
            return packed.tobytes()
    if isinstance(logprobs, (bytes, bytearray, memoryview)):
        raise CodecError("logprobs must be a sequence of floats, not bytes")
    try:
        raw = np.asarray(logprobs)
        if raw.size and raw.dtype.kind not in "fiu":  # strings, bytes, None: never parsed as numbers
            raise CodecError(f"logprobs must be floats, got dtype {raw.dtype}")
        arr = raw.astype(LOGPROB_DTYPE)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"logprobs must be floats: {exc}") from None
    if arr.ndim != 1 and arr.size:
        raise CodecError(f"logprobs must be one-dimensional, got shape {arr.shape}")
    if arr.size != n:
        raise CodecError(f"got {arr.size} logprobs for {n} tokens; there must be one per token")
    if n and _has_nan(arr):
        raise CodecError("logprobs contain NaN")
    return arr.tobytes()


def check_packed(tokens: bytes, logprobs: bytes) -> int:
    """Packed tokens (int32 LE) and log-probs (float64 LE) as they travel: one log-prob per token, ids
    in 0..2^31-1, no NaN. Returns the token count (the check `pack_tokens` / `pack_logprobs` make)."""
    n = len(tokens) // TOKEN_BYTES
    if len(tokens) != n * TOKEN_BYTES or len(logprobs) != n * LOGPROB_BYTES:
        raise CodecError(f"{len(tokens)} bytes of tokens and {len(logprobs)} bytes of logprobs: want 4 bytes "
                         "(int32 LE) per token and 8 (float64 LE) per log-prob")
    if n:
        if _has_negative(np.frombuffer(tokens, TOKEN_DTYPE)):
            raise CodecError(f"token ids must lie in 0..{_I32_MAX}, got a negative one")
        if _has_nan(np.frombuffer(logprobs, LOGPROB_DTYPE)):
            raise CodecError("logprobs contain NaN")
    return n


def unpack_tokens(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=TOKEN_DTYPE).tolist()


def unpack_logprobs(data: bytes) -> list[float]:
    return np.frombuffer(data, dtype=LOGPROB_DTYPE).tolist()
