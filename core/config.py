"""Typed configs: pydantic models (one per component, in its package), TOML/YAML files, CLI overrides.

A file holds one table per component (`[policy]`, `[sft]`, …); `--set sft.steps=200` overrides a field.
Unknown keys, wrong types and out-of-bounds values fail with one line naming the key.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from core.atomic import write_atomic
from core.errors import UserError

C = TypeVar("C", bound=BaseModel)


class Config(BaseModel):
    """Base of every component config: strict keys, validated on assignment, frozen after checks."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def read_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise UserError(f"config file not found: {path}")
    if not path.is_file():
        raise UserError(f"config file {path} is {'a directory' if path.is_dir() else 'not a regular file'}; "
                        "expected a .toml, .yaml or .yml file")
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise UserError(f"config file {path}: expected .toml, .yaml or .yml")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        data = yaml.safe_load(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} does not parse: {exc}") from None
    except yaml.YAMLError as exc:  # its message runs over several lines, with a quote of the file
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"config file {path} does not parse{where}: {what}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path}: the top level must be a mapping of tables, not a {type(data).__name__}")
    return data


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # bare strings need no quotes on the command line


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`a.b=3` sets data['a']['b'] = 3 (the value parsed as JSON where it parses, else a string)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r}: expected KEY=VALUE, e.g. sft.steps=200")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {item!r}: {part!r} is not a table")
        node[leaf] = _parse_value(raw)
    return data


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on top, table by table (a new dict; neither input changes)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def build(model: type[C], data: dict[str, Any], where: str = "config") -> C:
    """Validate `data` as `model`; a failure names the first bad key and why."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "extra_forbidden":
            known = ", ".join(_fields(model, err["loc"][:-1]))
            raise UserError(f"{where}: unknown key {key!r} (known here: {known})") from None
        raise UserError(f"{where}: {key}: {err['msg']} (got {err.get('input')!r})") from None


def _fields(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(model.model_fields)


def load(model: type[C], path: str | Path | None = None, overrides: list[str] | None = None) -> C:
    data = read_file(path) if path else {}
    data = apply_overrides(data, overrides or [])
    return build(model, data, where=str(path) if path else "config")


def dump(cfg: BaseModel, path: str | Path) -> None:
    """Write the resolved config as JSON next to a run's outputs (atomically)."""
    write_atomic(Path(path), json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True).encode())
