"""Stage manifests of a pipeline run: what a finished stage was made from and what it made.

`RUN/<stage>/manifest.json`, written last and atomically when the stage is done: the hash of the
stage's own settings, the sha256 of every input checkpoint, the sha256 of every output, wall time,
status. A rerun keeps a stage whose manifest still matches all of these (outputs re-hashed), and reruns
it otherwise, saying why. Output paths inside the run directory are stored relative to it and read back
against it, so the run directory may be moved or used from another working directory; manifests written
before that (paths as given) are read as they are.

`RUN/<stage>/started.json` is written when a stage begins: the settings hash and inputs it started with. An
unfinished stage whose record differs from the current ones was made by other settings, and nothing in it
may be resumed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from core.atomic import write_atomic
from core.digest import sha256_tree

NAME = "manifest.json"
STARTED = "started.json"
RELATIVE = "run_dir"  # the manifest's `paths`: outputs inside the run directory are relative to it


def settings_hash(settings) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def write(stage_dir: Path, *, settings: str, inputs: dict[str, str], outputs: dict[str, str], wall_s: float,
          extra: dict | None = None) -> dict:
    """outputs: name -> path (stored relative to the run directory, the stage dir's parent, when inside it)."""
    run_dir = Path(stage_dir).parent
    doc = {"status": "done", "settings_hash": settings, "inputs": inputs, "paths": RELATIVE,
           "outputs": {name: {"path": _stored(run_dir, Path(p)), "sha256": sha256_tree(Path(p))}
                       for name, p in outputs.items()},
           "wall_s": round(wall_s, 1), **(extra or {})}
    write_atomic(Path(stage_dir) / NAME, json.dumps(doc, indent=2, sort_keys=True).encode())
    return doc


def _stored(run_dir: Path, path: Path) -> str:
    """`path` relative to `run_dir` when inside it, else absolute."""
    rel = os.path.relpath(path.resolve(), run_dir.resolve())
    return str(path.resolve()) if rel == ".." or rel.startswith(".." + os.sep) else rel


def read(stage_dir: Path) -> dict | None:
    """The finished stage's manifest with its output paths resolved (against the run directory), or None."""
    path = Path(stage_dir) / NAME
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        return None
    if not (isinstance(doc, dict) and doc.get("status") == "done"):
        return None
    if doc.get("paths") == RELATIVE:
        run_dir = Path(stage_dir).parent
        for out in doc.get("outputs", {}).values():
            out["path"] = str(run_dir / out["path"])  # an absolute path stays itself
    return doc


def start(stage_dir: Path, settings: str, inputs: dict[str, str]) -> None:
    """Record the settings and inputs a stage starts with (before it writes anything else)."""
    Path(stage_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(stage_dir) / STARTED, json.dumps({"settings_hash": settings, "inputs": inputs}).encode())


def started_reason(stage_dir: Path, settings: str, inputs: dict[str, str]) -> str | None:
    """Why an unfinished stage's contents may not be resumed (started with other settings or inputs), or None.
    A stage started before this record was kept (or one without a readable record) is left as it is."""
    try:
        doc = json.loads((Path(stage_dir) / STARTED).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("settings_hash") != settings:
        return "its settings changed"
    if doc.get("inputs") != inputs:
        return "its inputs changed"
    return None


def clear(stage_dir: Path) -> None:
    """Empty a stage directory that starts over, keeping its started record."""
    for p in Path(stage_dir).iterdir() if Path(stage_dir).is_dir() else ():
        if p.name == STARTED:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def stale_reason(doc: dict | None, settings: str, inputs: dict[str, str]) -> str | None:
    """None when `doc` still describes a valid finished stage; else why it must run (again)."""
    if doc is None:
        return "not finished"
    if doc.get("settings_hash") != settings:
        return "its settings changed"
    if doc.get("inputs") != inputs:
        return "its inputs changed"
    for name, out in doc.get("outputs", {}).items():
        p = Path(out["path"])
        if not p.exists():
            return f"output {name} ({p}) is missing"
        if sha256_tree(p) != out["sha256"]:
            return f"output {name} ({p}) does not match its sha256 (corrupt or changed)"
    return None
