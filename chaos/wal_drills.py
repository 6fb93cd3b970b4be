"""WAL drills: SIGKILL of writer processes, torn last flushes, flipped bits, on real log directories.

The writer appends tokens that are a pure function of (trajectory, position), so an audit knows what
every position must hold: an acknowledged position that is missing is a lost token, a position that
holds anything else a re-sampled one.

    wal-kill    a writer process is SIGKILLed at a random moment (mid-append, mid-commit, mid-roll);
                reopening keeps every acknowledged token and the next writer continues after them
    wal-torn    the last flush of a log is cut as a power loss leaves it (a zeroed suffix or a hole);
                the log opens, keeps every earlier acknowledged token and no partial record
    wal-bitflip one bit of an earlier segment is flipped; opening refuses the log (CorruptionError),
                it never skips the damaged record
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

import wal
from chaos.drill import DrillContext, DrillResult, Event
from chaos.files import flip_bit, zero_range

KILL_CONFIG = dict(segment_bytes=32 << 10, preallocate_bytes=8 << 10, compact_live_fraction=0.6)
BITFLIP_CONFIG = dict(segment_bytes=16 << 10, preallocate_bytes=4 << 10)  # several segments: earlier ones to damage


def token(traj: str, pos: int) -> int:
    return (int(traj.split("-")[1]) * 1_000_003 + pos * 7919) % 50_000


def _append(w, traj: str, start: int, n: int) -> int:
    w.append(traj, start, [token(traj, p) for p in range(start, start + n)], [-0.5] * n, 0)
    return start + n


def writer(directory: str, seed: int, out, config: dict, max_acks: int | None = None) -> dict[str, int]:
    """Append and commit forever (or `max_acks` times), writing `A traj:len …` after every durable commit
    and `F traj` after every durable finalize. Resumes the live trajectories of an earlier writer."""
    rng = random.Random(seed)
    w = wal.open(directory, wal.WALConfig(**config))
    live = {t: w.length(t) for t in w.trajectories()}
    next_id = seed * 100_000
    out.write("ready\n")
    out.flush()
    acks = 0
    while max_acks is None or acks < max_acks:
        while len(live) < 4:
            live[f"t-{next_id}"], next_id = 0, next_id + 1
        for _ in range(rng.choice([1, 1, 2, 4])):
            traj = rng.choice(sorted(live))
            live[traj] = _append(w, traj, live[traj], rng.choice([1, 1, 3, 8, 40]))
        w.commit()
        acks += 1
        out.write("A " + " ".join(f"{t}:{k}" for t, k in sorted(live.items())) + "\n")
        done = [t for t, k in live.items() if k > 300]
        if done:  # intent first: from here on each finalize may or may not be durable
            out.write("".join(f"f {t}\n" for t in done))
            out.flush()
        for t in done:
            w.finalize(t)
            del live[t]
        if done:
            w.commit()
            out.write("".join(f"F {t}\n" for t in done))
        out.flush()
    w.close()
    return live


def audit(directory: str | Path, acked: dict[str, int], finalized: set[str],
          finalizing: frozenset[str] = frozenset()) -> tuple[int, int]:
    """(tokens lost, tokens re-sampled) of a log against what was acknowledged; opens and closes it.
    `finalizing`: trajectories whose finalize had begun at the kill (it may have become durable, and the
    log may have reclaimed their records and forgotten them since)."""
    lost = resampled = 0
    w = wal.open(directory)
    try:
        for traj, n in acked.items():
            if traj in finalized:
                continue
            try:
                got = w.tokens(traj)
            except wal.FinalizedError:
                if traj not in finalizing:
                    lost += n  # finalized although nobody asked: its acknowledged tokens are gone
                continue  # else its finalize became durable before the kill: that is allowed
            if not got and traj in finalizing:
                continue  # finalized, reclaimed and forgotten
            lost += max(0, n - len(got))
            resampled += sum(1 for p, t in enumerate(got) if t != token(traj, p))
    finally:
        w.close()
    return lost, resampled


def _read_acks(line: str, acked: dict[str, int], finalized: set[str], finalizing: set[str] | None = None) -> None:
    if line.startswith("A "):
        for item in line.split()[1:]:
            t, k = item.rsplit(":", 1)
            acked[t] = max(acked.get(t, 0), int(k))
    elif line.startswith("F "):
        finalized.add(line.split()[1])
    elif line.startswith("f ") and finalizing is not None:
        finalizing.add(line.split()[1])


def wal_kill(ctx: DrillContext, n: int) -> DrillResult:
    rng = random.Random(ctx.seed)
    directory = ctx.work("wal-kill") / "wal"
    res = DrillResult("wal-kill", {"wal_sigkill": n})
    acked: dict[str, int] = {}
    finalized: set[str] = set()
    finalizing: set[str] = set()
    t0 = time.monotonic()
    for trial in range(n):
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: killed by the parent, never returns
            try:
                os.close(r)
                writer(str(directory), ctx.seed * 10_000 + trial + 1, os.fdopen(wfd, "w"), KILL_CONFIG)
            finally:
                os._exit(1)
        os.close(wfd)
        pipe = os.fdopen(r)
        try:
            if pipe.readline().strip() != "ready":
                res.detail["writer_failed"] = trial
                break
            target, seen = rng.randrange(1, 30), 0
            while seen < target:
                line = pipe.readline()
                if not line:
                    break
                seen += line.startswith("A ")
                _read_acks(line, acked, finalized, finalizing)
            time.sleep(rng.random() * 0.002)  # land anywhere in the next append, commit, roll or finalize
        finally:
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            for line in pipe:  # acknowledgements written before the kill still count
                _read_acks(line, acked, finalized, finalizing)
            pipe.close()
        lost, resampled = audit(directory, acked, finalized, frozenset(finalizing))
        t_back = time.monotonic()
        res.tokens_lost += lost
        res.tokens_resampled += resampled
        res.events.append(Event("wal_sigkill", t_kill - t0, round(t_back - t_kill, 6) if not (lost or resampled) else None))
    res.wall_s = time.monotonic() - t0
    res.completed = res.calm_completed = None
    res.detail = {"acknowledged_tokens": sum(acked.values()), "trajectories": len(acked), "finalized": len(finalized)}
    res.checks["acknowledged tokens audited"] = sum(acked.values()) > 0
    return res


class _Sink:
    def write(self, _):
        pass

    def flush(self):
        pass


def _base_log(directory: Path, seed: int, acks: int, config: dict) -> dict[str, int]:
    return writer(str(directory), seed, _Sink(), config, max_acks=acks)


def _last_segment(directory: Path) -> Path:
    return max(p for p in directory.glob("*.seg"))


def _data_end(path: Path) -> int:
    from wal.segments import nonzero_end

    return nonzero_end(path.read_bytes(), 0)


def wal_torn(ctx: DrillContext, n: int) -> DrillResult:
    rng = random.Random(ctx.seed + 1)
    work = ctx.work("wal-torn")
    config = dict(segment_bytes=4 << 20, preallocate_bytes=1 << 20)
    base = work / "base"
    shutil.rmtree(base, ignore_errors=True)
    acked = _base_log(base, ctx.seed + 7, 40, config)
    res = DrillResult("wal-torn", {"wal_torn_tail": n})
    cuts = {"suffix": 0, "hole": 0, "intact": 0}
    t0 = time.monotonic()
    for trial in range(n):
        d = work / "copy"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base, d)
        seg = _last_segment(d)
        e0 = _data_end(seg)
        w = wal.open(d, wal.WALConfig(**config))  # the flush that the power cut: appended, never acknowledged
        extra = {}
        for traj in sorted(acked)[: rng.randint(1, 4)]:
            extra[traj] = _append(w, traj, acked[traj], rng.choice([1, 5, 30]))
        w.commit()
        w.close()
        e1 = _data_end(_last_segment(d))
        if _last_segment(d) != seg or e1 <= e0:
            raise RuntimeError("wal-torn: the last flush left its segment; the drill's segment size is too small")
        kind = rng.choice(["suffix", "hole", "intact"]) if trial >= 2 else ["suffix", "hole"][trial]
        if kind == "suffix":
            zero_range(str(seg), rng.randrange(e0, e1), e1)
        elif kind == "hole":
            a = rng.randrange(e0, e1)
            zero_range(str(seg), a, min(e1, a + rng.choice([1, 8, 64, 512])))
        cuts[kind] += 1
        t_fault = time.monotonic()
        ok = True
        try:
            lost, resampled = audit(d, acked, set())
        except wal.WALError as exc:
            ok, lost, resampled = False, 0, 0
            res.detail.setdefault("refused", []).append(f"{type(exc).__name__}: {exc}"[:200])
        res.tokens_lost += lost
        res.tokens_resampled += resampled
        ok = ok and not (lost or resampled)
        res.events.append(Event("wal_torn_tail", t_fault - t0, round(time.monotonic() - t_fault, 6) if ok else None))
    res.wall_s = time.monotonic() - t0
    res.detail |= {"cuts": cuts, "acknowledged_tokens": sum(acked.values())}
    res.checks["a torn tail never refuses the log"] = "refused" not in res.detail
    return res


def wal_bitflip(ctx: DrillContext, n: int, config: dict | None = None) -> DrillResult:
    from wal.codec import SEGMENT_HEAD_BYTES

    config = config or BITFLIP_CONFIG
    rng = random.Random(ctx.seed + 2)
    work = ctx.work("wal-bitflip")
    base = work / "base"
    shutil.rmtree(base, ignore_errors=True)
    acked = _base_log(base, ctx.seed + 11, 60, config)
    sealed = sorted(base.glob("*.seg"))[:-1]
    res = DrillResult("wal-bitflip", {"wal_bitflip": n})
    if not sealed:
        res.shortfall = "the base log has a single segment: no earlier segment to damage"
        return res
    skipped = 0
    t0 = time.monotonic()
    for _ in range(n):
        d = work / "copy"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base, d)
        victim = d / rng.choice(sealed).name
        flip_bit(str(victim), rng, lo=SEGMENT_HEAD_BYTES, hi=_data_end(victim))
        t_fault = time.monotonic()
        try:
            lost, resampled = audit(d, acked, set())
            skipped += 1  # opened although committed data is damaged
            res.tokens_lost += lost
            res.tokens_resampled += resampled
            res.events.append(Event("wal_bitflip", t_fault - t0, None))
        except wal.CorruptionError:
            res.events.append(Event("wal_bitflip", t_fault - t0, round(time.monotonic() - t_fault, 6)))
    res.wall_s = time.monotonic() - t0
    res.detail = {"segments": len(sealed) + 1, "opened_despite_damage": skipped}
    res.checks["every flipped bit refused (CorruptionError), none skipped"] = skipped == 0
    return res
