"""Power-cut cases for the token WAL and the environment log.

Tokens and tool results are pure functions of their place (trajectory and position, sandbox and seq),
so a check knows what every recovered position must hold. Properties after each cut:
- every token, finalize, tool invocation, result and release acknowledged before the cut is there;
- recovery opens the log (it never refuses a log that only lost unacknowledged data);
- nothing else is there but a contiguous prefix of what was written (no rewritten token), and the
  recovered log takes the next token of every live trajectory (no re-sampling needed or refused).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import wal

# (segment_bytes, preallocate_bytes, spare_segments, recycle_segments, direct_io): segments preallocated whole
# (every roll builds a segment inline, or takes a reclaimed one; commits written direct), grown 1 KiB at a time
# (deleted once reclaimed; commits through the page cache), grown and rolled into spare segments built by the
# helper thread or reclaimed ones (commits direct where their blocks lie inside the reserve, else buffered)
CONFIGS = ((8192, 8192, False, True, True), (12288, 1024, False, False, False), (8192, 1024, True, True, True))


def token(traj: str, pos: int) -> int:
    return (int(traj.split("-")[1]) * 1_000_003 + pos * 7919) % 150_000


def logprob(traj: str, pos: int) -> float:
    return -((int(traj.split("-")[1]) + pos) % 1000) / 997.0


def _step(w, ids: list[str], pos: list[int], version: int, numpy_form: bool) -> None:
    """One batched decode step as lists, or as a decode loop holds it (int32 / float64 / int64 arrays:
    the step group's C path, where the module is built)."""
    tok, lp = [token(t, q) for t, q in zip(ids, pos)], [logprob(t, q) for t, q in zip(ids, pos)]
    if numpy_form:
        w.append_step(ids, np.array(pos, np.int64), np.array(tok, np.int32), np.array(lp, np.float64), version)
    else:
        w.append_step(ids, pos, tok, lp, version)


def request(sb: str, seq: int) -> bytes:
    return f"{sb} call {seq}".encode()


def response(sb: str, seq: int) -> bytes:
    return f"{sb} result {seq}".encode() * (1 + seq % 5)


@dataclass
class Promised:
    """What the acknowledgements before a cut promise."""

    tokens: dict = field(default_factory=dict)  # traj -> acknowledged length
    finalized: set = field(default_factory=set)  # acknowledged
    finalizing: set = field(default_factory=set)  # started (may or may not be durable)
    env: dict = field(default_factory=dict)  # sandbox -> acknowledged entries (invoke and result)
    invoked: dict = field(default_factory=dict)  # sandbox -> acknowledged invocations without their result yet
    released: set = field(default_factory=set)
    releasing: set = field(default_factory=set)


def note(p: Promised, mark) -> None:
    kind = mark[0]
    if kind == "A":
        p.tokens.update(mark[1])
    elif kind == "f":
        p.finalizing.add(mark[1])
    elif kind == "F":
        p.finalized.add(mark[1])
    elif kind == "I":
        p.invoked[mark[1]] = mark[2]
    elif kind == "E":
        p.env[mark[1]] = mark[2]
    elif kind == "r":
        p.releasing.add(mark[1])
    elif kind == "R":
        p.released.add(mark[1])


def check_tokens(w, p: Promised) -> list:
    problems = []
    live = set(w.trajectories())
    for traj, n in p.tokens.items():
        if traj in p.finalized:
            if traj in live:
                problems.append(("lost", f"{traj}: its finalize was acknowledged, yet it is live again"))
            continue
        if traj not in live and traj in p.finalizing:
            continue  # its finalize had started: it may be durable
        got = w.length(traj) if traj in live else 0
        if got < n:
            problems.append(("lost", f"{traj}: {n} tokens acknowledged, {got} after recovery"))
    for traj in sorted(live):
        n = w.length(traj)
        if (w.tokens(traj) != [token(traj, i) for i in range(n)] or w.logprobs(traj) != [logprob(traj, i) for i in range(n)]
                or w.policy_versions(traj) != [i // 50 for i in range(n)]):
            problems.append(("wrong", f"{traj}: the {n} recovered tokens are not the written prefix"))
    return problems


def check_env(env, p: Promised) -> list:
    problems = []
    for sb in set(p.env) | set(p.invoked) | p.released:
        entries = env.entries(sb)
        if sb in p.released:
            if entries:
                problems.append(("lost", f"{sb}: its release was acknowledged, yet {len(entries)} entries are back"))
            continue
        if sb in p.releasing and not entries:
            continue
        n, k = p.env.get(sb, 0), p.invoked.get(sb, 0)
        if len(entries) < max(n, k) or any(e.response is None for e in entries[:n]):
            problems.append(("lost", f"{sb}: {n} results and {k} invocations acknowledged, recovered "
                                     f"{sum(e.response is not None for e in entries)} results of {len(entries)} invocations"))
    for sb in env.sandboxes():
        for e in env.entries(sb):
            if e.request != request(sb, e.seq) or e.response not in (None, response(sb, e.seq)):
                problems.append(("wrong", f"{sb}: entry {e.seq} is not what was written"))
                break
    return problems


def log_config(segment_bytes: int, preallocate_bytes: int, spare_segments: bool,
               recycle_segments: bool = True, direct_io: bool = True) -> wal.WALConfig:
    return wal.WALConfig(segment_bytes=segment_bytes, preallocate_bytes=preallocate_bytes, spare_segments=spare_segments,
                         recycle_segments=recycle_segments, direct_io=direct_io, compact_live_fraction=0.6)


def tool_call(env, rec, sb: str, seq: int) -> None:
    env.invoke(sb, seq, request(sb, seq))
    rec.mark(("I", sb, seq + 1))
    env.result(sb, seq, response(sb, seq))
    rec.mark(("E", sb, seq + 1))


def release(env, rec, sb: str) -> None:
    rec.mark(("r", sb))
    env.release(sb)
    rec.mark(("R", sb))


def recovered(open_log, path: Path, check) -> list:
    """Open (recover) the log at `path` and check it; a refusal to open is the finding."""
    try:
        log = open_log(path, wal.WALConfig(preallocate_bytes=4096))
    except Exception as exc:  # noqa: BLE001  (any exception out of recovery)
        return [("refused", f"{type(exc).__name__}: {exc}")]
    try:
        return check(log)
    finally:
        log.close()


class TokenCase:
    """A rollout writer: appends (several per commit at times), batched decode steps, finalizes, tool
    calls and releases on one log; a reopen half-way (recovery of a live log)."""

    name = "wal"
    new_state = Promised

    def __init__(self, steps: int = 90, configs=CONFIGS):
        self.steps, self.configs = steps, configs

    @staticmethod
    def note(state, mark) -> None:
        note(state, mark)

    def config(self, seed: int) -> wal.WALConfig:
        return log_config(*self.configs[seed % len(self.configs)])

    def run(self, live: Path, rec, seed: int) -> None:
        rng = random.Random(seed)
        cfg = self.config(seed)
        w = wal.open(live / "wal", cfg)
        env = w.envlog()
        lengths: dict[str, int] = {}
        seqs: dict[str, int] = {}
        next_id = 1
        for step in range(self.steps):
            if step == self.steps // 2:  # a clean restart: recovery of a log that is in use
                w.close()
                w = wal.open(live / "wal", cfg)
                env = w.envlog()
            while len(lengths) < 4:
                lengths[f"t-{next_id}"] = 0
                next_id += 1
            traj = rng.choice(sorted(lengths))
            start = lengths[traj]
            n = min(rng.choice([1, 1, 2, 5, 17, 64]), 50 - start % 50)  # one policy version per 50 positions
            w.append(traj, start, [token(traj, q) for q in range(start, start + n)],
                     [logprob(traj, q) for q in range(start, start + n)], start // 50)
            lengths[traj] = start + n
            if rng.random() < 0.4:  # several appends in one commit (one flush of several frames)
                other = rng.choice(sorted(lengths))
                s2 = lengths[other]
                w.append(other, s2, [token(other, s2)], [logprob(other, s2)], s2 // 50)
                lengths[other] = s2 + 1
            if rng.random() < 0.3:  # batched decode steps: one token for every live trajectory, 1-3 steps in a row
                for _ in range(1 + step % 3):  # (a run over the same ids takes the step group's row path)
                    for version in sorted({q // 50 for q in lengths.values()}):
                        ids = [t for t in sorted(lengths) if lengths[t] // 50 == version]
                        pos = [lengths[t] for t in ids]
                        _step(w, ids, pos, version, numpy_form=step % 2 == 0)
                        for t in ids:
                            lengths[t] += 1
            w.commit()
            rec.mark(("A", dict(lengths)))
            if rng.random() < 0.12:
                done = rng.choice(sorted(lengths))
                rec.mark(("f", done))
                w.finalize(done)
                rec.mark(("F", done))
                del lengths[done]
                if cfg.recycle_segments:  # reclaim now, in this thread: dead segments become later ones
                    w.reclaim()
            while len(seqs) < 2:
                seqs[f"sb-{next_id}"] = 0
                next_id += 1
            if rng.random() < 0.15:
                sb = rng.choice(sorted(seqs))
                tool_call(env, rec, sb, seqs[sb])
                seqs[sb] += 1
            if rng.random() < 0.03:
                sb = rng.choice(sorted(seqs))
                release(env, rec, sb)
                del seqs[sb]
        w.close()

    def check(self, image: Path, p: Promised) -> list:
        return recovered(wal.open, image / "wal", lambda w: self._check_and_resume(w, p))

    @staticmethod
    def _check_and_resume(w, p: Promised) -> list:
        problems = check_tokens(w, p) + check_env(w.envlog(), p)
        if not problems:  # resume: the next token of every live trajectory is accepted and durable
            for traj in w.trajectories():
                q = w.length(traj)
                w.append(traj, q, [token(traj, q)], [logprob(traj, q)], q // 50)
            w.commit()
        return problems


class EnvCase:
    """A sandbox service's environment log alone: invoke, run, result, release, for a few sandboxes."""

    name = "envlog"
    new_state = Promised

    def __init__(self, calls: int = 60, config: tuple = (8192, 2048, False)):
        self.calls, self.cfg = calls, config

    @staticmethod
    def note(state, mark) -> None:
        note(state, mark)

    def run(self, live: Path, rec, seed: int) -> None:
        rng = random.Random(seed)
        env = wal.open_envlog(live / "env", log_config(*self.cfg))
        seqs: dict[str, int] = {}
        next_id = 1
        for _ in range(self.calls):
            while len(seqs) < 3:
                seqs[f"sb-{next_id}"] = 0
                next_id += 1
            sb = rng.choice(sorted(seqs))
            tool_call(env, rec, sb, seqs[sb])
            seqs[sb] += 1
            if rng.random() < 0.08:
                release(env, rec, sb)
                del seqs[sb]
        env.close()

    def check(self, image: Path, p: Promised) -> list:
        return recovered(wal.open_envlog, image / "env", lambda env: check_env(env, p))
