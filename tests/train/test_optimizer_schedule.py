"""Optimizer from config: warmup+cosine schedule, clipping, decay mask, accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlax_ps import optim
from rlax_ps.train.step import loss_and_grads, split_micro_batches


def test_schedule_warms_up_linearly_then_decays_by_cosine():
  cfg = {"lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.1}
  sched = optim.learning_rate_schedule(cfg, total_steps=20)
  lrs = [float(sched(k)) for k in range(20)]
  np.testing.assert_allclose(lrs[:4], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)  # update k uses k+1.
  assert all(a > b for a, b in zip(lrs[3:-1], lrs[4:]))
  np.testing.assert_allclose(lrs[-1], 0.1, rtol=1e-5)  # Ends at lr * min_lr_ratio.
  mid = 4 + (20 - 4) / 2  # Halfway through the cosine: the mean of peak and floor.
  np.testing.assert_allclose(float(sched(mid - 1)), 0.55, rtol=1e-5)


def test_clipping_bounds_the_gradient_the_optimizer_sees():
  cfg = {"lr": 1.0, "warmup_steps": 0, "clip_norm": 1.0, "weight_decay": 0.0, "b1": 0.9}
  params = {"w": jnp.zeros((3, 3))}
  grads = {"w": jnp.full((3, 3), 100.0)}  # global norm 300

  def first_moment_norm(config):
    tx = optim.make_optimizer(config, total_steps=5)
    _, state = tx.update(grads, tx.init(params), params)
    return float(optax.global_norm(optax.tree_utils.tree_get(state, "mu")))

  # Adam's first moment after one update is (1 - b1) * the gradient it was given.
  assert first_moment_norm(cfg) == pytest.approx(0.1, rel=1e-5)  # clipped to norm 1
  assert first_moment_norm(dict(cfg, clip_norm=0.0)) == pytest.approx(30.0, rel=1e-5)


def test_weight_decay_skips_vectors():
  cfg = {"lr": 1.0, "warmup_steps": 0, "weight_decay": 0.5, "clip_norm": 0.0}
  tx = optim.make_optimizer(cfg, total_steps=5)
  params = {"kernel": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params)
  assert np.all(np.asarray(updates["kernel"]) < 0)  # Decayed towards 0.
  assert np.all(np.asarray(updates["scale"]) == 0)  # Left alone.
  # An MoE's expert biases are 2-D (an expert a row): left alone too (gpt-oss's were decayed).
  experts = {"experts": {"gate_bias": jnp.ones((4, 3)), "gate_proj": jnp.ones((4, 2, 3))}}
  zero = jax.tree.map(jnp.zeros_like, experts)
  updates, _ = tx.update(zero, tx.init(experts), experts)
  assert np.all(np.asarray(updates["experts"]["gate_bias"]) == 0)
  assert np.all(np.asarray(updates["experts"]["gate_proj"]) < 0)


def test_without_warmup_the_first_update_is_at_the_peak_learning_rate():
  schedule = optim.learning_rate_schedule({"lr": 1.0, "warmup_steps": 0}, total_steps=10)
  assert float(schedule(0)) == pytest.approx(1.0)  # it was the cosine's second value
  assert float(schedule(9)) < float(schedule(1)) < 1.0
  warm = optim.learning_rate_schedule({"lr": 1.0, "warmup_steps": 4}, total_steps=10)
  assert float(warm(0)) == pytest.approx(0.25) and float(warm(3)) == pytest.approx(1.0)


def test_bad_optimizer_fields_are_named():
  with pytest.raises(ValueError, match="optimizer.lr: expected > 0, got -1"):
    optim.make_optimizer({"lr": -1}, total_steps=5)
  with pytest.raises(ValueError, match="optimizer.grad_accum_steps"):
    optim.make_optimizer({"grad_accum_steps": 0}, total_steps=5)
  with pytest.raises(ValueError, match="train.steps"):
    optim.make_optimizer({}, total_steps=0)
  with pytest.raises(ValueError, match="optimizer.max_nonfinite_steps: expected >= 1, got 0"):
    optim.make_optimizer({"max_nonfinite_steps": 0}, total_steps=5)


def test_an_update_with_non_finite_gradients_is_skipped_and_counted():
  """NaN or inf gradients move neither the params nor Adam's moments and count in a row;
  the next finite update applies and ends the streak (the total stays)."""
  tx = optim.make_optimizer({"lr": 0.1, "warmup_steps": 0}, total_steps=5)
  params = {"w": jnp.ones((2, 3))}
  state = tx.init(params)
  for n, bad in enumerate([np.nan, np.inf], 1):
    updates, state = tx.update({"w": jnp.ones((2, 3)).at[0, 1].set(bad)}, state, params)
    assert not np.any(np.asarray(updates["w"]))
    counts = {k: int(v) for k, v in optim.skip_counts(state).items()}
    assert counts == {"nonfinite_streak": n, "skipped_updates": n}
    assert not np.any(np.asarray(optax.tree_utils.tree_get(state, "mu")["w"]))
  updates, state = tx.update({"w": jnp.ones((2, 3))}, state, params)
  assert np.all(np.asarray(updates["w"]) < 0)
  assert {k: int(v) for k, v in optim.skip_counts(state).items()} == {
      "nonfinite_streak": 0, "skipped_updates": 2}


def test_bfloat16_params_train_with_float32_moments_that_decay():
  """bfloat16 params (model.param_dtype): an averaged float32 gradient made Adam's moments
  float32 in one branch of the finite-update check and bfloat16 in the other (the jitted
  step failed); in bfloat16, nu * 0.999 rounds back to nu."""
  tx = optim.make_optimizer({"lr": 0.1, "warmup_steps": 0, "b2": 0.999}, total_steps=5)
  params = {"w": jnp.ones((2, 3), jnp.bfloat16)}
  state = tx.init(params)
  assert optax.tree_utils.tree_get(state, "nu")["w"].dtype == jnp.float32

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = step(params, state, {"w": jnp.full((2, 3), 2.0, jnp.float32)})
  assert params["w"].dtype == jnp.bfloat16 and float(params["w"][0, 0]) < 1.0
  nu = float(optax.tree_utils.tree_get(state, "nu")["w"][0, 0])
  params, state = step(params, state, {"w": jnp.zeros((2, 3), jnp.bfloat16)})
  assert float(optax.tree_utils.tree_get(state, "nu")["w"][0, 0]) == pytest.approx(nu * 0.999)


def test_too_many_skipped_updates_in_a_row_stop_the_run_naming_the_field():
  cfg = {"max_nonfinite_steps": 3}
  optim.check_finite_updates({"nonfinite_streak": 2.0}, cfg, step=7)  # not yet
  optim.check_finite_updates({}, cfg, step=7)  # a step without the counts (critic warming)
  with pytest.raises(FloatingPointError, match=r"model's gradients .* last 3 updates \(step 8\)"
                     r".*max_nonfinite_steps=3"):
    optim.check_finite_updates({"nonfinite_streak": 3.0}, cfg, step=8)
  with pytest.raises(FloatingPointError, match="the critic's gradients"):
    optim.check_finite_updates({"critic_nonfinite_streak": 3.0}, cfg, 8, prefix="critic_")


def _toy_loss_sum(params, graphdef, batch):
  del graphdef
  pred = batch["x"] @ params["w"]
  err = ((pred - batch["y"]) ** 2).sum(-1) * batch["loss_mask"]
  return err.sum(), {"tokens": batch["loss_mask"].sum(), "correct": jnp.zeros(())}


def test_micro_batch_accumulation_equals_the_full_batch():
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(8, 3)).astype(np.float32),
           "y": rng.normal(size=(8, 2)).astype(np.float32),
           "loss_mask": np.array([1, 1, 0, 1, 1, 1, 0, 1], np.float32)}
  params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
  full_loss, full_grads, _ = loss_and_grads(params, None, batch, 1, _toy_loss_sum)
  for micro in (2, 4):
    loss, grads, metrics = loss_and_grads(params, None, batch, micro, _toy_loss_sum)
    np.testing.assert_allclose(float(loss), float(full_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(full_grads["w"]), rtol=1e-5)
    assert float(metrics["tokens"]) == 6.0


def test_micro_batches_interleave_rows():
  x = np.arange(8)
  micro = split_micro_batches({"x": x}, 2)["x"]
  np.testing.assert_array_equal(np.asarray(micro), [[0, 2, 4, 6], [1, 3, 5, 7]])
  with pytest.raises(ValueError, match="grad_accum_steps=3"):
    split_micro_batches({"x": x}, 3)


def test_the_updates_of_one_step_share_its_learning_rate():
  """rl.updates_per_batch=3: the schedule counts steps, as warmup_steps and decay_steps do;
  counting updates it warmed up and decayed three times too fast."""
  cfg = {"lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.0, "clip_norm": 0.0,
         "weight_decay": 0.0, "b1": 0.0, "b2": 0.0, "eps": 1e-12}
  per_step = optim.learning_rate_schedule(cfg, 10)
  tx = optim.make_optimizer(cfg, 10, updates_per_step=3)
  params = {"w": jnp.zeros(())}
  state = tx.init(params)
  for count in range(9):  # sign-like Adam (b1=b2=0): each update moves by the lr applied
    updates, state = tx.update({"w": jnp.ones(())}, state, params)
    assert float(-updates["w"]) == pytest.approx(float(per_step(count // 3)), rel=1e-5), count
