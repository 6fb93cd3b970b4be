"""chaos: fault injection as its own layer. It drives the hooks that the production classes expose
(`RolloutPool.preempt` / `kill` / `worker_pid`, the WAL's files and writers, the sandbox service, the
data-plane catalog, the learner's process, the teacher cache) from outside; no fault code sits in
their paths. `postrain drill` and `--chaos` on `rollout`, `grpo` and `opd` use it.

    schedule.py     seeded fault schedules scheduled on observed progress (pure); percentiles
    files.py        file damage: flip a bit, zero a range
    pool_faults.py  PoolInjector: rollout faults through the pool's hooks, recovery time per fault
    node_loss_drill.py  node-loss: a worker node of a local multi-node Ray cluster killed mid-decode
"""
