"""Small JSON records a run directory keeps about itself (pipeline.json, grpo_run.json, opd_run.json,
results.json): reading them with one clear error when damaged, and the settings that make a run what it is.

A run's identity is the hash of the settings that define what it computes (its resolved config and its
starting weights or teachers). A resume under another identity would mix two runs in one directory, so it
is refused, naming what differs. Not part of the identity: the time budget (`loop.time_budget_s`; the
pipeline resumes an interrupted run with the rest of its budget, and a budget only says when the same run
ends, as `--iterations` and `--stop-after` do) and what `final/` is made of (`loop.final`,
`loop.ema_decay`: they do not change the iterates, and a run resumed under another one says so in an
`ema` row).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.errors import UserError
from deploy.manifest import settings_hash as digest

NOT_IDENTITY = (("loop", "time_budget_s"), ("loop", "final"), ("loop", "ema_decay"))  # may change on resume


def read_record(path: Path, keys: dict[str, type | tuple[type, ...]], remedy: str) -> dict:
    """The JSON object in `path`, checked to hold `keys` of their types; otherwise one UserError naming the
    file, what is wrong and `remedy` (what to do: delete it, or start another run)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is damaged: not JSON ({exc}); delete it or {remedy}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path} is damaged: expected a JSON object, got {type(doc).__name__}; delete it or {remedy}")
    for key, kind in keys.items():
        if not isinstance(doc.get(key), kind):
            raise UserError(f"{path} is damaged: {key!r} is missing or not {_kind_name(kind)}; delete it or {remedy}")
    return doc


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({str: "a string", dict: "an object", list: "a list", int: "an integer",
                        bool: "a boolean"}.get(k, k.__name__) for k in kinds)


def identity_config(cfg) -> dict:
    """The resolved config of a run without the fields that are not part of its identity."""
    doc = cfg.model_dump(mode="json")
    for table, key in NOT_IDENTITY:
        doc.get(table, {}).pop(key, None)
    return doc


def identity(**parts: Any) -> dict[str, str]:
    """One hash per part of a run's identity (config, init, teachers, ...), so a mismatch can say which."""
    return {name: digest(value) for name, value in parts.items()}


def check_resume(verb: str, record: Path, recorded: Any, current: dict[str, str], config: dict) -> None:
    """Refuse resuming the run whose `record` (grpo_run.json, opd_run.json) holds the identity `recorded` at
    its start when it differs from `current` (`config`: the identity config hashed into it). A run recorded
    before identities were kept (`recorded` None) is resumed as before."""
    if recorded is None:
        return
    if not isinstance(recorded, dict):
        raise UserError(f"{record} is damaged: 'settings' is not an object; delete the run or start it afresh "
                        "in another --out")
    out = Path(record).parent
    differ = [name for name in current if recorded.get(name) != current[name]]
    if not differ:
        return
    shown = [f"config ({_config_diff(out / 'config.json', config)})" if name == "config" else name for name in differ]
    free = ", ".join(f"{table}.{key}" for table, key in NOT_IDENTITY)
    raise UserError(f"{verb}: {out} was started with other settings ({'; '.join(shown)}); --resume needs the run's "
                    f"own settings (only {free}, --iterations and --stop-after may change): pick a fresh --out to "
                    "train with these")


def _config_diff(old_config: Path, new: dict, limit: int = 4) -> str:
    """The dotted keys in which the config a run dumped at its start differs from `new`."""
    try:
        old = json.loads(Path(old_config).read_text())
    except (OSError, ValueError):
        return "the resolved config"
    if not isinstance(old, dict):
        return "the resolved config"
    for table, key in NOT_IDENTITY:
        old.get(table, {}).pop(key, None)
    a, b = _flat(old), _flat(new)
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if not keys:
        return "the resolved config"
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _flat(doc: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in doc.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
