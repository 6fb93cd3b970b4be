"""Writer subprocess for the crash tests: appends, commits, finalizes and logs env entries, printing an
acknowledgement line after every durable operation; the test SIGKILLs it at a random moment.

Tokens are a pure function of (trajectory, position) so the test knows what every position must hold.
    python tests/wal/crash_writer.py DIR SEED SEGMENT_BYTES [PREALLOCATE_BYTES [spare]]   (the tests fork it instead)

A preallocation smaller than the segment makes commits grow segments inline, or with `spare` roll into
spare segments built by the log's helper thread, so kills also land in extensions, in a spare's
construction and activation, and in trims.
"""
from __future__ import annotations

import random
import sys

import numpy as np

import wal


def token(traj: str, pos: int) -> int:
    return (hash_id(traj) * 1_000_003 + pos * 7919) % 150_000


def logprob(traj: str, pos: int) -> float:
    return -((hash_id(traj) + pos) % 1000) / 997.0


def hash_id(traj: str) -> int:
    return int(traj.split("-")[1])


def main(argv: list[str], out=sys.stdout) -> None:
    directory, seed, seg_bytes = argv[0], int(argv[1]), int(argv[2])
    prealloc = int(argv[3]) if len(argv) > 3 else 1 << 20
    rng = random.Random(seed)
    spare = len(argv) > 4 and argv[4] == "spare"
    w = wal.open(directory, wal.WALConfig(segment_bytes=seg_bytes, preallocate_bytes=prealloc, spare_segments=spare,
                                          compact_live_fraction=0.6))
    env = w.envlog()
    # resume what an earlier (killed) writer left: continue after the last committed token
    live = {t: w.length(t) for t in w.trajectories()}
    next_id = seed * 100_000  # fresh ids per run: a finalized id is never reused
    seqs = {s: len(env.entries(s)) for s in env.sandboxes()}
    for sb, n in seqs.items():  # killed between invoke and result: replay finishes the call
        if env.get(sb, n - 1).response is None:
            env.result(sb, n - 1, f"{sb} result {n - 1}".encode())
    out.write("ready\n")
    out.flush()
    while True:
        while len(live) < 4:
            live[f"t-{next_id}"] = 0
            next_id += 1
        traj = rng.choice(sorted(live))
        start = live[traj]
        n = rng.choice([1, 1, 2, 5, 17, 64])
        n = min(n, 50 - start % 50)  # one policy version per 50 positions: records never straddle a change
        w.append(traj, start, [token(traj, p) for p in range(start, start + n)],
                 [logprob(traj, p) for p in range(start, start + n)], start // 50)
        if rng.random() < 0.3:  # several appends share one commit sometimes
            continue_traj = rng.choice(sorted(live))
            if continue_traj != traj:
                s2 = live[continue_traj]
                w.append(continue_traj, s2, [token(continue_traj, s2)], [logprob(continue_traj, s2)], s2 // 50)
                live[continue_traj] = s2 + 1
        live[traj] = start + n
        if rng.random() < 0.2:  # batched decode steps: one token for every live trajectory (one call per version),
            for rep in range(1 + len(live) % 3):  # 1-3 in a row, as lists or as numpy arrays (the C step)
                for version in sorted({live[t] // 50 for t in live}):
                    ids = [t for t in sorted(live) if live[t] // 50 == version]
                    pos = [live[t] for t in ids]
                    tok, lp = [token(t, p) for t, p in zip(ids, pos)], [logprob(t, p) for t, p in zip(ids, pos)]
                    if rep % 2:
                        w.append_step(ids, np.array(pos, np.int64), np.array(tok, np.int32), np.array(lp), version)
                    else:
                        w.append_step(ids, pos, tok, lp, version)
                    for t in ids:
                        live[t] += 1
        w.commit()
        out.write("A " + " ".join(f"{t}:{k}" for t, k in sorted(live.items())) + "\n")
        if rng.random() < 0.05:
            done = rng.choice(sorted(live))
            out.write(f"f {done}\n")  # intent: from here on the finalize may or may not be durable
            out.flush()
            w.finalize(done)
            del live[done]
            out.write(f"F {done}\n")
        while len(seqs) < 3:
            seqs[f"sb-{next_id}"] = 0
            next_id += 1
        if rng.random() < 0.02:  # a sandbox is done: release it (its records become reclaimable)
            sb = rng.choice(sorted(seqs))
            out.write(f"r {sb}\n")
            out.flush()
            env.release(sb)
            del seqs[sb]
            out.write(f"R {sb}\n")
        if rng.random() < 0.1:
            sb = rng.choice(sorted(seqs))
            seq = seqs.get(sb, 0)
            env.invoke(sb, seq, f"{sb} call {seq}".encode())
            env.result(sb, seq, f"{sb} result {seq}".encode())
            seqs[sb] = seq + 1
            out.write(f"E {sb} {seq + 1}\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
