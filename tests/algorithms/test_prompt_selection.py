"""Selective rollouts: a record's streak of uniform groups, and the chance it is fed again."""

import numpy as np
import pytest

from algorithms.selection import check_revisit, feed_probability, fed, next_streak


def test_a_streak_counts_uniform_groups_in_a_row_and_a_signal_ends_it():
  assert next_streak(0, [1.0, 1.0, 1.0]) == 1
  assert next_streak(2, [1.0, 1.0]) == 3
  assert next_streak(0, [0.0, 0.0]) == -1
  assert next_streak(-1, [0.5, 0.5]) == -2  # all equal below 1: no signal, failed
  assert next_streak(3, [0.0, 0.0]) == -1  # a solved record failing starts over
  assert next_streak(-4, [1.0, 1.0]) == 1
  assert next_streak(-4, [1.0, 0.0]) == 0 and next_streak(5, [0.2, 0.3]) == 0
  assert next_streak(2, []) == 0


def test_the_chance_to_be_fed_falls_with_the_streak():
  assert feed_probability(0, 0.0, 0.0) == 1.0
  assert feed_probability(1, 0.5, 0.9) == 0.5 and feed_probability(3, 0.5, 0.9) == 0.125
  assert feed_probability(-2, 0.5, 0.9) == pytest.approx(0.81)
  assert feed_probability(1, 0.0, 1.0) == 0.0 and feed_probability(-7, 0.0, 1.0) == 1.0


def test_feeding_draws_depend_on_seed_and_position_only_and_match_the_probability():
  draws = [fed(-2, seed=7, position=i, revisit_solved=1.0, revisit_failed=0.5)
           for i in range(4000)]
  assert draws == [fed(-2, 7, i, 1.0, 0.5) for i in range(4000)]  # a resumed run agrees
  assert abs(np.mean(draws) - 0.25) < 0.03
  other = [fed(-2, 8, i, 1.0, 0.5) for i in range(4000)]
  assert other != draws
  assert all(fed(0, 7, i, 0.0, 0.0) for i in range(50))  # no streak: always fed
  assert not any(fed(1, 7, i, 0.0, 1.0) for i in range(50))  # retired


def test_revisit_settings_are_checked_naming_the_field():
  assert check_revisit("rl.revisit_failed", 0.5) == 0.5
  assert check_revisit("rl.revisit_solved", 0) == 0.0  # retired: never fed again
  assert check_revisit("rl.revisit_solved", 1) == 1.0
  for bad in (-0.1, 1.01, float("nan")):
    with pytest.raises(ValueError, match="rl.revisit_failed: expected a probability in"):
      check_revisit("rl.revisit_failed", bad)
