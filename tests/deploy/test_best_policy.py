"""The best eval of a run: new bests saved, ties keep the earlier, patience, pruning at checkpoints, resume."""
from __future__ import annotations

from deploy.best_policy import BestPolicy


def _writer(path):
    path.mkdir(parents=True)
    (path / "w").write_text("x")


def _saved(root):
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_new_bests_are_saved_ties_keep_the_earlier_and_patience_counts_evals_since(tmp_path):
    root = tmp_path / "best"
    b = BestPolicy(root, save=True, write=_writer)
    root.mkdir()
    assert b.observe(0, 0.5) and b.path() == root / "it0"
    assert not b.observe(10, 0.5)  # a tie is no new best
    assert b.evals_since == 1 and not b.exhausted(2) and b.exhausted(1) and not b.exhausted(0)
    assert b.observe(20, 0.7) and b.evals_since == 0 and b.iteration == 20
    assert _saved(root) == ["it0", "it20"]  # the older best stays until a checkpoint covers the new one
    b.after_checkpoint(15)
    assert _saved(root) == ["it0", "it20"]
    b.after_checkpoint(20)
    assert _saved(root) == ["it20"] and b.path() == root / "it20"


def test_a_resumed_run_drops_bests_after_its_checkpoint_and_finds_the_earlier_one(tmp_path):
    root = tmp_path / "best"
    root.mkdir()
    b = BestPolicy(root, save=True, write=_writer)
    for i, p in [(0, 0.4), (10, 0.6), (20, 0.5), (30, 0.8)]:
        b.observe(i, p)
    b.after_checkpoint(25)  # it0 goes (covered, not the best); it30 is after the checkpoint
    assert _saved(root) == ["it10", "it30"]
    (root / "it40.tmp").mkdir()  # a save cut short by a kill
    r = BestPolicy(root, save=True, write=_writer)
    r.resume([(0, 0.4), (10, 0.6), (20, 0.5), (30, 0.8)], start=25)  # metrics rows up to the checkpoint
    assert r.iteration == 10 and r.pass_at_1 == 0.6 and r.evals_since == 1
    assert _saved(root) == ["it10"] and r.path() == root / "it10"


def test_without_saving_nothing_is_written_but_patience_still_counts(tmp_path):
    calls = []
    b = BestPolicy(tmp_path / "best", save=False, write=calls.append)
    assert b.observe(0, 0.1) and not b.observe(5, 0.1)
    assert calls == [] and b.path() is None and b.exhausted(1)
