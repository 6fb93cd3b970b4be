"""Token staleness: histogram, and the bound in mask and drop modes."""
from __future__ import annotations

import pytest
import torch

from learner.staleness import apply_staleness_bound, token_staleness


def example():
    # three sequences; the second switched weights mid-trajectory (versions 3 -> 5)
    versions = torch.tensor([5, 5, 5, 3, 3, 3, 5, 5, 4, 4])
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2])
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    return versions, seq_ids, mask


def test_histogram_and_no_bound():
    versions, seq_ids, mask = example()
    rep = apply_staleness_bound(6, versions, mask, seq_ids, bound=None)
    assert rep.histogram == {1: 4, 2: 1, 3: 2}
    assert rep.max_staleness == 3
    assert torch.equal(rep.loss_mask_N, mask) and rep.tokens_removed == 0


def test_mask_mode_removes_only_stale_tokens():
    versions, seq_ids, mask = example()
    rep = apply_staleness_bound(6, versions, mask, seq_ids, bound=2, mode="mask")
    assert rep.tokens_over_bound == 2 and rep.tokens_removed == 2 and rep.seqs_dropped == 0
    assert rep.loss_mask_N.tolist() == [0, 1, 1, 0, 0, 0, 1, 1, 0, 1]


def test_drop_mode_removes_whole_trajectories():
    versions, seq_ids, mask = example()
    rep = apply_staleness_bound(6, versions, mask, seq_ids, bound=2, mode="drop")
    assert rep.keep_seq_S.tolist() == [True, False, True]
    assert rep.loss_mask_N.tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    assert rep.tokens_over_bound == 2 and rep.tokens_removed == 4 and rep.seqs_dropped == 1


def test_bound_zero_is_strictly_on_policy():
    versions, seq_ids, mask = example()
    rep = apply_staleness_bound(5, versions, mask, seq_ids, bound=0)
    assert rep.loss_mask_N.tolist() == [0, 1, 1, 0, 0, 0, 1, 1, 0, 0]


def test_future_version_is_an_error():
    with pytest.raises(ValueError, match="newer than the learner"):
        token_staleness(2, torch.tensor([1, 3]))
    versions, seq_ids, mask = example()
    with pytest.raises(ValueError, match="mode"):
        apply_staleness_bound(6, versions, mask, seq_ids, bound=1, mode="clip")
