"""The packed shared-prompt layout: one prompt region then N response regions.

A GRPO group of one prompt (P tokens) and N responses (R tokens each) is packed
as `[P + N*R]` tokens: `[prompt | response 0 | ... | response N-1]`. Regions have
static capacities (`prompt_capacity`, `response_capacity`) and are right-padded;
the real lengths are arrays. Response i attends the real prompt tokens and its
own earlier tokens, never another response, so the packed group computes
exactly what N separate `[prompt, response i]` sequences would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedPromptLayout:
  """Where the prompt and the N responses lie in a packed row.

  prompt_lens: [B] int32, real prompt length per row (<= prompt_capacity).
  response_lens: [B, N] int32, real length of each response (<= response_capacity).
  num_responses, prompt_capacity, response_capacity: static region sizes.
  """
  prompt_lens: jax.Array
  response_lens: jax.Array
  num_responses: int = dataclasses.field(metadata=dict(static=True))
  prompt_capacity: int = dataclasses.field(metadata=dict(static=True))
  response_capacity: int = dataclasses.field(metadata=dict(static=True))

  @property
  def total_len(self) -> int:
    return self.prompt_capacity + self.num_responses * self.response_capacity

  @property
  def batch(self) -> int:
    return self.prompt_lens.shape[0]

  def validate(self, seq_len: int | None = None, batch: int | None = None) -> None:
    """Checks static shapes; errors name the field, the expected and received value."""
    n = self.num_responses
    if n < 1:
      raise ValueError(f"num_responses must be >= 1, got {n}")
    if self.prompt_capacity < 1 or self.response_capacity < 1:
      raise ValueError(
          "prompt_capacity and response_capacity must be >= 1, got "
          f"{self.prompt_capacity} and {self.response_capacity}")
    if self.prompt_lens.ndim != 1:
      raise ValueError(f"prompt_lens must be [B], got shape {self.prompt_lens.shape}")
    if self.response_lens.shape != (self.prompt_lens.shape[0], n):
      raise ValueError(
          f"response_lens must have shape (B, N)={(self.prompt_lens.shape[0], n)}, "
          f"got {self.response_lens.shape}")
    if seq_len is not None and seq_len != self.total_len:
      raise ValueError(
          f"sequence length must be prompt_capacity + num_responses * "
          f"response_capacity = {self.total_len}, got {seq_len}")
    if batch is not None and batch != self.prompt_lens.shape[0]:
      raise ValueError(
          f"batch of prompt_lens must match the inputs' batch {batch}, "
          f"got {self.prompt_lens.shape[0]}")

  # Static per-position structure (numpy, shape [L]).
  def region_ids(self) -> np.ndarray:
    """0 for the prompt region, i + 1 for response i."""
    r = np.zeros(self.total_len, np.int32)
    r[self.prompt_capacity:] = 1 + np.arange(
        self.num_responses * self.response_capacity) // self.response_capacity
    return r

  def local_index(self) -> np.ndarray:
    """Offset of each position inside its region."""
    idx = np.arange(self.total_len, dtype=np.int32)
    out = idx.copy()
    out[self.prompt_capacity:] = (idx[self.prompt_capacity:] - self.prompt_capacity) % (
        self.response_capacity)
    return out

  # Per-row arrays.
  def region_lens(self) -> jax.Array:
    """[B, L]: the real length of the region each position lies in."""
    lens = jnp.concatenate([self.prompt_lens[:, None], self.response_lens], axis=1)
    return lens[:, self.region_ids()]

  def valid(self) -> jax.Array:
    """[B, L] bool: position holds a real token (none in a row of no responses: a batch's
    padding row, whose one-token prompt is no token of the batch's)."""
    used = (jnp.sum(self.response_lens, axis=1) > 0)[:, None]
    return (jnp.asarray(self.local_index())[None, :] < self.region_lens()) & used

  def positions(self) -> jax.Array:
    """[B, L] int32 RoPE positions: prompt 0..P-1, every response restarts at P."""
    local = jnp.asarray(self.local_index())[None, :]
    in_resp = jnp.asarray(self.region_ids() > 0)[None, :]
    return jnp.where(in_resp, self.prompt_lens[:, None] + local, local).astype(jnp.int32)

  def segment_ids(self) -> jax.Array:
    """[B, L] int32: 0 padding, 1 prompt, i + 2 response i."""
    return jnp.where(self.valid(), jnp.asarray(self.region_ids())[None, :] + 1, 0)

  def dense_mask(self) -> jax.Array:
    """[B, L, L] bool: query attends key (the packed mask, for references)."""
    reg = self.region_ids()
    idx = np.arange(self.total_len)
    same_or_prompt = (reg[:, None] == reg[None, :]) | (reg[None, :] == 0)
    structural = jnp.asarray(same_or_prompt & (idx[None, :] <= idx[:, None]))
    v = self.valid()
    return structural[None] & v[:, :, None] & v[:, None, :]


def make_layout(prompt_lens, response_lens, prompt_capacity: int,
                response_capacity: int) -> SharedPromptLayout:
  """Builds a layout from lengths; N is read from response_lens' last axis."""
  prompt_lens = jnp.asarray(prompt_lens, jnp.int32)
  response_lens = jnp.asarray(response_lens, jnp.int32)
  layout = SharedPromptLayout(
      prompt_lens=prompt_lens, response_lens=response_lens,
      num_responses=int(response_lens.shape[-1]), prompt_capacity=int(prompt_capacity),
      response_capacity=int(response_capacity))
  layout.validate()
  if not isinstance(prompt_lens, jax.core.Tracer):
    p = np.asarray(prompt_lens)
    if p.size and (p.min() < 1 or p.max() > prompt_capacity):
      raise ValueError(f"prompt_lens must lie in [1, prompt_capacity={prompt_capacity}], got {p}")
  if not isinstance(response_lens, jax.core.Tracer):
    r = np.asarray(response_lens)
    if r.size and (r.min() < 0 or r.max() > response_capacity):
      raise ValueError(
          f"response_lens must lie in [0, response_capacity={response_capacity}], got {r}")
  return layout


def split_regions(x: jax.Array, layout: SharedPromptLayout):
  """[B, L, ...] -> (prompt [B, P, ...], responses [B, N, R, ...])."""
  p, n, r = layout.prompt_capacity, layout.num_responses, layout.response_capacity
  return x[:, :p], x[:, p:].reshape(x.shape[0], n, r, *x.shape[2:])


def join_regions(prompt: jax.Array, responses: jax.Array) -> jax.Array:
  """Inverse of split_regions."""
  b, n, r = responses.shape[:3]
  return jnp.concatenate([prompt, responses.reshape(b, n * r, *responses.shape[3:])], axis=1)


def repad_regions(x: jax.Array, layout: SharedPromptLayout, prompt_capacity: int,
                  response_capacity: int) -> jax.Array:
  """Moves a packed [B, L, ...] array to larger region capacities (zero padded)."""
  prompt, resp = split_regions(x, layout)
  extra = [(0, 0)] * (x.ndim - 2)
  prompt = jnp.pad(prompt, [(0, 0), (0, prompt_capacity - layout.prompt_capacity)] + extra)
  resp = jnp.pad(resp, [(0, 0), (0, 0), (0, response_capacity - layout.response_capacity)] + extra)
  return join_regions(prompt, resp)


def unpad_regions(x: jax.Array, layout: SharedPromptLayout, prompt_capacity: int,
                  response_capacity: int) -> jax.Array:
  """Inverse of repad_regions: x has the larger capacities, result has layout's."""
  b = x.shape[0]
  n = layout.num_responses
  prompt = x[:, :layout.prompt_capacity]
  resp = x[:, prompt_capacity:].reshape(b, n, response_capacity, *x.shape[2:])
  return join_regions(prompt, resp[:, :, :layout.response_capacity])
