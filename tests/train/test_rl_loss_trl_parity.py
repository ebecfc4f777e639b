"""The trainer's objective (`rl_loss` as `LossConfig` wires it, whole or micro-batched)
against Hugging Face TRL's GRPOTrainer on the same log-probs (tests/fixtures/trl_losses.json;
see tests/algorithms/test_trl_parity.py for the function-level map). The model forward is
replaced by the fixture's log-probs, so this checks the wiring: which log-probs anchor the
ratio, which weights and masks, which aggregation and normaliser, the KL term."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_ps.train import rl_loss as rl_loss_lib
from rlax_ps.train.rl_loss import (LossConfig, group_advantages, micro_batched_loss_and_grad,
                                   rl_loss)

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trl_losses.json")
with open(FIXTURE) as _f:
  DATA = json.load(_f)
BUDGET = DATA["max_completion_length"]


def _find(batch, **cfg):
  for c in DATA["cases"]:
    if c["trainer"] == "grpo" and c["batch"] == batch and c["config"] == cfg:
      return c
  raise KeyError(cfg)


def _batch(name):
  """One row per group (rows = groups, N samples each), as the trainer packs a batch."""
  b = DATA["batches"][name]
  g, n = b["groups"], b["n"]
  f = lambda k: np.asarray(b[k], np.float32)
  t = f("mask").shape[-1]
  batch = {"rewards": f("rewards").reshape(g, n), "sample_mask": np.ones((g, n), np.float32),
           "row_group": np.arange(g, dtype=np.int32), "row_ids": np.arange(g, dtype=np.int32),
           "response_lens": np.asarray(b["lens"], np.int32).reshape(g, n),
           "response_tokens": np.ones((g, n, t), np.int32),
           "behaviour_logp": f("behaviour_logp").reshape(g, n, t)}
  logp = {k: jnp.asarray(f(k)) for k in ("logp", "old_logp", "behaviour_logp", "ref_logp")}
  return {k: jnp.asarray(v) for k, v in batch.items()}, logp, g


@pytest.fixture(autouse=True)
def fixture_logprobs(monkeypatch):
  """The policy is its per-token log-probs ({"logp": [rows * N, R]}): the batch's rows of it."""
  def response_logprobs(params, graphdef, batch, backend="auto", *, with_stats=False, **_):
    logp = params["logp"]
    rows = batch["row_group"].shape[0]
    n, r = batch["response_tokens"].shape[1:]
    logp = logp.reshape(-1, n, r)[batch["row_ids"]].reshape(rows * n, r)
    return (logp, {"entropy": jnp.zeros_like(logp)}) if with_stats else logp
  monkeypatch.setattr(rl_loss_lib, "response_logprobs", response_logprobs)


# (TRL config, our LossConfig fields, whether TRL's `old` is our behaviour (True: correction
# "none", ratio against the workers' log-probs) or our proximal (an IS correction), and
# whether to give TRL's advantages: TRL's eps 1e-4 is not ours, see test_trl_parity.py).
WIRING = [
    (dict(scale_rewards="none", loss_type="dapo", epsilon=0.2, epsilon_high=0.28, use_vllm=False),
     dict(advantage="dr_grpo", agg="token-mean"), True, False),
    (dict(scale_rewards="none", loss_type="dr_grpo", epsilon=0.2, epsilon_high=0.28,
          use_vllm=False),
     dict(advantage="dr_grpo", agg="seq-mean-token-sum-norm", budget=BUDGET), True, False),
    (dict(scale_rewards="none", loss_type="grpo", epsilon=0.2, epsilon_high=0.28, use_vllm=False),
     dict(advantage="dr_grpo", agg="seq-mean-token-mean"), True, False),
    (dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False, use_vllm=False),
     dict(agg="seq-mean-token-mean", clip_high=0.2, kl_coef=0.04), True, True),
    (dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.02, epsilon_high=0.05,
          beta=0.04, use_bias_correction_kl=False, use_vllm=False),
     dict(policy_loss="gspo", agg="seq-mean-token-mean", clip_low=0.02, clip_high=0.05,
          kl_coef=0.04), True, True),
    (dict(loss_type="dapo", use_vllm=True, vllm_importance_sampling_correction=True,
          vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
          beta=0.0, use_bias_correction_kl=False),
     dict(correction="tis", tis_cap=2.0, clip_high=0.2), False, True),
    (dict(loss_type="dapo", use_vllm=True, vllm_importance_sampling_correction=True,
          vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
          beta=0.0, use_bias_correction_kl=False),
     dict(correction="decoupled", behaviour_cap=2.0, clip_high=0.2), False, True),
    (dict(loss_type="dapo", use_vllm=True, vllm_importance_sampling_correction=True,
          vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5,
          vllm_importance_sampling_clip_max=2.0),
     dict(correction="mis", mis_low=0.5, mis_high=2.0, clip_high=0.2), False, True),
    (dict(loss_type="grpo", use_vllm=True, vllm_importance_sampling_correction=True,
          vllm_importance_sampling_mode="sequence_truncate",
          vllm_importance_sampling_clip_max=2.0, beta=0.04, use_bias_correction_kl=False),
     dict(correction="tis", is_level="sequence", tis_cap=2.0, agg="seq-mean-token-mean",
          clip_high=0.2, kl_coef=0.04), False, True),
    (dict(loss_type="grpo", use_vllm=True, vllm_importance_sampling_correction=True,
          vllm_importance_sampling_mode="sequence_mask",
          vllm_importance_sampling_clip_max=2.0, beta=0.04, use_bias_correction_kl=False),
     dict(correction="mis", is_level="sequence", mis_low=0.0, mis_high=2.0,
          agg="seq-mean-token-mean", clip_high=0.2, kl_coef=0.04), False, True),
    (dict(loss_type="cispo", epsilon_high=1.28, use_vllm=True,
          vllm_importance_sampling_correction=True,
          vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0),
     dict(policy_loss="cispo", correction="tis", tis_cap=2.0, clip_low=1.0, clip_high=0.28),
     False, True),
]
OPSM = dict(off_policy_mask_threshold=0.2)  # TRL's: the sampler's log-probs against pi's
# Off-policy sequence masking with each correction (TRL's old: our proximal).
OFF_POLICY_WIRING = [
    (dict(loss_type="dapo", use_vllm=True, vllm_importance_sampling_correction=True,
          vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
          **OPSM),
     dict(correction="tis", tis_cap=2.0, clip_high=0.2, off_policy_mask=0.2), False, True),
    (dict(loss_type="dapo", use_vllm=True, vllm_importance_sampling_correction=True,
          vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
          **OPSM),
     dict(correction="decoupled", behaviour_cap=2.0, clip_high=0.2, off_policy_mask=0.2),
     False, True),
    (dict(loss_type="dapo", use_vllm=True, vllm_importance_sampling_correction=True,
          vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=2.0,
          vllm_importance_sampling_clip_min=0.5, **OPSM),
     dict(correction="mis", is_level="sequence", mis_low=0.5, mis_high=2.0, clip_high=0.2,
          off_policy_mask=0.2), False, True),
]


def _ids(w):
  return f"{w[0]['loss_type']}-" + "-".join(f"{k}={v}" for k, v in sorted(w[1].items()))


def _inputs(name, trl_cfg, fields, old_is_behaviour, give_advantages):
  case = _find(name, **trl_cfg)
  batch, lp, groups = _batch(name)
  if old_is_behaviour:
    batch["behaviour_logp"] = lp["old_logp"].reshape(batch["behaviour_logp"].shape)
  proximal = None if old_is_behaviour else lp["old_logp"]
  adv = None
  if give_advantages:
    adv = (jnp.asarray(case["advantages"], jnp.float32), batch["sample_mask"].reshape(-1))
  return case, batch, lp, groups, LossConfig(**fields), proximal, adv


@pytest.mark.parametrize("name", ["b3x4", "b2x5"])
@pytest.mark.parametrize("wiring", WIRING + OFF_POLICY_WIRING, ids=_ids)
def test_rl_loss_equals_trl(name, wiring):
  case, batch, lp, groups, cfg, proximal, adv = _inputs(name, *wiring)

  def loss(params):
    return rl_loss(params, None, batch, {"logp": lp["ref_logp"]}, num_groups=groups, cfg=cfg,
                   proximal=proximal, advantages=adv)

  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)({"logp": lp["logp"]})
  if adv is None:
    np.testing.assert_allclose(metrics["advantage_abs_mean"],
                               np.mean(np.abs(case["advantages"])), rtol=1e-5)
  np.testing.assert_allclose(value, case["loss"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad["logp"], np.asarray(case["grad_logp"], np.float32),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wiring", WIRING[:3], ids=_ids)
def test_micro_batched_loss_equals_trls_whole_batch(wiring):
  """TRL's dapo divides by the generation batch's token count, its grpo averages over its
  sequences, its dr_grpo over B * max length: micro-batches weighted by their share of that
  count give the same loss and gradient."""
  case, batch, lp, groups, cfg, proximal, _ = _inputs("b3x4", *wiring)
  _micro_batched_equals_trl(case, batch, lp, groups, cfg, proximal)


def _micro_batched_equals_trl(case, batch, lp, groups, cfg, proximal):
  """The loss and gradient of 3 micro-batches equal TRL's whole batch's; their metrics."""
  (value, metrics), grad = micro_batched_loss_and_grad(
      {"logp": lp["logp"]}, None, batch, {"logp": lp["ref_logp"]}, num_groups=groups, cfg=cfg,
      micro_batches=3, proximal=proximal)
  np.testing.assert_allclose(value, case["loss"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad["logp"], np.asarray(case["grad_logp"], np.float32),
                             rtol=1e-5, atol=1e-6)
  return metrics


def test_overlong_buffer_advantages_equal_trls_punishment_reward():
  """loss.overlong_buffer counts from loss.budget as TRL's soft_punish_cache from
  max_completion_length (Dr. GRPO advantages: no eps to differ by)."""
  case = next(c for c in DATA["cases"] if c.get("overlong")
              and c["config"]["scale_rewards"] == "none")
  batch, _, groups = _batch(case["batch"])
  cfg = LossConfig(advantage="dr_grpo", overlong_buffer=case["overlong"]["soft_punish_cache"],
                   budget=case["overlong"]["max_completion_len"])
  adv, _ = group_advantages(batch, groups, cfg)
  np.testing.assert_allclose(adv, case["advantages"], rtol=1e-5, atol=1e-6)


def test_micro_batched_off_policy_mask_equals_trls_whole_batch():
  """Each slice masks its own sequences: the slices' loss, gradient and masked share are the
  whole batch's (the advantages the trainer's, with TRL's eps)."""
  case, batch, lp, groups, cfg, proximal, _ = _inputs("b3x4", *OFF_POLICY_WIRING[0])
  cfg = dataclasses.replace(cfg, std_eps=1e-4)
  metrics = _micro_batched_equals_trl(case, batch, lp, groups, cfg, proximal)
  _, whole = rl_loss({"logp": lp["logp"]}, None, batch, None, num_groups=groups, cfg=cfg,
                     proximal=proximal)
  assert 0 < float(whole["off_policy_masked_frac"]) < 1
  np.testing.assert_allclose(metrics["off_policy_masked_frac"], whole["off_policy_masked_frac"],
                             rtol=1e-6)


def _gdpo_inputs(case):
  """The case's batch carrying its two reward functions as the batch's reward parts, and the
  loss settings that weigh them as TRL's reward_weights."""
  batch, lp, groups = _batch(case["batch"])
  parts = np.stack([np.asarray(batch["rewards"]).reshape(-1),
                    np.asarray(case["second_reward"], np.float32)], axis=1)
  batch["reward_parts"] = jnp.asarray(parts.reshape(groups, -1, 2))
  batch["behaviour_logp"] = lp["old_logp"].reshape(batch["behaviour_logp"].shape)
  w = case["config"]["reward_weights"]
  cfg = LossConfig(reward_aggregation="normalize_then_sum", std_eps=1e-4, clip_high=0.2,
                   reward_parts=(("task", w[0]), ("second", w[1])))
  return batch, lp, groups, cfg


@pytest.mark.parametrize("case", [c for c in DATA["cases"] if c.get("second_reward")
                                  and c["config"].get("multi_objective_aggregation")],
                         ids=lambda c: f"{c['batch']}-{c['config']['reward_weights']}")
def test_normalize_then_sum_equals_trls_advantages_and_loss(case):
  """loss.reward_aggregation="normalize_then_sum" on the batch's reward parts: TRL's GDPO
  advantages, and its loss and gradient (dapo, old log-probs the workers')."""
  batch, lp, groups, cfg = _gdpo_inputs(case)
  adv, _ = group_advantages(batch, groups, cfg)
  np.testing.assert_allclose(adv, case["advantages"], rtol=1e-5, atol=1e-6)
  loss = lambda p: rl_loss(p, None, batch, None, num_groups=groups, cfg=cfg)
  (value, _), grad = jax.value_and_grad(loss, has_aux=True)({"logp": lp["logp"]})
  np.testing.assert_allclose(value, case["loss"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad["logp"], np.asarray(case["grad_logp"], np.float32),
                             rtol=1e-5, atol=1e-6)


def test_reward_model_weighs_one_in_a_group_without_task_part():
  """As the worker sums them: a group of task reward_model (no task part) adds its reward
  model score x 1, the others x worker.reward_model_weight."""
  parts = np.asarray([[[1.0, 2.0], [0.0, 4.0]], [[np.nan, 2.0], [np.nan, 4.0]]], np.float32)
  batch = {"reward_parts": jnp.asarray(parts), "response_tokens": jnp.ones((2, 2, 3), jnp.int32)}
  cfg = LossConfig(reward_aggregation="normalize_then_sum",
                   reward_parts=(("task", 1.0), ("reward_model", 0.25)))
  _, weights = rl_loss_lib.reward_parts(batch, cfg)
  np.testing.assert_array_equal(weights, [[1.0, 0.25]] * 2 + [[1.0, 1.0]] * 2)


def test_normalize_then_sum_counts_the_overlong_punishment_as_a_part():
  """loss.overlong_buffer with normalize_then_sum: the punishment normalised apart, as TRL's
  soft overlong punishment reward function is."""
  case = next(c for c in DATA["cases"] if c.get("overlong")
              and c["config"].get("multi_objective_aggregation") == "normalize_then_sum")
  batch, _, groups = _batch(case["batch"])
  batch["reward_parts"] = batch["rewards"][..., None]
  cfg = LossConfig(reward_aggregation="normalize_then_sum", std_eps=1e-4,
                   reward_parts=(("task", 1.0),),
                   overlong_buffer=case["overlong"]["soft_punish_cache"],
                   budget=case["overlong"]["max_completion_len"])
  adv, _ = group_advantages(batch, groups, cfg)
  np.testing.assert_allclose(adv, case["advantages"], rtol=1e-5, atol=1e-6)
