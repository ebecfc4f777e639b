"""What the Pallas attention kernels (TPU and GPU) share: the custom VJP and the call on
regions re-padded to block multiples."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_ps.kernels import schedule as sched_lib
from rlax_ps.kernels.layout import SharedPromptLayout, repad_regions, unpad_regions
from rlax_ps.kernels.reference import default_scale


def capped_logits(s, softcap: float | None):
  """(softcap * tanh(s / softcap), the tanh) for the backward kernels; (s, None) uncapped."""
  if softcap is None:
    return s, None
  t = jnp.tanh(s / softcap)
  return t * softcap, t


def through_cap(ds, tanh):
  """The gradient ds of the capped logits taken back to the raw ones: d(c tanh(s / c)) / ds
  is 1 - tanh(s / c) ** 2 (identity without a cap)."""
  return ds if tanh is None else ds * (1.0 - tanh * tanh)


def attention_with_vjp(forward, backward):
  """Differentiable attention(q, k, v, lens, g, sm_scale, interpret) -> (o, lse) from a
  kernel's forward (-> o, lse) and backward (q, k, v, o, lse, do, dlse, lens, g, sm_scale,
  interpret -> dq, dk, dv); lens, g, sm_scale and interpret get no gradient."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
  def attention(q, k, v, lens, g, sm_scale, interpret):
    return forward(q, k, v, lens, g, sm_scale, interpret)

  def attention_fwd(q, k, v, lens, g, sm_scale, interpret):
    o, lse = forward(q, k, v, lens, g, sm_scale, interpret)
    return (o, lse), (q, k, v, o, lse, lens)

  def attention_bwd(g, sm_scale, interpret, res, cts):
    q, k, v, o, lse, lens = res
    do, dlse = cts
    dq, dk, dv = backward(q, k, v, o, lse, do, dlse, lens, g, sm_scale, interpret)
    return dq, dk, dv, np.zeros(lens.shape, jax.dtypes.float0)

  attention.defvjp(attention_fwd, attention_bwd)
  return attention


def aligned_geometry(layout: SharedPromptLayout, blocks: sched_lib.BlockSizes,
                     window: int | None = None, softcap: float | None = None):
  """The kernel geometry with prompt and response regions rounded up to block multiples
  (re-padding moves no token's position: positions count from each region's start)."""
  mult = blocks.region_multiple
  up = lambda x: -(-x // mult) * mult
  return sched_lib.Geometry(layout.num_responses, up(layout.prompt_capacity),
                            up(layout.response_capacity), blocks.block_q, blocks.block_kv,
                            window, softcap)


def call_on_aligned_regions(attention, q, k, v, layout: SharedPromptLayout,
                            blocks: sched_lib.BlockSizes, sm_scale, interpret,
                            window: int | None = None, softcap: float | None = None):
  """Runs `attention` (from attention_with_vjp, [B, H, L, D] layout) on q/k/v [B, L, H, D]
  whose regions are re-padded to block multiples; returns (o [B, L, H, D], lse [B, L, H]).
  The window and the softcap travel in the static geometry."""
  g = aligned_geometry(layout, blocks, window, softcap)
  scale = default_scale(q.shape[-1]) if sm_scale is None else float(sm_scale)
  aligned = (g.prompt_capacity, g.response_capacity) == (layout.prompt_capacity,
                                                        layout.response_capacity)
  to_kernel = lambda x: jnp.swapaxes(
      x if aligned else repad_regions(x, layout, g.prompt_capacity, g.response_capacity), 1, 2)
  lens = sched_lib.region_lens(layout.prompt_lens, layout.response_lens)
  o, lse = attention(to_kernel(q), to_kernel(k), to_kernel(v), lens, g, scale, interpret)
  o, lse = jnp.swapaxes(o, 1, 2), jnp.swapaxes(lse, 1, 2)
  if not aligned:
    o = unpad_regions(o, layout, g.prompt_capacity, g.response_capacity)
    lse = unpad_regions(lse, layout, g.prompt_capacity, g.response_capacity)
  return o, lse
