"""The optimizer from config: AdamW with global-norm clipping and a warmup+cosine schedule.

Gradient accumulation over micro-batches lives in the train step (`rlax_ps.train.step`),
which averages the micro-batch gradients inside one jitted call before this update runs.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

# Defaults for every optimizer field; a config may set any subset.
DEFAULTS = {
    "lr": 3e-4,  # Peak learning rate, reached after warmup.
    "warmup_steps": 100,  # Linear warmup from 0 to lr.
    "decay_steps": 0,  # Cosine decay length in steps (warmup included); 0 = the run's steps.
    "min_lr_ratio": 0.1,  # The cosine ends at lr * min_lr_ratio.
    "b1": 0.9,
    "b2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.1,  # Decoupled; applied to matrices only (embeddings too; not norms, biases).
    "clip_norm": 1.0,  # Global-norm clip before Adam; 0 disables.
    "grad_accum_steps": 1,  # Micro-batches per update (the batch is split into this many).
  # An update whose gradients are not all finite is skipped (params and moments kept); this
  # many in a row stop the run with an error, at its last checkpoint.
  "max_nonfinite_steps": 5,
}


def setting(cfg: Mapping[str, Any] | Any, key: str):
  """Optimizer setting `key` of a config block or dict, its default where unset."""
  if isinstance(cfg, Mapping):
    return cfg.get(key, DEFAULTS[key])
  return getattr(cfg, key, DEFAULTS[key])


def check_optimizer_config(cfg, total_steps: int) -> None:
  """Raise a ValueError naming the first field that is out of range."""
  def need(cond, field, expected):
    if not cond:
      raise ValueError(f"optimizer.{field}: expected {expected}, got {setting(cfg, field)!r}")

  need(setting(cfg, "lr") > 0, "lr", "> 0")
  need(int(setting(cfg, "warmup_steps")) >= 0, "warmup_steps", ">= 0")
  need(int(setting(cfg, "decay_steps")) >= 0, "decay_steps", ">= 0 (0 = the run's length)")
  need(0 <= setting(cfg, "min_lr_ratio") <= 1, "min_lr_ratio", "in [0, 1]")
  need(0 <= setting(cfg, "b1") < 1, "b1", "in [0, 1)")
  need(0 <= setting(cfg, "b2") < 1, "b2", "in [0, 1)")
  need(setting(cfg, "eps") > 0, "eps", "> 0")
  need(setting(cfg, "weight_decay") >= 0, "weight_decay", ">= 0")
  need(setting(cfg, "clip_norm") >= 0, "clip_norm", ">= 0 (0 disables clipping)")
  need(int(setting(cfg, "grad_accum_steps")) >= 1, "grad_accum_steps", ">= 1")
  need(int(setting(cfg, "max_nonfinite_steps")) >= 1, "max_nonfinite_steps", ">= 1")
  if total_steps < 1:
    raise ValueError(f"train.steps: expected >= 1, got {total_steps}")


def learning_rate_schedule(cfg, total_steps: int) -> optax.Schedule:
  """Linear warmup to lr over warmup_steps, then cosine down to lr * min_lr_ratio at
  decay_steps."""
  lr = float(setting(cfg, "lr"))
  warmup = int(setting(cfg, "warmup_steps"))
  decay = int(setting(cfg, "decay_steps")) or total_steps
  decay = max(decay, warmup + 1)
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=decay,
      end_value=lr * float(setting(cfg, "min_lr_ratio")))
  # Update k (counting from 0) uses base(k + 1) after a warmup (the first update already
  # moves the weights), base(k) without one (the first update at the peak).
  return (lambda count: base(count + 1)) if warmup else base


def schedule_settings(cfg, total_steps: int) -> dict[str, Any]:
  """The schedule as numbers, decay_steps resolved: what a checkpoint records so that a
  resumed run can tell whether, and how, its learning rate changes."""
  return {"lr": float(setting(cfg, "lr")), "warmup_steps": int(setting(cfg, "warmup_steps")),
          "decay_steps": int(setting(cfg, "decay_steps")) or int(total_steps),
          "min_lr_ratio": float(setting(cfg, "min_lr_ratio"))}


def saved_schedule(metadata: Mapping[str, Any] | None, steps_field: str
                   ) -> dict[str, Any] | None:
  """The schedule a checkpoint's metadata records; for a checkpoint that records none, the
  one its saved config implies (its `steps_field`, e.g. "rl.steps", as the horizon); None
  when neither is there (or no checkpoint: `metadata` None)."""
  if not metadata:
    return None
  if metadata.get("schedule"):
    return dict(metadata["schedule"])
  config = metadata.get("config") or {}
  steps = config
  for key in steps_field.split("."):
    steps = steps.get(key) if isinstance(steps, Mapping) else None
  if not isinstance(config.get("optimizer"), Mapping) or not isinstance(steps, int):
    return None
  return schedule_settings(config["optimizer"], steps)


def resumed_optimizer_config(cfg, total_steps: int, saved: Mapping[str, Any] | None,
                             step: int, steps_field: str) -> tuple[dict[str, Any], str | None]:
  """(optimizer config, log line or None) for a run resuming at `step` from a checkpoint
  whose schedule was `saved` (schedule_settings; None: nothing to follow).

  With decay_steps unset (0) a decaying schedule keeps the checkpoint's horizon when
  `steps_field` changed: the lr goes on down the curve it was on, and stays at its floor past
  the end, instead of jumping to the curve stretched over the new length (set decay_steps to
  stretch it). Any other change is applied as asked; the line names it and the lr it moves
  the next step to. A constant schedule after warmup has no horizon: a new length is silent."""
  plain = dict(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg)
  if saved is None:
    return plain, None
  decaying = float(setting(plain, "min_lr_ratio")) < 1.0
  pinned = (decaying and not int(setting(plain, "decay_steps"))
            and int(saved["decay_steps"]) != int(total_steps))
  if pinned:
    plain["decay_steps"] = int(saved["decay_steps"])
  now = schedule_settings(plain, total_steps)
  was = {k: saved.get(k, now[k]) for k in now}
  if not decaying and float(was["min_lr_ratio"]) >= 1.0:  # constant: no horizon to compare
    was["decay_steps"] = now["decay_steps"]
  changed = [f"optimizer.{k}: {was[k]!r} in the checkpoint, {now[k]!r} now"
             for k in now if was[k] != now[k]]
  lr_was = float(learning_rate_schedule(was, total_steps)(step))
  lr_now = float(learning_rate_schedule(now, total_steps)(step))
  if changed:
    return plain, (f"optimizer: resuming at step {step} with another schedule "
                   f"({'; '.join(changed)}): the next step's lr is {lr_now:.4g}, "
                   f"{lr_was:.4g} on the checkpoint's")
  if pinned:
    end = max(now["decay_steps"], now["warmup_steps"] + 1)  # the first step at the floor
    return plain, (f"optimizer: {steps_field} is {total_steps} now, the lr schedule keeps the "
                   f"checkpoint's decay over {now['decay_steps']} steps (next step's lr "
                   f"{lr_now:.4g}, {now['lr'] * now['min_lr_ratio']:.4g} from step {end} "
                   f"on); set optimizer.decay_steps to decay over another length")
  return plain, None


def decay_mask(params):
  """Weight decay on matrices only: norms and biases are left alone, an MoE's stacked
  expert biases (2-D, one row an expert: gpt-oss's gate_bias) too."""
  def decayed(path, p):
    name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1]))) if path else ""
    return p.ndim >= 2 and not name.endswith(("bias", "scale"))
  return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(cfg, total_steps: int, updates_per_step: int = 1
                   ) -> optax.GradientTransformation:
  """AdamW(schedule) after optional global-norm clipping, as the config says, skipping any
  update whose gradients are not all finite (optax.apply_if_finite, which never gives up:
  `check_finite_updates` stops the run instead, before a NaN reaches the weights).
  `updates_per_step` (rl.updates_per_batch): optimizer updates a step takes, which share
  the step's learning rate (the schedule counts steps, as its fields do: it ran that many
  times too fast)."""
  check_optimizer_config(cfg, total_steps)
  schedule = learning_rate_schedule(cfg, total_steps)
  if updates_per_step > 1:
    schedule = lambda count, per=updates_per_step, of_step=schedule: of_step(count // per)  # noqa: E731
  parts = []
  if setting(cfg, "clip_norm") > 0:
    parts.append(optax.clip_by_global_norm(float(setting(cfg, "clip_norm"))))
  parts.append(optax.adamw(
      learning_rate=schedule, b1=float(setting(cfg, "b1")),
      b2=float(setting(cfg, "b2")), eps=float(setting(cfg, "eps")),
      weight_decay=float(setting(cfg, "weight_decay")), mask=decay_mask))
  return _in_float32(optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=_NEVER))


def _in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` on float32 gradients, params and state, whatever the params' dtype: Adam's
  moments of bfloat16 params in bfloat16 would not decay (0.999 * nu rounds back to nu), and
  their gradients (float32 once averaged) would not match them. optax.apply_updates rounds
  each update into its param's dtype."""
  def up(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def update(grads, state, params=None):
    return inner.update(up(grads), state, None if params is None else up(params))

  return optax.GradientTransformation(lambda params: inner.init(up(params)), update)


_NEVER = 2**31 - 1  # apply_if_finite's count saturates below it: it never applies a NaN


def skip_counts(opt_state) -> dict[str, jax.Array]:
  """The step's metrics of make_optimizer's skipping: updates skipped in a row (0 after a
  finite one) and in the whole run."""
  if not isinstance(opt_state, optax.ApplyIfFiniteState):
    return {}
  return {"nonfinite_streak": opt_state.notfinite_count,
          "skipped_updates": opt_state.total_notfinite}


def check_finite_updates(metrics: Mapping[str, float], cfg, step: int, prefix: str = ""
                         ) -> None:
  """Raises a FloatingPointError once `metrics` (skip_counts' fetched, under `prefix`) show
  optimizer.max_nonfinite_steps updates in a row skipped for non-finite gradients: the run
  makes no progress, and stopping before its next checkpoint keeps the last good one."""
  streak = int(metrics.get(prefix + "nonfinite_streak", 0))
  limit = int(setting(cfg, "max_nonfinite_steps"))
  if streak >= limit:
    raise FloatingPointError(
        f"optimizer: the {prefix.rstrip('_') or 'model'}'s gradients were not finite in the last {streak} "
        f"updates (step {step}); each was skipped, and the run stops at its last checkpoint "
        f"(optimizer.max_nonfinite_steps={limit}): lower optimizer.lr, or look for the "
        f"batches that overflow")


def grad_accum_steps(cfg) -> int:
  return int(setting(cfg, "grad_accum_steps"))
