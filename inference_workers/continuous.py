"""Continuous batching of shared-prefix sampling: `slots` prompts decode together; when all
n samples of a prompt have finished, the prompt leaves and a waiting one takes its slot, so
one long response no longer holds the rest of the batch idle.

A slot's n samples run on its `rows_per_prompt` rows (n by default): a row whose sample ends
takes the prompt's next one on device, drawing its first token from the prompt's kept
last-token logits. The device state (`Slots`) is a SharedPrefixCache with one prompt per
slot and a write index per row, the rows, and an output slot per sample. Decoding runs on
device in chunks (a while loop). A chunk returns to the host as soon as a prompt finishes
(or after `chunk_steps`); the host takes the finished groups, to be scored and sent at once,
and prefills waiting prompts into the freed slots in one batched prefill. Each chunk reads
the weights afresh, so a worker may update them in place between chunks.

A sample equals `generate`'s for the same prompt and seed, whatever its neighbours and
whenever it started: its token at step t is drawn with fold_in(key(seed), t).

Multi-turn (`respond`): a sample that emits a stop token has ended a turn and its row pauses.
The chunk returns; the host asks `respond(key, j, tokens, observed)` for the reply to
sample j of that prompt (its tokens so far, and which of them earlier replies wrote) on a
thread pool, and decoding goes on for the other rows meanwhile (a paused row's cache
stands still). Once the reply is in, the row takes its tokens in place of drawing, all in
one step (`_feed_rows`: they join its cache like its own; a reply the budget cuts short is
fed one token per decode step instead), and draws again after them; None or no tokens (or
`max_turns` replies given) finishes the sample (a resumed sample counts its replies by the
tokens they wrote).

Resuming (`resume`): a prompt may come with samples another run began (partial rollouts):
a finished one is returned as it is; the others take their begun tokens first (with their
own log-probs and reply flags), then draw on with their seeds, so they end as the
uninterrupted run would have. The rows that take them as the prompt is inserted feed
those tokens at once (`_feed_rows`); a sample that starts later on a freed row (fewer rows
than samples) feeds them one per decode step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from inference_workers.decoding import (MIN_PROMPT_BUCKET, Rows, Sample, bucket, check_request,
                                        empty_routes, knobs, pad_prompts, prefill, record,
                                        replies_in, routes_last, samples_of)
from inference_workers.sampling import SamplingParams
from inference_workers.shared_prefix import DecodeFn, SharedPrefixCache, cache_heads
from rlax_ps import sharding as shd
from inference_workers.worker_config import KV_DTYPES
from rlax_ps.kernels.dispatch import shared_prefix_decode_attention
from rlax_ps.kernels.kv_quant import QuantizedKV, kv_repeat_heads, kv_write


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Slots:
  """Everything on device. Per slot: its prompt's cache, seeds [S, n], how many of its
  samples have started [S] and how many it draws (`limit` [S], at most n; a free slot has
  none left), and its last-token logits [S, V], where a row starting a sample draws its
  first token. The rows [S*r] and outputs
  [S*n] (`Rows`). Routing replay: the experts each fed-back token [S*n, budget, M, k] and
  each prompt token [S, Sp, M, k] went to. Resuming (else None): each sample's begun
  tokens [S*n, budget] (right-aligned, `begun_len` [S*n] of them), which the row that takes
  the sample writes first, in place of drawing."""

  cache: SharedPrefixCache
  rows: Rows
  seeds: jax.Array
  next: jax.Array
  limit: jax.Array
  first_logits: jax.Array
  routes: jax.Array | None
  prompt_routes: jax.Array | None
  begun: jax.Array | None = None
  begun_len: jax.Array | None = None


def _empty_slots(config, s: int, n: int, r: int, prompt_len: int, budget: int, decode_fn,
                 record_routes: bool, turns: bool, resume: bool, kv_dtype=None,
                 kv_heads: int | None = None) -> Slots:
  return Slots(cache=SharedPrefixCache.empty(config, s, r, prompt_len, budget, decode_fn,
                                             kv_dtype, kv_heads),
               rows=Rows.init(jnp.zeros((s * r,), jnp.int32), budget, done=True,
                              outputs=s * n, turns=turns, forcing=resume),
               seeds=jnp.zeros((s, n), jnp.int32), next=jnp.full((s,), n, jnp.int32),
               limit=jnp.full((s,), n, jnp.int32),
               first_logits=jnp.zeros((s, config.vocab_size), jnp.float32),
               routes=empty_routes(config, s * n, budget) if record_routes else None,
               prompt_routes=empty_routes(config, s, prompt_len) if record_routes else None,
               begun=jnp.zeros((s * n, budget), jnp.int32) if resume else None,
               begun_len=jnp.zeros((s * n,), jnp.int32) if resume else None)


def _slot_shardings(slots: Slots, mesh):
  """Where each part of the slots lives on a worker's mesh: its leading dim (slots, rows or
  outputs) split over data, the KV caches' heads over tensor, as far as they divide."""
  cache = slots.cache
  caches = cache.prefix_k + cache.prefix_v + cache.suffix_k + cache.suffix_v
  heads = {id(x) for x in jax.tree.leaves(caches)}
  scales = {id(x.scales) for x in caches if isinstance(x, QuantizedKV)}  # [.., S, Hkv]

  def spec(x):
    if not x.ndim:
      return NamedSharding(mesh, P())
    entries = ["data"] + [None] * (x.ndim - 1)
    if id(x) in heads:
      entries[x.ndim - (1 if id(x) in scales else 2)] = "tensor"
    return NamedSharding(mesh, shd.fit_spec(P(*entries), x.shape, mesh))

  return jax.tree.map(spec, slots)


def _rows_of(slot_ids, n: int):
  return (slot_ids[:, None] * n + jnp.arange(n)).reshape(-1)


def _start_samples(slots: Slots, knobs_, mode) -> Slots:
  """Rows that are done take their slot's next samples, drawing each first token from the
  prompt's last-token logits (skipped when no row does)."""
  s, r = slots.cache.index.shape
  n = slots.seeds.shape[1]
  idle = slots.rows.idle.reshape(s, r)
  k = slots.next[:, None] + jnp.cumsum(idle, axis=1) - 1  # the sample each idle row takes
  take = idle & (k < slots.limit[:, None])

  def start(slots: Slots) -> Slots:
    rows, t = slots.rows, take.reshape(-1)
    k_ = jnp.minimum(k, n - 1)
    seeds = jnp.take_along_axis(slots.seeds, k_, axis=1).reshape(-1)
    sample = (jnp.arange(s)[:, None] * n + k_).reshape(-1)
    view = dataclasses.replace(rows, done=~t, seeds=jnp.where(t, seeds, rows.seeds),
                               sample=jnp.where(t, sample, rows.sample))
    if slots.begun is not None:  # a resumed sample writes its begun tokens first
      view = dataclasses.replace(
          view, forced=jnp.where(t[:, None], slots.begun[sample], rows.forced),
          forced_left=jnp.where(t, slots.begun_len[sample], rows.forced_left))
    view = record(view, 0, jnp.repeat(slots.first_logits, r, axis=0), knobs_, mode)
    rows = dataclasses.replace(view, token=jnp.where(t, view.token, rows.token),
                               done=jnp.where(t, view.done, rows.done))
    return dataclasses.replace(slots, rows=rows, next=slots.next + take.sum(axis=1),
                               cache=slots.cache.replace(
                                   index=jnp.where(take, 0, slots.cache.index)))

  return jax.lax.cond(jnp.any(take), start, lambda slots: slots, slots)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "record_routes"),
                   donate_argnames=("slots",))
def _insert(graphdef, state, slots: Slots, slot_ids, tokens, lens, source, seeds, limits,
            knobs_, resumed=None, *, mode, record_routes):
  """Prefill prompts tokens [u, P] (lens [u]) once each, into free slots slot_ids [m] (an id
  past the last slot: padding, dropped), slot i taking prompt source[i] (several slots may
  take one prompt: a SampleBatch's samples), each to draw its first limits [m] samples (the
  rest count as finished), and start their first samples. Resuming: `resumed` = (begun [m,
  n, budget], begun_len [m, n], complete [m]): each sample's begun tokens, and how many of
  the prompt's first samples are complete already (they are not drawn)."""
  model = nnx.merge(graphdef, state)
  c, p = slots.cache, tokens.shape[1]
  n = slots.seeds.shape[1]
  logits, filled, prompt_routes = prefill(model, tokens, lens, p, record_routes)
  logits, lens = logits[source], lens[source]
  prompt_routes = None if prompt_routes is None else prompt_routes[source]

  def put(buf, new):  # each kv head repeated where the cache holds more (cache_heads)
    return kv_write(buf, (slot_ids, slice(None, p)), kv_repeat_heads(new, buf.shape[-2]))

  cache = c.replace(prefix_k=tuple(put(b, k[source]) for b, k in zip(c.prefix_k, filled.k)),
                    prefix_v=tuple(put(b, v[source]) for b, v in zip(c.prefix_v, filled.v)),
                    prefix_lens=c.prefix_lens.at[slot_ids].set(lens, mode="drop"))
  out = _rows_of(slot_ids, n)
  complete = jnp.zeros(slot_ids.shape, jnp.int32)
  if resumed is not None:
    begun, begun_len, complete = resumed
    slots = dataclasses.replace(
        slots, begun=slots.begun.at[out].set(begun.reshape(out.shape[0], -1), mode="drop"),
        begun_len=slots.begun_len.at[out].set(begun_len.reshape(-1), mode="drop"))
  rows = dataclasses.replace(
      slots.rows, lengths=slots.rows.lengths.at[out].set(0, mode="drop"),
      reasons=slots.rows.reasons.at[out].set(0, mode="drop"),
      finished=slots.rows.finished.at[out].set(
          ((jnp.arange(n)[None, :] < complete[:, None])
           | (jnp.arange(n)[None, :] >= limits[:, None])).reshape(-1), mode="drop"))
  slots = dataclasses.replace(
      slots, cache=cache, rows=rows, seeds=slots.seeds.at[slot_ids].set(seeds, mode="drop"),
      next=slots.next.at[slot_ids].set(complete, mode="drop"),
      limit=slots.limit.at[slot_ids].set(limits, mode="drop"),
      first_logits=slots.first_logits.at[slot_ids].set(logits, mode="drop"),
      prompt_routes=put(slots.prompt_routes, prompt_routes) if record_routes else None)
  return _start_samples(slots, knobs_, mode)


@functools.partial(jax.jit, static_argnames=("graphdef", "record_routes"),
                   donate_argnames=("slots",))
def _feed_rows(graphdef, state, slots: Slots, row_ids, tokens, counts, *, record_routes):
  """Rows row_ids [m] (an id past the last row: padding) take tokens [m, T] (left-aligned,
  counts [m] of them) as forced tokens, all in one step instead of one per decode step:
  the row's current token and all of them but the last are fed (k/v into its suffix,
  experts recorded), and the last becomes its current token, as after the forced steps.
  Only these rows run: each gets its prompt's prefix for the step."""
  model = nnx.merge(graphdef, state)
  rows, c = slots.rows, slots.cache
  count, budget = rows.token.shape[0], rows.tokens.shape[1]
  s, r = c.index.shape
  t = tokens.shape[1]
  ok = (row_ids < count) & (counts > 0)
  at = jnp.minimum(row_ids, count - 1)
  slot, j = at // r, at % r
  sub = SharedPrefixCache(
      prefix_k=tuple(k[slot] for k in c.prefix_k), prefix_v=tuple(v[slot] for v in c.prefix_v),
      prefix_lens=c.prefix_lens[slot], suffix_k=tuple(k[slot, j][:, None] for k in c.suffix_k),
      suffix_v=tuple(v[slot, j][:, None] for v in c.suffix_v), index=c.index[slot, j][:, None],
      decode_fn=c.decode_fn)
  seq = jnp.concatenate([rows.token[at][:, None], tokens[:, :t - 1]], axis=1)
  positions = (sub.prefix_lens + sub.index[:, 0])[:, None] + jnp.arange(t)
  _, sub, *routing = model.hidden_states(seq, positions=positions, cache=sub,
                                         record_routes=record_routes)
  back = (jnp.where(ok, slot, s), j)  # the rows not fed write nothing back
  def put(bufs, news):
    return tuple(kv_write(buf, back, new[:, 0]) for buf, new in zip(bufs, news))

  cache = c.replace(suffix_k=put(c.suffix_k, sub.suffix_k), suffix_v=put(c.suffix_v, sub.suffix_v),
                    index=c.index.at[back].add(counts, mode="drop"))
  out = jnp.where(ok, rows.sample[at], rows.lengths.shape[0])
  start = rows.lengths[rows.sample[at]]  # the current token is output start - 1
  keep = jnp.arange(t) < counts[:, None]
  cols = (out[:, None], jnp.where(keep, start[:, None] + jnp.arange(t), budget))
  mine = jnp.where(ok, row_ids, count)
  fields = dict(
      token=rows.token.at[mine].set(
          jnp.take_along_axis(tokens, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0],
          mode="drop"),
      tokens=rows.tokens.at[cols].set(tokens, mode="drop"),
      logp=rows.logp.at[cols].set(0.0, mode="drop"),
      slogp=rows.slogp.at[cols].set(0.0, mode="drop"),
      lengths=rows.lengths.at[out].add(counts, mode="drop"),
      forced_left=rows.forced_left.at[mine].set(0, mode="drop"))
  if rows.observed is not None:  # as the forced steps mark them
    fields["observed"] = rows.observed.at[cols].set(True, mode="drop")
  routes = slots.routes
  if record_routes:  # the fed tokens: the current one (output start - 1) and the rest
    fed = (out[:, None], jnp.where(keep, start[:, None] - 1 + jnp.arange(t), budget))
    routes = routes.at[fed].set(routes_last(routing[0].picks), mode="drop")
  return dataclasses.replace(slots, cache=cache, rows=dataclasses.replace(rows, **fields),
                             routes=routes)


def _without_prompts(slots: Slots):
  """(what decoding only reads: the prompts' caches, lengths, routes, seeds and logits; the
  rest of the slots, with None in their place)."""
  c = slots.cache
  fixed = (c.prefix_k, c.prefix_v, c.prefix_lens, slots.prompt_routes, slots.seeds,
           slots.first_logits)
  return fixed, dataclasses.replace(
      slots, cache=c.replace(prefix_k=None, prefix_v=None, prefix_lens=None),
      prompt_routes=None, seeds=None, first_logits=None)


def _with_prompts(fixed, slots: Slots) -> Slots:
  prefix_k, prefix_v, prefix_lens, prompt_routes, seeds, first_logits = fixed
  return dataclasses.replace(
      slots, cache=slots.cache.replace(prefix_k=prefix_k, prefix_v=prefix_v,
                                       prefix_lens=prefix_lens),
      prompt_routes=prompt_routes, seeds=seeds, first_logits=first_logits)


def _slots_done(slots: Slots):
  """[S]: every sample of the slot's prompt has finished (a free slot's too)."""
  return jnp.all(slots.rows.finished.reshape(slots.seeds.shape), axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef", "mode", "record_routes"),
                   donate_argnames=("moving",))
def _chunk(graphdef, state, fixed, moving: Slots, held, asked, knobs_, max_steps, need, *,
           mode, record_routes):
  """Decode until `need` prompts in held slots (held [S]) have all their samples (at once if
  so many already have) or `max_steps` steps; returns the slots' moving part (see
  `_without_prompts`; the rest is only read, so it is neither donated nor copied), which
  slots are done [S] and the steps taken. With a row per sample every sample starts at its
  prompt's insertion, so rows never start one here and that branch is not compiled.
  Multi-turn: also returns when a row pauses that the host has not been asked about (asked
  [R]), or when no row draws."""
  model = nnx.merge(graphdef, state)
  slots = _with_prompts(fixed, moving)
  s, r = slots.cache.index.shape
  budget = slots.rows.tokens.shape[1]
  rows_move_on = r < slots.seeds.shape[1]

  def cond(carry):
    taken, slots = carry
    go = (taken < max_steps) & (jnp.sum(held & _slots_done(slots)) < need)
    if slots.rows.paused is not None:  # a turn ended: the host asks for the reply
      go = go & ~jnp.any(slots.rows.paused & ~asked) & ~jnp.all(slots.rows.done)
    return go

  def body(carry):
    taken, slots = carry
    cache, rows = slots.cache, slots.rows
    step = cache.index.reshape(-1) + 1  # this step feeds generated token step - 1
    positions = (jnp.repeat(cache.prefix_lens, r) + step - 1)[:, None]
    before = cache.index
    hidden, cache, *routing = model.hidden_states(rows.token[:, None], positions=positions,
                                                  cache=cache, record_routes=record_routes)
    # A row with nothing left to draw stops at the end of its suffix (its writes are dropped).
    index = jnp.minimum(cache.index, budget - 1)
    if rows.paused is not None:  # a paused row stays put: its next write overwrites this one
      index = jnp.where(rows.paused.reshape(s, r), before, index)
    cache = cache.replace(index=index)
    routes = slots.routes
    if record_routes:
      out = jnp.where(rows.done, routes.shape[0], rows.sample)
      routes = routes.at[out, step - 1].set(routes_last(routing[0].picks)[:, 0], mode="drop")
    rows = record(rows, step, model.logits_from_hidden(hidden)[:, 0], knobs_, mode)
    slots = dataclasses.replace(slots, cache=cache, rows=rows, routes=routes)
    return taken + 1, _start_samples(slots, knobs_, mode) if rows_move_on else slots

  taken, slots = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), slots))
  return _without_prompts(slots)[1], _slots_done(slots), taken


@jax.jit
def _collect(slots: Slots, slot_ids):
  """The rows of slots slot_ids [m]: tokens, logp, sampling logp [m*n, budget], lengths,
  reasons, and (routing replay) their routes and the slots' prompt routes."""
  rows = _rows_of(slot_ids, slots.seeds.shape[1])
  r = slots.rows
  out = (r.tokens[rows], r.logp[rows], r.slogp[rows], r.lengths[rows], r.reasons[rows])
  out += (None,) if r.observed is None else (r.observed[rows],)
  if slots.routes is not None:
    out += (slots.routes[rows], slots.prompt_routes[slot_ids])
  return out


@jax.jit
def _turns_of(rows: Rows, row_ids):
  """Rows row_ids [m]' output slots, and those outputs' lengths, tokens so far and which
  of them replies wrote."""
  out = rows.sample[row_ids]
  return out, rows.lengths[out], rows.tokens[out], rows.observed[out]


@functools.partial(jax.jit, static_argnames=("mode",), donate_argnames=("slots",))
def _answer(slots: Slots, row_ids, replies, counts, go_on, knobs_, *, mode):
  """Paused rows row_ids [m] (an id past the last row: padding) go on with replies
  [m, F] (right-aligned, counts [m] tokens) where go_on [m], else finish their sample (and
  take their prompt's next one, if any)."""
  rows = slots.rows
  outs = rows.sample.at[row_ids].get(mode="fill", fill_value=rows.lengths.shape[0])
  ended = jnp.where(go_on, rows.lengths.shape[0], outs)
  going = jnp.where(go_on, outs, rows.lengths.shape[0])
  rows = dataclasses.replace(
      rows, paused=rows.paused.at[row_ids].set(False, mode="drop"),
      done=rows.done.at[row_ids].set(~go_on, mode="drop"),
      forced=rows.forced.at[row_ids].set(replies, mode="drop"),
      forced_left=rows.forced_left.at[row_ids].set(jnp.where(go_on, counts, 0), mode="drop"),
      reasons=rows.reasons.at[going].set(0, mode="drop"),  # a stop ended a turn, not it
      finished=rows.finished.at[ended].set(True, mode="drop"))
  slots = dataclasses.replace(slots, rows=rows)
  if slots.cache.index.shape[1] < slots.seeds.shape[1]:
    slots = _start_samples(slots, knobs_, mode)
  return slots


@functools.partial(jax.jit, donate_argnames=("slots",))
def _free(slots: Slots, slot_ids) -> Slots:
  """Slots slot_ids [m] (an id past the last slot: padding) let go of their prompts: their
  rows stop (done, not paused, nothing forced), their samples count as finished and none
  is left to start, as in a slot whose group was taken."""
  r, n = slots.cache.index.shape[1], slots.seeds.shape[1]
  rows, ids = slots.rows, _rows_of(slot_ids, r)
  fields = dict(done=rows.done.at[ids].set(True, mode="drop"),
                finished=rows.finished.at[_rows_of(slot_ids, n)].set(True, mode="drop"))
  if rows.paused is not None:
    fields["paused"] = rows.paused.at[ids].set(False, mode="drop")
  if rows.forced_left is not None:
    fields["forced_left"] = rows.forced_left.at[ids].set(0, mode="drop")
  return dataclasses.replace(slots, rows=dataclasses.replace(rows, **fields),
                             next=slots.next.at[slot_ids].set(n, mode="drop"),
                             limit=slots.limit.at[slot_ids].set(n, mode="drop"))


@functools.partial(jax.jit, static_argnames=("length",))
def _grow(slots: Slots, length: int) -> Slots:
  """Room for prompts of up to `length` tokens (the slots' prompts are kept)."""
  def pad(a):
    return jnp.pad(a, [(0, 0), (0, length - a.shape[1])] + [(0, 0)] * (a.ndim - 2))

  c = slots.cache
  return dataclasses.replace(  # (an int8 cache: its codes and scales alike)
      slots, cache=c.replace(prefix_k=jax.tree.map(pad, c.prefix_k),
                             prefix_v=jax.tree.map(pad, c.prefix_v)),
      prompt_routes=None if slots.prompt_routes is None else pad(slots.prompt_routes))


class _ModelSplit:
  """nnx.split of a model, kept until one of its variables holds another array (weights
  applied in place set new ones): a split flattens the whole graph, a millisecond or more
  for each of the calls a chunk makes otherwise."""

  def __init__(self, model):
    self._model, self._split, self._held = model, None, ()

  def __call__(self):
    if self._split is None or any(v.get_raw_value() is not x for v, x in self._held):
      self._split = nnx.split(self._model)
      self._held = tuple((v, v.get_raw_value()) for _, v in nnx.iter_graph(self._model)
                         if isinstance(v, nnx.Variable))
    return self._split


# SlotsDevice's methods: each a device call (mirrored on a multi-host worker's followers).
SLOTS_CALLS = ("prepare", "insert", "feed_rows", "chunk", "done", "paused", "finished",
               "turns_of", "answer", "free", "collect", "clear")


class SlotsDevice:
  """A ContinuousBatch's device half: the slots and every call that reads or changes them,
  each taking and giving host values only, so that every process of a multi-host worker
  makes the same calls with the same inputs (inference_workers.multihost). `settings`: what
  such a process needs to make its own (all but the model and the mesh)."""

  def __init__(self, model, *, slots: int, n: int, rows_per_prompt: int, budget: int,
               params: SamplingParams, decode_fn: DecodeFn, record_routes: bool, turns: bool,
               resume: bool, kv_dtype: str | None, mesh: jax.sharding.Mesh | None = None):
    self.settings = dict(slots=slots, n=n, rows_per_prompt=rows_per_prompt, budget=budget,
                         params=params, decode_fn=decode_fn, record_routes=record_routes,
                         turns=turns, resume=resume, kv_dtype=kv_dtype)
    self.config = model.config
    self._model_split = _ModelSplit(model)
    self.num_slots, self.n, self.r, self.budget = slots, n, rows_per_prompt, budget
    self.mode, self._knobs = params.mode, knobs(params)
    self.decode_fn, self.record_routes = decode_fn, record_routes
    self.turns, self.resume, self.kv_dtype = turns, resume, kv_dtype
    self.mesh = mesh
    self.slots: Slots | None = None

  @property
  def row_count(self) -> int:
    """Decode rows: r per slot."""
    return self.num_slots * self.r

  @property
  def reply_width(self) -> int:
    """The most tokens a multi-turn reply feeds a row."""
    return self.slots.rows.forced.shape[1]

  def _on_mesh(self):
    """The mesh in context (jit traces see it), if the batch has one."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def prepare(self, length: int) -> None:
    """Slots made (where they live), with room for prompts of `length` tokens."""
    with self._on_mesh():
      if self.slots is None:
        empty = functools.partial(_empty_slots, self.config, self.num_slots, self.n, self.r,
                                  length, self.budget, self.decode_fn, self.record_routes,
                                  self.turns, self.resume, self.kv_dtype,
                                  cache_heads(self.config, self.mesh))
        self.slots = empty() if self.mesh is None else jax.jit(
            empty, out_shardings=_slot_shardings(jax.eval_shape(empty), self.mesh))()
      elif length > self.slots.cache.prefix_k[0].shape[1]:
        self.slots = _grow(self.slots, length=length)

  def insert(self, slot_ids, tokens, lens, source, seeds, limits, resumed) -> None:
    """_insert's prefill of prompts into free slots."""
    graphdef, state = self._model_split()
    with self._on_mesh():
      self.slots = _insert(graphdef, state, self.slots, slot_ids, tokens, lens, source,
                           seeds, limits, self._knobs, resumed, mode=self.mode,
                           record_routes=self.record_routes)

  def feed_rows(self, ids, tokens, counts) -> None:
    """_feed_rows: rows take forced tokens at once."""
    graphdef, state = self._model_split()
    with self._on_mesh():
      self.slots = _feed_rows(graphdef, state, self.slots, ids, tokens, counts,
                              record_routes=self.record_routes)

  def chunk(self, held, asked, max_steps, need) -> tuple[np.ndarray, int]:
    """One decode chunk (_chunk): which slots are done [S], and the steps taken."""
    graphdef, state = self._model_split()
    with self._on_mesh():
      fixed, moving = _without_prompts(self.slots)
      moving, finished, taken = _chunk(graphdef, state, fixed, moving, held, asked,
                                       self._knobs, max_steps, need, mode=self.mode,
                                       record_routes=self.record_routes)
      self.slots = _with_prompts(fixed, moving)
      return shd.to_host(finished), int(shd.to_host(taken))

  def done(self) -> np.ndarray:
    """[S]: every sample of the slot's prompt has finished."""
    with self._on_mesh():
      return shd.to_host(_slots_done(self.slots))

  def paused(self) -> np.ndarray:
    """[R]: rows paused at the end of a turn."""
    return shd.to_host(self.slots.rows.paused)

  def finished(self) -> np.ndarray:
    """[S*n]: outputs whose sample has finished."""
    return shd.to_host(self.slots.rows.finished)

  def turns_of(self, ids) -> tuple:
    """_turns_of rows `ids`, on the host."""
    with self._on_mesh():
      return shd.to_host(_turns_of(self.slots.rows, ids))

  def answer(self, ids, replies, counts, go_on) -> None:
    """_answer: paused rows go on with replies, or finish."""
    with self._on_mesh():
      self.slots = _answer(self.slots, ids, replies, counts, go_on, self._knobs,
                           mode=self.mode)

  def free(self, ids) -> None:
    """_free: slots let go of their prompts."""
    with self._on_mesh():
      self.slots = _free(self.slots, ids)

  def collect(self, ids) -> tuple:
    """_collect of slots `ids`, on the host."""
    with self._on_mesh():
      return shd.to_host(_collect(self.slots, ids))

  def clear(self) -> None:
    """The device state goes."""
    self.slots = None


@dataclasses.dataclass
class _Waiting:
  """A prompt queued or in a slot. Resumed (`begun`): its samples in the order its outputs
  hold them, the complete ones first (`order`: each output's original sample index)."""
  key: Hashable
  tokens: np.ndarray
  seeds: np.ndarray  # [n]: the first `count` are drawn
  count: int
  begun: list[Sample] | None = None
  order: np.ndarray | None = None
  complete: int = 0

  def restore(self, samples: list[Sample], finished: list[bool] | None = None
              ) -> tuple[list[Sample], list[bool] | None]:
    """The outputs' samples (and finished flags) in the original order, each resumed one
    whole: the complete ones as they were begun, the others with their begun tokens'
    log-probs (the device fed those tokens, it did not draw them)."""
    if self.begun is None:
      return samples, finished
    out: list[Sample | None] = [None] * len(samples)
    flags: list[bool] = [True] * len(samples)
    for pos, (j, got, before) in enumerate(zip(self.order, samples, self.begun)):
      k = len(before.tokens)
      if pos < self.complete:  # the prompt's routes are this run's (one prefill)
        out[j] = dataclasses.replace(before, prompt_routes=got.prompt_routes)
      elif len(got.tokens) < len(before.tokens):  # stopped again while its begun tokens
        # were fed (or before it had a row): those stand, to be continued by the next worker
        out[j] = dataclasses.replace(before, prompt_routes=got.prompt_routes, resumed=True)
      elif len(before.tokens):
        seen = {}
        if before.observed is not None and got.observed is not None:
          seen["observed"] = np.concatenate([before.observed[:k], got.observed[k:]])
        out[j] = dataclasses.replace(
            got, logprobs=np.concatenate([before.logprobs[:k], got.logprobs[k:]]),
            sampling_logprobs=np.concatenate([before.sampling_logprobs[:k],
                                              got.sampling_logprobs[k:]]), resumed=True,
            **seen)
      else:
        out[j] = got
      if finished is not None:
        flags[j] = finished[pos]
    return out, None if finished is None else flags


class ContinuousBatch:
  """`slots` prompt slots, kept full from a queue of waiting prompts; each slot's n samples
  run through `rows_per_prompt` rows (0: n, all at once), a row taking the prompt's next
  sample when its own ends.

  `add(key, prompt, seeds)` queues a prompt; each `step()` fills free slots, decodes one
  chunk and returns the groups that finished as (key, [its Samples]); `run()` steps until
  nothing waits or runs. `chunk_steps` (0: no bound) caps the steps of one chunk, so the
  caller regains control (to apply new weights, or to stop) within that many steps; a chunk
  also ends once `return_after` prompts have all their samples (or every prompt held has).
  Fewer rows per prompt (and more slots for the same rows) keep more rows drawing when
  lengths vary, at the price of a group taking longer to finish.
  `respond(key, j, tokens, observed) -> token ids | None` makes samples multi-turn (module
  docstring): each sample gets at most `max_turns` replies, asked for on `respond_threads`
  threads. A reply (or a resumed sample's begun tokens) joins its row in steps of up to
  `feed_tokens` tokens (1: one a decode step), which bounds that step's attention scores.
  `mesh` (the model's weights on it): the slots split over its data axis and the caches'
  heads over tensor; every step is traced with it in context, so attention runs per device.
  `kv_dtype` (one of KV_DTYPES; None: the model's compute dtype): what the caches hold k/v
  in; float8_e4m3fn or int8, with a scale per token and head, fits twice the rows of a bf16
  cache in the same memory, and on TPU the decode kernel reads it at that width (widening
  a block at a time in VMEM; XLA elsewhere widens each layer's cache first).
  """

  def __init__(self, model, n: int, slots: int, params: SamplingParams = SamplingParams(), *,
               rows_per_prompt: int = 0, decode_fn: DecodeFn = shared_prefix_decode_attention,
               record_routes: bool = False, chunk_steps: int = 0,
               respond: Callable[[Hashable, int, np.ndarray, np.ndarray],
                                 Sequence[int] | None] | None = None,
               max_turns: int = 4, respond_threads: int = 8, resume: bool = False,
               feed_tokens: int = 256, mesh: jax.sharding.Mesh | None = None,
               kv_dtype: str | None = None, return_after: int = 1, mirror=None):
    if not isinstance(model, nnx.Module):
      raise TypeError(f"model: expected an nnx Transformer, got {type(model).__name__}")
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"n: expected a positive int (samples per prompt), got {n!r}")
    if not isinstance(slots, int) or slots < 1:
      raise ValueError(f"slots: expected a positive int (prompts decoded together), got "
                       f"{slots!r}")
    if not isinstance(rows_per_prompt, int) or not 0 <= rows_per_prompt <= n:
      raise ValueError(f"rows_per_prompt: expected an int in [0, n={n}] (0: n), got "
                       f"{rows_per_prompt!r}")
    if not isinstance(chunk_steps, int) or chunk_steps < 0:
      raise ValueError(f"chunk_steps: expected an int >= 0, got {chunk_steps!r}")
    if respond is not None and not callable(respond):
      raise TypeError(f"respond: expected a callable or None, got {type(respond).__name__}")
    if not isinstance(max_turns, int) or max_turns < 0:
      raise ValueError(f"max_turns: expected an int >= 0, got {max_turns!r}")
    if not isinstance(respond_threads, int) or respond_threads < 1:
      raise ValueError(f"respond_threads: expected a positive int, got {respond_threads!r}")
    if not isinstance(feed_tokens, int) or feed_tokens < 1:
      raise ValueError(f"feed_tokens: expected a positive int, got {feed_tokens!r}")
    if not isinstance(return_after, int) or return_after < 1:
      raise ValueError(f"return_after: expected a positive int, got {return_after!r}")
    if kv_dtype not in (None,) + KV_DTYPES:
      raise ValueError(f"kv_dtype: expected None (the model's) or one of {KV_DTYPES}, got "
                       f"{kv_dtype!r}")
    check_request(model.config, [[0]], [0] * n, n, params)
    self.model, self.n, self.num_slots, self.params = model, n, slots, params
    self.record_routes = record_routes
    self.chunk_steps = chunk_steps
    self.respond, self.max_turns = respond, max_turns
    self.resume = resume
    self.feed_tokens = feed_tokens
    self.return_after = return_after
    self._replies: dict[int, int] = {}  # output slot -> replies given to its sample
    # paused row -> (its output slot, its sample's length, its reply in the making)
    self._asking: dict[int, tuple[int, int, concurrent.futures.Future]] = {}
    self._threads = respond_threads
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made when first asked
    self.rows_per_prompt = rows_per_prompt or n
    self._budget = bucket(params.max_new_tokens)
    self._waiting: collections.deque[_Waiting] = collections.deque()
    self._held: dict[int, _Waiting] = {}  # slot -> the prompt in it
    device = SlotsDevice(model, slots=slots, n=n, rows_per_prompt=self.rows_per_prompt,
                         budget=self._budget, params=params, decode_fn=decode_fn,
                         record_routes=record_routes, turns=respond is not None,
                         resume=resume, kv_dtype=kv_dtype, mesh=mesh)
    # A multi-host worker's `mirror` (inference_workers.multihost.Mirror): every device call
    # is made by each of its processes too.
    self._mirror = mirror
    self._dev = device if mirror is None else mirror.mirrored("slots", device, device.settings,
                                                              SLOTS_CALLS)

  @property
  def waiting(self) -> int:
    """Prompts queued, not yet in a slot."""
    return len(self._waiting)

  @property
  def running(self) -> int:
    """Prompts in a slot whose group has not been returned yet."""
    return len(self._held)

  @property
  def free(self) -> int:
    """Slots that the waiting prompts do not already claim."""
    return max(0, self.num_slots - self.running - self.waiting)

  @property
  def running_keys(self) -> list[Hashable]:
    """The keys of the prompts in slots."""
    return [w.key for w in self._held.values()]

  def add(self, key: Hashable, prompt: Sequence[int], seeds: Sequence[int],
          begun: Sequence[Sample] | None = None) -> None:
    """Queue `prompt` (token ids) for len(seeds) samples (at most n), sample j drawn with
    seeds[j]; its group has as many. `begun`
    (with `resume`): samples another run began (partial rollouts, in order, one per
    sample at most): a finished one is returned as it is; the others write their tokens
    first and draw on from there, as they would have (step t draws with fold_in(seed, t))."""
    self.queue([self.entry(key, prompt, seeds, begun)])

  def queue(self, entries: Sequence[_Waiting]) -> None:
    """Queue entries that `entry` made; ValueError naming a key queued or running already
    (run()'s groups, drop() and partial() go by key)."""
    keys = {w.key for w in self._waiting} | {w.key for w in self._held.values()}
    for w in entries:
      if w.key in keys:
        raise ValueError(f"key: {w.key!r} is queued or running already")
      keys.add(w.key)
    self._waiting.extend(entries)

  def entry(self, key: Hashable, prompt: Sequence[int], seeds: Sequence[int],
            begun: Sequence[Sample] | None = None) -> _Waiting:
    """add's checks and queue entry, not queued yet (so that several can be checked before
    any is queued)."""
    seeds = np.asarray(seeds).reshape(-1)
    if not 1 <= seeds.size <= self.n:
      raise ValueError(f"seeds: expected 1 to n={self.n} seeds (one per sample), got "
                       f"{seeds.size}")
    check_request(self.model.config, [prompt], seeds, seeds.size, self.params)
    tokens, lens = pad_prompts([prompt], 1, len(prompt), self.model.config.vocab_size)
    padded = np.zeros((self.n,), np.int32)
    padded[:seeds.size] = seeds
    waiting = _Waiting(key, tokens[0, :lens[0]], padded, seeds.size)
    if begun:
      if not self.resume:
        raise ValueError("begun: expected None for a batch made with resume=False")
      if seeds.size != self.n:
        raise ValueError(f"begun: expected n={self.n} seeds with begun samples, got "
                         f"{seeds.size}")
      if len(begun) > self.n:
        raise ValueError(f"begun: expected at most n={self.n} samples, got {len(begun)}")
      vocab, most = self.model.config.vocab_size, self.params.max_new_tokens
      begun = list(begun) + [Sample(np.zeros(0, np.int32), np.zeros(0, np.float32),
                                    np.zeros(0, np.float32), "")] * (self.n - len(begun))
      for j, b in enumerate(begun):
        if len(b.tokens) and (np.min(b.tokens) < 0 or np.max(b.tokens) >= vocab):
          raise ValueError(f"begun[{j}].tokens: expected ids in [0, {vocab})")
        if not len(b.logprobs) == len(b.sampling_logprobs) == len(b.tokens):
          raise ValueError(f"begun[{j}].logprobs: expected one per token ({len(b.tokens)}), "
                           f"got {len(b.logprobs)} and {len(b.sampling_logprobs)}")
        if b.observed is not None and len(b.observed) != len(b.tokens):
          raise ValueError(f"begun[{j}].observed: expected one flag per token "
                           f"({len(b.tokens)}), got {len(b.observed)}")
        if not b.finish_reason and len(b.tokens) >= most:  # nothing left to draw
          b = begun[j] = dataclasses.replace(b, finish_reason="length")
        routed = max(len(b.tokens) - 1, 0)  # a finished one keeps its routes: it is not fed
        if self.record_routes and b.finish_reason and (
            b.routes is None or len(b.routes) != routed):
          raise ValueError(f"begun[{j}].routes: expected the experts of its {routed} tokens "
                           f"but the last (routing replay), got "
                           f"{None if b.routes is None else len(b.routes)}")
      done = [j for j, b in enumerate(begun) if b.finish_reason]
      order = np.asarray(done + [j for j, b in enumerate(begun) if not b.finish_reason])
      waiting = dataclasses.replace(
          waiting, seeds=waiting.seeds[order], order=order, complete=len(done),
          begun=[dataclasses.replace(
              begun[j], tokens=np.asarray(begun[j].tokens[:most], np.int32),
              logprobs=begun[j].logprobs[:most],
              sampling_logprobs=begun[j].sampling_logprobs[:most], resumed=True,
              routes=None if begun[j].routes is None else begun[j].routes[:max(most - 1, 0)],
              observed=None if self.respond is None else np.asarray(
                  np.zeros(len(begun[j].tokens)) if begun[j].observed is None
                  else begun[j].observed, bool)[:most])  # multi-turn: none fed = all 0
                 for j in order])
    return waiting

  def step(self) -> list[tuple[Hashable, list[Sample]]]:
    """Fill free slots, decode one chunk, return the groups that finished."""
    self._fill()
    if not self._held:
      return []
    turns = self.respond is not None
    if turns:
      self._answers(wait=False)
    held = np.zeros((self.num_slots,), bool)
    held[list(self._held)] = True
    asked = None
    if turns:
      asked = np.zeros((self._dev.row_count,), bool)
      asked[list(self._asking)] = True
    finished, taken = self._dev.chunk(held, asked, np.int32(self.chunk_steps or self._budget),
                                      np.int32(min(self.return_after, len(self._held))))
    if turns:
      self._ask()
      # Nothing decoded (every row waits for a reply or is idle): wait for a reply.
      if self._answers(wait=taken == 0 and not finished[list(self._held)].any()):
        finished = self._dev.done()  # a reply may have ended a sample
    return self._take([s for s in sorted(self._held) if finished[s]])

  def partial(self) -> list[tuple[Hashable, list[Sample], list[bool]]]:
    """Each running prompt's samples so far (one not started yet is empty) and which of
    them have finished: what a worker that must stop hands back (partial rollouts)."""
    held = sorted(self._held)
    if not held:
      return []
    ids = np.full((self.num_slots,), held[0], np.int32)
    ids[:len(held)] = held
    finished = self._dev.finished().reshape(self.num_slots, self.n)
    samples = self._samples(ids, held)
    out = []
    for i, s in enumerate(held):
      w = self._held[s]
      got, done = w.restore(samples[i * self.n:i * self.n + w.count],
                            finished[s].tolist()[:w.count])
      out.append((w.key, got, done))
    return out

  def drop(self, keys: Sequence[Hashable]) -> None:
    """Take the prompts of `keys` out, waiting or running: what they drew is dropped, their
    replies in the making go unused and their slots are free for the next prompts."""
    keys = set(keys)
    self._waiting = collections.deque(w for w in self._waiting if w.key not in keys)
    slots = [s for s, w in self._held.items() if w.key in keys]
    if not slots:
      return
    outs = {out for s in slots for out in range(s * self.n, (s + 1) * self.n)}
    for s in slots:
      del self._held[s]
    for row in [row for row, (out, _, _) in self._asking.items() if out in outs]:
      del self._asking[row]
    for out in outs:
      self._replies.pop(out, None)
    ids = np.full((self.num_slots,), self.num_slots, np.int32)  # one program: padded
    ids[:len(slots)] = slots
    self._dev.free(ids)

  def clear(self) -> None:
    """Drop every prompt, running or waiting, and the device state with them."""
    self._held.clear()
    self._waiting.clear()
    self._asking.clear()
    self._replies.clear()
    self._dev.clear()

  def close(self, wait: bool = True) -> None:
    """Stop the reply threads: calls not begun are dropped, those under way awaited unless
    not `wait` (a crashed worker leaves a hung one on its thread rather than wait for it)."""
    if self._pool is not None:
      self._pool.shutdown(wait=wait, cancel_futures=True)
      self._pool = None

  def release(self, wait: bool = True) -> None:
    """Done with the batch: its reply threads stop (`close`) and its device state goes (on
    every process of a multi-host worker)."""
    self.close(wait)
    self.clear()
    if self._mirror is not None:
      self._dev.forget()

  def run(self) -> list[tuple[Hashable, list[Sample]]]:
    """Step until nothing waits or runs; every group, in the order they finished."""
    out = []
    while self._waiting or self._held:
      out.extend(self.step())
    return out

  def _fill(self) -> None:
    free = [s for s in range(self.num_slots) if s not in self._held]
    joining = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
    if not joining:
      return
    length = bucket(max(w.tokens.size for w in joining), MIN_PROMPT_BUCKET)
    config = self.model.config
    self._dev.prepare(length)
    m = bucket(len(joining))
    # One prefill per distinct prompt (a SampleBatch queues each sample of a prompt).
    distinct: dict[bytes, np.ndarray] = {}  # prompt bytes -> its tokens, in first-seen order
    keys = [w.tokens.tobytes() for w in joining]
    for key, w in zip(keys, joining):
      distinct.setdefault(key, w.tokens)
    index = {key: i for i, key in enumerate(distinct)}
    source = np.zeros((m,), np.int32)
    source[:len(joining)] = [index[key] for key in keys]
    tokens, lens = pad_prompts(list(distinct.values()), bucket(len(distinct)), length,
                               config.vocab_size)
    slot_ids = np.full((m,), self.num_slots, np.int32)  # padding: past the last slot
    seeds = np.zeros((m, self.n), np.int32)
    limits = np.zeros((m,), np.int32)
    for i, (w, s) in enumerate(zip(joining, free)):
      slot_ids[i], seeds[i], limits[i] = s, w.seeds, w.count
      self._held[s] = w
    resumed = None
    if self.resume:
      begun = np.zeros((m, self.n, self._budget), np.int32)  # right-aligned
      begun_len = np.zeros((m, self.n), np.int32)
      complete = np.zeros((m,), np.int32)
      for i, w in enumerate(joining):
        if w.begun is None:
          continue
        complete[i] = w.complete
        for pos, b in enumerate(w.begun[w.complete:], start=w.complete):
          if len(b.tokens):
            begun[i, pos, self._budget - len(b.tokens):] = b.tokens
            begun_len[i, pos] = len(b.tokens)
      resumed = (begun, begun_len, complete)
    self._dev.insert(slot_ids, tokens, lens, source, seeds, limits, resumed)
    if self.resume:  # the rows that took begun samples feed their tokens at once
      r, feeds = self.rows_per_prompt, {}
      for w, s in zip(joining, slot_ids):
        for j in range(r if w.begun is not None else 0):
          pos = w.complete + j  # row j took the prompt's sample `pos`
          if pos < self.n and len(w.begun[pos].tokens) > 1:
            feeds[int(s) * r + j] = w.begun[pos].tokens[1:]  # the first: drawn, forced
      self._feed(feeds)
    for w, s in zip(joining, slot_ids):
      for pos, out in enumerate(range(s * self.n, (s + 1) * self.n)):
        self._replies.pop(out, None)
        if w.begun is not None and replies_in(w.begun[pos].observed):  # replies it had
          self._replies[out] = replies_in(w.begun[pos].observed)
    if self.respond is not None:
      self._ask()  # a first token may have ended a turn

  def _feed(self, feeds: dict[int, np.ndarray]) -> None:
    """Rows take these forced tokens (by row) at once, `feed_tokens` a call at most (1: they
    are left to the decode steps, one a step)."""
    if not feeds or self.feed_tokens == 1:
      return
    count = self._dev.row_count
    ids = np.full((bucket(len(feeds)),), count, np.int32)  # padding: past the last row
    ids[:len(feeds)] = list(feeds)
    longest = max(len(f) for f in feeds.values())
    width = min(bucket(longest), bucket(self.feed_tokens + 1) // 2)  # powers of two: few shapes
    for start in range(0, longest, width):
      tokens = np.zeros((ids.size, width), np.int32)
      counts = np.zeros((ids.size,), np.int32)
      for i, f in enumerate(feeds.values()):
        part = f[start:start + width]
        tokens[i, :len(part)], counts[i] = part, len(part)
      self._dev.feed_rows(ids, tokens, counts)

  def _ask(self) -> None:
    """Ask for the reply of each row that has paused since: on the thread pool, or at once
    None when its sample has had `max_turns` replies."""
    new = [int(r) for r in np.flatnonzero(self._dev.paused()) if int(r) not in self._asking]
    if not new:
      return
    count = self._dev.row_count
    ids = np.full((count,), count, np.int32)  # one program: padded to every row
    ids[:len(new)] = new
    outs, lengths, tokens, observed = self._dev.turns_of(ids)
    for i, row in enumerate(new):
      out = int(outs[i])
      if self._replies.get(out, 0) >= self.max_turns:
        future = concurrent.futures.Future()
        future.set_result(None)
      else:
        if self._pool is None:
          self._pool = concurrent.futures.ThreadPoolExecutor(self._threads,
                                                             thread_name_prefix="respond")
        k = int(lengths[i])
        w, pos = self._held[out // self.n], out % self.n
        seen = np.array(observed[i, :k])
        if w.begun is not None:  # a resumed sample: its own index, its begun tokens' flags
          before = w.begun[pos].observed
          if before is not None:
            seen[:len(before)] = before[:k]
          pos = int(w.order[pos])
        future = self._pool.submit(self.respond, w.key, pos, np.array(tokens[i, :k]), seen)
      self._asking[row] = (out, int(lengths[i]), future)

  def _answers(self, wait: bool) -> bool:
    """Feed the replies that are in (after waiting for one, with `wait`) to their rows;
    True when some were."""
    if not self._asking:
      return False
    if wait:
      concurrent.futures.wait([f for _, _, f in self._asking.values()],
                              return_when=concurrent.futures.FIRST_COMPLETED)
    ready = [row for row, (_, _, f) in self._asking.items() if f.done()]
    if not ready:
      return False
    count = self._dev.row_count
    width = self._dev.reply_width
    ids = np.full((count,), count, np.int32)  # one program: padded to every row
    replies = np.zeros((count, width), np.int32)
    counts = np.zeros((count,), np.int32)
    go_on = np.zeros((count,), bool)
    vocab = self.model.config.vocab_size
    feeds = {}  # the replies fed at once: those the budget does not cut short
    for i, row in enumerate(ready):
      out, length, future = self._asking.pop(row)
      ids[i] = row
      reply = future.result()
      if reply is None:
        continue
      reply = np.asarray(reply, np.int64).reshape(-1)
      if not reply.size:  # as None: a reply of no tokens is no turn a resume could count
        continue
      if reply.min() < 0 or reply.max() >= vocab:
        raise ValueError(f"respond: reply token ids must lie in [0, {vocab}), got "
                         f"[{reply.min()}, {reply.max()}]")
      reply = reply[:width]  # the budget ends the sample within the reply anyway
      self._replies[out] = self._replies.get(out, 0) + 1
      go_on[i], counts[i] = True, reply.size
      replies[i, width - reply.size:] = reply
      if length + reply.size < self.params.max_new_tokens:
        feeds[row] = reply
    self._dev.answer(ids, replies, counts, go_on)
    self._feed(feeds)
    return True

  def _take(self, finished: list[int]) -> list[tuple[Hashable, list[Sample]]]:
    if not finished:
      return []
    ids = np.full((self.num_slots,), finished[0], np.int32)  # one program per batch shape
    ids[:len(finished)] = finished
    flat = self._samples(ids, finished)
    out = []
    for i, s in enumerate(finished):
      w = self._held.pop(s)
      out.append((w.key, w.restore(flat[i * self.n:i * self.n + w.count])[0]))
    return out

  def _samples(self, ids: np.ndarray, slots: list[int]) -> list[Sample]:
    """The samples of `slots` (ids: them, padded to every slot), n per slot, in order."""
    host: Any = self._dev.collect(ids)
    tokens, logp, slogp, lengths, reasons, observed, *routes = host
    prompt_lens = [self._held[s].tokens.size for s in slots]
    return samples_of(tokens, logp, slogp, lengths[:len(slots) * self.n], reasons,
                      *(routes or (None, None)), prompt_lens=prompt_lens,
                      prompt_row=lambda i: i // self.n, observed=observed)
