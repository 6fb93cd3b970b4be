"""One Ray for every stage of a job: the stages' child processes join it instead of each starting its own.

When nothing names a cluster (no RAY_ADDRESS, no cluster file), `shared_ray()` starts a local Ray in
this process and hands its address to the children through $POSTRAIN_SHARED_RAY; the children's
`init_ray` then joins it, which costs a connection instead of a Ray start per stage, and they still
run as embedded (their own WAL and sandbox). Its processes share this
process's fate (Ray ties them to the driver that started them), so a killed job leaves none behind.
When a cluster is named, the children join that cluster themselves and nothing is started here.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

from deploy.cluster import CLUSTER_ENV


@contextmanager
def shared_ray(num_cpus: int):
    """Within the block, $POSTRAIN_SHARED_RAY names a Ray that every child of this process joins."""
    if os.environ.get("RAY_ADDRESS", "").strip() or os.environ.get(CLUSTER_ENV):
        yield None
        return
    from rollout.ray_cluster import local_shared_ray

    with local_shared_ray(num_cpus) as address:
        yield address
