"""DAPO soft overlong punishment against hand-computed values."""

import numpy as np
import pytest

from algorithms.shaping import soft_overlong_punishment


def test_soft_overlong_punishment_ramp():
  # max 20, cache 4: free up to 16 tokens, then (16 - L) / 4 down to -1 at 20, -1 beyond
  got = soft_overlong_punishment(np.array([10, 16, 17, 18, 20, 21]), 20, 4)
  np.testing.assert_allclose(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])


def test_soft_overlong_punishment_rejects_bad_lengths_config():
  with pytest.raises(ValueError, match="cache_length: expected an int in \\[1, max_length=8\\]"):
    soft_overlong_punishment(np.array([1]), 8, 9)
  with pytest.raises(ValueError, match="max_length: expected an int >= 1"):
    soft_overlong_punishment(np.array([1]), 0, 1)
