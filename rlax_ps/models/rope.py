"""Rotary position embeddings, computed as Hugging Face does (float32, rotate-half layout)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from rlax_ps.models.config import ModelConfig


def _yarn(config: ModelConfig, inv_freq: np.ndarray) -> np.ndarray:
  """YaRN: frequencies that turn fewer than beta_slow times over the original context are
  interpolated (divided by `factor`), those turning more than beta_fast times kept, with a
  linear ramp over the dimensions in between."""
  s, dim, base = config.rope_scaling, config.head_dim, float(config.rope_theta)
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
  """The factor YaRN multiplies cos and sin by (1 for the other kinds)."""
  s = config.rope_scaling
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


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
  """RoPE inverse frequencies [head_dim // 2] in float32, with linear, Llama-3 or YaRN
  scaling."""
  dim = config.head_dim
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq
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


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
  """Rotate x [B, T, heads, head_dim] by the angles (rotate-half convention)."""
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  cos = cos[:, :, None, :].astype(x.dtype)
  sin = sin[:, :, None, :].astype(x.dtype)
  return x * cos + rotated * sin
