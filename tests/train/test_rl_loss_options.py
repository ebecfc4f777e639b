"""The loss options a user sets in the config (loss.scale_rewards, loss.std_eps,
loss.dual_clip, loss.off_policy_mask, loss.reward_aggregation) change what the trainer
computes: by hand on a small batch, and as Hugging Face TRL's GRPOTrainer computes its
scale_rewards, eps and delta (tests/fixtures/trl_losses.json); bad values are refused
naming the field."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_testlib import rl_config
from rlax_ps.train import rl_loss as rl_loss_lib
from rlax_ps.train.rl_checks import check_rl_config
from rlax_ps.train.rl_loss import LossConfig, group_advantages, rl_loss

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trl_losses.json")
with open(FIXTURE) as _f:
  DATA = json.load(_f)
TRL_EPS = 1e-4  # TRL divides by std + 1e-4


def _hand_batch():
  """Two groups of 4 (even: MC-GRPO drops no pivot), one row each."""
  rewards = np.asarray([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], np.float32)
  return {"rewards": jnp.asarray(rewards), "sample_mask": jnp.ones((2, 4), jnp.float32),
          "row_group": jnp.arange(2, dtype=jnp.int32)}


def test_scale_rewards_batch_divides_by_the_whole_batchs_std():
  batch = _hand_batch()
  batch_std = np.sqrt(8 * 0.25 / 7)  # all 8 rewards: mean 0.5, unbiased
  group_std = 0.5  # each group: deviations 0.75 and 3 x 0.25, unbiased var 0.75 / 3
  grpo = lambda **kw: np.asarray(group_advantages(batch, 2, LossConfig(**kw))[0])
  centred = np.asarray([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
  np.testing.assert_allclose(grpo(), centred / group_std, rtol=1e-5)
  np.testing.assert_allclose(grpo(scale_rewards="batch"), centred / batch_std, rtol=1e-5)
  mc = lambda **kw: np.asarray(group_advantages(batch, 2, LossConfig(advantage="mc_grpo",
                                                                     **kw))[0])
  median_centred = np.asarray([1.0, 0, 0, 0, 0, 0, 0, -1.0])  # medians 0 and 1
  np.testing.assert_allclose(mc(scale_rewards="batch"), median_centred / batch_std, rtol=1e-5)
  np.testing.assert_allclose(mc(), median_centred / group_std, rtol=1e-5)


def test_std_eps_is_added_to_the_std():
  batch = _hand_batch()
  adv = group_advantages(batch, 2, LossConfig(std_eps=0.5))[0]
  np.testing.assert_allclose(adv[:4], np.asarray([0.75, -0.25, -0.25, -0.25]) / 1.0, rtol=1e-6)


def _find(batch, **cfg):
  return next(c for c in DATA["cases"]
              if c["trainer"] == "grpo" and c["batch"] == batch and c["config"] == cfg)


def _trl_batch(name):
  """The fixture's batch as the trainer packs it (one row per group); TRL's `old` log-probs
  as the workers' (correction none: the ratio is against them, as TRL's is)."""
  b = DATA["batches"][name]
  g, n = b["groups"], b["n"]
  f = lambda k: jnp.asarray(np.asarray(b[k], np.float32))
  t = f("mask").shape[-1]
  batch = {"rewards": f("rewards").reshape(g, n), "sample_mask": jnp.ones((g, n), jnp.float32),
           "row_group": jnp.arange(g, dtype=jnp.int32),
           "response_lens": jnp.asarray(b["lens"], jnp.int32).reshape(g, n),
           "response_tokens": jnp.ones((g, n, t), jnp.int32),
           "behaviour_logp": f("old_logp").reshape(g, n, t)}
  return batch, f("logp"), g


@pytest.fixture(autouse=True)
def fixture_logprobs(monkeypatch):
  """The policy is its per-token log-probs [rows * N, R]: no model runs."""
  def response_logprobs(params, graphdef, batch, backend="auto", *, with_stats=False, **_):
    logp = params["logp"]
    return (logp, {"entropy": jnp.zeros_like(logp)}) if with_stats else logp
  monkeypatch.setattr(rl_loss_lib, "response_logprobs", response_logprobs)


def _loss_and_grad(name, cfg):
  batch, logp, groups = _trl_batch(name)
  loss = lambda p: rl_loss(p, None, batch, None, num_groups=groups, cfg=cfg)
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)({"logp": logp})
  return value, metrics, grad["logp"]


# (TRL's GRPOConfig, our loss fields): the advantages are the trainer's own, not TRL's.
TRL_OPTIONS = [
    (dict(scale_rewards="batch", loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
          use_vllm=False), dict(scale_rewards="batch", std_eps=TRL_EPS)),
    (dict(scale_rewards="batch", loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
          use_vllm=False),
     dict(scale_rewards="batch", std_eps=TRL_EPS, agg="seq-mean-token-mean")),
    (dict(scale_rewards="group", loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
          use_vllm=False), dict(std_eps=TRL_EPS)),
    (dict(loss_type="dapo", delta=1.5, use_vllm=False),
     dict(std_eps=TRL_EPS, clip_high=0.2, dual_clip=1.5)),
]


TRL_IDS = ["batch-dapo", "batch-grpo", "group-dapo", "delta"]


# batch-dapo-b2x5 is slow (suite time): batch-dapo-b3x4 holds its options, the other
# options' b2x5 cases its batch.
@pytest.mark.parametrize("trl_cfg,fields,name", [
    pytest.param(trl_cfg, fields, name, id=f"{option}-{name}",
                 marks=[pytest.mark.slow] if (option, name) == ("batch-dapo", "b2x5") else [])
    for (trl_cfg, fields), option in zip(TRL_OPTIONS, TRL_IDS) for name in ("b3x4", "b2x5")])
def test_loss_options_give_trls_advantages_loss_and_gradient(name, trl_cfg, fields):
  case = _find(name, **trl_cfg)
  cfg = LossConfig(**fields)
  batch, _, groups = _trl_batch(name)
  adv, _ = group_advantages(batch, groups, cfg)
  np.testing.assert_allclose(adv, case["advantages"], rtol=1e-5, atol=1e-6)
  value, _, grad = _loss_and_grad(name, cfg)
  np.testing.assert_allclose(value, case["loss"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, np.asarray(case["grad_logp"], np.float32), rtol=1e-5,
                             atol=1e-6)


def test_dual_clip_binds_on_trls_delta_batch():
  """On that batch the bound is active: without it the loss is not TRL's."""
  case = _find("b3x4", loss_type="dapo", delta=1.5, use_vllm=False)
  value, metrics, _ = _loss_and_grad("b3x4", LossConfig(std_eps=TRL_EPS, clip_high=0.2,
                                                        dual_clip=1.5))
  assert metrics["dual_clip_frac"] > 0
  off, _, _ = _loss_and_grad("b3x4", LossConfig(std_eps=TRL_EPS, clip_high=0.2))
  assert not np.isclose(float(off), case["loss"], rtol=1e-3) and float(value) < float(off)


def test_the_config_keeps_todays_objective_unless_the_options_are_set():
  cfg = check_rl_config(rl_config(), files=False)
  assert (cfg.scale_rewards, cfg.std_eps, cfg.dual_clip) == ("group", 1e-6, None)
  config = rl_config()
  config.loss.scale_rewards, config.loss.std_eps, config.loss.dual_clip = "batch", 1e-4, 3.0
  cfg = check_rl_config(config, files=False)
  assert (cfg.scale_rewards, cfg.std_eps, cfg.dual_clip) == ("batch", 1e-4, 3.0)


@pytest.mark.parametrize("fields, message", [
    ({"scale_rewards": "none"}, r"loss.scale_rewards: expected one of \('group', 'batch'\) "
                                r"with advantage='grpo' \(no std: advantage='dr_grpo'\)"),
    ({"advantage": "rloo", "scale_rewards": "batch"},
     "loss.scale_rewards: expected unset with advantage='rloo'"),
    ({"advantage": "dr_grpo", "scale_rewards": "group"},
     "loss.scale_rewards: expected unset with advantage='dr_grpo'"),
    ({"std_eps": -1e-4}, "loss.std_eps: expected a finite eps >= 0"),
    ({"dual_clip": 1.0}, r"loss.dual_clip: expected a constant > 1 \(None: off\), got 1.0"),
    ({"policy_loss": "gspo", "dual_clip": 3.0},
     "loss.dual_clip: expected None with policy_loss='gspo'"),
    ({"correction": "m2po", "dual_clip": 3.0},
     "loss.dual_clip: expected None with policy_loss='ppo', correction='m2po'"),
    ({"off_policy_mask": -0.1}, r"loss.off_policy_mask: expected a finite threshold > 0 .*"
                                r"got -0.1"),
    ({"off_policy_mask": float("inf")}, "loss.off_policy_mask: expected a finite threshold"),
    ({"reward_aggregation": "mean"},
     r"loss.reward_aggregation: expected one of \('sum', 'normalize_then_sum'\), got 'mean'"),
    ({"reward_aggregation": "normalize_then_sum", "advantage": "rloo"},
     "loss.reward_aggregation: expected 'sum' with advantage='rloo'"),
    ({"reward_aggregation": "normalize_then_sum", "scale_rewards": "batch"},
     "loss.reward_aggregation: expected 'sum' with advantage='grpo', scale_rewards='batch'"),
    ({"reward_aggregation": "normalize_then_sum"},
     "loss.reward_aggregation: expected 'sum' when the workers send no reward parts"),
    ({"advantage": "reinforce_pp", "scale_rewards": "batch"},
     "loss.scale_rewards: expected unset with advantage='reinforce_pp', which whitens over "
     "the batch's tokens itself"),
    ({"advantage": "reinforce_pp_baseline", "off_policy_mask": 0.2},
     "loss.off_policy_mask: expected None or 0 with advantage='reinforce_pp_baseline'"),
    ({"advantage": "reinforce_pp", "policy_loss": "gspo"},
     "loss.policy_loss: expected 'ppo', 'cispo' or 'kl_cov' with advantage='reinforce_pp'"),
    ({"gamma": 0.9}, r"loss.gamma: expected 1.0 with advantage='grpo' \(only reinforce_pp "
                     r"and gae discount returns\), got 0.9"),
    ({"advantage": "reinforce_pp", "gamma": 0.0}, r"loss.gamma: expected a discount in \(0, 1\]"),
    ({"kl_in_reward": -0.1}, "loss.kl_in_reward: expected a finite coefficient >= 0"),
    ({"kl_in_reward": 0.1, "reward_aggregation": "normalize_then_sum"},
     "loss.kl_in_reward: expected 0 with reward_aggregation='normalize_then_sum'"),
    ({"kl_target": 0.1}, "loss.kl_target: expected None with kl_in_reward=0"),
    ({"kl_in_reward": 0.1, "kl_target": -1.0}, r"loss.kl_target: expected a finite KL > 0"),
    ({"kl_in_reward": 0.1, "kl_target": 0.1, "kl_horizon": 0},
     "loss.kl_horizon: expected a whole number of samples > 0"),
])
def test_bad_loss_options_are_refused_naming_the_field(fields, message):
  config = rl_config()
  for key, value in fields.items():
    config.loss[key] = value
  with pytest.raises(ValueError, match=message):
    check_rl_config(config, files=False)


def test_normalize_then_sum_weighs_the_parts_as_the_workers_do():
  """The trainer takes the parts' names and weights from the workers' settings."""
  config = rl_config()
  config.loss.reward_aggregation = "normalize_then_sum"
  config.worker.reward_terms = "think_format:0.5,math"
  config.worker.reward_model, config.worker.reward_model_weight = "/rm", 0.25
  assert check_rl_config(config, files=False).reward_parts == (
      ("task", 1.0), ("think_format", 0.5), ("math", 1.0), ("reward_model", 0.25))
  config.loss.reward_aggregation = "sum"
  assert check_rl_config(config, files=False).reward_parts == ()


def test_overlong_punishment_ramps_to_the_sampling_budget_not_the_padded_width():
  # worker.max_new_tokens=4 (loss.budget), the batch padded to 8 tokens, a buffer of 2: the
  # punishment starts past 2 tokens and is whole at the budget, where the workers cut.
  cfg = LossConfig(overlong_buffer=2, budget=4)
  batch = {"rewards": jnp.zeros((1, 3)), "response_tokens": jnp.zeros((1, 3, 8), jnp.int32),
           "response_lens": jnp.array([[2, 3, 4]])}
  np.testing.assert_allclose(np.asarray(rl_loss_lib.sample_scores(batch, cfg)),
                             [0.0, -0.5, -1.0], atol=1e-6)
