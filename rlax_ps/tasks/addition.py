"""Multi-digit addition: "123+45=" -> "168"."""

from __future__ import annotations

import numpy as np

from rlax_ps.tasks.base import ANSWER_DELIMITER, Example, Task


class Addition(Task):
  """a+b with each operand's digit count drawn uniformly from [min_digits, max_digits]."""

  name = "addition"

  def __init__(self, min_digits: int = 1, max_digits: int = 3, heldout_fraction: float = 0.1):
    super().__init__(heldout_fraction)
    if not isinstance(min_digits, int) or min_digits < 1:
      raise ValueError(f"addition.min_digits: expected an int >= 1, got {min_digits!r}")
    if not isinstance(max_digits, int) or max_digits < min_digits or max_digits > 18:
      raise ValueError(f"addition.max_digits: expected an int in [min_digits={min_digits}, 18], "
                       f"got {max_digits!r}")
    self.min_digits, self.max_digits = min_digits, max_digits

  def _operand(self, rng: np.random.Generator) -> int:
    d = int(rng.integers(self.min_digits, self.max_digits + 1))
    low = 0 if d == 1 else 10 ** (d - 1)
    return int(rng.integers(low, 10**d))

  def sample(self, rng: np.random.Generator) -> Example:
    a, b = self._operand(rng), self._operand(rng)
    return Example(prompt=f"{a}+{b}{ANSWER_DELIMITER}", answer=str(a + b), task=self.name)

  @property
  def max_prompt_chars(self) -> int:
    return 2 * self.max_digits + 2

  @property
  def max_answer_chars(self) -> int:
    return self.max_digits + 1
