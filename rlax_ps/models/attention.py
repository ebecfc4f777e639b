"""Plain-XLA grouped-query attention with a segment/position mask (the reference path)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def check_window(window) -> int | None:
  """None (no window) or a positive int, returned as a plain (static) int."""
  if window is None:
    return None
  if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)) or (
      window < 1):
    raise ValueError(f"window: expected a positive int or None, got {window!r}")
  return int(window)


def check_softcap(softcap) -> float | None:
  """None (no cap) or a positive finite number, returned as a plain (static) float."""
  if softcap is None:
    return None
  if isinstance(softcap, (bool, np.bool_)) or not isinstance(
      softcap, (int, float, np.integer, np.floating)) or not (
      math.isfinite(softcap) and softcap > 0):
    raise ValueError(f"softcap: expected a positive number or None, got {softcap!r}")
  return float(softcap)


def cap_logits(s, softcap: float | None):
  """softcap * tanh(s / softcap), Gemma 2's logit soft-capping (None: s unchanged)."""
  return s if softcap is None else jnp.tanh(s / softcap) * softcap


def attention_mask(q_segment_ids, q_positions, k_segment_ids, k_positions, *,
                   window: int | None = None) -> jnp.ndarray:
  """[B, T, S] bool: a query sees a key of its own segment at an earlier or equal position
  (and, with a sliding window, fewer than `window` positions back, as Gemma's local layers)."""
  window = check_window(window)
  same_segment = q_segment_ids[:, :, None] == k_segment_ids[:, None, :]
  causal = k_positions[:, None, :] <= q_positions[:, :, None]
  mask = same_segment & causal
  if window is not None:
    mask = mask & (q_positions[:, :, None] - k_positions[:, None, :] < window)
  return mask


def with_sinks(out, lse, sinks):
  """Attention whose softmax also holds one sink logit per head (gpt-oss), from the plain
  output out [..., H, D] and its keys' log-sum-exp lse [..., H]: each key's weight shrinks
  by sum / (sum + e^sink), so out * sigmoid(lse - sink). A row with no key (lse -inf) is 0."""
  scale = jax.nn.sigmoid(lse.astype(jnp.float32) - sinks.astype(jnp.float32))
  return (out.astype(jnp.float32) * scale[..., None]).astype(out.dtype)


def dot_product_attention(q, k, v, q_segment_ids, q_positions, k_segment_ids, k_positions, *,
                          window: int | None = None, sm_scale: float | None = None,
                          softcap: float | None = None, sinks=None):
  """Softmax attention; q [B,T,H,D], k/v [B,S,Hkv,D] -> [B,T,H,D].

  Query heads are grouped over the kv heads (GQA); logits and softmax are float32.
  A query with no visible key (only possible for padding) gets zeros, never NaN.
  sm_scale multiplies the logits (None: head_dim ** -0.5); window: see attention_mask;
  softcap (None: none) caps the scaled logits to softcap * tanh(logits / softcap) before the
  mask, as Gemma 2 does; sinks [H] (None: none) join each softmax as one more logit that
  weighs no value (gpt-oss).
  """
  softcap = check_softcap(softcap)
  b, t, h, d = q.shape
  hkv = k.shape[2]
  if h % hkv:
    raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
  qg = q.reshape(b, t, hkv, h // hkv, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
  logits = cap_logits(logits * (d ** -0.5 if sm_scale is None else sm_scale), softcap)
  mask = attention_mask(q_segment_ids, q_positions, k_segment_ids, k_positions, window=window)
  mask = mask[:, None, None, :, :]
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  if sinks is None:
    probs = jax.nn.softmax(logits, axis=-1)
  else:
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, h // hkv, 1, 1),
                            (*logits.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
  probs = jnp.where(mask, probs, 0.0).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, d)
