"""rewards.sandbox: the tool sandbox service — gRPC, bubblewrap isolation, exactly-once via the env log.

    types.py            limits, run/tool outcomes, error kinds, sandbox id rule
    config.py           SandboxConfig: bounded settings of the service
    isolation.py        bubblewrap + prlimit + per-slot uid runner with wall clock and output bounds; what is missing
    view.py             the minimal filesystem a sandbox sees (read-only binds of what tools need, nothing else)
    syscall_filter.py   the seccomp deny list, compiled to BPF by libseccomp for bubblewrap's --seccomp
    tools.py            the tools (calc, python, counter) and how a run becomes an outcome with a reason
    service.py          exactly-once core over the environment log (no gRPC): replay, join, abort, back-pressure
    server.py           gRPC shell: token auth, message bounds, status codes, SandboxServer
    client.py           SandboxClient (deadlines, safe retries), SandboxSession (seq keeping, fast-forward)
    launch.py           ServerProcess: `postrain sandbox serve` as a child process (tests, benchmark)
    sandbox.proto       the wire and log records; sandbox_pb2*.py are generated from it (grpc_tools.protoc)
"""
from __future__ import annotations


def connect(target: str, token: str, **kwargs):
    """A SandboxClient for the service at host:port (kwargs: timeout_s, retries, backoff_s)."""
    from rewards.sandbox.client import SandboxClient

    return SandboxClient(target, token, **kwargs)


def serve(config=None, token: str | None = None, **fields):
    """Start the service in this process; returns the running SandboxServer (`.target`, `.stop()`)."""
    from rewards.sandbox.config import SandboxConfig
    from rewards.sandbox.server import SandboxServer

    return SandboxServer(config or SandboxConfig(**fields), token=token)


__all__ = ["connect", "serve"]
