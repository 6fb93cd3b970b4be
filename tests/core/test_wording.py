"""Tracked files speak of the project only: nothing about how, when or by whom the work was done
(development sessions, issue numbers, the tools used to build it). bench/results/history/ keeps old
runs as they were recorded and is not read."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_PREFIXES = ("bench/results/history/", "tests/core/test_wording.py")  # old runs; the patterns themselves
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".json", ".txt", ".proto", ".cfg", ".sh", ".ini", ""}
WHEN = r"(this|that|an earlier|earlier|the previous|previous|a later|later|the next|next|the last|last|my|our)"
PATTERNS = [
    rf"\b{WHEN}\s+sessions?\b",  # development sessions (a process, database or Ray session is fine)
    r"\bsession's\b",
    r"\bissues?\s*#\s*\d+|\bissues?\s+\d+\b",  # issues by number
    rf"\b{WHEN}\s+issues?\b|\bthe issue's\b",
    r"\bstop \d+\b",
    r"\.library\b|postrain_heavy|heavy[- ]benchmark lock|\bdevice tool\b|\bsubagents?\b",
    r"\bother helpers\b|\bhelpers?'s? (jobs?|runs?)\b|\bthe lead\b|closing note|duplicates --change",
]
FORBIDDEN = re.compile("|".join(PATTERNS), re.I)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names
            if not n.startswith(SKIP_PREFIXES) and Path(n).suffix in TEXT_SUFFIXES and (ROOT / n).is_file()]


def offending_lines(text: str) -> list[tuple[int, str]]:
    return [(i, m.group(0)) for i, line in enumerate(text.splitlines(), 1) for m in FORBIDDEN.finditer(line)]


def test_tracked_files_speak_of_the_project_only():
    bad = []
    for path in tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        bad += [f"{path.relative_to(ROOT)}:{i}: {hit!r}" for i, hit in offending_lines(text)]
    assert bad == [], "\n".join(bad)


def test_the_check_sees_development_wording():
    for line in ["measured in this session", "as an earlier session found", "see issue 7", "fixes issue #12",
                 "under the heavy-benchmark lock", "run on the device tool's machine", "later issues add it",
                 "this session's code", "/tmp/postrain_heavy.lock"]:
        assert offending_lines(line), line
    for line in ["bwrap --new-session", "a Ray session behind", "@pytest.fixture(scope=\"session\")",
                 "a helper thread zero-fills the next segment", "the caller's session"]:
        assert not offending_lines(line), line
