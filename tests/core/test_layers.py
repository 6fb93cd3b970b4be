"""Dependencies point one way: each package imports only packages below it in LAYERS (or itself).

Read from the import graph (every `import` and `from … import`, at any depth of a module, relative
imports resolved), so a lazy import inside a function counts the same as one at the top.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# bottom first; a package may import those before it
LAYERS = ["core", "wal", "rewards", "dataplane", "rollout", "learner", "distill", "chaos", "bench", "deploy"]
# never in a package of LAYERS: the heavy frameworks the leaves must not need
FORBIDDEN = {"wal": {"torch", "ray"}, "core": {"ray", "grpc", "sqlalchemy", "pyarrow"},
             "dataplane": {"ray"}}


def imported_top_names(path: Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every import in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg_parts = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update((a.name.split(".")[0], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's own package
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                top = base[0] if base else (node.module or "").split(".")[0]
            else:
                top = (node.module or "").split(".")[0]
            out.add((top, node.lineno))
    return out


def violations(layers: list[str], forbidden: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(layers)}
    bad = []
    for pkg in layers:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for top, line in sorted(imported_top_names(path)):
                where = f"{path.relative_to(ROOT)}:{line}"
                if top in rank and rank[top] > rank[pkg]:
                    bad.append(f"{where}: {pkg} imports {top}, which sits above it")
                if top in forbidden.get(pkg, ()):
                    bad.append(f"{where}: {pkg} imports {top}")
    return bad


def test_layers_point_one_way():
    assert violations(LAYERS, FORBIDDEN) == []


def test_every_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(LAYERS)


def test_the_check_sees_an_upward_import():
    # the same check with the order reversed must flag deploy's imports of the packages it composes
    assert any(v.startswith("deploy/") and "imports core" in v for v in violations(LAYERS[::-1], {}))
    assert any("imports torch" in v for v in violations(LAYERS, {"learner": {"torch"}}))


@pytest.mark.parametrize("src, expected", [
    ("from . import x\n", "wal"), ("from .codec import y\n", "wal"), ("import wal.codec as c\n", "wal"),
    ("def f():\n    from deploy import cli\n", "deploy"),
])
def test_import_forms(src, expected):
    path = ROOT / "wal" / "_layer_probe_tmp.py"
    path.write_text(src)
    try:
        assert expected in {top for top, _ in imported_top_names(path)}
    finally:
        path.unlink()
