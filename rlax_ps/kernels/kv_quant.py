"""KV caches held as int8 or fp8 (e4m3) codes with a scale per token and KV head (a
worker's `kv_cache_dtype=int8` / `float8_e4m3fn`): half a bf16 cache.

`QuantizedKV(values [..., S, Hkv, D], scales float32 [..., S, Hkv])` stands where a cache
array does; these helpers take either: `kv_zeros` makes one, `kv_write` stores new k/v
(quantized on the way in), `kv_widen` reads it back in a compute dtype, indexing (`x[i]`)
selects in both parts. A token's keys of one head are scaled so that their largest
magnitude is the codes' (int8: 127, rounded to the nearest level, an error of at most half
a level of that token's own range; e4m3: 448, 3 mantissa bits), so no key overflows the
codes however large (an e4m3 cast alone turns keys past 448 into NaN). The decode kernels
take it as held and widen a block at a time (`decode_tpu`); XLA widens first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LEVELS = 127  # int8 codes' largest magnitude
FP8_MAX = 448.0  # float8_e4m3fn's
SCALED = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))  # the dtypes held with scales


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedKV:
  values: jax.Array  # int8 [..., S, Hkv, D]
  scales: jax.Array  # float32 [..., S, Hkv]

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def ndim(self) -> int:
    return self.values.ndim

  @property
  def dtype(self):
    return self.values.dtype

  @property
  def nbytes(self) -> int:
    return self.values.nbytes + self.scales.nbytes

  def __getitem__(self, index) -> "QuantizedKV":
    return QuantizedKV(self.values[index], self.scales[index])

  def reshape(self, *shape) -> "QuantizedKV":
    """A new shape of the leading dims (S, Hkv and D stay)."""
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
    return QuantizedKV(self.values.reshape(shape), self.scales.reshape(shape[:-1]))


def quantize(x, dtype=jnp.int8) -> QuantizedKV:
  """k or v [..., Hkv, D] -> codes of `dtype` (int8 or float8_e4m3fn) and a scale per
  [..., Hkv] (its largest |x| over the codes' largest)."""
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  # (at least the smallest normal float32: a head of values below ~1e-36 had a scale flushed
  # to 0, which made its fp8 codes NaN and its int8 ones 0)
  tiny = jnp.finfo(jnp.float32).tiny
  if jnp.dtype(dtype) == jnp.int8:
    scales = jnp.where(amax > 0, jnp.maximum(amax / LEVELS, tiny), 1.0)
    values = jnp.clip(jnp.round(x / scales[..., None]), -LEVELS, LEVELS).astype(jnp.int8)
  else:
    scales = jnp.where(amax > 0, jnp.maximum(amax / FP8_MAX, tiny), 1.0)
    values = jnp.clip(x / scales[..., None], -FP8_MAX, FP8_MAX).astype(dtype)
  return QuantizedKV(values, scales)


def kv_zeros(shape: tuple[int, ...], dtype) -> jax.Array | QuantizedKV:
  """An empty cache [..., S, Hkv, D] held in `dtype` (int8, float8_e4m3fn: a
  QuantizedKV)."""
  if jnp.dtype(dtype) in SCALED:
    return QuantizedKV(jnp.zeros(shape, dtype), jnp.ones(shape[:-1], jnp.float32))
  return jnp.zeros(shape, dtype)


def kv_write(buf, index, new):
  """buf with `new` (k or v, any float dtype, or already a QuantizedKV) at `index` (out of
  range: dropped), in the dtype buf holds."""
  if isinstance(buf, QuantizedKV):
    if not isinstance(new, QuantizedKV):
      new = quantize(new, buf.values.dtype)
    return QuantizedKV(buf.values.at[index].set(new.values, mode="drop"),
                       buf.scales.at[index].set(new.scales, mode="drop"))
  return buf.at[index].set(new.astype(buf.dtype), mode="drop")


def kv_repeat_heads(new, heads: int):
  """New k or v [..., Hkv, D] (or a QuantizedKV) with each head repeated to `heads` in all
  (a multiple of Hkv): head h of the result is head h // (heads / Hkv), so grouped queries
  read the same keys. As they are: when they have `heads` already."""
  repeat = heads // new.shape[-2]
  if repeat == 1:
    return new
  if isinstance(new, QuantizedKV):
    return QuantizedKV(jnp.repeat(new.values, repeat, axis=-2),
                       jnp.repeat(new.scales, repeat, axis=-1))
  return jnp.repeat(new, repeat, axis=-2)


def kv_widen(x, dtype):
  """A cache as an array of `dtype` (a QuantizedKV dequantized)."""
  if isinstance(x, QuantizedKV):
    return (x.values.astype(jnp.float32) * x.scales[..., None]).astype(dtype)
  return x.astype(dtype)

