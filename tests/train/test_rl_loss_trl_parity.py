"""The trainer's objective (`rl_loss` as `LossConfig` wires it, whole or micro-batched)
against Hugging Face TRL's GRPOTrainer on the same log-probs (tests/fixtures/trl_losses.json;
see tests/algorithms/test_trl_parity.py for the function-level map). The model forward is
replaced by the fixture's log-probs, so this checks the wiring: which log-probs anchor the
ratio, which weights and masks, which aggregation and normaliser, the KL term."""

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
@pytest.mark.parametrize("wiring", WIRING, ids=_ids)
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
  (value, _), grad = micro_batched_loss_and_grad(
      {"logp": lp["logp"]}, None, batch, {"logp": lp["ref_logp"]}, num_groups=groups, cfg=cfg,
      micro_batches=3, proximal=proximal)
  np.testing.assert_allclose(value, case["loss"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad["logp"], np.asarray(case["grad_logp"], np.float32),
                             rtol=1e-5, atol=1e-6)


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
