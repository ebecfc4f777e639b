"""Which prompts of a dataset to spend rollouts on, epoch after epoch (selective rollouts).

A group whose rewards are all equal has no advantage: its rollouts teach nothing. Such a
prompt tends to stay so from one epoch to the next (solved ones stay solved, hopeless ones
hopeless: GRESO, Zheng et al. 2025), so its record keeps a streak: +z after z groups in a
row all correct, -z after z all equal below 1 (failed). A record on a streak is fed again
with probability `revisit ** z` (revisit_solved or revisit_failed), so it is seen less and
less while it stays uniform and at once as before after one group with a signal (the streak
ends). revisit 1: always fed; 0: never again (retired). Numpy only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def next_streak(streak: int, rewards: Sequence[float]) -> int:
  """A record's streak after a group with `rewards`: +1 per all-correct group in a row, -1
  per all-equal failed one, 0 once a group carries a signal (rewards not all equal)."""
  r = np.asarray(rewards, np.float64)
  if r.size == 0 or np.ptp(r) > 0:
    return 0
  if r[0] >= 1.0:
    return max(streak, 0) + 1
  return min(streak, 0) - 1


def feed_probability(streak: int, revisit_solved: float, revisit_failed: float) -> float:
  """How likely a record on `streak` is fed when its turn comes."""
  if streak > 0:
    return float(revisit_solved) ** streak
  if streak < 0:
    return float(revisit_failed) ** -streak
  return 1.0


def fed(streak: int, seed: int, position: int, revisit_solved: float,
        revisit_failed: float) -> bool:
  """Whether the record at feed `position` is fed: a draw that depends only on (seed,
  position), so a resumed run decides as the first one did."""
  p = feed_probability(streak, revisit_solved, revisit_failed)
  if p >= 1.0:
    return True
  u = np.random.default_rng([seed & 0xFFFFFFFF, 0x5E1EC7, int(position)]).random()
  return bool(u < p)


def check_revisit(name: str, value: float) -> float:
  """A revisit probability from a config, or ValueError naming the field."""
  value = float(value)
  if not 0.0 <= value <= 1.0:
    raise ValueError(f"{name}: expected a probability in [0, 1], got {value}")
  return value
