"""core: what every layer of postrain shares; it imports no other postrain package.

    fileio.py     the I/O layer every durable write goes through (os functions by default, swappable)
    powercut/     simulated power cuts: a fileio backend that records, a disk model that builds crash images
    atomic.py     atomic file writes (temp file, fsync, rename, fsync of the directory)
    errors.py     UserError: operating errors printed as one line
    config.py     typed configs: the pydantic base, TOML/YAML files, --set overrides, one-line errors
    cli_args.py   argparse types: counts, durations, lists and run names checked when a command line is parsed
    progress.py   rich progress bars that fall back to quiet lines when not a TTY
    rundir.py     a run directory: resolved config, metrics.jsonl, PNG plots
    digest.py     sha256 of a file or a directory tree
    hf.py         HF checkpoints: load/save model and tokenizer, a run directory's final/ as a checkpoint
"""
