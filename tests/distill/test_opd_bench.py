"""bench/opd.py runs its path end to end (on the CPU: a small shape; the targets are H200 targets)."""
import json

from bench import opd


def test_opd_bench_smoke(capsys):
    assert opd.main(["--json", "--rounds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_resident_heads_scheduler"] == 1
    assert out["median_s"]["streamed"] > 0 and out["median_s"]["resident"] > 0
    assert out["cache_bytes_per_token"] >= out["shape"]["H"] * 2  # bf16 hidden states, never logits
    assert out["meta"]["machine"] and out["meta"]["date_utc"].endswith("Z")
