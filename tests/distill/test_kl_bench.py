"""`python -m bench.kl --json` as a subprocess: on a machine without CUDA it runs the CPU comparison."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA benchmark is exercised on the GPU machine")
def test_bench_kl_cpu_smoke(tmp_path):
    out = tmp_path / "kl.json"
    r = subprocess.run([sys.executable, "-m", "bench.kl", "--json", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    printed, written = json.loads(r.stdout), json.loads(out.read_text())
    assert printed == written
    assert written["cpu_run"] is True and "cores" in written["device"]
    for row in written["results"].values():
        assert row["eager"]["ms"] > 0 and row["ours_chunked"]["ms"] > 0
    target = written["targets"]["rel_grad_err_vs_fp64"]
    assert target["met"] and 0 < target["value"] <= 1e-2


def test_exact_floor_takes_the_fastest_gemms_plus_one_logits_read():
    from bench import kl, kl_floor

    N, V = 16384, 129280
    hbm = dict(used_tb_s=4.0)
    f = kl_floor.floor(N, V, dict(products_best_layout=101.0, ours_schedule_ms=106.0), hbm)
    reread = 2 * N * V * 4 / 4.0e12 * 1e3  # both float32 logits, read once
    assert f["gemm_from"] == "products_best_layout" and f["gemm_ms"] == 101.0
    assert abs(f["logits_reread_ms"] - reread) < 1e-9 and abs(f["floor_ms"] - (101.0 + reread)) < 1e-9
    res = dict(results={str(N): dict(ours_default=dict(ms=116.0), compile=dict(ms=120.0), liger=dict(ms=190.0),
                                     gemm_only=dict(ours_schedule_ms=106.0), floor=f)})
    a = kl._analysis(res, [N])[str(N)]
    assert a["exact_floor_ms"] == f["floor_ms"]
    assert a["compile_goal_below_exact_floor"] is True  # 120 / 1.15 = 104.3 < 105.2
    assert a["liger_goal_below_exact_floor"] is False  # 190 / 1.7 = 111.8
