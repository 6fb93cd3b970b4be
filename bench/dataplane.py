"""Data plane: metadata-only planning and streaming loads against full-copy shuffles of the same rows.

Two datasets with the same N trajectories: T tokens, and 10xT tokens (lengths log-normal, up to 1M
tokens per trajectory), heavy fields = tokens int32 + loss mask uint8 + behaviour log-probs float32.
Each size is built, measured and shuffled by baselines in separate child processes, so peak RSS of
one size cannot leak into the other:
- `measure`: select (catalog), plan (shuffle + split + pack + balance, best of K), loader over the whole
  epoch for every rank (time to first minibatch; GB/s from the page cache: bytes the loader read from
  the shards into batches per wall second, best of K epochs; also per CPU second), peak RSS (VmHWM);
- `take`: baseline full-copy shuffle, `pyarrow.Table.take` on a permutation of all rows (best of K);
- `ray`: baseline Ray Data `random_shuffle` on the same rows (errors are recorded, not raised).
Plus planning 1,000,000 trajectories' metadata in-process (pure numpy).

    python -m bench.dataplane --json [--n 20000] [--tokens 20000000] [--out bench/results/dataplane.json]
    python -m bench.dataplane --json --only select_plan     # just select + plan of 1M on both catalogs
    python -m bench.dataplane --json --only loader          # just build the 10xT dataset and measure on it
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._device import cpu_name, run_meta
from core.cli_args import nonneg_int, positive_int


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    return float("nan")


def _lengths(n: int, total: int, seed: int, max_len: int):
    """n log-normal lengths in [16, max_len] summing to `total` exactly."""
    import numpy as np

    rng = np.random.default_rng(seed)
    raw = rng.lognormal(0.0, 1.3, n)
    length = np.clip((raw / raw.sum() * total).astype(np.int64), 16, max_len)
    for _ in range(50):  # fix the sum after clipping, spreading the difference over the unclipped ones
        diff = total - int(length.sum())
        if diff == 0:
            break
        free = np.flatnonzero((length > 16) & (length < max_len))
        step = np.full(free.shape[0], diff // free.shape[0])
        step[: abs(diff) % free.shape[0]] += 1 if diff > 0 else 0
        length[free] = np.clip(length[free] + step, 16, max_len)
    return length


# -- children ------------------------------------------------------------------------------------------
def child_gen(a) -> dict:
    import numpy as np

    import dataplane
    from dataplane import TrajectoryRecord

    length = _lengths(a.n, a.tokens, a.seed, a.max_len)
    rng = np.random.default_rng(a.seed + 1)
    pool_n = int(min(length.sum(), 1 << 26)) + int(length.max())
    tokens = rng.integers(0, 150_000, pool_n, dtype=np.int32)
    logp = -rng.exponential(1.0, pool_n).astype(np.float32)
    mask = (tokens & 3 != 0).astype(np.uint8)
    dp = dataplane.open(Path(a.dir) / "catalog.db", Path(a.dir) / "store", shard_bytes=64 << 20)
    t0 = time.perf_counter()
    batch, size = [], 0
    for i, L in enumerate(length.tolist()):
        o = int(rng.integers(0, pool_n - L + 1))
        batch.append(TrajectoryRecord(id=f"traj{i:07d}", run="bench", domain=("arith", "reverse", "calc")[i % 3],
                                      prompt=f"prompt {i // 8}", group_id=f"g{i // 8:06d}", tokens=tokens[o:o + L],
                                      loss_mask=mask[o:o + L], logprobs=logp[o:o + L], reward=float(i % 2),
                                      policy_min=i % 4, policy_max=i % 4))
        size += L * 9
        if size >= 256 << 20 or i == len(length) - 1:
            dp.put(batch)
            batch, size = [], 0
    st = dp.stats()
    dp.close()
    return {"put_s": time.perf_counter() - t0, "trajectories": st["trajectories"], "tokens": st["tokens"],
            "shards": st["shards"], "shard_bytes": st["shard_bytes"], "max_length": int(length.max()),
            "mean_length": float(length.mean())}


def child_measure(a) -> dict:
    import numpy as np

    import dataplane

    base_mb = _status_mb("VmRSS")
    dp = dataplane.open(Path(a.dir) / "catalog.db", Path(a.dir) / "store")
    t0 = time.perf_counter()
    sel = dp.select()
    select_s = time.perf_counter() - t0
    plan_times = []
    for k in range(a.repeats):
        t0 = time.perf_counter()
        plan = dp.plan(sel, tokens_per_rank=a.tokens_per_rank, ranks=a.ranks, seed=a.seed, epoch=k, group_aware=True)
        plan_times.append(time.perf_counter() - t0)
    summary = plan.summary()
    def epoch(verify: bool) -> dict:
        """One epoch over every rank (each rank's loader in turn, prefetch thread on, as a trainer would).
        `delivered`: bytes the loader read from the shard files into the batches (the planned token
        ranges of every heavy column, as stored); `read`: that plus bytes read only to verify checksums
        (the rest of a split row, on its first piece)."""
        load0 = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        first_s, delivered, read, batches, tokens = None, 0, 0, 0, 0
        for r in range(a.ranks):
            for b in dp.loader(plan, rank=r, prefetch=1, verify=verify, check=verify):
                if first_s is None:
                    first_s = time.perf_counter() - t0
                delivered += b.bytes_delivered
                read += b.bytes_read
                tokens += b.num_tokens
                batches += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if tokens != plan.num_tokens or delivered != plan.num_tokens * 9:  # int32 + uint8 + float32 per token
            raise RuntimeError(f"loader delivered {tokens} tokens / {delivered} B, plan has {plan.num_tokens} tokens")
        return {"wall_s": wall, "cpu_s": cpu, "first_s": first_s, "delivered": delivered, "read": read,
                "batches": batches, "load_avg": [load0, os.getloadavg()[0]]}

    runs = [epoch(True) for _ in range(a.loader_repeats)]  # the page cache is warm after the first
    best = min(runs, key=lambda e: e["wall_s"])
    walls = sorted(e["wall_s"] for e in runs)
    nov = epoch(False)  # the same epoch without the per-row crc32c check: what verification costs
    dp.close()
    gb = lambda e, key="delivered": e[key] / 1e9  # noqa: E731
    return {"select_s": select_s, "plan_s": min(plan_times), "plan_s_median": float(np.median(plan_times)),
            "epoch_s_all": [p + w for p, w in zip(plan_times, [e["wall_s"] for e in runs])],
            "epoch_s_median": float(np.median([p + e["wall_s"] for p, e in zip(plan_times, runs)])),
            "load_s_median": float(np.median(walls)),
            "first_minibatch_s": runs[0]["first_s"], "load_s": best["wall_s"],
            "loader_gb_s": gb(best) / best["wall_s"], "loader_gb_s_all": [gb(e) / e["wall_s"] for e in runs],
            "loader_gb_per_cpu_s": gb(best) / best["cpu_s"], "loader_cpu_s": best["cpu_s"],
            "loader_read_gb_s": gb(best, "read") / best["wall_s"], "bytes_delivered": best["delivered"],
            "bytes_read": best["read"], "loader_load_avg": best["load_avg"],
            "loader_gb_s_no_verify": gb(nov) / nov["wall_s"], "loader_gb_per_cpu_s_no_verify": gb(nov) / nov["cpu_s"],
            "loader_mb_s": best["delivered"] / 2**20 / best["wall_s"],
            "batches": best["batches"], "plan": summary,
            "peak_rss_mb": _status_mb("VmHWM"), "rss_before_open_mb": base_mb}


def _table(a):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    paths = sorted((Path(a.dir) / "store" / "shards").rglob("*.arrow"))
    tables = [ipc.open_file(pa.memory_map(str(p))).read_all() for p in paths]
    return pa.concat_tables(tables)


def child_take(a) -> dict:
    """The full-copy shuffle baseline: `Table.take` on a permutation of every row; then (`epoch_s`) the
    same loading as the loader's epoch: the shuffled rows cut into minibatches of ranks x tokens_per_rank
    tokens, each heavy column of a minibatch made one contiguous numpy array (9 B per token delivered)."""
    import numpy as np
    import pyarrow.compute as pc

    table = _table(a)
    lens = pc.list_value_length(table["tokens"]).to_numpy()
    budget = a.tokens_per_rank * a.ranks
    times, epochs = [], []
    for k in range(a.take_repeats):
        perm = np.random.default_rng(k).permutation(table.num_rows)
        t0 = time.perf_counter()
        out = table.take(perm)
        times.append(time.perf_counter() - t0)
        ends = np.searchsorted(np.cumsum(lens[perm]), np.arange(budget, int(lens.sum()) + budget, budget), side="right")
        bounds = np.unique(np.concatenate([[0], np.minimum(ends, table.num_rows)]))
        delivered = 0
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            for col in ("tokens", "loss_mask", "logprobs"):
                arr = np.ascontiguousarray(pc.list_flatten(out[col].slice(lo, hi - lo)).to_numpy())
                delivered += arr.nbytes
        epochs.append(time.perf_counter() - t0)
        if delivered != int(lens.sum()) * 9:
            raise RuntimeError(f"take epoch delivered {delivered} B, want {int(lens.sum()) * 9}")
        nbytes = out.nbytes
        del out
    return {"take_s": min(times), "take_s_all": times, "take_s_median": float(np.median(times)),
            "epoch_s_all": epochs, "epoch_s_median": float(np.median(epochs)), "minibatches": int(len(bounds) - 1),
            "rows": table.num_rows, "table_mb": nbytes / 2**20, "peak_rss_mb": _status_mb("VmHWM")}


def child_ray(a) -> dict:
    try:
        import ray
        import ray.data

        table = _table(a)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=int(table.nbytes * 3) + (512 << 20))
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = ray.data.from_arrow(table).materialize()
        t0 = time.perf_counter()
        out = ds.random_shuffle(seed=0).materialize()
        shuffle_s = time.perf_counter() - t0
        rows = out.count()
        ray.shutdown()
        return {"random_shuffle_s": shuffle_s, "rows": rows}
    except Exception as exc:  # recorded in the JSON: the baseline failing is a result, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def _spawn(mode: str, a, ddir: Path, tokens: int, timeout: float, catalog: str = "sqlite") -> dict:
    """Run child `mode` in a process of its own on a dataset of `tokens` tokens."""
    cmd = [sys.executable, "-m", "bench.dataplane", "--child", mode, "--dir", str(ddir), "--n", str(a.n),
           "--tokens", str(tokens), "--max-len", str(a.max_len), "--tokens-per-rank", str(a.tokens_per_rank),
           "--ranks", str(a.ranks), "--seed", str(a.seed), "--repeats", str(a.repeats),
           "--take-repeats", str(a.take_repeats), "--loader-repeats", str(a.loader_repeats), "--n-1m", str(a.n_1m),
           "--repeats-1m", str(a.repeats_1m), "--catalog", catalog]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        return {"error": f"{mode} child timed out after {timeout:.0f}s"}
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": f"{mode} child exited {res.returncode}: {res.stderr.strip()[-800:]}"}
    return json.loads(lines[-1])


def _plan_scaling(a, sizes=(100_000, 1_000_000), tries: int = 5) -> dict:
    """Planner time at N and 10 N trajectories (1,000 tokens each on average, groups of 8), tries
    interleaved, median of each."""
    import numpy as np

    from dataplane import planner

    inputs = {n: (_lengths(n, n * 1000, a.seed, a.max_len), np.arange(n) // 8) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for k in range(tries):
        for n in (sizes if k % 2 == 0 else sizes[::-1]):
            length, group = inputs[n]
            t0 = time.perf_counter()
            planner.layout(length, a.tokens_per_rank, a.ranks, seed=a.seed, epoch=k, group=group)
            times[n].append(time.perf_counter() - t0)
    med = {n: float(np.median(t)) for n, t in times.items()}
    return {"sizes": list(sizes), "plan_s_all": {str(n): t for n, t in times.items()},
            "plan_s_median": {str(n): m for n, m in med.items()}, "ratio_10x_n": med[sizes[1]] / med[sizes[0]]}


def child_select_plan(a) -> dict:
    """Catalogue 1,000,000 trajectories (metadata only) in a fresh catalog (a.catalog: 'sqlite' or a
    PostgreSQL URL), then time select + plan of all of them (tries: a.repeats_1m, median)."""
    import numpy as np

    from dataplane import planner
    from dataplane.catalog import Catalog
    from dataplane import postgres

    n = a.n_1m
    ns = None
    if a.catalog == "sqlite":
        url = str(Path(a.dir) / "catalog_1m.db")
    else:
        url, ns = a.catalog, f"bench_1m_{os.getpid()}"
    cat = Catalog(url, namespace=ns)
    try:
        t0 = time.perf_counter()
        fill_catalog(cat, n, seed=a.seed)
        fill_s = time.perf_counter() - t0
        select_s, plan_s, cpu_s, load = [], [], [], []
        for k in range(a.repeats_1m):
            load.append(os.getloadavg()[0])
            t0, c0 = time.perf_counter(), time.process_time()
            sel = cat.select()
            t1 = time.perf_counter()
            planner.make_plan(sel, a.tokens_per_rank, a.ranks, seed=a.seed, epoch=k, group_aware=True)
            t2, c2 = time.perf_counter(), time.process_time()
            if len(sel) != n:
                raise RuntimeError(f"selected {len(sel)} of {n} trajectories")
            select_s.append(t1 - t0)
            plan_s.append(t2 - t1)
            cpu_s.append(c2 - c0)
        total = [s + p for s, p in zip(select_s, plan_s)]
        return {"backend": cat.backend.__name__.rsplit(".", 1)[-1], "trajectories": n, "fill_s": fill_s,
                "select_s_all": select_s, "plan_s_all": plan_s, "select_plus_plan_s_all": total,
                # context on a shared machine: this process's CPU seconds (not the database server's)
                "select_plus_plan_cpu_s_all": cpu_s, "load_avg_all": load,
                "select_plus_plan_s_median": float(np.median(total)), "peak_rss_mb": _status_mb("VmHWM")}
    finally:
        cat.close()
        if ns:
            postgres.drop_namespace(url, ns)


def _plan_1m(a) -> dict:
    import numpy as np

    from dataplane import planner

    n = 1_000_000
    length = _lengths(n, n * 1000, a.seed, a.max_len)
    group = np.arange(n) // 8
    times = []
    for k in range(3):
        t0 = time.perf_counter()
        lay = planner.layout(length, a.tokens_per_rank, a.ranks, seed=a.seed, epoch=k, group=group)
        times.append(time.perf_counter() - t0)
    return {"plan_s": min(times), "plan_s_all": times, "segments": int(lay.traj.shape[0]),
            "minibatches": int(lay.balanced.shape[0])}


def fill_catalog(cat, n: int, seed: int = 0, shard_rows: int = 1000) -> None:
    """Catalogue n trajectories' metadata (no shard files: select and plan read the catalog only) the way
    GRPO runs add them: groups of 8 adjacent, group ids random hex strings, log-normal lengths."""
    import numpy as np

    from dataplane import columns
    from dataplane.schema import policy_versions, runs, shards, trajectories

    rng = np.random.default_rng(seed)
    length = _lengths(n, n * 1000, seed, 1_000_000)
    n_groups = (n + 7) // 8
    gid = (np.arange(n_groups, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(24)  # distinct, unordered
    groups = [f"{g:010x}" for g in gid.tolist()]
    now = time.time()
    n_shards = (n + shard_rows - 1) // shard_rows
    shard_rows_ = [{"id": k + 1, "path": f"shards/bench/{k:06d}.arrow", "run": "bench", "rows": shard_rows,
                    "bytes": 0, "checksum": 0, "created_at": now} for k in range(n_shards)]
    cols = ("id", "run", "domain", "prompt", "group_id", "length", "policy_min", "policy_max", "reward", "status",
            "shard_id", "row", "checksum", "created_at", "pack")
    domains = ("arith", "reverse", "calc")
    ln = length.tolist()
    ids, gids, i = [f"traj{i:07d}" for i in range(n)], [groups[i // 8] for i in range(n)], np.arange(n)
    shard_id, row, checksum, version = i // shard_rows + 1, i % shard_rows, (i * 2654435761) & 0xFFFFFFFF, i % 4
    packs = columns.pack(length, shard_id, (i % 2).astype(float), version, version, row, checksum, ids, gids,
                         ["bench"] * n, [None] * n)  # what put stores beside the columns
    rows = [(ids[i], "bench", domains[i % 3], f"prompt {i // 8}", gids[i], ln[i], i % 4, i % 4,
             float(i % 2), "complete", i // shard_rows + 1, i % shard_rows, (i * 2654435761) & 0xFFFFFFFF, now, packs[i])
            for i in range(n)]
    with cat._writing() as conn:
        cat.backend_insert_ignore(conn, runs, [{"name": "bench", "created_at": now}])
        cat.backend_insert_ignore(conn, policy_versions, [{"run": "bench", "version": v, "created_at": now,
                                                           "checkpoint": None} for v in range(4)])
        conn.execute(shards.insert(), shard_rows_)
        raw = conn.connection.dbapi_connection
        cur = raw.cursor()
        if cat.url.startswith("sqlite"):
            cur.executemany(f"INSERT INTO {trajectories.name} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", rows)
        else:
            with cur.copy(f"COPY {trajectories.name} ({', '.join(cols)}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
        cur.close()


def _target(value, goal: str, met: bool) -> dict:
    return {"value": value, "goal": goal, "met": bool(met)}


CHILDREN = {"gen": child_gen, "measure": child_measure, "take": child_take, "ray": child_ray,
            "select_plan": child_select_plan}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.dataplane", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one compact JSON object (default: indented)")
    ap.add_argument("--n", type=positive_int, default=20_000, help="trajectories per dataset")
    ap.add_argument("--tokens", type=positive_int, default=20_000_000, help="T: tokens of the small dataset (the large has 10x)")
    ap.add_argument("--max-len", type=positive_int, default=1_000_000, help="longest trajectory, tokens")
    ap.add_argument("--tokens-per-rank", type=positive_int, default=262_144, help="token budget per rank and minibatch")
    ap.add_argument("--ranks", type=positive_int, default=4, help="data-parallel ranks planned for")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--repeats", type=positive_int, default=15, help="plans timed per size (best is reported)")
    ap.add_argument("--take-repeats", type=positive_int, default=3, help="full-copy shuffle epochs timed per size (median for the target)")
    ap.add_argument("--loader-repeats", type=positive_int, default=3, help="plan + loader epochs timed per size (median for the target)")
    ap.add_argument("--n-1m", type=positive_int, default=1_000_000, help="trajectories catalogued for select + plan")
    ap.add_argument("--repeats-1m", type=positive_int, default=3, help="select + plan tries per catalog backend (median)")
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test",
                    help="PostgreSQL for the select + plan measurement ('' to skip)")
    ap.add_argument("--catalog", default="sqlite", help=argparse.SUPPRESS)
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray Data baseline")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir, deleted afterwards)")
    ap.add_argument("--out", default=None, help="also write the JSON to this file")
    ap.add_argument("--only", choices=["select_plan", "loader"], default=None,
                    help="run one part (a partial result: not with --out): select_plan = select + plan of --n-1m "
                         "catalogued trajectories on each catalog; loader = build the 10xT dataset and measure plan "
                         "+ loader on it (no baselines)")
    ap.add_argument("--child", choices=sorted(CHILDREN), default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(CHILDREN[a.child](a)))
        return 0
    if a.only and a.out:
        ap.error("--only measures a part of the benchmark: its JSON is not a result file (drop --out)")

    t_start = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="postrain-bench-dataplane-", dir=a.dir))
    out = {"benchmark": "dataplane", "device": cpu_name(), "load_avg_start": os.getloadavg()[0],
           "config": {"n": a.n, "tokens_1x": a.tokens, "tokens_10x": 10 * a.tokens, "max_len": a.max_len,
                      "tokens_per_rank": a.tokens_per_rank, "ranks": a.ranks, "group_aware": True,
                      "heavy_fields": "tokens int32, loss_mask uint8, logprobs float32 (9 B/token)",
                      "plan_time": f"best of {a.repeats}", "take_time": f"best of {a.take_repeats}",
                      "loader_time": f"best of {a.loader_repeats} epochs (all ranks, prefetch 1, checksums verified)",
                      "loader_gb_s": "bytes the loader read from the shard files into the batches (every planned "
                                     "token range of every heavy column, as stored: 9 B/token), counted by the "
                                     "loader, per second of wall time for one epoch over all ranks; GB = 1e9 B. "
                                     "loader_read_gb_s adds bytes read only to verify checksums; "
                                     "loader_gb_per_cpu_s divides by the process CPU time instead (the machine "
                                     "is shared)"},
           "sizes": {}}
    try:
        sizes = {None: (("1x", a.tokens), ("10x", 10 * a.tokens)), "loader": (("10x", 10 * a.tokens),)}
        for name, tokens in sizes.get(a.only, ()):
            ddir = scratch / name
            ddir.mkdir()
            print(f"[dataplane bench] {name}: building {a.n} trajectories, {tokens} tokens", file=sys.stderr)
            size = {"gen": _spawn("gen", a, ddir, tokens, 600)}
            print(f"[dataplane bench] {name}: measuring plan + loader", file=sys.stderr)
            size["measure"] = _spawn("measure", a, ddir, tokens, 600)
            out["sizes"][name] = size
            if not a.only:
                print(f"[dataplane bench] {name}: full-copy shuffle baselines", file=sys.stderr)
                size["take"] = _spawn("take", a, ddir, tokens, 600)
                size["ray"] = {"skipped": True} if a.no_ray else _spawn("ray", a, ddir, tokens, 300)
            shutil.rmtree(ddir, ignore_errors=True)
        if not a.only:
            print("[dataplane bench] planning 1,000,000 trajectories", file=sys.stderr)
            out["plan_1m"] = _plan_1m(a)
            print("[dataplane bench] plan time at N and 10 N trajectories", file=sys.stderr)
            out["plan_scaling"] = _plan_scaling(a)
        out["select_plan_1m"] = {}
        for name, catalog in (("sqlite", "sqlite"), ("postgresql", a.pg)) if a.only in (None, "select_plan") else ():
            if not catalog:
                out["select_plan_1m"][name] = {"skipped": True}
                continue
            print(f"[dataplane bench] select + plan of {a.n_1m} trajectories on {name}", file=sys.stderr)
            d1m = scratch / f"1m-{name}"
            d1m.mkdir()
            out["select_plan_1m"][name] = _spawn("select_plan", a, d1m, a.tokens, 1200, catalog=catalog)  # builds no dataset
            shutil.rmtree(d1m, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if a.only:
        out["only"] = a.only
        out["targets"] = _select_plan_targets(a, out) if a.only == "select_plan" else _loader_target(out)
        return _finish(a, out, t_start)
    s1, s10 = out["sizes"]["1x"], out["sizes"]["10x"]
    try:
        m1, m10, t10 = s1["measure"], s10["measure"], s10["take"]
        ray10 = s10["ray"].get("random_shuffle_s")
        out["figures"] = {
            "plan_s_1x": m1["plan_s"], "plan_s_10x": m10["plan_s"],
            "first_minibatch_s_1x": m1["first_minibatch_s"], "first_minibatch_s_10x": m10["first_minibatch_s"],
            "loader_gb_s_1x": m1["loader_gb_s"], "loader_gb_s_10x": m10["loader_gb_s"],
            "loader_gb_per_cpu_s_1x": m1["loader_gb_per_cpu_s"], "loader_gb_per_cpu_s_10x": m10["loader_gb_per_cpu_s"],
            "loader_gb_s_no_verify_1x": m1["loader_gb_s_no_verify"], "loader_gb_s_no_verify_10x": m10["loader_gb_s_no_verify"],
            "peak_rss_mb_1x": m1["peak_rss_mb"], "peak_rss_mb_10x": m10["peak_rss_mb"],
            "take_shuffle_s_1x": s1["take"]["take_s"], "take_shuffle_s_10x": t10["take_s"],
            "ray_random_shuffle_s_1x": s1["ray"].get("random_shuffle_s"), "ray_random_shuffle_s_10x": ray10,
            "ray_vs_plan_10x": (ray10 / m10["plan_s"]) if ray10 else None,
        }
        # context, no longer targets: a fixed N (plan time cannot grow with tokens), a copy against a plan
        # that moves no bytes, the planner without the catalog
        out["figures"].update({
            "plan_time_10x_tokens_vs_1x": m10["plan_s"] / m1["plan_s"],
            "full_copy_shuffle_vs_plan_10x": t10["take_s"] / m10["plan_s"],
            "plan_1m_trajectories_s": out["plan_1m"]["plan_s"],
        })
        scale = out["plan_scaling"]["ratio_10x_n"]
        epoch_ratio = t10["epoch_s_median"] / m10["epoch_s_median"]
        out["figures"]["epoch_vs_full_copy_shuffle_1x"] = s1["take"]["epoch_s_median"] / m1["epoch_s_median"]
        out["targets"] = {
            "plan_time_10x_n_vs_n": _target(scale, "<= 12 (planner time at 1,000,000 vs 100,000 trajectories, median of 5 "
                                            "interleaved tries each)", scale <= 12),
            "peak_rss_10x_vs_1x": _target(m10["peak_rss_mb"] / m1["peak_rss_mb"], "<= 1.1",
                                          m10["peak_rss_mb"] / m1["peak_rss_mb"] <= 1.1),
            "epoch_vs_full_copy_shuffle": _target(epoch_ratio, ">= 2 (10x dataset: Table.take shuffle + cutting every "
                                                  "minibatch into contiguous arrays, over plan + the loader's epoch on all "
                                                  f"ranks; median of {a.loader_repeats} tries each)", epoch_ratio >= 2),
            **_loader_target(out),
        }
        out["targets"].update(_select_plan_targets(a, out))
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        out["error"] = f"a measurement failed, see sizes: {type(exc).__name__}: {exc}"
    return _finish(a, out, t_start)


def _loader_target(out: dict) -> dict:
    v = out["sizes"]["10x"]["measure"].get("loader_gb_s")
    return {"loader_gb_s": _target(v, ">= 1 (10x dataset, page cache, all ranks; bytes read from the shards into "
                                      "batches per wall second, see config.loader_gb_s)", v is not None and v >= 1)}


def _select_plan_targets(a, out: dict) -> dict:
    targets = {}
    for name, r in out["select_plan_1m"].items():
        v = r.get("select_plus_plan_s_median")
        targets[f"select_plus_plan_1m_s_{name}"] = _target(
            v, f"< 2 (catalog select + plan of {a.n_1m:,} trajectories on {name}, median of {a.repeats_1m})",
            v is not None and v < 2)
    return targets


def _failed_parts(out: dict) -> list[str]:
    """The parts of this benchmark's own code that ended in an error (Ray's shuffle, a baseline, may fail:
    that is recorded as its result)."""
    parts = [(f"{size} {mode}", r) for size, s in out["sizes"].items() for mode, r in s.items() if mode != "ray"]
    parts += [(f"select + plan on {name}", r) for name, r in out.get("select_plan_1m", {}).items()]
    return [f"{where}: {r['error']}" for where, r in parts if isinstance(r, dict) and "error" in r]


def _finish(a, out: dict, t_start: float) -> int:
    out["load_avg_end"] = os.getloadavg()[0]
    out["wall_s"] = time.perf_counter() - t_start
    out["meta"] = run_meta(out.get("device"))
    text = json.dumps(out, indent=None if a.json else 2)
    print(text)
    failed = _failed_parts(out)
    if failed:  # a part that did not run is no result: nothing is written to --out
        print("bench.dataplane: " + "; ".join(failed), file=sys.stderr)
        return 1
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if "targets" in out else 1


if __name__ == "__main__":
    sys.exit(main())
