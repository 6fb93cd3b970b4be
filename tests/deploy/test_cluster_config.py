"""Cluster settings without a cluster: what can be scheduled, `--dry-run` reports, and bad input as one clear error."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rollout.local_cluster import free_port
from core.errors import UserError
from rollout.ray_cluster import Demand, check_schedulable, init_ray

BIN = [sys.executable, "-m", "deploy.cli"]


def postrain(*args, env=None, timeout=120):
    import os

    return subprocess.run(BIN + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})


def test_schedulable_against_node_resources():
    nodes = [{"CPU": 2.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert check_schedulable([Demand("rollout workers", 3, {"CPU": 1.0})], nodes) == []
    assert check_schedulable([Demand("learner ranks", 1, {"CPU": 1.0, "GPU": 1.0}, "PACK")], nodes) == []
    too_big = check_schedulable([Demand("rollout workers", 1, {"CPU": 3.0})], nodes)
    assert len(too_big) == 1 and "no node has CPU=3" in too_big[0]
    total = check_schedulable([Demand("rollout workers", 3, {"CPU": 1.0}), Demand("learner ranks", 2, {"CPU": 1.0})], nodes)
    assert len(total) == 1 and "needs 5 CPU at once" in total[0] and "the cluster has 4" in total[0]
    assert check_schedulable([Demand("learner ranks", 2, {"GPU": 1.0})], nodes)  # one GPU in the cluster
    assert "STRICT_PACK" in check_schedulable([Demand("learner ranks", 2, {"CPU": 1.5}, "STRICT_PACK")], nodes)[0]
    assert "STRICT_SPREAD" in check_schedulable([Demand("l", 3, {"CPU": 0.5}, "STRICT_SPREAD")], nodes)[0]
    assert check_schedulable([Demand("rollout workers", 8, {"CPU": 0.0})], nodes) == []  # reserves nothing


def test_unreachable_cluster_is_one_error_at_once():
    t0 = time.monotonic()
    with pytest.raises(UserError, match="cannot reach the Ray cluster at 127.0.0.1:"):
        init_ray(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 30  # not ray.init's minute of retries


def test_dry_run_embedded_reports_each_dependency(tmp_path):
    res = postrain("rollout", "--checkpoint", str(tmp_path / "none"), "--domain", "calc", "--n", "4",
                   "--out", str(tmp_path / "out"), "--dry-run", "--cluster", "configs/cluster.toml")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[1:-1]] == ["ray", "catalog", "wal", "sandbox", "storage"]
    assert all(ln.split()[1] == "ok" for ln in lines[1:-1]) and "all 5 checks passed" in lines[-1]
    assert not (tmp_path / "out").exists(), "a dry run leaves nothing behind"


def test_dry_run_names_every_bad_dependency(tmp_path):
    port = free_port()
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[storage]\ncatalog = "postgresql://postgres@127.0.0.1:{port}/test"\n'
                   f'[wal]\nmode = "external"\naddresses = ["127.0.0.1:{port}"]\n')
    res = postrain("grpo", "--domain", "reverse", "--init", "x", "--iterations", "1", "--out", str(tmp_path / "o"),
                   "--cluster", str(bad), "--dry-run", "--set", "pool.workers=3")
    assert res.returncode == 2
    rows = {ln.split()[0]: ln.split()[1] for ln in res.stdout.splitlines()[1:]}
    # three workers of one CPU each do not fit the local Ray's two CPUs
    assert rows == {"ray": "FAILED", "catalog": "FAILED", "wal": "FAILED", "storage": "ok"}, res.stdout
    assert "needs 3 CPU at once" in res.stdout and f"127.0.0.1:{port}" in res.stdout
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "3 of 4 checks failed (ray, catalog, wal)" in err[0]


def test_dry_run_against_real_postgresql(tmp_path):
    good = tmp_path / "pg.toml"
    good.write_text('[storage]\ncatalog = "postgresql+psycopg://postgres@127.0.0.1:5432/test"\n')
    res = postrain("grpo", "--domain", "reverse", "--init", "x", "--iterations", "1", "--out", str(tmp_path / "o"),
                   "--cluster", str(good), "--dry-run")
    assert res.returncode == 0, res.stdout + res.stderr
    assert any(ln.split()[:2] == ["catalog", "ok"] and "PostgreSQL" in ln for ln in res.stdout.splitlines())


def _named_checkpoint(tmp_path):
    """A directory that passes as a checkpoint until its weights are loaded: the checks before Ray starts
    (a missing checkpoint is refused there) let these runs reach the services."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "qwen2"}')
    return str(ckpt)


def test_unreachable_ray_address_on_the_command_line(tmp_path):
    res = postrain("rollout", "--checkpoint", _named_checkpoint(tmp_path), "--domain", "reverse", "--out", str(tmp_path / "o"),
                   "--ray-address", f"127.0.0.1:{free_port()}")
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1 and "cannot reach the Ray cluster" in err[0], res.stderr


def test_unreachable_services_fail_at_start_not_mid_run(tmp_path):
    port = free_port()
    bad = tmp_path / "bad.toml"
    bad.write_text(f'[wal]\nmode = "external"\naddresses = ["127.0.0.1:{port}"]\n')
    res = postrain("rollout", "--checkpoint", _named_checkpoint(tmp_path), "--domain", "reverse", "--n", "2",
                   "--out", str(tmp_path / "o"), "--cluster", str(bad))
    err = [ln for ln in res.stderr.splitlines() if "error" in ln]  # (a local Ray prints a notice of its own)
    assert res.returncode == 2 and len(err) == 1 and f"WAL service 127.0.0.1:{port} unreachable" in err[0], res.stderr
    assert not (tmp_path / "o" / "config.json").exists(), "refused before the run began (no worker was started)"
