"""The custom VJP shared by the Pallas attention kernels (TPU and GPU)."""

from __future__ import annotations

import functools

import jax
import numpy as np


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
