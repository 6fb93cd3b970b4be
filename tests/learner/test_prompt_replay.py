"""Hard-prompt replay queue: FIFO, bounded share, bounded replays, solved prompts leave."""
import pytest

from learner.prompt_replay import PromptReplay


def test_unsolved_prompts_come_back_up_to_the_share_in_order():
    q = PromptReplay(share=0.5, max_replays=3)
    assert q.take(4) == []
    q.observe(["a", "b", "c", "d"], [1.0, 0.5, 0.0, 0.99])
    assert len(q) == 3
    assert q.take(4) == ["b", "c"]  # floor(0.5 * 4) = 2, oldest first
    assert q.take(5) == ["d"]  # only what is queued
    assert q.take(5) == []


def test_solved_prompts_leave_and_replays_are_bounded():
    q = PromptReplay(share=1.0, max_replays=2)
    q.observe(["x", "y"], [0.0, 0.0])
    for _ in range(2):  # x fails every time: replayed twice, then dropped
        got = q.take(2)
        assert "x" in got
        q.observe(got, [0.0 if p == "x" else 1.0 for p in got])
    assert q.take(2) == []  # y was solved on its first replay, x spent its replays


def test_a_fresh_draw_of_a_replayed_prompt_counts_once():
    q = PromptReplay(share=1.0, max_replays=1)
    q.observe(["x"], [0.0])
    assert q.take(1) == ["x"]
    q.observe(["x", "x"], [0.0, 0.0])  # replayed and drawn fresh in the same batch
    assert q.take(2) == ["x"]  # the fresh one is new, so it may come back once; the replay is spent


@pytest.mark.parametrize("kwargs", [{"share": -0.1, "max_replays": 1}, {"share": 1.5, "max_replays": 1},
                                    {"share": 0.5, "max_replays": 0},
                                    {"share": 0.5, "max_replays": 1, "solved_below": 0.0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        PromptReplay(**kwargs)


def test_mismatched_observation_is_refused():
    with pytest.raises(ValueError):
        PromptReplay(0.5, 1).observe(["a"], [0.0, 1.0])


def test_only_groups_below_the_bar_are_queued_and_the_queue_keeps_the_newest():
    q = PromptReplay(share=1.0, max_replays=1, solved_below=0.5, capacity=2)
    q.observe(["easy", "half", "hard"], [0.875, 0.5, 0.25])
    assert q.take(3) == ["hard"]  # 0.875 and 0.5 are not below the bar
    q.observe(["a", "b", "c"], [0.0, 0.0, 0.0])
    assert q.take(3) == ["b", "c"]  # capacity 2: the oldest entry went
