"""Group-relative advantages against a per-group loop, and zero-variance accounting."""
from __future__ import annotations

import itertools
import statistics

import pytest
import torch

from learner.advantages import group_advantages


def loop_reference(rewards, groups, std_normalise, leave_one_out, eps=1e-6):
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        rs = [rewards[i] for i in idx]
        if max(rs) == min(rs):
            continue
        sd = statistics.stdev(rs) if len(rs) > 1 else 0.0
        for i in idx:
            base = (sum(rs) - rewards[i]) / (len(rs) - 1) if leave_one_out else statistics.fmean(rs)
            a = rewards[i] - base
            out[i] = a / (sd + eps) if std_normalise else a
    return out


@pytest.mark.parametrize("std_normalise,leave_one_out", list(itertools.product([False, True], repeat=2)))
def test_matches_loop(std_normalise, leave_one_out):
    g = torch.Generator().manual_seed(0)
    groups = torch.tensor([7] * 4 + [3] * 5 + [9] * 4 + [1] * 3)  # ragged groups, unsorted ids
    rewards = torch.randint(0, 3, (len(groups),), generator=g).double()
    rewards[4:9] = 1.0  # group 3 has zero variance
    rewards[9:13] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    adv = group_advantages(rewards, groups, std_normalise=std_normalise, leave_one_out=leave_one_out)
    expected = loop_reference(rewards.tolist(), groups.tolist(), std_normalise, leave_one_out)
    torch.testing.assert_close(adv.advantages_B, torch.tensor(expected, dtype=torch.float64))
    assert adv.groups == 4 and adv.zero_variance_groups >= 1
    assert adv.keep_B.all()


def test_zero_variance_counted_and_filtered():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    adv = group_advantages(rewards, groups, filter_zero_variance=True)
    assert adv.zero_variance_groups == 3 and adv.groups == 4
    assert adv.zero_variance_frac == pytest.approx(0.75)
    assert adv.keep_B.tolist() == [False, False, True, True, False, False, False, False]
    assert (adv.advantages_B[[0, 1, 4, 5, 6, 7]] == 0).all()
    assert adv.advantages_B[2] < 0 < adv.advantages_B[3]


def test_group_means_are_zero_and_std_one():
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(64, generator=g)
    groups = torch.arange(64) // 8
    adv = group_advantages(rewards, groups)
    per_group = adv.advantages_B.view(8, 8)
    torch.testing.assert_close(per_group.mean(1), torch.zeros(8, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(per_group.std(1), torch.ones(8, dtype=torch.float64), atol=1e-4, rtol=0)


def test_bad_input():
    with pytest.raises(ValueError, match="one \\[B\\]"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]))
