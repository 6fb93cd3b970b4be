"""Streaming loader: iterate a plan one minibatch at a time for one rank, reading only the rows and
token ranges it names (memory-mapped, zero-copy until packing), into packed torch tensors. A background
thread builds the next minibatch; at most `prefetch` + 1 minibatches are alive (the one in use and the
ones ahead), output buffers are reused once released, and the pages of the shard maps are dropped
after each minibatch, so peak memory stays near two minibatches whatever the dataset size."""
from __future__ import annotations

import queue
import sys
import threading
from collections import OrderedDict

import google_crc32c
import numpy as np
import torch

from dataplane.codec import CORE_DTYPES, EXTRA_PREFIX, decode
from dataplane.errors import ChecksumError, DataPlaneError, StaleRowError
from dataplane.store import ShardStore
from dataplane.types import Batch, Plan

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class OpenShards:
    """Shards kept open across minibatches (LRU, at most `capacity`), decoded once. After each minibatch
    `drop_pages` unmaps the pages this process touched, so RSS stays near the minibatch while reopening
    and re-parsing footers is avoided. Stores that cannot map (remote) keep nothing open."""

    def __init__(self, store: ShardStore, capacity: int = 64):
        self.store = store
        self.capacity = capacity if store.use_mmap else 0
        self.open: OrderedDict[str, tuple] = OrderedDict()

    def get(self, rel: str, who: str):
        if rel in self.open:
            self.open.move_to_end(rel)
            return self.open[rel][1]
        shard = self.store.map(rel, who)
        self.open[rel] = (shard, decode(shard.batch))
        return self.open[rel][1]

    def drop_pages(self) -> None:
        for shard, _ in self.open.values():
            shard.drop_pages()
        while len(self.open) > self.capacity:
            _, (shard, decoded) = self.open.popitem(last=False)
            del decoded
            shard.close()

    def close(self) -> None:
        while self.open:
            _, (shard, decoded) = self.open.popitem(last=False)
            del decoded
            shard.close()


class BufferPool:
    """Output buffers reused across minibatches, to skip the page faults of fresh allocations. A buffer
    is handed out again only when nothing but the pool refers to it (every tensor and view of a batch
    holds a reference), so a batch the caller keeps is never overwritten. Buffers hold `capacity`
    tokens (the plan's per-rank budget, so any bin fits); at most `limit` per field, beyond that fresh
    arrays that are simply freed."""

    def __init__(self, limit: int, capacity: int):
        self.limit, self.capacity = limit, capacity
        self.free: dict[tuple, list[np.ndarray]] = {}
        self.lock = threading.Lock()

    def take(self, name: str, n: int, dtype, shape: tuple = ()) -> np.ndarray:
        key = (name, np.dtype(dtype).str, tuple(shape))
        with self.lock:
            bufs = self.free.setdefault(key, [])
            for i, buf in enumerate(bufs):
                if sys.getrefcount(buf) <= 3 and buf.shape[0] >= n:  # the list, `buf`, getrefcount's argument
                    return buf[:n]
            buf = np.empty((max(n, self.capacity, 1), *shape), dtype=dtype)
            if len(bufs) < self.limit:
                bufs.append(buf)
            else:  # replace a free one that is too small, else hand out an unpooled array
                small = [i for i, b in enumerate(bufs) if sys.getrefcount(b) <= 3]
                if small:
                    bufs[small[0]] = buf
            return buf[:n]


def _tensor(arr: np.ndarray, logical: str) -> torch.Tensor:
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if logical == "bfloat16" else t


class Loader:
    """`for batch in Loader(plan, store, rank=r): ...` yields a `Batch` per minibatch (empty for a rank
    that holds no segment in that minibatch)."""

    def __init__(self, plan: Plan, store: ShardStore | None = None, rank: int = 0, prefetch: int = 1,
                 verify: bool = True, extras: tuple[str, ...] | list[str] = (), minibatches=None):
        if not 0 <= rank < plan.ranks:
            raise DataPlaneError(f"rank {rank} not in plan with {plan.ranks} ranks")
        if prefetch < 0 or prefetch > 8:
            raise DataPlaneError(f"prefetch {prefetch}: expected 0..8 minibatches ahead")
        self.plan, self.rank, self.prefetch, self.verify = plan, rank, prefetch, verify
        self.store = store or ShardStore(plan.store_root)
        self.extras = tuple(extras)
        self.minibatches = list(range(plan.num_minibatches) if minibatches is None else minibatches)
        self.bytes_read = 0
        self._stop = threading.Event()
        self._specs: dict[str, tuple] = {}
        self._pool = BufferPool(limit=prefetch + 2, capacity=plan.tokens_per_rank)  # a bin never holds more
        self._shards = OpenShards(self.store)
        self._iota = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.minibatches)

    # -- one minibatch ---------------------------------------------------------------------------------
    def build(self, m: int) -> Batch:
        p = self.plan
        sl = p.bin(m, self.rank)
        traj, start, stop = p.seg_traj[sl], p.seg_start[sl], p.seg_stop[sl]
        seg_len = stop - start
        n_tok = int(seg_len.sum())
        cu = np.concatenate([[0], np.cumsum(seg_len)]).astype(np.int32)
        ids = self._pool.take("tokens", n_tok, np.int64)
        mask = self._pool.take("loss_mask", n_tok, np.uint8)
        logp = self._pool.take("logprobs", n_tok, np.float32)
        outs = {"tokens": ids, "loss_mask": mask, "logprobs": logp}
        logical: dict[str, str] = {}
        shard_of = p.shard[traj]
        by_shard = np.argsort(shard_of, kind="stable")
        cuts = np.flatnonzero(np.diff(shard_of[by_shard])) + 1
        bytes_read = 0
        try:
            for ks in np.split(by_shard, cuts) if traj.size else []:
                bytes_read += self._copy_shard(m, int(shard_of[ks[0]]), ks, traj, start, stop, cu, outs, logical)
        finally:
            self._shards.drop_pages()
        for name in self.extras:  # a rank with nothing in this minibatch still gets typed, empty fields
            if name not in outs:
                dtype, shape, logical[name] = self._extra_spec(name)
                outs[name] = np.empty((0, *shape), dtype=dtype)
        pos = self._pool.take("position_ids", n_tok, np.int64)
        if 0 < traj.size <= 256:  # few segments: one pass each, iota + offset
            if self._iota.shape[0] < n_tok:
                self._iota = np.arange(max(n_tok, p.tokens_per_rank), dtype=np.int64)
            for a, b, lo in zip(cu[:-1].tolist(), cu[1:].tolist(), start.tolist()):
                np.add(self._iota[:b - a], lo, out=pos[a:b])
        elif n_tok:  # pos[i] = i - cu[k] + start[k] inside segment k, as a running sum of steps
            shift = start - cu[:-1]
            pos.fill(1)
            pos[0] = shift[0]
            pos[cu[1:-1]] = 1 + np.diff(shift)
            np.cumsum(pos, out=pos)
        self.bytes_read += bytes_read
        return Batch(
            minibatch=m, rank=self.rank, input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(pos),
            cu_seqlens=torch.from_numpy(cu), loss_mask=torch.from_numpy(mask.view(np.bool_)),
            logprobs=torch.from_numpy(logp), extras={n: _tensor(outs[n], logical[n]) for n in self.extras},
            traj_ids=[str(x) for x in p.ids[traj]], seg_start=start, seg_stop=stop, traj_length=p.length[traj],
            reward=p.reward[traj], group=p.group[traj], teacher=[p.teachers[i] if p.teachers else "" for i in p.teacher[traj]],
            bytes_read=bytes_read)

    def _copy_shard(self, m, s, ks, traj, start, stop, cu, outs, logical) -> int:
        """Copy the segments `ks` that live in shard `s` into the packed outputs, checking that each row
        still holds the trajectory the plan names, its length, and (first piece) its checksum."""
        p = self.plan
        rel = p.shard_paths[s]
        bytes_read = 0
        id_col, cols = self._shards.get(rel, who=f"trajectory {str(p.ids[traj[ks[0]]])!r}")
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
        wanted = [(outs[n], cols[n if n in CORE_DTYPES else EXTRA_PREFIX + n]) for n in outs]
        ks = np.asarray(ks)
        t = traj[ks]
        rows, tids = p.row[t], p.ids[t]
        path = self.store.full_path(rel)
        n_rows = len(id_col)
        bad = np.flatnonzero(rows >= n_rows)
        if not bad.size:  # the row must still hold the trajectory the plan names: compare all ids at once
            _, id_off, id_data = id_col.buffers()
            id_off = np.frombuffer(id_off, dtype=np.int32)[id_col.offset:]
            id_u8 = np.frombuffer(id_data, dtype=np.uint8)
            lo, hi = id_off[rows].astype(np.int64), id_off[rows + 1].astype(np.int64)
            want = "\x00".join(tids.tolist()).encode()
            got_len = hi - lo
            idx = np.arange(int(got_len.sum()), dtype=np.int64) + np.repeat(lo - np.cumsum(got_len) + got_len, got_len)
            got = np.insert(id_u8[idx], np.cumsum(got_len)[:-1], 0).tobytes()  # same separators as `want`
            if got != want:
                bad = np.asarray([i for i, (a, b, tid) in enumerate(zip(lo.tolist(), hi.tolist(), tids.tolist()))
                                  if id_u8[a:b].tobytes() != tid.encode()], dtype=np.int64)
        if bad.size:
            i = int(bad[0])
            raise StaleRowError(f"trajectory {str(tids[i])!r} (shard file {path}, row {int(rows[i])}): the shard no "
                                "longer holds it there; re-plan from the catalog")
        off = cols["tokens"].offsets
        base, full = off[rows], off[rows + 1] - off[rows]
        bad = np.flatnonzero(full != p.length[t])
        if bad.size:
            i = int(bad[0])
            raise StaleRowError(f"trajectory {str(tids[i])!r} (shard file {path}, row {int(rows[i])}): holds "
                                f"{int(full[i])} tokens, the plan says {int(p.length[t[i]])}")
        if self.verify:  # a row's first piece checks the whole row, every column (same offsets in all)
            flat = [(c.values.reshape(-1).view(np.uint8), c.values.itemsize * c.spec.width) for c in cols.values()]
            row_bytes = sum(w for _, w in flat)
            first = np.flatnonzero(start[ks] == 0)
            for i, lo, hi in zip(first.tolist(), base[first].tolist(), (base + full)[first].tolist()):
                got = 0
                for u8, width in flat:
                    got = google_crc32c.extend(got, u8[lo * width:hi * width])
                bytes_read += (hi - lo) * row_bytes
                if got != int(p.checksum[t[i]]):
                    raise ChecksumError(f"trajectory {str(tids[i])!r} (shard file {path}, row {int(rows[i])}): "
                                        f"checksum {got:#010x} != recorded {int(p.checksum[t[i]]):#010x}: the shard "
                                        "is corrupt; restore it or drop the trajectory")
        src_lo = (base + start[ks]).tolist()
        src_hi = (base + stop[ks]).tolist()
        dst_lo, dst_hi = cu[ks].tolist(), cu[ks + 1].tolist()
        for out, col in wanted:
            vals = col.values
            for a, b, lo, hi in zip(dst_lo, dst_hi, src_lo, src_hi):
                np.copyto(out[a:b], vals[lo:hi], casting="unsafe")
            bytes_read += int((stop[ks] - start[ks]).sum()) * vals[:1].nbytes
        return bytes_read

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
                self._shards.close()
            return
        self._stop.clear()
        q: queue.Queue = queue.Queue()
        slots = threading.Semaphore(self.prefetch + 1)  # built and not yet released: in use + ahead

        def work():
            try:
                for m in self.minibatches:
                    while not slots.acquire(timeout=0.05):
                        if self._stop.is_set():
                            return
                    if self._stop.is_set():
                        return
                    q.put(self.build(m))
                q.put(_END)
            except BaseException as exc:  # handed to the consumer, raised there
                q.put(_Failure(exc))

        worker = threading.Thread(target=work, name="dataplane-prefetch", daemon=True)
        worker.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
                del item  # released: the consumer asked for the next one
                slots.release()
        finally:
            self._stop.set()
            worker.join(timeout=30)
            if not worker.is_alive():
                self._shards.close()

    def close(self) -> None:
        self._stop.set()
        self._shards.close()
