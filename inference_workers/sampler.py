"""Batched generation with a KV cache: one jitted prefill, then a decode loop on device.

Prompts are right-padded into power-of-two buckets (batch, prompt length, new-token budget),
so varying lengths and batch sizes reuse a few compiled programs; the actual max_new_tokens
is a traced bound and the loop exits as soon as every row has finished. Two entry points:

- `generate(model, prompts, seeds, params)`: one sample per prompt row.
- `generate_shared(model, prompts, n, seeds, params)`: n samples per prompt; the prompt is
  prefilled once and its KV cache shared by the n samples (`SharedPrefixCache`), through
  `ContinuousBatch` with a slot for every prompt.

`model` is an nnx Transformer (or one whose kernels are int8, see `weights.py`). A sample
depends only on its seed, prompt and weights, not on its batch neighbours.
"""

from __future__ import annotations

import functools
import numbers
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from inference_workers.continuous import ContinuousBatch
from inference_workers.decoding import (MIN_PROMPT_BUCKET, Rows, Sample, bucket, check_request,
                                        empty_routes, knobs, pad_prompts, prefill, record,
                                        routes_last, samples_of)
from inference_workers.sampling import DecodeMode, SamplingParams
from inference_workers.shared_prefix import DecodeFn
from rlax_ps.kernels.dispatch import shared_prefix_decode_attention

__all__ = ["Sample", "generate", "generate_shared"]


def _decode(model, cache, first_logits, lens, seeds, active, knobs_, mode: DecodeMode,
            budget: int, record_routes: bool = False):
  """Sample up to max_new tokens per row; rows are independent except for sharing the loop.
  Returns the final Rows and, `record_routes`, the routes [rows, budget, M, k] of each
  fed-back token (slot t: generated token t)."""
  rows = record(Rows.init(seeds, budget, done=~active), 0, first_logits, knobs_, mode)
  routes = empty_routes(model.config, seeds.shape[0], budget) if record_routes else None

  def cond(carry):
    step, _, rows, _ = carry
    return (step < knobs_[0]) & ~jax.numpy.all(rows.done)

  def body(carry):
    step, cache, rows, routes = carry
    positions = (lens + step - 1)[:, None]
    hidden, cache, *routing = model.hidden_states(rows.token[:, None], positions=positions,
                                                  cache=cache, record_routes=record_routes)
    if record_routes:  # this step fed generated token step - 1
      routes = routes.at[:, step - 1].set(routes_last(routing[0].picks)[:, 0])
    rows = record(rows, step, model.logits_from_hidden(hidden)[:, 0], knobs_, mode)
    return step + 1, cache, rows, routes

  _, _, rows, routes = jax.lax.while_loop(cond, body, (np.int32(1), cache, rows, routes))
  return rows, routes


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "budget", "record_routes"))
def _generate_jit(graphdef, state, tokens, lens, seeds, active, knobs_, *, mode, budget,
                  record_routes):
  model = nnx.merge(graphdef, state)
  logits, cache, prompt_routes = prefill(model, tokens, lens, tokens.shape[1] + budget,
                                         record_routes)
  rows, routes = _decode(model, cache, logits, lens, seeds, active, knobs_, mode, budget,
                         record_routes)
  out = (rows.tokens, rows.logp, rows.slogp, rows.lengths, rows.reasons)
  return out + (routes, prompt_routes) if record_routes else out


def generate(model, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
             params: SamplingParams = SamplingParams(), *, record_routes: bool = False
             ) -> list[Sample]:
  """One sample per prompt (row i drawn with seeds[i]); `record_routes`: each Sample also
  carries its experts (mixture of experts, for routing replay)."""
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model: expected an nnx Transformer, got {type(model).__name__}")
  graphdef, state = nnx.split(model)
  config = model.config
  check_request(config, prompts, seeds, len(prompts), params)
  batch = bucket(len(prompts))
  tokens, lens = pad_prompts(prompts, batch, bucket(max(map(len, prompts)), MIN_PROMPT_BUCKET),
                             config.vocab_size)
  active = np.arange(batch) < len(prompts)
  seeds_arr = np.zeros((batch,), np.int32)
  seeds_arr[:len(prompts)] = np.asarray(seeds, np.int64)
  out = jax.device_get(_generate_jit(graphdef, state, tokens, lens, seeds_arr, active,
                                     knobs(params), mode=params.mode,
                                     budget=bucket(params.max_new_tokens),
                                     record_routes=record_routes))
  tokens_, logp, slogp, lengths, reasons, *routes = out
  return samples_of(tokens_, logp, slogp, lengths[:len(prompts)], reasons,
                    *(routes or (None, None)), prompt_lens=lens)


def generate_shared(model, prompts: Sequence[Sequence[int]], n: int, seeds,
                    params: SamplingParams = SamplingParams(),
                    decode_fn: DecodeFn = shared_prefix_decode_attention, *,
                    record_routes: bool = False) -> list[list[Sample]]:
  """n samples per prompt from one shared prefill; seeds [len(prompts), n] (sample j of prompt b
  uses seeds[b][j] and equals `generate` on that prompt with that seed). `record_routes`: as
  in `generate`; the n samples of a prompt share its prompt_routes."""
  if not isinstance(n, numbers.Integral) or isinstance(n, (bool, np.bool_)) or n < 1:
    raise ValueError(f"n: expected a positive int (samples per prompt), got {n!r}")
  n = int(n)
  seeds = np.asarray(seeds)
  if seeds.shape != (len(prompts), n):
    raise ValueError(f"seeds: expected shape ({len(prompts)}, {n}) (prompts x samples), "
                     f"got {seeds.shape}")
  if seeds.size and not np.issubdtype(seeds.dtype, np.integer):
    raise ValueError(f"seeds: expected ints, got {seeds.dtype}")
  seeds = seeds.astype(np.int64)
  if len(prompts) == 0:
    raise ValueError("prompts: expected at least one prompt, got none")
  batch = ContinuousBatch(model, n, bucket(len(prompts)), params, decode_fn=decode_fn,
                          record_routes=record_routes)
  for i, (prompt, row) in enumerate(zip(prompts, seeds)):
    batch.add(i, prompt, row)
  groups = dict(batch.run())
  return [groups[i] for i in range(len(prompts))]
