"""catalog-drop: the data-plane catalog loses its connection or its writer in the middle of a put.

    pg_terminate_backend   on PostgreSQL (127.0.0.1:5432, database `test`, a schema of the drill's
                           own): the backend of a put is terminated while its transaction runs (a
                           statement trigger in the drill's schema holds the insert open for a moment);
                           the put fails with an error, none of its rows is visible, a retry stores it
    sqlite_writer_sigkill  on SQLite: a writer process putting batches is SIGKILLed at a random point;
                           every acknowledged batch is visible and no batch is partly visible

Nothing is half-visible: after every fault each batch is visible with all its rows or with none.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np

from chaos.drill import DrillContext, DrillResult, Event

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
BATCH = 6


def _records(prefix: str, n: int = BATCH, seed: int = 0):
    from dataplane import TrajectoryRecord

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(4, 64))
        out.append(TrajectoryRecord(id=f"{prefix}-{i}", run="drill", domain="arith", prompt=f"p{i}", group_id=prefix,
                                    tokens=rng.integers(0, 1000, length, dtype=np.int64),
                                    loss_mask=np.ones(length, dtype=np.uint8),
                                    logprobs=-rng.random(length).astype(np.float32), reward=1.0,
                                    policy_min=0, policy_max=0))
    return out


def _visible(dp, prefix: str) -> int:
    sel = dp.select(run="drill", status=None)
    return sum(1 for i in sel.ids.tolist() if str(i).rsplit("-", 1)[0] == prefix)


def catalog_drop(ctx: DrillContext, n: int) -> DrillResult:
    res = DrillResult("catalog-drop", {"pg_terminate_backend": n, "sqlite_writer_sigkill": n})
    t0 = time.monotonic()
    half = 0
    try:
        half += _postgres(ctx, n, res, t0)
    except Exception as exc:  # no PostgreSQL reachable: the drill says so and fails
        res.shortfall = f"PostgreSQL at {PG_URL}: {type(exc).__name__}: {str(exc)[:200]}"
    half += _sqlite(ctx, n, res, t0)
    res.wall_s = time.monotonic() - t0
    res.checks["no batch partly visible"] = half == 0
    return res


def _postgres(ctx: DrillContext, n: int, res: DrillResult, t0: float) -> int:
    import dataplane
    from sqlalchemy import create_engine, text

    ns = f"drill_{os.getpid()}_{ctx.seed}"
    app = f"postrain_drill_{os.getpid()}"
    admin = create_engine("postgresql+psycopg://postgres@127.0.0.1:5432/test", isolation_level="AUTOCOMMIT")
    dp = dataplane.open(f"{PG_URL}?application_name={app}", ctx.work("catalog-drop") / "pg-store", namespace=ns)
    half = 0
    try:
        with admin.connect() as c:  # holds each put's transaction open for a moment, so it can be cut
            c.execute(text(f'CREATE OR REPLACE FUNCTION "{ns}".hold() RETURNS trigger AS '
                           "$$ BEGIN PERFORM pg_sleep(0.3); RETURN NULL; END $$ LANGUAGE plpgsql"))
            c.execute(text(f'CREATE TRIGGER hold AFTER INSERT ON "{ns}".dp_trajectories '
                           f'FOR EACH STATEMENT EXECUTE FUNCTION "{ns}".hold()'))
        for trial in range(n):
            prefix = f"pg{trial}"
            recs = _records(prefix, seed=trial)
            err: dict = {}

            def put():
                try:
                    dp.put(recs)
                except Exception as exc:  # the terminated connection
                    err["exc"] = exc

            th = threading.Thread(target=put, daemon=True)
            th.start()
            pids = []
            deadline = time.monotonic() + 30
            with admin.connect() as c:
                while not pids and time.monotonic() < deadline and th.is_alive():
                    pids = c.execute(text("SELECT pid FROM pg_stat_activity WHERE application_name = :a AND "
                                          "state = 'active' AND query ILIKE 'INSERT INTO%dp_trajectories%'"),
                                     {"a": app}).scalars().all()
                    time.sleep(0.005)
                t_fault = time.monotonic()
                for pid in pids:
                    c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            th.join(60)
            if not pids:
                continue  # the put finished before its backend was seen: no fault, try the next batch
            seen = _visible(dp, prefix)
            half += seen not in (0, BATCH)
            stored = seen == BATCH
            if not stored:
                dp.put(recs)  # the retry after the error (the pool re-puts what the sink did not confirm)
            ok = "exc" in err and seen == 0 and _visible(dp, prefix) == BATCH
            res.events.append(Event("pg_terminate_backend", t_fault - t0, round(time.monotonic() - t_fault, 6) if ok else None))
        res.detail["pg_batches"] = int(len(dp.select(run="drill", status=None)) // BATCH)
    finally:
        dp.close()
        with admin.connect() as c:
            c.execute(text(f'DROP SCHEMA IF EXISTS "{ns}" CASCADE'))
        admin.dispose()
    return half


def _sqlite_writer(db: str, store: str, start: int, fd: int) -> None:
    import dataplane

    out = os.fdopen(fd, "w")
    dp = dataplane.open(db, store)
    out.write("ready\n")
    out.flush()
    for b in range(start, start + 1_000_000):
        dp.put(_records(f"sq{b}", seed=b))
        out.write(f"ACK {b}\n")
        out.flush()


def _sqlite(ctx: DrillContext, n: int, res: DrillResult, t0: float) -> int:
    import dataplane

    rng = random.Random(ctx.seed + 9)
    work = ctx.work("catalog-drop")
    db, store = str(work / "catalog.db"), str(work / "sq-store")
    acked: set[int] = set()
    half, next_batch = 0, 0
    for trial in range(n):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                _sqlite_writer(db, store, next_batch, w)
            finally:
                os._exit(1)
        os.close(w)
        pipe = os.fdopen(r)
        target = rng.randrange(1, 6)
        got = 0
        try:
            if pipe.readline().strip() == "ready":
                while got < target:
                    line = pipe.readline()
                    if not line:
                        break
                    acked.add(int(line.split()[1]))
                    got += 1
                time.sleep(rng.random() * 0.02)  # inside the next put: shard write, fsync, transaction, commit
        finally:
            t_fault = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            for line in pipe:
                if line.startswith("ACK"):
                    acked.add(int(line.split()[1]))
            pipe.close()
        dp = dataplane.open(db, store)
        try:
            counts: dict[str, int] = {}
            for i in dp.select(run="drill", status=None).ids.tolist():
                counts[str(i).rsplit("-", 1)[0]] = counts.get(str(i).rsplit("-", 1)[0], 0) + 1
        finally:
            dp.close()
        partial = sum(1 for c in counts.values() if c != BATCH)
        lost = sum(1 for b in acked if counts.get(f"sq{b}", 0) != BATCH)
        half += partial
        res.detail["sqlite_acked_batches_missing"] = res.detail.get("sqlite_acked_batches_missing", 0) + lost
        next_batch = max([int(k[2:]) for k in counts] + list(acked) + [next_batch - 1]) + 1
        ok = partial == 0 and lost == 0
        res.events.append(Event("sqlite_writer_sigkill", t_fault - t0, round(time.monotonic() - t_fault, 6) if ok else None))
    res.detail["sqlite_batches"] = next_batch
    res.checks["every acknowledged SQLite batch visible"] = res.detail.get("sqlite_acked_batches_missing", 0) == 0
    return half
