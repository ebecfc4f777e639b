"""The optimizer from config: AdamW with global-norm clipping and a warmup+cosine schedule.

Gradient accumulation over micro-batches lives in the train step (`rlax_ps.train.step`),
which averages the micro-batch gradients inside one jitted call before this update runs.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
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
    "weight_decay": 0.1,  # Decoupled; applied to matrices only (not norms, biases).
    "clip_norm": 1.0,  # Global-norm clip before Adam; 0 disables.
    "grad_accum_steps": 1,  # Micro-batches per update (the batch is split into this many).
}


def _get(cfg: Mapping[str, Any] | Any, key: str):
  if isinstance(cfg, Mapping):
    return cfg.get(key, DEFAULTS[key])
  return getattr(cfg, key, DEFAULTS[key])


def check_optimizer_config(cfg, total_steps: int) -> None:
  """Raise a ValueError naming the first field that is out of range."""
  def need(cond, field, expected):
    if not cond:
      raise ValueError(f"optimizer.{field}: expected {expected}, got {_get(cfg, field)!r}")

  need(_get(cfg, "lr") > 0, "lr", "> 0")
  need(int(_get(cfg, "warmup_steps")) >= 0, "warmup_steps", ">= 0")
  need(int(_get(cfg, "decay_steps")) >= 0, "decay_steps", ">= 0 (0 = the run's length)")
  need(0 <= _get(cfg, "min_lr_ratio") <= 1, "min_lr_ratio", "in [0, 1]")
  need(0 <= _get(cfg, "b1") < 1, "b1", "in [0, 1)")
  need(0 <= _get(cfg, "b2") < 1, "b2", "in [0, 1)")
  need(_get(cfg, "eps") > 0, "eps", "> 0")
  need(_get(cfg, "weight_decay") >= 0, "weight_decay", ">= 0")
  need(_get(cfg, "clip_norm") >= 0, "clip_norm", ">= 0 (0 disables clipping)")
  need(int(_get(cfg, "grad_accum_steps")) >= 1, "grad_accum_steps", ">= 1")
  if total_steps < 1:
    raise ValueError(f"train.steps: expected >= 1, got {total_steps}")


def learning_rate_schedule(cfg, total_steps: int) -> optax.Schedule:
  """Linear warmup to lr over warmup_steps, then cosine down to lr * min_lr_ratio at
  decay_steps."""
  lr = float(_get(cfg, "lr"))
  warmup = int(_get(cfg, "warmup_steps"))
  decay = int(_get(cfg, "decay_steps")) or total_steps
  decay = max(decay, warmup + 1)
  base = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=decay,
      end_value=lr * float(_get(cfg, "min_lr_ratio")))
  # Update k (counting from 0) uses base(k + 1): the first update already moves the weights.
  return lambda count: base(count + 1)


def decay_mask(params):
  """Weight decay on matrices only: norms and biases (ndim < 2) are left alone."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW(schedule) after optional global-norm clipping, as the config says."""
  check_optimizer_config(cfg, total_steps)
  parts = []
  if _get(cfg, "clip_norm") > 0:
    parts.append(optax.clip_by_global_norm(float(_get(cfg, "clip_norm"))))
  parts.append(optax.adamw(
      learning_rate=learning_rate_schedule(cfg, total_steps), b1=float(_get(cfg, "b1")),
      b2=float(_get(cfg, "b2")), eps=float(_get(cfg, "eps")),
      weight_decay=float(_get(cfg, "weight_decay")), mask=decay_mask))
  return optax.chain(*parts)


def grad_accum_steps(cfg) -> int:
  return int(_get(cfg, "grad_accum_steps"))
