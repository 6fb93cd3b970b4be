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
