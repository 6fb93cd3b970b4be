"""`grpc`, loaded with the socket poller that suits the log service: import it from here, not directly.

grpcio's default EventEngine reads and writes sockets on a thread pool of its own and hands every completion to the
thread waiting for it. The log service exchanges one small request and one acknowledgement per decode step, so that
is three more thread wake-ups per step on each side, on a 2-core machine where 4 clients are CPU-bound (measured,
one client at B=512: 10.8 -> 7.3 context switches per step in the server, 13.9 -> 9.9 in the client). gRPC's older
poller (the `event_engine_client` / `event_engine_listener` experiments switched off) polls in the thread that
waits. The choice is read once, when the process first loads grpc: it applies only if grpc is not loaded yet and
GRPC_EXPERIMENTS is unset (an explicit setting wins), and the variable is removed again so that child processes
make their own choice. A grpcio that no longer knows these names logs "Unknown experiment" and runs its default.
"""
from __future__ import annotations

import os
import sys

EXPERIMENTS = "-event_engine_client,-event_engine_listener"

if "grpc" not in sys.modules and "GRPC_EXPERIMENTS" not in os.environ:
    os.environ["GRPC_EXPERIMENTS"] = EXPERIMENTS
    try:
        import grpc  # noqa: F401
    finally:
        del os.environ["GRPC_EXPERIMENTS"]

import grpc  # noqa: E402,F401  (re-exported)
import grpc.aio  # noqa: E402,F401

__all__ = ["grpc"]
