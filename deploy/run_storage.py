"""A run directory given as a `pyarrow.fs` URI (`--out s3://bucket/runs/calc`, `file:///shared/runs/calc`).

The run works in a local staging directory (HF `save_pretrained`, SQLite and the plots need local
paths) and publishes to the URI through `dataplane.remote`:
  shards        URI/dataplane/store (grpo, opd: OPD's teacher hidden-state cache too) or URI/store (rollout),
                written there directly
  KV snapshots  URI/kv, written there directly
  checkpoints   URI/checkpoints/iter_N/ (a committed tree: files, then MANIFEST.json), then URI/checkpoints/latest
  final policy  URI/final/ (a committed tree)
  run files     RUN_FILES[kind] (config.json, metrics.jsonl, the run's record, plots): one object each, replaced whole
`--resume` downloads the latest committed checkpoint (every file checked against its manifest) and the
run files into the staging directory; a SQLite catalog travels inside each checkpoint (a consistent
copy), so a resume on another machine sees the batches the checkpoint saw. A plain local `--out` is used as it is: nothing here runs.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from core.errors import UserError
from dataplane.errors import ChecksumError
from dataplane.remote import MANIFEST, RemoteStore, is_uri

STAGING_ENV = "POSTRAIN_STAGING"  # where staging directories go (default: the temp directory)
CATALOG = "catalog.db"  # the SQLite catalog's name inside a published checkpoint
RUN_FILES = {  # what each command keeps at the top of its run directory
    "grpo": ("grpo_run.json", "config.json", "metrics.jsonl", "report.json", "grpo.png"),
    "rollout": ("config.json", "metrics.jsonl", "report.json", "rollout.png"),
    "opd": ("opd_run.json", "config.json", "metrics.jsonl", "teacher_eval.json", "opd.png"),
}


def staging_root() -> Path:
    return Path(os.environ.get(STAGING_ENV) or Path(tempfile.gettempdir()) / "postrain-staging")


def _staging_for(uri: str, what: str) -> Path:
    """One directory per URI, named as the URI's last part (a rollout's data-plane run takes that name)."""
    name = uri.rstrip("/").rsplit("/", 1)[-1] or what
    return staging_root() / f"{what}-{hashlib.sha256(uri.encode()).hexdigest()[:16]}" / name


class RunStorage:
    """The run directory of one `kind` of run (a key of RUN_FILES). `local`: where the run writes; `remote`:
    the URI's store, or None for a local run directory."""

    def __init__(self, out: str, kind: str):
        if kind not in RUN_FILES:
            raise ValueError(f"RunStorage: kind {kind!r} is not one of {sorted(RUN_FILES)}")
        self.out, self.kind, self.run_files = str(out), kind, RUN_FILES[kind]
        self.remote = RemoteStore(self.out) if is_uri(out) else None
        self.local = _staging_for(self.out, "run") if self.remote else Path(out)
        self.catalog: Path | None = None  # a SQLite catalog in the staging directory: published with each checkpoint

    def overrides(self) -> list[str]:
        """Shards and KV snapshots straight to the URI (laid under the user's own --set)."""
        if self.remote is None:
            return []
        out = [f"pool.snapshot_uri={self.out}/kv"]
        if self.kind in ("grpo", "opd"):
            out.append(f"loop.store={self.out}/dataplane/store")
        return out

    def prepare(self, resume: bool = False, catalog: str | None = None) -> None:
        """A fresh run needs an empty URI; a resumed one gets its run files and latest checkpoint back.
        `catalog`: the loop's `loop.catalog` setting; empty means the loop's SQLite default in the staging
        directory, which then travels inside every published checkpoint."""
        if self.remote is None:
            return
        if catalog == "":
            self.catalog = self.local / "dataplane" / CATALOG
        held = self.remote.list("") + self.remote.dirs("")
        if not resume:
            if held:
                raise UserError(f"run directory {self.out} is not empty ({', '.join(held[:3])}...); pick a fresh "
                                "--out or pass --resume")
            if self.local.exists():
                shutil.rmtree(self.local)
            self.local.mkdir(parents=True)
            return
        if not held:
            raise UserError(f"--resume: run directory {self.out} holds nothing to resume")
        self.local.mkdir(parents=True, exist_ok=True)  # same machine: the SQLite catalog and WALs are kept
        for name in self.run_files:
            data = self.remote.get(name)
            if data is not None:
                (self.local / name).write_bytes(data)
        ckpts = self.local / "checkpoints"
        if ckpts.exists():  # the URI is the truth: what was published
            shutil.rmtree(ckpts)
        name = self.remote.latest_tree("checkpoints")
        if name is not None:
            try:
                self.remote.download_tree(f"checkpoints/{name}", ckpts / name)
            except ChecksumError as exc:
                raise UserError(f"--resume: the latest checkpoint is damaged: {exc}; delete {self.out}/checkpoints/"
                                f"{name} to resume from the one before it, or start a fresh --out") from None
            (ckpts / "latest").write_text(name)
            if self.catalog is not None and (ckpts / name / CATALOG).is_file():  # the catalog as of that checkpoint
                self.catalog.parent.mkdir(parents=True, exist_ok=True)
                for side in ("-wal", "-shm"):  # an older log must not be replayed into it
                    Path(f"{self.catalog}{side}").unlink(missing_ok=True)
                os.replace(ckpts / name / CATALOG, self.catalog)

    def publish_checkpoint(self, path: str | Path, keep: int = 0) -> None:
        """A local learner checkpoint as URI/checkpoints/NAME, then the run files; older ones beyond `keep` go."""
        if self.remote is None:
            return
        path = Path(path)
        extra = {}
        if self.catalog is not None and self.catalog.is_file():
            copy = self.local / f".{CATALOG}.publish"
            _sqlite_copy(self.catalog, copy)
            extra[CATALOG] = copy
        try:
            self.remote.publish_tree("checkpoints", path.name, path, extra=extra)
        finally:
            for p in extra.values():
                p.unlink(missing_ok=True)
        self.publish_files()
        if keep:  # older committed trees beyond `keep`, and what uploads cut short left behind
            names = [d for d in self.remote.dirs("checkpoints") if d != path.name]
            committed = [d for d in names if self.remote.exists(f"checkpoints/{d}/{MANIFEST}")]
            for old in [d for d in names if d not in committed] + committed[:max(0, len(committed) + 1 - keep)]:
                self.remote.delete(f"checkpoints/{old}/{MANIFEST}")  # un-committed first
                self.remote.fs.delete_dir(self.remote.path(f"checkpoints/{old}"))

    def publish_final(self, path: str | Path) -> None:
        if self.remote is not None:
            self.remote.upload_tree(path, "final")

    def publish_files(self) -> None:
        if self.remote is None:
            return
        for name in self.run_files:
            p = self.local / name
            if p.is_file():
                self.remote.put(name, p.read_bytes())


def _sqlite_copy(src: Path, dst: Path) -> None:
    """A consistent copy of a live SQLite database (the backup API; writers may hold it meanwhile)."""
    import sqlite3

    dst.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(src)) as a, contextlib.closing(sqlite3.connect(dst)) as b:
        a.backup(b)


def check_local_checkpoints(*specs: str | Path) -> None:
    """Every local path among `specs` names a checkpoint (UserError naming the first that does not); a URI is
    checked when `local_checkpoint` downloads it. Called before Ray starts, so a mistyped path costs no start."""
    from core.hf import resolve_checkpoint

    for spec in specs:
        if not is_uri(str(spec)):
            resolve_checkpoint(spec)


def local_checkpoint(spec: str | Path) -> str:
    """`--init` / `--checkpoint` as a local path: a URI's committed tree (itself, or its final/) is downloaded
    into the staging area with every file checked against its manifest; a local path is returned as it is."""
    spec = str(spec)
    if not is_uri(spec):
        return spec
    store = RemoteStore(spec)
    for rel in ("", "final"):
        if store.manifest(rel) is not None:
            dest = _staging_for(f"{spec}/{rel}", "checkpoint")
            try:
                store.download_tree(rel, dest)
            except ChecksumError as exc:
                raise UserError(f"checkpoint {spec}: {exc}") from None
            return str(dest)
    raise UserError(f"checkpoint {spec}: no committed checkpoint there (no {MANIFEST} in it or in its final/); "
                    "expected the URI of a run directory or of a checkpoint published by postrain")
