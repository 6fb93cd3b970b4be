"""Running a test file's Triton cases on CPU: Triton reads TRITON_INTERPRET when it is imported, so the
default run launches the file again in a child pytest with the variable set, where the cases run."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = pathlib.Path(__file__).resolve().parents[1]
interp = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")


def run_child(test_file: str, timeout_s: int = 600) -> None:
    """Run `test_file` in a child pytest under the interpreter; fail with its output unless all passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", test_file], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1].split("passed")[0]
