"""Flat name -> array views of a model's parameters (the currency of checkpoints and weight sync)."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
from flax import nnx


def _name(path) -> str:
  return ".".join(str(p) for p in path)


def flatten_params(model_or_state) -> dict[str, jax.Array]:
  """{"layers.0.attn.q_proj.kernel": array, ...} for every nnx.Param of a model or state."""
  state = model_or_state
  if isinstance(model_or_state, nnx.Module):
    state = nnx.state(model_or_state, nnx.Param)
  return {_name(path): var[...] if isinstance(var, nnx.Variable) else var
          for path, var in nnx.to_flat_state(state)}


def assign_params(model: nnx.Module, flat: Mapping[str, jax.Array], *, strict: bool = True) -> None:
  """Write named arrays into the model's params in place, checking names and shapes.

  With strict=True every param must be given and no unknown name may appear.
  """
  state = nnx.state(model, nnx.Param)
  flat_state = list(nnx.to_flat_state(state))
  known = {_name(path) for path, _ in flat_state}
  unknown = sorted(set(flat) - known)
  if unknown:
    raise KeyError(f"unknown parameter {unknown[0]!r} (and {len(unknown) - 1} more); "
                   f"the model has e.g. {sorted(known)[:3]}")
  missing = sorted(known - set(flat))
  if strict and missing:
    raise KeyError(f"missing parameter {missing[0]!r} ({len(missing)} missing in all)")
  for path, var in flat_state:
    name = _name(path)
    if name not in flat:
      continue
    value = flat[name]
    if tuple(value.shape) != tuple(var.shape):
      raise ValueError(f"parameter {name!r}: expected shape {tuple(var.shape)}, "
                       f"got {tuple(value.shape)}")
    var[...] = jnp.asarray(value, dtype=var.dtype)
  nnx.update(model, state)
