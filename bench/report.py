"""`postrain bench report`: the targets of every latest benchmark JSON in bench/results/, as a table,
and the generated blocks of README.md and docs/*.md, so that no figure in them is copied by hand.

A JSON `bench/results/NAME.json` is the latest run of benchmark NAME on the CPU machine it names;
`NAME_h200.json` the latest on an H200 host, `NAME_h100.json` on an H100 host. `bench/results/history/`
keeps older runs and is not read.
A generated block is the text between `<!-- targets:KEY -->` and `<!-- /targets:KEY -->`: KEY `all`
is the summary (one row per JSON), any other KEY the targets of benchmark KEY (both devices).

    postrain bench report [--json]        print the targets table
    postrain bench report --write         rewrite the generated blocks
    postrain bench report --check         exit 1 when a generated block is not current
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEVICE_SUFFIXES = ("h200", "h100")  # NAME_<suffix>.json: the run of NAME on that device
BLOCK = re.compile(r"(<!-- targets:([\w-]+) -->\n)(.*?)(<!-- /targets:\2 -->)", re.S)


@dataclass
class Result:
    name: str  # benchmark name (file stem without the device suffix)
    device: str  # "cpu" or a suffix of DEVICE_SUFFIXES
    path: Path
    data: dict

    @property
    def targets(self) -> dict:
        return self.data.get("targets") or {}

    @property
    def machine(self) -> str:
        meta = self.data.get("meta") or {}
        return str(meta.get("machine") or self.data.get("device") or "?")

    @property
    def date(self) -> str:
        return str((self.data.get("meta") or {}).get("date_utc") or "?")[:10]


def load(results: Path = RESULTS) -> list[Result]:
    out = []
    for path in sorted(results.glob("*.json")):
        stem, device = path.stem, "cpu"
        for suffix in DEVICE_SUFFIXES:
            if stem.endswith("_" + suffix):
                stem, device = stem[: -len(suffix) - 1], suffix
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        out.append(Result(stem, device, path, data))
    return out


def _fmt(value, goal=None) -> str:
    """The value as the tables show it; a float that would print as its goal's threshold without being it
    (0.96996 against ">= 0.97") keeps the digits that tell them apart."""
    if value is None:
        return "not run"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            text = f"{value:.3g}"
        else:
            text = f"{value:.4g}" if abs(value) < 100 else f"{value:,.1f}"
        bound = _threshold(goal)
        digits = 5
        while bound is not None and value != bound and float(text.replace(",", "")) == bound and digits <= 12:
            text, digits = f"{value:.{digits}g}", digits + 1
        return text
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _threshold(goal) -> float | None:
    """The number a goal compares with (">= 0.97 (worse seed)" -> 0.97), or None."""
    m = re.match(r"\s*(?:<=|>=|<|>|==)\s*(-?[0-9.]+(?:e-?[0-9]+)?)", str(goal or ""))
    try:
        return float(m.group(1)) if m else None
    except ValueError:
        return None


def _met(target: dict) -> str:
    met = target.get("met")
    return "—" if met is None else ("✓" if met else "✗")


def _link(result: Result, relative_to: Path) -> str:
    rel = os.path.relpath(result.path, relative_to)
    return f"[{result.path.name}]({rel})"


def target_rows(results: list[Result]) -> list[dict]:
    rows = []
    for r in results:
        for key, t in r.targets.items():
            t = t if isinstance(t, dict) else {"value": t}
            rows.append({"benchmark": r.name, "device": r.device, "target": key, "value": t.get("value"),
                         "goal": t.get("goal"), "met": t.get("met"), "machine": r.machine, "date": r.date,
                         "json": str(r.path.relative_to(ROOT))})
    return rows


def bench_table(results: list[Result], name: str, relative_to: Path) -> str:
    """Every target of benchmark `name` on every device: value, goal, met, machine, date, JSON."""
    chosen = [r for r in results if r.name == name]
    if not chosen:
        return f"_No results for benchmark `{name}` in bench/results/ yet._"
    lines = ["| target | value | goal | met | machine | date | JSON |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in chosen:
        for key, t in r.targets.items():
            t = t if isinstance(t, dict) else {"value": t}
            if t.get("value") is None:
                continue  # a target of the other device, not measured in this run
            lines.append(f"| `{key}` | {_fmt(t.get('value'), t.get('goal'))} | {t.get('goal', '')} | {_met(t)} | {r.machine} | "
                         f"{r.date} | {_link(r, relative_to)} |")
    return "\n".join(lines)


def summary_table(results: list[Result], relative_to: Path) -> str:
    """One row per JSON with targets: how many are met, and the unmet ones by name and value."""
    lines = ["| benchmark | machine | targets met | not met | JSON |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        measured = {k: t for k, t in r.targets.items() if isinstance(t, dict) and t.get("value") is not None}
        if not measured:
            continue
        met = sum(bool(t.get("met")) for t in measured.values())
        unmet = ", ".join(f"`{k}` {_fmt(t['value'], t.get('goal'))} (goal {t.get('goal')})" for k, t in measured.items()
                          if t.get("met") is False) or "—"
        lines.append(f"| {r.name} | {r.machine} | {met} / {len(measured)} | {unmet} | {_link(r, relative_to)} |")
    return "\n".join(lines)


def render(text: str, path: Path, results: list[Result]) -> str:
    """`text` with every generated block filled from `results` (links relative to `path`'s folder)."""
    here = path.parent

    def fill(m: re.Match) -> str:
        key = m.group(2)
        body = summary_table(results, here) if key == "all" else bench_table(results, key, here)
        return f"{m.group(1)}{body}\n{m.group(4)}"

    return BLOCK.sub(fill, text)


def documents(root: Path = ROOT) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def stale(results: list[Result], root: Path = ROOT) -> list[Path]:
    """The documents whose generated blocks differ from what the JSONs give."""
    return [p for p in documents(root) if render(p.read_text(), p, results) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="postrain bench report", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the targets as JSON rows")
    p.add_argument("--write", action="store_true", help="rewrite the generated blocks of README.md and docs/*.md")
    p.add_argument("--check", action="store_true", help="exit 1 when a generated block is not current")
    a = p.parse_args(argv)
    results = load()
    if a.write:
        for path in documents():
            text = path.read_text()
            new = render(text, path, results)
            if new != text:
                path.write_text(new)
                print(f"updated {path.relative_to(ROOT)}")
        return 0
    if a.check:
        bad = stale(results)
        for path in bad:
            print(f"{path.relative_to(ROOT)}: generated figures are not current; run `postrain bench report --write`",
                  file=sys.stderr)
        return 1 if bad else 0
    if a.json:
        print(json.dumps(target_rows(results), indent=2))
        return 0
    rows = target_rows(results)
    width = max((len(r["benchmark"]) + len(r["target"]) for r in rows), default=20) + 3
    for r in rows:
        if r["value"] is None:
            continue
        met = {True: "met", False: "NOT MET", None: "-"}[r["met"]]
        print(f"{r['benchmark'] + ' / ' + r['target']:<{width}} {_fmt(r['value'], r['goal']):>12}  {str(r['goal'])[:40]:<40}  "
              f"{met:<8} {r['machine'][:40]}  {r['date']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
