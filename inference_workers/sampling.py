"""Sampling settings and the per-step token choice (temperature, min-p, top-k, top-p, greedy).

Pure functions on logits; the decode loop in `sampler.py` calls `choose_tokens` once per step.
Only `DecodeMode` (greedy, top_k, whether top-p and min-p are on) is compiled in; temperature,
top_p, min_p, stop tokens and max_new_tokens are traced, so changing them does not recompile,
except where max_new_tokens or the number of stop tokens moves to another power-of-two bucket
(the buffers' sizes).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


# A sample's seed that asks for its greedy decode instead (any settings): the reward of one
# greedy sample per prompt is ReMax's baseline (worker.greedy_baseline).
GREEDY_SEED = -1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn.

  temperature: logits are divided by it before min-p/top-k/top-p; 0 means greedy.
  top_k: keep the k most likely tokens (0 = all).
  top_p: keep the smallest most-likely set whose probability reaches top_p (1.0 = all).
  min_p: keep the tokens whose probability is at least min_p x the most likely one's
    (0.0 = all), as vLLM's and TRL's min_p.
  greedy: always take the argmax (the sampling distribution is then a point mass).
  max_new_tokens: generation stops after this many tokens ("length").
  stop_tokens: generation stops after emitting any of these (kept in the output, "stop").
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  greedy: bool = False
  max_new_tokens: int = 64
  stop_tokens: tuple[int, ...] = ()

  def __post_init__(self):
    def need(cond, field, expected, got):
      if not cond:
        raise ValueError(f"SamplingParams.{field}: expected {expected}, got {got!r}")

    # numpy scalars (np.int64 from an array, np.float32) count as the numbers they hold; a
    # bool is no number here (top_k=True would mean top-1) and greedy must be a real bool.
    need(_is_real(self.temperature) and self.temperature >= 0
         and math.isfinite(self.temperature), "temperature", "a finite number >= 0",
         self.temperature)
    need(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an int >= 0", self.top_k)
    need(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]",
         self.top_p)
    need(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]",
         self.min_p)
    need(isinstance(self.greedy, (bool, np.bool_)), "greedy", "a bool", self.greedy)
    need(_is_int(self.max_new_tokens) and self.max_new_tokens > 0, "max_new_tokens",
         "a positive int", self.max_new_tokens)
    need(isinstance(self.stop_tokens, collections.abc.Iterable)
         and not isinstance(self.stop_tokens, (str, bytes)), "stop_tokens",
         "a sequence of token ids", self.stop_tokens)
    stops = tuple(np.asarray(self.stop_tokens).reshape(-1).tolist()
                  if isinstance(self.stop_tokens, np.ndarray) else self.stop_tokens)
    need(all(_is_int(t) and t >= 0 for t in stops), "stop_tokens",
         "non-negative token ids", self.stop_tokens)
    object.__setattr__(self, "stop_tokens", tuple(sorted({int(t) for t in stops})))
    object.__setattr__(self, "temperature", float(self.temperature))
    object.__setattr__(self, "top_p", float(self.top_p))
    object.__setattr__(self, "min_p", float(self.min_p))
    object.__setattr__(self, "top_k", int(self.top_k))
    object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
    object.__setattr__(self, "greedy", bool(self.greedy) or self.temperature == 0)

  @property
  def mode(self) -> "DecodeMode":
    """The part of these settings that shapes the compiled program."""
    return DecodeMode(greedy=self.greedy, top_k=self.top_k, nucleus=self.top_p < 1.0,
                      min_p_on=self.min_p > 0)


def _is_int(value) -> bool:
  """An int or numpy integer, not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
  """A real number (numpy's too), not a bool and not NaN."""
  return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
          and not math.isnan(value))


@dataclasses.dataclass(frozen=True)
class DecodeMode:
  """Static sampling structure (one compiled decode loop each); the numbers stay traced.

  nucleus: top-p is on (top_p < 1); min_p_on: min-p is on (min_p > 0).
  """

  greedy: bool
  top_k: int
  nucleus: bool
  min_p_on: bool = False


def truncated_logprobs(logits: jax.Array, mode: DecodeMode, temperature, top_p, min_p=0.0):
  """(log-probs of the sampling distribution over candidates [B, C], candidate ids [B, C] or None).

  Temperature first, then min-p, then top-k, then top-p (the smallest most-likely set whose
  mass, renormalised over what min-p kept, reaches top_p), renormalised: the order of vLLM's V1
  sampler (vllm/v1/sample/sampler.py; v1/worker/gpu/sample/min_p.py), where min-p sees the
  whole vocabulary. Without top-k/top-p the candidates are the whole vocabulary (ids None),
  the tokens min-p drops at log-prob -inf.
  """
  scaled = logits / temperature
  if mode.min_p_on:
    # p_i >= min_p * p_max  <=>  scaled_i >= max(scaled) + log(min_p)
    floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(min_p)
    scaled = jnp.where(scaled >= floor, scaled, -jnp.inf)
  if not (mode.top_k or mode.nucleus):
    return jax.nn.log_softmax(scaled, axis=-1), None
  k = min(mode.top_k or logits.shape[-1], logits.shape[-1])
  vals, ids = jax.lax.top_k(scaled, k)  # sorted, most likely first
  if mode.nucleus:
    probs = jax.nn.softmax(vals, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    vals = jnp.where(mass_before < top_p, vals, -jnp.inf)  # the first always survives
  return jax.nn.log_softmax(vals, axis=-1), ids


def choose_tokens(logits: jax.Array, keys: jax.Array, mode: DecodeMode, temperature, top_p,
                  min_p=0.0, greedy_rows: jax.Array | None = None):
  """Draw one token per row from float32 logits [B, V] with per-row keys [B]; the rows
  `greedy_rows` [B] bool marks take their argmax instead.

  Returns (tokens [B] int32, behaviour log-probs [B], model log-probs [B]): the token is
  drawn from the tempered policy softmax(logits / temperature) narrowed by min-p, top-k and
  top-p (truncated_logprobs); its behaviour log-prob is under the tempered policy itself,
  before that narrowing (0 for greedy, a point mass): the distribution the trainer's
  importance ratios are of, so an on-policy ratio is 1 (of the narrowed one, every ratio
  was its kept mass < 1, and PPO's clip dropped the negative advantages' gradients); the
  narrowing's bias is not corrected, as in TRL. The model log-prob is log_softmax(logits)
  at temperature 1.
  """
  model_logp = jax.nn.log_softmax(logits, axis=-1)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if mode.greedy:
    tokens = greedy
    sampling_logp = jnp.zeros(tokens.shape, jnp.float32)
  else:
    logp, ids = truncated_logprobs(logits, mode, temperature, top_p, min_p)
    choice = jax.vmap(jax.random.categorical)(keys, logp)
    tokens = choice if ids is None else jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]
    tokens = tokens.astype(jnp.int32)
    narrowed = mode.top_k or mode.nucleus or mode.min_p_on
    tempered = jax.nn.log_softmax(logits / temperature, axis=-1) if narrowed else logp
    sampling_logp = jnp.take_along_axis(tempered, tokens[:, None], axis=-1)[:, 0]
    if greedy_rows is not None:
      tokens = jnp.where(greedy_rows, greedy, tokens)
      sampling_logp = jnp.where(greedy_rows, 0.0, sampling_logp)
  chosen = jnp.take_along_axis(model_logp, tokens[:, None], axis=-1)[:, 0]
  return tokens, sampling_logp, chosen


def step_keys(seeds: jax.Array, step) -> jax.Array:
  """Per-row keys for one decode step (`step` scalar or per row): fold_in(key(seed), step),
  reproducible given the seed."""
  steps = jnp.broadcast_to(jnp.asarray(step, jnp.int32), seeds.shape)
  return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)
