"""Which params a run trains: all of them, or (LoRA) only the adapters.

A model with LoRA adapters (params named `lora_a`, `lora_b`) trains those alone; its other
params stay frozen, take no gradient and no optimizer state. Pure functions on the nested
param dicts, so the train steps differentiate the trainable part only.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

ADAPTER_PREFIX = "lora_"


def has_adapters(params: dict) -> bool:
  """Whether `params` holds LoRA adapters."""
  return any(str(getattr(k, "key", k)).startswith(ADAPTER_PREFIX)
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0] for k in path)


def split_trainable(params: dict) -> tuple[dict, dict]:
  """(trainable, frozen) nested dicts partitioning `params`: the LoRA adapters and the rest
  when there are adapters, else (params, {})."""
  if not has_adapters(params):
    return params, {}

  def split(d):
    trainable, frozen = {}, {}
    for k, v in d.items():
      if isinstance(v, dict):
        t, f = split(v)
        if t:
          trainable[k] = t
        if f:
          frozen[k] = f
      elif str(k).startswith(ADAPTER_PREFIX):
        trainable[k] = v
      else:
        frozen[k] = v
    return trainable, frozen

  return split(params)


def split_as(params: dict, like: dict) -> tuple[dict, dict]:
  """(the part of nested dict `params` with the keys of nested dict `like`, the rest): the
  params a gradient tree covers and those it does not, or one model's part of another's."""
  taken, rest = {}, {}
  for k, v in params.items():
    if k not in like:
      rest[k] = v
    elif isinstance(v, dict) and isinstance(like[k], dict):
      taken[k], r = split_as(v, like[k])
      if r:
        rest[k] = r
    else:
      taken[k] = v
  return taken, rest


def join(trainable: dict, frozen: dict) -> dict:
  """The nested union of two disjoint param dicts (split_trainable's inverse)."""
  out = dict(frozen)
  for k, v in trainable.items():
    out[k] = join(v, frozen[k]) if isinstance(v, dict) and k in frozen else v
  return out


def trainable_value_and_grad(fn: Callable[..., tuple[jax.Array, Any]]) -> Callable:
  """jax.value_and_grad(fn, has_aux=True) over the trainable part of fn's first argument:
  (params, *args) -> ((value, aux), gradient of the trainable params)."""

  def wrapped(params, *args, **kwargs):
    trainable, frozen = split_trainable(params)
    return jax.value_and_grad(lambda t: fn(join(t, frozen), *args, **kwargs),
                              has_aux=True)(trainable)

  return wrapped
