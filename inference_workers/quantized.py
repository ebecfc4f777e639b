"""The transformer with int8 weight-only kernels: int8 codes + bf16 scales, dequantized per matmul.

Layout as published by the codec (`rlax_ps.sync.int8`): a kernel [in, out] has one scale per
output channel, an embedding table [V, H] one per row, stacked experts [E, in, out] one per
expert and output channel; 1-D tensors and expert routers stay bf16. The codes are
held as int8 and widened one layer at a time inside the jitted forward, so the model's
resident weights take half the bytes of bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlax_ps.models.config import ModelConfig
from rlax_ps.models.transformer import Experts, LatentAttention, Transformer, lora_delta

SCALE_ATTR = "_scale"  # model attribute suffix: `kernel_scale` holds the codec's "kernel.scale"


class Int8Linear(nnx.Module):
  """y = (x @ codes) * scale[out] (+ bias): the codec's per-output-channel int8 kernel; with
  `lora_rank`, plus the trainer's bf16 LoRA adapter (x @ A) @ B * lora_scale."""

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
               lora_rank: int = 0, lora_scale: float = 0.0):
    self.kernel = nnx.Param(jnp.zeros((in_features, out_features), jnp.int8))
    self.kernel_scale = nnx.Param(jnp.zeros((out_features,), jnp.bfloat16))
    self.bias = nnx.Param(jnp.zeros((out_features,), jnp.bfloat16)) if use_bias else None
    self.dtype = jnp.dtype(dtype)
    self.lora_scale = lora_scale
    if lora_rank:
      self.lora_a = nnx.Param(jnp.zeros((in_features, lora_rank), jnp.bfloat16))
      self.lora_b = nnx.Param(jnp.zeros((lora_rank, out_features), jnp.bfloat16))

  def __call__(self, x, out_dtype=None):
    out_dtype = out_dtype or self.dtype
    y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                preferred_element_type=out_dtype)
    y = y * self.kernel_scale[...].astype(out_dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(out_dtype)
    if self.lora_scale:
      y = y + lora_delta(x, self.lora_a, self.lora_b, self.lora_scale,
                         self.dtype).astype(out_dtype)
    return y

  def weight(self, dtype):
    """The [in, out] matrix this layer multiplies by: codes times their scales (plus the
    adapter's A @ B * lora_scale), for a latent cache's absorbed heads."""
    w = self.kernel[...].astype(dtype) * self.kernel_scale[...].astype(dtype)
    if self.lora_scale:
      a, b = (p[...].astype(dtype) for p in (self.lora_a, self.lora_b))
      w = w + (a @ b * self.lora_scale).astype(dtype)
    return w


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


class Int8Experts(Experts):
  """Stacked int8 experts: codes gate/up [E, H, I], down [E, I, H] and bf16 scales [E, out]
  (biases bf16). A row's output is scaled by its own expert's scales after the matmul, as in
  Int8Linear."""

  def __init__(self, config: ModelConfig):
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    self._gate_settings(config)
    for name, (n_in, n_out) in (("gate_proj", (h, i)), ("up_proj", (h, i)),
                                ("down_proj", (i, h))):
      setattr(self, name, nnx.Param(jnp.zeros((e, n_in, n_out), jnp.int8)))
      setattr(self, name + SCALE_ATTR, nnx.Param(jnp.zeros((e, n_out), jnp.bfloat16)))
    if config.moe_bias:
      for name, shape, _ in self.bias_shapes(config):
        setattr(self, name, nnx.Param(jnp.zeros(shape, jnp.bfloat16)))
    for name, shape, _ in self.adapter_shapes(config):  # the trainer's adapters, bf16
      setattr(self, name, nnx.Param(jnp.zeros(shape, jnp.bfloat16)))

  def _scale(self, name):
    return getattr(self, name + SCALE_ATTR)[...].astype(self.dtype)

  def _grouped_matmul(self, x, proj, group_sizes, experts):
    y = jax.lax.ragged_dot(x, getattr(self, proj)[...].astype(self.dtype), group_sizes)
    return y * self._scale(proj)[experts]

  def _every_matmul(self, spec, x, proj):
    return (jnp.einsum(spec, x, getattr(self, proj)[...].astype(self.dtype))
            * self._scale(proj)[:, None, :])


class Int8Transformer(Transformer):
  """`Transformer` whose projections, experts and embedding hold int8 codes (norms, biases
  and routers bf16).

  Build it under `nnx.eval_shape` (as `HeldPolicy` does): the float modules the parent
  constructor makes are replaced before anything is allocated.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    config = config.replace(param_dtype="bfloat16", lora_dtype="bfloat16")
    super().__init__(config, rngs=rngs)
    c, dtype = config, jnp.dtype(config.dtype)

    def linear(fan_in, fan_out, bias=False, name=""):
      lora = c.lora_rank if name in c.lora_targets else 0
      return Int8Linear(fan_in, fan_out, use_bias=bias, dtype=dtype, lora_rank=lora,
                        lora_scale=c.lora_alpha / lora if lora else 0.0)

    self.embed = Int8Embed(c.vocab_size, c.hidden_size, dtype=dtype)
    for i, block in enumerate(self.layers):
      a, m = block.attn, block.mlp
      if c.kv_lora_rank:  # latent attention: its projections as built, none biased
        for name in LatentAttention.PROJECTIONS:
          if hasattr(a, name):
            setattr(a, name, linear(*getattr(a, name).kernel.shape, name=name))
      else:
        a.q_proj = linear(c.hidden_size, c.num_heads * c.head_dim, c.qkv_bias, "q_proj")
        a.k_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, "k_proj")
        a.v_proj = linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, "v_proj")
        a.o_proj = linear(c.num_heads * c.head_dim, c.hidden_size, c.attention_out_bias,
                          "o_proj")
      if c.moe_layer(i):
        m.experts = Int8Experts(c)
        if not c.shared_expert_intermediate_size:
          continue
        if c.shared_expert_gated:  # Qwen2-MoE's; GLM-4.5's shared experts are ungated
          m.shared_expert_gate = linear(c.hidden_size, 1)
        m = m.shared_expert
      width = m.gate_proj.kernel.shape[1]
      m.gate_proj = linear(c.hidden_size, width, name="gate_proj")
      m.up_proj = linear(c.hidden_size, width, name="up_proj")
      m.down_proj = linear(width, c.hidden_size, name="down_proj")
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
