"""KVCache: the decoding cache, a pytree that jitted code passes in and gets back."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from rlax_ps.models.config import ModelConfig


def check_values(v, holds_values: bool) -> None:
  """A cache's attend takes values (v) exactly when it holds them: a latent-attention cache
  (`kv_cache_layout`) reads its keys as values and takes v None."""
  if (v is not None) != holds_values:
    raise ValueError(f"v: expected {'values' if holds_values else 'None'} for a cache that "
                     f"{'holds' if holds_values else 'reads its keys as'} values, got "
                     f"{'None' if v is None else 'values'}")


@flax.struct.dataclass
class KVCache:
  """Keys/values per layer plus the segment id and position of every slot.

  Slots [0, index) are filled; an empty slot has segment id 0 so no real query sees it.
  Its shape is the config's `kv_cache_layout`: a latent-attention model holds no values
  (v is ()), its keys being read as the values too.
  """

  k: tuple[jax.Array, ...]  # per layer [B, S, Hkv, D]
  v: tuple[jax.Array, ...]  # as k, or () where the keys are the values
  segment_ids: jax.Array  # [B, S] int32, 0 = empty or padding
  positions: jax.Array  # [B, S] int32
  index: jax.Array  # int32 scalar: next slot to write

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    dtype = jnp.dtype(dtype or config.dtype)
    heads, width, values = config.kv_cache_layout
    shape = (batch, max_len, heads, width)
    layers = range(config.num_layers if values else 0)
    return cls(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in layers),
        segment_ids=jnp.zeros((batch, max_len), jnp.int32),
        positions=jnp.zeros((batch, max_len), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )

  @property
  def max_len(self) -> int:
    return self.segment_ids.shape[1]

  def write_meta(self, segment_ids: jax.Array, positions: jax.Array) -> "KVCache":
    """Record the segment ids and positions of T new tokens at slots [index, index+T).
    Tokens past max_len are a ValueError (a slice write would clamp and overwrite the last
    slots: wrong logits); under jit only when T alone exceeds it, the index being traced."""
    t = segment_ids.shape[1]
    filled = None if isinstance(self.index, jax.core.Tracer) else int(self.index)
    if (filled or 0) + t > self.max_len:
      raise ValueError(f"cache: {t} new tokens after {'its' if filled is None else filled} "
                       f"filled slots overflow a KVCache of max_len={self.max_len}; make it "
                       "with a larger max_len")
    start = (jnp.zeros((), jnp.int32), self.index)
    return self.replace(
        segment_ids=jax.lax.dynamic_update_slice(self.segment_ids,
                                                 segment_ids.astype(jnp.int32), start),
        positions=jax.lax.dynamic_update_slice(self.positions, positions.astype(jnp.int32),
                                               start),
    )

  def attend(self, layer: int, q, k, v, q_segment_ids, q_positions, attention_fn, *,
             window: int | None = None, sm_scale: float | None = None,
             softcap: float | None = None, sinks=None):
    """Write layer `layer`'s new k/v [B, T, Hkv, D] at slot `index`, attend over all slots
    (within `window` positions when the layer slides). v None: the keys are the values (a
    cache without values, `kv_cache_layout`)."""
    check_values(v, bool(self.v))
    zero = jnp.zeros((), jnp.int32)
    start = (zero, self.index, zero, zero)
    layer_k = jax.lax.dynamic_update_slice(self.k[layer], k.astype(self.k[layer].dtype), start)
    new_k = self.k[:layer] + (layer_k,) + self.k[layer + 1:]
    layer_v, new_v = layer_k, self.v
    if v is not None:
      layer_v = jax.lax.dynamic_update_slice(self.v[layer], v.astype(self.v[layer].dtype), start)
      new_v = self.v[:layer] + (layer_v,) + self.v[layer + 1:]
    out = attention_fn(q, layer_k.astype(q.dtype), layer_v.astype(q.dtype), q_segment_ids,
                       q_positions, self.segment_ids, self.positions, window=window,
                       sm_scale=sm_scale, softcap=softcap,
                       **({} if sinks is None else {"sinks": sinks}))
    return out, self.replace(k=new_k, v=new_v)

  def advance(self, t: int) -> "KVCache":
    """Move the write slot past the T tokens just processed."""
    return self.replace(index=self.index + t)
