"""The objective features set in the config: loss.mask_truncated (no loss on responses cut
at the budget), loss.top_entropy_quantile (policy loss on the batch's high-entropy tokens
alone) and loss.entropy_coef (an entropy bonus, fixed or adapted each step:
loss.adaptive_entropy): against Hugging Face TRL's GRPOTrainer on its own numbers
(tests/fixtures/trl_losses.json, trl_adaptive_entropy.json) and verl's formula, whole or
micro-batched, with the bonus's gradient through the packed model; the selection with
decoupled PPO and M2PO (their token weights) against plain-jnp references; bad values are
refused naming the field."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from algorithms.corrections import decoupled_ppo_loss, m2po_loss, m2po_mask
from rl_testlib import rl_config
from rlax_ps.kernels import pack_group, packed_response_logprobs
from rlax_ps.kernels.schedule import BlockSizes
from rlax_ps.models import ModelConfig, Transformer
from rlax_ps.train import rl_loss as rl_loss_lib
from rlax_ps.train.rl_checks import check_rl_config
from rlax_ps.train.rl_loss import (LossConfig, group_advantages, micro_batched_loss_and_grad,
                                   rl_loss)

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "trl_losses.json")
with open(FIXTURE) as _f:
  DATA = json.load(_f)
EOS = 1  # the fixture's eos id: it ends every sample but the truncated ones
# TRL's eps and its default clip (epsilon 0.2, epsilon_high unset: 0.2) as our fields
TRL = dict(std_eps=1e-4, clip_high=0.2, stop_ids=(EOS,))
# b2x5: two samples cut at the budget, one stopped there. b3x4 (its own shapes: op-by-op
# compiles, ~3 s) adds a group of equal rewards.
BATCHES = ["b2x5", pytest.param("b3x4", marks=pytest.mark.slow)]


def _find(batch, **cfg):
  return next(c for c in DATA["feature_cases"] if c["batch"] == batch and c["config"] == cfg)


def _trl_batch(name, truncated=()):
  """The fixture's batch as the trainer packs it (one row per group), its samples ending on
  eos but the `truncated` ones; the policy ({"logp", "entropy"} [rows * N, R]) as params."""
  b = DATA["batches"][name]
  g, n = b["groups"], b["n"]
  f = lambda k: np.asarray(b[k], np.float32)  # noqa: E731
  t = f("mask").shape[-1]
  lens = np.asarray(b["lens"], np.int32)
  tokens = np.full((g * n, t), 5, np.int32)
  for i, k in enumerate(lens):
    tokens[i, k - 1] = 5 if i in truncated else EOS
  batch = {"rewards": f("rewards").reshape(g, n), "sample_mask": np.ones((g, n), np.float32),
           "row_group": np.arange(g, dtype=np.int32), "row_ids": np.arange(g, dtype=np.int32),
           "response_lens": lens.reshape(g, n), "response_tokens": tokens.reshape(g, n, t),
           "behaviour_logp": f("old_logp").reshape(g, n, t)}  # correction none: TRL's `old`
  policy = {"logp": f("logp"), "entropy": np.asarray(DATA["entropies"][name], np.float32)}
  return ({k: jnp.asarray(v) for k, v in batch.items()},
          {k: jnp.asarray(v) for k, v in policy.items()}, g)


@pytest.fixture
def fixture_policy(monkeypatch):
  """The policy is its per-token log-probs and entropies: the batch's rows of them."""
  def response_logprobs(params, graphdef, batch, backend="auto", *, with_stats=False, **_):
    rows = batch["row_group"].shape[0]
    n, r = batch["response_tokens"].shape[1:]
    pick = lambda x: x.reshape(-1, n, r)[batch["row_ids"]].reshape(rows * n, r)  # noqa: E731
    logp = pick(params["logp"])
    return (logp, {"entropy": pick(params["entropy"])}) if with_stats else logp
  monkeypatch.setattr(rl_loss_lib, "response_logprobs", response_logprobs)


def _loss_and_grad(batch, policy, groups, cfg):
  loss = lambda p: rl_loss(p, None, batch, None, num_groups=groups, cfg=cfg)  # noqa: E731
  (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(policy)
  return value, metrics, grad


def _assert_trls(case, value, grad):
  np.testing.assert_allclose(value, case["loss"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad["logp"], np.asarray(case["grad_logp"], np.float32),
                             rtol=1e-5, atol=1e-6)
  if "grad_entropy" in case:
    np.testing.assert_allclose(grad["entropy"], np.asarray(case["grad_entropy"], np.float32),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.usefixtures("fixture_policy")
@pytest.mark.parametrize("name", BATCHES)
def test_truncated_samples_get_no_loss_and_keep_their_groups_statistics_as_in_trl(name):
  """One sample of each batch reaches the budget ending on eos: stopped, trained on (with no
  stop ids known, every sample at the budget counts as cut)."""
  case = _find(name, loss_type="dapo", mask_truncated_completions=True, use_vllm=False)
  batch, policy, groups = _trl_batch(name, case["truncated"])
  cfg = LossConfig(mask_truncated=True, **TRL)
  adv, mask = group_advantages(batch, groups, cfg)
  np.testing.assert_allclose(adv, case["advantages"], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.flatnonzero(np.asarray(mask) == 0), case["truncated"])
  lens = np.asarray(DATA["batches"][name]["lens"])
  _, by_length = group_advantages(batch, groups, dataclasses.replace(cfg, stop_ids=()))
  np.testing.assert_array_equal(by_length, lens < lens.max())
  value, _, grad = _loss_and_grad(batch, policy, groups, cfg)
  _assert_trls(case, value, grad)


TOP_ENTROPY = [("dapo", "token-mean", False), ("grpo", "seq-mean-token-mean", False),
               ("dapo", "token-mean", True)]


@pytest.mark.usefixtures("fixture_policy")
@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("loss_type,agg,truncated", TOP_ENTROPY,
                         ids=["dapo", "grpo", "dapo-mask-truncated"])
def test_the_top_entropy_tokens_alone_get_policy_loss_as_in_trl(name, loss_type, agg,
                                                                truncated):
  """The others weigh 0 and still count in the mean; with truncated samples masked, the
  quantile is over the others' tokens."""
  trl_cfg = dict(loss_type=loss_type, top_entropy_quantile=0.2, use_vllm=False)
  if truncated:
    trl_cfg = dict(loss_type=loss_type, mask_truncated_completions=True,
                   top_entropy_quantile=0.2, use_vllm=False)
  case = _find(name, **trl_cfg)
  batch, policy, groups = _trl_batch(name, case.get("truncated", ()))
  cfg = LossConfig(top_entropy_quantile=0.2, agg=agg, mask_truncated=truncated, **TRL)
  value, metrics, grad = _loss_and_grad(batch, policy, groups, cfg)
  _assert_trls(case, value, grad)
  valid = np.asarray(DATA["batches"][name]["mask"]) > 0
  valid[case.get("truncated", [])] = False
  ent = np.asarray(policy["entropy"])
  trained = valid & (ent >= np.quantile(ent[valid], 0.8))
  np.testing.assert_allclose(metrics["trained_token_frac"], trained.sum() / valid.sum(),
                             rtol=1e-6)


def _verl_agg(loss_mat, mask, mode):
  """verl's core_algos.agg_loss, in numpy."""
  if mode == "token-mean":
    return (loss_mat * mask).sum() / mask.sum()
  return ((loss_mat * mask).sum(-1) / mask.sum(-1)).mean()  # seq-mean-token-mean


@pytest.mark.usefixtures("fixture_policy")
@pytest.mark.parametrize("name", BATCHES)
def test_the_entropy_bonus_is_trls_and_verls_with_its_gradient(name):
  """verl: policy_loss = pg_loss - entropy_coeff * agg_loss(entropy, response_mask, mode)."""
  case = _find(name, loss_type="dapo", entropy_coef=0.05, use_vllm=False)
  batch, policy, groups = _trl_batch(name)
  value, metrics, grad = _loss_and_grad(batch, policy, groups,
                                        LossConfig(entropy_coef=0.05, **TRL))
  _assert_trls(case, value, grad)
  mask = np.asarray(DATA["batches"][name]["mask"], np.float32)
  ent = np.asarray(policy["entropy"])
  np.testing.assert_allclose(metrics["entropy"], _verl_agg(ent, mask, "token-mean"), rtol=1e-6)
  cfg = LossConfig(agg="seq-mean-token-mean", **TRL)
  off, _, _ = _loss_and_grad(batch, policy, groups, cfg)
  on, _, grad = _loss_and_grad(batch, policy, groups, LossConfig(
      agg="seq-mean-token-mean", entropy_coef=0.3, **TRL))
  np.testing.assert_allclose(on, off - 0.3 * _verl_agg(ent, mask, "seq-mean-token-mean"),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad["entropy"], -0.3 * mask / mask.sum(-1, keepdims=True)
                             / len(mask), rtol=1e-5)


@pytest.mark.usefixtures("fixture_policy")
def test_micro_batches_select_the_whole_batchs_high_entropy_tokens():
  """Two slices of one row: each row's own top 20% are not the batch's, so the loss,
  gradient and metrics are the whole batch's only if the quantile is."""
  case = _find("b2x5", loss_type="dapo", mask_truncated_completions=True,
               top_entropy_quantile=0.2, use_vllm=False)
  batch, policy, groups = _trl_batch("b2x5", case["truncated"])
  cfg = LossConfig(top_entropy_quantile=0.2, mask_truncated=True, entropy_coef=0.05,
                   correction="tis", **TRL)
  proximal = policy["logp"] - 0.1
  (loss, metrics), grads = jax.value_and_grad(
      lambda p: rl_loss(p, None, batch, None, num_groups=groups, cfg=cfg, proximal=proximal),
      has_aux=True)(policy)
  (m_loss, m_metrics), m_grads = micro_batched_loss_and_grad(
      policy, None, batch, None, num_groups=groups, cfg=cfg, micro_batches=2,
      proximal=proximal)
  np.testing.assert_allclose(m_loss, loss, rtol=1e-5, atol=1e-7)
  for k in grads:
    np.testing.assert_allclose(m_grads[k], grads[k], rtol=1e-4, atol=1e-7, err_msg=k)
  assert set(m_metrics) == set(metrics)
  for k in sorted(metrics):
    np.testing.assert_allclose(m_metrics[k], metrics[k], rtol=1e-4, atol=1e-6, err_msg=k)


# Two sequences (the second padded): PPO clips some ratios pi/pi_prox, the behaviour cap
# (2) some weights pi_prox/pi_behav. Weights 0/1: the selection. M2PO masks the first
# token by the second moment over all 7 real tokens; over the 4 selected ones alone it
# would mask the second row's third too.
_LOGP = np.log(np.float32([[0.5, 0.2, 0.9, 0.4], [0.3, 0.6, 0.7, 0.1]]))
_PROX = _LOGP - np.float32([[0.3, -0.1, 0.05, -0.4], [0.0, 0.2, -0.25, 0.0]])
_BEHAV = _PROX - np.float32([[1.0, -0.2, 0.1, 0.0], [0.05, 0.05, -0.35, 3.0]])
_ADV = np.float32([[1.0, -2.0, 0.5, 1.5], [-1.0, 2.0, -0.5, 1.0]])
_MASK = np.float32([[1, 1, 1, 1], [1, 1, 1, 0]])
_SELECTED = np.float32([[1, 0, 1, 0], [0, 1, 1, 0]])
_CORRECTED = {
    "decoupled": lambda logp, **kw: decoupled_ppo_loss(logp, _PROX, _BEHAV, _ADV, _MASK,
                                                       behaviour_cap=2.0, **kw)[0],
    "m2po": lambda logp, **kw: m2po_loss(logp, _PROX, _BEHAV, _ADV, _MASK, threshold=0.04,
                                         **kw)[0]}


@functools.partial(jax.jit, static_argnames=("correction", "agg"))
def _corrected(weights, correction, agg="token-mean"):
  """(loss, d loss / d logp) of the correction's loss at _LOGP; weights None: not passed."""
  kw = {} if weights is None else {"token_weights": weights}
  return jax.value_and_grad(lambda x: _CORRECTED[correction](x, agg=agg, **kw))(_LOGP)


@functools.partial(jax.jit, static_argnames=("correction", "agg"))
def _reference(weights, correction, agg):
  """`_corrected` in plain jnp, each token's loss times its weight: decoupled PPO's clipped
  ratio times the capped behaviour weight, M2PO's unclipped ratio on the tokens its mask
  (over every real token) keeps; every real token counts in the denominators."""
  def loss(logp):
    ratio = jnp.exp(logp - _PROX)
    if correction == "m2po":
      per_token = -ratio * _ADV * m2po_mask(_PROX, _BEHAV, _MASK, threshold=0.04)
    else:
      per_token = (jnp.maximum(-_ADV * ratio, -_ADV * jnp.clip(ratio, 0.8, 1.2))
                   * jnp.minimum(jnp.exp(_PROX - _BEHAV), 2.0))
    per_token = per_token * weights * _MASK
    if agg == "token-mean":
      return jnp.sum(per_token) / jnp.sum(_MASK)
    return jnp.mean(jnp.sum(per_token, -1) / jnp.sum(_MASK, -1))
  return jax.value_and_grad(loss)(_LOGP)


@pytest.mark.parametrize("correction", ["decoupled", "m2po"])
def test_the_corrections_take_token_weights_of_one_as_none(correction):
  value, grad = _corrected(np.ones_like(_LOGP), correction)
  today, today_grad = _corrected(None, correction)
  np.testing.assert_allclose(value, today, rtol=1e-6)
  np.testing.assert_allclose(grad, today_grad, rtol=1e-6)


@pytest.mark.parametrize("correction", ["decoupled", "m2po"])
def test_the_corrections_refuse_token_weights_of_another_shape(correction):
  with pytest.raises(ValueError, match=r"token_weights: expected shape \(2, 4\) like logp, "
                                       r"got \(2, 3\)"):
    _CORRECTED[correction](_LOGP, token_weights=np.ones((2, 3), np.float32))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("correction", ["decoupled", "m2po"])
def test_the_corrections_weigh_unselected_tokens_0_and_still_count_them(correction, agg):
  """As `algorithms.losses`: the weighted loss is the one with the unselected tokens'
  per-token loss set to 0, over the same denominators; their log-probs get no gradient."""
  unselected = (_MASK > 0) & (_SELECTED == 0)
  _, unweighted = _corrected(None, correction, agg)
  assert bool(jnp.all(unweighted[unselected] != 0))  # each would train without the weights
  value, grad = _corrected(_SELECTED, correction, agg)
  want, want_grad = _reference(_SELECTED, correction, agg)
  np.testing.assert_allclose(value, want, rtol=1e-6)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
  np.testing.assert_array_equal(grad[unselected], 0.0)


@pytest.mark.usefixtures("fixture_policy")
@pytest.mark.parametrize("correction", ["decoupled", "m2po"])
def test_the_top_entropy_tokens_alone_get_policy_loss_with_every_correction(correction):
  """Through `rl_loss`: pi/pi_prox = e^0.1 (unclipped), so each token's loss is -A * its
  ratio times decoupled PPO's behaviour weight or M2PO's mask (over all tokens), and
  only the batch's top 20% by entropy keep it, over every real token's count."""
  batch, policy, groups = _trl_batch("b2x5")
  cfg = LossConfig(top_entropy_quantile=0.2, correction=correction, **TRL)
  proximal = policy["logp"] - 0.1
  (value, metrics), grad = jax.jit(jax.value_and_grad(
      lambda p: rl_loss(p, None, batch, None, num_groups=groups, cfg=cfg, proximal=proximal),
      has_aux=True))(policy)
  adv, _ = group_advantages(batch, groups, cfg)
  mask = np.asarray(DATA["batches"]["b2x5"]["mask"], np.float32)
  ent = np.asarray(policy["entropy"])
  behaviour = np.asarray(batch["behaviour_logp"]).reshape(mask.shape)
  selected = (mask > 0) & (ent >= np.quantile(ent[mask > 0], 0.8))
  if correction == "m2po":
    weight = np.asarray(jax.jit(functools.partial(m2po_mask, threshold=cfg.m2po_threshold))(
        proximal, behaviour, mask))
  else:
    weight = np.minimum(np.exp(np.asarray(proximal) - behaviour), cfg.behaviour_cap)
  d_logp = -np.asarray(adv)[:, None] * np.exp(0.1) * weight * selected * mask / mask.sum()
  np.testing.assert_allclose(value, d_logp.sum(), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grad["logp"], d_logp, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics["trained_token_frac"], selected.sum() / mask.sum(),
                             rtol=1e-6)


V, P, R = 24, 4, 3


# Compiles of a model's gradient (~3 s each): the trainer's path (XLA attention, chunked
# logits recomputed in the backward pass) and the Pallas kernel's (interpreted on CPU).
@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(backend="xla", logits_chunk=2),
                                dict(backend="pallas_tpu", interpret=True,
                                     block_sizes=BlockSizes(8, 8))], ids=["xla", "pallas"])
def test_the_entropy_bonus_takes_its_gradient_through_the_packed_model(kw):
  """d/dparams of the packed path's token-mean entropy equals that of each sample's own
  forward pass: the bonus trains the policy whichever attention backend runs."""
  cfg = ModelConfig(vocab_size=V, hidden_size=8, intermediate_size=16, num_layers=1,
                    num_heads=2, num_kv_heads=1, max_position_embeddings=16)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  prompt = rng.integers(2, V, (1, P)).astype(np.int32)
  responses = rng.integers(2, V, (1, 2, R)).astype(np.int32)
  lens = np.asarray([[R, 2]], np.int32)
  mask = (np.arange(R)[None] < lens[0][:, None]).astype(np.float32)

  def packed(st):
    tokens, layout = pack_group(prompt, np.asarray([P]), responses, lens)
    _, ent = packed_response_logprobs(nnx.merge(graphdef, st), tokens, responses, layout,
                                      with_entropy=True, **kw)
    return jnp.sum(ent[0] * mask) / mask.sum()

  def separate(st):
    rows = jnp.asarray(np.concatenate([np.repeat(prompt, 2, 0), responses[0]], 1))
    logits = nnx.merge(graphdef, st)(rows)[:, P - 1:P - 1 + R]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return jnp.sum(-jnp.sum(jnp.exp(logp) * logp, -1) * mask) / mask.sum()

  want = jax.jit(jax.grad(separate))(state)
  got = jax.jit(jax.grad(packed))(state)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(got)) > 1e-4
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_the_config_keeps_todays_objective_unless_the_features_are_set():
  cfg = check_rl_config(rl_config(), files=False)
  assert (cfg.mask_truncated, cfg.top_entropy_quantile, cfg.entropy_coef) == (False, 1.0, 0.0)
  config = rl_config()
  config.loss.mask_truncated, config.loss.top_entropy_quantile = True, 0.2
  config.loss.entropy_coef = 0.01
  cfg = check_rl_config(config, files=False)
  assert (cfg.mask_truncated, cfg.top_entropy_quantile, cfg.entropy_coef) == (True, 0.2, 0.01)


@pytest.mark.parametrize("correction", ["none", "tis", "mis", "decoupled", "m2po"])
def test_the_top_entropy_selection_is_accepted_with_every_correction(correction):
  cfg = LossConfig(top_entropy_quantile=0.2, correction=correction)
  assert (cfg.top_entropy_quantile, cfg.correction) == (0.2, correction)


@pytest.mark.parametrize("fields, message", [
    ({"mask_truncated": 1}, r"loss.mask_truncated: expected True or False, got 1"),
    ({"top_entropy_quantile": 0.0},
     r"loss.top_entropy_quantile: expected a share in \(0, 1\] \(1.0: every token\), got 0.0"),
    ({"top_entropy_quantile": 1.5}, r"loss.top_entropy_quantile: expected a share in \(0, 1\]"),
    ({"entropy_coef": -0.01}, r"loss.entropy_coef: expected a finite coefficient >= 0 \(0: "
                              r"off\), got -0.01"),
    ({"entropy_coef": float("inf")}, "loss.entropy_coef: expected a finite coefficient"),
    ({"adaptive_entropy": 1}, r"loss.adaptive_entropy: expected True or False, got 1"),
    ({"entropy_target": -0.5}, r"loss.entropy_target: expected a finite value >= 0, got -0.5"),
    ({"entropy_target": float("nan")}, r"loss.entropy_target: expected a finite value >= 0"),
    ({"entropy_coef_delta": 0.0}, r"loss.entropy_coef_delta: expected a finite value > 0"),
    ({"entropy_coef_min": -0.1}, r"loss.entropy_coef_min: expected a finite value >= 0"),
    ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1},
     r"loss.entropy_coef_max: expected a finite bound >= entropy_coef_min=0.5, got 0.1"),
    ({"adaptive_entropy": True, "entropy_coef": 0.5, "entropy_coef_max": 0.2},
     r"loss.entropy_coef: expected a starting coefficient in \[entropy_coef_min, "
     r"entropy_coef_max\] = \[0.0, 0.2\] with adaptive_entropy=True, got 0.5"),
])
def test_bad_feature_values_are_refused_naming_the_field(fields, message):
  with pytest.raises(ValueError, match=message):
    LossConfig(**fields)


with open(os.path.join(os.path.dirname(__file__), "..", "fixtures",
                       "trl_adaptive_entropy.json")) as _f:
  ADAPTIVE = json.load(_f)  # TRL's controller over 12 steps of b2x5 (its generator's docstring)


def _adaptive_cfg(**fields):
  trl = ADAPTIVE["config"]
  return LossConfig(adaptive_entropy=True, entropy_coef=trl["entropy_coef"],
                    entropy_target=trl["entropy_target"],
                    entropy_coef_delta=trl["entropy_coef_delta"],
                    entropy_coef_min=trl["entropy_coef_min"],
                    entropy_coef_max=trl["entropy_coef_max"], **TRL, **fields)


def test_the_adaptive_coefficient_moves_as_trls_after_each_step():
  """Up and down across the target, held at both bounds, up at the target itself; the bonus
  applies only after a step at or below the target (none before the first)."""
  cfg = _adaptive_cfg()
  coef, last, applied = cfg.entropy_coef, float("inf"), []
  for step in ADAPTIVE["steps"]:
    assert (coef, last) == (step["before"]["entropy_coef"], step["before"]["last_world_entropy"])
    applied.append(rl_loss_lib.entropy_bonus_coef(coef, last, cfg))
    coef, last = rl_loss_lib.adapt_entropy_coef(coef, step["entropy"], cfg), step["entropy"]
    assert coef == step["after"]["entropy_coef"] == step["logged_coef"]
  coefs = [s["after"]["entropy_coef"] for s in ADAPTIVE["steps"]]
  assert max(coefs) == cfg.entropy_coef_max and min(coefs) == cfg.entropy_coef_min
  assert applied[:2] == [0.0, 0.0] and 0.0 < applied[-1] == coefs[-2]  # last == target


@pytest.mark.usefixtures("fixture_policy")
def test_the_adaptive_coefficient_is_a_step_input_giving_trls_loss_at_each_step():
  """One compile for every coefficient; each step's loss and gradients are TRL's with the
  coefficient its controller applied, the fixed coefficient's, whole or micro-batched."""
  batch, policy, groups = _trl_batch(ADAPTIVE["batch"])
  cfg = _adaptive_cfg()

  @jax.jit
  def step(p, coef):
    loss = lambda p: rl_loss(p, None, batch, None, num_groups=groups, cfg=cfg,  # noqa: E731
                             entropy_coef=coef)
    return jax.value_and_grad(loss, has_aux=True)(p)

  for s in ADAPTIVE["steps"]:
    coef = rl_loss_lib.entropy_bonus_coef(s["before"]["entropy_coef"],
                                          s["before"]["last_world_entropy"], cfg)
    at = dict(policy, entropy=policy["entropy"] * s["scale"])
    (value, metrics), grad = step(at, jnp.float32(coef))
    np.testing.assert_allclose(value, s["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad["logp"], s["grad_logp"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad["entropy"], s["grad_entropy"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["entropy"], s["entropy"], rtol=1e-6)  # what it adapts on
  assert step._cache_size() == 1
  # A coefficient of 0.05 as input: TRL's fixed entropy_coef=0.05, as loss.entropy_coef=0.05
  # gives (test_the_entropy_bonus_is_trls_and_verls_with_its_gradient); micro-batched too.
  fixed = _find(ADAPTIVE["batch"], loss_type="dapo", entropy_coef=0.05, use_vllm=False)
  (value, _), grad = step(policy, jnp.float32(0.05))
  _assert_trls(fixed, value, grad)
  (m_value, _), m_grad = micro_batched_loss_and_grad(
      policy, None, batch, None, num_groups=groups, cfg=cfg, micro_batches=2,
      entropy_coef=jnp.float32(0.05))
  _assert_trls(fixed, m_value, m_grad)


def test_adaptive_entropy_is_refused_with_several_updates_a_batch():
  config = rl_config()
  config.loss.adaptive_entropy, config.rl.updates_per_batch = True, 2
  with pytest.raises(ValueError, match=r"rl.updates_per_batch: expected 1 with "
                                       r"loss.adaptive_entropy=True .*, got 2"):
    check_rl_config(config, files=False)
  config.rl.updates_per_batch = 1
  assert check_rl_config(config, files=False).adaptive_entropy
