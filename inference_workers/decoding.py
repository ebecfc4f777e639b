"""The pieces every sampler shares: the Sample record, shape buckets, prompt padding and
checks, the jitted prefill, and the per-step token record.

A row's token at step t is drawn with key fold_in(key(seed), t), so a sample depends only on
its seed, prompt and weights, not on its batch neighbours or on when it joined the batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from inference_workers.sampling import GREEDY_SEED, SamplingParams, choose_tokens, step_keys
from rlax_ps.models.kv_cache import KVCache

FINISH_REASONS = ("length", "stop")  # index = code used on device
MIN_PROMPT_BUCKET = 8
ROUTE_DTYPE = jnp.int16  # expert ids on device (-1: not recorded)


@dataclasses.dataclass(frozen=True)
class Sample:
  """One generated continuation.

  tokens: generated ids, the stop token included when there was one.
  logprobs: log_softmax of the model's logits (temperature 1) at each token: the policy's
    log-prob, what importance ratios against the trainer's policy need.
  sampling_logprobs: log-prob of each token under the tempered policy it was drawn by,
    softmax(logits / temperature), before min-p, top-k and top-p narrow the draw (0 when
    greedy): the behaviour log-prob, of the distribution the trainer's ratios are of
    (sampling.choose_tokens).
  finish_reason: "stop" (emitted a stop token) or "length" (reached max_new_tokens).
  prompt_routes, routes (`record_routes`, mixture of experts): the experts each MoE layer's
    router picked, [prompt tokens, M, k] for the prompt and [len(tokens) - 1, M, k] for the
    generated tokens fed back (the last one never is): what routing replay trains with.
  observed (multi-turn): [len(tokens)] bool, True where an environment's reply wrote the
    token (log-probs 0 there: the policy did not draw it); None for a single turn.
  resumed: begun by another worker (partial rollouts): its first tokens and their log-probs
    are that worker's, drawn with an older version.
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  sampling_logprobs: np.ndarray
  finish_reason: str
  prompt_routes: np.ndarray | None = None
  routes: np.ndarray | None = None
  observed: np.ndarray | None = None
  resumed: bool = False


def replies_in(observed: np.ndarray | None) -> int:
  """How many environment replies a multi-turn sample holds: its runs of observed tokens."""
  if observed is None:
    return 0
  return int(np.sum(np.diff(np.concatenate([[0], np.asarray(observed, int)])) == 1))


def bucket(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum)."""
  n = max(int(n), minimum)
  return 1 << (n - 1).bit_length()


def token_ids(field: str, prompt) -> np.ndarray:
  """`prompt` as int64 token ids [T], T >= 1; a ValueError naming `field` for anything else
  (a float id would otherwise be cut to an int, a scalar has no length)."""
  ids = np.asarray(prompt)
  if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
    raise ValueError(f"{field}: expected a sequence of int token ids, got "
                     f"{ids.dtype} of shape {ids.shape}")
  if ids.size == 0:
    raise ValueError(f"{field}: expected at least one token, got an empty prompt")
  return ids.astype(np.int64, copy=False)


def pad_prompts(prompts: Sequence[Sequence[int]], batch: int, length: int, vocab: int):
  """Right-padded tokens [batch, length] and lengths; padding rows hold one token 0."""
  tokens = np.zeros((batch, length), np.int32)
  lens = np.ones((batch,), np.int32)
  for i, p in enumerate(prompts):
    p = token_ids(f"prompts[{i}]", p)
    if p.min() < 0 or p.max() >= vocab:
      raise ValueError(f"prompts[{i}]: token ids must lie in [0, {vocab}), got "
                       f"[{p.min()}, {p.max()}]")
    tokens[i, :p.size] = p
    lens[i] = p.size
  return tokens, lens


def check_request(model_config, prompts, seeds, rows, params: SamplingParams):
  """Name what is wrong with a sampling request before anything is compiled."""
  if not isinstance(params, SamplingParams):
    raise TypeError(f"params: expected SamplingParams, got {type(params).__name__}")
  if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
    raise ValueError(f"prompts: expected a list of prompts (each a list of token ids), got "
                     f"{type(prompts).__name__}")
  if len(prompts) == 0:
    raise ValueError("prompts: expected at least one prompt, got none")
  seeds = np.asarray(seeds)
  if seeds.ndim != 1 or not (np.issubdtype(seeds.dtype, np.integer) or seeds.size == 0):
    raise ValueError(f"seeds: expected a sequence of {rows} ints (one per sample), got "
                     f"{seeds.dtype} of shape {seeds.shape}")
  if len(seeds) != rows:
    raise ValueError(f"seeds: expected {rows} seeds (one per sample), got {len(seeds)}")
  longest = max(len(token_ids(f"prompts[{i}]", p)) for i, p in enumerate(prompts))
  if longest + params.max_new_tokens > model_config.max_position_embeddings:
    raise ValueError(f"prompt length {longest} + max_new_tokens {params.max_new_tokens} exceeds "
                     f"max_position_embeddings={model_config.max_position_embeddings}")
  bad = [s for s in seeds.tolist() if not (0 <= s < 2 ** 31 or s == GREEDY_SEED)]
  if bad:
    raise ValueError(f"seeds: expected ints in [0, 2**31) (or GREEDY_SEED={GREEDY_SEED}: a "
                     f"greedy sample), got {bad[0]!r}")


def knobs(params: SamplingParams):
  """The traced sampling numbers; stop ids padded with -1 to a power-of-two count."""
  stops = np.full((bucket(len(params.stop_tokens), 4),), -1, np.int32)
  stops[:len(params.stop_tokens)] = params.stop_tokens
  return (np.int32(params.max_new_tokens), np.float32(max(params.temperature, 1e-6)),
          np.float32(params.top_p), np.float32(params.min_p), stops)


def routes_last(picks):
  """The model's recorded picks [M, B, T, k] -> [B, T, M, k] ROUTE_DTYPE."""
  return jnp.transpose(picks, (1, 2, 0, 3)).astype(ROUTE_DTYPE)


def prefill(model, tokens, lens, cache_len: int, record_routes: bool = False):
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
  routes = routes_last(routing[0].picks) if record_routes else None
  return model.logits_from_hidden(last)[:, 0], cache, routes


def empty_routes(model_config, rows: int, length: int):
  """A routes buffer [rows, length, M, k] of -1 (nothing recorded)."""
  return jnp.full((rows, length, len(model_config.moe_layers),
                   model_config.num_experts_per_tok), -1, ROUTE_DTYPE)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rows:
  """Decode state. Per row [R]: the last token drawn, whether the row is done, the seed and
  output slot (`sample`) of the sample it draws. Per output slot [O]: its length, finish
  reason, whether it finished, and what it drew ([O, budget]). `generate` gives each row
  its own slot; `ContinuousBatch` moves a row on to a prompt's next sample.

  Forced tokens (multi-turn replies, resumed samples' first tokens; else None): `forced`
  [R, F] (right-aligned, `forced_left` [R] of them still to feed), which the row writes in
  place of drawing (log-prob 0). Multi-turn (else None): a row that stops ends a turn and
  is `paused` [R] (done, its sample not finished) until the host answers it; forced tokens
  are then replies, marked in `observed` [O, budget]."""

  token: jax.Array
  done: jax.Array
  seeds: jax.Array
  sample: jax.Array
  lengths: jax.Array
  reasons: jax.Array
  finished: jax.Array
  tokens: jax.Array
  logp: jax.Array
  slogp: jax.Array
  paused: jax.Array | None = None
  forced: jax.Array | None = None
  forced_left: jax.Array | None = None
  observed: jax.Array | None = None

  @classmethod
  def init(cls, seeds, budget: int, done, outputs: int | None = None,
           turns: bool = False, forcing: bool = False) -> "Rows":
    """Rows drawing with `seeds`, row i into output slot i; `outputs` slots in all;
    `turns`: with the multi-turn state; `forcing`: with forced tokens (turns has them)."""
    rows = seeds.shape[0]
    outputs = rows if outputs is None else outputs
    done = jnp.broadcast_to(jnp.asarray(done, bool), (rows,))
    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)  # one buffer each (donation)
    multi = {}
    if turns or forcing:
      multi = dict(forced=zeros((rows, budget)), forced_left=zeros((rows,)))
    if turns:
      multi.update(paused=jnp.zeros((rows,), bool),
                   observed=jnp.zeros((outputs, budget), bool))
    return cls(token=zeros((rows,)), done=done, seeds=jnp.asarray(seeds, jnp.int32),
               sample=jnp.arange(rows, dtype=jnp.int32), lengths=zeros((outputs,)),
               reasons=zeros((outputs,)), finished=jnp.ones((outputs,), bool),
               tokens=zeros((outputs, budget)),
               logp=jnp.zeros((outputs, budget), jnp.float32),
               slogp=jnp.zeros((outputs, budget), jnp.float32), **multi)

  @property
  def idle(self) -> jax.Array:
    """[R]: rows free to take a new sample (done, and not waiting for an answer)."""
    return self.done if self.paused is None else self.done & ~self.paused


def record(rows: Rows, step, logits, knobs_, mode) -> Rows:
  """Draw step `step` (scalar or per row) of every row not done from its logits [R, V],
  write it into the row's output slot, and finish rows that stopped or reached max_new.
  Multi-turn: a row with forced tokens left writes the next one instead of drawing, and a
  row that stops before max_new pauses (its sample goes on once the host answers)."""
  max_new, temperature, top_p, min_p, stops = knobs_
  step = jnp.broadcast_to(jnp.asarray(step, jnp.int32), rows.done.shape)
  token, slogp, logp = choose_tokens(logits, step_keys(rows.seeds, step), mode, temperature,
                                     top_p, min_p, greedy_rows=rows.seeds == GREEDY_SEED)
  live = ~rows.done
  multi = {}
  force = jnp.zeros_like(live)
  if rows.forced is not None:
    force = live & (rows.forced_left > 0)
    width = rows.forced.shape[1]
    fed = jnp.take_along_axis(rows.forced, (width - jnp.maximum(rows.forced_left, 1))[:, None],
                              axis=1)[:, 0]
    token = jnp.where(force, fed, token)
    logp, slogp = jnp.where(force, 0.0, logp), jnp.where(force, 0.0, slogp)
  if rows.paused is not None:
    # A paused row keeps its closing token: fed while it waits (rewriting the same slot)
    # and once it goes on.
    token = jnp.where(live, token, rows.token)
  else:
    token = jnp.where(live, token, 0)
  out = jnp.where(live, rows.sample, rows.lengths.shape[0])  # rows not drawing write nothing
  stopped = live & jnp.any(token[:, None] == stops[None, :], axis=-1) & ~force
  last = step + 1 >= max_new
  if rows.paused is not None:
    turn_ends = stopped & ~last
    ends = live & last
    multi = dict(paused=rows.paused | turn_ends,
                 observed=rows.observed.at[(out, step)].set(force, mode="drop"))
    ends = ends | turn_ends  # a paused row is done until answered, its sample not finished
    finishes = live & last
  else:
    ends = finishes = live & (stopped | last)
  if rows.forced is not None:
    multi["forced_left"] = jnp.where(ends, 0, rows.forced_left - force.astype(jnp.int32))
  at = (out, step)
  return dataclasses.replace(
      rows, token=token, done=rows.done | ends, **multi,
      tokens=rows.tokens.at[at].set(token, mode="drop"),
      logp=rows.logp.at[at].set(logp, mode="drop"),
      slogp=rows.slogp.at[at].set(slogp, mode="drop"),
      lengths=rows.lengths.at[out].add(1, mode="drop"),
      reasons=rows.reasons.at[jnp.where(stopped, out, rows.lengths.shape[0])].set(
          FINISH_REASONS.index("stop"), mode="drop"),
      finished=rows.finished.at[jnp.where(finishes, out, rows.lengths.shape[0])].set(
          True, mode="drop"))


def samples_of(tokens, logp, slogp, lengths, reasons, routes=None, prompt_routes=None,
               prompt_lens=None, prompt_row=lambda i: i, observed=None) -> list[Sample]:
  """Host Samples of host arrays (row i's prompt is prompt row prompt_row(i))."""
  result = []
  for i in range(len(lengths)):
    k, p = int(lengths[i]), prompt_row(i)
    extra = {}
    if routes is not None:
      extra = dict(routes=routes[i, :max(k - 1, 0)],
                   prompt_routes=prompt_routes[p, :prompt_lens[p]])
    if observed is not None:
      extra["observed"] = observed[i, :k]
    result.append(Sample(tokens=tokens[i, :k], logprobs=logp[i, :k],
                         sampling_logprobs=slogp[i, :k],
                         finish_reason=FINISH_REASONS[int(reasons[i])], **extra))
  return result
