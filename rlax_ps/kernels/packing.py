"""Pack a GRPO group into one `[P + N*R]` row and read per-response log-probs back.

The model runs the packed row once (norms, projections, MLPs and attention all
see the prompt once) through `Transformer(..., attention_fn=packed_attention_fn(layout))`;
response i's first token is scored by the logit at the last real prompt token
(P - 1) for every i, later tokens by the logit just before them in region i.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_ps.kernels.dispatch import shared_prompt_attention
from rlax_ps.models.attention import with_sinks
from rlax_ps.kernels.layout import SharedPromptLayout, join_regions, make_layout
from rlax_ps.kernels.schedule import BlockSizes


def pack_group(prompt_tokens, prompt_lens, response_tokens, response_lens, pad_id: int = 0):
  """prompt_tokens [B, P] (right-padded), response_tokens [B, N, R] (right-padded)
  -> (tokens [B, P + N*R] int32, SharedPromptLayout)."""
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  response_tokens = jnp.asarray(response_tokens, jnp.int32)
  if prompt_tokens.ndim != 2:
    raise ValueError(f"prompt_tokens must be [B, P], got shape {prompt_tokens.shape}")
  if response_tokens.ndim != 3 or response_tokens.shape[0] != prompt_tokens.shape[0]:
    raise ValueError(
        f"response_tokens must be [B={prompt_tokens.shape[0]}, N, R], got shape "
        f"{response_tokens.shape}")
  layout = make_layout(prompt_lens, response_lens, prompt_tokens.shape[1],
                       response_tokens.shape[2])
  valid = layout.valid()
  tokens = join_regions(prompt_tokens, response_tokens)
  return jnp.where(valid, tokens, pad_id), layout


def packed_attention_fn(layout: SharedPromptLayout, *, backend: str = "auto",
                        block_sizes: BlockSizes | None = None, interpret: bool = False):
  """An `attention_fn` for the model: same signature as models.attention.dot_product_attention,
  the mask comes from the layout (segment ids and positions are not needed); `window`,
  `sm_scale` and `softcap` go to shared_prompt_attention, `sinks` (gpt-oss) rescale its
  output by its log-sum-exp."""

  def attention_fn(q, k, v, q_segment_ids, q_positions, k_segment_ids, k_positions, *,
                   window=None, sm_scale=None, softcap=None, sinks=None):
    del q_segment_ids, q_positions, k_segment_ids, k_positions
    out, lse = shared_prompt_attention(q, k, v, layout, sm_scale=sm_scale, window=window,
                                       softcap=softcap, backend=backend,
                                       block_sizes=block_sizes, interpret=interpret)
    return out if sinks is None else with_sinks(out, lse, sinks)

  return attention_fn


def response_logit_index(layout: SharedPromptLayout) -> jax.Array:
  """[B, N, R] int32: packed position whose logit predicts response token (i, t)."""
  p, n, r = layout.prompt_capacity, layout.num_responses, layout.response_capacity
  t = jnp.arange(r, dtype=jnp.int32)[None, None, :]
  i = jnp.arange(n, dtype=jnp.int32)[None, :, None]
  inside = p + i * r + t - 1
  first = jnp.broadcast_to(layout.prompt_lens[:, None, None] - 1, (layout.batch, n, r))
  return jnp.where(t == 0, first, inside)


def response_logprobs(logits, response_tokens, layout: SharedPromptLayout, *,
                      with_entropy: bool = False, targets=None, temperature: float = 1.0):
  """logits [B, L, V] of the packed row -> log p(response token) [B, N, R], 0 at padding;
  `with_entropy`: also the entropy of each response position's next-token distribution;
  `targets` [B, N, R, k]: also the log-probs of those ids at each response position (a
  teacher's top k), after the entropy. `temperature`: of the distribution softmax(logits /
  temperature), the one a sampler at that temperature draws from."""
  b, n, r = layout.batch, layout.num_responses, layout.response_capacity
  if logits.shape[:2] != (b, layout.total_len):
    raise ValueError(
        f"logits must be [B={b}, L={layout.total_len}, V], got shape {logits.shape}")
  idx = response_logit_index(layout).reshape(b, n * r)
  rows = jnp.take_along_axis(logits, idx[:, :, None], axis=1).astype(jnp.float32)
  logp = jax.nn.log_softmax(_tempered(rows, temperature), axis=-1)
  tok = jnp.asarray(response_tokens, jnp.int32).reshape(b, n * r, 1)
  out = jnp.take_along_axis(logp, tok, axis=-1).reshape(b, n, r)
  valid = jnp.arange(r)[None, None, :] < layout.response_lens[:, :, None]
  out = jnp.where(valid, out, 0.0)
  extra = []
  if with_entropy:
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1).reshape(b, n, r)
    extra.append(jnp.where(valid, entropy, 0.0))
  if targets is not None:
    ids = jnp.asarray(targets, jnp.int32).reshape(b, n * r, -1)
    at = jnp.take_along_axis(logp, ids, axis=-1).reshape(b, n, r, -1)
    extra.append(jnp.where(valid[..., None], at, 0.0))
  return (out, *extra) if extra else out


def _tempered(logits, temperature: float):
  """`logits` of the distribution at `temperature` (a Python float > 0; 1: themselves)."""
  if not temperature > 0:
    raise ValueError(f"temperature: expected > 0, got {temperature}")
  return logits if temperature == 1.0 else logits / jnp.float32(temperature)


def _map_response_chunks(fn, hidden, ids, layout: SharedPromptLayout, chunk: int):
  """fn(h [B, chunk, H], ids [B, chunk, k]) -> arrays [B, chunk, ...], over the packed
  rows' response positions `chunk` at a time (hidden [B, L, H], ids [B, N, R, k] given per
  position); each output as [B, N, R, ...], 0 at padding."""
  b, n, r = layout.batch, layout.num_responses, layout.response_capacity
  idx = response_logit_index(layout).reshape(b, n * r)
  h = jnp.take_along_axis(hidden, idx[:, :, None], axis=1)  # [B, N*R, H]
  ids = jnp.asarray(ids, jnp.int32).reshape(b, n * r, -1)
  chunks = -(-(n * r) // chunk)
  pad = chunks * chunk - n * r
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, chunks, chunk, -1).swapaxes(0, 1)
  ids = jnp.pad(ids, ((0, 0), (0, pad), (0, 0))).reshape(b, chunks, chunk, -1).swapaxes(0, 1)
  valid = jnp.arange(r)[None, None, :] < layout.response_lens[:, :, None]

  def unchunk(x):  # [chunks, B, chunk, ...] -> [B, N, R, ...]
    x = x.swapaxes(0, 1).reshape(b, chunks * chunk, *x.shape[3:])[:, :n * r]
    x = x.reshape(b, n, r, *x.shape[2:])
    return jnp.where(valid.reshape(*valid.shape, *(1,) * (x.ndim - 3)), x, 0)

  return tuple(unchunk(x) for x in jax.lax.map(lambda a: fn(*a), (h, ids)))


def chunked_response_logprobs(model, hidden, response_tokens, layout: SharedPromptLayout, *,
                              chunk: int, with_entropy: bool = False, targets=None,
                              temperature: float = 1.0):
  """response_logprobs from the packed row's final hidden states [B, L, H], projecting
  `chunk` response positions to the vocabulary at a time and recomputing each chunk in the
  backward pass: at most [B, chunk, V] logits live at once instead of [B, L, V] (a long
  response under a 150k vocabulary otherwise takes gigabytes per row). `targets` as
  response_logprobs', and `temperature`."""
  ids = jnp.asarray(response_tokens, jnp.int32)[..., None]
  if targets is not None:  # the targets' ids after the sampled one's
    ids = jnp.concatenate([ids, jnp.asarray(targets, jnp.int32)], -1)

  @jax.checkpoint
  def one(h_c, ids_c):
    logits = _tempered(model.logits_from_hidden(h_c).astype(jnp.float32), temperature)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return (jnp.take_along_axis(logp, ids_c, axis=-1),
            -jnp.sum(jnp.exp(logp) * logp, axis=-1))

  out, entropy = _map_response_chunks(one, hidden, ids, layout, chunk)
  extra = [entropy] if with_entropy else []
  if targets is not None:
    extra.append(out[..., 1:])
  return (out[..., 0], *extra) if extra else out[..., 0]


def packed_response_logprobs(model, tokens, response_tokens, layout: SharedPromptLayout, *,
                             backend: str = "auto", block_sizes: BlockSizes | None = None,
                             interpret: bool = False, with_entropy: bool = False,
                             logits_chunk: int = 0, remat: bool = False, routes=None,
                             record_routes: bool = False, targets=None,
                             temperature: float = 1.0):
  """Runs the model once on the packed group and returns [B, N, R] response log-probs
  (and, `with_entropy`, the policy's entropy at each response position). `logits_chunk` > 0
  projects that many response positions to the vocabulary at a time
  (chunked_response_logprobs); 0 projects the whole row. `remat` recomputes each layer in
  the backward pass; `routes` [M, B, L, k] replays experts and `record_routes` appends the
  `Routing` (the routers' own picks, the load-balancing loss) to the outputs
  (Transformer.hidden_states). `targets` [B, N, R, k]: also the log-probs of those ids at
  each response position, after the entropy (response_logprobs); `temperature`: of
  softmax(logits / temperature), the workers' sampling distribution."""
  attention_fn = packed_attention_fn(layout, backend=backend, block_sizes=block_sizes,
                                     interpret=interpret)
  hidden, _, *routing = model.hidden_states(
      tokens, positions=layout.positions(), segment_ids=layout.segment_ids(),
      attention_fn=attention_fn, remat=remat, routes=routes, record_routes=record_routes)
  if logits_chunk > 0:
    out = chunked_response_logprobs(model, hidden, response_tokens, layout,
                                    chunk=logits_chunk, with_entropy=with_entropy,
                                    targets=targets, temperature=temperature)
  else:
    out = response_logprobs(model.logits_from_hidden(hidden), response_tokens, layout,
                            with_entropy=with_entropy, targets=targets,
                            temperature=temperature)
  if not record_routes:
    return out
  return (*out, routing[0]) if isinstance(out, tuple) else (out, routing[0])


def packed_response_topk(model, tokens, response_tokens, layout: SharedPromptLayout, k: int,
                         *, backend: str = "auto", logits_chunk: int = 0,
                         vocab_size: int | None = None):
  """In one forward pass of the packed rows: the response tokens' log-probs [B, N, R] and
  the model's k most likely next tokens at each response position (ids [B, N, R, k] int32,
  their log-probs [B, N, R, k]), 0 at padding; `logits_chunk` > 0 projects that many
  positions to the vocabulary at a time (a distillation teacher's forward under a large
  vocabulary). `vocab_size`: the ids a tokenizer gives; the top k names none of the
  model's padded rows past it (a student's head may not have them)."""
  attention_fn = packed_attention_fn(layout, backend=backend)
  hidden = model.hidden_states(tokens, positions=layout.positions(),
                               segment_ids=layout.segment_ids(), attention_fn=attention_fn)[0]
  positions = layout.num_responses * layout.response_capacity

  def one(h_c, tok_c):
    logp = jax.nn.log_softmax(model.logits_from_hidden(h_c).astype(jnp.float32), axis=-1)
    named = logp  # the ids the top k may name (the log-probs themselves stay the model's)
    if vocab_size is not None and vocab_size < logp.shape[-1]:
      named = jnp.where(jnp.arange(logp.shape[-1]) < vocab_size, logp, -jnp.inf)
    top, ids = jax.lax.top_k(named, k)
    return jnp.take_along_axis(logp, tok_c, -1)[..., 0], ids.astype(jnp.int32), top

  return _map_response_chunks(one, hidden, jnp.asarray(response_tokens)[..., None], layout,
                              logits_chunk if 0 < logits_chunk < positions else positions)


def pack_routes(prompt_routes, response_routes):
  """prompt_routes [B, P, M, k], response_routes [B, N, R, M, k] -> the packed rows'
  routes [M, B, P + N*R, k] (Transformer.hidden_states' layout; -1 stays -1)."""
  return jnp.moveaxis(join_regions(jnp.asarray(prompt_routes), jnp.asarray(response_routes)),
                      2, 0)
