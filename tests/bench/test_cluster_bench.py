"""bench.cluster's stream measurement on a small scale: every client holds its stream through the barrier,
none fails, every acknowledged token reads back."""
from __future__ import annotations

from bench.cluster import wal_streams


def test_wal_streams_small(tmp_path):
    res = wal_streams(24, 3, 2, tmp_path)
    assert res["held"] == 24 and res["failed_clients"] == 0 and res["acked_tokens_not_read_back"] == 0
    assert res["commits_per_stream"] == 3
