"""Advantage estimators against hand-computed values, degenerate groups, padding, bad input."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from algorithms.advantages import (gdpo_advantages, gpg_advantages, grpo_advantages,
                                   masked_whiten, mc_grpo_advantages, opo_advantages,
                                   passk_advantages, reinforce_pp_baseline_advantages,
                                   rloo_advantages)

# Two groups of unequal size: group 0 = [1, 0, 1], group 1 = [0, 2].
REWARDS = np.array([1.0, 0.0, 1.0, 0.0, 2.0], np.float32)
GROUPS = np.array([0, 0, 0, 1, 1], np.int32)


def test_grpo_group_std_matches_hand_arithmetic():
  # group 0: mean 2/3, centred [1/3, -2/3, 1/3], unbiased var (1/9 + 4/9 + 1/9) / 2 = 1/3
  # group 1: mean 1, centred [-1, 1], unbiased var (1 + 1) / 1 = 2
  s0, s1 = math.sqrt(1 / 3), math.sqrt(2)
  expected = [1 / 3 / s0, -2 / 3 / s0, 1 / 3 / s0, -1 / s1, 1 / s1]
  got = grpo_advantages(REWARDS, GROUPS, 2, eps=0.0)
  np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_grpo_biased_std_uses_n_denominator():
  # group 0 biased var = (1/9 + 4/9 + 1/9) / 3 = 2/9, std = sqrt(2)/3; 1/3 / std = 1/sqrt(2)
  got = grpo_advantages(REWARDS, GROUPS, 2, eps=0.0, unbiased=False)
  np.testing.assert_allclose(got[:3], [1 / math.sqrt(2), -2 / math.sqrt(2), 1 / math.sqrt(2)],
                             rtol=1e-5)


def test_grpo_eps_is_added_to_std():
  # group 1: std sqrt(2); with eps = 1: -1 / (sqrt(2) + 1)
  got = grpo_advantages(REWARDS, GROUPS, 2, eps=1.0)
  np.testing.assert_allclose(got[3], -1 / (math.sqrt(2) + 1), rtol=1e-5)


def test_grpo_batch_std_scaling():
  # batch mean 4/5; squared deviations .04 .64 .04 .64 1.44 sum 2.8; unbiased var 2.8/4 = 0.7
  centred = [1 / 3, -2 / 3, 1 / 3, -1.0, 1.0]
  got = grpo_advantages(REWARDS, GROUPS, 2, std_scaling="batch", eps=0.0)
  np.testing.assert_allclose(got, np.array(centred) / math.sqrt(0.7), rtol=1e-5)


def test_dr_grpo_no_std_scaling_is_centred_reward():
  got = grpo_advantages(REWARDS, GROUPS, 2, std_scaling="none")
  np.testing.assert_allclose(got, [1 / 3, -2 / 3, 1 / 3, -1.0, 1.0], rtol=1e-5)


@pytest.mark.parametrize("scaling", ["group", "batch", "none"])
def test_grpo_degenerate_groups_are_zero_not_nan(scaling):
  # group 0 = one sample, group 1 = all equal, group 2 = empty; eps = 0 must not divide by 0
  rewards = np.array([3.0, 0.5, 0.5, 0.5], np.float32)
  groups = np.array([0, 1, 1, 1], np.int32)
  got = grpo_advantages(rewards, groups, 3, std_scaling=scaling, eps=0.0)
  np.testing.assert_array_equal(got, np.zeros(4, np.float32))


def test_grpo_padding_rows_change_nothing_and_get_zero():
  padded_r = np.concatenate([REWARDS, [100.0, -7.0]]).astype(np.float32)
  padded_g = np.concatenate([GROUPS, [0, 1]]).astype(np.int32)
  mask = np.array([True] * 5 + [False] * 2)
  got = grpo_advantages(padded_r, padded_g, 2, mask, eps=0.0)
  np.testing.assert_allclose(got[:5], grpo_advantages(REWARDS, GROUPS, 2, eps=0.0), rtol=1e-6)
  np.testing.assert_array_equal(got[5:], [0.0, 0.0])


def test_rloo_is_reward_minus_mean_of_the_others():
  # group 0: 1 - (0+1)/2 = 0.5, 0 - (1+1)/2 = -1, 0.5; group 1: 0 - 2 = -2, 2 - 0 = 2
  got = rloo_advantages(REWARDS, GROUPS, 2)
  np.testing.assert_allclose(got, [0.5, -1.0, 0.5, -2.0, 2.0], rtol=1e-5)


def test_rloo_single_sample_group_is_zero():
  got = rloo_advantages(np.array([5.0, 1.0, 3.0], np.float32), np.array([0, 1, 1]), 2)
  # group 1: 1 - 3 = -2, 3 - 1 = 2
  np.testing.assert_allclose(got, [0.0, -2.0, 2.0])


def test_mc_grpo_odd_group_excludes_the_median_pivot():
  # [3, 1, 2]: median 2 (index 2) -> advantages [1, -1, 0], pivot dropped from the loss
  adv, keep = mc_grpo_advantages(np.array([3.0, 1.0, 2.0], np.float32), np.zeros(3, np.int32),
                                 1, std_scaling="none")
  np.testing.assert_allclose(adv, [1.0, -1.0, 0.0])
  np.testing.assert_array_equal(keep, [True, True, False])


def test_mc_grpo_even_group_uses_midpoint_and_keeps_all():
  # [1, 4, 2, 3]: median (2 + 3) / 2 = 2.5 -> [-1.5, 1.5, -0.5, 0.5], nobody dropped
  adv, keep = mc_grpo_advantages(np.array([1.0, 4.0, 2.0, 3.0], np.float32),
                                 np.zeros(4, np.int32), 1, std_scaling="none")
  np.testing.assert_allclose(adv, [-1.5, 1.5, -0.5, 0.5])
  np.testing.assert_array_equal(keep, [True] * 4)


def test_mc_grpo_group_std_scaling_and_ties_drop_exactly_one_pivot():
  # group 0 = [3, 1, 2]: std 1 (mean 2, deviations 1, -1, 0; var 2/2); group 1 = [1, 1, 1]
  rewards = np.array([3.0, 1.0, 2.0, 1.0, 1.0, 1.0], np.float32)
  groups = np.array([0, 0, 0, 1, 1, 1], np.int32)
  adv, keep = mc_grpo_advantages(rewards, groups, 2, eps=0.0)
  np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0, 0.0, 0.0], atol=1e-6)
  # ties broken by position: the middle of the sorted positions [3, 4, 5] is 4
  np.testing.assert_array_equal(keep, [True, True, False, True, False, True])


def test_mc_grpo_padding_is_neither_sample_nor_pivot():
  rewards = np.array([3.0, 9.0, 1.0, 2.0], np.float32)
  adv, keep = mc_grpo_advantages(rewards, np.zeros(4, np.int32), 1,
                                 np.array([True, False, True, True]), std_scaling="none")
  np.testing.assert_allclose(adv, [1.0, 0.0, -1.0, 0.0])
  np.testing.assert_array_equal(keep, [True, False, True, False])


def test_bad_inputs_name_the_field():
  with pytest.raises(ValueError, match="group_ids: expected shape"):
    grpo_advantages(REWARDS, GROUPS[:3], 2)
  with pytest.raises(ValueError, match="group_ids: expected an integer dtype"):
    grpo_advantages(REWARDS, GROUPS.astype(np.float32), 2)
  with pytest.raises(ValueError, match="std_scaling: expected one of"):
    grpo_advantages(REWARDS, GROUPS, 2, std_scaling="median")
  with pytest.raises(ValueError, match="rewards: expected shape \\[B\\]"):
    rloo_advantages(jnp.ones((2, 2)), jnp.zeros((2, 2), jnp.int32), 1)


def _ids_of_sizes(sizes, total):
  """Group ids for consecutive groups of the given sizes, padded to `total` rows."""
  n = int(np.sum(sizes))
  ids = np.zeros(total, np.int32)
  ids[:n] = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
  return ids, np.arange(total) < n


def test_random_unequal_groups_match_a_per_group_numpy_loop():
  # one padded shape for every draw (one compile); reference: plain numpy per group
  rng = np.random.default_rng(0)
  for _ in range(5):
    sizes = rng.integers(0, 7, size=6)
    ids, mask = _ids_of_sizes(sizes, total=40)
    rewards = np.where(mask, rng.integers(0, 4, size=40) / 2, 0.0).astype(np.float32)
    grpo = np.asarray(grpo_advantages(rewards, ids, 6, mask, eps=0.0))
    rloo = np.asarray(rloo_advantages(rewards, ids, 6, mask))
    mc, keep = mc_grpo_advantages(rewards, ids, 6, mask, std_scaling="none")
    start = 0
    for n in sizes:
      r, sl = rewards[start:start + n].astype(np.float64), slice(start, start + n)
      start += n
      if n == 0:
        continue
      std = r.std(ddof=1) if n > 1 else 0.0
      want = (r - r.mean()) / std if std > 0 else np.zeros(n)
      np.testing.assert_allclose(grpo[sl], want, rtol=1e-5, atol=1e-6)
      want = n / (n - 1) * (r - r.mean()) if n > 1 else np.zeros(n)
      np.testing.assert_allclose(rloo[sl], want, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(np.asarray(mc)[sl], r - np.median(r), atol=1e-6)
      assert int(np.sum(~np.asarray(keep)[sl])) == n % 2
    np.testing.assert_array_equal(grpo[~mask], 0.0)


# Equal rewards whose float32 group mean (sum / n) is not exact: each leaves a residual.
UNIFORM_CASES = [(1.1, 16), (0.9, 8), (1.95, 16), (5.7, 3), (123.4, 8)]


@pytest.mark.parametrize("value,size", UNIFORM_CASES)
def test_groups_of_equal_rewards_get_exactly_zero_advantage(value, size):
  # two groups of equal rewards (value, 3 value + 0.1): every estimator that promises 0 for
  # them gives exactly 0, not the mean's rounding residual over a std of its own size
  rewards = np.repeat(np.array([value, 3 * value + 0.1], np.float32), size)
  ids = np.repeat(np.arange(2, dtype=np.int32), size)
  got = {f"grpo {s}": grpo_advantages(rewards, ids, 2, std_scaling=s)
         for s in ("group", "batch", "none")}
  got.update({f"gpg {s}": gpg_advantages(rewards, ids, 2, std_scaling=s)
              for s in ("group", "none")})
  got["rloo"] = rloo_advantages(rewards, ids, 2)
  got["mc_grpo"] = mc_grpo_advantages(rewards, ids, 2)[0]
  got["opo"] = opo_advantages(rewards, np.arange(2 * size) + 1.0, ids, 2)
  got["passk"] = passk_advantages(rewards, ids, 2)
  parts = np.stack([rewards, 2 * rewards + 0.3], axis=1)
  got["gdpo"] = gdpo_advantages(parts, np.array([1.0, 0.5], np.float32), ids, 2)
  tokens = np.ones((2 * size, 3), np.float32)
  got["reinforce++ baseline"] = reinforce_pp_baseline_advantages(rewards, ids, 2, tokens)
  got["whiten"] = masked_whiten(jnp.full((size, 3), value, jnp.float32), tokens[:size])
  for name, adv in got.items():
    assert np.all(np.asarray(adv) == 0.0), f"{name}: {np.asarray(adv).reshape(-1)[:3]}"
