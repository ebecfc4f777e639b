"""Importance corrections (TIS, MIS, decoupled PPO, M2PO) against hand-computed values."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from algorithms.corrections import (decoupled_ppo_loss, m2po_loss, m2po_mask,
                                    masked_importance_weights, truncated_importance_weights)
from algorithms.losses import ppo_clip_loss

# One sequence of three real tokens and a pad; pi_prox / pi_behav = 3, 0.5, 1.2 (pad: 9).
BEHAV = jnp.zeros((1, 4))
PROX = jnp.log(jnp.array([[3.0, 0.5, 1.2, 9.0]]))
MASK = jnp.array([[1, 1, 1, 0]])


def test_tis_token_level_truncates_each_ratio():
  w = truncated_importance_weights(PROX, BEHAV, MASK, level="token", cap=2.0)
  np.testing.assert_allclose(w, [[2.0, 0.5, 1.2, 0.0]], rtol=1e-6)


def test_tis_sequence_and_geometric_levels():
  # sequence ratio 3 * 0.5 * 1.2 = 1.8 (pad excluded); capped at 1.5
  w = truncated_importance_weights(PROX, BEHAV, MASK, level="sequence", cap=1.5)
  np.testing.assert_allclose(w, [[1.5, 1.5, 1.5, 0.0]], rtol=1e-6)
  w = truncated_importance_weights(PROX, BEHAV, MASK, level="sequence", cap=5.0)
  np.testing.assert_allclose(w, [[1.8, 1.8, 1.8, 0.0]], rtol=1e-6)
  # geometric mean 1.8 ** (1/3)
  w = truncated_importance_weights(PROX, BEHAV, MASK, level="geometric", cap=5.0)
  np.testing.assert_allclose(w[0, :3], [1.8 ** (1 / 3)] * 3, rtol=1e-6)


def test_mis_drops_tokens_outside_the_range():
  # range [0.6, 2]: 3 and 0.5 leave it, 1.2 stays with its ratio
  w, keep = masked_importance_weights(PROX, BEHAV, MASK, level="token", low=0.6, high=2.0)
  np.testing.assert_allclose(w, [[0.0, 0.0, 1.2, 0.0]], rtol=1e-6)
  np.testing.assert_array_equal(keep, [[0, 0, 1, 0]])


def test_mis_sequence_level_keeps_or_drops_whole_sequences():
  prox = jnp.concatenate([PROX, jnp.log(jnp.array([[3.0, 3.0, 1.0, 1.0]]))])
  mask = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])
  # sequence 0: 1.8 in [0.5, 2] kept; sequence 1: 9 > 2 dropped
  w, keep = masked_importance_weights(prox, jnp.zeros((2, 4)), mask, level="sequence",
                                      low=0.5, high=2.0)
  np.testing.assert_allclose(w, [[1.8, 1.8, 1.8, 0.0], [0.0] * 4], rtol=1e-6)
  np.testing.assert_array_equal(keep, [[1, 1, 1, 0], [0, 0, 0, 0]])


def test_decoupled_ppo_weights_tokens_by_capped_behaviour_ratio():
  # logp = prox: PPO ratio 1, loss per token -A * w; w = min(pi_prox/pi_behav, cap = 2)
  # token-mean over 3 real tokens: -(1 * 2 + 2 * 0.5 + (-1) * 1.2) / 3
  adv = jnp.array([[1.0, 2.0, -1.0, 5.0]])
  loss, m = decoupled_ppo_loss(PROX, PROX, BEHAV, adv, MASK, behaviour_cap=2.0)
  assert float(loss) == pytest.approx(-(2.0 + 1.0 - 1.2) / 3, rel=1e-5)
  assert float(m["behaviour_capped_frac"]) == pytest.approx(1 / 3)
  assert float(m["behaviour_weight_mean"]) == pytest.approx((2.0 + 0.5 + 1.2) / 3, rel=1e-5)
  # cap_mode "mask" drops the token over the cap instead: -(0 + 1.0 - 1.2) / 3
  loss, _ = decoupled_ppo_loss(PROX, PROX, BEHAV, adv, MASK, behaviour_cap=2.0,
                               cap_mode="mask")
  assert float(loss) == pytest.approx(-(1.0 - 1.2) / 3, rel=1e-5)


def test_decoupled_ppo_clips_against_the_proximal_policy():
  # logp / prox = 1.5 on every token, A = +1, clip_high = 0.2: each token -1.2 * w
  logp = PROX + math.log(1.5)
  adv = jnp.ones((1, 4))
  loss, _ = decoupled_ppo_loss(logp, PROX, BEHAV, adv, MASK, behaviour_cap=None)
  assert float(loss) == pytest.approx(-1.2 * (3.0 + 0.5 + 1.2) / 3, rel=1e-5)
  ref, _ = ppo_clip_loss(logp, PROX, adv, MASK, token_weights=jnp.array([[3.0, 0.5, 1.2, 0]]))
  assert float(loss) == pytest.approx(float(ref), rel=1e-6)


def test_m2po_masks_largest_second_moments_until_under_threshold():
  # log ratios 0.5, 0.1, -0.1, 0: squares .25 .01 .01 0, mean .0675 > .04;
  # without .25: .02 / 3 = .0067 <= .04 -> only the first token is masked
  prox = jnp.array([[0.5, 0.1, -0.1, 0.0]])
  keep = m2po_mask(prox, jnp.zeros((1, 4)), jnp.ones((1, 4)), threshold=0.04)
  np.testing.assert_array_equal(keep, [[0, 1, 1, 1]])
  # threshold .1: .0675 already fits, nothing masked
  keep = m2po_mask(prox, jnp.zeros((1, 4)), jnp.ones((1, 4)), threshold=0.1)
  np.testing.assert_array_equal(keep, [[1, 1, 1, 1]])
  # threshold 0: everything with a non-zero second moment goes
  keep = m2po_mask(prox, jnp.zeros((1, 4)), jnp.ones((1, 4)), threshold=0.0)
  np.testing.assert_array_equal(keep, [[0, 0, 0, 1]])


def test_m2po_mask_is_batch_wide_and_ignores_padding():
  # tokens .3 (seq 0), .05 (seq 1), pad 5.0: squares .09 .0025 mean .04625 > .04 -> drop .3
  prox = jnp.array([[0.3, 5.0], [0.05, 0.0]])
  mask = jnp.array([[1, 0], [1, 0]])
  keep = m2po_mask(prox, jnp.zeros((2, 2)), mask, threshold=0.04)
  np.testing.assert_array_equal(keep, [[0, 0], [1, 0]])


def test_m2po_loss_is_unclipped_ratio_times_advantage_on_kept_tokens():
  prox = jnp.array([[0.5, 0.1, -0.1, 0.0]])
  logp = prox + jnp.log(jnp.array([[2.0, 3.0, 1.5, 0.5]]))  # ratios to prox, no clipping
  adv = jnp.array([1.0])
  loss, m = m2po_loss(logp, prox, jnp.zeros((1, 4)), adv, jnp.ones((1, 4)), threshold=0.04)
  # token 0 masked; token-mean over all 4 tokens: -(3 + 1.5 + 0.5) / 4
  assert float(loss) == pytest.approx(-5.0 / 4, rel=1e-5)
  assert float(m["m2po_masked_frac"]) == pytest.approx(0.25)
  assert float(m["m2"]) == pytest.approx(0.0675, rel=1e-5)


def test_corrections_reject_bad_input():
  with pytest.raises(ValueError, match="behaviour_logp: expected shape \\(1, 4\\)"):
    truncated_importance_weights(PROX, jnp.zeros((1, 3)), MASK)
  with pytest.raises(ValueError, match="level: expected one of"):
    truncated_importance_weights(PROX, BEHAV, MASK, level="batch")
  with pytest.raises(ValueError, match="cap: expected > 0"):
    truncated_importance_weights(PROX, BEHAV, MASK, cap=0.0)
  with pytest.raises(ValueError, match="low/high: expected 0 <= low < high"):
    masked_importance_weights(PROX, BEHAV, MASK, low=2.0, high=1.0)
  with pytest.raises(ValueError, match="cap_mode: expected"):
    decoupled_ppo_loss(PROX, PROX, BEHAV, jnp.ones(1), MASK, cap_mode="clip")
