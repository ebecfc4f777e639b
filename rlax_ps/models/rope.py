"""Rotary position embeddings, computed as Hugging Face does (float32, rotate-half layout)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from rlax_ps.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
  """RoPE inverse frequencies [head_dim // 2] in float32, with linear or Llama-3 scaling."""
  dim = config.head_dim
  exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
  inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq
  factor = float(scaling["factor"])
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


def rotary_angles(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """cos, sin of shape [B, T, head_dim] for integer positions [B, T]."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
  """Rotate x [B, T, heads, head_dim] by the angles (rotate-half convention)."""
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  cos = cos[:, :, None, :].astype(x.dtype)
  sin = sin[:, :, None, :].astype(x.dtype)
  return x * cos + rotated * sin
