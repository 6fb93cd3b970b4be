"""Store: one log directory with its token index and environment index, recovery and retention.

TokenWAL and EnvLog are thin façades over a Store; both kinds of record share one log, one mutex
and one group commit. Retention: after a segment rolls, a background thread looks at the oldest
sealed segments; a segment with no live record (token records of unfinalized trajectories and
environment records of unreleased sandboxes are live) is deleted; one with a small live fraction has its live records
copied to the head of the log (committed) and is then deleted. Only the oldest segment is ever
removed, so a finalize record always outlives the token records it kills; before it goes, its id is
kept in the tombstone file (`wal/tombstones.py`), so a finalized trajectory stays finalized.
"""
from __future__ import annotations

import logging
import operator
import threading
from pathlib import Path

import numpy as np

from wal import codec, cuts, segments, tombstones
from wal.config import WALConfig
from wal.envindex import EnvIndex
from wal.errors import ConflictError, CorruptionError, GapError, WALError
from wal.index import TokenIndex, Trajectory
from wal.log import Log
from wal.types import EnvInvokeRecord, EnvReleaseRecord, EnvResultRecord, FinalizeRecord, Record, Starts, StepRecord, TokensRecord


class Store:
    def __init__(self, path: str | Path, config: WALConfig | None = None, *, repair: bool = False):
        self.config = config or WALConfig()
        self._replayed_lsn = -1  # during replay every record read is durable (the log does not exist yet)
        self.tokens = TokenIndex(lambda: self._replayed_lsn)
        self.env = EnvIndex()
        self._deferred: dict[str, list[TokensRecord]] = {}
        self.ignored_records = 0
        self._reclaim_wanted = threading.Event()
        self._stop = threading.Event()
        self.log = Log(path, segment_bytes=self.config.segment_bytes, on_record=self._replay, repair=repair,
                       on_roll=self._reclaim_wanted.set, preallocate_bytes=self.config.preallocate_bytes,
                       spare_segments=self.config.spare_segments, recycle_segments=self.config.recycle_segments,
                       direct_io=self.config.direct_io)
        try:
            self._cuts = cuts.read(self.log.directory)
            self._finish_replay(repair)
            self.tokens.forgotten = tombstones.read(self.log.directory, mutate=True)
            revived = self.tokens.forgotten.intersection(self.tokens.trajs)
            if revived:
                raise CorruptionError(f"WAL {self.log.directory}: trajectories {sorted(revived)[:5]} have token records "
                                      f"but are in {tombstones.FILE_NAME} (finalized and reclaimed)")
        except BaseException:
            self.log.close()
            raise
        self.tokens.durable_lsn = lambda: self.log.durable_lsn
        self.mutex = self.log.mutex
        # Whether a finalize or release since the last retention pass may have made records dead: a roll
        # with nothing dead (and the sealed bytes within retain_bytes) then costs no segment read. After
        # replay with nothing remembered as finalized or released, every record on disk is live (a dead
        # record's finalize or release record is reclaimed only after it).
        self._maybe_dead = bool(self.tokens.finalized or self.env.released)
        self.reclaimed_segments = 0
        self.copied_records = 0
        self.scanned_segments = 0  # sealed segments read by retention passes
        self._reclaim_lock = threading.Lock()
        self._reclaimer = threading.Thread(target=self._reclaim_loop, name=f"wal-reclaim:{path}", daemon=True)
        self._reclaimer.start()
        if len(self.log.segment_list()) > 1:
            self._reclaim_wanted.set()

    # --- recovery ---
    def _replay(self, rec: Record) -> None:
        if type(rec) is StepRecord:
            self._replayed_lsn = rec.lsn
            if not self._replay_step(rec):
                for item in rec.items():
                    self._replay(item)
                self._start_replay_group(rec)
            return
        if type(rec) is TokensRecord:
            traj = self.tokens.trajs.get(rec.traj_id)
            if traj is not None and rec.start == traj.length:  # the common case: the next chunk, in order
                traj.add(rec.tokens, rec.logprobs, rec.policy_version)
                return
            if rec.traj_id in self.tokens.finalized:
                self.ignored_records += 1
                return
            traj = self.tokens.trajs.get(rec.traj_id)
            if rec.start > (traj.length if traj else 0):
                # a compacted copy arrives after later records; copied out of the segment's buffer, which it would pin
                self._deferred.setdefault(rec.traj_id, []).append(rec._replace(tokens=bytes(rec.tokens), logprobs=bytes(rec.logprobs)))
                return
            self._replay_tokens(rec)
        elif isinstance(rec, FinalizeRecord):
            self.tokens.finalize(rec.traj_id)
            self._deferred.pop(rec.traj_id, None)
        elif isinstance(rec, EnvInvokeRecord):
            self.env.replay("invoke", rec.sandbox_id, rec.seq, rec.request, rec.lsn)
        elif isinstance(rec, EnvResultRecord):
            self.env.replay("result", rec.sandbox_id, rec.seq, rec.response, rec.lsn)
        elif isinstance(rec, EnvReleaseRecord):
            self.env.release(rec.sandbox_id)

    def _replay_step(self, rec: StepRecord) -> bool:
        """Replay a STEP record that is the next row of the index's step group (the same trajectories, each at
        its next position), as the append path logs it: one row copy instead of one record per trajectory.
        False (nothing changed) for anything else."""
        g = self.tokens.group
        if g is None or g.n != len(rec.traj_ids):
            return False
        starts = rec.starts
        packed = starts.packed if type(starts) is Starts else codec.pack_positions(starts)
        if packed != g.next_starts or (rec.traj_ids is not g.key and list(rec.traj_ids) != g.ids):
            return False
        g.key = rec.traj_ids  # the scan's records share this tuple while the ids stay the same
        if g.rows >= g.capacity:
            self.tokens.start_group(g.ids, g.trajs)  # the full group dissolves into its trajectories first
            g = self.tokens.group
            g.key = rec.traj_ids
        g.add_row(rec.tokens, rec.logprobs, rec.policy_version, rec.lsn)
        return True

    def _start_replay_group(self, rec: StepRecord) -> None:
        """After a STEP record replayed item by item: when each of its trajectories now ends right after its item
        (none was finalized, deferred or out of order), the next records over them take _replay_step."""
        trajs = self.tokens.trajs
        objs = [trajs.get(t) for t in rec.traj_ids]
        if None not in objs and all(t.length == s + 1 for t, s in zip(objs, rec.starts)):
            self.tokens.start_group(list(rec.traj_ids), objs).key = rec.traj_ids

    def _replay_tokens(self, rec: TokensRecord) -> None:
        try:
            part = self.tokens.new_part(rec.traj_id, rec.start, rec.tokens, rec.logprobs, rec.policy_version)
        except (ConflictError, GapError) as exc:
            raise CorruptionError(f"WAL record lsn {rec.lsn} contradicts earlier records: {exc}") from None
        if part is not None:
            pos, skip = part
            self.tokens.apply(rec.traj_id, pos, rec.tokens[skip * 4:], rec.logprobs[skip * 8:], rec.policy_version, rec.lsn)

    def _finish_replay(self, repair: bool) -> None:
        """Apply the records that came before the positions they follow (compacted copies), skipping those a
        repair cut. A hole left fails the open, or under repair cuts the trajectory at it, durably (`cuts`)."""
        new_cuts: dict[str, tuple[int, int]] = {}
        for traj_id, recs in self._deferred.items():
            recs = sorted(recs, key=lambda r: (r.start, r.lsn))
            for i, rec in enumerate(recs):
                if cuts.is_cut(self._cuts, traj_id, rec.start, rec.lsn):
                    self.ignored_records += 1
                    continue
                traj = self.tokens.trajs.get(traj_id)
                length = traj.length if traj else 0
                if rec.start > length:
                    if not repair:
                        raise CorruptionError(f"WAL {self.log.directory}: trajectory {traj_id!r} has a hole before position "
                                              f"{rec.start} (records were lost); open with repair=True to keep its contiguous prefix")
                    new_cuts[traj_id] = (length, max(r.lsn for r in recs[i:]))
                    break
                self._replay_tokens(rec)
        self._deferred = {}
        if new_cuts:  # durable before the log takes an append that reuses the cut positions
            for traj_id, cut in new_cuts.items():
                self._cuts.setdefault(traj_id, []).append(cut)
            cuts.write(self.log.directory, self._cuts)
            self.log.report.repaired = True
        durable = self.log.durable_lsn
        self.env.finish_replay(durable)
        for traj in self.tokens.trajs.values():
            traj.pending.clear()
            traj.durable_len = traj.length

    # --- writes ---
    def append_tokens(self, traj_id: str, start: int, tokens, logprobs, policy_version: int) -> int:
        tok = codec.pack_tokens(tokens)
        return self._append(traj_id, start, tok, codec.pack_logprobs(logprobs, len(tok) // 4), policy_version)

    def append_packed(self, traj_id: str, start: int, tokens: bytes, logprobs: bytes, policy_version: int) -> int:
        """append_tokens for tokens and log-probs already packed as they travel (the gRPC service)."""
        codec.check_packed(tokens, logprobs)
        return self._append(traj_id, start, bytes(tokens), bytes(logprobs), policy_version)

    def _append(self, traj_id: str, start: int, tok: bytes, lp: bytes, policy_version: int) -> int:
        n = len(tok) // 4
        if type(start) is not int or type(policy_version) is not int:
            start, policy_version = _index(start, "start"), _index(policy_version, "policy_version")
        if not 0 <= policy_version < codec.U64_LIMIT:
            codec.check_u64(policy_version, "policy_version")
        step = self.config.max_record_tokens
        with self.mutex:
            self.log.check_open()
            traj = self.tokens.trajs.get(traj_id) if type(traj_id) is str else None  # finalized ones are not in it
            if traj is not None and start == traj.length and 0 < n <= step:  # the common case: the next chunk, one record
                idb = traj.idb
                lsn = self.log.append_locked(lambda lsn, mark: codec.encode_tokens_id(lsn, idb, start, policy_version, tok, lp, mark))
                traj.add_record(tok, lp, policy_version, lsn)
            else:
                self._append_checked(traj_id, start, tok, lp, policy_version, n)
            big = self.log.batch_bytes > self.config.max_batch_bytes
        if big:
            self.log.commit()
        return start + n

    def _append_checked(self, traj_id: str, start: int, tok: bytes, lp: bytes, policy_version: int, n: int) -> None:
        """_append for anything but the next chunk of a known trajectory (caller holds the mutex): new
        trajectories, repeats, gaps, rewrites, finalized ones, records to split."""
        codec._id_bytes(traj_id, "traj_id")
        step = self.config.max_record_tokens
        part = self.tokens.new_part(traj_id, start, tok, lp, policy_version)
        if part is not None:
            pos, skip = part
            while skip < n:
                k = min(step, n - skip)
                t, l = tok[skip * 4:(skip + k) * 4], lp[skip * 8:(skip + k) * 8]
                lsn = self.log.append_locked(lambda lsn, mark: codec.encode_tokens(lsn, traj_id, pos, policy_version, t, l, mark))
                self.tokens.apply(traj_id, pos, t, l, policy_version, lsn)
                pos, skip = pos + k, skip + k

    def append_step(self, traj_ids, positions, tokens, logprobs, policy_version: int) -> None:
        """One decode step: token i goes to traj_ids[i] at positions[i], as one STEP record (one frame,
        one checksum). All items are checked before anything is written (a gap, rewrite or finalized
        trajectory fails the whole step); exact repeats are dropped from the record. The common case
        (every trajectory known, every position its next) costs a few list operations per step."""
        if self._step_fast(traj_ids, positions, tokens, logprobs, policy_version):
            return
        n = len(traj_ids)
        tok = codec.pack_tokens(tokens)
        lp = codec.pack_logprobs(logprobs, len(tok) // 4)
        if len(tok) // 4 != n or len(positions) != n:
            raise codec.CodecError(f"append_step: {n} trajectory ids, {len(positions)} positions, {len(tok) // 4} tokens; "
                                   f"there must be one of each per trajectory")
        starts = codec.positions_bytes(positions)  # checked below unless they are the group's next positions
        codec.check_u64(_index(policy_version, "policy_version"), "policy_version")
        if not n:
            return
        with self.mutex:  # the common case: the same trajectories as the last step, each at its next position
            g = self.tokens.group
            fast = g is not None and g.matches(traj_ids, starts)
            if fast:
                self.log.check_open()
                lsn = self.log.append_locked(lambda lsn, mark: codec.encode_step_blob(
                    lsn, n, g.lens, g.ids_blob, starts, policy_version, tok, lp, mark))
                g.add_row(tok, lp, policy_version, lsn)
                big = self.log.batch_bytes > self.config.max_batch_bytes
        if fast:
            if big:
                self.log.commit()
            return
        starts = codec.pack_positions(positions)  # the range check the fast path did not need
        if len(set(traj_ids)) != n:  # a trajectory twice in one step: checked whole, then written item by item
            at = np.frombuffer(starts, "<i8").tolist()
            with self.mutex:
                self.log.check_open()
                self._check_items(traj_ids, at, tok, lp, policy_version)
                for i in range(n):
                    self._append_checked(traj_ids[i], at[i], tok[i * 4:i * 4 + 4], lp[i * 8:i * 8 + 8], policy_version, 1)
                big = self.log.batch_bytes > self.config.max_batch_bytes
            if big:
                self.log.commit()
            return
        with self.mutex:
            self.log.check_open()
            objs = list(map(self.tokens.trajs.get, traj_ids))
            if None in objs or [t.length for t in objs] != np.frombuffer(starts, "<i8").tolist():
                objs, traj_ids, starts, tok, lp = self._step_slow(objs, traj_ids, starts, tok, lp, policy_version)
                if not objs:
                    return  # all exact repeats
            ids = [t.idb for t in objs]
            lsn = self.log.append_locked(lambda lsn, mark: codec.encode_step_record(lsn, ids, starts, policy_version, tok, lp, mark))
            trajs = self.tokens.trajs
            for tid, t in zip(traj_ids, objs):
                if t.length == 0 and tid not in trajs:
                    trajs[tid] = t
            if len(objs) == n:  # every item written: the next steps over these trajectories take the fast path
                self.tokens.start_group(traj_ids, objs).add_row(tok, lp, policy_version, lsn)
            else:
                self.tokens.apply_step(objs, tok, lp, policy_version, lsn)
            big = self.log.batch_bytes > self.config.max_batch_bytes
        if big:
            self.log.commit()

    def _check_items(self, traj_ids, positions: list[int], tok: bytes, lp: bytes, policy_version: int) -> None:
        """Raise what writing the items of a step one by one, in order, would raise (a gap, a rewrite, a
        finalized trajectory), before any of them is written (caller holds the mutex)."""
        added: dict[str, tuple[int, bytearray, bytearray]] = {}  # trajectory -> (first position the step adds, them)
        for i, t in enumerate(traj_ids):
            codec._id_bytes(t, "traj_id")
            p, ti, li = positions[i], tok[i * 4:i * 4 + 4], lp[i * 8:i * 8 + 8]
            first, toks, lps = added.get(t, (None, None, None))
            if first is None or p < first:  # against the log
                if self.tokens.new_part(t, p, ti, li, policy_version) is not None and first is None:
                    added[t] = (p, bytearray(ti), bytearray(li))
            elif p < first + len(toks) // 4:  # against an earlier item of this step
                k = p - first
                if toks[k * 4:k * 4 + 4] != ti or lps[k * 8:k * 8 + 8] != li:
                    raise ConflictError(f"trajectory {t!r}: the step writes position {p} twice, with different "
                                        "tokens or log-probs")
            elif p == first + len(toks) // 4:
                toks += ti
                lps += li
            else:
                raise GapError(f"trajectory {t!r}: the step's item at position {p} leaves a gap after position "
                               f"{first + len(toks) // 4 - 1}")

    def _step_fast(self, traj_ids, positions, tokens, logprobs, policy_version) -> bool:
        """append_step for a step given as a decode loop holds it (int32 tokens, float64 log-probs and
        int64 positions as numpy arrays, or lists of Python ints and floats; an int version) that is the step
        group's next row: checked, encoded and added in one StepGroup.encode_row. True when it is logged.
        Anything else (other types, a bad value, other ids or positions, a closed log) returns False before
        changing anything, and the general path takes the step (and raises what it raises)."""
        g = self.tokens.group
        if g is None or type(policy_version) is not int or not 0 <= policy_version < codec.U64_LIMIT:
            return False
        log = self.log
        with self.mutex:
            if self.tokens.group is not g or log.check_failed() or not g.same_ids(traj_ids):
                return False
            if log.append_locked(g.encode_row, positions, tokens, logprobs, policy_version) is None:
                return False
            big = log.batch_bytes > self.config.max_batch_bytes
        if big:
            log.commit()
        return True

    def _step_slow(self, objs, traj_ids, starts, tok, lp, version):
        """Check a step item by item (new trajectories, repeats, gaps, rewrites, finalized ones; raises on
        the first bad one, before anything changed). Returns the items to write: (trajectories, ids,
        starts, tokens, log-probs), new trajectories as fresh, not yet indexed, objects."""
        pos = np.frombuffer(starts, "<i8").tolist()
        keep = []
        for i, t in enumerate(objs):
            if t is not None and pos[i] == t.length:
                keep.append(i)
                continue
            if t is None:
                codec._id_bytes(traj_ids[i], "traj_id")
            if self.tokens.new_part(traj_ids[i], pos[i], tok[i * 4:i * 4 + 4], lp[i * 8:i * 8 + 8], version) is not None:
                keep.append(i)  # a new trajectory at position 0 (new_part raised on gap, rewrite, finalized)
        out = [objs[i] if objs[i] is not None else Trajectory(traj_ids[i].encode("utf-8")) for i in keep]
        if len(keep) == len(objs):
            return out, traj_ids, starts, tok, lp
        return (out, [traj_ids[i] for i in keep], b"".join(starts[i * 8:i * 8 + 8] for i in keep),
                b"".join(tok[i * 4:i * 4 + 4] for i in keep), b"".join(lp[i * 8:i * 8 + 8] for i in keep))

    def finalize(self, traj_id: str) -> int:
        return self.finalize_many([traj_id])

    def finalize_many(self, traj_ids) -> int:
        """Finalize records of every id not finalized yet, then one commit."""
        for traj_id in traj_ids:
            codec._id_bytes(traj_id, "traj_id")
        with self.mutex:
            self.log.check_open()
            for traj_id in traj_ids:
                if traj_id not in self.tokens.finalized and traj_id not in self.tokens.forgotten:
                    self.log.append_locked(lambda lsn, mark, t=traj_id: codec.encode_finalize(lsn, t, mark))
                    self.tokens.finalize(traj_id)
                    self._maybe_dead = True
        return self.log.commit()

    def env_invoke(self, sandbox_id: str, seq: int, request: bytes) -> int:
        request, seq = _as_bytes(request, "request"), _index(seq, "seq")
        with self.mutex:
            self.log.check_open()
            if self.env.needs_invoke(sandbox_id, seq, request):
                lsn = self.log.append_locked(lambda lsn, mark: codec.encode_env_invoke(lsn, sandbox_id, seq, request, mark))
                self.env.apply_invoke(sandbox_id, seq, request, lsn)
        return self.log.commit()

    def env_result(self, sandbox_id: str, seq: int, response: bytes) -> int:
        response, seq = _as_bytes(response, "response"), _index(seq, "seq")
        with self.mutex:
            self.log.check_open()
            if self.env.needs_result(sandbox_id, seq, response):
                lsn = self.log.append_locked(lambda lsn, mark: codec.encode_env_result(lsn, sandbox_id, seq, response, mark))
                self.env.apply_result(sandbox_id, seq, response, lsn)
        return self.log.commit()

    def env_release(self, sandbox_id: str) -> int:
        codec._id_bytes(sandbox_id, "sandbox_id")
        with self.mutex:
            self.log.check_open()
            if sandbox_id not in self.env.released:
                self.log.append_locked(lambda lsn, mark: codec.encode_env_release(lsn, sandbox_id, mark))
                self.env.release(sandbox_id)
                self._maybe_dead = True
        return self.log.commit()

    def commit(self) -> int:
        return self.log.commit()

    # --- retention ---
    def _live(self, rec: Record) -> bool:
        if isinstance(rec, TokensRecord):
            return self._live_item(rec.traj_id, rec.start, rec.lsn)
        if isinstance(rec, StepRecord):  # copied while any of its items lives, without the others (`_live_items`)
            if self._cuts:
                return any(self._live_item(t, p, rec.lsn) for t, p in zip(rec.traj_ids, rec.starts))
            return not self.tokens.finalized.issuperset(rec.traj_ids)
        if isinstance(rec, (EnvInvokeRecord, EnvResultRecord)):
            return rec.sandbox_id not in self.env.released
        return False  # finalize and release records only matter while older records of their id exist

    def _live_item(self, traj_id: str, start: int, lsn: int) -> bool:
        return traj_id not in self.tokens.finalized and not cuts.is_cut(self._cuts, traj_id, start, lsn)

    def reclaim(self, lookahead: int = 16) -> int:
        """Delete or compact old segments now; returns how many segments were removed.

        A pass reads segments only when a finalize or release happened since the last one (or the sealed
        bytes exceed `retain_bytes`): records are live when appended and die only through those. Only
        a prefix of the log can go. The shortest prefix (up to `lookahead` segments) whose live
        fraction is at most `compact_live_fraction` is compacted: its live records are copied to the
        head and committed, then its files deleted. A mostly-live oldest segment (where earlier copies
        landed) therefore does not pin the dead segments behind it.
        """
        removed = 0
        with self._reclaim_lock:
            with self.mutex:
                todo = self.log.sealed_segments()
                if not self._maybe_dead and sum(p.stat().st_size for _, p in todo) <= self.config.retain_bytes:
                    return 0  # every sealed record was live at the last pass, and none died since
                self._maybe_dead = False
            i = 0
            while i < len(todo):
                live_bytes = total = 0
                prefix = []
                for base, path in todo[i:i + lookahead]:
                    recs = self._segment_records(base, path)
                    with self.mutex:
                        live_bytes += sum(_frame_bytes(r) for r in recs if self._live(r))
                        sealed = sum(p.stat().st_size for _, p in self.log.sealed_segments())
                    total += path.stat().st_size
                    prefix.append((base, recs))
                    if live_bytes <= self.config.compact_live_fraction * total or sealed > self.config.retain_bytes:
                        break
                else:
                    break  # no short prefix is worth rewriting yet
                for base, recs in prefix:
                    self._compact(base, recs)
                    removed += 1
                i += len(prefix)
        return removed

    def _segment_records(self, base: int, path: Path) -> list[Record]:
        self.scanned_segments += 1
        buf = path.read_bytes()
        recs = [r for _, r in codec.iter_frames(buf, codec.SEGMENT_HEAD_BYTES, base)]
        end = sum(_frame_bytes(r) for r in recs) + codec.SEGMENT_HEAD_BYTES
        if codec.segment_header(buf)[1]:  # recycled: older frames may follow, but no frame of a later lsn
            damaged = codec.find_valid_after(buf, end - 1, recs[-1].lsn if recs else base - 1, dense=True) is not None
        else:  # only zeros may follow (a crash before the roll's truncate)
            damaged = bool(recs) and segments.nonzero_end(buf, end) != end
        if damaged:
            raise CorruptionError(f"sealed segment {path} does not decode to its end; run `postrain wal verify`")
        return recs

    def _compact(self, base: int, recs: list[Record]) -> None:
        with self.mutex:  # liveness re-checked under the mutex: a finalize cannot slip between check and copy
            live = [_live_items(r, self._live_item) if type(r) is StepRecord else r for r in recs if self._live(r)]
            for r in live:
                self.log.append_locked(lambda lsn, mark, r=r: codec.encode(r, lsn, mark))
            self.copied_records += len(live)
        if live:
            self.log.commit()
        with self.mutex:
            tombs = [r for r in recs if isinstance(r, FinalizeRecord) and r.traj_id not in self.tokens.forgotten]
        tombstones.append(self.log.directory, tombs)  # durable before the finalize records are deleted
        self.log.delete_oldest(base)
        with self.mutex:
            for r in tombs:
                self.tokens.forgotten.add(r.traj_id)
            for r in recs:
                if isinstance(r, FinalizeRecord):
                    self.tokens.finalized.discard(r.traj_id)
                elif isinstance(r, EnvReleaseRecord):
                    self.env.released.discard(r.sandbox_id)
            self.reclaimed_segments += 1

    def _reclaim_loop(self) -> None:
        while not self._stop.is_set():
            self._reclaim_wanted.wait()
            self._reclaim_wanted.clear()
            if self._stop.is_set():
                return
            try:
                self.reclaim()
            except WALError as exc:  # poisoned, closed or damaged: callers see it themselves; stop reclaiming
                logging.getLogger("wal").warning("retention stopped for %s: %s", self.log.directory, exc)
                return

    # --- reads ---
    def stats(self) -> dict:
        with self.mutex:
            trajs = self.tokens.trajs
            segs = self.log.segment_list()
            return {
                "directory": str(self.log.directory),
                "segments": len(segs),
                "disk_bytes": self.log.disk_bytes(),
                "next_lsn": self.log.next_lsn,
                "durable_lsn": self.log.durable_lsn,
                "trajectories": len(trajs),
                "live_tokens": sum(t.length for t in trajs.values()),
                "finalized_remembered": len(self.tokens.finalized),
                "finalized_forgotten": len(self.tokens.forgotten),  # in the tombstone file
                "sandboxes": len(self.env.sandboxes),
                "released_remembered": len(self.env.released),
                "fsyncs": self.log.fsyncs,  # flushes (each one durable write: fdatasync, fsync or a direct write)
                "direct_writes": self.log.direct_writes,  # of them, written with O_DIRECT + RWF_DSYNC
                "bytes_written": self.log.bytes_written,
                "reclaimed_segments": self.reclaimed_segments,
                "recycled_segments": self.log.segments_recycled,
                "spares_used": self.log.spares_used,  # rolls into a spare (built ahead, or recycled)
                "copied_records": self.copied_records,
                "scanned_segments": self.scanned_segments,
                "recovery": {"torn_bytes_cut": self.log.report.torn_bytes_cut, "torn_files": self.log.report.torn_files,
                             "repaired": self.log.report.repaired},
            }

    def close(self) -> None:
        self._stop.set()
        self._reclaim_wanted.set()
        if self._reclaimer.is_alive() and self._reclaimer is not threading.current_thread():
            self._reclaimer.join(timeout=60)
        self.log.close()


def _live_items(rec: StepRecord, live) -> StepRecord:
    """The step without its dead items (`live(traj_id, start, lsn)` false: a finalized trajectory's, whose copy
    must not outlive its finalize record, or one a repair cut, whose copy would escape the cut)."""
    keep = [i for i, (t, p) in enumerate(zip(rec.traj_ids, rec.starts)) if live(t, p, rec.lsn)]
    if len(keep) == len(rec.traj_ids):
        return rec
    tok, lp = bytes(rec.tokens), bytes(rec.logprobs)
    return StepRecord(rec.lsn, rec.policy_version, tuple(rec.traj_ids[i] for i in keep), tuple(rec.starts[i] for i in keep),
                      b"".join(tok[i * 4:i * 4 + 4] for i in keep), b"".join(lp[i * 8:i * 8 + 8] for i in keep))


def _frame_bytes(rec: Record) -> int:
    """Encoded size of a record, without encoding it."""
    if isinstance(rec, TokensRecord):
        body = 9 + codec.TOKENS_HEAD.size + len(rec.traj_id.encode()) + len(rec.tokens) + len(rec.logprobs)
    elif isinstance(rec, StepRecord):
        body = (9 + codec.STEP_HEAD.size + 10 * len(rec.traj_ids) + sum(len(t.encode()) for t in rec.traj_ids)
                + len(rec.tokens) + len(rec.logprobs))
    elif isinstance(rec, FinalizeRecord):
        body = 9 + codec.ID_HEAD.size + len(rec.traj_id.encode())
    elif isinstance(rec, EnvReleaseRecord):
        body = 9 + codec.ID_HEAD.size + len(rec.sandbox_id.encode())
    else:
        data = rec.request if isinstance(rec, EnvInvokeRecord) else rec.response
        body = 9 + codec.ENV_HEAD.size + len(rec.sandbox_id.encode()) + len(data)
    return codec.FRAME.size + body


def _index(value, what: str) -> int:
    """An integer argument (int, numpy integer, …); floats and strings are refused."""
    try:
        return operator.index(value)
    except TypeError:
        raise codec.CodecError(f"{what} must be an integer, got {type(value).__name__}") from None


def _as_bytes(data, what: str) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise codec.CodecError(f"{what} must be bytes, got {type(data).__name__}")
    return bytes(data)
