"""Objects under a `pyarrow.fs` URI (s3://, gs://, hdfs://, file://, or a path inside a given filesystem).

The one way shards, KV snapshots, checkpoints and reports reach storage that is not a plain local
path (plain local paths keep their own fast path: `core.atomic`, fsync, memory maps).

Commit rules, the same on every filesystem (object stores have no rename and no fsync):
- one object (`put`): written to a temp key, then moved onto its name; a reader sees the old object
  or the complete new one (S3 / GCS: the move is a server-side copy, itself all or nothing).
- a tree (`upload_tree`): its old MANIFEST.json goes first, then every file, then the manifest
  (sha256 and size of each file) written last; `download_tree` trusts a tree only through its
  manifest and checks every file's sha256 against it. A writer that dies midway leaves a tree
  without a manifest, which readers pass over.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from core import fileio
from core.errors import UserError
from dataplane.errors import ChecksumError

MANIFEST = "MANIFEST.json"
TREE_FORMAT = "postrain-tree-1"
CHUNK_BYTES = 8 << 20
_ERRORS = (OSError, ValueError, pa.ArrowException)


def is_uri(root: str | os.PathLike) -> bool:
    """A `scheme://` root goes through pyarrow.fs; anything else is a local path."""
    return "://" in str(root)


class RemoteStore:
    """Objects by relative key under `uri` (or under `uri` as a path inside `filesystem`)."""

    def __init__(self, uri: str, filesystem: pafs.FileSystem | None = None):
        self.uri = str(uri).rstrip("/")
        try:
            if filesystem is not None:
                self.fs, base = filesystem, self.uri
            else:
                self.fs, base = pafs.FileSystem.from_uri(self.uri)
        except _ERRORS as exc:
            raise UserError(f"storage {self.uri}: pyarrow.fs cannot resolve it ({_first_line(exc)}); "
                            "expected a local path or a URI such as file:///abs/dir, s3://bucket/prefix, "
                            "gs://bucket/prefix, hdfs://host:port/dir") from None
        self.base = base.rstrip("/")

    def path(self, rel: str) -> str:
        rel = rel.strip("/")
        return f"{self.base}/{rel}" if rel else self.base

    def url(self, rel: str) -> str:
        """`rel` as a URI, for messages."""
        rel = rel.strip("/")
        return f"{self.uri}/{rel}" if rel else self.uri

    # -- one object ------------------------------------------------------------------------------
    def put(self, rel: str, data) -> None:
        """Publish `data` under `rel`: temp key, then a move onto the name (see module doc)."""
        final = self.path(rel)
        parent, name = final.rsplit("/", 1)
        tmp = f"{parent}/.{name}.tmp.{uuid.uuid4().hex[:12]}"
        try:
            self.fs.create_dir(parent, recursive=True)
            with self.fs.open_output_stream(tmp) as out:
                out.write(data)
            self.fs.move(tmp, final)
        except _ERRORS as exc:
            self._try_delete(tmp)
            raise UserError(f"storage {self.url(rel)}: cannot write ({_first_line(exc)})") from None

    def get(self, rel: str) -> bytes | None:
        """The object's bytes, or None when there is none."""
        try:
            with self.fs.open_input_stream(self.path(rel)) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except _ERRORS as exc:
            if self.fs.get_file_info(self.path(rel)).type == pafs.FileType.NotFound:
                return None
            raise UserError(f"storage {self.url(rel)}: cannot read ({_first_line(exc)})") from None

    def exists(self, rel: str) -> bool:
        return self.fs.get_file_info(self.path(rel)).type == pafs.FileType.File

    def delete(self, rel: str) -> bool:
        if not self.exists(rel):
            return False
        self.fs.delete_file(self.path(rel))
        return True

    def list(self, prefix: str = "", recursive: bool = False) -> list[str]:
        """Relative keys of the objects under `prefix` (temp keys of unfinished writes left out)."""
        sel = pafs.FileSelector(self.path(prefix), recursive=recursive, allow_not_found=True)
        n = len(self.base) + 1
        return sorted(i.path[n:] for i in self.fs.get_file_info(sel)
                      if i.type == pafs.FileType.File and not i.base_name.startswith("."))

    def dirs(self, prefix: str = "") -> list[str]:
        """Names of the directories (common prefixes) right under `prefix`."""
        sel = pafs.FileSelector(self.path(prefix), allow_not_found=True)
        return sorted(i.base_name for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.Directory)

    def sweep_temps(self, prefix: str = "", older_than_s: float = 3600.0) -> int:
        """Delete the temp keys (`.NAME.tmp.*`, see `put`) right under `prefix` whose writer stopped more than
        `older_than_s` ago: it died between the write and the move. A live writer's temp key is younger (one
        stream, then the move). Returns how many went; a listing or delete that fails skips them."""
        cutoff = time.time() - older_than_s
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path(prefix), allow_not_found=True))
        except _ERRORS:
            return 0
        gone = 0
        for i in infos:
            if i.type != pafs.FileType.File or not i.base_name.startswith(".") or ".tmp." not in i.base_name:
                continue
            if i.mtime is None or i.mtime.timestamp() > cutoff:  # no time kept: it may be a live writer's
                continue
            try:
                self.fs.delete_file(i.path)
                gone += 1
            except _ERRORS:
                pass
        return gone

    def _try_delete(self, path: str) -> None:
        try:
            self.fs.delete_file(path)
        except _ERRORS:
            pass

    # -- trees with a manifest -------------------------------------------------------------------
    def upload_tree(self, local: str | Path, rel: str, between_files=None, extra: dict[str, Path] | None = None) -> dict:
        """Every file under local directory `local` (and the files of `extra`, by key) to `rel/`, then
        `rel/MANIFEST.json` last. `between_files(i)` is called after the i-th file (fault drills stop there)."""
        local = Path(local)
        files = [(p.relative_to(local).as_posix(), p) for p in sorted(local.rglob("*")) if p.is_file()]
        files += sorted((extra or {}).items())
        if not files:
            raise UserError(f"upload {local} -> {self.url(rel)}: no files to upload")
        self.delete(f"{rel}/{MANIFEST}")  # uncommitted while its files change
        entries = {}
        for i, (key, p) in enumerate(files):
            entries[key] = self._upload_file(p, f"{rel}/{key}")
            if between_files is not None:
                between_files(i)
        manifest = {"format": TREE_FORMAT, "files": entries}
        self.put(f"{rel}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
        return manifest

    def _upload_file(self, src: Path, rel: str) -> dict:
        h, size = hashlib.sha256(), 0
        path = self.path(rel)
        try:
            self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            with open(src, "rb") as f, self.fs.open_output_stream(path) as out:
                while block := f.read(CHUNK_BYTES):
                    h.update(block)
                    out.write(block)
                    size += len(block)
        except _ERRORS as exc:
            raise UserError(f"upload {src} -> {self.url(rel)}: {_first_line(exc)}") from None
        return {"sha256": h.hexdigest(), "bytes": size}

    def manifest(self, rel: str) -> dict | None:
        """The tree's manifest, or None when `rel` holds no committed tree."""
        raw = self.get(f"{rel}/{MANIFEST}")
        if raw is None:
            return None
        try:
            m = json.loads(raw)
            files = m["files"]
            ok = m.get("format") == TREE_FORMAT and isinstance(files, dict) and all(
                isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("bytes"), int)
                for e in files.values())
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise ChecksumError(f"{self.url(rel)}/{MANIFEST}: not a {TREE_FORMAT} manifest")
        for key in files:
            parts = key.split("/")
            if key.startswith("/") or ".." in parts or "" in parts:
                raise ChecksumError(f"{self.url(rel)}/{MANIFEST}: file name {key!r} leaves the tree")
        return m

    def download_tree(self, rel: str, local: str | Path) -> dict:
        """The committed tree `rel` into local directory `local` (made whole, then renamed into place),
        every file checked against the manifest's sha256 and size."""
        m = self.manifest(rel)
        if m is None:
            raise UserError(f"{self.url(rel)}: no committed tree ({MANIFEST} missing: never written, or an upload "
                            "that did not finish)")
        local = Path(local)
        tmp = local.with_name(f".{local.name}.tmp.{os.getpid()}")
        if tmp.exists():
            fileio.rmtree(tmp)
        for key, e in sorted(m["files"].items()):
            dst = tmp / key
            dst.parent.mkdir(parents=True, exist_ok=True)
            h, size = hashlib.sha256(), 0
            try:
                with self.fs.open_input_stream(self.path(f"{rel}/{key}")) as f, open(dst, "wb") as out:
                    while block := f.read(CHUNK_BYTES):
                        h.update(block)
                        out.write(block)
                        size += len(block)
            except _ERRORS as exc:
                raise ChecksumError(f"{self.url(rel)}/{key}: listed in the manifest, unreadable "
                                    f"({_first_line(exc)})") from None
            if h.hexdigest() != e["sha256"] or size != e["bytes"]:
                raise ChecksumError(f"{self.url(rel)}/{key}: sha256 or size differs from the manifest "
                                    f"({size} bytes read, {e['bytes']} listed): corrupt or overwritten")
        if local.exists():
            fileio.rmtree(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, local)
        return m

    def publish_tree(self, prefix: str, name: str, local: str | Path, between_files=None,
                     extra: dict[str, Path] | None = None) -> str:
        """`local` (+ `extra`) as committed tree `prefix/name`, then `prefix/latest` names it; returns its key."""
        self.upload_tree(local, f"{prefix}/{name}", between_files, extra)
        self.put(f"{prefix}/latest", name.encode())
        return f"{prefix}/{name}"

    def latest_tree(self, prefix: str) -> str | None:
        """Name of the newest committed tree under `prefix`: the one `latest` names if it is committed, else
        the last committed one by name (a publish cut short between its manifest and the pointer)."""
        pointer = (self.get(f"{prefix}/latest") or b"").decode().strip()
        if pointer and "/" not in pointer and self.exists(f"{prefix}/{pointer}/{MANIFEST}"):
            return pointer
        done = [d for d in self.dirs(prefix) if self.exists(f"{prefix}/{d}/{MANIFEST}")]
        return done[-1] if done else None

    # -- check -----------------------------------------------------------------------------------
    def probe(self) -> str:
        """Write, read back and delete a probe object; a line saying so, or UserError naming the URI."""
        rel, body = f".probe-{uuid.uuid4().hex}", uuid.uuid4().bytes
        fresh = self.fs.get_file_info(self.base).type == pafs.FileType.NotFound
        self.put(rel, body)
        try:
            got = self.get(rel)
        finally:
            try:
                self.delete(rel)
                if fresh and not self.fs.get_file_info(pafs.FileSelector(self.base, allow_not_found=True)):
                    self.fs.delete_dir(self.base)  # a check leaves nothing behind
            except _ERRORS as exc:
                raise UserError(f"storage {self.url(rel)}: cannot delete ({_first_line(exc)})") from None
        if got != body:
            raise UserError(f"storage {self.uri}: a probe object read back differs from what was written")
        return f"{self.uri} ({self.fs.type_name}): probe object written, read back, deleted"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
