"""Pallas GPU (Triton) training kernel for packed shared-prompt attention.

Same schedule as the TPU kernel, written as loops inside one program instead of
grid steps: a query block loops over the prompt key blocks and then its own
response's blocks; a key block of the prompt loops over the prompt's queries and
then, response by response, over all N responses' queries (the sum over N is a
sequential loop, no atomics). Loop bounds come from the real lengths (and the
sliding window, if any), so padded and masked blocks are never loaded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rlax_ps.kernels import schedule as sched_lib
from rlax_ps.kernels.layout import SharedPromptLayout
from rlax_ps.kernels.reference import cap_logits, check_qkv, check_softcap, check_window
from rlax_ps.kernels.pallas_common import (attention_with_vjp, call_on_aligned_regions,
                                           capped_logits, through_cap)

_MASKED = -1e30


def _cdiv(a, b):
  return lax.div(a + b - 1, b)


def _dot(a, b, trans_a=False, trans_b=False):
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _query_region(g: sched_lib.Geometry, qb, lens_ref):
  """(region start, region length, local start) of global query block qb."""
  nqp, nqr = g.prompt_capacity // g.block_q, g.response_capacity // g.block_q
  is_prompt = qb < nqp
  n = jnp.where(is_prompt, 0, lax.div(qb - nqp, nqr))
  start = jnp.where(is_prompt, 0, g.prompt_capacity + n * g.response_capacity)
  length = lens_ref[jnp.where(is_prompt, 0, n + 1)]
  return is_prompt, start, length, qb * g.block_q - start


def _shift(region_start, plen):
  """RoPE position minus packed index for the region starting at region_start: the prompt
  starts at 0 and at position 0, every response at position plen."""
  return jnp.where(region_start == 0, 0, plen - region_start)


def _window_mask(g, rows, cols, q_region, k_region, plen):
  """[bq, bk] bool: positions fewer than g.window apart (rows/cols are packed indices)."""
  shift = _shift(q_region, plen) - _shift(k_region, plen)
  return rows[:, None] - cols[None, :] + shift < g.window


def _kv_loops(g, qb, lens_ref, body, carry):
  """Runs body(k_start, k_region_start, k_len, carry) over the key blocks query block qb sees
  (with a window, from the first block that holds a key within it)."""
  bq, bk = g.block_q, g.block_kv
  is_prompt, start, q_len, q_local = _query_region(g, qb, lens_ref)
  q_live = q_local < q_len
  plen = lens_ref[0]
  causal_end = _cdiv(q_local + bq, bk)
  n_prompt = jnp.where(is_prompt, jnp.minimum(causal_end, _cdiv(plen, bk)), _cdiv(plen, bk))
  n_prompt = jnp.where(q_live, n_prompt, 0)
  lo_prompt = lo_own = 0
  if g.window is not None:
    q_pos = q_local + jnp.where(is_prompt, 0, plen)
    lo_prompt = lax.div(jnp.maximum(q_pos - g.window + 1, 0), bk)
    lo_own = lax.div(jnp.maximum(q_local - g.window + 1, 0), bk)
  carry = lax.fori_loop(lo_prompt, n_prompt, lambda j, c: body(j * bk, 0, plen, c), carry)
  n_own = jnp.where(is_prompt | ~q_live, 0, jnp.minimum(causal_end, _cdiv(q_len, bk)))
  return lax.fori_loop(lo_own, n_own, lambda j, c: body(start + j * bk, start, q_len, c), carry)


def _fwd_kernel(lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, g, sm_scale):
  bq, bk = g.block_q, g.block_kv
  qb = pl.program_id(0)
  _, q_start, q_len, _ = _query_region(g, qb, lens_ref)
  rows = qb * bq + jnp.arange(bq)
  q_ok = rows - q_start < q_len
  q = q_ref[pl.ds(qb * bq, bq), :]

  def body(k_start, k_region, k_len, carry):
    acc, m, l = carry
    k = k_ref[pl.ds(k_start, bk), :]
    v = v_ref[pl.ds(k_start, bk), :]
    cols = k_start + jnp.arange(bk)
    mask = q_ok[:, None] & (cols - k_region < k_len)[None, :] & (cols[None, :] <= rows[:, None])
    if g.window is not None:
      mask = mask & _window_mask(g, rows, cols, q_start, k_region, lens_ref[0])
    s = jnp.where(mask, cap_logits(_dot(q, k, trans_b=True) * sm_scale, g.softcap), _MASKED)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
    alpha = jnp.exp(m - m_next)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_next, l * alpha + jnp.sum(p, axis=1)

  d = q_ref.shape[-1]
  init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _MASKED, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  acc, m, l = _kv_loops(g, qb, lens_ref, body, init)
  has = l > 0
  l_safe = jnp.where(has, l, 1.0)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has, m + jnp.log(l_safe), -jnp.inf)


def _dq_kernel(lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref, *, g, sm_scale):
  bq, bk = g.block_q, g.block_kv
  qb = pl.program_id(0)
  _, q_start, q_len, _ = _query_region(g, qb, lens_ref)
  rows = qb * bq + jnp.arange(bq)
  q_ok = rows - q_start < q_len
  q = q_ref[pl.ds(qb * bq, bq), :]
  do = do_ref[pl.ds(qb * bq, bq), :]
  lse = lse_ref[pl.ds(qb * bq, bq)]
  di = di_ref[pl.ds(qb * bq, bq)]

  def body(k_start, k_region, k_len, dq):
    k = k_ref[pl.ds(k_start, bk), :]
    v = v_ref[pl.ds(k_start, bk), :]
    cols = k_start + jnp.arange(bk)
    mask = q_ok[:, None] & (cols - k_region < k_len)[None, :] & (cols[None, :] <= rows[:, None])
    if g.window is not None:
      mask = mask & _window_mask(g, rows, cols, q_start, k_region, lens_ref[0])
    s, tanh = capped_logits(_dot(q, k, trans_b=True) * sm_scale, g.softcap)
    p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
    ds = through_cap(p * (_dot(do, v, trans_b=True) - di[:, None]), tanh) * sm_scale
    return dq + _dot(ds.astype(k.dtype), k)

  dq = _kv_loops(g, qb, lens_ref, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref, *, g,
                group, sm_scale):
  bq, bk = g.block_q, g.block_kv
  kb = pl.program_id(0)
  nkp, nkr = g.prompt_capacity // bk, g.response_capacity // bk
  is_prompt = kb < nkp
  m_resp = jnp.where(is_prompt, 0, lax.div(kb - nkp, nkr))
  k_region = jnp.where(is_prompt, 0, g.prompt_capacity + m_resp * g.response_capacity)
  k_len = lens_ref[jnp.where(is_prompt, 0, m_resp + 1)]
  k_local = kb * bk - k_region
  k_live = k_local < k_len
  cols = kb * bk + jnp.arange(bk)
  k_ok = cols - k_region < k_len
  k = k_ref[pl.ds(kb * bk, bk), :]
  v = v_ref[pl.ds(kb * bk, bk), :]
  plen = lens_ref[0]

  def step(h, q_start, q_region, q_len, carry):
    dk, dv = carry
    q = q_ref[h, pl.ds(q_start, bq), :]
    do = do_ref[h, pl.ds(q_start, bq), :]
    lse = lse_ref[h, pl.ds(q_start, bq)]
    di = di_ref[h, pl.ds(q_start, bq)]
    rows = q_start + jnp.arange(bq)
    mask = (rows - q_region < q_len)[:, None] & k_ok[None, :] & (cols[None, :] <= rows[:, None])
    if g.window is not None:
      mask = mask & _window_mask(g, rows, cols, q_region, k_region, plen)
    s, tanh = capped_logits(_dot(q, k, trans_b=True) * sm_scale, g.softcap)
    p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
    dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
    ds = through_cap(p * (_dot(do, v, trans_b=True) - di[:, None]), tanh) * sm_scale
    return dk + _dot(ds.astype(q.dtype), q, trans_a=True), dv

  d = k_ref.shape[-1]
  carry = (jnp.zeros((bk, d), jnp.float32), jnp.zeros((bk, d), jnp.float32))
  # Prompt keys: the prompt's own (causal) queries ...
  p_lo = lax.div(k_local, bq)
  p_hi = jnp.where(is_prompt & k_live, _cdiv(plen, bq), p_lo)
  # ... then every response's queries (prompt keys), or the own response's (response keys).
  n_lo = m_resp
  n_hi = jnp.where(k_live, jnp.where(is_prompt, g.num_responses, m_resp + 1), n_lo)
  t_lo = jnp.where(is_prompt, 0, lax.div(k_local, bq))
  t_cap = None
  if g.window is not None:
    # Queries past the block's last key position + window - 1 see none of its keys.
    reach = k_local + bk + g.window - 1
    p_hi = jnp.minimum(p_hi, _cdiv(reach, bq))
    t_cap = _cdiv(reach - jnp.where(is_prompt, plen, 0), bq)
  for h in range(group):
    carry = lax.fori_loop(p_lo, p_hi, lambda i, c, h=h: step(h, i * bq, 0, plen, c), carry)

    def response(n, c, h=h):
      r_start = g.prompt_capacity + n * g.response_capacity
      r_len = lens_ref[n + 1]
      t_hi = _cdiv(r_len, bq) if t_cap is None else jnp.minimum(_cdiv(r_len, bq), t_cap)
      return lax.fori_loop(t_lo, t_hi,
                           lambda t, cc: step(h, r_start + t * bq, r_start, r_len, cc), c)

    carry = lax.fori_loop(n_lo, n_hi, response, carry)
  dk, dv = carry
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _pad_lens(lens):
  """[B, 1+N] -> [B, 2^k]: Triton blocks need power-of-two extents."""
  width = pl.next_power_of_2(lens.shape[1])
  return jnp.pad(lens, [(0, 0), (0, width - lens.shape[1])])


def _params(d, num_warps=None):
  return plgpu.CompilerParams(num_warps=num_warps or (4 if d <= 64 else 8), num_stages=2)


def _forward(q, k, v, lens, g, sm_scale, interpret):
  """q [B, H, L, D], k/v [B, Hkv, L, D] -> (o [B, H, L, D], lse [B, H, L] f32)."""
  b, h, length, d = q.shape
  group = h // k.shape[1]
  lens = _pad_lens(lens)
  full = lambda: pl.BlockSpec((None, None, length, d), lambda i, bb, hh: (bb, hh, 0, 0))
  kv = pl.BlockSpec((None, None, length, d), lambda i, bb, hh: (bb, lax.div(hh, group), 0, 0))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, g=g, sm_scale=sm_scale),
      grid=(length // g.block_q, b, h),
      in_specs=[pl.BlockSpec((None, lens.shape[1]), lambda i, bb, hh: (bb, 0)), full(), kv, kv],
      out_specs=[pl.BlockSpec((None, None, g.block_q, d), lambda i, bb, hh: (bb, hh, i, 0)),
                 pl.BlockSpec((None, None, g.block_q), lambda i, bb, hh: (bb, hh, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, length), jnp.float32)],
      compiler_params=_params(d),
      interpret=interpret,
      name="shared_prompt_fwd_gpu",
  )(lens, q, k, v)


def _backward(q, k, v, o, lse, do, dlse, lens, g, sm_scale, interpret):
  b, h, length, d = q.shape
  hkv = k.shape[1]
  group = h // hkv
  lens = _pad_lens(lens)
  di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1) - dlse
  lens_spec = pl.BlockSpec((None, lens.shape[1]), lambda i, bb, hh: (bb, 0))
  full = lambda: pl.BlockSpec((None, None, length, d), lambda i, bb, hh: (bb, hh, 0, 0))
  kv = pl.BlockSpec((None, None, length, d), lambda i, bb, hh: (bb, lax.div(hh, group), 0, 0))
  row = pl.BlockSpec((None, None, length), lambda i, bb, hh: (bb, hh, 0))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, g=g, sm_scale=sm_scale),
      grid=(length // g.block_q, b, h),
      in_specs=[lens_spec, full(), kv, kv, full(), row, row],
      out_specs=pl.BlockSpec((None, None, g.block_q, d), lambda i, bb, hh: (bb, hh, i, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(d),
      interpret=interpret,
      name="shared_prompt_dq_gpu",
  )(lens, q, k, v, do, lse, di)
  grouped = pl.BlockSpec((None, group, length, d), lambda i, bb, hh: (bb, hh, 0, 0))
  grouped_row = pl.BlockSpec((None, group, length), lambda i, bb, hh: (bb, hh, 0))
  own = pl.BlockSpec((None, None, length, d), lambda i, bb, hh: (bb, hh, 0, 0))
  out_kv = pl.BlockSpec((None, None, g.block_kv, d), lambda i, bb, hh: (bb, hh, i, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, g=g, group=group, sm_scale=sm_scale),
      grid=(length // g.block_kv, b, hkv),
      in_specs=[lens_spec, grouped, own, own, grouped, grouped_row, grouped_row],
      out_specs=[out_kv, out_kv],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(d),
      interpret=interpret,
      name="shared_prompt_dkv_gpu",
  )(lens, q, k, v, do, lse, di)
  return dq, dk, dv


_attention_bhld = attention_with_vjp(_forward, _backward)


def shared_prompt_attention_pallas_gpu(q, k, v, layout: SharedPromptLayout, *, sm_scale=None,
                                       block_sizes: sched_lib.BlockSizes | None = None,
                                       interpret=False, window: int | None = None,
                                       softcap: float | None = None):
  """Packed shared-prompt attention on GPU (Pallas Triton): q [B, L, H, D],
  k/v [B, L, Hkv, D] -> (o [B, L, H, D], lse [B, L, H] f32). Block sizes must be powers of
  two; regions are re-padded to block multiples, and heads with zeros to a power-of-two
  width (Triton's tiles; e.g. Phi-3-mini's 96, DeepSeek's 192), which changes no logit.
  A window shortens the key (and, backward, query) loops to the blocks it reaches; a softcap
  caps the scaled logits (recomputed from q and k in dq and dk/dv)."""
  check_qkv(q, k, v)
  layout.validate(q.shape[1], q.shape[0])
  window = check_window(window)
  softcap = check_softcap(softcap)
  # 64-wide tiles for 16-bit inputs; f32 tiles take twice the shared memory.
  default = 64 if jnp.dtype(q.dtype).itemsize <= 2 else 32
  blocks = block_sizes or sched_lib.BlockSizes(default, default)
  for name, val in (("block_q", blocks.block_q), ("block_kv", blocks.block_kv)):
    if val & (val - 1):
      raise ValueError(f"{name} must be a power of two for the GPU kernel, got {val}")
  d = q.shape[-1]
  if sm_scale is None:
    sm_scale = d ** -0.5
  wide = 1 << (d - 1).bit_length()
  if wide != d:
    q, k, v = (jnp.pad(x, [(0, 0)] * 3 + [(0, wide - d)]) for x in (q, k, v))
  o, lse = call_on_aligned_regions(_attention_bhld, q, k, v, layout, blocks, sm_scale,
                                   interpret, window, softcap)
  return o[..., :d], lse
