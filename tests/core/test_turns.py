"""selfopd.core.turns: an episode's loss mask cut into the student's turns and the environment's ids."""

from __future__ import annotations

from selfopd.core.turns import Segment, is_episode, segments


def test_segments_are_the_runs_of_the_mask_with_student_turns_numbered():
    mask = [True, True, False, False, False, True, False, True, True]
    assert segments(mask) == [Segment(0, 2, True, 1), Segment(2, 5, False, 1), Segment(5, 6, True, 2),
                              Segment(6, 7, False, 2), Segment(7, 9, True, 3)]
    assert [s.label for s in segments(mask)] == ["turn 1", "environment", "turn 2", "environment", "turn 3"]
    assert segments([True] * 4) == [Segment(0, 4, True, 1)] and segments([]) == []
    assert segments([False, True]) == [Segment(0, 1, False, 0), Segment(1, 2, True, 1)]  # the environment first


def test_only_a_mask_with_environment_ids_is_an_episode_of_several_turns():
    assert is_episode([True, False, True]) and not is_episode([True, True]) and not is_episode(None)
