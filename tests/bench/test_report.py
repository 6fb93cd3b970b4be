"""`postrain bench report`: the figures in README.md and docs/ are generated from bench/results/*.json."""
from __future__ import annotations

import json
import shutil

from bench import report


def test_generated_figures_are_current():
    stale = report.stale(report.load())
    assert stale == [], f"run `postrain bench report --write`: {[str(p) for p in stale]}"


def test_every_latest_result_records_commit_date_and_machine():
    for r in report.load():
        meta = r.data.get("meta") or {}
        assert meta.get("commit") or meta.get("recorded_in_commit"), r.path
        assert meta.get("date_utc") and meta.get("machine"), r.path


def test_a_changed_figure_makes_the_block_stale(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    run = {"targets": {"speed": {"value": 2.0, "goal": ">= 1", "met": True}},
           "meta": {"commit": "abc", "date_utc": "2026-01-01T00:00:00Z", "machine": "test box"}}
    (results / "toy.json").write_text(json.dumps(run))
    doc = tmp_path / "docs" / "toy.md"
    doc.parent.mkdir()
    doc.write_text("# toy\n<!-- targets:toy -->\n<!-- /targets:toy -->\nafter\n")
    text = report.render(doc.read_text(), doc, report.load(results))
    assert "| `speed` | 2 | >= 1 | ✓ | test box | 2026-01-01 | [toy.json](../bench/results/toy.json) |" in text
    assert text.endswith("<!-- /targets:toy -->\nafter\n")
    doc.write_text(text)
    run["targets"]["speed"] = {"value": 0.5, "goal": ">= 1", "met": False}
    (results / "toy.json").write_text(json.dumps(run))
    again = report.render(doc.read_text(), doc, report.load(results))
    assert again != text and "| 0.5 |" in again and "✗" in again
    summary = report.summary_table(report.load(results), tmp_path)
    assert "| toy | test box | 0 / 1 | `speed` 0.5 (goal >= 1) |" in summary
    shutil.rmtree(results)


def test_a_value_just_short_of_its_goal_does_not_print_as_the_goal():
    from bench.report import _fmt

    assert _fmt(0.9699570815450643, ">= 0.97 (worse seed)") == "0.96996"  # one prompt short, not "0.97"
    assert _fmt(0.97, ">= 0.97 (worse seed)") == "0.97"
    assert _fmt(0.9699570815450643) == "0.97"  # no goal to tell apart
    assert _fmt(29.01, "<= 30 (worse of 2 runs)") == "29.01"
    assert _fmt(2.00004, ">= 2") == "2.00004"
    assert _fmt(1.99996, ">= 2") == "1.99996"
