"""A rollout worker: engine + token WAL + KV snapshot store + sandbox gateway; and its Ray actor shell.

`RolloutWorker` is a plain class (tests run it in one process); `RolloutActor` is the Ray actor that
wraps it and adds nothing but its pid. Commit order in `run`: the engine draws a token for each
running request → the draws are appended to the WAL and committed (in the background, while the
next steps decode: `commit.AsyncCommitter`) → only once that commit returned does the pool's stream
see the tokens, a tool get called or a trajectory finish.

Admission resumes from the WAL: the committed tokens of a trajectory are loaded, a KV snapshot is
used when it validates (trajectory, token prefix, policy version, model fingerprint, dtype, crc),
else the committed tokens are re-prefilled; both paths are counted with the rejection reason.
Finishing: verify with the domain's verifier → report to the pool, which puts the trajectory into the
data plane and acknowledges; the WAL finalize happens on that acknowledgement (next call), so a crash
in between only repeats an idempotent put.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

import rewards
import wal as wal_mod
from rollout import agent, restore
from rollout.commit import AsyncCommitter
from rollout.config import EngineConfig
from rollout.engine import Engine
from rollout.snapshot import SnapshotStore, encode
from rollout.types import ENV_LOGPROB, Finished, Request, WorkerReport, is_sampled

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WorkerSpec:
    """Everything a worker incarnation needs; a replacement gets the same spec (same WAL)."""

    name: str
    checkpoint: str
    wal_path: str  # in-process WAL directory (used when wal_addr is empty)
    snapshot_uri: str
    seed: int
    engine: EngineConfig = field(default_factory=EngineConfig)
    threads: int = 1
    wal_addr: str = ""
    wal_token: str | None = None
    sandbox_target: str = ""
    sandbox_token: str = ""
    max_tool_calls: int = 4
    wal_open_wait_s: float = 30.0
    max_commit_lag: int = 4  # WAL commits that may be in flight (their tokens unexposed)
    commit_group_steps: int = 1  # decode steps per WAL commit (1: every step is committed on its own)
    wal_segment_bytes: int = 64 << 20  # in-process WAL segment size (retention works on sealed segments)
    split_restore: bool = True  # re-prefill a resume's head while its snapshot's tail is read (rollout.restore)


def _open_wal(spec: WorkerSpec):
    if spec.wal_addr:
        return wal_mod.connect(spec.wal_addr, token=spec.wal_token)
    deadline = time.monotonic() + spec.wal_open_wait_s
    pause_s = 0.002
    while True:  # a killed predecessor may still hold the directory lock for a moment
        try:
            return wal_mod.open(spec.wal_path, wal_mod.WALConfig(
                segment_bytes=spec.wal_segment_bytes, preallocate_bytes=min(1 << 20, spec.wal_segment_bytes)))
        except wal_mod.LockedError:
            if time.monotonic() > deadline:
                raise
            # a replacement starts while `ray.kill` of its predecessor is still under way: the lock is free a few
            # ms later, and recovery waits on this loop, so look again soon (backing off to 0.1 s)
            time.sleep(pause_s)
            pause_s = min(0.1, pause_s * 2)


def load_for_engine(checkpoint: str, dtype: torch.dtype, device: str):
    """Model and tokenizer for an engine on `device`: on a CPU, a checkpoint LeanForward covers is loaded
    without transformers (`rollout/lite_model.py`: a worker starts on ~2 CPU-s of imports instead of
    ~4.5); anything else as its HF class."""
    if torch.device(device).type == "cpu":
        from rollout.lite_model import load_lite, load_lite_tokenizer

        model = load_lite(checkpoint, dtype)
        if model is not None:
            tok = load_lite_tokenizer(checkpoint)
            if tok is None:
                from core.hf import load_tokenizer

                tok = load_tokenizer(checkpoint)
            return model, tok
    from core.hf import load_policy

    return load_policy(checkpoint, dtype=dtype)


class RolloutWorker:
    def __init__(self, spec: WorkerSpec, weights: dict | None = None, policy_version: int = 0):
        torch.set_num_threads(spec.threads)
        self.spec = spec
        model, tok = load_for_engine(spec.checkpoint, DTYPES[spec.engine.dtype], spec.engine.device)
        if weights is not None:
            model.load_state_dict(weights, strict=True)
        e = spec.engine
        self.engine = Engine(model, tok, seed=spec.seed, max_batch=e.max_batch, max_len=e.max_len or None,
                             strict=e.strict, policy_version=policy_version, device=e.device,
                             static_decode=e.cuda_graphs and torch.device(e.device).type == "cuda",
                             decode_chunk=e.decode_chunk, compile_decode=e.compile_decode)
        self.wal = _open_wal(spec)
        self.committer = AsyncCommitter(self.wal, spec.max_commit_lag, spec.commit_group_steps)
        self.store = SnapshotStore(spec.snapshot_uri)
        self.split = restore.SplitPolicy(enabled=spec.split_restore)
        self.tools = agent.ToolGateway(spec.sandbox_target, spec.sandbox_token) if spec.sandbox_target else None
        self.queue: deque[Request] = deque()
        self.reqs: dict[str, Request] = {}
        self.prompt_len: dict[str, int] = {}
        self._prompt_ids: dict[str, list[int]] = {}  # each held request's prompt, encoded once (at submit)
        self.counters: Counter = Counter()
        self._stream: dict[str, tuple[int, list[int]]] = {}
        self._finished: list[Finished] = []
        self._done: list[tuple[str, list[int], str]] = []  # stopped in this call, not finished yet: (id, tokens, reason)
        self._already_final: list[str] = []
        self._tool_waiting: list[str] = []  # paused on a call the sandbox service did not answer: asked again
        self._stopped = False
        self._failed: BaseException | None = None  # what broke a run's decode or commit: the worker is done

    # -- pool interface ---------------------------------------------------------------------
    def submit(self, requests: list[Request]) -> None:
        """Queue the requests not held yet. Each new one is checked first (ValueError naming it, nothing queued):
        a prompt that encodes to no token or leaves no room for one would fail its whole admission batch."""
        new: dict[str, Request] = {}
        for r in requests:  # the first of an id wins, as a held one does
            if r.traj_id not in self.reqs:
                new.setdefault(r.traj_id, r)
        ids = {t: self._checked_prompt(r) for t, r in new.items()}
        for t, r in new.items():
            self.reqs[t], self._prompt_ids[t] = r, ids[t]
            self.queue.append(r)

    def _checked_prompt(self, req: Request) -> list[int]:
        """The request's prompt encoded; ValueError naming it when it cannot be admitted."""
        ids, limit = self.engine.tok.encode(req.prompt), self.engine.max_len
        if not 0 < len(ids) < limit:
            raise ValueError(f"request {req.traj_id!r}: a prompt of {len(ids)} tokens; engine.max_len {limit} "
                             f"admits 1 to {limit - 1}")
        return ids

    def finalize(self, traj_ids: list[str]) -> None:
        """The pool holds these finished trajectories: drop their snapshots, and mark them finalized in the WAL
        on the commit thread while decoding goes on (durable before this call's `run` returns: its last wait
        covers it). A crash before that resumes them as complete, and the pool's put of them is idempotent."""
        for t in traj_ids:
            self._drop_snapshot(t)
            self.reqs.pop(t, None)
            self.prompt_len.pop(t, None)
            self._prompt_ids.pop(t, None)
        if traj_ids:
            self.committer.call(lambda: self._finalize_log(list(traj_ids)))

    def _drop_snapshot(self, traj: str) -> None:
        """Delete the snapshot of a trajectory the pool holds; a store that fails leaves it (counted): it is
        never read again, and its trajectory is safe in the data plane."""
        try:
            self.store.delete(traj)
        except OSError as exc:
            self.counters["snapshots_undeleted"] += 1
            log.warning("snapshot of %r left in the store: %s", traj, exc)

    def _finalize_log(self, traj_ids: list[str]) -> None:
        self.wal.finalize_many(traj_ids)  # one commit for all of them
        if isinstance(self.wal, wal_mod.TokenWAL):  # in-process: delete the sealed segments that just died now
            self.wal.reclaim()                      # (a log service runs its own retention)

    def run(self, max_steps: int) -> WorkerReport:
        """Admit queued requests and decode up to `max_steps` steps; report what became durable or finished.
        An error while decoding or committing fails the worker (its engine may hold draws the WAL does not):
        every later call raises it, and a replacement resumes from the WAL."""
        self._check_live()
        if self._tool_waiting:  # their calls, again: answered now, or waiting for the next call of run
            waiting, self._tool_waiting = self._tool_waiting, []
            self._on_stops([t for t in waiting if t in self.engine.seqs])
        self._admit()
        try:
            return self._decode(max_steps)
        except BaseException as exc:
            self._failed = exc
            raise

    def _decode(self, max_steps: int) -> WorkerReport:
        eng, chunk = self.engine, self.spec.engine.decode_chunk
        pending = eng.launch(min(chunk, max_steps)) if max_steps > 0 else None
        step = 0
        while step < max_steps:
            steps = eng.accept_steps(eng.collect_steps(pending))  # engine-internal only: not yet exposed
            if not steps:
                break
            step += len(steps)
            # the next steps run on the device while these are made durable (they feed only requests
            # still running, so a tool call or a finish waits for the commit of its step)
            pending = eng.launch(min(chunk, max_steps - step)) if step < max_steps else None
            for draws, stopped in steps:  # a tool call waits for its step's commit: commit it now; a finish
                paused = any(seq.state == "paused" for seq in stopped)  # waits for the end of the call anyway
                self.committer.submit(draws, eng.version, (draws, stopped), flush=paused)
            self._expose(self.committer.ready())
            if pending is None and step < max_steps:  # nothing running: settle the stops, admit, go on
                self._expose(self.committer.ready(wait_all=True))
                self._admit()
                pending = eng.launch(min(chunk, max_steps - step))
        self._expose(self.committer.ready(wait_all=True))
        self._admit()
        self._finish_done()
        report = WorkerReport(self._stream, self._finished, dict(self.counters),
                              idle=not self.engine.seqs and not self.queue, already_final=self._already_final)
        self._stream, self._finished, self._already_final = {}, [], []
        return report

    def _expose(self, durable: list) -> None:
        """Steps whose commit returned: stream their tokens, answer tool calls, finish trajectories."""
        stops = []
        for draws, stopped in durable:
            self.counters["tokens_committed"] += len(draws)
            for d in draws:
                self._emit(d.req_id, d.position, [d.token])
            stops += [seq.req_id for seq in stopped]  # a stopped request draws no more: its order is kept
        if stops:
            self._on_stops(stops)

    def _snapshot(self, traj: str, seq) -> bool:
        """Write the KV snapshot of `traj`. A write that fails (a full disk, a store that does not answer) is
        counted, not raised: the WAL holds every committed token, and the resume re-prefills them."""
        kv, covered = self.engine.export_kv(traj)
        try:
            self.store.put(traj, encode(traj, seq.tokens[:covered], kv, self.engine.version, self.engine.fingerprint))
        except OSError:
            self.counters["snapshots_failed"] += 1
            return False
        self.counters["snapshots_written"] += 1
        return True

    def preempt(self) -> int:
        """Graceful stop: snapshot the KV of every in-flight request, release the WAL. Returns snapshots written."""
        try:
            self._check_live()
            return sum(self._snapshot(traj, seq) for traj, seq in list(self.engine.seqs.items()))
        finally:
            self.close()

    def suspend(self) -> list[str]:
        """Preempt the in-flight requests, not the worker: snapshot their KV, free their engine slots and queue
        them again; the next `run` resumes them from the WAL and the snapshot. Called between runs, when every
        drawn token is committed. Returns the suspended trajectory ids."""
        self._check_live()
        out = []
        try:
            for traj, seq in list(self.engine.seqs.items()):
                self._snapshot(traj, seq)
                self.engine.remove(traj)
                out.append(traj)
        finally:  # whatever raised, the requests already out of the engine are queued again (in their order)
            self.queue.extendleft(self.reqs[t] for t in reversed(out))
            self.counters["suspended"] += len(out)
        return out

    def update_weights(self, state: dict, version: int) -> None:
        self.engine.load_weights(state, version)

    def close(self) -> None:
        """Stop the commit thread, release the WAL, close the sandbox clients: each of them whatever the others
        raise (a failed commit must not keep the WAL locked); the first error is raised after all."""
        if self._stopped:
            return
        self._stopped = True
        first = None
        for part in (self.committer, self.wal, self.tools):
            try:
                if part is not None:
                    part.close()
            except BaseException as exc:
                first = exc if first is None else first
        if first is not None:
            raise first

    # -- internals ------------------------------------------------------------------------------
    def _check_live(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"worker {self.spec.name} failed ({type(self._failed).__name__}: {self._failed}); "
                               "start a replacement") from self._failed
        if self._stopped:
            raise RuntimeError(f"worker {self.spec.name} was preempted or closed; start a replacement")

    def _emit(self, traj: str, start: int, tokens: list[int]) -> None:
        span = self._stream.get(traj)
        if span is None or span[0] + len(span[1]) != start:  # not contiguous: keep the later span only
            self._stream[traj] = (start, list(tokens))
        else:
            span[1].extend(tokens)

    def _admit(self) -> None:
        """Start queued requests while slots are free; the new prompts go into the WAL with one commit for
        all of them (before any of their draws can be committed: those commits come later)."""
        appended = False
        try:
            while self.queue and self.engine.capacity:
                batch = [self.queue.popleft() for _ in range(min(len(self.queue), self.engine.capacity))]
                started = 0
                try:
                    held = self.wal.read_many([r.traj_id for r in batch])  # one round trip to a log service
                    for req in batch:
                        appended |= self._start(req, held[req.traj_id])
                        started += 1
                finally:  # an error admitting one request loses none of the batch: the rest are queued again
                    self.queue.extendleft(r for r in reversed(batch[started:]) if r.traj_id not in self.engine.seqs)
        finally:
            if appended:
                self.wal.commit()

    def _start(self, req: Request, held: wal_mod.Committed | None) -> bool:
        """Admit one request, given what the WAL holds of it (None: finalized); True when its prompt was
        appended to the WAL (the caller commits)."""
        eng, traj = self.engine, req.traj_id
        prompt = self._prompt_ids.get(traj) or eng.tok.encode(req.prompt)
        if held is None:  # finished and acknowledged earlier: its record lives in the data plane
            self.reqs.pop(traj, None)
            self._prompt_ids.pop(traj, None)
            self._already_final.append(traj)
            return False
        committed = held.tokens
        appended = not committed
        if appended:
            self.wal.append(traj, 0, prompt, [ENV_LOGPROB] * len(prompt), eng.version)
            committed, sampled = prompt, [False] * len(prompt)
        else:
            if committed[:len(prompt)] != prompt:
                raise ValueError(f"trajectory {traj!r}: the WAL holds another prompt under this id")
            sampled = [is_sampled(lp) for lp in held.logprobs]
        self.prompt_len[traj] = len(prompt)
        resumed = len(committed) > len(prompt)
        if not resumed:
            eng.add(traj, committed, sampled, req.params)
        else:
            r = restore.resume(eng, self.store, self.split, traj, committed, sampled, req.params)
            self.counters["resumed"] += 1
            if eng.seqs[traj].state == "done":
                self.counters["resumed_complete"] += 1  # finished before the crash, not yet acknowledged: no KV needed
            else:
                self.counters["kv_restore" if r.kv_tokens else "reprefill"] += 1
                if r.head_tokens and r.kv_tokens:
                    self.counters["kv_restore_split"] += 1
                if r.rejected:
                    self.counters[f"snapshot_{r.rejected}"] += 1
                self.counters["prefill_tokens_on_resume"] += r.prefilled
        if eng.seqs[traj].state != "run":
            self._on_stops([traj])
        return appended

    def _on_stops(self, trajs: list[str]) -> None:
        """Requests the engine stopped: answer the tool calls of the paused ones together (one round to the
        sandbox service, one WAL commit for their results), finish the ones that are done."""
        seqs, trajs = self.engine.seqs, list(dict.fromkeys(trajs))
        paused = [t for t in trajs if seqs[t].state == "paused"]
        while paused:
            before = {t: len(seqs[t].tokens) for t in paused}
            try:
                outs = agent.answer_turns(self.engine, self.wal, self.tools, [(t, self.prompt_len[t]) for t in paused],
                                          self.spec.max_tool_calls)
            except agent.ToolServiceError as exc:  # nothing committed: they stay paused and ask again next run
                self.counters["tool_service_unanswered"] += 1
                log.warning("%s", exc)
                self._tool_waiting += paused
                break
            for t in paused:
                out, seq = outs[t], seqs[t]
                self.counters["tool_executed"] += out.executed
                self.counters["tool_recorded"] += out.recorded
                if len(seq.tokens) > before[t]:
                    self._emit(t, before[t], seq.tokens[before[t]:])
                if not out.continued:
                    seq.state, seq.reason = "done", out.reason or seq.reason
            paused = [t for t in paused if seqs[t].state == "paused"]
        for t in trajs:
            if seqs[t].state == "done":  # its slot is free at once; it is finished at the end of the call
                self._done.append((t, list(seqs[t].tokens), seqs[t].reason))
                self.engine.remove(t)

    def _finish_done(self) -> None:
        """Finish the trajectories that stopped during this call: their committed log-probs and versions
        come from the WAL in one read (one round trip to a log service, however many stopped)."""
        if not self._done:
            return
        held = self.wal.read_many([t for t, _, _ in self._done])
        for traj, tokens, stop_reason in self._done:
            req, p, got = self.reqs[traj], self.prompt_len[traj], held[traj]
            if got is None:
                raise AssertionError(f"{traj}: finalized in the WAL before the pool held it")
            completion = self.engine.tok.decode(tokens[p:], skip_special_tokens=True)
            reward, reason = rewards.domain(req.domain).verify(req.prompt, completion)
            fin = Finished(traj, req.domain, req.prompt, tokens, got.logprobs, got.policy_versions, p, completion,
                           float(reward), reason, stop_reason)
            if len(fin.logprobs) != len(fin.tokens):
                raise AssertionError(f"{traj}: WAL holds {len(fin.logprobs)} tokens, engine {len(fin.tokens)}")
            self._finished.append(fin)
            self.counters["finished"] += 1
        self._done = []


try:
    import ray

    @ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1)
    class RolloutActor:
        """Ray shell over RolloutWorker (the pool replaces it on death; Ray never restarts it)."""

        def __init__(self, spec: WorkerSpec | None = None, weights=None, policy_version: int = 0):
            self.w = None
            if spec is None:  # a warm spare: process up and imports done; `start` gives it a slot later
                import rollout.lite_model  # noqa: F401  (what `start` loads a CPU checkpoint with)
                import tokenizers  # noqa: F401
            else:
                self.w = RolloutWorker(spec, weights, policy_version)

        def start(self, spec: WorkerSpec, weights=None, policy_version: int = 0) -> tuple[int, str]:
            """A spare takes over a slot: the worker is built as a fresh actor's would be; returns `ident()`."""
            self.w = RolloutWorker(spec, weights, policy_version)
            return self.ident()

        def ident(self) -> tuple[int, str]:
            """(pid, Ray node id): where this actor runs, in one call."""
            return os.getpid(), ray.get_runtime_context().get_node_id()

        def pid(self) -> int:
            return os.getpid()

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def run(self, requests: list[Request], finalize: list[str], max_steps: int) -> WorkerReport:
            self.w.finalize(finalize)
            self.w.submit(requests)
            return self.w.run(max_steps)

        def preempt(self) -> int:
            return self.w.preempt()

        def suspend(self) -> list[str]:
            return self.w.suspend()

        def update_weights(self, state, version: int) -> None:
            self.w.update_weights(state, version)
except ImportError:  # pragma: no cover - ray is a dependency; the plain worker still runs without it
    RolloutActor = None
