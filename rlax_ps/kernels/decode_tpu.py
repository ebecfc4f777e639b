"""Pallas TPU decode attention for N samples sharing one prefix KV cache.

One kernel, used twice: rows of queries attend a length-masked KV sequence.
Pass 1 puts all N samples' queries of a KV head in one [N*G, D] tile, so every
prefix block is read from HBM once per step for the whole group; pass 2 runs
each sample's query against its own suffix cache. The two partials are merged
by log-sum-exp (reference.merge_lse). Caches stay in the model's
[.., S, Hkv, D] layout, viewed as lane-dense [S, Hkv*D] tiles; an int8 cache's scales
[.., S, Hkv] come block by block beside its codes; a cache that is its own values (latent
attention) is read once for both. A sliding window
gives each query row a first visible key ([M, 128] int32 tile, lanes equal); the
blocks below a grid row's least one are neither fetched nor computed. A softcap
caps each block's scaled logits before the mask.

Extending (T tokens of each sample at once: a tool's reply, resumed tokens) is the same
kernel with N*T*G query rows against the prefix, blocked `block_m` rows at a time so the
tiles fit VMEM, and each row's own last suffix key (causal within the T tokens).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rlax_ps.kernels.kv_quant import QuantizedKV
from rlax_ps.kernels.reference import (cap_logits, check_decode, check_softcap, check_window,
                                       decode_window_starts, default_scale, merge_lse)

LANES = 128
_MASKED = -1e30
_NT = (((1,), (1,)), ((), ()))


def _decode_kernel(*refs, num_kv_heads, head_dim, block_s, num_blocks, num_row_blocks,
                   sm_scale, windowed, bounded, softcap, scaled, values_are_keys):
  refs = list(refs)
  hi_ref = refs.pop(0)
  lo_ref = refs.pop(0) if windowed else None
  q_ref = refs.pop(0)
  start_ref = refs.pop(0) if windowed else None
  end_ref = refs.pop(0) if bounded else None
  k_ref = refs.pop(0)
  v_ref = k_ref if values_are_keys else refs.pop(0)
  ks_ref = refs.pop(0) if scaled else None
  vs_ref = ks_ref if values_are_keys or not scaled else refs.pop(0)
  o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
  x, r, s_idx = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block = x * num_row_blocks + r
  length = hi_ref[block]  # the keys any row of this block sees end here

  @pl.when(s_idx == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, _MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  live = s_idx * block_s < length
  if windowed:  # blocks wholly below every row's first visible key are skipped
    live = live & ((s_idx + 1) * block_s > lo_ref[block])

  @pl.when(live)
  def _compute():
    for h in range(num_kv_heads):
      q = q_ref[h]  # [M, D]
      # A cache held narrower than the queries (fp8, int8) widens here, a block at a time:
      # HBM is read at the cache's width. The codes take their token's scale ([bs, 1]).
      k = k_ref[:, h * head_dim:(h + 1) * head_dim]  # [bs, D]
      v = v_ref[:, h * head_dim:(h + 1) * head_dim]
      if scaled:
        k = k.astype(jnp.float32) * ks_ref[:, h:h + 1]
        v = v.astype(jnp.float32) * vs_ref[:, h:h + 1]
      k, v = k.astype(q.dtype), v.astype(q.dtype)
      # The last block may overhang the cache (unspecified values): zero those rows of v
      # so that 0 * garbage cannot reach the output.
      v_rows = s_idx * block_s + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
      v = jnp.where(v_rows < length, v, jnp.zeros_like(v))
      s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * sm_scale
      s = cap_logits(s, softcap)
      cols = s_idx * block_s + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
      mask = cols < (end_ref[:, :1] if bounded else length)
      if windowed:
        mask = mask & (cols >= start_ref[:, :1])
      s = jnp.where(mask, s, _MASKED)
      m_prev = m_scr[h]
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)
      alpha = jnp.exp(m_prev - m_next)
      l_scr[h] = alpha * l_scr[h] + jnp.sum(p, axis=1, keepdims=True)
      m_scr[h] = m_next
      pv = jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
      acc_scr[h] = acc_scr[h] * alpha[:, :1] + pv

  @pl.when(s_idx == num_blocks - 1)
  def _finish():
    l = l_scr[...]
    has = l > 0
    l_safe = jnp.where(has, l, 1.0)
    o_ref[...] = acc_scr[...] / l_safe[..., :1]
    lse_ref[...] = jnp.where(has, m_scr[...] + jnp.log(l_safe), -jnp.inf)


def _row_tile(rows, m_pad: int, fill: int):
  """[X, M] per-row int32 bounds -> [X, M_pad, 128] (lanes equal), padded rows `fill`."""
  rows = jnp.pad(rows.astype(jnp.int32), ((0, 0), (0, m_pad - rows.shape[1])),
                 constant_values=fill)
  return jnp.broadcast_to(rows[..., None], rows.shape + (LANES,))


def decode_partial_pallas(q, k, v, lens, *, sm_scale, block_s=512, interpret=False,
                          starts=None, ends=None, softcap=None, block_m=512,
                          values_are_keys=False):
  """q [X, Hkv, M, D] attends k, v [X, S, Hkv, D] (arrays, or int8 `QuantizedKV`s) up to
  lens [X] (<= S); values_are_keys: v is k (latent attention's one cache), each block read
  from HBM once for both:
  -> (o [X, Hkv, M, D] f32, lse [X, Hkv, M] f32). starts [X, M] (optional): query row m
  sees keys from index starts[x, m] on; ends [X, M] (optional, <= lens): row m sees keys
  below ends[x, m]. Rows go `block_m` at a time; the key blocks a row block's bounds
  exclude are neither fetched nor computed. softcap (optional): logits
  softcap * tanh(s / softcap)."""
  x, hkv, m, d = q.shape
  s = k.shape[1]
  scaled = isinstance(k, QuantizedKV)
  if scaled:
    k, v, k_scales, v_scales = k.values, v.values, k.scales, v.scales
  if s < 8:  # a sublane tile of keys at least (Mosaic refuses a bf16 block of one key); the
    def tile(a):  # lengths mask the padding
      return jnp.pad(a, ((0, 0), (0, 8 - s)) + ((0, 0),) * (a.ndim - 2))
    k, v = tile(k), (tile(k) if values_are_keys else tile(v))
    if scaled:
      k_scales, v_scales = tile(k_scales), tile(v_scales)
    s = 8
  bs = min(block_s, s)
  nb = pl.cdiv(s, bs)  # no copy of the cache: a partial last block is masked in the kernel
  # a multiple of 8 sublanes (at least 8), or all rows
  bm = m if m <= block_m else max(8, block_m - block_m % 8)
  mb = pl.cdiv(m, bm)
  m_pad = mb * bm
  k2 = k.reshape(x, s, hkv * d)
  v2 = v.reshape(x, s, hkv * d)
  windowed, bounded = starts is not None, ends is not None
  lens = lens.astype(jnp.int32)
  if m_pad != m:
    q = jnp.pad(q, ((0, 0), (0, 0), (0, m_pad - m), (0, 0)))

  def per_block(rows, reduce, fill):  # [X, M] -> [X * MB]: each row block's bound
    rows = jnp.pad(rows.astype(jnp.int32), ((0, 0), (0, m_pad - m)), constant_values=fill)
    return reduce(rows.reshape(x, mb, bm), axis=2).reshape(-1)

  hi = jnp.repeat(lens, mb)
  if bounded:
    hi = jnp.minimum(hi, per_block(ends, jnp.max, 0))

  def kv_map(i, r, j, hi_ref, *lo):
    last = jnp.maximum(jax.lax.div(hi_ref[i * mb + r] + bs - 1, bs) - 1, 0)
    if windowed:
      j = jnp.maximum(j, jax.lax.div(lo[0][i * mb + r], bs))
    return i, jnp.minimum(j, last), 0

  row_map = lambda i, r, j, *_: (i, 0, r, 0)
  tile_map = lambda i, r, j, *_: (i, r, 0)
  in_specs = [pl.BlockSpec((None, hkv, bm, d), row_map)]
  prefetch = [hi]
  operands = [q]
  if windowed:
    starts = jnp.maximum(starts.astype(jnp.int32), 0)
    prefetch.append(per_block(starts, jnp.min, s))
    in_specs.append(pl.BlockSpec((None, bm, LANES), tile_map))
    operands.append(_row_tile(starts, m_pad, 0))
  if bounded:
    in_specs.append(pl.BlockSpec((None, bm, LANES), tile_map))
    operands.append(_row_tile(jnp.minimum(ends, lens[:, None]), m_pad, 0))
  caches = [k2] if values_are_keys else [k2, v2]
  in_specs += [pl.BlockSpec((None, bs, hkv * d), kv_map) for _ in caches]
  operands += caches
  if scaled:  # [X, S, Hkv] float32: each key block's scales beside it
    scales = [k_scales] if values_are_keys else [k_scales, v_scales]
    in_specs += [pl.BlockSpec((None, bs, hkv), kv_map) for _ in scales]
    operands += scales
  kernel = functools.partial(_decode_kernel, num_kv_heads=hkv, head_dim=d, block_s=bs,
                             num_blocks=nb, num_row_blocks=mb, sm_scale=sm_scale,
                             windowed=windowed, bounded=bounded, softcap=softcap,
                             scaled=scaled, values_are_keys=values_are_keys)
  o, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch),
          grid=(x, mb, nb),
          in_specs=in_specs,
          out_specs=[pl.BlockSpec((None, hkv, bm, d), row_map),
                     pl.BlockSpec((None, hkv, bm, LANES), row_map)],
          scratch_shapes=[pltpu.VMEM((hkv, bm, LANES), jnp.float32),
                          pltpu.VMEM((hkv, bm, LANES), jnp.float32),
                          pltpu.VMEM((hkv, bm, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct((x, hkv, m_pad, d), jnp.float32),
                 jax.ShapeDtypeStruct((x, hkv, m_pad, LANES), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="shared_prefix_decode",
  )(*prefetch, *operands)
  return o[:, :, :m], lse[:, :, :m, 0]


def shared_prefix_decode_pallas_tpu(q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v,
                                    suffix_lens, *, sm_scale=None, block_s=512, interpret=False,
                                    window: int | None = None, softcap: float | None = None,
                                    values_are_keys: bool = False):
  """q [B, N, H, D]; prefix [B, S, Hkv, D] (+ lens [B]); suffix [B, N, Ss, Hkv, D]
  (+ lens [B, N]) -> (o [B, N, H, D], lse [B, N, H]). With a window, each query row
  masks the keys below its first visible one and the kernel skips blocks below all rows'.
  A softcap caps the scaled logits of both passes. values_are_keys: the values are the
  keys (latent attention), read once; prefix_v and suffix_v are not read."""
  check_decode(q, prefix_k, prefix_v, suffix_k, suffix_v)
  window = check_window(window)
  softcap = check_softcap(softcap)
  b, n, h, d = q.shape
  hkv = prefix_k.shape[2]
  g = h // hkv
  scale = default_scale(d) if sm_scale is None else float(sm_scale)
  pre_start = suf_start = None
  if window is not None:
    pre_start, suf_start = decode_window_starts(prefix_lens, suffix_lens, window)
    pre_start = jnp.repeat(pre_start, g, axis=1)  # rows of pass 1 are (n, g), n-major
    suf_start = jnp.repeat(suf_start.reshape(b * n, 1), g, axis=1)
  qg = q.reshape(b, n, hkv, g, d)
  # Pass 1: [B, Hkv, N*G, D] rows against the shared prefix.
  q_pre = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(b, hkv, n * g, d)
  o1, l1 = decode_partial_pallas(q_pre, prefix_k, prefix_v, prefix_lens, sm_scale=scale,
                                 block_s=block_s, interpret=interpret, starts=pre_start,
                                 softcap=softcap, values_are_keys=values_are_keys)
  o1 = jnp.transpose(o1.reshape(b, hkv, n, g, d), (0, 2, 1, 3, 4)).reshape(b, n, h, d)
  l1 = jnp.transpose(l1.reshape(b, hkv, n, g), (0, 2, 1, 3)).reshape(b, n, h)
  # Pass 2: each sample's [Hkv, G, D] query against its own suffix.
  ss = suffix_k.shape[2]
  o2, l2 = decode_partial_pallas(
      qg.reshape(b * n, hkv, g, d), suffix_k.reshape((b * n, ss, hkv, d)),
      suffix_v.reshape((b * n, ss, hkv, d)), suffix_lens.reshape(b * n), sm_scale=scale,
      block_s=block_s, interpret=interpret, starts=suf_start, softcap=softcap,
      values_are_keys=values_are_keys)
  return merge_lse(o1, l1, o2.reshape(b, n, h, d), l2.reshape(b, n, h), out_dtype=q.dtype)


def shared_prefix_extend_pallas_tpu(q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v,
                                    index, *, sm_scale=None, block_s=512, block_m=512,
                                    interpret=False, window: int | None = None,
                                    softcap: float | None = None,
                                    values_are_keys: bool = False):
  """T tokens of each of N samples at once, as `reference.extend_two_pass`: q [B, N, T, H, D],
  their keys already written at suffix slots [index, index + T) (index [B, N]); query t sees
  the prefix and its suffix below index + t + 1 -> (o [B, N, T, H, D], lse [B, N, T, H]).
  The prefix is read once for all N*T*G query rows of a KV head; values_are_keys as in
  the decode step."""
  b, n, t, h, d = q.shape
  check_decode(q[:, :, 0], prefix_k, prefix_v, suffix_k, suffix_v)
  window = check_window(window)
  softcap = check_softcap(softcap)
  hkv = prefix_k.shape[2]
  g = h // hkv
  scale = default_scale(d) if sm_scale is None else float(sm_scale)
  index = index.astype(jnp.int32)
  ends = index[:, :, None] + jnp.arange(1, t + 1, dtype=jnp.int32)  # [B, N, T]
  pre_start = suf_start = None
  if window is not None:
    pre_start, suf_start = decode_window_starts(prefix_lens, ends.reshape(b, n * t), window)
    pre_start = jnp.repeat(pre_start, g, axis=1)  # rows of pass 1 are (n, t, g)
    suf_start = jnp.repeat(suf_start.reshape(b * n, t), g, axis=1)  # pass 2: (t, g)
  qg = q.reshape(b, n, t, hkv, g, d)
  # Pass 1: [B, Hkv, N*T*G, D] rows against the shared prefix.
  q_pre = jnp.transpose(qg, (0, 3, 1, 2, 4, 5)).reshape(b, hkv, n * t * g, d)
  o1, l1 = decode_partial_pallas(q_pre, prefix_k, prefix_v, prefix_lens, sm_scale=scale,
                                 block_s=block_s, block_m=block_m, interpret=interpret,
                                 starts=pre_start, softcap=softcap,
                                 values_are_keys=values_are_keys)
  o1 = jnp.transpose(o1.reshape(b, hkv, n, t, g, d), (0, 2, 3, 1, 4, 5))
  l1 = jnp.transpose(l1.reshape(b, hkv, n, t, g), (0, 2, 3, 1, 4))
  # Pass 2: each sample's [Hkv, T*G, D] queries against its own suffix, causally.
  ss = suffix_k.shape[2]
  q_suf = jnp.transpose(qg, (0, 1, 3, 2, 4, 5)).reshape(b * n, hkv, t * g, d)
  o2, l2 = decode_partial_pallas(
      q_suf, suffix_k.reshape((b * n, ss, hkv, d)), suffix_v.reshape((b * n, ss, hkv, d)),
      jnp.minimum(index + t, ss).reshape(b * n), sm_scale=scale, block_s=block_s,
      block_m=block_m, interpret=interpret, starts=suf_start,
      ends=jnp.repeat(ends.reshape(b * n, t), g, axis=1), softcap=softcap,
      values_are_keys=values_are_keys)
  o2 = jnp.transpose(o2.reshape(b, n, hkv, t, g, d), (0, 1, 3, 2, 4, 5))
  l2 = jnp.transpose(l2.reshape(b, n, hkv, t, g), (0, 1, 3, 2, 4))
  o, lse = merge_lse(o1.reshape(b, n, t, h, d), l1.reshape(b, n, t, h),
                     o2.reshape(b, n, t, h, d), l2.reshape(b, n, t, h), out_dtype=q.dtype)
  return o, lse
