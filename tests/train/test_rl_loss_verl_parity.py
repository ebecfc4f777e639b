"""verl's REINFORCE++ family and its KL-in-reward (loss.advantage="reinforce_pp" /
"reinforce_pp_baseline", loss.gamma, loss.kl_in_reward) against verl's own code on one batch
(tests/fixtures/verl/reinforce_pp.json, made by tests/fixtures/make_verl_fixtures.py): the
token rewards, the per-token advantages and the per-sample ones of the summed rewards; then
the loss they feed, whole and micro-batched. The model forward is replaced by fixture
log-probs, as in test_rl_loss_trl_parity.py."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from algorithms import advantages as adv_lib
from algorithms import losses
from rl_testlib import verl_batch, verl_fixture
from rlax_ps.train import rl_loss as rl_loss_lib
from rlax_ps.train.rl_loss import (LossConfig, group_advantages, logged_advantages,
                                   micro_batched_loss_and_grad, ref_sync_settings, rl_loss,
                                   token_mask)

DATA, B, G, N, REAL, T = verl_fixture("reinforce_pp.json")  # verl sees the real samples alone


def _batch():
  """The fixture's batch as the trainer packs it: one row per group, padding samples masked."""
  return verl_batch(B)


def _cfg(case, **fields):  # (the fixture's estimator where a KL is estimated: else unused)
  kl = {"kl_estimator": case["kl_estimator"]} if case["kl_in_reward"] else {}
  return LossConfig(advantage=case["advantage"], kl_in_reward=case["kl_in_reward"],
                    gamma=case["gamma"], **kl, **fields)


def _full(verl_rows):
  """verl's [real samples, T] values at the batch's [rows * N, T] places, 0 on padding."""
  out = np.zeros((G * N, T), np.float32)
  out[REAL] = np.asarray(verl_rows, np.float32)
  return out


CASES = DATA["cases"]
IDS = [f"{c['advantage']}-beta{c['kl_in_reward']}-{c['kl_estimator']}-g{c['gamma']}"
       for c in CASES]


@pytest.mark.parametrize("case", [c for c in CASES if c["kl_in_reward"]],
                         ids=[i for i, c in zip(IDS, CASES) if c["kl_in_reward"]])
def test_token_rewards_with_the_kl_penalty_equal_verls(case):
  batch, ref = _batch()
  tokens = token_mask(batch, batch["sample_mask"].reshape(-1))
  kl = losses.kl_penalty(batch["behaviour_logp"].reshape(-1, T), ref,
                         case["kl_estimator"]) * tokens
  np.testing.assert_allclose(kl, _full(case["kl"]), rtol=1e-6, atol=1e-6)
  rewards = adv_lib.token_rewards(batch["rewards"].reshape(-1), tokens, kl,
                                  case["kl_in_reward"])
  np.testing.assert_allclose(rewards[REAL], case["token_rewards"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_advantages_equal_verls(case):
  batch, ref = _batch()
  adv, mask = group_advantages(batch, G, _cfg(case), ref)
  verl = np.asarray(case["advantages"], np.float32)
  if case["advantage"].startswith("reinforce_pp"):
    assert adv.shape == (G * N, T)
    np.testing.assert_allclose(adv, _full(verl), rtol=1e-5, atol=1e-5)
  else:  # one per sample, of the summed token rewards; a group of one is verl's own rule
    several = np.repeat(np.asarray(B["sample_mask"]).reshape(G, N).sum(1) > 1, N) & REAL
    np.testing.assert_allclose(np.asarray(adv)[several], _full(verl)[several, 0], rtol=1e-5,
                               atol=1e-6)
  np.testing.assert_array_equal(mask, np.asarray(B["sample_mask"]))


def test_kl_in_reward_needs_the_reference():
  batch, _ = _batch()
  with pytest.raises(ValueError, match="loss.kl_in_reward: the advantages need the frozen "
                                       "reference's log-probs"):
    group_advantages(batch, G, LossConfig(kl_in_reward=0.1))


@pytest.fixture
def fixture_logprobs(monkeypatch):
  """A policy is its per-token log-probs ({"logp": [rows * N, R]}): the batch's rows of it."""
  def response_logprobs(params, graphdef, batch, backend="auto", *, with_stats=False, **_):
    rows = batch["row_group"].shape[0]
    logp = params["logp"].reshape(-1, N, T)[batch["row_ids"]].reshape(rows * N, T)
    return (logp, {"entropy": jnp.zeros_like(logp)}) if with_stats else logp
  monkeypatch.setattr(rl_loss_lib, "response_logprobs", response_logprobs)


# (case index, extra loss fields): per-token advantages with and without a KL loss term
# sharing the reference, and a per-sample one of summed rewards, with CISPO.
WIRING = [(1, {}), (4, dict(kl_coef=0.05, agg="seq-mean-token-mean")),
          (2, dict(policy_loss="cispo")), (5, {})]


@pytest.mark.parametrize("index,fields", WIRING, ids=[IDS[i] for i, _ in WIRING])
def test_rl_loss_trains_on_verls_advantages_whole_and_micro_batched(fixture_logprobs, index,
                                                                    fields):
  """The loss and gradient equal the policy loss of verl's advantages (each token its own,
  or each sample's on its tokens), with the KL term against the same reference; 3 slices of
  the rows (a group each) give the same, so the whitening and group means are the whole
  batch's."""
  case = CASES[index]
  cfg = _cfg(case, **fields)
  batch, ref = _batch()
  behaviour = batch["behaviour_logp"].reshape(-1, T)
  logp = behaviour + jnp.asarray(np.random.default_rng(3).normal(0, 0.2, (G * N, T)),
                                 jnp.float32)
  mask = token_mask(batch, batch["sample_mask"].reshape(-1))
  if case["advantage"].startswith("reinforce_pp"):
    adv = _full(case["advantages"])
  else:  # per sample: verl's but for its group of one (test_advantages_equal_verls)
    adv = np.asarray(group_advantages(batch, G, cfg, ref)[0])
  policy = {"ppo": losses.ppo_clip_loss, "cispo": losses.cispo_loss}[cfg.policy_loss]
  expected = lambda lp: policy(lp, behaviour, adv, mask, clip_low=cfg.clip_low,
                               clip_high=cfg.clip_high, agg=cfg.agg,
                               ref_logp=ref if cfg.kl_coef else None, kl_coef=cfg.kl_coef,
                               kl_estimator=cfg.kl_estimator)[0]
  want, want_grad = jax.value_and_grad(expected)(logp)
  (value, metrics), grad = jax.value_and_grad(
      lambda p: rl_loss(p, None, batch, {"logp": ref}, num_groups=G, cfg=cfg),
      has_aux=True)({"logp": logp})
  np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad["logp"], want_grad, rtol=1e-5, atol=1e-7)
  (m_value, m_metrics), m_grad = micro_batched_loss_and_grad(
      {"logp": logp}, None, batch, {"logp": ref}, num_groups=G, cfg=cfg, micro_batches=3)
  np.testing.assert_allclose(m_value, want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(m_grad["logp"], want_grad, rtol=1e-5, atol=1e-7)
  for k in sorted(metrics):
    np.testing.assert_allclose(m_metrics[k], metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_logged_advantages_are_one_per_sample_without_the_kl_penalty():
  """The completions log shows a per-token advantage as its mean over the sample's tokens."""
  batch, _ = _batch()
  cfg = LossConfig(advantage="reinforce_pp_baseline", kl_in_reward=0.1, kl_target=0.05,
                   kl_horizon=16)  # (the adaptive controller's own settings: left out too)
  adv, mask = logged_advantages(batch, G, cfg)
  tokens, _ = group_advantages(batch, G, LossConfig(advantage="reinforce_pp_baseline"))
  m = token_mask(batch, mask)
  assert adv.shape == (G * N,)
  np.testing.assert_allclose(adv, np.sum(tokens * m, 1) / np.maximum(np.sum(m, 1), 1),
                             rtol=1e-6)


def test_kl_in_reward_keeps_a_reference_to_sync():
  rl = ml_collections.ConfigDict(dict(ref_sync_steps=4))
  assert ref_sync_settings(rl, LossConfig(kl_in_reward=0.1)) == (4, 0.6)
  assert rl_loss_lib.needs_reference(LossConfig(kl_in_reward=0.1))
  assert not rl_loss_lib.needs_reference(LossConfig())


@pytest.mark.parametrize("case", DATA["adaptive"], ids=lambda c: f"{c['kl_estimator']}-"
                                                               f"target{c['kl_target']}")
def test_the_adaptive_kl_controller_moves_the_coefficient_as_verls(case):
  """loss.kl_target: the step's reward_kl is verl's reward_kl_penalty, and each step's
  coefficient after it is verl's AdaptiveKLController's (n_steps: the batch's samples)."""
  batch, ref = _batch()
  cfg = LossConfig(kl_in_reward=case["kl_in_reward"], kl_target=case["kl_target"],
                   kl_horizon=case["kl_horizon"], kl_estimator=case["kl_estimator"])
  mask = batch["sample_mask"].reshape(-1)
  kl = float(rl_loss_lib.reward_kl_mean(batch, ref, mask, cfg))
  beta = cfg.kl_in_reward
  for want_kl, applied, after in case["steps"]:
    np.testing.assert_allclose(kl, want_kl, rtol=1e-5)
    assert beta == pytest.approx(applied, rel=1e-6)
    beta = rl_loss_lib.adapt_kl_coef(beta, kl, int(REAL.sum()), cfg)
    assert beta == pytest.approx(after, rel=1e-6)


def test_a_kl_coefficient_given_as_input_is_the_configured_one_and_reward_kl_is_logged(
    fixture_logprobs):
  """The step's kl_beta input (loss.kl_target's coefficient) weighs the KL in the rewards as
  loss.kl_in_reward set to it would, whole and micro-batched; both log reward_kl."""
  batch, ref = _batch()
  logp = batch["behaviour_logp"].reshape(-1, T) + jnp.asarray(
      np.random.default_rng(5).normal(0, 0.2, (G * N, T)), jnp.float32)
  adaptive = LossConfig(advantage="reinforce_pp_baseline", kl_in_reward=0.1, kl_target=0.05,
                        kl_estimator="k1")
  fixed = dataclasses.replace(adaptive, kl_in_reward=0.3, kl_target=None)
  run = lambda cfg, **kw: rl_loss({"logp": logp}, None, batch, {"logp": ref}, num_groups=G,
                                  cfg=cfg, **kw)
  (want, want_m), (got, got_m) = run(fixed), run(adaptive, kl_beta=jnp.float32(0.3))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert float(run(adaptive)[0]) != pytest.approx(float(want), rel=1e-3)  # 0.1 differs
  kl = rl_loss_lib.reward_kl_mean(batch, ref, batch["sample_mask"].reshape(-1), fixed)
  np.testing.assert_allclose([got_m["reward_kl"], want_m["reward_kl"]], [kl, kl], rtol=1e-6)
  (m_value, m_metrics), _ = micro_batched_loss_and_grad(
      {"logp": logp}, None, batch, {"logp": ref}, num_groups=G, cfg=adaptive, micro_batches=3,
      kl_beta=jnp.float32(0.3))
  np.testing.assert_allclose([m_value, m_metrics["reward_kl"]], [want, kl], rtol=1e-5)
  assert abs(float(want)) > 1e-3  # the losses compared are not ~0
  # loss.advantage="gae" (the critic's targets) takes the adaptive coefficient alike.
  gae = dataclasses.replace(adaptive, advantage="gae")
  valued = {**batch, "values": jnp.asarray(np.random.default_rng(6).normal(
      size=batch["behaviour_logp"].shape), jnp.float32)}
  got_gae = rl_loss_lib.gae_targets(valued, gae, ref, kl_beta=jnp.float32(0.3))
  want_gae = rl_loss_lib.gae_targets(valued, dataclasses.replace(gae, kl_in_reward=0.3,
                                                                 kl_target=None), ref)
  for got_part, want_part in zip(got_gae, want_gae):
    np.testing.assert_allclose(got_part, want_part, rtol=1e-6)
  assert not np.allclose(rl_loss_lib.gae_targets(valued, gae, ref)[0], want_gae[0])
