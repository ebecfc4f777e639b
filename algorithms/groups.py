"""Per-group statistics over a flat batch of samples tagged with group ids.

Layout used by every group-relative function in `algorithms`: rewards are a flat
`[B]` array, `group_ids` a `[B]` int array with values in `[0, num_groups)`
(`num_groups` a static Python int), and an optional `[B]` bool `sample_mask` that
marks padding rows (they take part in nothing and get 0). Groups may have any size,
including 0 or 1, so VIGOR's unequal groups and padded batches jit to one shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_group_inputs(rewards, group_ids, num_groups: int, sample_mask=None):
  """Validate shapes and return (rewards float, group_ids int32, mask float)."""
  rewards = jnp.asarray(rewards)
  group_ids = jnp.asarray(group_ids)
  if rewards.ndim != 1:
    raise ValueError(f"rewards: expected shape [B], got {rewards.shape}")
  if group_ids.shape != rewards.shape:
    raise ValueError(f"group_ids: expected shape {rewards.shape} like rewards, got "
                     f"{group_ids.shape}")
  if not jnp.issubdtype(group_ids.dtype, jnp.integer):
    raise ValueError(f"group_ids: expected an integer dtype, got {group_ids.dtype}")
  if not isinstance(num_groups, int) or num_groups < 1:
    raise ValueError(f"num_groups: expected a static int >= 1, got {num_groups!r}")
  if not jnp.issubdtype(rewards.dtype, jnp.floating):
    rewards = rewards.astype(jnp.float32)
  if sample_mask is None:
    mask = jnp.ones(rewards.shape, rewards.dtype)
  else:
    sample_mask = jnp.asarray(sample_mask)
    if sample_mask.shape != rewards.shape:
      raise ValueError(f"sample_mask: expected shape {rewards.shape} like rewards, got "
                       f"{sample_mask.shape}")
    mask = sample_mask.astype(rewards.dtype)
  return rewards, group_ids.astype(jnp.int32), mask


def segment_sum(x, group_ids, num_groups: int):
  """Sum of `x` per group; ids outside [0, num_groups) are dropped."""
  return jax.ops.segment_sum(x, group_ids, num_segments=num_groups)


def group_mean_std(rewards, group_ids, num_groups: int, mask, unbiased: bool = True):
  """(count [G], mean [G], std [G]) of the masked rewards of each group.

  Empty groups have mean 0; a group of one sample has std 0 (the unbiased estimate is
  undefined there, and 0 makes its advantage 0 below rather than NaN). A group whose
  rewards are all equal gets that value as its exact mean, so r - mean and std are exactly
  0 there: sum / n rounds, and its residual over a std of the same size is of order 1.
  """
  count = segment_sum(mask, group_ids, num_groups)
  mean = segment_sum(rewards * mask, group_ids, num_groups) / jnp.maximum(count, 1.0)
  held = mask > 0
  lo = jax.ops.segment_min(jnp.where(held, rewards, jnp.inf), group_ids, num_groups)
  hi = jax.ops.segment_max(jnp.where(held, rewards, -jnp.inf), group_ids, num_groups)
  mean = jnp.where(lo == hi, lo, mean)
  centred = (rewards - mean[group_ids]) * mask
  denom = count - 1.0 if unbiased else count
  var = segment_sum(centred * centred, group_ids, num_groups) / jnp.maximum(denom, 1.0)
  var = jnp.where(count > 1, var, 0.0)
  return count, mean, jnp.sqrt(var)


def ranks_within_group(values, group_ids, num_groups: int, mask):
  """Rank (0-based, ascending, ties by position) of each sample within its group.

  Masked samples get rank -1.
  """
  n = values.shape[0]
  valid = mask > 0
  sort_ids = jnp.where(valid, group_ids, num_groups)
  order = jnp.lexsort((values, sort_ids))  # by group, then value; stable in position
  count = segment_sum(valid.astype(jnp.int32), group_ids, num_groups)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(count)[:-1]])
  sorted_ids = sort_ids[order]
  in_group = sorted_ids < num_groups
  rank_sorted = jnp.arange(n, dtype=jnp.int32) - starts[jnp.minimum(sorted_ids, num_groups - 1)]
  rank_sorted = jnp.where(in_group, rank_sorted, -1)
  return jnp.zeros((n,), jnp.int32).at[order].set(rank_sorted)
