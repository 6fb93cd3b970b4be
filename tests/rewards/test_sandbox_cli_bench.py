"""`postrain sandbox serve` refuses bad options in one line; `postrain bench sandbox` runs end to end (tiny)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rewards.sandbox.isolation import probe


@pytest.mark.parametrize("argv, words", [
    (["--max-concurrent", "0"], "max_concurrent"),
    (["--port", "70000"], "port"),
    (["--wall-s", "-1"], "wall_s"),
])
def test_serve_refuses_bad_options_in_one_line(tmp_path, argv, words):
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "sandbox", "serve", "--log-dir", str(tmp_path), *argv],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in res.stderr


@pytest.mark.skipif(probe() is not None, reason=f"sandbox isolation unavailable: {probe()}")
def test_bench_sandbox_smoke(capsys):
    from bench import sandbox

    assert sandbox.main(["--json", "--pairs", "3", "--calls-1", "4", "--calls-8", "8", "--rounds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["targets"]) == {"isolation_overhead_cold_p50_ms", "isolation_overhead_warm_p50_ms",
                                   "calls_per_s_8_clients"}
    for t in out["targets"].values():
        assert set(t) == {"value", "goal", "met"} and isinstance(t["met"], bool)
    assert out["sandbox_service_8_clients"]["calls"] == 8 and out["plain_subprocess_1_client"]["calls"] == 4
    assert out["targets"]["calls_per_s_8_clients"]["value"] == out["sandbox_service_8_clients"]["calls_per_s"]
    for mode in ("cold", "warm"):
        fig = out[f"isolation_{mode}"]
        assert fig["sandboxed"]["calls"] == fig["bare"]["calls"] == 3
        assert out["targets"][f"isolation_overhead_{mode}_p50_ms"]["value"] == fig["overhead_p50_ms"]
    assert out["meta"]["commit"] and out["meta"]["date_utc"].endswith("Z") and "cores" in out["meta"]["machine"]


@pytest.mark.skipif(probe() is not None, reason=f"sandbox isolation unavailable: {probe()}")
def test_call_and_log_subverbs(tmp_path):
    from rewards.sandbox.launch import ServerProcess

    srv = ServerProcess(tmp_path / "svc", "cli-test-token-0123")
    try:
        def cli(*argv):
            return subprocess.run([sys.executable, "-m", "deploy.cli", "sandbox", *argv, "--target", srv.target,
                                   "--sandbox", "cli"], capture_output=True, text=True, timeout=60,
                                  env={**os.environ, "POSTRAIN_SANDBOX_TOKEN": "cli-test-token-0123"})

        first = cli("call", "calc", "37*41")
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout) | {"wall_ms": 0} == {"seq": 0, "replayed": False, "ok": True, "output": "1517",
                                                             "error_kind": "", "error": "", "exit_code": 0, "wall_ms": 0}
        again = cli("call", "--seq", "0", "calc", "37*41")
        assert json.loads(again.stdout)["replayed"] is True
        clash = cli("call", "--seq", "0", "calc", "1+1")
        assert clash.returncode == 2 and "FAILED_PRECONDITION" in clash.stderr and len(clash.stderr.splitlines()) == 1
        log = cli("log")
        rows = [json.loads(line) for line in log.stdout.splitlines()]
        assert rows[0]["args"] == "37*41" and rows[0]["result"]["output"] == "1517" and rows[-1] == {"next_seq": 1}
    finally:
        srv.kill()


@pytest.mark.skipif(probe() is not None, reason=f"sandbox isolation unavailable: {probe()}")
def test_serve_refuses_weaker_isolation_unless_allowed(tmp_path, monkeypatch):
    """Without the seccomp layer (its binding made unimportable) the service names what is missing and
    refuses; with --allow-weaker-isolation it starts, says so, and still runs tools isolated."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pyseccomp.py").write_text("raise ImportError('libseccomp hidden for this test')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    res = subprocess.run([sys.executable, "-m", "deploy.cli", "sandbox", "serve", "--log-dir", str(tmp_path / "a")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for words in ("seccomp filter", "libseccomp hidden", "no nested user namespaces", "--allow-weaker-isolation"):
        assert words in lines[0], lines[0]

    from rewards.sandbox.client import SandboxClient
    from rewards.sandbox.launch import ServerProcess

    srv = ServerProcess(tmp_path / "b", "weak-isolation-token", extra=["--allow-weaker-isolation"])
    try:
        assert "WEAKER isolation, missing: seccomp filter" in srv.out_path.read_text()
        with SandboxClient(srv.target, "weak-isolation-token", retries=0) as c:
            code = "import os\nprint(os.getuid() > 0, open('/proc/self/status').read().count('Seccomp:\\t0'))\n"
            out = c.execute("weak", 0, "python", code).result
        assert out.ok and out.output.split() == ["True", "1"], out  # isolated, without the filter, as announced
    finally:
        srv.kill()
