"""Policy losses against hand-computed values; gradients against finite differences."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from algorithms.corrections import decoupled_ppo_loss, m2po_loss
from algorithms.losses import aggregate, cispo_loss, gspo_loss, kl_penalty, ppo_clip_loss
from algorithms.losses import entropy_threshold, high_entropy_tokens
from algorithms.losses import ppo_clip_loss


def test_aggregation_modes():
  per_token = jnp.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0]])
  # token-mean: (1 + 2 + 3 + 4) / 4 real tokens
  assert float(aggregate(per_token, mask, "token-mean")) == pytest.approx(2.5)
  # seq-mean-token-mean: ((1 + 2 + 3) / 3 + 4 / 1) / 2 sequences
  assert float(aggregate(per_token, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
  # seq-mean-token-sum: (6 + 4) / 2
  assert float(aggregate(per_token, mask, "seq-mean-token-sum")) == pytest.approx(5.0)
  # seq-mean-token-sum-norm: 10 / (B=2 * norm 4), default norm T=3: 10 / 6
  assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", 4.0)) == pytest.approx(1.25)
  assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / 6)


def test_aggregation_ignores_empty_sequences_and_rejects_unknown_mode():
  per_token = jnp.array([[1.0, 3.0], [5.0, 5.0]])
  mask = jnp.array([[1, 1], [0, 0]])
  # only sequence 0 has tokens: its token mean 2
  assert float(aggregate(per_token, mask, "seq-mean-token-mean")) == pytest.approx(2.0)
  assert float(aggregate(per_token, jnp.zeros((2, 2)), "token-mean")) == 0.0
  # Dr. GRPO's constant normaliser (TRL's dr_grpo): every row, empty (padding) ones too
  assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", 4.0)) == 4.0 / (2 * 4.0)
  with pytest.raises(ValueError, match="aggregation mode: expected one of"):
    aggregate(per_token, mask, "sum")


def test_high_entropy_tokens_keep_those_at_the_threshold_so_quantile_1_keeps_every_token():
  """TRL's top_entropy_quantile: tokens whose entropy reaches (>=) the quantile; 1.0 trains
  every real token, 0.5 of [1, 2, 3] the two reaching the median."""
  entropy = jnp.array([[1.0, 2.0, 3.0, 9.0]])
  mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
  every = high_entropy_tokens(entropy, mask, entropy_threshold(entropy, mask, 1.0))
  assert np.asarray(every).tolist() == [[1.0, 1.0, 1.0, 0.0]]
  half = high_entropy_tokens(entropy, mask, entropy_threshold(entropy, mask, 0.5))
  assert np.asarray(half).tolist() == [[0.0, 1.0, 1.0, 0.0]]

def test_ppo_clip_higher_hand_example():
  # ratios 1.5, 0.5, 1.1, 0.7 with advantages +1, -1, +1, +1; clip [1 - 0.2, 1 + 0.28]
  # token 0: -min(1.5, 1.28) = -1.28 (clipped high); token 1: max(0.5, 0.8) = 0.8 (low)
  # token 2: -1.1; token 3: max(-0.7, -0.8) = -0.7 (pessimistic side: not clipped)
  ratios = jnp.array([[1.5, 0.5, 1.1, 0.7]])
  logp, old = jnp.log(ratios), jnp.zeros((1, 4))
  adv = jnp.array([[1.0, -1.0, 1.0, 1.0]])
  loss, m = ppo_clip_loss(logp, old, adv, jnp.ones((1, 4)), clip_low=0.2, clip_high=0.28)
  assert float(loss) == pytest.approx((-1.28 + 0.8 - 1.1 - 0.7) / 4, rel=1e-5)
  assert float(m["clip_frac"]) == pytest.approx(0.5)
  assert float(m["clip_frac_high"]) == pytest.approx(0.25)
  assert float(m["clip_frac_low"]) == pytest.approx(0.25)
  assert float(m["ratio_max"]) == pytest.approx(1.5, rel=1e-5)
  assert float(m["ratio_min"]) == pytest.approx(0.5, rel=1e-5)
  assert float(m["ratio_mean"]) == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4, rel=1e-5)


def test_ppo_dual_clip_bounds_negative_advantage_loss():
  # ratio 5, A = -1: PPO loss max(5, 1.2) = 5; dual clip c = 3 caps it at -c * A = 3
  logp, old = jnp.log(jnp.array([[5.0]])), jnp.zeros((1, 1))
  loss, _ = ppo_clip_loss(logp, old, jnp.array([-1.0]), jnp.ones((1, 1)))
  assert float(loss) == pytest.approx(5.0, rel=1e-5)
  loss, m = ppo_clip_loss(logp, old, jnp.array([-1.0]), jnp.ones((1, 1)), dual_clip=3.0)
  assert float(loss) == pytest.approx(3.0, rel=1e-5)
  assert float(m["dual_clip_frac"]) == 1.0


def test_ppo_approx_kl_and_kl_penalty_added():
  # one token, ratio e^0.1: approx KL k3 = e^0.1 - 1 - 0.1
  logp, old = jnp.array([[0.1]]), jnp.zeros((1, 1))
  ref = jnp.array([[0.1 + math.log(2.0)]])  # log(pi_ref / pi) = log 2: k3 = 2 - 1 - log 2
  loss, m = ppo_clip_loss(logp, old, jnp.array([0.0]), jnp.ones((1, 1)), ref_logp=ref,
                          kl_coef=0.5)
  assert float(m["approx_kl"]) == pytest.approx(math.exp(0.1) - 1.1, rel=1e-4)
  assert float(m["kl_ref"]) == pytest.approx(1 - math.log(2), rel=1e-5)
  assert float(loss) == pytest.approx(0.5 * (1 - math.log(2)), rel=1e-5)


def test_kl_estimators_hand_values():
  # pi = 0.5, pi_ref = 0.25: log r = log(0.25/0.5) = -log 2
  logp, ref = jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25]))
  l2 = math.log(2)
  assert float(kl_penalty(logp, ref, "k1")[0]) == pytest.approx(l2, rel=1e-5)
  assert float(kl_penalty(logp, ref, "k2")[0]) == pytest.approx(0.5 * l2 * l2, rel=1e-5)
  assert float(kl_penalty(logp, ref, "k3")[0]) == pytest.approx(0.5 - 1 + l2, rel=1e-5)
  with pytest.raises(ValueError, match="kl estimator: expected one of"):
    kl_penalty(logp, ref, "k4")


def _verl_kl_penalty_forward(logprob, ref_logprob, kind):
  """verl's core_algos.kl_penalty_forward (no "+": no straight-through), in numpy."""
  if kind == "abs":
    return np.abs(logprob - ref_logprob)
  kl = np.clip(ref_logprob - logprob, -20, 20)  # low_var_kl
  return np.clip(np.exp(kl) - kl - 1, -10, 10)


def test_verl_low_var_kl_and_abs_equal_verls_formula_and_clamp_far_tokens():
  # log r = ref - logp: -log 2, 0.5, 3 (k3 = 16.1: clamped to 10), 25 and -30 (clamped to
  # +-20 first, then the value to 10).
  logp = jnp.array([[math.log(0.5), -1.0, -4.0, -26.0, 0.0]])
  ref = jnp.array([[math.log(0.25), -0.5, -1.0, -1.0, -30.0]])
  lp, rf = np.asarray(logp, np.float64), np.asarray(ref, np.float64)
  low_var = np.asarray(kl_penalty(logp, ref, "low_var_kl"))
  np.testing.assert_allclose(low_var, _verl_kl_penalty_forward(lp, rf, "low_var_kl"), rtol=1e-5)
  np.testing.assert_allclose(low_var[0, :2], [0.5 - 1 + math.log(2), math.exp(0.5) - 1.5],
                             rtol=1e-5)
  np.testing.assert_array_equal(low_var[0, 2:], [10.0, 10.0, 10.0])
  assert float(kl_penalty(logp, ref, "k3")[0, 2]) == pytest.approx(math.exp(3) - 4, rel=1e-5)
  np.testing.assert_allclose(kl_penalty(logp, ref, "abs"),
                             _verl_kl_penalty_forward(lp, rf, "abs"), rtol=1e-6)
  np.testing.assert_allclose(kl_penalty(logp, ref, "abs")[0, :3], [math.log(2), 0.5, 3.0],
                             rtol=1e-5)
  # A clamped token's term is a constant: no gradient pulls it back (as verl's torch.clamp).
  grad = np.asarray(jax.grad(lambda x: jnp.sum(kl_penalty(x, ref, "low_var_kl")))(logp))
  np.testing.assert_allclose(grad[0, :2], [1 - 0.5, 1 - math.exp(0.5)], rtol=1e-5)
  np.testing.assert_array_equal(grad[0, 2:], [0.0, 0.0, 0.0])


def test_kl_bias_correction_multiplies_each_tokens_kl_by_the_losss_ratio():
  """TRL's use_bias_correction_kl: per_token_kl * coef_1, coef_1 = exp(logp - old_logp) per
  token, or exp of the sequence's mean log ratio at importance_sampling_level="sequence"
  (GSPO); the term is then aggregated as the policy loss."""
  old, logp, ref = (np.asarray(x, np.float32) for x in _case())
  mask = _MASK.astype(np.float32)
  k3 = np.exp(ref - logp) - (ref - logp) - 1
  token_ratio = np.exp(logp - old)
  seq_ratio = np.exp(((logp - old) * mask).sum(-1, keepdims=True) / mask.sum(-1, keepdims=True))
  token_mean = lambda x: (x * mask).sum() / mask.sum()
  seq_mean = lambda x: np.mean((x * mask).sum(-1) / mask.sum(-1))
  kw = dict(ref_logp=ref, kl_coef=0.1, kl_bias_correction=True)
  for fn, agg, ratio, mean in [(ppo_clip_loss, "token-mean", token_ratio, token_mean),
                               (cispo_loss, "token-mean", token_ratio, token_mean),
                               (gspo_loss, "seq-mean-token-mean", seq_ratio, seq_mean)]:
    _, m = fn(logp, old, _ADV[:, 0], mask, agg=agg, **kw)
    assert float(m["kl_ref"]) == pytest.approx(mean(k3 * ratio), rel=1e-5), fn.__name__
    _, plain = fn(logp, old, _ADV[:, 0], mask, agg=agg, ref_logp=ref, kl_coef=0.1)
    assert float(plain["kl_ref"]) == pytest.approx(mean(k3), rel=1e-5), fn.__name__


def test_gspo_sequence_ratio_hand_example():
  # seq 0 log ratios [0.1, 0.3]: s = e^0.2 = 1.2214 > 1.1 -> clipped term -1.1 (A = +1)
  # seq 1 log ratio [-0.05]: s = e^-0.05 = 0.9512, inside [0.9, 1.1] -> -0.9512
  logp = jnp.array([[0.1, 0.3], [-0.05, 7.0]])
  mask = jnp.array([[1, 1], [1, 0]])
  loss, m = gspo_loss(logp, jnp.zeros((2, 2)), jnp.array([1.0, 1.0]), mask, clip_low=0.1,
                      clip_high=0.1)
  assert float(loss) == pytest.approx((-1.1 - math.exp(-0.05)) / 2, rel=1e-5)
  assert float(m["clip_frac_high"]) == pytest.approx(0.5)


def test_cispo_weights_every_tokens_log_prob_by_its_clipped_ratio_hand_example():
  # ratios 1.5, 0.5, 1.1 with advantages +1, -1, +1; weights clipped to [0.8, 1.28]:
  # 1.28 (capped high), 0.8 (capped low), 1.1; loss = mean(-w * A * logp).
  old = jnp.zeros((1, 3))
  logp = jnp.log(jnp.array([[1.5, 0.5, 1.1]]))
  adv = jnp.array([[1.0, -1.0, 1.0]])
  mask = jnp.ones((1, 3))
  loss, m = cispo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
  lp = np.log([1.5, 0.5, 1.1])
  want = -(1.28 * lp[0] - 0.8 * lp[1] + 1.1 * lp[2]) / 3
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert float(m["clip_frac"]) == pytest.approx(2 / 3)
  assert float(m["clip_frac_high"]) == pytest.approx(1 / 3)
  # Every token keeps a gradient, the capped ones too: d/dlogp = -w * A / 3 (PPO's clip
  # would give tokens 0 and 1 none).
  grad = jax.grad(lambda x: cispo_loss(x, old, adv, mask, clip_low=0.2, clip_high=0.28)[0])(
      logp)
  np.testing.assert_allclose(grad, [[-1.28 / 3, 0.8 / 3, -1.1 / 3]], rtol=1e-5)
  ppo_grad = jax.grad(lambda x: ppo_clip_loss(x, old, adv, mask, clip_low=0.2,
                                              clip_high=0.28)[0])(logp)
  assert float(ppo_grad[0, 0]) == 0.0 and float(ppo_grad[0, 1]) == 0.0


def test_losses_reject_bad_shapes_and_params():
  x = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="mask: expected shape \\(2, 3\\)"):
    ppo_clip_loss(x, x, jnp.zeros(2), jnp.ones((2, 2)))
  with pytest.raises(ValueError, match="advantages: expected shape"):
    ppo_clip_loss(x, x, jnp.zeros(3), jnp.ones((2, 3)))
  with pytest.raises(ValueError, match="dual_clip: expected a constant > 1"):
    ppo_clip_loss(x, x, jnp.zeros(2), jnp.ones((2, 3)), dual_clip=0.5)
  with pytest.raises(ValueError, match="advantages: GSPO expects one per sequence"):
    gspo_loss(x, x, jnp.zeros((2, 3)), jnp.ones((2, 3)))


# Gradient checks: float64, log-probs chosen away from every clip boundary (kinks).
_DELTA = np.array([[0.05, 0.4, -0.5, 1.5], [-0.1, 0.3, 0.02, -0.3]])
_ADV = np.array([[1.0, 1.0, -1.0, -1.0], [-0.5, 0.7, 1.2, 0.3]])
_MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float64)


def _fd_check(fn, x0, eps=1e-6):
  """jax.grad of fn at x0 against central differences, one element at a time (batched)."""
  grad = np.asarray(jax.jit(jax.grad(fn))(x0))
  steps = np.eye(x0.size).reshape((x0.size,) + x0.shape) * eps
  values = jax.jit(jax.vmap(fn))(np.concatenate([x0 + steps, x0 - steps]))
  fd = (np.asarray(values[:x0.size]) - np.asarray(values[x0.size:])).reshape(x0.shape) / (2 * eps)
  np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-8)
  return grad


def _case():
  old = np.log(np.array([[0.3, 0.5, 0.2, 0.6], [0.4, 0.1, 0.7, 0.5]]))
  return old, old + _DELTA, old - np.array([[0.1, -0.2, 0.3, 0.0], [0.05, 0.0, -0.1, 0.2]])


def test_ppo_clip_gradient_matches_finite_differences():
  with jax.enable_x64(True):
    old, logp, ref = _case()
    def fn(lp):
      return ppo_clip_loss(lp, old, _ADV, _MASK, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                           agg="seq-mean-token-mean", ref_logp=ref, kl_coef=0.1)[0]
    grad = _fd_check(fn, logp)
    # the padded token gets no gradient; every real one does (through the KL term at least)
    assert grad[1, 3] == 0.0
    assert np.count_nonzero(grad) == 7


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_gspo_gradient_matches_finite_differences(agg):
  with jax.enable_x64(True):
    old, logp, _ = _case()
    def fn(lp):
      return gspo_loss(lp, old, np.array([1.0, -1.0]), _MASK, clip_low=0.5, clip_high=0.5,
                       agg=agg)[0]
    _fd_check(fn, logp * 0.2 + old * 0.8)


def test_decoupled_ppo_gradient_matches_finite_differences():
  with jax.enable_x64(True):
    old, logp, behaviour = _case()
    def fn(lp):
      return decoupled_ppo_loss(lp, old, behaviour, _ADV, _MASK, behaviour_cap=1.2)[0]
    _fd_check(fn, logp)


def test_m2po_gradient_matches_finite_differences():
  with jax.enable_x64(True):
    old, logp, behaviour = _case()
    def fn(lp):
      return m2po_loss(lp, old, behaviour, _ADV, _MASK, threshold=0.01)[0]
    _fd_check(fn, logp)


def _verl_kl_cov(old, logp, adv, mask, ratio, coef):
  """verl's compute_policy_loss_kl_cov (token-mean), transcribed to NumPy: the top
  max(1, int(n * ratio)) valid tokens by (A - mean A)(log pi - mean log pi) take
  coef * |log-ratio| on the unclipped -A r."""
  log_ratio = logp - old
  pg = -adv * np.exp(log_ratio)
  valid = np.flatnonzero(mask.reshape(-1) > 0)
  a, lp = adv.reshape(-1)[valid], logp.reshape(-1)[valid]
  cov = (a - a.mean()) * (lp - lp.mean())
  top = valid[np.argsort(-cov, kind="stable")[:max(1, int(len(cov) * ratio))]]
  pg = pg.reshape(-1)
  pg[top] += coef * np.abs(log_ratio.reshape(-1)[top])
  pg = pg.reshape(mask.shape)
  return (pg * mask).sum() / mask.sum(), len(top)


@pytest.mark.parametrize("ratio,coef", [(2e-4, 1.0), (0.25, 0.5)])
def test_kl_cov_holds_the_most_covarying_tokens_as_verl_does(ratio, coef):
  from algorithms.losses import kl_cov_loss
  rng = np.random.default_rng(3)
  old = rng.normal(-2.0, 0.5, (4, 6)).astype(np.float32)
  logp = (old + rng.normal(0, 0.2, (4, 6))).astype(np.float32)
  adv = np.repeat(rng.normal(0, 1, (4, 1)), 6, axis=1).astype(np.float32)
  mask = (np.arange(6)[None, :] < np.array([[6], [4], [5], [2]])).astype(np.float32)
  want, held = _verl_kl_cov(old, logp, adv, mask, ratio, coef)
  loss, metrics = kl_cov_loss(jnp.asarray(logp), old, adv[:, 0], mask, kl_cov_ratio=ratio,
                              kl_cov_coef=coef)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert float(metrics["kl_cov_frac"]) == pytest.approx(held / mask.sum())
  assert held == (1 if ratio < 0.01 else 4)
  # The held tokens' gradient carries the KL term's sign(log-ratio) * coef; no ratio clips.
  grad = jax.grad(lambda lp: kl_cov_loss(lp, old, adv[:, 0], mask, kl_cov_ratio=ratio,
                                         kl_cov_coef=coef)[0])(jnp.asarray(logp))
  plain = -adv * np.exp(logp - old) * mask / mask.sum()
  extra = (np.asarray(grad) - plain) * mask.sum() / coef
  moved = np.abs(extra) > 1e-4
  assert moved.sum() == held
  np.testing.assert_allclose(extra[moved], np.sign(logp - old)[moved], rtol=1e-4)
  with pytest.raises(ValueError, match="kl_cov_ratio: expected a share"):
    kl_cov_loss(jnp.asarray(logp), old, adv[:, 0], mask, kl_cov_ratio=0.0)


def _verl_geo_mean(old, logp, adv, mask, low, high):
  """verl's compute_policy_loss_geo_mean transcribed to NumPy (no IS weights): each row's
  geometric-mean ratio of its sign-pessimistically clipped token log-ratios, times minus
  its token-mean advantage, averaged over the rows; and its clip fractions."""
  d = logp - old
  sgn = np.sign(adv)
  bounded = np.clip(d, -low, high)
  pess = sgn * np.minimum(sgn * d, sgn * bounded)
  n = mask.sum(-1)
  ratio = np.exp((pess * mask).sum(-1) / (n + 1e-8))
  loss = np.mean(-(adv * mask).sum(-1) / (n + 1e-8) * ratio)
  clipped = d != bounded
  frac = lambda c: (c * mask).sum() / mask.sum()  # noqa: E731
  return loss, frac(clipped & (adv > 0)), frac(clipped & (adv < 0))


def test_gmpo_clips_each_tokens_log_ratio_and_takes_the_geometric_mean_as_verl_does():
  from algorithms.losses import geo_mean_loss
  rng = np.random.default_rng(5)
  old = rng.normal(-2.0, 0.5, (4, 6)).astype(np.float32)
  logp = (old + rng.normal(0, 0.5, (4, 6))).astype(np.float32)  # some past +-0.4
  adv = np.repeat(np.array([[1.5], [-0.7], [0.3], [-1.2]], np.float32), 6, axis=1)
  mask = (np.arange(6)[None, :] < np.array([[6], [4], [5], [2]])).astype(np.float32)
  want, high, low = _verl_geo_mean(old, logp, adv, mask, 0.4, 0.4)
  assert high > 0 and low > 0  # both sides clip somewhere
  loss, metrics = geo_mean_loss(jnp.asarray(logp), old, adv[:, 0], mask)
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose([metrics["clip_frac_high"], metrics["clip_frac_low"]],
                             [high, low], rtol=1e-6)
  # A token clipped on the optimistic side carries no gradient; the others the sequence's
  # -A_i s_i / n_i over the 4 sequences' mean.
  f = lambda lp: geo_mean_loss(lp, old, adv[:, 0], mask)[0]  # noqa: E731
  grad = np.asarray(jax.grad(f)(jnp.asarray(logp, jnp.float32)))
  d, sgn, n = logp - old, np.sign(adv), mask.sum(-1, keepdims=True)
  live = (sgn * d <= sgn * np.clip(d, -0.4, 0.4)) & (mask > 0)
  assert live.sum() < mask.sum() and np.all(grad[~live] == 0)
  pess = np.where(live, d, np.clip(d, -0.4, 0.4))
  s_i = np.exp((pess * mask).sum(-1, keepdims=True) / n)
  np.testing.assert_allclose(grad[live], np.broadcast_to(-adv * s_i / n / 4, d.shape)[live],
                             rtol=1e-5)


def _verl_clip_cov(old, logp, adv, mask, noise, low, high, ratio, lb, ub):
  """verl's compute_policy_loss_clip_cov (token-mean) transcribed to NumPy, its random pick
  (torch.randperm over the candidates) made by the smallest `noise`."""
  r = np.exp(logp - old)
  pg1, pg2 = -adv * r, -adv * np.clip(r, 1 - low, 1 + high)
  clip_by_origin = (pg2 > pg1) & (mask > 0)
  valid = mask > 0
  cov = (adv - adv[valid].mean()) * (logp - logp[valid].mean())
  cov[~valid | clip_by_origin] = -np.inf
  clip_num = max(int(ratio * mask.sum()), 1)
  idx = np.argwhere((cov < ub) & (cov > lb) & valid)
  idx = idx[np.argsort(noise[idx[:, 0], idx[:, 1]], kind="stable")[:clip_num]]
  corr = np.ones_like(adv)
  corr[idx[:, 0], idx[:, 1]] = 0
  pg = np.maximum(pg1, pg2) * corr
  return (pg * mask).sum() / mask.sum(), len(idx)


@pytest.mark.parametrize("ratio,lb,ub", [(0.2, -1e9, 1e9), (0.05, 0.02, 1e9), (1.0, 0.02, 0.3)])
def test_clip_cov_drops_a_random_few_of_the_covarying_tokens_as_verl_does(ratio, lb, ub):
  from algorithms.losses import clip_cov_loss
  rng = np.random.default_rng(7)
  old = rng.normal(-2.0, 0.5, (4, 6)).astype(np.float32)
  logp = (old + rng.normal(0, 0.3, (4, 6))).astype(np.float32)
  adv = np.repeat(rng.normal(0, 1, (4, 1)), 6, axis=1).astype(np.float32)
  mask = (np.arange(6)[None, :] < np.array([[6], [4], [5], [2]])).astype(np.float32)
  noise = rng.uniform(size=(4, 6)).astype(np.float32)
  want, dropped = _verl_clip_cov(old, logp, adv, mask, noise, 0.2, 0.2, ratio, lb, ub)
  assert dropped > 0
  f = lambda lp: clip_cov_loss(lp, old, adv[:, 0], mask, noise=noise, clip_low=0.2,  # noqa
                               clip_high=0.2, clip_cov_ratio=ratio, clip_cov_lb=lb,
                               clip_cov_ub=ub)
  loss, metrics = f(jnp.asarray(logp))
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert float(metrics["clip_cov_frac"]) == pytest.approx(dropped / mask.sum())
  # The dropped tokens take no gradient; every other live token its PPO term's.
  grad = np.asarray(jax.grad(lambda lp: f(lp)[0])(jnp.asarray(logp)))
  ppo = np.asarray(jax.grad(lambda lp: ppo_clip_loss(lp, old, adv[:, 0], mask, clip_low=0.2,
                                                     clip_high=0.2)[0])(jnp.asarray(logp)))
  differ = ~np.isclose(grad, ppo, atol=1e-7)
  assert differ.sum() == dropped and np.all(grad[differ] == 0)


def _verl_sapo(old, logp, adv, mask, tau_pos, tau_neg):
  """verl's compute_policy_loss_sapo (seq-mean-token-mean, no IS weights) in NumPy."""
  ratio = np.exp(np.clip(logp - old, -20.0, 20.0))
  tau = np.where(adv > 0, tau_pos, tau_neg)
  pg = -(1 / (1 + np.exp(-tau * (ratio - 1.0)))) * (4.0 / tau) * adv
  n = mask.sum(-1)
  rows = (pg * mask).sum(-1) / (n + 1e-8)
  return rows[n > 0].sum() / (n > 0).sum()


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (2.0, 8.0)])
def test_sapo_gates_each_tokens_step_softly_as_verl_does(tau_pos, tau_neg):
  from algorithms.losses import sapo_loss
  rng = np.random.default_rng(7)
  old = rng.normal(-2.0, 0.5, (4, 6)).astype(np.float32)
  logp = (old + rng.normal(0, 0.6, (4, 6))).astype(np.float32)
  adv = np.repeat(np.array([[1.5], [-0.7], [0.3], [-1.2]], np.float32), 6, axis=1)
  mask = (np.arange(6)[None, :] < np.array([[6], [4], [5], [0]])).astype(np.float32)
  kwargs = dict(tau_pos=tau_pos, tau_neg=tau_neg)
  loss, metrics = sapo_loss(jnp.asarray(logp), old, adv[:, 0], mask, **kwargs)
  np.testing.assert_allclose(loss, _verl_sapo(old, logp, adv, mask, tau_pos, tau_neg),
                             rtol=1e-5)
  assert float(metrics["clip_frac"]) == 0.0
  # d/dlogp of -sigmoid(tau (r - 1)) 4 / tau A = -4 s (1 - s) r A, over each row's tokens and
  # the 3 rows with tokens: every token keeps a gradient (nothing is clipped), one that
  # fades as r leaves 1, the faster the larger tau.
  grad = np.asarray(jax.grad(lambda lp: sapo_loss(lp, old, adv[:, 0], mask, **kwargs)[0])(
      jnp.asarray(logp)))
  r, tau = np.exp(logp - old), np.where(adv > 0, tau_pos, tau_neg)
  s = 1 / (1 + np.exp(-tau * (r - 1)))
  n = np.maximum(mask.sum(-1, keepdims=True), 1)
  want = -4 * s * (1 - s) * r * adv * mask / n / 3
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-7)
  assert np.all(grad[mask > 0] != 0)
  # At r = 1 the gate's gradient is the policy gradient's, whatever tau.
  at_one = jax.grad(lambda lp: sapo_loss(lp, old, adv[:, 0], mask, **kwargs)[0])(
      jnp.asarray(old))
  np.testing.assert_allclose(at_one, -adv * mask / n / 3, rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="tau_pos/tau_neg: expected temperatures > 0"):
    sapo_loss(jnp.asarray(logp), old, adv[:, 0], mask, tau_pos=0.0)


def test_the_plain_policy_gradient_weighs_each_log_prob_by_its_advantage_as_verl_gpg():
  from algorithms.losses import pg_loss
  rng = np.random.default_rng(3)
  old = rng.normal(-2.0, 0.5, (3, 5)).astype(np.float32)
  logp = (old + rng.normal(0, 0.8, (3, 5))).astype(np.float32)  # far off-policy: no clip
  adv = np.array([1.5, -0.7, 0.0], np.float32)
  mask = (np.arange(5)[None, :] < np.array([[5], [3], [2]])).astype(np.float32)
  weights = rng.uniform(0.5, 2.0, (3, 5)).astype(np.float32)
  loss, metrics = pg_loss(jnp.asarray(logp), old, adv, mask, token_weights=weights)
  # verl's compute_policy_loss_gpg: token-mean of -log pi * A (its IS weights multiplying).
  want = np.sum(-logp * adv[:, None] * weights * mask) / mask.sum()
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert float(metrics["clip_frac"]) == 0.0
  grad = np.asarray(jax.grad(lambda lp: pg_loss(lp, old, adv, mask, token_weights=weights)[0])(
      jnp.asarray(logp)))
  np.testing.assert_allclose(grad, -adv[:, None] * weights * mask / mask.sum(), rtol=1e-5)
  # The ratio enters nothing but its metrics: the old log-probs leave loss and gradient be.
  other = pg_loss(jnp.asarray(logp), old - 1.0, adv, mask, token_weights=weights)
  np.testing.assert_allclose(other[0], loss, rtol=1e-6)
  assert float(other[1]["ratio_mean"]) > float(metrics["ratio_mean"])


def test_a_zero_abs_kl_term_gives_no_gradient():
  # jnp.abs has gradient 1 at 0: KL-Cov's |log pi - log pi_old| on one update per batch
  # (old = log pi) pushed every held token; torch's, and ours, give 0 there
  from algorithms.losses import kl_cov_loss, pg_loss
  rng = np.random.default_rng(5)
  logp = jnp.asarray(rng.normal(-2.0, 0.5, (4, 6)).astype(np.float32))
  adv = rng.normal(0, 1, (4,)).astype(np.float32)
  mask = (np.arange(6)[None, :] < np.array([[6], [4], [5], [2]])).astype(np.float32)
  kl_cov = lambda lp: kl_cov_loss(lp, jax.lax.stop_gradient(lp), adv, mask,  # noqa: E731
                                  kl_cov_ratio=0.25, kl_cov_coef=1.0)
  assert float(kl_cov(logp)[1]["kl_cov_frac"]) > 0
  grad = jax.grad(lambda lp: kl_cov(lp)[0])(logp)
  plain = jax.grad(lambda lp: pg_loss(lp, lp, adv, mask)[0])(logp)
  np.testing.assert_allclose(grad, plain, rtol=1e-6)
  # the abs estimator: no gradient where log pi equals the reference, sign(log r) elsewhere
  ref = logp.at[0].add(0.5)
  grad = np.asarray(jax.grad(lambda lp: jnp.sum(kl_penalty(lp, ref, "abs")))(logp))
  np.testing.assert_array_equal(grad[1:], 0.0)
  np.testing.assert_array_equal(grad[0], -1.0)


def test_ratio_stats_ignore_padding_tokens():
  ratios = jnp.array([[1.1, 0.9, 5.0, 0.01]])  # the last two are padding
  mask = jnp.array([[1.0, 1.0, 0.0, 0.0]])
  _, m = ppo_clip_loss(jnp.log(ratios), jnp.zeros((1, 4)), jnp.ones((1, 4)), mask)
  assert float(m["ratio_max"]) == pytest.approx(1.1, rel=1e-5)
  assert float(m["ratio_min"]) == pytest.approx(0.9, rel=1e-5)
  assert float(m["ratio_mean"]) == pytest.approx(1.0, rel=1e-5)
