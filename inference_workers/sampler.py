"""Batched generation with a KV cache: one jitted prefill, then a decode loop on device.

Prompts are right-padded into power-of-two buckets (batch, prompt length, new-token budget),
so varying lengths and batch sizes reuse a few compiled programs; the actual max_new_tokens
is a traced bound and the loop exits as soon as every row has finished. Two entry points:

- `generate(model, prompts, seeds, params)`: one sample per prompt row.
- `generate_shared(model, prompts, n, seeds, params)`: n samples per prompt; the prompt is
  prefilled once and its KV cache shared by the n samples (`SharedPrefixCache`).

`model` is an nnx Transformer (or one whose kernels are int8, see `weights.py`). Row i uses key fold_in(key(seeds[i]), step) at each step, so a
sample depends only on its seed, prompt and weights, not on its batch neighbours.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference_workers.sampling import DecodeMode, SamplingParams, choose_tokens, step_keys
from inference_workers.shared_prefix import DecodeFn, SharedPrefixCache
from rlax_ps.kernels.dispatch import shared_prefix_decode_attention
from rlax_ps.models.kv_cache import KVCache

FINISH_REASONS = ("length", "stop")  # index = code used on device
MIN_PROMPT_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class Sample:
  """One generated continuation.

  tokens: generated ids, the stop token included when there was one.
  logprobs: log_softmax of the model's logits (temperature 1) at each token: the policy's
    log-prob, what importance ratios against the trainer's policy need.
  sampling_logprobs: log-prob of each token under the distribution it was drawn from
    (temperature, top-k, top-p applied and renormalised; 0 when greedy): the behaviour log-prob.
  finish_reason: "stop" (emitted a stop token) or "length" (reached max_new_tokens).
  prompt_routes, routes (`record_routes`, mixture of experts): the experts each MoE layer's
    router picked, [prompt tokens, M, k] for the prompt and [len(tokens) - 1, M, k] for the
    generated tokens fed back (the last one never is): what routing replay trains with.
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  sampling_logprobs: np.ndarray
  finish_reason: str
  prompt_routes: np.ndarray | None = None
  routes: np.ndarray | None = None


def bucket(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum)."""
  n = max(int(n), minimum)
  return 1 << (n - 1).bit_length()


def _split(model):
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model: expected an nnx Transformer, got {type(model).__name__}")
  graphdef, state = nnx.split(model)
  return graphdef, state, model.config


def _pad_prompts(prompts: Sequence[Sequence[int]], batch: int, length: int, vocab: int):
  tokens = np.zeros((batch, length), np.int32)
  lens = np.ones((batch,), np.int32)  # padding rows: one token 0, finished from the start
  for i, p in enumerate(prompts):
    p = np.asarray(p, np.int64).reshape(-1)
    if p.size == 0:
      raise ValueError(f"prompts[{i}]: expected at least one token, got an empty prompt")
    if p.min() < 0 or p.max() >= vocab:
      raise ValueError(f"prompts[{i}]: token ids must lie in [0, {vocab}), got "
                       f"[{p.min()}, {p.max()}]")
    tokens[i, :p.size] = p
    lens[i] = p.size
  return tokens, lens


def _check(model_config, prompts, seeds, rows, params: SamplingParams):
  if not isinstance(params, SamplingParams):
    raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
  if len(prompts) == 0:
    raise ValueError("prompts: expected at least one prompt, got none")
  if len(seeds) != rows:
    raise ValueError(f"seeds: expected {rows} seeds (one per sample), got {len(seeds)}")
  longest = max(len(p) for p in prompts)
  if longest + params.max_new_tokens > model_config.max_position_embeddings:
    raise ValueError(f"prompt length {longest} + max_new_tokens {params.max_new_tokens} exceeds "
                     f"max_position_embeddings={model_config.max_position_embeddings}")
  bad = [s for s in seeds if not 0 <= int(s) < 2 ** 31]
  if bad:
    raise ValueError(f"seeds: expected ints in [0, 2**31), got {bad[0]!r}")


ROUTE_DTYPE = jnp.int16  # expert ids on device (-1: not recorded)


def _routes_last(picks):
  """The model's recorded picks [M, B, T, k] -> [B, T, M, k] ROUTE_DTYPE."""
  return jnp.transpose(picks, (1, 2, 0, 3)).astype(ROUTE_DTYPE)


def _prefill(model, tokens, lens, cache_len: int, record_routes: bool = False):
  """Prefill right-padded prompts; returns (last-token logits [B, V], filled KVCache, the
  prompts' routes [B, P, M, k] when `record_routes`, else None)."""
  b, p = tokens.shape
  segment_ids = (jnp.arange(p)[None, :] < lens[:, None]).astype(jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
  cache = KVCache.init(model.config, b, cache_len)
  hidden, cache, *routing = model.hidden_states(
      tokens, positions=positions, segment_ids=segment_ids, cache=cache,
      record_routes=record_routes)
  last = jnp.take_along_axis(hidden, (lens - 1)[:, None, None], axis=1)
  routes = _routes_last(routing[0].picks) if record_routes else None
  return model.logits_from_hidden(last)[:, 0], cache, routes


def _decode(model, cache, first_logits, lens, seeds, active, knobs, mode: DecodeMode,
            budget: int, record_routes: bool = False):
  """Sample up to max_new tokens per row; rows are independent except for sharing the loop.

  knobs = (max_new int32, temperature f32, top_p f32, stop token ids [K] int32, -1 = none).
  Returns (tokens, logp, sampling logp, lengths, finish reasons) and, `record_routes`, the
  routes [rows, budget, M, k] of each fed-back token (slot t: generated token t).
  """
  max_new, temperature, top_p, stops = knobs
  rows = first_logits.shape[0]
  out_tokens = jnp.zeros((rows, budget), jnp.int32)
  out_logp = jnp.zeros((rows, budget), jnp.float32)
  out_slogp = jnp.zeros((rows, budget), jnp.float32)
  c = model.config
  out_routes = (jnp.full((rows, budget, len(c.moe_layers), c.num_experts_per_tok), -1,
                         ROUTE_DTYPE) if record_routes else None)

  def record(step, logits, done, lengths, reasons, tokens_buf, logp_buf, slogp_buf):
    token, slogp, logp = choose_tokens(logits, step_keys(seeds, step), mode, temperature, top_p)
    live = ~done
    token = jnp.where(live, token, 0)
    tokens_buf = tokens_buf.at[:, step].set(token)
    logp_buf = logp_buf.at[:, step].set(jnp.where(live, logp, 0.0))
    slogp_buf = slogp_buf.at[:, step].set(jnp.where(live, slogp, 0.0))
    lengths = lengths + live.astype(jnp.int32)
    stopped = live & jnp.any(token[:, None] == stops[None, :], axis=-1)
    reasons = jnp.where(stopped, FINISH_REASONS.index("stop"), reasons)
    done = done | stopped | (step + 1 >= max_new)
    return token, done, lengths, reasons, tokens_buf, logp_buf, slogp_buf

  zeros = jnp.zeros((rows,), jnp.int32)
  token, done, lengths, reasons, *bufs = record(
      0, first_logits, ~active, zeros, zeros, out_tokens, out_logp, out_slogp)

  def cond(carry):
    step, _, _, done, *_ = carry
    return (step < max_new) & ~jnp.all(done)

  def body(carry):
    step, cache, token, done, lengths, reasons, routes, *bufs = carry
    positions = (lens + step - 1)[:, None]
    hidden, cache, *routing = model.hidden_states(token[:, None], positions=positions,
                                                  cache=cache, record_routes=record_routes)
    if record_routes:  # this step fed generated token step - 1
      routes = routes.at[:, step - 1].set(_routes_last(routing[0].picks)[:, 0])
    logits = model.logits_from_hidden(hidden)[:, 0]
    token, done, lengths, reasons, *bufs = record(step, logits, done, lengths, reasons, *bufs)
    return (step + 1, cache, token, done, lengths, reasons, routes, *bufs)

  carry = (jnp.ones((), jnp.int32), cache, token, done, lengths, reasons, out_routes, *bufs)
  _, _, _, _, lengths, reasons, routes, tokens_buf, logp_buf, slogp_buf = jax.lax.while_loop(
      cond, body, carry)
  out = (tokens_buf, logp_buf, slogp_buf, lengths, reasons)
  return out + (routes,) if record_routes else out


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "budget", "record_routes"))
def _generate_jit(graphdef, state, tokens, lens, seeds, active, knobs, *, mode, budget,
                  record_routes):
  model = nnx.merge(graphdef, state)
  logits, cache, prompt_routes = _prefill(model, tokens, lens, tokens.shape[1] + budget,
                                          record_routes)
  out = _decode(model, cache, logits, lens, seeds, active, knobs, mode, budget, record_routes)
  return out + (prompt_routes,) if record_routes else out


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "budget", "n", "decode_fn",
                                             "record_routes"))
def _generate_shared_jit(graphdef, state, tokens, lens, seeds, active, knobs, *, mode, budget,
                         n, decode_fn, record_routes):
  model = nnx.merge(graphdef, state)
  logits, prefill, prompt_routes = _prefill(model, tokens, lens, tokens.shape[1],
                                            record_routes)
  cache = SharedPrefixCache.from_prefill(prefill, lens, n, budget, decode_fn)
  row_lens = jnp.repeat(lens, n)
  row_active = jnp.repeat(active, n)
  out = _decode(model, cache, jnp.repeat(logits, n, axis=0), row_lens, seeds.reshape(-1),
                row_active, knobs, mode, budget, record_routes)
  return out + (prompt_routes,) if record_routes else out


def _knobs(params: SamplingParams):
  """The traced sampling numbers; stop ids padded with -1 to a power-of-two count."""
  stops = np.full((bucket(len(params.stop_tokens), 4),), -1, np.int32)
  stops[:len(params.stop_tokens)] = params.stop_tokens
  return (np.int32(params.max_new_tokens), np.float32(max(params.temperature, 1e-6)),
          np.float32(params.top_p), stops)


def _samples(outputs, rows: int, prompt_lens: Sequence[int], prompt_row=lambda i: i
             ) -> list[Sample]:
  """Host Samples of the first `rows` rows; row i's prompt is prompt row prompt_row(i)."""
  tokens, logp, slogp, lengths, reasons, *routes = jax.device_get(outputs)
  result = []
  for i in range(rows):
    k, p = int(lengths[i]), prompt_row(i)
    extra = {}
    if routes:
      extra = dict(routes=routes[0][i, :max(k - 1, 0)],
                   prompt_routes=routes[1][p, :prompt_lens[p]])
    result.append(Sample(tokens=tokens[i, :k], logprobs=logp[i, :k],
                         sampling_logprobs=slogp[i, :k],
                         finish_reason=FINISH_REASONS[int(reasons[i])], **extra))
  return result


def generate(model, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
             params: SamplingParams = SamplingParams(), *, record_routes: bool = False
             ) -> list[Sample]:
  """One sample per prompt (row i drawn with seeds[i]); `record_routes`: each Sample also
  carries its experts (mixture of experts, for routing replay)."""
  graphdef, state, config = _split(model)
  _check(config, prompts, seeds, len(prompts), params)
  batch = bucket(len(prompts))
  tokens, lens = _pad_prompts(prompts, batch, bucket(max(map(len, prompts)), MIN_PROMPT_BUCKET),
                              config.vocab_size)
  active = np.arange(batch) < len(prompts)
  seeds_arr = np.zeros((batch,), np.int32)
  seeds_arr[:len(prompts)] = np.asarray(seeds, np.int64)
  out = _generate_jit(graphdef, state, tokens, lens, seeds_arr, active, _knobs(params),
                      mode=params.mode, budget=bucket(params.max_new_tokens),
                      record_routes=record_routes)
  return _samples(out, len(prompts), lens)


def generate_shared(model, prompts: Sequence[Sequence[int]], n: int, seeds,
                    params: SamplingParams = SamplingParams(),
                    decode_fn: DecodeFn = shared_prefix_decode_attention, *,
                    record_routes: bool = False) -> list[list[Sample]]:
  """n samples per prompt from one shared prefill; seeds [len(prompts), n] (sample j of prompt b
  uses seeds[b][j] and equals `generate` on that prompt with that seed). `record_routes`: as
  in `generate`; the n samples of a prompt share its prompt_routes."""
  graphdef, state, config = _split(model)
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"n: expected a positive int (samples per prompt), got {n!r}")
  seeds = np.asarray(seeds, np.int64)
  if seeds.shape != (len(prompts), n):
    raise ValueError(f"seeds: expected shape ({len(prompts)}, {n}) (prompts x samples), "
                     f"got {seeds.shape}")
  _check(config, prompts, seeds.reshape(-1).tolist(), len(prompts) * n, params)
  batch = bucket(len(prompts))
  tokens, lens = _pad_prompts(prompts, batch, bucket(max(map(len, prompts)), MIN_PROMPT_BUCKET),
                              config.vocab_size)
  active = np.arange(batch) < len(prompts)
  seeds_arr = np.zeros((batch, n), np.int32)
  seeds_arr[:len(prompts)] = seeds
  out = _generate_shared_jit(graphdef, state, tokens, lens, seeds_arr, active, _knobs(params),
                             mode=params.mode, budget=bucket(params.max_new_tokens), n=n,
                             decode_fn=decode_fn, record_routes=record_routes)
  flat = _samples(out, len(prompts) * n, lens, lambda i: i // n)
  return [flat[b * n:(b + 1) * n] for b in range(len(prompts))]
