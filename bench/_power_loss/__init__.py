"""Power-loss crash consistency: workloads, their properties and the trial driver (bench/power_loss.py).

    trials.py           record a workload through core.powercut, cut it, build seeded crash images, check each
    wal_cases.py        the token WAL (three segment configurations) and the environment log
    plane_case.py       the data plane's put: a shard the catalog may show is durable and whole
    snapshot_case.py    KV snapshots: whole and valid, or absent and rejected as missing
    checkpoint_case.py  learner checkpoints: whole and verified, or absent; `latest` never goes back
    canaries.py         builds with one sync removed, compiled from the source without that line
    step_ab.py          the WAL's batched-decode step, this tree against itself with the I/O layer bypassed
"""
