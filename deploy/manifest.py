"""Stage manifests of a pipeline run: what a finished stage was made from and what it made.

`RUN/<stage>/manifest.json`, written last and atomically when the stage is done: the hash of the
stage's own settings, the sha256 of every input checkpoint, the sha256 of every output, wall time,
status. A rerun keeps a stage whose manifest still matches all of these (outputs re-hashed), and reruns
it otherwise, saying why.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from core.atomic import write_atomic
from core.digest import sha256_tree

NAME = "manifest.json"


def settings_hash(settings) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def write(stage_dir: Path, *, settings: str, inputs: dict[str, str], outputs: dict[str, str], wall_s: float,
          extra: dict | None = None) -> dict:
    """outputs: name -> path (relative to the run directory's parent-free stage dir or absolute)."""
    doc = {"status": "done", "settings_hash": settings, "inputs": inputs,
           "outputs": {name: {"path": str(p), "sha256": sha256_tree(Path(p))} for name, p in outputs.items()},
           "wall_s": round(wall_s, 1), **(extra or {})}
    write_atomic(Path(stage_dir) / NAME, json.dumps(doc, indent=2, sort_keys=True).encode())
    return doc


def read(stage_dir: Path) -> dict | None:
    path = Path(stage_dir) / NAME
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and doc.get("status") == "done" else None


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
