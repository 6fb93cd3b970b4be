"""The `postrain` CLI as a user runs it: subprocesses with tiny budgets."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BIN = [sys.executable, "-m", "deploy.cli"]
TINY = ["--set", "policy.hidden_size=32", "--set", "policy.num_layers=1", "--set", "policy.num_heads=2",
        "--set", "policy.num_kv_heads=1", "--set", "policy.intermediate_size=64", "--set", "sft.threads=1"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}


def postrain(*args, check=True, timeout=300):
    res = subprocess.run(BIN + list(args), capture_output=True, text=True, timeout=timeout, env=ENV)
    if check and res.returncode != 0:
        raise AssertionError(f"postrain {' '.join(args)} exited {res.returncode}:\n{res.stderr[-3000:]}")
    return res


def test_help_imports_nothing_heavy_and_is_fast():
    code = ("import sys, time; t=time.perf_counter(); from deploy.cli import build_parser; build_parser();"
            "heavy=[m for m in ('torch','ray','transformers','pyarrow','grpc','sqlalchemy') if m in sys.modules];"
            "print(heavy, time.perf_counter()-t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "[]", f"heavy imports at --help: {out}"
    t0 = time.perf_counter()
    res = postrain("--help")
    assert "sft" in res.stdout and "eval" in res.stdout and "domains" in res.stdout
    assert time.perf_counter() - t0 < 3.0  # < 1 s on an idle machine; bound loose for a loaded CI box


def test_domains_json():
    rows = json.loads(postrain("domains", "--json").stdout)
    assert {"arith", "reverse", "calc"} <= {r["name"] for r in rows}
    assert all(r["description"] for r in rows)


def test_json_stdout_carries_the_report_alone():
    """Under --json, what child processes and native code write to descriptor 1, and what other threads
    print (Ray's error listener prints a dead worker's notice to sys.stdout), and what is printed once the
    command returned (Ray's shutdown at exit), goes to stderr; the report alone reaches stdout."""
    code = ("import os, subprocess, sys, threading; from deploy.json_stdout import reserve_stdout; reserve_stdout();"
            "subprocess.run(['echo', 'child notice']); os.write(1, b'native notice\\n');"
            "t = threading.Thread(target=print, args=('thread notice',)); t.start(); t.join();"
            "print('{\"report\": 1}'); from deploy.json_stdout import release_stdout; release_stdout();"
            "print('exit notice')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert p.stdout == '{"report": 1}\n'
    assert all(f"{w} notice" in p.stderr for w in ("child", "native", "thread", "exit"))


@pytest.mark.parametrize("args,needle", [
    (["sft", "--out", "{tmp}/x", "--domain", "nope"], "unknown domain 'nope'"),
    (["sft", "--out", "{tmp}/x", "--set", "sft.stepz=3"], "unknown key 'sft.stepz'"),
    (["sft", "--out", "{tmp}/x", "--set", "sft.lr=nan"], "sft.lr: Input should be a finite number"),
    (["eval", "--checkpoint", "{tmp}/missing"], "missing: no such directory; expected an HF checkpoint directory"),
    (["eval", "--checkpoint", "{tmp}"], "neither"),
    (["sft", "--out", "{tmp}/x", "--config", "{tmp}/none.toml"], "config file not found"),
    (["bench", "nope"], "unknown benchmark 'nope'"),
    # a missing checkpoint is named before Ray is joined (an unreachable address would be the error otherwise)
    (["grpo", "--domain", "calc", "--init", "{tmp}/missing", "--iterations", "3", "--out", "{tmp}/g",
      "--ray-address", "127.0.0.1:1"], "missing: no such directory"),
    (["opd", "--student", "{tmp}/missing", "--iterations", "3", "--out", "{tmp}/o", "--ray-address", "127.0.0.1:1"],
     "missing: no such directory"),
    (["rollout", "--domain", "calc", "--checkpoint", "{tmp}/missing", "--out", "{tmp}/r", "--ray-address", "127.0.0.1:1"],
     "missing: no such directory"),
])
def test_errors_are_one_clear_line(tmp_path, args, needle):
    res = postrain(*[a.format(tmp=tmp_path) for a in args], check=False)
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args,needle", [
    (["data", "plan", "--config", "{tmp}/bad.yaml"], "does not parse at line 3, column 1"),
    (["data", "plan", "--config", "{tmp}/list.yaml", "--set", "dataplane.ranks=2"], "must be a mapping"),
    (["data", "plan", "--config", "{tmp}/binary.toml"], "is not UTF-8 text"),
    (["data", "plan", "--config", "{tmp}"], "is a directory; expected a .toml, .yaml or .yml file"),
    (["data", "plan", "--config", "/dev/null"], "/dev/null is not a regular file"),
    (["data", "plan", "--config", "{tmp}/garbage.db"], "garbage.db: expected .toml, .yaml or .yml"),
    (["data", "stats", "--catalog", "{tmp}/garbage.db"], "cannot open: file is not a database"),
    (["data", "plan", "--catalog", "{tmp}/c.db", "--store", "{tmp}/s", "--epoch", "-1"], "--epoch -1: an epoch number is >= 0"),
    (["data", "plan", "--catalog", "{tmp}/none.db", "--store", "{tmp}/s"], "none.db does not exist"),
    (["data", "stats", "--catalog", "postgresql://postgres@127.0.0.1:1/test", "--store", "{tmp}/s"],
     "Connection refused Is the server running"),
    (["wal", "serve", "--dir", "{tmp}/w", "--port", "70000"], "serve.port: Input should be less than or equal to 65535"),
    (["sandbox", "serve", "--log-dir", "{tmp}/sb", "--first-slot", "250"], "exceed the 256 execution slots"),
    (["sandbox", "serve", "--log-dir", "{tmp}/sb", "--max-concurrent", "0"], "bad sandbox option max_concurrent"),
])
def test_bad_files_and_values_are_one_clear_line(tmp_path, args, needle):
    (tmp_path / "bad.yaml").write_text('dataplane:\n  catalog: "x\n')
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe[dataplane]\n")
    (tmp_path / "garbage.db").write_bytes(bytes(range(256)) * 16)
    res = postrain(*[a.format(tmp=tmp_path) for a in args], check=False)
    lines = [line for line in res.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr
    assert not (tmp_path / "none.db").exists() and not (tmp_path / "s").exists(), "a refused read wrote nothing"


@pytest.mark.parametrize("args,needle", [
    (["grpo", "--domain", "calc", "--init", "x", "--out", "x", "--iterations", "0"], "--iterations: must be a whole number >= 1"),
    (["grpo", "--domain", "calc", "--init", "x", "--out", "x", "--iterations", "3", "--stop-after", "0"], "--stop-after"),
    (["opd", "--student", "x", "--out", "x", "--iterations", "-2"], "--iterations: must be a whole number >= 1"),
    (["opd", "--student", "x", "--out", "x", "--iterations", "3", "--chaos", "-1"], "--chaos: must be a whole number >= 0"),
    (["rollout", "--domain", "calc", "--checkpoint", "x", "--out", "x", "--n", "0"], "--n: must be a whole number >= 1"),
    (["pipeline", "--name", "../elsewhere"], "--name: must be one directory name"),
    (["pipeline", "--name", "a/b"], "--name: must be one directory name"),
    (["job", "--name", ""], "--name: must be one directory name"),
])
def test_counts_that_describe_no_run_are_refused_when_parsed(args, needle):
    res = postrain(*args, check=False, timeout=60)
    assert res.returncode == 2 and needle in res.stderr.splitlines()[-1], res.stderr


def test_debug_shows_traceback(tmp_path):
    res = postrain("--debug", "eval", "--checkpoint", str(tmp_path / "missing"), check=False)
    assert res.returncode != 0 and "Traceback" in res.stderr


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    postrain("sft", "--out", str(out), "--steps", "40", "--quiet", *TINY, "--set", "sft.log_every=5",
             "--set", "sft.batch_size=16", "--set", "sft.warmup_steps=5", "--set", "sft.lr=5e-3")
    return out


def test_a_run_whose_stderr_is_a_log_gets_no_library_progress_bars(tmp_path):
    """Hugging Face prints a bar per checkpoint written or loaded; a run logging to a file (as the pipeline's
    stages do) keeps to its own lines, as our bars do."""
    res = postrain("sft", "--out", str(tmp_path / "s"), "--steps", "2", *TINY)
    assert (tmp_path / "s" / "final" / "model.safetensors").is_file()
    assert "Writing model shards" not in res.stderr and "it/s]" not in res.stderr, res.stderr[-2000:]


def test_sft_smoke_loss_falls_and_parameters_change(sft_run):
    rows = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("stage") == "sft"]
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0], losses
    assert json.loads((sft_run / "config.json").read_text())["sft"]["steps"] == 40
    assert (sft_run / "sft.png").stat().st_size > 1000
    from learner.config import PolicyConfig
    from learner.policy import build_policy
    from core.hf import load_policy

    init, _ = build_policy(PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64))
    trained, _ = load_policy(sft_run / "final")
    changed = [not torch.equal(a, b) for a, b in zip(init.parameters(), trained.parameters())]
    assert all(changed), "every parameter tensor must move during SFT"


def test_eval_is_deterministic_under_a_fixed_seed(sft_run):
    args = ["eval", "--checkpoint", str(sft_run / "final"), "--n", "12", "--json"]
    greedy = [postrain(*args).stdout for _ in range(2)]
    assert greedy[0] == greedy[1]
    rows = [json.loads(line) for line in greedy[0].splitlines()]
    assert [r["domain"] for r in rows] == ["arith", "reverse", "calc"]
    assert all(r["n"] == 12 and 0.0 <= r["pass_at_1"] <= 1.0 for r in rows)
    sampled = [postrain(*args, "--set", "eval.temperature=1.0", "--seed", "5").stdout for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_eval_takes_the_run_directory(sft_run):
    # the directory `postrain sft --out` wrote names the same checkpoint as its final/
    args = ["--n", "6", "--domain", "arith", "--json"]
    assert postrain("eval", "--checkpoint", str(sft_run), *args).stdout == \
        postrain("eval", "--checkpoint", str(sft_run / "final"), *args).stdout


def test_job_writes_run_directory(tmp_path):
    postrain("job", "--name", "t", "--runs", str(tmp_path), "--quiet", *TINY, "--set", "sft.steps=4",
             "--set", "eval.n=4", "--set", "sft.log_every=2")
    run = tmp_path / "t"
    summary = json.loads((run / "summary.json").read_text())
    assert [e["domain"] for e in summary["eval"]] == ["arith", "reverse", "calc"]
    assert (run / "config.json").is_file() and (run / "final" / "config.json").is_file()
    assert (run / "sft.png").is_file()
    stages = [json.loads(line)["stage"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert stages.count("eval") == 3
