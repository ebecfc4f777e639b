"""Pallas TPU training kernel for packed shared-prompt attention (forward + custom VJP).

The grid walks a static pair schedule (see schedule.py) instead of the dense
[L/bq, L/bk] square: masked blocks are never visited. Forward and dQ iterate,
per query block, over the prompt key blocks then the response's own blocks;
dK/dV iterate, per key block, over the query blocks that read it, with the sum
over the N responses (and over the query heads of a GQA group) on sequential
("arbitrary") grid axes, so no atomics are needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rlax_ps.kernels import schedule as sched_lib
from rlax_ps.kernels.layout import SharedPromptLayout
from rlax_ps.kernels.reference import cap_logits, check_qkv, check_softcap, check_window
from rlax_ps.kernels.pallas_common import (attention_with_vjp, call_on_aligned_regions,
                                           capped_logits, through_cap)

LANES = 128
_MASKED = -1e30
_NT = (((1,), (1,)), ((), ()))  # a @ b.T


def _block_mask(g: sched_lib.Geometry, b, q_blk, k_blk, q_reg, k_reg, lens_ref, shape):
  """Visited pairs are same-region or (prompt key, response query): causal by
  global index plus both tokens real (plus, with a window, the RoPE positions
  fewer than `window` apart)."""
  n1 = g.num_responses + 1
  q_len = lens_ref[b * n1 + q_reg]
  k_len = lens_ref[b * n1 + k_reg]
  rows = q_blk * g.block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = k_blk * g.block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  q_ok = rows - g.region_start(q_reg) < q_len
  k_ok = cols - g.region_start(k_reg) < k_len
  mask = q_ok & k_ok & (cols <= rows)
  if g.window is None:
    return mask
  # position = index - region start (+ prompt_len in a response): a per-pair scalar shift.
  plen = lens_ref[b * n1]
  shift = lambda reg: jnp.where(reg == 0, 0, plen - g.region_start(reg))
  return mask & (rows - cols + (shift(q_reg) - shift(k_reg)) < g.window)


def _fwd_kernel(q_blk_ref, k_blk_ref, q_reg_ref, k_reg_ref, first_ref, last_ref, fetch_ref,
                live_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr,
                *, g, num_pairs, sm_scale):
  b, t = pl.program_id(0), pl.program_id(2)

  @pl.when(first_ref[t] == 1)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, _MASKED, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(live_ref[b * num_pairs + t] == 1)
  def _compute():
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * sm_scale
    s = cap_logits(s, g.softcap)
    mask = _block_mask(g, b, q_blk_ref[t], k_blk_ref[t], q_reg_ref[t], k_reg_ref[t], lens_ref,
                       s.shape)
    s = jnp.where(mask, s, _MASKED)
    m_prev = m_scr[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
    m_scr[...] = m_next
    pv = jax.lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc_scr[...] = acc_scr[...] * alpha[:, :1] + pv

  @pl.when(last_ref[t] == 1)
  def _finish():
    l = l_scr[...]
    has = l > 0
    l_safe = jnp.where(has, l, 1.0)
    o_ref[...] = (acc_scr[...] / l_safe[:, :1]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, m_scr[...] + jnp.log(l_safe), -jnp.inf)


def _dq_kernel(q_blk_ref, k_blk_ref, q_reg_ref, k_reg_ref, first_ref, last_ref, fetch_ref,
               live_ref, lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dq_ref, acc_scr,
               *, g, num_pairs, sm_scale):
  b, t = pl.program_id(0), pl.program_id(2)

  @pl.when(first_ref[t] == 1)
  def _init():
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  @pl.when(live_ref[b * num_pairs + t] == 1)
  def _compute():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * sm_scale
    s, tanh = capped_logits(s, g.softcap)
    mask = _block_mask(g, b, q_blk_ref[t], k_blk_ref[t], q_reg_ref[t], k_reg_ref[t], lens_ref,
                       s.shape)
    p = jnp.where(mask, jnp.exp(s - lse_ref[...][:, :1]), 0.0)
    dp = jax.lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    ds = through_cap(p * (dp - di_ref[...][:, :1]), tanh) * sm_scale
    acc_scr[...] += jax.lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  @pl.when(last_ref[t] == 1)
  def _finish():
    dq_ref[...] = acc_scr[...].astype(dq_ref.dtype)


def _dkv_kernel(q_blk_ref, k_blk_ref, q_reg_ref, k_reg_ref, first_ref, last_ref, fetch_ref,
                live_ref, lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, dk_ref, dv_ref,
                dk_scr, dv_scr, *, g, num_pairs, group, sm_scale):
  b, t, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when((first_ref[t] == 1) & (j == 0))
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  @pl.when(live_ref[b * num_pairs + t] == 1)
  def _compute():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    s = jax.lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * sm_scale
    s, tanh = capped_logits(s, g.softcap)
    mask = _block_mask(g, b, q_blk_ref[t], k_blk_ref[t], q_reg_ref[t], k_reg_ref[t], lens_ref,
                       s.shape)
    p = jnp.where(mask, jnp.exp(s - lse_ref[...][:, :1]), 0.0)
    dv_scr[...] += jax.lax.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jax.lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    ds = through_cap(p * (dp - di_ref[...][:, :1]), tanh) * sm_scale
    dk_scr[...] += jax.lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)

  @pl.when((last_ref[t] == 1) & (j == group - 1))
  def _finish():
    dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _prefetch(sched: sched_lib.Schedule, g: sched_lib.Geometry, lens, fetch_from: str):
  """Scalar-prefetch operands: static pair tables, per-row fetch index and liveness, lens."""
  live = sched_lib.liveness(sched, g, lens)
  blocks = sched.k_block if fetch_from == "k" else sched.q_block
  fetch = sched_lib.fill_dead(blocks, live)
  as_i32 = lambda a: jnp.asarray(a, jnp.int32)
  return (as_i32(sched.q_block), as_i32(sched.k_block), as_i32(sched.q_region),
          as_i32(sched.k_region), as_i32(sched.first), as_i32(sched.last),
          fetch.reshape(-1), live.astype(jnp.int32).reshape(-1), lens.reshape(-1))


def _forward(q, k, v, lens, g, sm_scale, interpret):
  """q [B, H, L, D], k/v [B, Hkv, L, D] -> (o [B, H, L, D], lse [B, H, L] f32)."""
  bsz, h, length, d = q.shape
  group = h // k.shape[1]
  sched = sched_lib.forward_schedule(g)
  num_pairs = sched.length
  bq, bk = g.block_q, g.block_kv
  q_map = lambda b, hh, t, qb, kb, qr, kr, fi, la, fe, li, le: (b, hh, qb[t], 0)
  kv_map = lambda b, hh, t, qb, kb, qr, kr, fi, la, fe, li, le: (
      b, jax.lax.div(hh, group), fe[b * num_pairs + t], 0)
  kernel = functools.partial(_fwd_kernel, g=g, num_pairs=num_pairs, sm_scale=sm_scale)
  o, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=9,
          grid=(bsz, h, num_pairs),
          in_specs=[pl.BlockSpec((None, None, bq, d), q_map),
                    pl.BlockSpec((None, None, bk, d), kv_map),
                    pl.BlockSpec((None, None, bk, d), kv_map)],
          out_specs=[pl.BlockSpec((None, None, bq, d), q_map),
                     pl.BlockSpec((None, None, bq, LANES), q_map)],
          scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),
                          pltpu.VMEM((bq, LANES), jnp.float32),
                          pltpu.VMEM((bq, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((bsz, h, length, LANES), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="shared_prompt_fwd",
  )(*_prefetch(sched, g, lens, "k"), q, k, v)
  return o, lse[..., 0]


def _backward(q, k, v, o, lse, do, dlse, lens, g, sm_scale, interpret):
  bsz, h, length, d = q.shape
  hkv = k.shape[1]
  group = h // hkv
  bq, bk = g.block_q, g.block_kv
  di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
  if dlse is not None:
    di = di - dlse
  lanes = lambda x: jnp.broadcast_to(x[..., None], (*x.shape, LANES))
  lse_l, di_l = lanes(lse), lanes(di)

  sched = sched_lib.forward_schedule(g)
  num_pairs = sched.length
  q_map = lambda b, hh, t, qb, kb, qr, kr, fi, la, fe, li, le: (b, hh, qb[t], 0)
  kv_map = lambda b, hh, t, qb, kb, qr, kr, fi, la, fe, li, le: (
      b, jax.lax.div(hh, group), fe[b * num_pairs + t], 0)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, g=g, num_pairs=num_pairs, sm_scale=sm_scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=9,
          grid=(bsz, h, num_pairs),
          in_specs=[pl.BlockSpec((None, None, bq, d), q_map),
                    pl.BlockSpec((None, None, bk, d), kv_map),
                    pl.BlockSpec((None, None, bk, d), kv_map),
                    pl.BlockSpec((None, None, bq, d), q_map),
                    pl.BlockSpec((None, None, bq, LANES), q_map),
                    pl.BlockSpec((None, None, bq, LANES), q_map)],
          out_specs=pl.BlockSpec((None, None, bq, d), q_map),
          scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="shared_prompt_dq",
  )(*_prefetch(sched, g, lens, "k"), q, k, v, do, lse_l, di_l)

  ksched = sched_lib.dkv_schedule(g)
  kpairs = ksched.length
  qh_map = lambda b, hh, t, j, qb, kb, qr, kr, fi, la, fe, li, le: (
      b, hh * group + j, fe[b * kpairs + t], 0)
  k_map = lambda b, hh, t, j, qb, kb, qr, kr, fi, la, fe, li, le: (b, hh, kb[t], 0)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, g=g, num_pairs=kpairs, group=group, sm_scale=sm_scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=9,
          grid=(bsz, hkv, kpairs, group),
          in_specs=[pl.BlockSpec((None, None, bq, d), qh_map),
                    pl.BlockSpec((None, None, bk, d), k_map),
                    pl.BlockSpec((None, None, bk, d), k_map),
                    pl.BlockSpec((None, None, bq, d), qh_map),
                    pl.BlockSpec((None, None, bq, LANES), qh_map),
                    pl.BlockSpec((None, None, bq, LANES), qh_map)],
          out_specs=[pl.BlockSpec((None, None, bk, d), k_map),
                     pl.BlockSpec((None, None, bk, d), k_map)],
          scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32),
                          pltpu.VMEM((bk, d), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
      name="shared_prompt_dkv",
  )(*_prefetch(ksched, g, lens, "q"), q, k, v, do, lse_l, di_l)
  return dq, dk, dv


_attention_bhld = attention_with_vjp(_forward, _backward)


def shared_prompt_attention_pallas_tpu(q, k, v, layout: SharedPromptLayout, *, sm_scale=None,
                                       block_sizes: sched_lib.BlockSizes | None = None,
                                       interpret=False, window: int | None = None,
                                       softcap: float | None = None):
  """Packed shared-prompt attention on TPU: q [B, L, H, D], k/v [B, L, Hkv, D]
  -> (o [B, L, H, D], lse [B, L, H] f32). Regions are re-padded to block multiples.
  A window drops the pairs wholly outside it from the schedule (or marks them dead).
  A softcap caps every block's scaled logits; dq and dk recompute them from q and k."""
  check_qkv(q, k, v)
  layout.validate(q.shape[1], q.shape[0])
  window = check_window(window)
  softcap = check_softcap(softcap)
  blocks = block_sizes or sched_lib.BlockSizes()
  return call_on_aligned_regions(_attention_bhld, q, k, v, layout, blocks, sm_scale, interpret,
                                 window, softcap)
