"""Device memory held by one piece of code, read from the CUDA caching allocator's record of every
allocation and free (`torch.cuda.memory._record_memory_history` with Python stacks)."""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def recording(max_entries: int = 1_000_000):
    """Record the allocator's events (with Python stacks) for the body; yields a dict that holds the
    snapshot (`snapshot`) once the body is done."""
    import torch

    out: dict = {}
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)
    try:
        yield out
        torch.cuda.synchronize()
        out["snapshot"] = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def live_max(snapshot: dict, file_suffix: str, function: str) -> dict:
    """Over the allocator's trace: the most blocks and bytes alive at once among the allocations made
    with `function` (in a file whose path ends with `file_suffix`) on the Python stack, and how many
    such allocations there were. A block counts from its allocation until the allocator completes
    its free."""
    events = [e for dev in snapshot.get("device_traces") or [] for e in dev]
    free_action = "free_completed" if any(e.get("action") == "free_completed" for e in events) else "free_requested"
    live: dict[int, int] = {}
    most_blocks = most_bytes = seen = 0
    for e in events:
        action = e.get("action")
        if action == "alloc" and any(f.get("name") == function and str(f.get("filename", "")).endswith(file_suffix)
                                     for f in e.get("frames") or []):
            live[e["addr"]] = int(e["size"])
            seen += 1
            most_blocks = max(most_blocks, len(live))
            most_bytes = max(most_bytes, sum(live.values()))
        elif action == free_action and e.get("addr") in live:
            del live[e["addr"]]
    return {"max_live_blocks": most_blocks, "max_live_bytes": most_bytes, "allocations": seen,
            "trace_events": len(events)}
