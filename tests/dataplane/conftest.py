"""Shared fixtures: synthetic trajectories, an SQLite data plane, and a PostgreSQL one on the live server
(a fresh schema per test, dropped afterwards; skipped with the reason when no server answers)."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

import dataplane
from dataplane import TrajectoryRecord

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def make_records(n: int, seed: int = 0, max_len: int = 300, run: str = "run-a", group_size: int = 4,
                 domains=("arith", "reverse"), extras: bool = False, id_prefix: str = "t") -> list[TrajectoryRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(1, max_len + 1))
        ex = {}
        if extras:
            ex = {"hidden": rng.standard_normal((L, 4)).astype(np.float16),
                  "score": rng.standard_normal(L).astype(np.float32)}
        out.append(TrajectoryRecord(
            id=f"{id_prefix}{i:05d}", run=run, domain=domains[i % len(domains)], prompt=f"prompt {i // group_size}",
            group_id=f"g{i // group_size:05d}", tokens=rng.integers(0, 50_000, L, dtype=np.int64),
            loss_mask=rng.integers(0, 2, L), logprobs=-rng.random(L).astype(np.float32),
            reward=float(rng.integers(0, 2)), policy_min=int(i % 3), policy_max=int(i % 3) + int(i % 2),
            teacher_id=("teacher-" + domains[i % len(domains)]) if i % 5 else None, extras=ex))
    return out


@pytest.fixture
def sqlite_dp(tmp_path):
    dp = dataplane.open(tmp_path / "catalog.db", tmp_path / "store")
    yield dp
    dp.close()


def _pg_reachable() -> str | None:
    try:
        import psycopg

        with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=test", connect_timeout=3):
            return None
    except Exception as exc:  # any failure to connect means: no server here
        return f"no PostgreSQL server answers at 127.0.0.1:5432/test ({type(exc).__name__}: {exc})"


@pytest.fixture
def pg_namespace():
    why = _pg_reachable()
    if why:
        pytest.skip(why)
    ns = f"dp_test_{uuid.uuid4().hex[:12]}"
    yield ns
    from dataplane import postgres

    postgres.drop_namespace(PG_URL, ns)


@pytest.fixture
def pg_dp(tmp_path, pg_namespace):
    dp = dataplane.open(PG_URL, tmp_path / "pg_store", namespace=pg_namespace)
    yield dp
    dp.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_dp(request, tmp_path):
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_dp")
    return request.getfixturevalue("pg_dp")
