"""deploy: the `postrain` CLI, typed configs, run directories, the pipeline job driver,
fault-injection drills, cluster files.

    cli.py        argparse front; verbs are discovered from commands/
    commands/     one module per verb, heavy imports inside run()
    config.py     TOML/YAML loading, --set overrides, validation with one-line errors
    config_registry.py  which model parses which file of configs/
    rundir.py     runs/<name>/: resolved config, metrics.jsonl, PNG plots
    atomic.py     atomic file writes (temp, fsync, rename, fsync dir)
    errors.py     UserError: operating errors printed as one line
    progress.py   rich progress bars that fall back to quiet lines when not a TTY
    job_config.py JobConfig of the main job
    job.py        the main job: the embedded-default pipeline (SFT, then eval on every domain)
    grpo_config.py  GRPOLoopConfig: learner, rollout and loop settings of `postrain grpo`
    grpo_loop.py  the GRPO loop: rollout pool -> verify -> data plane -> plan -> learner -> publish
"""
