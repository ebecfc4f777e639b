"""Reward shaping terms added to a verifier's reward."""

from __future__ import annotations

import jax.numpy as jnp


def soft_overlong_punishment(lengths, max_length: int, cache_length: int):
  """DAPO's soft overlong punishment for responses of `lengths` tokens, in [-1, 0].

  0 up to max_length - cache_length tokens, then a linear ramp down to -1 at
  max_length, and -1 beyond it (a truncated response). Add it to the task reward.
  """
  if not isinstance(max_length, int) or max_length < 1:
    raise ValueError(f"max_length: expected an int >= 1, got {max_length!r}")
  if not isinstance(cache_length, int) or not 0 < cache_length <= max_length:
    raise ValueError(f"cache_length: expected an int in [1, max_length={max_length}], got "
                     f"{cache_length!r}")
  lengths = jnp.asarray(lengths, jnp.float32)
  start = max_length - cache_length
  ramp = (start - lengths) / cache_length
  return jnp.where(lengths <= start, 0.0, jnp.where(lengths <= max_length, ramp, -1.0))
