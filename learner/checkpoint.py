"""Learner checkpoints: HF weights + optimizer + schedule + RNG + iteration + policy version, atomic.

Layout of `ROOT/iter_00000012/` (written as `ROOT/.tmp-iter_00000012-PID/`, every file fsynced, then
renamed into place and the root fsynced, so a crash leaves either the old set or the complete new one):
  model/            `save_pretrained` (safetensors) + tokenizer: what `postrain eval --checkpoint` takes
  trainer.pt        optimizer and LR-schedule state, optimizer step
  rng.pt            one RNG state per learner rank (python, numpy, torch CPU, CUDA)
  NAME.safetensors  state of the loop beside the learner's (`extra`), e.g. `ema`: a weight average
  state.json        iteration, policy version, step, world size, sha256 of every file above
`ROOT/latest` names the newest complete checkpoint (written atomically after the rename).

A checkpoint is data and never runs code when loaded: the weights are safetensors; trainer.pt and
rng.pt hold only tensors, numbers, strings and plain containers (the numpy RNG state is stored as a
tensor) and are read with `torch.load(weights_only=True)`, which refuses any other pickled object.
The sha256 list detects corruption, not tampering: whoever can write the files can rewrite it.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
from pathlib import Path

import numpy as np
import torch

from core import fileio
from core.atomic import fsync_dir, write_atomic
from core.digest import sha256_file
from core.errors import UserError

FORMAT = 2  # 1 stored numpy objects, which only a full (code-running) unpickler reads


def capture_rng() -> dict:
    """Every RNG state of this process, in types `torch.load(weights_only=True)` accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fileio.sync_path(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:08d}"


_EXTRA_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def save_checkpoint(root: str | Path, iteration: int, model, tokenizer, trainer_state: dict,
                    rng_states: list[dict], extra: dict[str, tuple[dict, dict]] | None = None) -> Path:
    """`extra`: name -> (tensors, str metadata), each saved as NAME.safetensors in the same atomic set."""
    from safetensors.torch import save_file

    bad = [n for n in extra or {} if not _EXTRA_NAME.match(n)]
    if bad:
        raise ValueError(f"save_checkpoint: extra state names must be short lowercase identifiers, got {bad}")
    root = Path(root)
    fileio.makedirs(root)
    final = root / checkpoint_name(iteration)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        fileio.rmtree(tmp)
    fileio.mkdir(tmp)
    model.save_pretrained(tmp / "model", safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "model")
    torch.save(trainer_state, tmp / "trainer.pt")
    torch.save(rng_states, tmp / "rng.pt")
    for name, (tensors, meta) in (extra or {}).items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / f"{name}.safetensors", metadata=meta)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    state = {"format": FORMAT, "iteration": iteration, "policy_version": int(trainer_state["policy_version"]),
             "step": int(trainer_state["step"]), "world_size": len(rng_states),
             "sha256": {str(p.relative_to(tmp)): sha256_file(p) for p in files}}
    fileio.write_file(tmp / "state.json", json.dumps(state, indent=2, sort_keys=True).encode())
    _fsync_tree(tmp)
    if final.exists():  # re-saving an iteration: swap the new one in, drop the old one once that is durable
        try:
            fileio.exchange(tmp, final)  # atomic: a crash leaves the old or the new one under the name
        except OSError:  # no renameat2 here: a crash between the renames leaves the old one aside only
            old = root / f".old-{final.name}-{os.getpid()}"
            fileio.rename(final, old)
            fileio.rename(tmp, final)
            tmp = old
        fsync_dir(root)
        fileio.rmtree(tmp)
    else:
        fileio.rename(tmp, final)
    fsync_dir(root)
    write_atomic(root / "latest", final.name.encode())
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if (cand / "state.json").is_file():
            return cand
    done = sorted(p for p in root.glob("iter_*") if (p / "state.json").is_file())
    return done[-1] if done else None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep` (never the one `latest` names, never a
    temp dir of a save in flight); returns what went. Call it only after the newest one is durable."""
    if keep < 1:
        raise ValueError(f"prune_checkpoints: keep must be >= 1, got {keep}")
    root = Path(root)
    newest = latest_checkpoint(root)
    done = sorted(p for p in root.glob("iter_*") if (p / "state.json").is_file())
    gone = [p for p in done[:-keep] if newest is None or p.name != newest.name]
    for p in gone:
        fileio.rmtree(p)
    if gone:
        fsync_dir(root)
    return gone


def read_checkpoint(path: str | Path, verify: bool = True) -> dict:
    """state.json of a checkpoint, after checking that every file is present and matches its sha256."""
    path = Path(path)
    if (path / "latest").is_file() or not (path / "state.json").exists():
        found = latest_checkpoint(path)
        if found is None:
            raise UserError(f"no learner checkpoint at {path} (state.json missing); pass a directory "
                            "written by the GRPO learner, e.g. RUN/checkpoints/iter_00000010")
        path = found
    try:
        state = json.loads((path / "state.json").read_text())
    except ValueError:
        raise UserError(f"checkpoint {path}: state.json is not JSON (cut short?); use an older checkpoint") from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {path}: state.json is not a JSON object; use an older checkpoint")
    if state.get("format") != FORMAT:
        raise UserError(f"checkpoint {path}: format {state.get('format')!r}, this learner reads {FORMAT} "
                        "(format 1 held pickled objects, which are not loaded: loading them could run code)")
    sums = state.get("sha256")
    if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
        raise UserError(f"checkpoint {path}: state.json has no sha256 table of file -> digest; use an older checkpoint")
    for rel in sums:
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts:
            raise UserError(f"checkpoint {path}: state.json lists {rel!r}, not a file inside the checkpoint")
    if verify:
        for rel, digest in sums.items():
            _check_file(path, rel, digest)
    state["path"] = str(path)
    return state


def _check_file(ckpt: Path, rel: str, digest: str) -> Path:
    """`ckpt / rel`, present and matching its sha256 from state.json."""
    f = ckpt / rel
    if not f.is_file():
        raise UserError(f"checkpoint {ckpt}: file {rel} is missing")
    if sha256_file(f) != digest:
        raise UserError(f"checkpoint {ckpt}: file {rel} fails its checksum (corrupt); use an older checkpoint")
    return f


def load_weights(model, model_dir: Path) -> None:
    """Copy safetensors weights into the existing `model` (so optimizer references stay valid)."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    from safetensors import SafetensorError

    tensors = {}
    for shard in shards:
        try:
            tensors.update(load_file(model_dir / shard))
        except (SafetensorError, OSError) as exc:
            raise UserError(f"checkpoint weights {model_dir / shard} do not load ({exc})") from None
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # save_pretrained leaves out tied weights (lm_head = embed_tokens); anything else missing is an error.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ptrs = {params[k].data_ptr() for k in tensors if k in params}
    untied = [k for k in missing if k not in params or params[k].data_ptr() not in loaded_ptrs]
    if untied or unexpected:
        raise UserError(f"checkpoint weights in {model_dir} do not fit the model: missing {untied[:5]}, "
                        f"unexpected {list(unexpected)[:5]}")


def load_into(path: str | Path, model, learner, rank: int = 0) -> dict:
    """Restore weights, optimizer, schedule, step, policy version and rank `rank`'s RNG; returns state.json."""
    state = read_checkpoint(path)
    ckpt = Path(state["path"])
    load_weights(model, ckpt / "model")
    try:
        learner.load_state(load_data(ckpt / "trainer.pt"))
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise UserError(f"checkpoint {ckpt}: trainer.pt does not fit this learner ({type(exc).__name__}: {exc})") from None
    rngs = load_data(ckpt / "rng.pt")
    if not isinstance(rngs, list) or not rngs:
        raise UserError(f"checkpoint {ckpt}: rng.pt holds no list of RNG states")
    try:
        restore_rng(rngs[rank % len(rngs)])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise UserError(f"checkpoint {ckpt}: rng.pt entry {rank % len(rngs)} is not an RNG state "
                        f"({type(exc).__name__}: {exc})") from None
    return state


def load_extra(path: str | Path, name: str) -> tuple[dict, dict] | None:
    """(tensors, metadata) of a checkpoint's NAME.safetensors after its checksum, or None when it has none.
    Only that file is hashed: the learner's `load_into` has checked the rest."""
    from safetensors import SafetensorError
    from safetensors import safe_open

    state = read_checkpoint(path, verify=False)
    rel = f"{name}.safetensors"
    if rel not in state["sha256"]:
        return None
    f = _check_file(Path(state["path"]), rel, state["sha256"][rel])
    try:
        with safe_open(str(f), framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata() or {})
    except (SafetensorError, OSError) as exc:
        raise UserError(f"checkpoint file {f} is not readable safetensors: {exc}") from None


def load_data(path: Path):
    """A torch.save file of tensors and plain containers; anything else is refused, never constructed."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is long advice on how to load it anyway; keep only the line naming the object
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines else type(exc).__name__)
        raise UserError(f"checkpoint file {path} holds objects other than tensors and plain data; refused "
                        f"(loading it could run code): {why}") from None
