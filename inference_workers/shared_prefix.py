"""A decode cache for N samples of each prompt: one prefix KV cache read once per step for all N.

It speaks the model's cache protocol (write_meta / attend / advance), so the transformer runs
unchanged on rows [B*N] (row b*N + j is sample j of prompt b). The prompt's keys/values are
held once per prompt, never copied N times; each sample only owns its suffix (the tokens it
generated). Attention is computed in two partials merged by log-sum-exp: all N queries of a
prompt against its prefix in one matmul ([N*group, D] x [D, S]), each query against its own
suffix. The partial/merge function is pluggable (`decode_fn`); the default is the kernels'
dispatch (the XLA two-pass path on CPU/GPU, the Pallas decode kernel on TPU); several tokens
a row at once (`shared_prefix_extend_attention`) likewise.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from rlax_ps.kernels.dispatch import (shared_prefix_decode_attention,
                                      shared_prefix_extend_attention)
from rlax_ps.kernels.kv_quant import kv_repeat_heads, kv_write, kv_zeros
from rlax_ps.models.attention import with_sinks
from rlax_ps.models.kv_cache import check_values

# decode_fn(q [B,N,H,D], prefix_k, prefix_v [B,Sp,Hkv,D], prefix_lens [B],
#           suffix_k, suffix_v [B,N,Ss,Hkv,D], suffix_lens [B,N], *, window, sm_scale,
#           softcap)
#   -> (out [B,N,H,D], lse); the caches come in the dtype they are held in (fp8 too).
DecodeFn = Callable[..., tuple[jax.Array, jax.Array]]


def cache_heads(config, mesh) -> int:
  """The kv heads a worker's decode cache holds per token: the model's, or, for two or more
  on a tensor axis wider than them that divides the query heads, as many as the axis, each
  head repeated (as vLLM does): every device then holds only the head its query heads read,
  where it held them all (replicated, as they did not split) and attended every query
  head. A single kv head stays replicated: each device holds just it either way."""
  heads = config.kv_cache_layout[0]
  t = 1 if mesh is None else dict(mesh.shape).get("tensor", 1)
  if 1 < heads < t and t % heads == 0 and config.num_heads % t == 0:
    return t
  return heads


@flax.struct.dataclass
class SharedPrefixCache:
  """Prefix k/v per layer [B, Sp, Hkv, D] shared by N samples; suffix k/v [B, N, Ss, Hkv, D]
  (arrays, or `kv_quant.QuantizedKV`s for an int8 or fp8 cache), shaped by the config's
  `kv_cache_layout` (latent attention: no values, prefix_v and suffix_v are ()).

  Prefix slots [0, prefix_lens[b]) hold prompt b; suffix slots [0, index[b, j]) hold the
  tokens sample j of prompt b generated so far. Every sample advances T tokens a call (1: a
  decode step) and its index is its own, so a sample can start while the others are mid-way.
  """

  prefix_k: tuple[jax.Array, ...]
  prefix_v: tuple[jax.Array, ...]
  prefix_lens: jax.Array  # [B] int32
  suffix_k: tuple[jax.Array, ...]
  suffix_v: tuple[jax.Array, ...]
  index: jax.Array  # [B, N] int32: next suffix slot of each sample
  decode_fn: DecodeFn = flax.struct.field(pytree_node=False, default=shared_prefix_decode_attention)

  @classmethod
  def empty(cls, config, b: int, n: int, prefix_len: int, suffix_len: int,
            decode_fn: DecodeFn = shared_prefix_decode_attention,
            dtype=None, heads: int | None = None) -> "SharedPrefixCache":
    """B prompt slots of n samples, each holding a one-token prompt and nothing generated;
    k/v held in `dtype` (default: the model's compute dtype; float8_e4m3fn or int8 (codes
    with a scale per token and head, `kv_quant`) halve a bf16 cache, read back in the
    compute dtype), with `heads` kv heads (default the model's; `cache_heads`)."""
    dtype = jnp.dtype(config.dtype if dtype is None else dtype)
    model_heads, width, values = config.kv_cache_layout
    kv = (heads or model_heads, width)
    layers = range(config.num_layers)
    v_layers = layers if values else ()  # latent attention: the keys are the values
    return cls(prefix_k=tuple(kv_zeros((b, prefix_len) + kv, dtype) for _ in layers),
               prefix_v=tuple(kv_zeros((b, prefix_len) + kv, dtype) for _ in v_layers),
               prefix_lens=jnp.ones((b,), jnp.int32),
               suffix_k=tuple(kv_zeros((b, n, suffix_len) + kv, dtype) for _ in layers),
               suffix_v=tuple(kv_zeros((b, n, suffix_len) + kv, dtype) for _ in v_layers),
               index=jnp.zeros((b, n), jnp.int32), decode_fn=decode_fn)

  @property
  def num_samples(self) -> int:
    return self.suffix_k[0].shape[1]

  def write_meta(self, segment_ids: jax.Array, positions: jax.Array) -> "SharedPrefixCache":
    """Nothing to record: validity is by length (prefix_lens, index), every row is one sample."""
    del segment_ids, positions
    return self

  def attend(self, layer: int, q, k, v, q_segment_ids, q_positions, attention_fn, *,
             window: int | None = None, sm_scale: float | None = None,
             softcap: float | None = None, sinks=None):
    """Write each sample's new k/v [B*N, T, Hkv, D] at its suffix slots from `index[b, j]`,
    attend prefix+suffix (within `window` positions when the layer slides: query t sits at
    prefix_len + index + t). One token a row is a decode step (`decode_fn`); several are
    fed at once (`shared_prefix_extend_attention`)."""
    del q_segment_ids, q_positions, attention_fn  # the dense mask path does not apply here
    rows, t, h, d = q.shape
    b, n = self.prefix_lens.shape[0], self.num_samples
    if rows != b * n:
      raise ValueError(f"SharedPrefixCache.attend: expected q of shape [{b * n}, T, heads, "
                       f"head_dim] (B={b} prompts x N={n} samples), got {q.shape}")
    check_values(v, bool(self.suffix_v))
    hkv, dk = k.shape[2:]
    heads = self.suffix_k[layer].shape[-2]  # hkv, or each head repeated (cache_heads)
    at = (jnp.arange(b)[:, None, None], jnp.arange(n)[None, :, None],
          self.index[:, :, None] + jnp.arange(t))
    new_k = kv_write(self.suffix_k[layer], at,
                     kv_repeat_heads(k.reshape(b, n, t, hkv, dk), heads))
    # The caches go as they are held (fp8, int8 too): the attention widens them as it reads.
    prefix_k = self.prefix_k[layer]
    if v is None:  # latent attention: one cache read as keys and values
      new_v, prefix_v, suffix_v = new_k, prefix_k, self.suffix_v
    else:
      new_v = kv_write(self.suffix_v[layer], at,
                       kv_repeat_heads(v.reshape(b, n, t, hkv, dk), heads))
      prefix_v = self.prefix_v[layer]
      suffix_v = self.suffix_v[:layer] + (new_v,) + self.suffix_v[layer + 1:]
    if t == 1:
      out, lse = self.decode_fn(q.reshape(b, n, h, d), prefix_k, prefix_v, self.prefix_lens,
                                new_k, new_v, self.index + 1, window=window,
                                sm_scale=sm_scale, softcap=softcap)
    else:  # several tokens a row (a reply fed at once): the prefix read once for all
      out, lse = shared_prefix_extend_attention(
          q.reshape(b, n, t, h, d), prefix_k, prefix_v, self.prefix_lens, new_k, new_v,
          self.index, window=window, sm_scale=sm_scale, softcap=softcap)
    if sinks is not None:  # gpt-oss: the sinks join the softmax the partials merged
      out = with_sinks(out, lse, sinks)
    cache = self.replace(suffix_k=self.suffix_k[:layer] + (new_k,) + self.suffix_k[layer + 1:],
                         suffix_v=suffix_v)
    return out.reshape(rows, t, h, d).astype(q.dtype), cache

  def advance(self, t: int) -> "SharedPrefixCache":
    return self.replace(index=self.index + t)
