"""Our advantages, losses and corrections against Hugging Face TRL's GRPOTrainer and
RLOOTrainer on the same inputs (tests/fixtures/trl_losses.json, written by TRL's own code
through tests/fixtures/make_trl_loss_fixtures.py; no torch here).

Settings map as follows (TRL -> ours):
- scale_rewards group / batch / none -> grpo_advantages std_scaling, eps=1e-4 (TRL's);
- loss_type grpo -> agg seq-mean-token-mean, bnpo and dapo (one process, one accumulation
  step) -> token-mean, dr_grpo -> seq-mean-token-sum-norm with norm_const =
  max_completion_length, cispo -> cispo_loss with clip_low=1, clip_high=epsilon_high - 1;
- epsilon / epsilon_high -> clip_low / clip_high, delta -> dual_clip;
- importance_sampling_level="sequence" -> gspo_loss;
- vLLM IS {token,sequence}_truncate -> truncated_importance_weights (cap = clip_max),
  {token,sequence}_mask -> masked_importance_weights (low = clip_min or 0, high = clip_max);
- beta (k3) -> kl_coef, kl_estimator="k3"; use_bias_correction_kl -> kl_bias_correction;
- off_policy_mask_threshold -> corrections.off_policy_sequence_mask (the sampler's log-probs
  against the current policy's) on the policy loss's token weights;
- multi_objective_aggregation normalize_then_sum with reward_weights -> gdpo_advantages.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from algorithms import advantages as adv_lib
from algorithms import corrections, losses, shaping

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trl_losses.json")
with open(FIXTURE) as _f:
  DATA = json.load(_f)
CASES = DATA["cases"]
AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
       "dr_grpo": "seq-mean-token-sum-norm", "cispo": "token-mean"}


def _arrays(name):
  b = DATA["batches"][name]
  arr = {k: jnp.asarray(np.asarray(b[k], np.float32))
         for k in ("mask", "logp", "old_logp", "behaviour_logp", "ref_logp")}
  arr["group_ids"] = jnp.repeat(jnp.arange(b["groups"]), b["n"])
  arr["groups"] = b["groups"]
  return arr


def _case_id(case):
  cfg = ",".join(f"{k}={v}" for k, v in sorted(case["config"].items()) if k != "use_vllm")
  return f"{case['trainer']}-{case['batch']}-{cfg}"


def _close(ours, theirs, rtol=1e-5, atol=1e-6):
  np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs, np.float32), rtol=rtol,
                             atol=atol)


def _rewards(case):
  r = np.asarray(case.get("rewards", DATA["batches"][case["batch"]]["rewards"]), np.float32)
  return jnp.asarray(np.nan_to_num(r)), jnp.asarray(~np.isnan(r), jnp.float32)


ADV_CASES = [c for c in CASES if c["trainer"] == "grpo" and not c.get("overlong")
             and "second_reward" not in c
             and ("rewards" in c or not c["config"].get("use_vllm", False))]


@pytest.mark.parametrize("case", ADV_CASES[::3] + [c for c in ADV_CASES if "rewards" in c],
                         ids=_case_id)
def test_grpo_advantages_equal_trl_with_its_eps(case):
  """TRL divides by (std + 1e-4); with that eps ours equal its advantages, an unscorable
  (NaN reward) sample being our masked sample: out of the baseline, advantage 0."""
  a = _arrays(case["batch"])
  rewards, mask = _rewards(case)
  scale = case["config"].get("scale_rewards", "group")
  ours = adv_lib.grpo_advantages(rewards, a["group_ids"], a["groups"], mask,
                                 std_scaling=scale, eps=1e-4)
  _close(ours, case["advantages"])


def test_grpo_advantages_default_eps_is_documented_not_trls():
  """Our default eps is 1e-6 (verl's), TRL's 1e-4: a relative difference of about 1e-4 / std."""
  case = next(c for c in CASES if c["trainer"] == "grpo" and c["batch"] == "b2x5"
              and c["config"].get("scale_rewards", "group") == "group")
  a = _arrays("b2x5")
  rewards, mask = _rewards(case)
  ours = adv_lib.grpo_advantages(rewards, a["group_ids"], a["groups"], mask)
  r = np.asarray(rewards).reshape(2, 5)
  expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
  _close(ours, expected.reshape(-1))
  theirs = np.asarray(case["advantages"])
  assert 0 < np.max(np.abs(np.asarray(ours) - theirs)) < 1e-3 * np.max(np.abs(theirs))


@pytest.mark.parametrize("case", [c for c in CASES if c["trainer"] == "rloo"], ids=_case_id)
def test_rloo_advantages_equal_trl(case):
  a = _arrays(case["batch"])
  rewards, mask = _rewards(case)
  _close(adv_lib.rloo_advantages(rewards, a["group_ids"], a["groups"], mask),
         case["advantages"])


@pytest.mark.parametrize("case", [c for c in CASES if c.get("overlong")
                                  and "multi_objective_aggregation" not in c["config"]],
                         ids=_case_id)
def test_overlong_punished_advantages_equal_trl(case):
  """DAPO's soft punishment added to the task reward before the group statistics, as TRL
  does with its `get_soft_overlong_punishment` as a second reward function."""
  a = _arrays(case["batch"])
  rewards, mask = _rewards(case)
  lens = jnp.asarray(DATA["batches"][case["batch"]]["lens"])
  o = case["overlong"]
  shaped = rewards + shaping.soft_overlong_punishment(lens, o["max_completion_len"],
                                                      o["soft_punish_cache"])
  ours = adv_lib.grpo_advantages(shaped, a["group_ids"], a["groups"], mask,
                                 std_scaling=case["config"]["scale_rewards"], eps=1e-4)
  _close(ours, case["advantages"])


def test_soft_overlong_punishment_equals_trl():
  o = DATA["overlong"]
  ours = shaping.soft_overlong_punishment(jnp.asarray(o["lengths"]), o["max_completion_len"],
                                          o["soft_punish_cache"])
  _close(ours, o["rewards"])


@pytest.mark.parametrize("case", [c for c in CASES if "second_reward" in c], ids=_case_id)
def test_two_reward_functions_advantages_equal_trl(case):
  """GDPO (normalize_then_sum): each reward function normalised in its group, weighted and
  summed, normalised over the batch; a NaN reward: that function does not apply. TRL's
  default sum_then_normalize: GRPO on the weighted sum (the workers' reward)."""
  a = _arrays(case["batch"])
  rewards, _ = _rewards(case)
  parts = jnp.stack([rewards, jnp.asarray(case["second_reward"], jnp.float32)], axis=1)
  weights = jnp.asarray(case["config"]["reward_weights"], jnp.float32)
  if case["config"].get("multi_objective_aggregation") == "normalize_then_sum":
    ours = adv_lib.gdpo_advantages(parts, weights, a["group_ids"], a["groups"], eps=1e-4)
  else:
    total = jnp.sum(jnp.nan_to_num(parts) * weights, axis=1)
    ours = adv_lib.grpo_advantages(total, a["group_ids"], a["groups"], eps=1e-4)
  _close(ours, case["advantages"])


def _our_loss(cfg, a, adv):
  """(loss function of logp, our importance weights or None) for one TRL config."""
  loss_type = cfg.get("loss_type", "dapo")
  eps = cfg.get("epsilon", 0.2)
  eps_high = cfg.get("epsilon_high") or eps
  beta = cfg.get("beta", 0.0)
  common = dict(agg=AGG[loss_type], norm_const=DATA["max_completion_length"],
                ref_logp=a["ref_logp"] if beta else None, kl_coef=beta, kl_estimator="k3",
                kl_bias_correction=_kl_bias_corrected(cfg))
  weights = None
  if cfg.get("use_vllm") and cfg.get("vllm_importance_sampling_correction", True):
    mode = cfg.get("vllm_importance_sampling_mode", "sequence_mask")
    level, kind = mode.split("_")
    cap = cfg.get("vllm_importance_sampling_clip_max", 3.0)
    if kind == "truncate":
      weights = corrections.truncated_importance_weights(
          a["old_logp"], a["behaviour_logp"], a["mask"], level=level, cap=cap)
    else:
      weights, _ = corrections.masked_importance_weights(
          a["old_logp"], a["behaviour_logp"], a["mask"], level=level,
          low=cfg.get("vllm_importance_sampling_clip_min") or 0.0, high=cap)
  token_weights = weights
  if cfg.get("off_policy_mask_threshold") is not None:
    kept, _ = corrections.off_policy_sequence_mask(a["logp"], a["behaviour_logp"], adv,
                                                   a["mask"],
                                                   threshold=cfg["off_policy_mask_threshold"])
    token_weights = kept if weights is None else weights * kept
  if loss_type == "cispo":
    fn = functools.partial(losses.cispo_loss, clip_low=1.0, clip_high=eps_high - 1.0)
  elif cfg.get("importance_sampling_level") == "sequence":
    fn = functools.partial(losses.gspo_loss, clip_low=eps, clip_high=eps_high)
  else:
    fn = functools.partial(losses.ppo_clip_loss, clip_low=eps, clip_high=eps_high,
                           dual_clip=cfg.get("delta"))

  def loss(logp):
    return fn(logp, a["old_logp"], adv, a["mask"], token_weights=token_weights, **common)
  return loss, weights


def _kl_bias_corrected(cfg):
  return cfg.get("beta", 0.0) > 0 and cfg.get("use_bias_correction_kl", True)  # TRL 1.16's default


LOSS_CASES = [c for c in CASES if c["trainer"] == "grpo" and "loss" in c]


@pytest.mark.parametrize("case", LOSS_CASES, ids=_case_id)
def test_loss_and_gradient_equal_trl(case):
  a = _arrays(case["batch"])
  adv = jnp.asarray(np.asarray(case["advantages"], np.float32))
  loss, weights = _our_loss(case["config"], a, adv)
  if weights is not None:
    _close(weights, np.asarray(case["is_ratio"]) * np.asarray(a["mask"]))
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(a["logp"])
  _close(value, case["loss"])
  _close(grad * a["mask"], case["grad_logp"])
  theirs = case["metrics"]
  if "clip_ratio/region_mean" in theirs:  # TRL's clip fractions: ratio past a bound, A's sign
    _close(metrics["clip_frac_low"], theirs["clip_ratio/low_mean"])
    _close(metrics["clip_frac_high"], theirs["clip_ratio/high_mean"])
    _close(metrics["clip_frac"], theirs["clip_ratio/region_mean"])


def _bias_twins():
  plain = {(c["batch"], c["config"]["loss_type"]): c for c in LOSS_CASES
           if c["config"].get("beta") and c["config"].get("use_bias_correction_kl") is False
           and not c["config"].get("use_vllm") and "importance_sampling_level" not in c["config"]
           and c["config"]["loss_type"] != "cispo"
           and "off_policy_mask_threshold" not in c["config"]}
  return [(c, plain[(c["batch"], c["config"]["loss_type"])]) for c in LOSS_CASES
          if _kl_bias_corrected(c["config"])]


@pytest.mark.parametrize("pair", _bias_twins(), ids=lambda p: _case_id(p[0]))
def test_kl_term_is_trls_without_bias_correction(pair):
  """TRL's use_bias_correction_kl=True multiplies the k3 term by pi/pi_old (DeepSeek V3.2):
  on these cases a change of the loss; ours without kl_bias_correction is TRL's value with
  the correction off (the GRPO paper's plain k3 term)."""
  corrected, plain = pair
  a = _arrays(corrected["batch"])
  loss, _ = _our_loss(dict(corrected["config"], use_bias_correction_kl=False), a,
                      jnp.asarray(corrected["advantages"]))
  value = float(loss(a["logp"])[0])
  _close(value, plain["loss"])
  assert abs(value - corrected["loss"]) > 1e-4


OFF_POLICY_CASES = [c for c in LOSS_CASES if "off_policy_mask_threshold" in c["config"]]


@pytest.mark.parametrize("case", OFF_POLICY_CASES[:1] + OFF_POLICY_CASES[8:9], ids=_case_id)
def test_off_policy_mask_drops_some_negative_sequences_and_binds(case):
  """On each batch the threshold drops some negative-advantage sequences and keeps others,
  and without the mask the loss is not TRL's."""
  a = _arrays(case["batch"])
  adv = jnp.asarray(case["advantages"], jnp.float32)
  threshold = case["config"]["off_policy_mask_threshold"]
  _, dropped = corrections.off_policy_sequence_mask(a["logp"], a["behaviour_logp"], adv,
                                                    a["mask"], threshold=threshold)
  assert 0 < int(jnp.sum(dropped)) < int(jnp.sum(adv < 0))
  plain = {k: v for k, v in case["config"].items() if k != "off_policy_mask_threshold"}
  loss, _ = _our_loss(plain, a, adv)
  assert abs(float(loss(a["logp"])[0]) - case["loss"]) > 1e-4
