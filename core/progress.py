"""Progress bars for long work (rich), quiet when stderr is not a terminal or `quiet` is asked."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def progress(description: str, total: int, quiet: bool = False) -> Iterator:
    """Yields `advance(n=1, **fields)`; shows a rich bar on a TTY, else nothing."""
    if quiet or not sys.stderr.isatty():
        yield lambda n=1, **fields: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeRemainingColumn(), TextColumn("{task.fields[info]}"), transient=False,
    ) as bar:
        task = bar.add_task(description, total=total, info="")

        def advance(n: int = 1, **fields) -> None:
            info = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
            bar.update(task, advance=n, info=info)

        yield advance


def quiet_library_bars(quiet: bool = False) -> None:
    """Hugging Face's own bars (loading and writing weights, one per checkpoint) follow the rule of ours: off
    when `quiet` or stderr is not a terminal, else a run's log fills with them. An explicit
    HF_HUB_DISABLE_PROGRESS_BARS wins. Call it before transformers loads: huggingface_hub reads the variable
    once, at import (processes started later, Ray's workers among them, inherit it)."""
    if not quiet and sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        hub.disable_progress_bars()
