"""Fault schedules (pure): seeded, every kind once per block, bounded gaps; bad arguments are refused."""
import pytest

from chaos.schedule import ROLLOUT_KINDS, percentile, schedule


def test_schedule_is_seeded_and_covers_every_kind_per_block():
    a, b = schedule(7, 3, 12), schedule(7, 3, 12)
    assert a == b and len(a) == 12 and a != schedule(8, 3, 12)
    for block in (a[:5], a[5:10]):
        assert sorted(f.kind for f in block) == sorted(ROLLOUT_KINDS)
    assert all(0 <= f.slot < 3 and 0 <= f.gap <= 1 for f in a)
    assert {f.kind for f in schedule(1, 2, 4, kinds=("preempt",))} == {"preempt"}


@pytest.mark.parametrize("args", [(1, 0, 1), (1, 1, -1), (1, 1, 1, ("nope",))])
def test_bad_schedules_are_refused(args):
    with pytest.raises(ValueError):
        schedule(*args) if len(args) == 3 else schedule(args[0], args[1], args[2], kinds=args[3])


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99 and percentile([5.0], 99) == 5.0
