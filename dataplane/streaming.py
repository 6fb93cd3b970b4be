"""Streaming loader: iterate a plan one minibatch at a time for one rank, reading only the rows and
token ranges it names into packed torch tensors. A shard's footer is parsed through the map once at
open, its ids and row offsets copied out and the map's pages dropped; heavy ranges are `pread` from the
file straight into reused output buffers (local stores: the page cache copies once, no page of the map
is touched while building) or copied from the in-memory batch (remote stores). Token ids are gathered
as stored (int32) and widened to int64 in one pass per minibatch; a row's crc32c is checked over the
very bytes delivered. Background threads (two by default; numpy,
`pread` and crc32c release the GIL) build the next minibatches; at most `prefetch` + 1 minibatches
are alive (the one in use, the ones ahead and those being built), output buffers are reused once
released, no shard page stays mapped, and the rest of a split row is read to verify it in fixed-size
chunks, so peak memory stays near two minibatches whatever the dataset size."""
from __future__ import annotations

import os
import queue
import sys
import threading
from collections import OrderedDict

import google_crc32c
import numpy as np
import torch

from dataplane.codec import CORE_DTYPES, EXTRA_PREFIX, decode
from dataplane.errors import ChecksumError, DataPlaneError, StaleRowError
from dataplane.store import MappedShard, ShardStore
from dataplane.types import Batch, Plan

_END = object()
VERIFY_CHUNK_BYTES = 1 << 20  # rest of a split row, read only to check its checksum, in chunks of this size


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _ShardIndex:
    """What the loader needs of one open shard, copied out of the map once at open so a build never
    touches the map again: the id column (offsets + bytes), each heavy column's row offsets, the column
    specs, and a `RangeReader`. These copies are O(rows), the same whatever the token count."""

    def __init__(self, shard: MappedShard):
        id_col, cols = decode(shard.batch)
        wrong = [n for n, dt in CORE_DTYPES.items() if n not in cols or cols[n].spec.dtype != dt]
        if wrong:  # a damaged schema can rename a column or change its type and still parse
            raise ValueError(f"core columns {wrong} missing or of another type")
        _, id_off, id_data = id_col.buffers()
        off = np.frombuffer(id_off, dtype=np.int32)[id_col.offset:id_col.offset + len(id_col) + 1]
        self.n_rows = len(id_col)
        self.id_off = off.astype(np.int64)
        lo, hi = (int(off[0]), int(off[-1])) if self.n_rows else (0, 0)
        self.id_u8 = np.frombuffer(id_data, dtype=np.uint8)[lo:hi].copy() if hi > lo else np.zeros(0, np.uint8)
        self.id_off -= lo
        self.offsets = {n: np.array(c.offsets, dtype=np.int64) for n, c in cols.items()}
        self.cols = cols  # specs; values (views of the map) are read only by stores that cannot `pread`
        self.reader = RangeReader(shard, cols)


class OpenShards:
    """Shards kept open across minibatches (LRU, at most `capacity`), decoded once. Everything a build
    reads of a shard's layout (ids, offsets) is copied out at open and the map's pages are dropped right
    then; heavy ranges are `pread`, so a build maps no shard page at all and RSS does not grow with the
    number of shards a minibatch touches. Stores that cannot map (remote) keep nothing open."""

    def __init__(self, store: ShardStore, capacity: int = 64):
        self.store = store
        self.capacity = capacity if store.use_mmap else 0
        self.open: OrderedDict[str, tuple[MappedShard, _ShardIndex]] = OrderedDict()

    def get(self, rel: str, who: str) -> _ShardIndex:
        if rel in self.open:
            self.open.move_to_end(rel)
            return self.open[rel][1]
        shard = self.store.map(rel, who)
        try:
            index = _ShardIndex(shard)
        except DataPlaneError:
            shard.close()
            raise
        except Exception as exc:  # a footer that parses as Arrow but not as our columns: damage the file check missed
            shard.close()
            raise ChecksumError(f"shard file {self.store.full_path(rel)} (needed by {who}) is not a readable shard "
                                f"(corrupt or truncated): {type(exc).__name__}: {exc}") from None
        except BaseException:
            shard.close()
            raise
        if index.reader.fd is not None:
            shard.drop_pages()  # footer, ids and offsets are copied: nothing of the map is needed resident
        self.open[rel] = (shard, index)
        return index

    def trim(self) -> None:
        """After a minibatch: close the least recently used shards beyond `capacity`."""
        while len(self.open) > self.capacity:
            _, (shard, index) = self.open.popitem(last=False)
            del index
            shard.close()

    def close(self) -> None:
        while self.open:
            _, (shard, index) = self.open.popitem(last=False)
            del index
            shard.close()


def _ro_u8(arr: np.ndarray) -> np.ndarray:
    """Read-only uint8 view (what google_crc32c accepts without a copy)."""
    v = arr.reshape(-1).view(np.uint8)
    v.flags.writeable = False
    return v


class RangeReader:
    """Reads token ranges [lo, hi) (absolute rows of the column) of one shard's heavy columns into a
    caller's contiguous buffer: `pread` at the column's file offset where the shard is a local file,
    else a copy from the batch in memory. Returns the bytes read."""

    def __init__(self, shard: MappedShard, cols: dict):
        self.path, self.cols = shard.path, cols
        self.fd = shard.file.fileno() if shard.file is not None else None
        self.stride = {n: c.values.itemsize * c.spec.width for n, c in cols.items()}
        self.at = {n: shard.file_offset(c.values) for n, c in cols.items()} if self.fd is not None else {}

    def read(self, name: str, lo: int, hi: int, dst: np.ndarray, who: str) -> int:
        if self.fd is None:  # bytes as stored, whatever the buffer's dtype and shape
            np.copyto(dst.reshape(-1).view(np.uint8), self.cols[name].values[lo:hi].reshape(-1).view(np.uint8))
            return dst.nbytes
        want = (hi - lo) * self.stride[name]
        got = os.preadv(self.fd, [dst], self.at[name] + lo * self.stride[name])
        if got != want:
            raise ChecksumError(f"{who} (shard file {self.path}): read {got} of {want} bytes of {name!r}: the "
                                "shard is truncated or corrupt")
        return got


class BufferPool:
    """Output buffers reused across minibatches, to skip the page faults of fresh allocations. A buffer
    is handed out again only when nothing but the pool refers to it (every tensor and view of a batch
    holds a reference), so a batch the caller keeps is never overwritten. Buffers hold `capacity`
    tokens (the rank's largest bin in the plan, so any of its bins fits); at most `limit` per field, beyond that fresh
    arrays that are simply freed."""

    def __init__(self, limit: int, capacity: int):
        self.limit, self.capacity = limit, capacity
        self.free: dict[tuple, list[np.ndarray]] = {}
        self.lock = threading.Lock()

    def take(self, name: str, n: int, dtype, shape: tuple = ()) -> np.ndarray:
        key = (name, np.dtype(dtype).str, tuple(shape))
        with self.lock:
            bufs = self.free.setdefault(key, [])
            idle = [i for i in range(len(bufs)) if self._idle(bufs, i)]
            for i in idle:
                if bufs[i].shape[0] >= n:
                    return bufs[i][:n]
            buf = np.empty((max(n, self.capacity, 1), *shape), dtype=dtype)
            if len(bufs) < self.limit:
                bufs.append(buf)
            elif idle:  # replace a free one that is too small, else hand out an unpooled array
                bufs[idle[0]] = buf
            return buf[:n]

    @staticmethod
    def _idle(bufs: list, i: int) -> bool:
        """Nothing but the pool refers to bufs[i]: the list and getrefcount's argument. (Not through a
        loop variable: `enumerate` keeps its last tuple alive, one more reference.)"""
        return sys.getrefcount(bufs[i]) <= 2


def _tensor(arr: np.ndarray, logical: str) -> torch.Tensor:
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if logical == "bfloat16" else t


class _State:
    """What one building thread owns: its open shards and scratch buffers (two threads may build two
    minibatches at once; the output buffer pool is shared and locked)."""

    def __init__(self, store: ShardStore):
        self.shards = OpenShards(store)
        self.iota = np.zeros(0, dtype=np.int64)
        self.stage = np.zeros(0, dtype=np.int32)  # token ids as stored, widened to int64 in one pass
        self.scratch = np.empty(VERIFY_CHUNK_BYTES, dtype=np.uint8)  # bytes read only to verify a row's checksum


class Loader:
    """`for batch in Loader(plan, store, rank=r): ...` yields a `Batch` per minibatch (empty for a rank
    that holds no segment in that minibatch)."""

    def __init__(self, plan: Plan, store: ShardStore | None = None, rank: int = 0, prefetch: int = 1,
                 verify: bool = True, extras: tuple[str, ...] | list[str] = (), minibatches=None, threads: int = 2):
        if not 0 <= rank < plan.ranks:
            raise DataPlaneError(f"rank {rank} not in plan with {plan.ranks} ranks")
        if prefetch < 0 or prefetch > 8:
            raise DataPlaneError(f"prefetch {prefetch}: expected 0..8 minibatches ahead")
        if not 1 <= threads <= 8:
            raise DataPlaneError(f"threads {threads}: expected 1..8 building threads")
        self.plan, self.rank, self.prefetch, self.verify = plan, rank, prefetch, verify
        self.store = store or ShardStore(plan.store_root)
        self.extras = tuple(extras)
        self.minibatches = list(range(plan.num_minibatches) if minibatches is None else minibatches)
        self.bytes_read = 0  # from shard files: delivered ranges + bytes read only to verify
        self.bytes_delivered = 0  # heavy bytes (as stored) of the ranges packed into batches
        self._stop = threading.Event()
        self._specs: dict[str, tuple] = {}
        # buffers sized by this rank's largest bin (never more than tokens_per_rank), not by the budget: a
        # budget of 2^30 tokens over a small plan would otherwise allocate gigabytes
        per_rank = plan.rank_tokens()[:, rank] if plan.num_minibatches else np.zeros(0, np.int64)
        mine = [m for m in self.minibatches if 0 <= m < plan.num_minibatches]  # others fail in `build`, by name
        self._max_tokens = int(per_rank[mine].max()) if mine else 0
        self._pool = BufferPool(limit=prefetch + 2, capacity=self._max_tokens)
        # background threads building minibatches at once: never more than may be alive anyway
        self.threads = max(1, min(threads, prefetch + 1)) if prefetch else 1
        self._local = threading.local()
        self._states: list[_State] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.minibatches)

    # -- one minibatch ---------------------------------------------------------------------------------
    def _state(self) -> _State:
        st = getattr(self._local, "state", None)
        if st is None:
            st = self._local.state = _State(self.store)
            with self._lock:
                self._states.append(st)
        return st

    def _close_shards(self) -> None:
        with self._lock:
            for st in self._states:
                st.shards.close()

    def build(self, m: int) -> Batch:
        p = self.plan
        st = self._state()
        sl = p.bin(m, self.rank)
        traj, start, stop = p.seg_traj[sl], p.seg_start[sl], p.seg_stop[sl]
        seg_len = stop - start
        n_tok = int(seg_len.sum())
        cu = np.concatenate([[0], np.cumsum(seg_len)]).astype(np.int32)
        if st.stage.shape[0] < n_tok:  # token ids as stored, widened to int64 in one pass below
            st.stage = np.empty(max(n_tok, self._max_tokens), dtype=np.int32)
        ids = self._pool.take("tokens", n_tok, np.int64)
        mask = self._pool.take("loss_mask", n_tok, np.uint8)
        logp = self._pool.take("logprobs", n_tok, np.float32)
        outs = {"tokens": st.stage[:n_tok], "loss_mask": mask, "logprobs": logp}
        logical: dict[str, str] = {}
        shard_of = p.shard[traj]
        by_shard = np.argsort(shard_of, kind="stable")
        cuts = np.flatnonzero(np.diff(shard_of[by_shard])) + 1
        delivered = verified = 0
        try:
            for ks in np.split(by_shard, cuts) if traj.size else []:
                d, v = self._copy_shard(st, m, int(shard_of[ks[0]]), ks, traj, start, stop, cu, outs, logical)
                delivered += d
                verified += v
        finally:
            st.shards.trim()
        outs.pop("/ro", None)  # (no extra name holds "/")
        np.copyto(ids, outs["tokens"], casting="unsafe")
        for name in self.extras:  # a rank with nothing in this minibatch still gets typed, empty fields
            if name not in outs:
                dtype, shape, logical[name] = self._extra_spec(name)
                outs[name] = np.empty((0, *shape), dtype=dtype)
        pos = self._pool.take("position_ids", n_tok, np.int64)
        if 0 < traj.size <= 256:  # few segments: one pass each, iota + offset
            if st.iota.shape[0] < n_tok:
                st.iota = np.arange(max(n_tok, self._max_tokens), dtype=np.int64)
            for a, b, lo in zip(cu[:-1].tolist(), cu[1:].tolist(), start.tolist()):
                np.add(st.iota[:b - a], lo, out=pos[a:b])
        elif n_tok:  # pos[i] = i - cu[k] + start[k] inside segment k, as a running sum of steps
            shift = start - cu[:-1]
            pos.fill(1)
            pos[0] = shift[0]
            pos[cu[1:-1]] = 1 + np.diff(shift)
            np.cumsum(pos, out=pos)
        with self._lock:
            self.bytes_delivered += delivered
            self.bytes_read += delivered + verified
        return Batch(
            minibatch=m, rank=self.rank, input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(pos),
            cu_seqlens=torch.from_numpy(cu), loss_mask=torch.from_numpy(mask.view(np.bool_)),
            logprobs=torch.from_numpy(logp), extras={n: _tensor(outs[n], logical[n]) for n in self.extras},
            traj_ids=[str(x) for x in p.ids[traj]], seg_start=start, seg_stop=stop, traj_length=p.length[traj],
            reward=p.reward[traj], group=p.group[traj], teacher=[p.teachers[i] if p.teachers else "" for i in p.teacher[traj]],
            bytes_read=delivered + verified, bytes_delivered=delivered)

    def _copy_shard(self, st: _State, m, s, ks, traj, start, stop, cu, outs, logical) -> tuple[int, int]:
        """Read the segments `ks` that live in shard `s` into the packed outputs, checking that each row
        still holds the trajectory the plan names, its length, and (first piece) its checksum. Returns
        (bytes delivered into the outputs, bytes read only to verify: other columns, rest of split rows)."""
        p = self.plan
        rel = p.shard_paths[s]
        sh = st.shards.get(rel, who=f"trajectory {str(p.ids[traj[ks[0]]])!r}")
        cols, reader = sh.cols, sh.reader
        for name in self.extras:
            if EXTRA_PREFIX + name not in cols:
                raise DataPlaneError(f"trajectory {str(p.ids[traj[ks[0]]])!r}: shard file {self.store.full_path(rel)} "
                                     f"has no extra field {name!r} (has {sorted(c[2:] for c in cols if c.startswith(EXTRA_PREFIX))})")
            col = cols[EXTRA_PREFIX + name]
            if name not in outs:
                outs[name] = self._pool.take(name, outs["tokens"].shape[0], col.spec.dtype, col.spec.shape)
                logical[name] = col.spec.logical
                self._specs[name] = (col.spec.dtype, col.spec.shape, col.spec.logical)
            elif outs[name].shape[1:] != col.spec.shape or outs[name].dtype != col.spec.dtype:
                raise DataPlaneError(f"extra {name!r} is {col.spec.dtype}{col.spec.shape} in {rel} but "
                                     f"{outs[name].dtype}{outs[name].shape[1:]} elsewhere in minibatch {m}")
        ks = np.asarray(ks)
        t = traj[ks]
        rows, tids = p.row[t], p.ids[t]
        path = self.store.full_path(rel)
        bad = np.flatnonzero(rows >= sh.n_rows)
        if not bad.size:  # the row must still hold the trajectory the plan names
            id_u8 = sh.id_u8
            lo, hi = sh.id_off[rows], sh.id_off[rows + 1]
            if rows.size <= 16:  # few rows of this shard in the minibatch: compare one by one
                got = want = None
            else:  # many: compare all ids at once
                want = "\x00".join(tids.tolist()).encode()
                got_len = hi - lo
                idx = np.arange(int(got_len.sum()), dtype=np.int64) + np.repeat(lo - np.cumsum(got_len) + got_len, got_len)
                got = np.insert(id_u8[idx], np.cumsum(got_len)[:-1], 0).tobytes()  # same separators as `want`
            if got is None or got != want:
                bad = np.asarray([i for i, (a, b, tid) in enumerate(zip(lo.tolist(), hi.tolist(), tids.tolist()))
                                  if id_u8[a:b].tobytes() != tid.encode()], dtype=np.int64)
        if bad.size:
            i = int(bad[0])
            raise StaleRowError(f"trajectory {str(tids[i])!r} (shard file {path}, row {int(rows[i])}): the shard no "
                                "longer holds it there; re-plan from the catalog")
        off = sh.offsets["tokens"]
        base, full = off[rows], off[rows + 1] - off[rows]
        bad = np.flatnonzero(full != p.length[t])
        if bad.size:
            i = int(bad[0])
            raise StaleRowError(f"trajectory {str(tids[i])!r} (shard file {path}, row {int(rows[i])}): holds "
                                f"{int(full[i])} tokens, the plan says {int(p.length[t[i]])}")
        # where each column goes: the output buffer of a field asked for, else nowhere (read only to verify)
        dest = [(n, outs.get(n if n in CORE_DTYPES else n[len(EXTRA_PREFIX):])) for n in cols]
        ro = outs.setdefault("/ro", {})  # read-only byte views crc32c reads, made once per minibatch
        for n, out in dest:
            if out is not None and n not in ro:
                ro[n] = _ro_u8(out)
        delivered = verified = 0
        first = (start[ks] == 0).tolist()
        whole = ((start[ks] == 0) & (stop[ks] == full)).tolist()
        for j, a, b, lo, hi, row_lo, row_hi in zip(range(ks.size), cu[ks].tolist(), cu[ks + 1].tolist(),
                                                   (base + start[ks]).tolist(), (base + stop[ks]).tolist(),
                                                   base.tolist(), (base + full).tolist()):
            who = f"trajectory {str(tids[j])!r}"
            for name, out in dest:
                if out is not None:
                    delivered += reader.read(name, lo, hi, out[a:b], who)
            if not (self.verify and first[j]):
                continue
            crc = 0  # the row's checksum covers every column, whole rows, in schema order
            for name, out in dest:
                if out is not None and whole[j]:
                    w = reader.stride[name]
                    crc = google_crc32c.extend(crc, ro[name][a * w:b * w])
                    continue
                rows_per = max(1, VERIFY_CHUNK_BYTES // reader.stride[name])  # a fixed scratch, whatever the row
                if st.scratch.nbytes < reader.stride[name]:  # (one row of a very wide extra)
                    st.scratch = np.empty(reader.stride[name], dtype=np.uint8)
                for c_lo in range(row_lo, row_hi, rows_per):
                    c_hi = min(row_hi, c_lo + rows_per)
                    buf = st.scratch[:(c_hi - c_lo) * reader.stride[name]]
                    verified += reader.read(name, c_lo, c_hi, buf, who)
                    crc = google_crc32c.extend(crc, _ro_u8(buf))
            if crc != int(p.checksum[t[j]]):
                raise ChecksumError(f"trajectory {str(tids[j])!r} (shard file {path}, row {int(rows[j])}): "
                                    f"checksum {crc:#010x} != recorded {int(p.checksum[t[j]]):#010x}: the shard "
                                    "is corrupt; restore it or drop the trajectory")
        return delivered, verified

    def _extra_spec(self, name: str):
        if name not in self._specs:
            p = self.plan
            if not p.shard_paths:
                raise DataPlaneError(f"extra {name!r} asked for, but the plan holds no trajectory")
            with self.store.open(p.shard_paths[int(p.shard[p.seg_traj[0]]) if p.seg_traj.size else 0]) as rb:
                _, cols = decode(rb)
                col = cols.get(EXTRA_PREFIX + name)
                if col is None:
                    raise DataPlaneError(f"extra {name!r} is not in the plan's shards")
                self._specs[name] = (col.spec.dtype, col.spec.shape, col.spec.logical)
                del cols, col, rb
        return self._specs[name]

    # -- iteration ---------------------------------------------------------------------------------------
    def __iter__(self):
        if self.prefetch == 0:
            try:
                for m in self.minibatches:
                    yield self.build(m)
            finally:
                self._close_shards()
            return
        self._stop.clear()
        mbs = self.minibatches
        # built and not yet released (in use + ahead + being built): the memory bound. Minibatches are
        # handed to the threads in order, each after taking a slot, so the next one the consumer needs
        # always holds a slot or gets the next one freed.
        slots = threading.Semaphore(self.prefetch + 1)
        done: dict[int, object] = {}
        cond = threading.Condition()
        nxt = [0]

        def work():
            while True:
                while not slots.acquire(timeout=0.05):
                    if self._stop.is_set():
                        return
                with cond:
                    if self._stop.is_set() or nxt[0] >= len(mbs):
                        slots.release()
                        return
                    i = nxt[0]
                    nxt[0] += 1
                try:
                    item = self.build(mbs[i])
                except BaseException as exc:  # handed to the consumer, raised there
                    item = _Failure(exc)
                failed = isinstance(item, _Failure)
                with cond:
                    done[i] = item
                    cond.notify_all()
                del item
                if failed:
                    return

        workers = [threading.Thread(target=work, name="dataplane-prefetch", daemon=True) for _ in range(self.threads)]
        for w in workers:
            w.start()
        try:
            for i in range(len(mbs)):
                with cond:
                    while i not in done:
                        if not cond.wait(timeout=1.0) and not any(w.is_alive() for w in workers) and i not in done:
                            raise DataPlaneError(f"loader threads ended before minibatch {mbs[i]} was built")
                    item = done.pop(i)
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
                del item  # released: the consumer asked for the next one
                slots.release()
        finally:
            self._stop.set()
            for w in workers:
                w.join(timeout=30)
            if not any(w.is_alive() for w in workers):
                self._close_shards()
            done.clear()

    def close(self) -> None:
        self._stop.set()
        self._close_shards()
