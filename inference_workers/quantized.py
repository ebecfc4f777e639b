"""The transformer with int8 weight-only kernels: int8 codes + bf16 scales, dequantized per matmul.

Layout as published by the codec (`rlax_ps.sync.int8`): a kernel [in, out] has one scale per
output channel, an embedding table [V, H] one per row, 1-D tensors stay bf16. The codes are
held as int8 and widened one layer at a time inside the jitted forward, so the model's
resident weights take half the bytes of bf16.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from rlax_ps.models.config import ModelConfig
from rlax_ps.models.transformer import Transformer

SCALE_ATTR = "_scale"  # model attribute suffix: `kernel_scale` holds the codec's "kernel.scale"


class Int8Linear(nnx.Module):
  """y = (x @ codes) * scale[out] (+ bias): the codec's per-output-channel int8 kernel."""

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype):
    self.kernel = nnx.Param(jnp.zeros((in_features, out_features), jnp.int8))
    self.kernel_scale = nnx.Param(jnp.zeros((out_features,), jnp.bfloat16))
    self.bias = nnx.Param(jnp.zeros((out_features,), jnp.bfloat16)) if use_bias else None
    self.dtype = jnp.dtype(dtype)

  def __call__(self, x, out_dtype=None):
    out_dtype = out_dtype or self.dtype
    y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                preferred_element_type=out_dtype)
    y = y * self.kernel_scale[...].astype(out_dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(out_dtype)
    return y


class Int8Embed(nnx.Module):
  """Embedding rows = codes[token] * scale[token]; `attend` is the tied output projection."""

  def __init__(self, num_embeddings: int, features: int, *, dtype):
    self.embedding = nnx.Param(jnp.zeros((num_embeddings, features), jnp.int8))
    self.embedding_scale = nnx.Param(jnp.zeros((num_embeddings,), jnp.bfloat16))
    self.dtype = jnp.dtype(dtype)

  def __call__(self, tokens):
    rows = self.embedding[...][tokens].astype(self.dtype)
    return rows * self.embedding_scale[...][tokens][..., None].astype(self.dtype)

  def attend(self, x):
    """float32 logits x @ (codes * scale).T, scaled after the matmul."""
    logits = jnp.einsum("bth,vh->btv", x.astype(self.dtype), self.embedding[...].astype(self.dtype),
                        preferred_element_type=jnp.float32)
    return logits * self.embedding_scale[...].astype(jnp.float32)


class Int8Transformer(Transformer):
  """`Transformer` whose projections and embedding hold int8 codes (norms and biases bf16).

  Build it under `nnx.eval_shape` (as `HeldPolicy` does): the float modules the parent
  constructor makes are replaced before anything is allocated.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    if config.num_experts:
      raise ValueError("weights_format: int8 has no per-expert scales for a mixture-of-experts "
                       "model; hold it as 'bf16'")
    config = config.replace(param_dtype="bfloat16")
    super().__init__(config, rngs=rngs)
    c, dtype = config, jnp.dtype(config.dtype)

    def linear(fan_in, fan_out, bias=False):
      return Int8Linear(fan_in, fan_out, use_bias=bias, dtype=dtype)

    self.embed = Int8Embed(c.vocab_size, c.hidden_size, dtype=dtype)
    for block in self.layers:
      a, m = block.attn, block.mlp
      a.q_proj = linear(c.hidden_size, c.num_heads * c.head_dim, c.qkv_bias)
      a.k_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias)
      a.v_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias)
      a.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size)
      m.gate_proj = linear(c.hidden_size, c.intermediate_size)
      m.up_proj = linear(c.hidden_size, c.intermediate_size)
      m.down_proj = linear(c.intermediate_size, c.hidden_size)
    if not c.tie_word_embeddings:
      self.lm_head = linear(c.hidden_size, c.vocab_size)

  def project_logits(self, x):
    if self.config.tie_word_embeddings:
      return self.embed.attend(x)
    return self.lm_head(x, out_dtype=jnp.float32)


def held_name(model_name: str) -> str:
  """Model param name -> codec held-state name ("x.kernel_scale" -> "x.kernel.scale")."""
  if model_name.endswith(SCALE_ATTR):
    return model_name[:-len(SCALE_ATTR)] + ".scale"
  return model_name
