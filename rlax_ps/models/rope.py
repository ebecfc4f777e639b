"""Rotary position embeddings, computed as Hugging Face does (float32, rotate-half layout,
partial rotation of the leading head dims)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from rlax_ps.models.config import ModelConfig


def _yarn(config: ModelConfig, inv_freq: np.ndarray) -> np.ndarray:
  """YaRN: frequencies that turn fewer than beta_slow times over the original context are
  interpolated (divided by `factor`), those turning more than beta_fast times kept, with a
  linear ramp over the dimensions in between."""
  s, dim, base = config.rope_scaling, config.rotary_dim, float(config.rope_theta)
  factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])

  def correction_dim(rotations):
    return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
  if s.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  high = high + 0.001 if low == high else high
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (keep), 0: interpolate
  return ((inv_freq / np.float32(factor)) * (1 - keep) + inv_freq * keep).astype(np.float32)


def attention_scaling(config: ModelConfig) -> float:
  """The factor YaRN and LongRoPE multiply cos and sin by (1 for the other kinds)."""
  s = config.rope_scaling
  if s is not None and s["rope_type"] == "longrope":
    if s.get("attention_factor") is not None:
      return float(s["attention_factor"])
    old_len = float(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or config.max_position_embeddings / old_len)
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
  if s is None or s["rope_type"] != "yarn":
    return 1.0
  if s.get("attention_factor") is not None:
    return float(s["attention_factor"])

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  factor = float(s["factor"])
  if s.get("mscale") and s.get("mscale_all_dim"):
    return mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"]))
  return mscale(factor)


def inverse_frequencies(config: ModelConfig, long: bool = False) -> np.ndarray:
  """RoPE inverse frequencies [rotary_dim // 2] in float32, with linear, Llama-3, YaRN or
  LongRoPE scaling (LongRoPE: its short factors, or with `long` its long ones)."""
  dim = config.rotary_dim
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  powers = np.float32(config.rope_theta) ** exponents
  inv_freq = (1.0 / powers).astype(np.float32)
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq
  if scaling["rope_type"] == "longrope":
    ext = np.asarray(scaling["long_factor" if long else "short_factor"], np.float32)
    return (1.0 / (ext * powers)).astype(np.float32)
  factor = float(scaling["factor"])
  if scaling["rope_type"] == "yarn":
    return _yarn(config, inv_freq)
  if scaling["rope_type"] == "linear":
    return (inv_freq / np.float32(factor)).astype(np.float32)
  # Llama 3: long wavelengths slowed by `factor`, short kept, smooth blend in between.
  low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
  old_len = float(scaling["original_max_position_embeddings"])
  low_wavelen, high_wavelen = old_len / low, old_len / high
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rotary_angles(positions: jnp.ndarray, inv_freq: np.ndarray, scale: float = 1.0
                  ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """cos, sin of shape [B, T, head_dim] for integer positions [B, T], times `scale`
  (attention_scaling)."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  if scale == 1.0:
    return jnp.cos(emb), jnp.sin(emb)
  return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def model_angles(config: ModelConfig, positions: jnp.ndarray, segment_ids: jnp.ndarray
                 ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """cos, sin [B, T, rotary_dim] of the model's (global) RoPE at positions [B, T]. LongRoPE
  takes the factors config.rope_long_factors fixes, or else its long ones when a token's
  position (padding, segment id 0, aside) reaches original_max_position_embeddings and its
  short ones otherwise, per call as transformers' forward does. (transformers' generate also
  recomputes its cache with the long set once a generation crosses that length; a cache here
  keeps the keys it has, which is why an RL run fixes the set.)"""
  scale = attention_scaling(config)
  angles = rotary_angles(positions, inverse_frequencies(config), scale)
  s = config.rope_scaling
  if s is None or s["rope_type"] != "longrope":
    return angles
  if config.rope_long_factors is False:
    return angles
  long = rotary_angles(positions, inverse_frequencies(config, long=True), scale)
  if config.rope_long_factors:
    return long
  use_long = jnp.max(jnp.where(segment_ids > 0, positions, 0)) >= s[
      "original_max_position_embeddings"]
  return tuple(jnp.where(use_long, b, a) for a, b in zip(angles, long))


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
  """Rotate x [B, T, heads, head_dim] by the angles (rotate-half convention); with angles
  for fewer dims than head_dim, only those leading dims turn."""
  if cos.shape[-1] < x.shape[-1]:
    rot = cos.shape[-1]
    return jnp.concatenate([apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  cos = cos[:, :, None, :].astype(x.dtype)
  sin = sin[:, :, None, :].astype(x.dtype)
  return x * cos + rotated * sin
