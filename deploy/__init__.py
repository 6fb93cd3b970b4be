"""deploy: the `postrain` CLI, the configs of the jobs it runs, the job drivers (main job, GRPO loop),
cluster files. It composes every other package; nothing imports it.

    cli.py        argparse front; verbs are discovered from commands/
    commands/     one module per verb, heavy imports inside run()
    config_registry.py  which model parses which file of configs/
    job_config.py JobConfig of the main job
    job.py        the main job: the embedded-default pipeline (SFT, then eval on every domain)
    grpo_config.py  GRPOLoopConfig: learner, rollout and loop settings of `postrain grpo`
    grpo_loop.py  the GRPO loop: rollout pool -> verify -> data plane -> plan -> learner -> publish
    run_storage.py  a run directory as a pyarrow.fs URI: local staging, checkpoints and reports published, resume
    run_lock.py   one process per run directory: a flock on DIR/.lock for the whole run
    run_records.py  run records (pipeline.json, grpo_run.json, ...) read with one error when damaged; run identity
"""
