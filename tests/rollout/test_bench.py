"""bench/rollout.py end to end at smoke size: the JSON names the device and every target."""
import json

import pytest


@pytest.mark.slow
def test_bench_quick_writes_targets(tmp_path, monkeypatch):
    import rollout.restore as restore
    import rollout.snapshot as snap
    from bench.rollout import main, run_gpu

    out = tmp_path / "r.json"
    assert main(["--quick", "--json", "--scratch", str(tmp_path / "s"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["device"] and set(res["targets"]) == {
        "engine_vs_hf_generate_cpu", "engine_vs_hf_static_compile_h200_b64", "reprefill_vs_kv_restore_cold_32k",
        "wal_overhead_share_b64_h200"}
    assert res["targets"]["engine_vs_hf_generate_cpu"]["value"] > 0
    assert res["cpu"]["fast_vs_strict_agreement"] > 0.9
    monkeypatch.setattr(snap, "BLOCK_TOKENS", 32)  # 256 tokens: a resume can split
    monkeypatch.setattr(restore, "SPLIT_ON_CPU", True)
    gpu = run_gpu(True, tmp_path / "g", device="cpu", small=True)  # the GPU section's code at toy size
    r = gpu["resume"][0]
    assert not [k for k in gpu if k.endswith("_error")] and r["ratio_cold_median"] > 0 and r["ratio_whole_cold_median"] > 0
    assert r["disk_read_cold_s_median"] > 0  # the bare read under the restore
    assert r["split_head_tokens"][0] == 128 and r["split_policy"]["prefill_us_per_token"] > 0
    probe = r["fixed_split"]  # the split at the middle block, its parts alone beside it
    assert probe["head_tokens"] == 96 and all(v > 0 for k, v in probe.items() if k.endswith("_s_median"))
