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

from dataclasses import dataclass

from rewards import protocol
from rollout.types import ENV_LOGPROB


@dataclass
class TurnOutcome:
    continued: bool  # False: the episode ends here (no valid call, call budget spent, context full)
    executed: bool = False  # the tool ran now
    recorded: bool = False  # the recorded result of an earlier run was reused
    reason: str = ""


def sandbox_id_of(traj_id: str) -> str:
    """The sandbox of a trajectory: one per episode, named after it (protocol-safe characters only)."""
    safe = "".join(c if c.isalnum() or c in "._:-" else "-" for c in traj_id)
    return ("t" + safe)[:128]


class ToolGateway:
    """The sandbox service as the agent loop sees it: `answer(traj, call_no, call) -> (text, replayed)`."""

    def __init__(self, target: str, token: str, timeout_s: float = 30.0):
        from rewards.sandbox.client import SandboxClient
        # a busy service sheds calls with RESOURCE_EXHAUSTED: wait it out (backoff doubling to 2 s, ~15 s in all)
        # before the episode sees a tool error
        self.client = SandboxClient(target, token, timeout_s=timeout_s, retries=12)

    def answer(self, traj_id: str, call_no: int, call: protocol.Call) -> tuple[str, bool]:
        from rewards.sandbox.client import InvocationAborted, SandboxRefused
        try:
            res = self.client.execute(sandbox_id_of(traj_id), call_no, call.tool, call.args)
        except InvocationAborted:  # invoked before a sandbox crash, outcome unknown: never run again
            return protocol.ERROR_PREFIX + "tool outcome unknown (sandbox crashed mid-call)", True
        except SandboxRefused as exc:  # bad tool / args: deterministic, so a replay gets the same answer
            return protocol.ERROR_PREFIX + f"refused ({exc.code.name})", False
        return res.text(), res.replayed

    def close(self) -> None:
        self.client.close()


def answer_turn(engine, wal, gateway: ToolGateway | None, traj_id: str, prompt_len: int, max_calls: int) -> TurnOutcome:
    """The engine paused `traj_id` on a stop string: answer its pending tool call, or end the episode."""
    seq = engine.seqs[traj_id]
    text = engine.tok.decode(seq.tokens[prompt_len:], skip_special_tokens=True)
    call = protocol.pending_call(text)
    if gateway is None or call is None:
        return TurnOutcome(False, reason="no valid tool call" if gateway else "stop string")
    call_no = len(protocol.steps(text))
    if call_no >= max_calls:
        return TurnOutcome(False, reason=f"tool call budget ({max_calls}) spent")
    output, replayed = gateway.answer(traj_id, call_no, call)
    result_ids = engine.tok.encode(protocol.format_result(output))
    if not engine.fits(traj_id, len(result_ids)):  # the tool ran (and is logged) but its answer does not fit
        return TurnOutcome(False, not replayed, replayed, reason="context")
    start = len(seq.tokens)
    wal.append(traj_id, start, result_ids, [ENV_LOGPROB] * len(result_ids), engine.version)
    wal.commit()
    engine.append_env(traj_id, result_ids)
    return TurnOutcome(True, not replayed, replayed)
