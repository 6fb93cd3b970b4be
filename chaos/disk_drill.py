"""disk-full: ENOSPC on the WAL and data-plane directories, on a size-capped tmpfs mounted for the drill.

Each fault fills the file system (a filler file takes every free block), then keeps writing: the WAL
appends and commits until a commit fails, the data plane puts a batch. Both must fail with one clear
error that names the full device (the WAL closes itself: `LogClosedError`), acknowledge nothing they
did not store, and make nothing half-visible. Then the space returns (the filler is deleted): the log
reopens with every acknowledged token, and writing resumes (the next commit and put succeed).
Recovery time: from the space returning to the first durable commit of the reopened log.
"""
from __future__ import annotations

import errno
import os
import random
import subprocess
import time

from chaos.drill import DrillContext, DrillResult, Event
from chaos.wal_drills import _append, audit

SIZE = "2m"
WAL_CONFIG = dict(segment_bytes=64 << 10, preallocate_bytes=16 << 10, compact_live_fraction=0.6)


def _fill(path: str) -> int:
    """Write zeros into `path` until the device is full; returns the bytes written."""
    n = 0
    chunk = bytes(64 << 10)
    with open(path, "wb", buffering=0) as fh:
        while True:
            try:
                n += fh.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                step = 4096
                while step:
                    try:
                        n += fh.write(bytes(step))
                    except OSError:
                        step //= 2 if step > 1 else 0
                        step = step if step >= 512 else 0
                return n


def _full(exc: BaseException) -> bool:
    text = f"{exc} {exc.__cause__ or ''}".lower()
    return "no space left" in text or "disk is full" in text or getattr(exc, "errno", None) == errno.ENOSPC


def disk_full(ctx: DrillContext, n: int) -> DrillResult:
    res = DrillResult("disk-full", {"wal_enospc": n, "dataplane_enospc": n})
    work = ctx.work("disk-full")
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        res.shortfall = f"could not mount a size-capped tmpfs at {mnt} (needs root): {p.stderr.strip()[:200]}"
        return res
    try:
        _drill(ctx, n, res, mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    return res


def _drill(ctx: DrillContext, n: int, res: DrillResult, mnt) -> None:
    import dataplane
    import wal

    from chaos.catalog_drill import BATCH, _records, _visible

    rng = random.Random(ctx.seed + 13)
    log_dir, filler = mnt / "wal", str(mnt / "filler")
    live: dict[str, int] = {}
    acked: dict[str, int] = {}
    finalized: set[str] = set()
    unclean: list[str] = []
    next_id, put_batches = ctx.seed * 100_000, 0
    t0 = time.monotonic()
    for trial in range(n):
        w = wal.open(log_dir, wal.WALConfig(**WAL_CONFIG))
        for t in [t for t, k in live.items() if k > 200]:
            w.finalize(t)
            finalized.add(t)
            del live[t]
        w.commit()
        dp = None
        if trial % 2 == 0:  # a writer that has the data plane open already (odd trials open it on the full device)
            dp = dataplane.open(str(mnt / "catalog.db"), str(mnt / "store"))
        _fill(filler)
        t_fault = time.monotonic()
        wal_err = None
        for _ in range(100_000):  # the preallocated reserve takes a few commits; then the device is full
            while len(live) < 3:
                live[f"t-{next_id}"], next_id = 0, next_id + 1
            traj = rng.choice(sorted(live))
            try:
                end = _append(w, traj, live[traj], rng.choice([1, 8, 40]))
                w.commit()
            except wal.WALError as exc:
                wal_err = exc
                break
            live[traj] = end
            acked.update(live)
        w.close()
        if wal_err is None or not _full(wal_err):
            unclean.append(f"wal: {type(wal_err).__name__}: {wal_err}")
        dp_err, prefix = None, f"df{trial}"
        try:
            dp = dp or dataplane.open(str(mnt / "catalog.db"), str(mnt / "store"))
            dp.put(_records(prefix, seed=trial))
        except Exception as exc:  # the full device, in whichever step it shows first
            dp_err = exc
        if dp is not None:
            dp.close()
        if dp_err is None or not _full(dp_err):
            unclean.append(f"dataplane: {type(dp_err).__name__}: {dp_err}")
        os.unlink(filler)  # the space returns
        t_back = time.monotonic()
        lost, resampled = audit(log_dir, acked, finalized)
        w = wal.open(log_dir, wal.WALConfig(**WAL_CONFIG))
        live = {t: w.length(t) for t in w.trajectories()}
        if not live:  # every live trajectory was finalized and the new ones never reached the disk
            live[f"t-{next_id}"], next_id = 0, next_id + 1
        traj = sorted(live)[0]
        live[traj] = _append(w, traj, live[traj], 4)  # writing resumes after the last committed token
        w.commit()
        acked.update(live)
        t_wal = time.monotonic()
        w.close()
        res.tokens_lost += lost
        res.tokens_resampled += resampled
        ok_wal = wal_err is not None and _full(wal_err) and not (lost or resampled)
        res.events.append(Event("wal_enospc", t_fault - t0, round(t_wal - t_back, 6) if ok_wal else None))
        dp = dataplane.open(str(mnt / "catalog.db"), str(mnt / "store"))
        try:
            seen = _visible(dp, prefix)
            dp.put(_records(prefix, seed=trial))  # resumes: the same batch again, now stored
            put_batches += 1
            ok_dp = dp_err is not None and _full(dp_err) and seen == 0 and _visible(dp, prefix) == BATCH
            dp.delete([f"{prefix}-{i}" for i in range(BATCH)])  # keep the small device from filling with old batches
            dp.gc(min_age_s=0)
        finally:
            dp.close()
        res.events.append(Event("dataplane_enospc", t_fault - t0, round(time.monotonic() - t_back, 6) if ok_dp else None))
    res.wall_s = time.monotonic() - t0
    res.detail = {"device": SIZE, "acknowledged_tokens": sum(acked.values()), "errors_not_naming_a_full_device": unclean[:5]}
    res.checks["every failure one clear error naming the full device"] = not unclean
