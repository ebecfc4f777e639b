"""String reversal: "rev abcd=" -> "dcba"."""

from __future__ import annotations

import string

import numpy as np

from rlax_ps.tasks.base import ANSWER_DELIMITER, Example, Task

PREFIX = "rev "


class Reversal(Task):
  """Reverse a random string of `alphabet` whose length is uniform in [min_len, max_len]."""

  name = "reversal"

  def __init__(self, min_len: int = 1, max_len: int = 8,
               alphabet: str = string.ascii_lowercase, heldout_fraction: float = 0.1):
    super().__init__(heldout_fraction)
    if not isinstance(min_len, int) or min_len < 1:
      raise ValueError(f"reversal.min_len: expected an int >= 1, got {min_len!r}")
    if not isinstance(max_len, int) or max_len < min_len:
      raise ValueError(f"reversal.max_len: expected an int >= min_len={min_len}, got "
                       f"{max_len!r}")
    bad = sorted(c for c in set(alphabet) if c == ANSWER_DELIMITER or c.isspace())
    if not alphabet or bad:  # (spaces: a checker strips an answer's outer ones)
      raise ValueError(f"reversal.alphabet: expected non-empty characters without "
                       f"{ANSWER_DELIMITER!r} or whitespace, got {alphabet!r}")
    self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet

  def sample(self, rng: np.random.Generator) -> Example:
    n = int(rng.integers(self.min_len, self.max_len + 1))
    s = "".join(self.alphabet[i] for i in rng.integers(0, len(self.alphabet), size=n))
    return Example(prompt=f"{PREFIX}{s}{ANSWER_DELIMITER}", answer=s[::-1], task=self.name)

  @property
  def max_prompt_chars(self) -> int:
    return len(PREFIX) + self.max_len + 1

  @property
  def max_answer_chars(self) -> int:
    return self.max_len
