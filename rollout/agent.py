"""The multi-turn agent loop: answer the model's tool call through the sandbox service, exactly once.

Order of one turn (each step durable before the next may see it):
  the call's tokens are committed in the token WAL (the engine paused on `</call>` only after the
  commit) → the sandbox service writes the invocation to its environment log, runs the tool, writes
  the result → the result tokens are appended to the token WAL as environment tokens (loss-masked)
  and committed → decoding continues.
A call is keyed by (sandbox id, call number), both pure functions of the committed tokens, so after
any crash the replay asks for the same key and the service returns the recorded result instead of
running the tool again.
"""
from __future__ import annotations

import hashlib
import string
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rewards import protocol
from rollout.types import ENV_LOGPROB


@dataclass
class TurnOutcome:
    continued: bool  # False: the episode ends here (no valid call, call budget spent, context full)
    executed: bool = False  # the tool ran now
    recorded: bool = False  # the recorded result of an earlier run was reused
    reason: str = ""


class ToolServiceError(RuntimeError):
    """The sandbox service did not answer a call (down past the client's retries, overloaded, a wrong token,
    an internal error). Nothing of the call enters the trajectory: a fault of the service is not the
    model's to learn from, and the call number must stay free for the call the service has not logged.
    The trajectory resumes from the WAL, and asks again, once the service answers."""


SANDBOX_ID_CHARS = frozenset(string.ascii_letters + string.digits + "._:-")  # the service's, after a leading "t"
SANDBOX_ID_MAX = 128  # characters of a sandbox id the service accepts


def sandbox_id_of(traj_id: str) -> str:
    """The sandbox of a trajectory: one per episode, named after it. An id of protocol-safe characters that fits
    is used as it is ("t" + id: the sandboxes of runs in flight keep their names); any other id is a safe prefix
    and a hash of the whole id, so trajectories whose ids differ only in replaced characters or past the limit
    never share a sandbox (and its recorded tool results)."""
    safe = "t" + "".join(c if c in SANDBOX_ID_CHARS else "-" for c in traj_id)
    if safe == "t" + traj_id and len(safe) <= SANDBOX_ID_MAX:
        return safe
    digest = hashlib.blake2b(traj_id.encode(), digest_size=8).hexdigest()
    return f"{safe[:SANDBOX_ID_MAX - len(digest) - 1]}-{digest}"


class ToolGateway:
    """The sandbox service as the agent loop sees it: `answer(traj, call_no, call) -> (text, replayed)`, and
    `answer_many` for the calls that one decode step paused on, sent together over `fan_out` connections
    (one client per thread), so that the service's environment log commits them in shared fsyncs."""

    def __init__(self, target: str, token: str, timeout_s: float = 30.0, fan_out: int = 8):
        self.target, self.token, self.timeout_s, self.fan_out = target, token, timeout_s, fan_out
        self._local = threading.local()
        self._clients: list = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            from rewards.sandbox.client import SandboxClient
            # a busy service sheds calls with RESOURCE_EXHAUSTED: wait it out (backoff doubling to 2 s, ~15 s
            # in all) before the episode sees a tool error
            client = self._local.client = SandboxClient(self.target, self.token, timeout_s=self.timeout_s, retries=12)
            with self._lock:
                self._clients.append(client)
        return client

    def answer(self, traj_id: str, call_no: int, call: protocol.Call) -> tuple[str, bool]:
        import grpc

        from rewards.sandbox.client import InvocationAborted, SandboxRefused
        from rewards.sandbox.tools import MAX_ARGS_CHARS
        # args past a tool's bound are refused by the service (a logged tool error) whatever follows the
        # bound: sent cut there, the request stays small enough for any message bound, the same on a replay
        limit = MAX_ARGS_CHARS.get(call.tool)
        args = call.args if limit is None or len(call.args) <= limit else call.args[:limit + 1]
        try:
            res = self._client().execute(sandbox_id_of(traj_id), call_no, call.tool, args)
        except InvocationAborted:  # invoked before a sandbox crash, outcome unknown: never run again
            return protocol.ERROR_PREFIX + "tool outcome unknown (sandbox crashed mid-call)", True
        except SandboxRefused as exc:
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:  # the request itself: a replay gets the same answer
                return protocol.ERROR_PREFIX + f"refused ({exc.code.name})", False
            raise ToolServiceError(f"sandbox service {self.target} did not answer call {call_no} of {traj_id!r}: "
                                   f"{exc.code.name} ({exc.details}); nothing of it was committed") from None
        return res.text(), res.replayed

    def answer_many(self, asks: list[tuple[str, int, protocol.Call]]) -> list[tuple[str, bool]]:
        """`answer` of each (traj_id, call_no, call), in order; distinct sandboxes, so order among them is free."""
        if len(asks) <= 1 or self.fan_out <= 1:
            return [self.answer(*a) for a in asks]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.fan_out, thread_name_prefix="tool-gateway")
        return list(self._pool.map(lambda a: self.answer(*a), asks))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()


def answer_turns(engine, wal, gateway: ToolGateway | None, paused: list[tuple[str, int]],
                 max_calls: int) -> dict[str, TurnOutcome]:
    """The engine paused each (traj_id, prompt_len) on a stop string: answer its pending tool call, or end its
    episode. The calls go to the service together, and their results enter the token WAL with one commit
    before any of them decodes on."""
    out: dict[str, TurnOutcome] = {}
    asks: list[tuple[str, int, protocol.Call]] = []
    for traj_id, prompt_len in paused:
        text = engine.tok.decode(engine.seqs[traj_id].tokens[prompt_len:], skip_special_tokens=True)
        call = protocol.pending_call(text)
        if gateway is None or call is None:
            out[traj_id] = TurnOutcome(False, reason="no valid tool call" if gateway else "stop string")
            continue
        call_no = len(protocol.steps(text))
        if call_no >= max_calls:
            out[traj_id] = TurnOutcome(False, reason=f"tool call budget ({max_calls}) spent")
            continue
        asks.append((traj_id, call_no, call))
    appended = []
    for (traj_id, _, _), (output, replayed) in zip(asks, gateway.answer_many(asks) if asks else []):
        result_ids = engine.tok.encode(protocol.format_result(output))
        if not engine.fits(traj_id, len(result_ids)):  # the tool ran (and is logged) but its answer does not fit
            out[traj_id] = TurnOutcome(False, not replayed, replayed, reason="context")
            continue
        start = len(engine.seqs[traj_id].tokens)
        wal.append(traj_id, start, result_ids, [ENV_LOGPROB] * len(result_ids), engine.version)
        appended.append((traj_id, result_ids, replayed))
    if appended:
        wal.commit()
    for traj_id, result_ids, replayed in appended:
        engine.append_env(traj_id, result_ids)
        out[traj_id] = TurnOutcome(True, not replayed, replayed)
    return out
