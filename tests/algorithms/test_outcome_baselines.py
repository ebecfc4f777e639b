"""OPO's length-weighted baseline, pass@k's best-of-group advantage and GPG's batch-scaled
one against verl's per-group loops or the paper (ported to numpy here), hand values,
padding and bad input."""

import math

import numpy as np
import pytest

from algorithms.advantages import (discounted_returns, distillation_advantages, gae,
                                   gpg_advantages, opo_advantages, passk_advantages,
                                   token_rewards)


def _verl_opo(rewards, lengths, ids):
  """verl core_algos.compute_opo_outcome_advantage, one group at a time (a group of one
  keeps 0 here: ours gives degenerate groups 0)."""
  out = np.zeros(len(rewards))
  for g in set(ids.tolist()):
    at = np.flatnonzero(ids == g)
    if len(at) > 1:
      out[at] = rewards[at] - np.sum(lengths[at] * rewards[at]) / np.sum(lengths[at])
  return out


def _verl_passk(rewards, ids, norm, eps):
  """verl core_algos.compute_grpo_passk_outcome_advantage (groups of one give 0, not a raise)."""
  out = np.zeros(len(rewards))
  for g in set(ids.tolist()):
    at = np.flatnonzero(ids == g)
    if len(at) < 2:
      continue
    r = rewards[at]
    order = np.argsort(-r, kind="stable")
    adv = r[order[0]] - r[order[1]]
    if norm:
      adv = adv / (np.std(r, ddof=1) + eps)
    out[at[order[0]]] = adv
  return out


def test_opo_subtracts_the_length_weighted_mean():
  # group 0: rewards [1, 0, 1], lengths [2, 6, 4]: baseline (2 + 4) / 12 = 0.5
  rewards = np.array([1.0, 0.0, 1.0, 3.0], np.float32)
  lengths = np.array([2, 6, 4, 9])
  got = opo_advantages(rewards, lengths, np.array([0, 0, 0, 1]), 2)
  np.testing.assert_allclose(got, [0.5, -0.5, 0.5, 0.0], rtol=1e-6)  # a group of one: 0
  # equal lengths: the plain mean (GRPO without the std)
  got = opo_advantages(rewards[:3], np.full(3, 5), np.zeros(3, np.int32), 1)
  np.testing.assert_allclose(got, np.array([1, 0, 1]) - 2 / 3, rtol=1e-6)


def test_pass_at_k_moves_only_each_groups_best_sample():
  rewards = np.array([0.2, 1.0, 0.5, 1.0, 1.0, 0.0], np.float32)
  ids = np.array([0, 0, 0, 1, 1, 1], np.int32)
  got = np.asarray(passk_advantages(rewards, ids, 2, std_scaling="none"))
  np.testing.assert_allclose(got, [0, 0.5, 0, 0, 0, 0], atol=1e-7)  # group 1's best is tied
  std = np.std([0.2, 1.0, 0.5], ddof=1)
  got = np.asarray(passk_advantages(rewards, ids, 2, eps=0.0))
  np.testing.assert_allclose(got, [0, 0.5 / std, 0, 0, 0, 0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("norm", [True, False])
def test_random_unequal_padded_groups_match_verls_loops(norm):
  rng = np.random.default_rng(0)
  sizes = [1, 3, 4, 2, 5]
  ids = np.repeat(np.arange(5), sizes).astype(np.int32)
  n = len(ids)
  ids = np.concatenate([ids, np.zeros(3, np.int32)])  # 3 padding rows
  mask = np.arange(n + 3) < n
  rewards = rng.integers(0, 4, n + 3).astype(np.float32) / 3
  lengths = rng.integers(1, 30, n + 3)
  opo = np.asarray(opo_advantages(rewards, lengths, ids, 5, mask))
  np.testing.assert_allclose(opo[:n], _verl_opo(rewards[:n], lengths[:n], ids[:n]),
                             rtol=1e-5, atol=1e-6)
  scaling = "group" if norm else "none"
  passk = np.asarray(passk_advantages(rewards, ids, 5, mask, std_scaling=scaling, eps=1e-6))
  np.testing.assert_allclose(passk[:n], _verl_passk(rewards[:n], ids[:n], norm, 1e-6),
                             rtol=1e-5, atol=1e-6)
  assert not opo[n:].any() and not passk[n:].any()


def test_gpg_scales_the_batch_by_its_share_of_groups_that_learn():
  # 3 groups, 8 samples: group 1's rewards are all equal and group 2 has one sample, so
  # M = 3 + 1 of B = 8 learn nothing; the others' r - mean is scaled by 8 / 4 = 2.
  rewards = np.array([1, 0, 0, 1, 0.5, 0.5, 0.5, 7], np.float32)
  ids = np.array([0, 0, 0, 0, 1, 1, 1, 2], np.int32)
  got = np.asarray(gpg_advantages(rewards, ids, 3))
  np.testing.assert_allclose(got, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-6)
  # F_norm = the group's std (GPG with std): GRPO's advantage times the same alpha.
  std = np.std([1, 0, 0, 1], ddof=1)
  got = np.asarray(gpg_advantages(rewards, ids, 3, std_scaling="group", eps=0.0))
  np.testing.assert_allclose(got, np.array([1, -1, -1, 1, 0, 0, 0, 0]) / std, rtol=1e-5)
  # Every group learning: alpha 1, Dr. GRPO's advantage; padding counts in neither B nor M.
  mask = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)
  rewards = np.array([1, 0, 0, 1, 0, 3, 9, 9], np.float32)
  got = np.asarray(gpg_advantages(rewards, np.array([0, 0, 0, 0, 1, 1, 1, 1]), 2, mask))
  np.testing.assert_allclose(got, [0.5, -0.5, -0.5, 0.5, -1.5, 1.5, 0, 0], atol=1e-6)
  # No group learning: all 0, never NaN.
  got = np.asarray(gpg_advantages(np.ones(4, np.float32), np.array([0, 0, 1, 1]), 2))
  assert np.all(got == 0)
  # One group in 64 learning: alpha is capped at 20, as the GPG authors' trainer caps it (64
  # would scale a plain policy gradient, no ratio or clip bounding it, 64 times).
  rewards = np.zeros(64 * 2, np.float32)
  rewards[0] = 1.0
  got = np.asarray(gpg_advantages(rewards, np.repeat(np.arange(64), 2), 64))
  np.testing.assert_allclose(got[:2], [20 * 0.5, -20 * 0.5], rtol=1e-6)
  assert np.all(got[2:] == 0)


def test_distillation_gives_each_token_minus_its_reverse_kl_to_the_teacher():
  student = np.array([[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.0]], np.float32)
  teacher = np.array([[-1.5, -1.0, -0.5], [-2.0, -9.0, -1.0]], np.float32)
  mask = np.array([[1, 1, 1], [1, 0, 0]], np.float32)
  got = np.asarray(distillation_advantages(student, teacher, mask))
  np.testing.assert_allclose(got, [[-0.5, 1.0, 0.0], [1.0, 0.0, 0.0]])
  with pytest.raises(ValueError, match="teacher_logp: expected the student's shape"):
    distillation_advantages(student, teacher[:, :2], mask)


def test_bad_input_names_the_argument():
  with pytest.raises(ValueError, match="lengths: expected shape \\(3,\\)"):
    opo_advantages(np.ones(3), np.ones(2), np.zeros(3, np.int32), 1)
  with pytest.raises(ValueError, match="std_scaling: expected one of"):
    passk_advantages(np.ones(3), np.zeros(3, np.int32), 1, std_scaling="max")
  with pytest.raises(ValueError, match="std_scaling: expected one of"):
    gpg_advantages(np.ones(3), np.zeros(3, np.int32), 1, std_scaling="max")
  assert math.isfinite(float(passk_advantages(np.ones(2), np.zeros(2, np.int32), 1)[0]))


def test_a_samples_score_lands_on_its_last_policy_token_where_a_reply_ends_it():
  """A multi-turn sample the budget ended within an environment's reply (its last two
  tokens observed): its score is the reward of its policy's last token, so REINFORCE++'s
  returns and GAE's advantages carry it (on the reply's token, masked, it was lost)."""
  mask = np.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], np.float32)
  rewards = np.asarray(token_rewards(np.asarray([-1.0, 2.0, 5.0]), mask))
  np.testing.assert_array_equal(rewards, [[0, 0, 0, -1, 0, 0], [0, 0, 2, 0, 0, 0], [0] * 6])
  returns = np.asarray(discounted_returns(rewards, mask, gamma=1.0))
  np.testing.assert_array_equal(returns[0], [-1, -1, -1, -1, 0, 0])
  adv, _ = gae(rewards, np.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
  np.testing.assert_array_equal(np.asarray(adv)[0, :4], [-1, -1, -1, -1])
