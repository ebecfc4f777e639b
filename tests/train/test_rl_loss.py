"""The RL batch and objective against hand-computed cases: groups packed into rows
(unequal groups spanning rows), advantages over whole groups, and the loss and its
gradient equal to the same objective computed on separate unpacked sequences."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from algorithms import corrections
from rlax_ps.models import ModelConfig, Transformer
from rlax_ps.train.rl_loss import LossConfig, group_advantages, reference_logprobs, rl_loss
from rlax_ps.train.rollouts import (BatchShape, Group, build_batch, check_group, empty_batch,
                                   fit_response_len, response_lens, response_stats)

V = 40
SHAPE = BatchShape(groups=2, samples=4, prompt_len=6, response_len=5)
REWARDS = ([1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0, 1.0])


def _groups():
  rng = np.random.default_rng(0)
  out = []
  for gi, rewards in enumerate(REWARDS):
    k = len(rewards)
    responses = tuple(rng.integers(1, V, int(rng.integers(1, 6))).astype(np.int32)
                      for _ in range(k))
    out.append(Group(rollout_id=10 + gi, prompt_tokens=rng.integers(1, V, 3 + gi).astype(np.int32),
                     responses=responses,
                     behaviour_logp=tuple(rng.uniform(-4.0, -2.0, len(r)).astype(np.float32)
                                          for r in responses),
                     rewards=np.asarray(rewards, np.float32), policy_version=3))
  return out


GROUPS = _groups()
BATCH = build_batch(GROUPS, SHAPE)


def test_unequal_groups_fill_rows_with_their_prompt_and_group_index():
  # Group 0 (3 samples) fills one row; group 1 (5 samples) two; rows round up to 2 * 2.
  np.testing.assert_array_equal(BATCH["row_group"], [0, 1, 1, 0])
  np.testing.assert_array_equal(BATCH["sample_mask"], [[1, 1, 1, 0], [1, 1, 1, 1],
                                                       [1, 0, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(BATCH["prompt_lens"], [3, 4, 4, 1])
  np.testing.assert_array_equal(BATCH["prompt_tokens"][2, :4], GROUPS[1].prompt_tokens)
  fifth = GROUPS[1].responses[4]
  np.testing.assert_array_equal(BATCH["response_tokens"][2, 0, :len(fifth)], fifth)
  np.testing.assert_array_equal(BATCH["behaviour_logp"][2, 0, :len(fifth)],
                                GROUPS[1].behaviour_logp[4])
  np.testing.assert_array_equal(BATCH["rewards"][1], [1, 1, 0, 0])
  assert BATCH["rewards"][2, 0] == 1.0


def test_grpo_advantages_are_taken_over_the_whole_group_across_rows():
  adv, mask = group_advantages({k: jnp.asarray(v) for k, v in BATCH.items()}, 2,
                               LossConfig(advantage="grpo"))
  adv = np.asarray(adv).reshape(4, 4)
  # Group 0: mean 1/3, unbiased std sqrt(1/3). Group 1: mean 0.6, unbiased std sqrt(0.3).
  s0, s1 = np.sqrt(1 / 3), np.sqrt(0.3)
  np.testing.assert_allclose(adv[0, :3], [(2 / 3) / s0, -(1 / 3) / s0, -(1 / 3) / s0], rtol=1e-5)
  np.testing.assert_allclose(adv[1], [0.4 / s1, 0.4 / s1, -0.6 / s1, -0.6 / s1], rtol=1e-5)
  np.testing.assert_allclose(adv[2, 0], 0.4 / s1, rtol=1e-5)
  assert np.all(adv[3] == 0) and adv[0, 3] == 0 and np.all(adv[2, 1:] == 0)
  np.testing.assert_array_equal(np.asarray(mask).reshape(4, 4), BATCH["sample_mask"])


def test_dr_grpo_and_rloo_use_their_own_baselines():
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  dr = np.asarray(group_advantages(batch, 2, LossConfig(advantage="dr_grpo"))[0]).reshape(4, 4)
  np.testing.assert_allclose(dr[1], [0.4, 0.4, -0.6, -0.6], rtol=1e-6)
  # GPG: both groups' rewards vary, so nothing is scaled: Dr. GRPO's advantages.
  gpg = np.asarray(group_advantages(batch, 2, LossConfig(advantage="gpg"))[0]).reshape(4, 4)
  np.testing.assert_allclose(gpg, dr, rtol=1e-6, atol=1e-7)
  rloo = np.asarray(group_advantages(batch, 2, LossConfig(advantage="rloo"))[0]).reshape(4, 4)
  np.testing.assert_allclose(rloo[0, :3], [1.0, -0.5, -0.5], rtol=1e-6)  # r - mean(others)
  # OPO: each group's length-weighted mean reward as baseline, from the samples' own lengths.
  opo = np.asarray(group_advantages(batch, 2, LossConfig(advantage="opo"))[0]).reshape(4, 4)
  for g, at in ((GROUPS[0], [(0, 0), (0, 1), (0, 2)]),
                (GROUPS[1], [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)])):
    lens = np.asarray([len(r) for r in g.responses], np.float64)
    want = g.rewards - np.sum(lens * g.rewards) / np.sum(lens)
    np.testing.assert_allclose([opo[i, j] for i, j in at], want, rtol=1e-5, atol=1e-6)
  # ... of the tokens trained: an environment's reply (policy_tokens 0) weighs nothing.
  replied = dict(batch, policy_tokens=batch["policy_tokens"].at[0, 0, :1].set(0.0))
  opo = np.asarray(group_advantages(replied, 2, LossConfig(advantage="opo"))[0]).reshape(4, 4)
  lens = np.asarray([len(r) for r in GROUPS[0].responses], np.float64) - [1, 0, 0]
  want = GROUPS[0].rewards - np.sum(lens * GROUPS[0].rewards) / np.sum(lens)
  np.testing.assert_allclose(opo[0, :3], want, rtol=1e-5, atol=1e-6)
  # pass@k: group 0's single best sample (1 over 0) alone, over the group's std; group 1's
  # best reward is tied three ways: nothing to learn.
  passk = np.asarray(group_advantages(batch, 2, LossConfig(advantage="passk"))[0]).reshape(4, 4)
  want = np.zeros((4, 4))
  want[0, 0] = 1.0 / (np.sqrt(1 / 3) + 1e-6)
  np.testing.assert_allclose(passk, want, rtol=1e-5)


def test_remax_takes_each_samples_reward_less_its_groups_greedy_reward():
  groups = [dataclasses.replace(g, baseline_reward=b) for g, b in zip(GROUPS, (0.5, 1.0))]
  batch = build_batch(groups, dataclasses.replace(SHAPE, baselines=True))
  np.testing.assert_array_equal(batch["baselines"] * batch["sample_mask"],
                                [[0.5, 0.5, 0.5, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  adv, mask = group_advantages(batch, 2, LossConfig(advantage="remax"))
  # Group 0 (rewards 1, 0, 0) against 0.5; group 1 (1, 1, 0, 0, 1) against 1; no std.
  np.testing.assert_allclose(np.asarray(adv).reshape(4, 4),
                             [[0.5, -0.5, -0.5, 0], [0, 0, -1, -1], [0, 0, 0, 0], [0] * 4])
  np.testing.assert_array_equal(np.asarray(mask).reshape(4, 4), BATCH["sample_mask"])
  del batch["baselines"]
  with pytest.raises(ValueError, match="'remax' needs each group's greedy sample's reward"):
    group_advantages(batch, 2, LossConfig(advantage="remax"))
  with pytest.raises(ValueError, match="rollout 10: baseline_reward: expected a finite number"):
    build_batch(GROUPS, dataclasses.replace(SHAPE, baselines=True))
  with pytest.raises(ValueError, match="loss.scale_rewards: expected unset with "
                                       "advantage='remax'"):
    LossConfig(advantage="remax", scale_rewards="group")
  # The greedy baseline's length never reaches the trainer: DAPO's length punishment would
  # fall on the samples alone (one equal to the greedy answer got -1, not verl's 0).
  with pytest.raises(ValueError, match="loss.overlong_buffer: expected 0 with "
                                       "advantage='remax'"):
    LossConfig(advantage="remax", overlong_buffer=4)
  with pytest.raises(ValueError, match="loss.policy_loss: expected 'ppo', 'cispo' or 'kl_cov' "
                                       "with advantage='remax' and kl_in_reward"):
    LossConfig(advantage="remax", kl_in_reward=0.1, policy_loss="gspo")


def test_remax_with_a_kl_in_the_reward_gives_each_token_its_return_less_the_baseline():
  """verl's compute_remax_outcome_advantage: token t's advantage is the sum of the token
  rewards from t on (the score on the last token, -beta * KL on each) less the baseline;
  every token had the score less the whole KL and the baseline."""
  beta, r = 0.5, 4
  behaviour = np.array([[[-1.0] * 4, [-1.0, -1.0, 0.0, 0.0]]], np.float32)
  batch = {"rewards": np.array([[1.0, 0.0]], np.float32),
           "baselines": np.full((1, 2), 0.5, np.float32),
           "sample_mask": np.ones((1, 2), np.float32), "row_group": np.zeros((1,), np.int32),
           "response_lens": np.array([[4, 2]], np.int32),
           "response_tokens": np.ones((1, 2, r), np.int32),
           "prompt_tokens": np.ones((1, 3), np.int32), "prompt_lens": np.full((1,), 3, np.int32),
           "behaviour_logp": behaviour, "policy_tokens": np.ones((1, 2, r), np.float32)}
  cfg = LossConfig(advantage="remax", kl_in_reward=beta, kl_estimator="k1", budget=r)
  adv, _ = group_advantages({k: jnp.asarray(v) for k, v in batch.items()}, 1, cfg,
                            ref_logp=jnp.full((2, r), -2.0))  # a KL of 1 on each token
  # Sample 0: score 1 at token 3, -0.5 on each of 4 tokens; sample 1: 2 tokens, score 0.
  np.testing.assert_allclose(np.asarray(adv), [[1 - 2.0 - 0.5, 1 - 1.5 - 0.5, 1 - 1.0 - 0.5,
                                                1 - 0.5 - 0.5],
                                               [-1.0 - 0.5, -0.5 - 0.5, 0, 0]], atol=1e-6)


def _model():
  cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, max_position_embeddings=32)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  return graphdef, state.to_pure_dict()


def _separate_rows():
  """Each sample as its own right-padded [prompt, response] row, and where its tokens sit."""
  rows = [(g.prompt_tokens, resp) for g in GROUPS for resp in g.responses]
  length = SHAPE.prompt_len + SHAPE.response_len
  tokens = np.zeros((len(rows), length), np.int32)
  segments = np.zeros((len(rows), length), np.int32)
  for i, (prompt, resp) in enumerate(rows):
    seq = np.concatenate([prompt, resp])
    tokens[i, :len(seq)], segments[i, :len(seq)] = seq, 1
  return tokens, segments, [(len(p), len(r)) for p, r in rows]


ROWS = _separate_rows()


@functools.partial(jax.jit, static_argnums=0)  # one program, not each op compiled eagerly
def _separate_logprobs(graphdef, params):
  """Per-sample response log-probs from the plain model on the separate rows."""
  tokens, segments, spans = ROWS
  logits = nnx.merge(graphdef, params)(jnp.asarray(tokens), segment_ids=jnp.asarray(segments))
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  out = []
  for i, (p, r) in enumerate(spans):
    targets = jnp.asarray(tokens[i, p:p + r])[:, None]
    out.append(jnp.take_along_axis(logp[i, p - 1:p + r - 1], targets, axis=-1)[:, 0])
  return out


def _reference_loss(params, graphdef, correction, overlong=0, policy=None):
  """PPO-clip (0.2 / 0.28), token mean, GRPO advantages: by hand, sample by sample; with
  `overlong`, each reward less DAPO's ramp over the last `overlong` of 5 response tokens;
  `policy` (per sample, 1 on the tokens the policy drew): the mean over those alone."""
  logps = _separate_logprobs(graphdef, params)
  advs = []
  for g, rewards in zip(GROUPS, REWARDS):
    r = np.asarray(rewards)
    if overlong:
      r = r - np.clip([(len(x) - (5 - overlong)) / overlong for x in g.responses], 0, 1)
    advs += list((r - r.mean()) / (r.std(ddof=1) + 1e-6))
  behav = [b for g in GROUPS for b in g.behaviour_logp]
  if correction == "m2po":  # the batch's largest second moments masked, by the library
    pad = lambda xs: jnp.stack([jnp.pad(x, (0, 5 - len(x))) for x in xs])  # noqa: E731
    lens = np.array([len(x) for x in behav])
    keep = corrections.m2po_mask(jax.lax.stop_gradient(pad(logps)), pad(behav),
                                 (np.arange(5)[None] < lens[:, None]).astype(np.float32))
  total, count = 0.0, 0
  for i, (lp, a, b) in enumerate(zip(logps, advs, behav)):
    prox = jax.lax.stop_gradient(lp)
    ratio = jnp.exp(lp - prox)
    if correction == "m2po":  # unclipped
      total, count = total + jnp.sum(-a * ratio * keep[i, :len(lp)]), count + len(lp)
      continue
    if correction == "none":
      ratio, weight = jnp.exp(lp - b), 1.0
    elif correction == "tis":  # ratio against the proximal policy, weight min(w, 2)
      weight = jnp.minimum(jnp.exp(prox - b), 2.0)
    else:  # mis: weight w where 0.5 <= w <= 2, else 0
      w = jnp.exp(prox - b)
      weight = jnp.where((w >= 0.5) & (w <= 2.0), w, 0.0)
    pg = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 0.8, 1.28)) * weight
    mine = np.ones(len(lp)) if policy is None else policy[i]
    total, count = total + jnp.sum(pg * mine), count + mine.sum()
  return total / count


@pytest.mark.parametrize("correction,overlong", [("none", 0), ("tis", 0), ("mis", 0),
                                                 ("m2po", 0), ("none", 2)])
def test_packed_loss_and_gradient_equal_the_objective_on_separate_sequences(correction,
                                                                            overlong):
  """Gradients too for none and tis; the other cases share their gradient path, so their
  loss values (one compile each, not two) check what they add."""
  graphdef, params = _model()
  cfg = LossConfig(correction=correction, overlong_buffer=overlong, backend="xla")
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  grads_too = correction in ("none", "tis") and not overlong
  packed = functools.partial(rl_loss, graphdef=graphdef, batch=batch, ref_params=None,
                             num_groups=2, cfg=cfg)
  reference = functools.partial(_reference_loss, graphdef=graphdef, correction=correction,
                                overlong=overlong)
  if grads_too:
    (loss, metrics), grads = jax.jit(jax.value_and_grad(packed, has_aux=True))(params)
    want, want_grads = jax.jit(jax.value_and_grad(reference))(params)
    for (path, g), (_, w) in zip(jax.tree.leaves_with_path(grads),
                                 jax.tree.leaves_with_path(want_grads)):
      np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6,
                                 err_msg=jax.tree_util.keystr(path))
  else:
    loss, metrics = jax.jit(packed)(params)
    want = jax.jit(reference)(params)
  np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-6)
  assert metrics["response_tokens"] == sum(len(r) for g in GROUPS for r in g.responses)
  assert 0.1 < float(metrics["entropy"]) <= np.log(V)  # a small random model: near uniform
  # each case differs from the plain one on this batch: some tokens masked, some shaped
  if correction in ("mis", "m2po"):
    assert 0 < metrics[f"{correction}_masked_frac"] < 1
  if overlong:
    assert any(len(r) > 5 - overlong for g in GROUPS for r in g.responses)


def test_gpg_trains_each_token_on_its_batch_scaled_advantage():
  # Group 0's rewards all equal: 3 of the batch's 8 samples learn nothing, so group 1's
  # r - mean is scaled by 8 / 5; the loss is the token mean of -A log pi (no ratio).
  groups = [dataclasses.replace(GROUPS[0], rewards=np.ones(3, np.float32)), GROUPS[1]]
  batch = {k: jnp.asarray(v) for k, v in build_batch(groups, SHAPE).items()}
  graphdef, params = _model()
  cfg = LossConfig(advantage="gpg", policy_loss="pg", backend="xla")
  loss, metrics = jax.jit(functools.partial(rl_loss, graphdef=graphdef, batch=batch,
                                            ref_params=None, num_groups=2, cfg=cfg))(params)
  advs = [0.0] * 3 + list((np.asarray(REWARDS[1]) - 0.6) * 8 / 5)
  logps = _separate_logprobs(graphdef, params)
  want = sum(-a * float(jnp.sum(lp)) for a, lp in zip(advs, logps)) / sum(map(len, logps))
  np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-6)
  assert float(metrics["clip_frac"]) == 0.0


# Where each sample of GROUPS sits in BATCH: (row, slot).
SLOTS = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]


def test_opd_trains_each_token_on_the_teachers_log_prob_less_the_sampled_one():
  # loss.advantage="opd": each token's advantage is log pi_teacher - log pi_behaviour (no
  # baseline, no whitening), under the default PPO-clip (0.2 / 0.28), token mean.
  teacher = np.random.default_rng(5).uniform(-4.0, -1.0, BATCH["behaviour_logp"].shape)
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  batch["teacher_logp"] = jnp.asarray(teacher, jnp.float32)
  graphdef, params = _model()
  cfg = LossConfig(advantage="opd", backend="xla")
  adv, _ = group_advantages(batch, 2, cfg)
  adv = np.asarray(adv).reshape(4, 4, -1)
  logps = _separate_logprobs(graphdef, params)
  behav = [b for g in GROUPS for b in g.behaviour_logp]
  total, kl, count = 0.0, 0.0, 0
  for (row, slot), lp, b in zip(SLOTS, logps, behav):
    a = teacher[row, slot, :len(b)] - b
    np.testing.assert_allclose(adv[row, slot, :len(b)], a, rtol=1e-6)
    assert not adv[row, slot, len(b):].any()
    ratio = np.exp(np.asarray(lp) - b)
    total += np.sum(np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.28)))
    kl, count = kl + np.sum(b - teacher[row, slot, :len(b)]), count + len(b)
  assert not adv[3].any() and not adv[0, 3].any()  # padding samples
  loss, metrics = jax.jit(functools.partial(rl_loss, graphdef=graphdef, batch=batch,
                                            ref_params=None, num_groups=2, cfg=cfg))(params)
  np.testing.assert_allclose(loss, total / count, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["teacher_kl"], kl / count, rtol=1e-5)
  del batch["teacher_logp"]
  with pytest.raises(ValueError, match="loss.advantage: 'opd' needs the teacher's log-probs"):
    group_advantages(batch, 2, cfg)
  with pytest.raises(ValueError, match="loss.kl_in_reward: expected 0 with advantage='opd'"):
    LossConfig(advantage="opd", kl_in_reward=0.1)


def test_the_distillation_term_is_the_forward_kl_from_the_teachers_top_tokens():
  # loss.distill_topk=2: at every sampled position, the teacher's 2 ids, their log-probs
  # renormalised to q; the term is sum_k q_k (log q_k - log pi(id_k)), token mean, times
  # distill_coef, added to the policy loss.
  rng = np.random.default_rng(6)
  shape = BATCH["behaviour_logp"].shape
  ids = rng.integers(0, V, (*shape, 2)).astype(np.int32)
  top = rng.uniform(-3.0, -0.1, (*shape, 2)).astype(np.float32)
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  batch.update(teacher_topk_ids=jnp.asarray(ids), teacher_topk_logp=jnp.asarray(top))
  graphdef, params = _model()
  tokens, segments, spans = ROWS
  logits = nnx.merge(graphdef, params)(jnp.asarray(tokens), segment_ids=jnp.asarray(segments))
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
  total, count = 0.0, 0
  for i, ((row, slot), (p, r)) in enumerate(zip(SLOTS, spans)):
    q = np.exp(top[row, slot, :r]) / np.exp(top[row, slot, :r]).sum(-1, keepdims=True)
    student = np.take_along_axis(logp[i, p - 1:p + r - 1], ids[row, slot, :r], -1)
    total, count = total + np.sum(q * (np.log(q) - student)), count + r
  def loss_of(cfg):
    return jax.jit(functools.partial(rl_loss, graphdef=graphdef, batch=batch, ref_params=None,
                                     num_groups=2, cfg=cfg))(params)
  plain, _ = loss_of(LossConfig(backend="xla"))
  with_term, metrics = loss_of(LossConfig(backend="xla", distill_topk=2, distill_coef=0.5))
  np.testing.assert_allclose(metrics["distill_kl"], total / count, rtol=1e-4)
  np.testing.assert_allclose(with_term - plain, 0.5 * total / count, rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="loss.distill_topk: expected a whole number"):
    LossConfig(distill_topk=-1)
  del batch["teacher_topk_ids"]
  with pytest.raises(ValueError, match="loss.distill_topk: needs the teacher's top tokens"):
    loss_of(LossConfig(backend="xla", distill_topk=2))


def test_the_teacher_scores_each_sampled_token_as_its_model_does(tmp_path):
  from rl_testlib import save_warm_start
  from rlax_ps import sharding as shd
  from rlax_ps.teacher import Teacher
  model = save_warm_start(tmp_path, seed=5)  # another model than the policy: 32 wide
  mesh = shd.make_mesh({"data": 1, "fsdp": 2, "tensor": 1}, jax.devices()[:2])
  teacher = Teacher(str(tmp_path), mesh, vocab_size=V, dtype="float32", backend="xla")
  got = np.asarray(teacher.scores({k: jnp.asarray(v) for k, v in BATCH.items()})["teacher_logp"])
  graphdef, params = nnx.split(model)
  for (row, slot), want in zip(SLOTS, _separate_logprobs(graphdef, params)):
    np.testing.assert_allclose(got[row, slot, :len(want)], want, rtol=1e-4, atol=1e-5)
  both = Teacher(str(tmp_path), mesh, vocab_size=V, dtype="float32", backend="xla", topk=3)
  scores = both.scores({k: jnp.asarray(v) for k, v in BATCH.items()})
  np.testing.assert_allclose(scores["teacher_logp"], got, atol=1e-6)
  assert scores["teacher_topk_ids"].shape == (*got.shape, 3)
  assert np.all(np.asarray(scores["teacher_topk_logp"])[..., 0] >= got - 1e-5)  # the best
  with pytest.raises(ValueError, match=r"teacher.path: .* scores \d+ token ids, the policy's "
                                       "tokenizer gives 100000"):
    Teacher(str(tmp_path), mesh, vocab_size=100000)
  with pytest.raises(ValueError, match="teacher.path: HF checkpoint"):
    Teacher(str(tmp_path / "missing"), mesh, vocab_size=V)


def test_an_environments_tokens_are_context_not_trained_on():
  # Multi-turn: the second and third tokens of every longer response are an environment's
  # reply. The loss and its gradient are the objective over the policy's tokens alone (the
  # reply still conditions them: the separate rows hold it).
  observed = tuple(tuple((np.arange(len(r)) >= 1) & (np.arange(len(r)) < 3) & (len(r) > 3)
                         for r in g.responses) for g in GROUPS)
  groups = [dataclasses.replace(g, observed=o) for g, o in zip(GROUPS, observed)]
  batch = build_batch(groups, SHAPE)
  fifth = observed[1][4]
  np.testing.assert_array_equal(batch["policy_tokens"][2, 0, :len(fifth)], ~fifth)
  policy = [(~o).astype(np.float32) for obs in observed for o in obs]
  assert 0 < sum(p.sum() for p in policy) < sum(len(p) for p in policy)
  graphdef, params = _model()
  cfg = LossConfig(backend="xla")
  packed = functools.partial(rl_loss, graphdef=graphdef,
                             batch={k: jnp.asarray(v) for k, v in batch.items()},
                             ref_params=None, num_groups=2, cfg=cfg)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(packed, has_aux=True))(params)
  want, want_grads = jax.jit(jax.value_and_grad(functools.partial(
      _reference_loss, graphdef=graphdef, correction="none", policy=policy)))(params)
  np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-6)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6)
  assert metrics["response_tokens"] == sum(p.sum() for p in policy)
  bad = dataclasses.replace(GROUPS[0], observed=(np.zeros(9, bool),) + observed[0][1:])
  with pytest.raises(ValueError, match=r"rollout 10: samples\[0\].observed: expected \d+ "
                                       r"\(one per token\), got 9"):
    build_batch([bad], SHAPE)


def test_a_gradient_step_raises_the_log_probs_of_rewarded_samples():
  graphdef, params = _model()
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  cfg = LossConfig(backend="xla")
  grads = jax.jit(jax.grad(
      lambda p: rl_loss(p, graphdef, batch, None, num_groups=2, cfg=cfg)[0]))(params)
  stepped = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
  before = _separate_logprobs(graphdef, params)
  after = _separate_logprobs(graphdef, stepped)
  rewards = [r for rs in REWARDS for r in rs]
  change = [float(jnp.sum(a - b)) for a, b in zip(after, before)]
  assert np.mean([c for c, r in zip(change, rewards) if r == 1]) > 0
  assert np.mean([c for c, r in zip(change, rewards) if r == 0]) < 0


@pytest.mark.parametrize("field,value,message", [
    ("advantage", "ppo", "loss.advantage"), ("correction", "is", "loss.correction"),
    ("agg", "sum", "loss.agg"), ("kl_coef", -1.0, "loss.kl_coef"),
    ("mis_low", 3.0, "loss.mis_low: expected 0 <= mis_low < mis_high=2.0"),
    ("overlong_buffer", -1, "loss.overlong_buffer"),
    ("clip_high", -1.0, "loss.clip_high: expected a finite clip bound >= 0"),
    ("clip_low", -0.1, "loss.clip_low: expected a finite clip bound >= 0"),
    ("clip_low", "0.2", "loss.clip_low: expected a finite clip bound >= 0, got '0.2'"),
    ("kl_coef", float("inf"), "loss.kl_coef: expected a finite coefficient >= 0, got inf"),
    ("overlong_buffer", 2.5, "loss.overlong_buffer: expected a whole number of tokens"),
    # Settings the objective would not read, set by mistake: they would do nothing.
    ("is_level", "sequence", "loss.is_level: expected its default 'token' with "
                             "correction='none' \\(read with 'tis' or 'mis'\\)"),
    ("kl_horizon", 5, "loss.kl_horizon: expected its default 10000 without kl_target"),
    ("distill_coef", 2.0, "loss.distill_coef: expected its default 1.0 with distill_topk=0"),
    ("sapo_tau_pos", 2.0, "loss.sapo_tau_pos: expected its default 1.0 with "
                          "policy_loss='ppo'"),
    ("kl_estimator", "mse", "loss.kl_estimator: expected one of .*'low_var_kl', 'abs'"),
    ("kl_bias_correction", True, "loss.kl_bias_correction: expected False with kl_coef=0"),
    ("kl_cov_ratio", 0.0, "loss.kl_cov_ratio: expected a share of the tokens in \\(0, 1\\]"),
    ("kl_cov_coef", -1.0, "loss.kl_cov_coef: expected a finite coefficient >= 0"),
    ("clip_cov_ratio", 2.0, "loss.clip_cov_ratio: expected a share of the tokens"),
    ("clip_cov_ub", 0.5, "loss.clip_cov_ub: expected a bound above clip_cov_lb=1.0"),
    ("sapo_tau_neg", 0.0, "loss.sapo_tau_neg: expected a finite temperature > 0")])
def test_bad_loss_settings_name_the_field(field, value, message):
  with pytest.raises(ValueError, match=message):
    LossConfig(**{field: value})
  with pytest.raises(ValueError, match="loss.correction: expected 'none', 'tis' or 'mis' with "
                                       "policy_loss='cispo'"):
    LossConfig(policy_loss="cispo", correction="decoupled")
  with pytest.raises(ValueError, match="loss.clip_low: expected unset with policy_loss='kl_cov'"):
    LossConfig(policy_loss="kl_cov", clip_high=0.28)
  with pytest.raises(ValueError, match="loss.clip_low: expected unset with policy_loss='sapo' "
                                       r"\(it clips no ratio: a soft gate"):
    LossConfig(policy_loss="sapo", clip_low=0.2)
  with pytest.raises(ValueError, match="loss.clip_low: expected unset with policy_loss='pg' "
                                       r"\(it clips no ratio: the plain policy gradient"):
    LossConfig(policy_loss="pg", clip_high=0.28)
  with pytest.raises(ValueError, match="loss.scale_rewards: expected unset with "
                                       "advantage='gpg'.*gpg takes one of"):
    LossConfig(advantage="gpg", scale_rewards="max")


def test_each_policy_loss_takes_its_own_clip_and_aggregation_unless_set():
  # The default recipe leaves them unset: a user choosing GSPO gets GSPO's bounds (a
  # sequence ratio within 3e-4 of 1), not PPO's 0.2 / 0.28, under which it never clipped.
  from rlax_ps import config_files
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  config = config_files.load(os.path.join(repo, "configs", "rl_local.py"))
  ppo = LossConfig.from_config(config.loss)
  assert (ppo.clip_low, ppo.clip_high, ppo.agg) == (0.2, 0.28, "token-mean")
  config.loss.policy_loss = "gspo"
  gspo = LossConfig.from_config(config.loss)
  assert (gspo.clip_low, gspo.clip_high, gspo.agg) == (3e-4, 4e-4, "seq-mean-token-mean")
  config.loss.policy_loss, config.loss.clip_high = "cispo", 0.5
  cispo = LossConfig.from_config(config.loss)
  assert (cispo.clip_low, cispo.clip_high, cispo.agg) == (1.0, 0.5, "token-mean")
  config.loss.policy_loss, config.loss.clip_high = "geo_mean", None
  gmpo = LossConfig.from_config(config.loss)
  assert (gmpo.clip_low, gmpo.clip_high, gmpo.agg) == (0.4, 0.4, "seq-mean-token-mean")
  config.loss.policy_loss = "kl_cov"
  kl_cov = LossConfig.from_config(config.loss)
  assert (kl_cov.clip_low, kl_cov.clip_high, kl_cov.agg) == (None, None, "token-mean")
  config.loss.policy_loss = "sapo"
  sapo = LossConfig.from_config(config.loss)
  assert (sapo.clip_low, sapo.clip_high, sapo.agg, sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (
      None, None, "seq-mean-token-mean", 1.0, 1.05)
  gpg = LossConfig.from_config(config_files.load(os.path.join(repo, "configs", "rl_gpg.py"))
                               .loss)
  assert (gpg.advantage, gpg.policy_loss, gpg.clip_low, gpg.clip_high, gpg.agg,
          gpg.scale_rewards) == ("gpg", "pg", None, None, "token-mean", None)


def test_bad_groups_are_refused_naming_the_rollout_and_field():
  g = GROUPS[0]
  long_prompt = Group(1, np.arange(1, 9, dtype=np.int32), g.responses, g.behaviour_logp,
                      g.rewards, 0)
  with pytest.raises(ValueError, match="rollout 1: prompt of 8 tokens; rl.max_prompt_tokens=6"):
    build_batch([long_prompt], SHAPE)
  short_logp = Group(2, g.prompt_tokens, g.responses,
                     (g.behaviour_logp[0][:-1],) + g.behaviour_logp[1:], g.rewards, 0)
  with pytest.raises(ValueError, match=r"rollout 2: samples\[0\].logprobs"):
    build_batch([short_logp], SHAPE)
  for over in (6, 9):  # one token past the budget, and more
    long_resp = Group(3, g.prompt_tokens, (np.ones(over, np.int32),) + g.responses[1:],
                      (np.zeros(over, np.float32),) + g.behaviour_logp[1:], g.rewards, 0)
    with pytest.raises(ValueError, match=f"samples\\[0\\] has {over} tokens, more than "
                                         f"worker.max_new_tokens=5"):
      build_batch([long_resp], SHAPE)
  nan_logp = Group(5, g.prompt_tokens, g.responses,
                   (np.full(len(g.responses[0]), np.nan, np.float32),) + g.behaviour_logp[1:],
                   g.rewards, 0)
  with pytest.raises(ValueError, match=r"rollout 5: samples\[0\].logprobs: expected finite"):
    build_batch([nan_logp], SHAPE)
  with pytest.raises(ValueError, match="rl.groups_per_step"):
    build_batch(GROUPS * 2, SHAPE)
  # Ids past the model's vocabulary (a worker with another tokenizer) would be clamped by
  # the embedding lookup and trained on silently.
  check_group(g, SHAPE, vocab_size=V)
  past = Group(4, g.prompt_tokens, (np.asarray([1, V], np.int32),) + g.responses[1:],
               (np.zeros(2, np.float32),) + g.behaviour_logp[1:], g.rewards, 0)
  with pytest.raises(ValueError, match=rf"rollout 4: samples\[0\].token_ids: expected ids "
                                       rf"below the model's vocab_size {V}, got {V}"):
    check_group(past, SHAPE, vocab_size=V)
  with pytest.raises(ValueError, match=r"rollout 1: prompt.token_ids"):
    check_group(Group(1, np.asarray([1, V + 3], np.int32), g.responses, g.behaviour_logp,
                      g.rewards, 0), SHAPE, vocab_size=V)


def test_a_sample_of_no_tokens_needs_no_teacher_scores():
  """One empty sample without the teacher's log-probs rejected its whole group, though
  build_batch needs none for it."""
  g = GROUPS[0]
  shape = dataclasses.replace(SHAPE, teacher_logp=True)
  responses = (np.zeros(0, np.int32),) + g.responses[1:]
  logps = (np.zeros(0, np.float32),) + g.behaviour_logp[1:]
  teacher = ((None, None, None),) + tuple((np.zeros(len(r), np.float32), None, None)
                                          for r in g.responses[1:])
  check_group(dataclasses.replace(g, responses=responses, behaviour_logp=logps,
                                  teacher=teacher), shape, vocab_size=V)
  with pytest.raises(ValueError, match=r"samples\[1\].teacher_logprobs_f32"):
    check_group(dataclasses.replace(g, responses=responses, behaviour_logp=logps,
                                    teacher=teacher[:1] + ((None, None, None),) + teacher[2:]),
                shape, vocab_size=V)


ROUTED = dataclasses.replace(SHAPE, moe_layers=2, top_k=2, num_experts=4)


def _routed(group, seed=0):
  """`group` with routes: distinct experts per token and layer, [tokens (- 1), 2, 2]."""
  rng = np.random.default_rng(seed)
  ids = lambda n: np.asarray([rng.permutation(4)[:2] for _ in range(2 * n)],
                             np.int32).reshape(n, 2, 2)
  return dataclasses.replace(group, prompt_routes=ids(len(group.prompt_tokens)),
                             response_routes=tuple(ids(len(r) - 1) for r in group.responses))


def test_routes_fill_the_rows_of_their_group_and_minus_one_elsewhere():
  routed = _routed(GROUPS[1])
  batch = build_batch([GROUPS[0], routed], ROUTED)
  assert batch["prompt_routes"].shape == (4, 6, 2, 2)
  assert batch["response_routes"].shape == (4, 4, 5, 2, 2)
  assert (batch["prompt_routes"][0] == -1).all() and (batch["response_routes"][0] == -1).all()
  for row, first in ((1, 0), (2, 4)):  # group 1's two rows: samples 0-3, then sample 4
    np.testing.assert_array_equal(batch["prompt_routes"][row, :4], routed.prompt_routes)
    assert (batch["prompt_routes"][row, 4:] == -1).all()
    r = routed.response_routes[first]
    np.testing.assert_array_equal(batch["response_routes"][row, 0, :len(r)], r)
    assert (batch["response_routes"][row, 0, len(r):] == -1).all()  # the last token: none
  # Without routing replay the batch has no routes.
  assert "prompt_routes" not in build_batch([GROUPS[0]], SHAPE)


def test_bad_routes_are_refused_naming_the_rollout_and_field():
  g = _routed(GROUPS[0])
  # A trainer that replays none leaves a group's routes unread (the group trains as it is).
  np.testing.assert_array_equal(build_batch([g], SHAPE)["response_tokens"],
                                build_batch([GROUPS[0]], SHAPE)["response_tokens"])
  assert "prompt_routes" not in build_batch([g], SHAPE)
  cases = [
      (dataclasses.replace(g, prompt_routes=None), "expected routes for the prompt and every"),
      (dataclasses.replace(g, prompt_routes=g.prompt_routes[:-1]),
       r"prompt_routes: expected shape \[3 tokens, 2 MoE layers, top_k=2\], got \[2, 2, 2\]"),
      (dataclasses.replace(g, response_routes=(g.response_routes[0] + 4,) + g.response_routes[1:]),
       r"samples\[0\].routes: expected expert ids in \[0, 4\)"),
      (dataclasses.replace(g, prompt_routes=np.zeros_like(g.prompt_routes)),
       "prompt_routes: expected 2 distinct experts per token and layer"),
      (dataclasses.replace(g, response_routes=g.response_routes[:-1]),
       "expected routes for each of 3 samples, got 2")]
  for bad, message in cases:
    with pytest.raises(ValueError, match=f"rollout 10: {message}"):
      build_batch([bad], ROUTED)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kl_term_is_zero_against_itself_and_positive_against_another_policy(temperature):
  # loss.temperature (the workers'): the reference is scored at it as the policy is, so a
  # policy equal to its reference pays no KL at any sampling temperature.
  graphdef, params = _model()
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  cfg = LossConfig(backend="xla", kl_coef=0.5, temperature=temperature)
  loss_fn = jax.jit(lambda p, ref, c: rl_loss(p, graphdef, batch, ref, num_groups=2, cfg=c),
                    static_argnums=2)
  plain, _ = loss_fn(params, None, LossConfig(backend="xla", temperature=temperature))
  same, m_same = loss_fn(params, params, cfg)
  assert float(m_same["kl_ref"]) == pytest.approx(0.0, abs=1e-6)
  np.testing.assert_allclose(same, plain, rtol=1e-6)
  other = jax.tree.map(lambda x: x * 1.5, params)
  shifted, m_other = loss_fn(params, other, cfg)
  assert float(m_other["kl_ref"]) > 1e-4
  np.testing.assert_allclose(shifted, plain + 0.5 * m_other["kl_ref"], rtol=1e-5)


def test_bias_corrected_kl_is_each_tokens_kl_times_its_ratio_to_the_behaviour_policy():
  """TRL's use_bias_correction_kl on the packed path: with correction "none" the ratio is
  pi / pi_behaviour, and verl's low_var_kl is the k3 estimate clamped to [-10, 10]."""
  from rlax_ps.train.rl_loss import response_logprobs, token_mask
  graphdef, params = _model()
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  other = jax.tree.map(lambda x: x * 1.5, params)
  cfg = LossConfig(backend="xla", kl_coef=0.5, kl_estimator="low_var_kl",
                   kl_bias_correction=True)
  def run(p, ref):  # the loss's metrics, and the log-probs it was computed from
    logps = [response_logprobs(x, graphdef, batch, "xla") for x in (p, ref)]
    return rl_loss(p, graphdef, batch, ref, num_groups=2, cfg=cfg)[1], logps

  metrics, logps = jax.jit(run)(params, other)
  logp, ref = (np.asarray(x, np.float64) for x in logps)
  behaviour = np.asarray(batch["behaviour_logp"], np.float64).reshape(logp.shape)
  mask = np.asarray(token_mask(batch, group_advantages(batch, 2, cfg)[1]), np.float64)
  log_r = np.clip(ref - logp, -20, 20)
  per_token = np.clip(np.exp(log_r) - log_r - 1, -10, 10) * np.exp(logp - behaviour)
  want = (per_token * mask).sum() / mask.sum()
  assert float(metrics["kl_ref"]) == pytest.approx(want, rel=1e-4)


def test_several_updates_per_batch_count_one_step_and_let_the_clip_bind(monkeypatch):
  """Three PPO updates on a batch count one step, and later ones clip; with a KL term the
  frozen reference's forward runs once for the batch, not once an update (and the proximal
  log-probs' once, the same sliced pass over the policy); the lr logged is the step's,
  which its three updates share."""
  from rlax_ps import optim, sharding
  from rlax_ps.train import rl, rl_loss as rl_loss_module
  from rlax_ps.train.rl_loss import response_logprobs
  from rlax_ps.train.state import sharded_init

  runs, real = [], rl_loss_module.reference_logprobs

  def counted(*args, **kwargs):
    out = real(*args, **kwargs)
    jax.debug.callback(lambda: runs.append(1))  # each time the compiled step runs it
    return out

  for module in (rl, rl_loss_module):
    monkeypatch.setattr(module, "reference_logprobs", counted)
  model_cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, max_position_embeddings=32)
  mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  opt_cfg = {"lr": 0.05, "warmup_steps": 0, "min_lr_ratio": 0.1}  # (lr decays each step)
  opt = optim.make_optimizer(opt_cfg, 10, updates_per_step=3)
  schedule = optim.learning_rate_schedule(opt_cfg, 10)
  cfg = LossConfig(backend="xla", kl_coef=0.01)
  state, shardings, graphdef = sharded_init(model_cfg, opt, mesh, seed=0)
  ref, _, _ = sharded_init(model_cfg, opt, mesh, seed=1)
  batch = {key: jnp.asarray(v) for key, v in BATCH.items()}
  # On-policy data: the behaviour log-probs are the policy's own, so one update sees ratio 1
  # everywhere and clips nothing; a clipped token shows that later updates ran.
  batch["behaviour_logp"] = jax.jit(lambda p: response_logprobs(p, graphdef, batch, "xla"))(
      state.params).reshape(batch["behaviour_logp"].shape)  # one compile, not one per op
  step = rl.make_rl_step(graphdef, opt, shardings, mesh, num_groups=2, loss_cfg=cfg,
                         updates_per_batch=3, schedule=schedule)
  three, metrics = step(state, batch, ref.params)
  jax.effects_barrier()
  assert int(three.step) == 1  # the state counts batches
  assert float(metrics["clip_frac"]) > 0.0  # later updates move past the clip and are bounded
  assert len(runs) == 2 and float(metrics["kl_ref"]) > 0  # the reference's, the proximal's
  assert float(metrics["lr"]) == pytest.approx(float(schedule(0)))  # step 0's, not a mean
  with pytest.raises(ValueError, match="rl.updates_per_batch"):
    rl.make_rl_step(graphdef, opt, shardings, mesh, num_groups=2, loss_cfg=cfg,
                    updates_per_batch=0)
  # Clip-Cov: the step draws the tokens it drops from its state's key (here, any token PPO's
  # clip leaves: up to half of them); the loss refuses to run without draws.
  cfg = LossConfig(backend="xla", policy_loss="clip_cov", clip_cov_ratio=0.5,
                   clip_cov_lb=-1e9, clip_cov_ub=1e9)
  step = rl.make_rl_step(graphdef, opt, shardings, mesh, num_groups=2, loss_cfg=cfg)
  _, metrics = step(three, batch, ref.params)
  assert 0.0 < float(metrics["clip_cov_frac"]) <= 0.5
  with pytest.raises(ValueError, match="loss.policy_loss: 'clip_cov' draws the tokens"):
    rl_loss(state.params, graphdef, batch, None, num_groups=2, cfg=cfg)


@pytest.mark.parametrize("micro,overrides", [
    # plain PPO, token-mean: the PPO-TIS and KL-Cov (token-mean) cases below hold its paths
    pytest.param(2, dict(), marks=pytest.mark.slow),
    # TIS and the per-slice count weighting: clip-cov-tis and kl-cov below hold its paths
    pytest.param(2, dict(agg="seq-mean-token-mean", correction="tis", kl_coef=0.1,
                         logits_chunk=3, kl_estimator="low_var_kl", kl_bias_correction=True),
                 marks=pytest.mark.slow),
    # ~6 s each: the slices' own counts are what the variants above check; these add
    # a 4-way split, decoupled PPO, GSPO's sequence ratios and RLOO.
    pytest.param(4, dict(agg="seq-mean-token-sum-norm", correction="decoupled"),
                 marks=pytest.mark.slow),
    pytest.param(2, dict(policy_loss="gspo", agg="seq-mean-token-sum", advantage="rloo"),
                 marks=pytest.mark.slow),
    # Per-token advantages whitened over the whole batch, of rewards with the KL penalty:
    # the reference's log-probs of every slice, back in the batch's row order.
    # (slow: test_rl_loss_verl_parity covers the advantages; kl-cov the micro-batch split)
    pytest.param(2, dict(advantage="reinforce_pp", gamma=0.9, kl_in_reward=0.1,
                         kl_estimator="k1"), marks=pytest.mark.slow),
    # KL-Cov's tokens are the whole batch's most covarying: each slice holds its own of them.
    (2, dict(policy_loss="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=5.0)),
    # Clip-Cov's dropped tokens are drawn from the whole batch's, by covariance terms against
    # its means: a slice drops those the whole batch's draw names (against the proximal
    # log-probs, TIS; here some 5 of the 17 tokens).
    (2, dict(policy_loss="clip_cov", correction="tis", clip_cov_ratio=0.3,
             clip_cov_lb=0.0, clip_cov_ub=1e9)),
    # ~8 s each: the losses' own tests cover them whole; micro-batching them adds no new path.
    pytest.param(2, dict(policy_loss="cispo", correction="tis"), marks=pytest.mark.slow),
    pytest.param(2, dict(policy_loss="gspo", agg="token-mean", correction="mis", mis_low=0.9),
                 marks=pytest.mark.slow),
    pytest.param(2, dict(policy_loss="geo_mean", correction="tis"), marks=pytest.mark.slow),
    # Distillation: the teacher's per-token advantages and its top tokens' term, by slice.
    # (slow: test_rl_trainer's distillation tests cover it; kl-cov the micro-batch split)
    pytest.param(2, dict(advantage="opd", distill_topk=2, agg="seq-mean-token-mean"),
                 marks=pytest.mark.slow),
], ids=["token-mean", "seq-mean-tis-kl-chunked", "sum-norm-decoupled-4", "gspo-rloo",
        "reinforce-pp-kl-in-reward", "kl-cov", "clip-cov-tis", "cispo-tis", "gspo-token-mean-mis",
        "gmpo-tis", "opd-topk"])
def test_micro_batches_give_the_whole_batchs_loss_gradient_and_metrics(micro, overrides):
  """Rows 1 and 2 hold one group: with 2 micro-batches (rows 0, 2 and rows 1, 3) it is split,
  so its advantages must come from the whole batch. The slices hold unequal numbers of
  tokens, sequences and samples, so every logged metric (token, sequence and sample means,
  maxima, minima) equals the whole batch's only if each is weighted by its own count."""
  from rlax_ps.train.rl_loss import micro_batched_loss_and_grad
  graphdef, params = _model()
  cfg = LossConfig(backend="xla", **overrides)
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  ref = jax.tree.map(lambda x: x * 1.01, params)
  rng = np.random.default_rng(1)
  if cfg.distill_topk:  # a teacher's scores of the batch
    shape = BATCH["behaviour_logp"].shape
    batch.update(teacher_logp=jnp.asarray(rng.uniform(-4, -1, shape), jnp.float32),
                 teacher_topk_ids=jnp.asarray(rng.integers(0, V, (*shape, 2)), jnp.int32),
                 teacher_topk_logp=jnp.asarray(rng.uniform(-3, -0.1, (*shape, 2)),
                                               jnp.float32))
  proximal = jnp.asarray(rng.uniform(-4, -2, (16, 5)), jnp.float32)
  noise = jnp.asarray(rng.uniform(size=(16, 5)), jnp.float32)  # Clip-Cov's draws
  whole = jax.jit(jax.value_and_grad(lambda p: rl_loss(p, graphdef, batch, ref, num_groups=2,
                                                       cfg=cfg, proximal=proximal,
                                                       noise=noise),
                                     has_aux=True))
  (loss, metrics), grads = whole(params)
  (m_loss, m_metrics), m_grads = jax.jit(lambda p: micro_batched_loss_and_grad(
      p, graphdef, batch, ref, num_groups=2, cfg=cfg, micro_batches=micro,
      proximal=proximal, noise=noise))(params)
  if cfg.policy_loss == "clip_cov":  # some dropped, fewer than every candidate
    assert 0.0 < float(metrics["clip_cov_frac"]) <= 0.3
  _assert_whole_batchs(m_loss, m_metrics, m_grads, loss, metrics, grads)


def _assert_whole_batchs(m_loss, m_metrics, m_grads, loss, metrics, grads):
  """The micro-batched loss, every gradient leaf and every metric equal the whole batch's."""
  np.testing.assert_allclose(m_loss, loss, rtol=1e-5, atol=1e-7)
  for (path, g), (_, w) in zip(jax.tree.leaves_with_path(m_grads),
                               jax.tree.leaves_with_path(grads)):
    np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  assert set(m_metrics) == set(metrics)
  for k in sorted(metrics):
    np.testing.assert_allclose(m_metrics[k], metrics[k], rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.slow  # ~20 s; the dense micro-batch cases stay in the default suite
def test_micro_batched_moe_loss_gradient_and_metrics_are_the_whole_batchs():
  """Routing replay on group 1 alone: the slices (rows 0, 2 and rows 1, 3) replay unequal
  numbers of expert slots, so the routers' agreement is a mean over those, not tokens. The
  load-balancing loss, E * sum over experts of (token share) * (mean probability), is a
  product of two means over the whole batch's tokens: its value, its gradient and the loss
  it joins are the whole batch's only if the slices' token shares are the whole batch's."""
  from rlax_ps.train.rl_loss import micro_batched_loss_and_grad
  model_cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2,
                          num_heads=2, num_kv_heads=1, max_position_embeddings=32,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
  # Initialised in one program: eagerly, each op of the init is a compile of its own.
  graphdef, state = nnx.split(nnx.jit(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))())
  params = state.to_pure_dict()
  batch = {k: jnp.asarray(v)
           for k, v in build_batch([GROUPS[0], _routed(GROUPS[1])], ROUTED).items()}
  cfg = LossConfig(backend="xla", router_aux_coef=0.5)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(
      lambda p: rl_loss(p, graphdef, batch, None, num_groups=2, cfg=cfg), has_aux=True))(params)
  (m_loss, m_metrics), m_grads = jax.jit(lambda p: micro_batched_loss_and_grad(
      p, graphdef, batch, None, num_groups=2, cfg=cfg, micro_batches=2))(params)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  assert 0.0 < float(metrics["router_agreement"]) < 1.0
  _assert_whole_batchs(m_loss, m_metrics, m_grads, loss, metrics, grads)
  # Without the term in the loss (no counting pass) the logged one is the whole batch's too.
  (_, unweighted), _ = jax.jit(lambda p: micro_batched_loss_and_grad(
      p, graphdef, batch, None, num_groups=2, cfg=dataclasses.replace(cfg, router_aux_coef=0.0),
      micro_batches=2))(params)
  np.testing.assert_allclose(unweighted["router_aux_loss"], metrics["router_aux_loss"],
                             rtol=1e-5)


# ~8 s and ~20 s: the sharded step is test_sharding_equivalence's, micro-batches the cases
# above, PPO epochs the several-updates test's.
@pytest.mark.slow
@pytest.mark.parametrize("updates", [1, 2])
def test_a_micro_batched_step_on_8_devices_equals_the_whole_batch_step_on_one(updates):
  from rlax_ps import optim, sharding
  from rlax_ps.train.rl import make_rl_step
  from rlax_ps.train.state import sharded_init

  model_cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                          num_heads=2, num_kv_heads=1, max_position_embeddings=32)
  opt = optim.make_optimizer({"lr": 0.05, "warmup_steps": 0, "min_lr_ratio": 1.0,
                              "eps": 1e-4}, 10)
  cfg = LossConfig(backend="xla", logits_chunk=8)
  out = {}
  for axes, micro in (((1, 1, 1), 1), ((2, 2, 2), 2)):
    mesh = sharding.make_mesh(dict(zip(sharding.MESH_AXES, axes)),
                              jax.devices()[:int(np.prod(axes))])
    state, shardings, graphdef = sharded_init(model_cfg, opt, mesh, seed=0)
    step = make_rl_step(graphdef, opt, shardings, mesh, num_groups=2, loss_cfg=cfg,
                        micro_batches=micro, updates_per_batch=updates)
    batch = sharding.shard_batch(mesh, BATCH)
    # On 8 devices the packed attention runs per device (rows over data and fsdp).
    assert ("shard_map" in str(jax.make_jaxpr(step)(state, batch, None))) == (micro == 2)
    new, metrics = step(state, batch, None)
    out[micro] = (jax.device_get(new.params), float(metrics["loss"]))
  (whole, loss1), (sliced, loss2) = out[1], out[2]
  np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(whole), jax.tree.leaves(sliced)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_micro_batches_are_refused_where_they_cannot_be_exact():
  from rlax_ps.train.rl_loss import micro_batched_loss_and_grad
  graphdef, params = _model()
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  with pytest.raises(ValueError, match="rl.micro_batches: expected a divisor of the batch's 4 "
                                       "rows .*got 3"):
    micro_batched_loss_and_grad(params, graphdef, batch, None, num_groups=2,
                                cfg=LossConfig(backend="xla"), micro_batches=3)
  with pytest.raises(ValueError, match="rl.micro_batches: expected 1 with loss.correction='m2po'"):
    micro_batched_loss_and_grad(params, graphdef, batch, None, num_groups=2,
                                cfg=LossConfig(backend="xla", correction="m2po"), micro_batches=2)
  # A KL reference's (or PPO epochs' proximal) log-probs are sliced first: the same error,
  # not a reshape's TypeError.
  with pytest.raises(ValueError, match="rl.micro_batches: expected a divisor of the batch's 4 "
                                       "rows .*got 3"):
    reference_logprobs(params, graphdef, batch, LossConfig(backend="xla"), micro_batches=3)


def test_response_stats_count_lengths_and_truncation_at_the_budget():
  def group(*responses):
    return Group(0, np.array([1], np.int32), tuple(np.asarray(r, np.int32) for r in responses),
                 tuple(np.zeros(len(r), np.float32) for r in responses),
                 np.zeros(len(responses), np.float32), 0)
  # Budget 4, stop ids 2 and 7: [5,5,5,5] is cut, [5,5,5,7] stopped on its last token,
  # [5,2] stopped early, [5,5,5] shorter than the budget.
  stats = response_stats([group([5, 5, 5, 5], [5, 5, 5, 7]), group([5, 2], [5, 5, 5])],
                         max_len=4, stop_ids=(2, 7))
  assert stats == {"response_len_mean": 3.25, "response_len_max": 4.0, "truncated_frac": 0.25}
  assert response_stats([], 4, (2,))["truncated_frac"] == 0.0


def test_response_stats_count_an_environments_replies_and_tokens():
  responses = (np.array([5, 2, 9, 9, 5, 2, 9, 5], np.int32), np.array([5, 5], np.int32))
  observed = (np.array([0, 0, 1, 1, 0, 0, 1, 0], bool), None)  # two replies, then none
  g = Group(0, np.array([1], np.int32), responses, tuple(np.zeros(len(r), np.float32)
                                                         for r in responses),
            np.zeros(2, np.float32), 0, observed=observed)
  stats = response_stats([g], max_len=8, stop_ids=(2,))
  assert stats["env_replies_mean"] == 1.0 and stats["env_token_frac"] == 0.3


def test_groups_that_fill_a_step_exactly_pack_into_its_rows_not_twice_as_many():
  from rlax_ps.train.rollouts import rows_needed
  g = GROUPS[1]  # 5 samples: 4 (SHAPE.samples) of them a row
  whole = Group(20, g.prompt_tokens, g.responses[:4], g.behaviour_logp[:4], g.rewards[:4], 0)
  full = [whole, dataclasses.replace(whole, rollout_id=21)]  # SHAPE.groups rows, exactly
  assert rows_needed(full, SHAPE) == SHAPE.groups == len(build_batch(full, SHAPE)["row_group"])
  assert rows_needed(GROUPS, SHAPE) == 2 * SHAPE.groups  # 1 + 2 rows: rounded up to 4


def test_response_capacities_halve_the_budget_in_multiples_of_8():
  assert response_lens(1024, 4) == [128, 256, 512, 1024]
  assert response_lens(20, 4) == [8, 16, 20] and response_lens(1024, 1) == [1024]
  big = dataclasses.replace(SHAPE, response_len=32)
  assert fit_response_len(GROUPS, big, 4).response_len == 8  # the longest response holds 5
  g = GROUPS[0]  # one exactly as long as a capacity packs to it, not the next
  exact = Group(9, g.prompt_tokens, (np.ones(8, np.int32),) + g.responses[1:],
                (np.zeros(8, np.float32),) + g.behaviour_logp[1:], g.rewards, 0)
  assert fit_response_len([exact], big, 4).response_len == 8
  assert fit_response_len(GROUPS, big, 1).response_len == 32
  with pytest.raises(ValueError, match="rl.response_buckets: expected >= 1"):
    fit_response_len(GROUPS, big, 0)


# dr_grpo holds the budget-relative terms (and the plain path beneath them); the plain GRPO,
# overlong and M2PO cases (~5 s each) run with the slow suite.
@pytest.mark.parametrize("overrides", [
    pytest.param(dict(), marks=pytest.mark.slow),
    dict(advantage="dr_grpo", agg="seq-mean-token-sum-norm"),
    pytest.param(dict(overlong_buffer=30), marks=pytest.mark.slow),
    pytest.param(dict(correction="m2po"), marks=pytest.mark.slow)],
    ids=["grpo", "dr_grpo", "overlong", "m2po"])
def test_a_batch_packed_to_its_bucket_trains_as_at_the_full_budget(overrides):
  """rl.response_buckets: the groups packed to 8 response positions give the loss and
  gradient they give packed to the 32-token budget, the budget-relative terms (Dr. GRPO's
  constant normaliser, DAPO's overlong ramp) counting from the budget, not the rows."""
  graphdef, params = _model()
  big = dataclasses.replace(SHAPE, response_len=32)
  cfg = LossConfig(budget=32, **overrides)
  fitted = fit_response_len(GROUPS, big, 4)
  assert fitted.response_len == 8
  results = []
  for shape in (big, fitted):
    batch = {k: jnp.asarray(v) for k, v in build_batch(GROUPS, shape).items()}
    fn = jax.value_and_grad(functools.partial(rl_loss, graphdef=graphdef, batch=batch,
                                              ref_params=None, num_groups=2, cfg=cfg),
                            has_aux=True)
    (loss, _), grads = jax.jit(fn)(params)
    results.append((loss, grads))
  (full, g_full), (packed, g_packed) = results
  np.testing.assert_allclose(packed, full, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g_packed), jax.tree.leaves(g_full)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


PARTS = dataclasses.replace(SHAPE, reward_parts=("task", "second"))


def _with_parts():
  """GROUPS with reward parts: group 0 its task part alone, group 1 both."""
  first = dataclasses.replace(GROUPS[0], reward_parts={"task": (1.0, 0.0, 0.0)})
  second = dataclasses.replace(GROUPS[1], reward_parts={"task": (1.0, 1.0, 0.0, 0.0, 1.0),
                                                        "second": (0.5, 0.0, 2.0, 1.0, 0.5)})
  return [first, second]


def test_reward_parts_fill_their_samples_and_nan_elsewhere():
  batch = build_batch(_with_parts(), PARTS)
  assert batch["reward_parts"].shape == (4, 4, 2)
  np.testing.assert_array_equal(batch["reward_parts"][0, :, 0], [1.0, 0.0, 0.0, np.nan])
  assert np.isnan(batch["reward_parts"][0, :, 1]).all()  # group 0 has no "second"
  np.testing.assert_array_equal(batch["reward_parts"][1, :, 1], [0.5, 0.0, 2.0, 1.0])
  np.testing.assert_array_equal(batch["reward_parts"][2, :, 1], [0.5, np.nan, np.nan, np.nan])
  assert np.isnan(batch["reward_parts"][3]).all()
  # Without loss.reward_aggregation="normalize_then_sum" the batch is as before.
  plain = build_batch(_with_parts(), SHAPE)
  assert set(plain) == set(BATCH)
  for k in BATCH:
    np.testing.assert_array_equal(plain[k], BATCH[k])


def test_normalize_then_sum_takes_each_part_over_its_whole_group():
  batch = {k: jnp.asarray(v) for k, v in build_batch(_with_parts(), PARTS).items()}
  cfg = LossConfig(reward_aggregation="normalize_then_sum",
                   reward_parts=(("task", 1.0), ("second", 2.0)))
  adv, _ = group_advantages(batch, 2, cfg)
  z = lambda x: (np.asarray(x) - np.mean(x)) / np.std(x, ddof=1)
  total = np.concatenate([z([1.0, 0.0, 0.0]),
                          z([1.0, 1.0, 0.0, 0.0, 1.0]) + 2.0 * z([0.5, 0.0, 2.0, 1.0, 0.5])])
  expected = z(total)
  got = np.asarray(adv).reshape(4, 4)
  np.testing.assert_allclose(got[0, :3], expected[:3], rtol=1e-4)
  np.testing.assert_allclose(np.concatenate([got[1], got[2, :1]]), expected[3:], rtol=1e-4)


def test_groups_without_the_batchs_reward_parts_are_refused():
  with pytest.raises(ValueError, match=r"rollout 10: reward parts \[\]: expected some of "
                                       r"\['task', 'second'\]"):
    check_group(GROUPS[0], PARTS)
  other = dataclasses.replace(GROUPS[0], reward_parts={"task": (1.0, 0.0, 0.0),
                                                       "length": (0.0, 0.0, 1.0)})
  with pytest.raises(ValueError, match=r"reward parts \['length', 'task'\]"):
    check_group(other, PARTS)
  short = dataclasses.replace(GROUPS[0], reward_parts={"task": (1.0, 0.0)})
  with pytest.raises(ValueError, match="reward part 'task': expected a value for each of 3 "
                                       "samples, got 2"):
    check_group(short, PARTS)


def test_rewards_the_workers_weigh_otherwise_than_the_trainer_are_refused():
  # Group 1's rewards are its task part plus 0.5 x its second part, as its worker weighs them.
  second = dataclasses.replace(_with_parts()[1], rewards=(1.25, 1.0, 1.0, 0.5, 1.25))
  check_group(second, PARTS, reward_weights=(("task", 1.0), ("second", 0.5)))
  check_group(second, PARTS)  # no weights given: not checked
  with pytest.raises(ValueError, match=r"rollout 11: samples\[0\].reward 1.25 is not the "
                                       r"weighted sum of its parts .*\(2\): the workers weigh "
                                       r"worker.reward_terms"):
    check_group(second, PARTS, reward_weights=(("task", 1.0), ("second", 2.0)))
  # A reward model's score alone (task reward_model: no task part) weighs 1, as the workers'.
  judged = dataclasses.replace(GROUPS[0], rewards=(0.5, -1.0, 2.0),
                               reward_parts={"reward_model": (0.5, -1.0, 2.0)})
  check_group(judged, dataclasses.replace(SHAPE, reward_parts=("task", "reward_model")),
              reward_weights=(("task", 1.0), ("reward_model", 0.25)))


def test_dr_grpos_normaliser_counts_the_samples_not_the_packed_slots():
  """seq-mean-token-sum-norm (Dr. GRPO): the token sum over the samples x the budget, as
  TRL's batch x max_completion_length; rows of no sample (a step of fewer groups packed
  to its rows, slots unequal groups leave empty) change neither loss nor gradient."""
  graphdef, params = _model()
  cfg = LossConfig(advantage="dr_grpo", agg="seq-mean-token-sum-norm", budget=5)
  padded = {k: np.concatenate([v, empty_batch(2, SHAPE)[k]]) for k, v in BATCH.items()}
  results = []
  for batch in (BATCH, padded):
    fn = jax.value_and_grad(functools.partial(
        rl_loss, graphdef=graphdef, batch={k: jnp.asarray(v) for k, v in batch.items()},
        ref_params=None, num_groups=2, cfg=cfg), has_aux=True)
    (loss, _), grads = jax.jit(fn)(params)
    results.append((loss, grads))
  (loss, grads), (loss_padded, grads_padded) = results
  assert float(loss) != 0.0
  np.testing.assert_allclose(loss_padded, loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_padded), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_a_batchs_padding_rows_add_no_token_to_the_routers_load_balancing():
  """A padding row's one-token prompt (the pad id) counted as a real token: the
  load-balancing loss and its token count changed with rl.groups_per_step's padding."""
  from rlax_ps.train.rl_loss import response_logprobs
  model_cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2,
                          num_heads=2, num_kv_heads=1, max_position_embeddings=32,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
  graphdef, state = nnx.split(nnx.jit(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))())
  routing = jax.jit(lambda s, b: response_logprobs(s, graphdef, b, "xla",
                                                   with_stats=True)[1]["routing"])
  got = []
  for groups in (1, 4):  # the one group alone, then with three padding rows
    shape = dataclasses.replace(SHAPE, groups=groups)
    batch = {k: jnp.asarray(v) for k, v in build_batch([GROUPS[0]], shape).items()}
    got.append(routing(state, batch))
  real = int(len(GROUPS[0].prompt_tokens) + sum(len(r) for r in GROUPS[0].responses))
  assert float(got[0].tokens) == float(got[1].tokens) == 2 * real  # (2 MoE layers)
  np.testing.assert_allclose(got[1].load_balance, got[0].load_balance, rtol=1e-6)


def test_the_entropy_bonus_is_subtracted_from_the_loss():
  """loss.entropy_coef: loss = policy loss - coef * entropy (verl's entropy_coeff), so that
  its gradient raises the entropy."""
  graphdef, params = _model()
  batch = {k: jnp.asarray(v) for k, v in BATCH.items()}
  loss = lambda cfg: jax.jit(lambda p: rl_loss(p, graphdef, batch, None, num_groups=2,
                                               cfg=cfg))(params)
  plain, metrics = loss(LossConfig(backend="xla"))
  bonus, _ = loss(LossConfig(backend="xla", entropy_coef=0.1))
  assert float(metrics["entropy"]) > 0.1
  np.testing.assert_allclose(bonus, plain - 0.1 * metrics["entropy"], rtol=1e-5, atol=1e-6)
