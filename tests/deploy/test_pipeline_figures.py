"""The pipeline tables in README.md and docs/pipeline.md are the committed runs' report.json, printed
the way `postrain pipeline` prints them (so they cannot drift from the JSONs)."""
import json
from pathlib import Path

from deploy.pipeline_report import final_table

ROOT = Path(__file__).resolve().parents[2]


def _table(seed: int) -> str:
    return final_table(json.loads((ROOT / "docs" / "results" / f"pipeline_seed{seed}.json").read_text()))


def test_readme_shows_the_seed0_run():
    assert _table(0) in (ROOT / "README.md").read_text()


def test_pipeline_doc_shows_every_committed_run():
    doc = (ROOT / "docs" / "pipeline.md").read_text()
    for path in sorted((ROOT / "docs" / "results").glob("pipeline_seed*.json")):
        assert _table(int(path.stem.removeprefix("pipeline_seed"))) in doc, path.name
