"""Decoder-only transformer in Flax NNX covering the Llama 2/3, Mistral, Qwen2/2.5, Qwen3,
Gemma 2/3, OLMo 2/3, Phi-3/4, SmolLM3, Granite 3, GLM-4/4.5 and DeepSeek-V2/V3 families.

RMSNorm, RoPE (plain, linear, Llama-3, YaRN or LongRoPE scaled, whole or partial heads),
grouped-query attention, SwiGLU or GeGLU MLP, optional q/k/v biases (Qwen2), q/k norms per
head (Qwen3, Gemma 3) or across heads (OLMo 2/3), sliding-window layers with their own RoPE
base, Gemma's zero-centred and sandwich norms, scaled embeddings and soft-capped logits,
OLMo's post-norms, layers without RoPE (SmolLM3), Granite's multipliers, mixture-of-experts
MLPs (Qwen3-MoE, Mixtral, Qwen2-MoE's gated shared expert, gpt-oss, GLM-4.5's biased sigmoid
routing over expert groups, DeepSeek-V2's softmax one), DeepSeek's multi-head latent
attention, tied or untied embeddings. Several sequences may share
a row (segment ids + positions); an optional KVCache serves decoding.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from rlax_ps import sharding as shd
from rlax_ps.models import rope
from rlax_ps.models.attention import dot_product_attention
from rlax_ps.models.config import ModelConfig

INIT_STD = 0.02  # HF's initializer_range default for both families.


def _partitioned(init, sharding):
  """Annotate a param with mesh axis names; sharding is applied by whoever places it on a mesh
  (the trainer's jitted init), so a model can also be built with no mesh at all."""
  return nnx.with_partitioning(init, sharding, eager_sharding=False)


def _normal(sharding):
  return _partitioned(nnx.initializers.normal(INIT_STD), sharding)


def adapter_a_init(key, shape, dtype):
  """A LoRA A ([..., in, rank]): uniform in +-1/sqrt(in), as PEFT's (its B starts at 0)."""
  bound = shape[-2] ** -0.5
  return jax.random.uniform(key, shape, jnp.dtype(dtype), -bound, bound)


def lora_delta(x, lora_a, lora_b, scale: float, dtype):
  """(x @ A) @ B * scale in `dtype`: what an adapter adds to its projection's output."""
  a, b = (p[...].astype(dtype) for p in (lora_a, lora_b))
  return (x.astype(dtype) @ a) @ b * scale


class LoRALinear(nnx.Linear):
  """nnx.Linear plus a low-rank adapter: y = x @ W (+ b) + (x @ A) @ B * alpha / rank, with A
  [in, rank] drawn uniform in +-1/sqrt(in) and B [rank, out] zero, so the adapter starts as
  a no-op (PEFT's LoRA). The kernel and bias keep nnx.Linear's names, so checkpoints read
  the same; a LoRA run trains A and B only."""

  def __init__(self, fan_in: int, fan_out: int, *, rank: int, alpha: float, sharding,
               rngs: nnx.Rngs, lora_dtype="float32", **kwargs):
    super().__init__(fan_in, fan_out, rngs=rngs, **kwargs)
    self.lora_scale = alpha / rank
    self.lora_a = nnx.Param(adapter_a_init(rngs.params(), (fan_in, rank), lora_dtype),
                            out_sharding=(sharding[0], None), eager_sharding=False)
    self.lora_b = nnx.Param(jnp.zeros((rank, fan_out), jnp.dtype(lora_dtype)),
                            out_sharding=(None, sharding[1]), eager_sharding=False)

  def __call__(self, x):
    y = super().__call__(x)
    return y + lora_delta(x, self.lora_a, self.lora_b, self.lora_scale,
                          self.dtype).astype(y.dtype)

  def weight(self, dtype):
    """The [in, out] matrix this layer multiplies by: the kernel plus A @ B * alpha / rank."""
    a, b = (p[...].astype(dtype) for p in (self.lora_a, self.lora_b))
    return self.kernel[...].astype(dtype) + (a @ b * self.lora_scale).astype(dtype)


def dense_weight(layer, dtype):
  """The [in, out] matrix a projection multiplies by, in `dtype` (its adapter merged, an
  int8 one's codes times their scales): what a latent cache's absorbed heads need."""
  if hasattr(layer, "weight"):
    return layer.weight(dtype)
  return layer.kernel[...].astype(dtype)


def _dense(config: ModelConfig, fan_in: int, fan_out: int, sharding, bias: bool, rngs,
           name: str = ""):
  """The Linear of projection `name`: a LoRALinear when the config adapts it."""
  kwargs = dict(use_bias=bias, dtype=jnp.dtype(config.dtype),
                param_dtype=jnp.dtype(config.param_dtype), kernel_init=_normal(sharding),
                bias_init=_partitioned(nnx.initializers.zeros_init(), (sharding[1],)),
                rngs=rngs)
  if config.lora_rank and name in config.lora_targets:
    return LoRALinear(fan_in, fan_out, rank=config.lora_rank, alpha=config.lora_alpha,
                      sharding=sharding, lora_dtype=config.lora_dtype, **kwargs)
  return nnx.Linear(fan_in, fan_out, **kwargs)


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last axis (`size`, default hidden_size), normalised in
  float32 as Hugging Face does; zero-centred (Gemma): scaled by 1 + w in float32."""

  def __init__(self, config: ModelConfig, size: int | None = None, *, rngs: nnx.Rngs,
               eps: float | None = None):
    del rngs
    self.eps = config.rms_norm_eps if eps is None else eps
    self.dtype = jnp.dtype(config.dtype)
    self.zero_centered = config.zero_centered_norms
    init = jnp.zeros if self.zero_centered else jnp.ones
    self.scale = nnx.Param(init((size or config.hidden_size,), jnp.dtype(config.param_dtype)),
                           out_sharding=(None,), eager_sharding=False)

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.zero_centered:
      return (xf * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype).astype(self.dtype)
    return (self.scale[...] * xf.astype(x.dtype)).astype(self.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with rotary positions and an optional cache slot."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
    self.q_proj = _dense(c, c.hidden_size, c.num_heads * c.head_dim, ("fsdp", "tensor"),
                         c.qkv_bias, rngs, "q_proj")
    self.k_proj = _dense(c, c.hidden_size, c.num_kv_heads * c.head_dim, ("fsdp", "tensor"),
                         c.qkv_bias, rngs, "k_proj")
    self.v_proj = _dense(c, c.hidden_size, c.num_kv_heads * c.head_dim, ("fsdp", "tensor"),
                         c.qkv_bias, rngs, "v_proj")
    self.o_proj = _dense(c, c.num_heads * c.head_dim, c.hidden_size, ("tensor", "fsdp"),
                         c.attention_out_bias, rngs, "o_proj")
    self.has_sinks = c.attention_sinks
    if c.attention_sinks:  # gpt-oss: one logit per head in every softmax's denominator
      self.sinks = nnx.Param(jnp.zeros((c.num_heads,), jnp.dtype(c.param_dtype)),
                             out_sharding=(None,), eager_sharding=False)
    self.use_qk_norm, self.across_heads = c.qk_norm, c.qk_norm_across_heads
    if c.qk_norm:  # Qwen3: each head's q and k RMS-normed before RoPE; OLMo: all heads at once.
      wide = c.qk_norm_across_heads
      self.q_norm = RMSNorm(c, c.num_heads * c.head_dim if wide else c.head_dim, rngs=rngs)
      self.k_norm = RMSNorm(c, c.num_kv_heads * c.head_dim if wide else c.head_dim, rngs=rngs)

  def __call__(self, x, cos, sin, attend: Callable, cached: bool = False):
    """`attend(q, k, v[, sinks=]) -> out` is given by the caller: plain, cached or packed
    attention; cos/sin None: no rotary embedding (a NoPE layer). `cached` (attend writes a
    decoding cache) changes nothing here: the cache holds these keys and values."""
    del cached
    b, t, _ = x.shape
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if self.use_qk_norm and self.across_heads:
      q, k = self.q_norm(q), self.k_norm(k)
    q = q.reshape(b, t, self.num_heads, self.head_dim)
    k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
    v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
    if self.use_qk_norm and not self.across_heads:
      q, k = self.q_norm(q), self.k_norm(k)
    if cos is not None:
      q, k = rope.apply_rotary(q, cos, sin), rope.apply_rotary(k, cos, sin)
    if self.has_sinks:
      out = attend(q, k, v, sinks=self.sinks[...].astype(jnp.float32))
    else:
      out = attend(q, k, v)
    return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


# transformers' DeepSeek latent norms (q_a_layernorm, kv_a_layernorm) take RMSNorm's default
# eps, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nnx.Module):
  """DeepSeek's multi-head latent attention (ModelConfig.kv_lora_rank > 0).

  Each head's query is [rotary part, plain part] (the HF loader moves the rotary dims first,
  in rotate-half order), so our RoPE turns its leading qk_rope_head_dim dims; the key is the
  shared rotary key beside the head's decompressed plain key. Values are zero-padded to the
  q/k width and the output sliced back, so that every attention path (XLA, the Pallas
  kernels) sees one head_dim for q, k and v and computes the same softmax.

  Cached (decoding), the heads are absorbed into the latent instead, as DeepSeek's own
  inference does: the cache holds one kv head per token, [normed latent, rotary key]
  (ModelConfig.kv_cache_layout), which is the key of every query head and, in its first
  kv_lora_rank dims, the value; each head's query is [q_nope @ W_uk, rotary part] and its
  output's latent goes through W_uv. The same softmax (the model's scale), a fraction of
  the cache. The uncached form stays decompressed: over whole sequences (training's packed
  rows) it computes less."""

  PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.num_heads, self.head_dim, self.v_head_dim = c.num_heads, c.head_dim, c.v_head_dim
    self.rank, self.nope = c.kv_lora_rank, c.head_dim - c.qk_rope_head_dim
    q_width = c.num_heads * c.head_dim
    self.q_bottleneck = bool(c.q_lora_rank)
    if c.q_lora_rank:
      self.q_a_proj = _dense(c, c.hidden_size, c.q_lora_rank, ("fsdp", None), False, rngs,
                             "q_a_proj")
      self.q_a_norm = RMSNorm(c, c.q_lora_rank, rngs=rngs, eps=LATENT_NORM_EPS)
      self.q_b_proj = _dense(c, c.q_lora_rank, q_width, ("fsdp", "tensor"), False, rngs,
                             "q_b_proj")
    else:
      self.q_proj = _dense(c, c.hidden_size, q_width, ("fsdp", "tensor"), False, rngs, "q_proj")
    self.kv_a_proj_with_mqa = _dense(c, c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                     ("fsdp", None), False, rngs, "kv_a_proj_with_mqa")
    self.kv_a_norm = RMSNorm(c, c.kv_lora_rank, rngs=rngs, eps=LATENT_NORM_EPS)
    self.kv_b_proj = _dense(c, c.kv_lora_rank, c.num_heads * (self.nope + c.v_head_dim),
                            ("fsdp", "tensor"), False, rngs, "kv_b_proj")
    self.o_proj = _dense(c, c.num_heads * c.v_head_dim, c.hidden_size, ("tensor", "fsdp"),
                         False, rngs, "o_proj")

  def __call__(self, x, cos, sin, attend: Callable, cached: bool = False):
    """As Attention.__call__ (no sinks); `cached`: attend writes a decoding cache, which
    takes the absorbed form (class docstring)."""
    b, t, _ = x.shape
    h, d, dv = self.num_heads, self.head_dim, self.v_head_dim
    if self.q_bottleneck:
      q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
    else:
      q = self.q_proj(x)
    q = q.reshape(b, t, h, d)
    kv = self.kv_a_proj_with_mqa(x)
    k_rope = kv[..., None, self.rank:]  # [B, T, 1, rope]: one rotary key for every head
    latent = self.kv_a_norm(kv[..., :self.rank])
    if cos is not None:
      q, k_rope = rope.apply_rotary(q, cos, sin), rope.apply_rotary(k_rope, cos, sin)
    if cached:
      return self._absorbed(q, latent, k_rope, attend)
    kv = self.kv_b_proj(latent).reshape(b, t, h, self.nope + dv)
    k = jnp.concatenate([jnp.broadcast_to(k_rope, (b, t, h, d - self.nope)),
                         kv[..., :self.nope]], axis=-1)
    v = kv[..., self.nope:]
    if dv < d:
      v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, d - dv)))
    out = attend(q, k, v)[..., :dv]
    return self.o_proj(out.reshape(b, t, h * dv))

  def _absorbed(self, q, latent, k_rope, attend):
    """Attention over the latent cache: q [B, T, H, D] (rotary part first), latent
    [B, T, rank], k_rope [B, T, 1, rope], both rotated -> o_proj's output [B, T, hidden]."""
    b, t, h, _ = q.shape
    rope_dims, dtype = q.shape[-1] - self.nope, q.dtype
    w = dense_weight(self.kv_b_proj, dtype).reshape(self.rank, h, self.nope + self.v_head_dim)
    q_latent = jnp.einsum("bthn,rhn->bthr", q[..., rope_dims:], w[..., :self.nope])
    q = jnp.concatenate([q_latent, q[..., :rope_dims]], axis=-1)
    kv = jnp.concatenate([latent[:, :, None, :], k_rope], axis=-1).astype(dtype)
    out = attend(q, kv, None)[..., :self.rank]  # values: the latent part of the cached keys
    out = jnp.einsum("bthr,rhv->bthv", out, w[..., self.nope:])
    return self.o_proj(out.reshape(b, t, h * self.v_head_dim))


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
  """Gated MLP: down(act(gate(x)) * up(x)), SwiGLU (silu) or GeGLU (gelu tanh), of width
  `width` (default intermediate_size)."""

  def __init__(self, config: ModelConfig, width: int | None = None, *, rngs: nnx.Rngs):
    c, w = config, width or config.intermediate_size
    self.hidden_act = c.hidden_act
    self.gate_proj = _dense(c, c.hidden_size, w, ("fsdp", "tensor"), False, rngs, "gate_proj")
    self.up_proj = _dense(c, c.hidden_size, w, ("fsdp", "tensor"), False, rngs, "up_proj")
    self.down_proj = _dense(c, w, c.hidden_size, ("tensor", "fsdp"), False, rngs, "down_proj")

  def __call__(self, x):
    return self.down_proj(_ACTIVATIONS[self.hidden_act](self.gate_proj(x)) * self.up_proj(x))


def _expert_spec(c: ModelConfig, spec: tuple) -> tuple:
  """An expert tensor's sharding ([E, ...]): with expert_parallel the experts split over
  fsdp, each held whole along its other dims but for tensor."""
  if not c.expert_parallel:
    return spec
  return ("fsdp",) + tuple(None if a == "fsdp" else a for a in spec[1:])


class Experts(nnx.Module):
  """num_experts SwiGLU experts stacked: gate/up [E, H, I], down [E, I, H]; with moe_bias
  (gpt-oss) also biases gate/up [E, I] and down [E, H], with swiglu_limit the clamped gate,
  and with LoRA on "experts" one adapter per expert and projection, lora_{gate,up,down}_{a,b}
  [E, in, rank] and [E, rank, out] (ModelConfig)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    self._gate_settings(c)
    init = lambda shape, sharding: nnx.Param(
        nnx.initializers.normal(INIT_STD)(rngs.params(), shape, jnp.dtype(c.param_dtype)),
        out_sharding=_expert_spec(c, sharding), eager_sharding=False)
    self.gate_proj = init((e, h, i), (None, "fsdp", "tensor"))
    self.up_proj = init((e, h, i), (None, "fsdp", "tensor"))
    self.down_proj = init((e, i, h), (None, "tensor", "fsdp"))
    if c.moe_bias:
      for name, shape, sharding in self.bias_shapes(c):
        setattr(self, name, nnx.Param(jnp.zeros(shape, jnp.dtype(c.param_dtype)),
                                      out_sharding=_expert_spec(c, sharding),
                                      eager_sharding=False))
    for name, shape, sharding in self.adapter_shapes(c):
      value = (adapter_a_init(rngs.params(), shape, c.lora_dtype) if name.endswith("_a")
               else jnp.zeros(shape, jnp.dtype(c.lora_dtype)))
      setattr(self, name, nnx.Param(value, out_sharding=_expert_spec(c, sharding),
                                    eager_sharding=False))

  @staticmethod
  def adapter_shapes(c: ModelConfig):
    """(name, shape, sharding) of each expert adapter (LoRA on "experts"; none otherwise)."""
    if not (c.lora_rank and "experts" in c.lora_targets):
      return ()
    e, h, i, r = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.lora_rank
    return (("lora_gate_a", (e, h, r), (None, "fsdp", None)),
            ("lora_gate_b", (e, r, i), (None, None, "tensor")),
            ("lora_up_a", (e, h, r), (None, "fsdp", None)),
            ("lora_up_b", (e, r, i), (None, None, "tensor")),
            ("lora_down_a", (e, i, r), (None, "tensor", None)),
            ("lora_down_b", (e, r, h), (None, None, "fsdp")))

  @staticmethod
  def bias_shapes(c: ModelConfig):
    """(name, shape, sharding) of each expert bias (moe_bias)."""
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    return (("gate_bias", (e, i), (None, "tensor")), ("up_bias", (e, i), (None, "tensor")),
            ("down_bias", (e, h), (None, "fsdp")))

  def _gate_settings(self, c: ModelConfig) -> None:
    self.dtype = jnp.dtype(c.dtype)
    self.has_bias, self.limit, self.alpha = c.moe_bias, c.swiglu_limit, c.swiglu_alpha
    adapted = c.lora_rank and "experts" in c.lora_targets
    self.lora_scale = c.lora_alpha / c.lora_rank if adapted else 0.0

  def _adapter(self, proj: str):
    """(A, B) of projection `proj`'s adapters ("gate_proj" -> lora_gate_a, lora_gate_b)."""
    name = "lora_" + proj.replace("_proj", "")
    return tuple(getattr(self, f"{name}_{ab}")[...].astype(self.dtype) for ab in "ab")

  def _glu(self, gate, up):
    """silu(gate) * up, or gpt-oss's clamped form when swiglu_limit is set."""
    if self.limit is None:
      return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, self.limit)
    up = jnp.clip(up, -self.limit, self.limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * self.alpha)

  def _bias(self, proj: str):
    """The [E, out] bias of projection `proj` ("gate_proj" -> gate_bias)."""
    return getattr(self, proj.replace("_proj", "_bias"))[...].astype(self.dtype)

  def _grouped_matmul(self, x, proj: str, group_sizes, experts):
    """x [N, in] sorted by expert through each row's expert's `proj` ([N] its expert)."""
    del experts
    return jax.lax.ragged_dot(x, getattr(self, proj)[...].astype(self.dtype), group_sizes)

  def _every_matmul(self, spec: str, x, proj: str):
    """`proj` of every expert on x, as the einsum `spec` (x, weights [E, in, out])."""
    return jnp.einsum(spec, x, getattr(self, proj)[...].astype(self.dtype))

  def grouped(self, x, group_sizes):
    """x [N, H] sorted by expert, group_sizes [E] -> [N, H]: each row through its expert
    (jax.lax.ragged_dot: a grouped matmul on TPU and GPU)."""
    experts = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                         total_repeat_length=x.shape[0])  # each sorted row's expert

    def proj(a, name):
      y = self._grouped_matmul(a, name, group_sizes, experts)
      if self.lora_scale:
        lora_a, lora_b = self._adapter(name)
        low = jax.lax.ragged_dot(a, lora_a, group_sizes)
        y = y + jax.lax.ragged_dot(low, lora_b, group_sizes) * self.lora_scale
      return y + self._bias(name)[experts] if self.has_bias else y

    return proj(self._glu(proj(x, "gate_proj"), proj(x, "up_proj")), "down_proj")

  def every(self, x, combine):
    """x [T, H] through every expert, summed with combine [T, E] (zero where not chosen):
    XLA's CPU backend runs ragged_dot as one masked matmul per expert over all rows, so
    there this is the cheaper of the two."""
    def proj(spec, a, name):
      y = self._every_matmul(spec, a, name)
      if self.lora_scale:  # the same contraction into rank r, then out of it
        lora_a, lora_b = self._adapter(name)
        inputs, out = spec.split("->")
        low = jnp.einsum(f"{inputs[:-1]}r->{out[:-1]}r", a, lora_a)
        y = y + jnp.einsum(f"{out[:-1]}r,ero->{out[:-1]}o", low, lora_b) * self.lora_scale
      return y + self._bias(name)[:, None, :] if self.has_bias else y

    h = self._glu(proj("th,ehi->eti", x, "gate_proj"), proj("th,ehi->eti", x, "up_proj"))
    return jnp.einsum("eth,te->th", proj("eti,eih->eth", h, "down_proj"),
                      combine.astype(self.dtype))


def _axes(spec: P, dim: int = 0) -> tuple[str, ...]:
  """The mesh axes a PartitionSpec splits dimension `dim` over."""
  entry = spec[dim] if len(spec) > dim else None
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def experts_per_device(expert_parallel: bool, num_experts: int, mesh) -> int:
  """How many whole experts each device holds under expert parallelism on `mesh` (its fsdp
  axis > 1 dividing num_experts), or 0: experts split along their matrices instead."""
  if not (expert_parallel and num_experts) or mesh is None or getattr(mesh, "empty", False):
    return 0
  if jax.sharding.AxisType.Manual in tuple(getattr(mesh, "axis_types", ())):
    return 0  # inside a shard_map: each device runs the layer on what it holds
  f = dict(mesh.shape).get("fsdp", 1)
  return num_experts // f if f > 1 and num_experts % f == 0 else 0


def _grouped(experts: Experts, num: int, flat, weights, chosen):
  """Tokens flat [T, H] through their chosen [T, k] experts, weighted: the T * k rows sorted
  by expert, run grouped (only each expert's own rows), scatter-added back. An expert id
  `num` (past experts' last) marks a row no expert here takes."""
  top_k = chosen.shape[1]
  chosen = chosen.reshape(-1)
  order = jnp.argsort(chosen, stable=True)
  token = order // top_k
  group_sizes = jnp.bincount(chosen, length=num + 1)[:num].astype(jnp.int32)
  out = experts.grouped(flat[token], group_sizes)
  taken = (chosen[order] < num)[:, None]  # rows past the groups: nothing computed them
  out = jnp.where(taken, out * weights.reshape(-1)[order].astype(flat.dtype)[:, None], 0)
  return jnp.zeros_like(flat).at[token].add(out)


def _every(experts: Experts, num: int, flat, weights, chosen):
  """As _grouped, with every expert run on every token (the CPU's cheaper way)."""
  rows = jnp.arange(flat.shape[0])[:, None]
  combine = jnp.zeros((flat.shape[0], num + 1), weights.dtype)
  return experts.every(flat, combine.at[rows, chosen].set(weights)[:, :num])


class RouterStats(NamedTuple):
  """What one MoE layer's routing did: the router's own picks [B, T, k] and, over the real
  tokens, how often each top-k slot went to each expert (counts [k, E]), the router's
  summed probabilities [E] and the token count (the load-balancing loss's parts)."""
  picked: jax.Array
  counts: jax.Array
  prob_sums: jax.Array
  tokens: jax.Array


def load_balancing_loss(counts: jax.Array, prob_sums: jax.Array, tokens: jax.Array
                        ) -> jax.Array:
  """transformers' load-balancing loss: E * sum over slots and experts of the share of
  tokens routed there (counts [k, E] / tokens) times the mean router probability
  (prob_sums [E] / tokens). Its parts are sums over tokens, so those of several batches add
  up to their union's."""
  n = jnp.maximum(tokens, 1.0)
  return counts.shape[-1] * jnp.sum(counts / n * prob_sums / n)


class Routing(NamedTuple):
  """Transformer.hidden_states' record of routing: the routers' own picks [M, B, T, k] of
  the M MoE layers and the load-balancing loss's parts, the layers' tokens pooled (as
  transformers pools them): routed counts [k, E], router probability sums [E] and the
  token count, over the real tokens."""
  picks: jax.Array
  counts: jax.Array
  prob_sums: jax.Array
  tokens: jax.Array

  @property
  def load_balance(self) -> jax.Array:
    """The load-balancing loss over these tokens (`load_balancing_loss`)."""
    return load_balancing_loss(self.counts, self.prob_sums, self.tokens)


class MoE(nnx.Module):
  """Mixture of experts (Qwen3-MoE): a linear router's softmax picks each token's
  num_experts_per_tok experts; their outputs are summed, weighted by the picked
  probabilities (renormalised if norm_topk_prob). On TPU and GPU tokens are sorted by
  expert and each expert multiplies only its own rows (Experts.grouped), so compute follows
  the active parameters; the CPU backend takes Experts.every. With expert_parallel and a
  mesh in context (the train step's), each fsdp device runs its own whole experts
  (`parallel`). With a shared expert (Qwen2-MoE) every token also goes through one more
  MLP, gated by sigmoid(x @ w) (GLM-4.5: ungated). GLM-4.5 routes by sigmoid scores
  (ModelConfig.router_scoring) with a `correction_bias` that only moves the picks: a
  buffer its pretraining balanced the experts with, held fixed here (no gradient reaches
  it, so the optimizer leaves it and every publication carries it unchanged). DeepSeek-V3
  routes as GLM-4.5; DeepSeek-V2 limits softmax picks to the groups of the best single
  scores (group_scoring "max")."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.num_experts, self.top_k, self.norm_topk_prob = (
        c.num_experts, c.num_experts_per_tok, c.norm_topk_prob)
    self.sigmoid = c.router_scoring == "sigmoid"
    self.groups, self.topk_groups = c.expert_groups, c.topk_groups
    self.group_max = c.group_scoring == "max"
    self.scaling = c.routed_scaling_factor
    self.expert_parallel = c.expert_parallel
    self.router = _dense(c, c.hidden_size, c.num_experts, ("fsdp", None), c.moe_bias, rngs)
    if self.sigmoid:
      self.correction_bias = nnx.Param(jnp.zeros((c.num_experts,), jnp.dtype(c.param_dtype)),
                                       out_sharding=(None,), eager_sharding=False)
    self.experts = Experts(c, rngs=rngs)
    self.shared = bool(c.shared_expert_intermediate_size)
    self.shared_gated = self.shared and c.shared_expert_gated
    if self.shared:
      self.shared_expert = MLP(c, c.shared_expert_intermediate_size, rngs=rngs)
    if self.shared_gated:
      self.shared_expert_gate = _dense(c, c.hidden_size, 1, ("fsdp", None), False, rngs)

  def route(self, flat, replay=None):
    """(weights [T, k] float32, experts used [T, k], experts the router picked [T, k], the
    router's softmax probabilities [T, E] (the load-balancing loss's)) of tokens flat
    [T, H]. replay [T, k] (routing replay): where >= 0, the experts to use instead of the
    router's picks (the sampler's routes); their weights are the router's own scores of
    them, so the router keeps its gradient."""
    if self.sigmoid:  # in float32, as transformers' Glm4MoeTopkRouter
      logits = flat.astype(jnp.float32) @ self.router.kernel[...].astype(jnp.float32)
      if self.router.use_bias:
        logits = logits + self.router.bias[...].astype(jnp.float32)
      scores = jax.nn.sigmoid(logits)
      bias = jax.lax.stop_gradient(self.correction_bias[...].astype(jnp.float32))
      _, picked = jax.lax.top_k(self._within_top_groups(scores + bias), self.top_k)
      weights = jnp.take_along_axis(scores, picked, axis=-1)
    else:
      logits = self.router(flat).astype(jnp.float32)
      scores = jax.nn.softmax(logits, axis=-1)
      _, picked = jax.lax.top_k(self._within_top_groups(scores), self.top_k)
      weights = jnp.take_along_axis(scores, picked, axis=-1)
    chosen = picked
    if replay is not None:
      replay = replay.astype(jnp.int32)
      chosen = jnp.where(replay >= 0, replay, picked)
      weights = jnp.take_along_axis(scores, chosen, axis=-1)
    if self.norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if self.scaling != 1.0:
      weights = weights * self.scaling
    probs = jax.nn.softmax(logits, axis=-1) if self.sigmoid else scores
    return weights, chosen, picked, probs

  def _within_top_groups(self, choice):
    """choice [T, E] with -inf outside each token's topk_groups best expert groups, a
    group's score being the sum of its two best (DeepSeek-V3's group-limited routing) or,
    with group_scoring "max", its best (DeepSeek-V2's group_limited_greedy)."""
    if self.groups == 1:
      return choice
    t, size = choice.shape[0], self.num_experts // self.groups
    grouped = choice.reshape(t, self.groups, size)
    group_scores = (jnp.max(grouped, -1) if self.group_max
                    else jnp.sum(jax.lax.top_k(grouped, 2)[0], -1))
    _, top = jax.lax.top_k(group_scores, self.topk_groups)
    kept = jnp.any(jax.nn.one_hot(top, self.groups, dtype=jnp.bool_), axis=1)  # [T, groups]
    return jnp.where(jnp.repeat(kept, size, axis=1), choice, -jnp.inf)

  def grouped(self, flat, weights, chosen):
    """Sort the T * k (token, expert) rows by expert, run them grouped, scatter-add back."""
    return _grouped(self.experts, self.num_experts, flat, weights, chosen)

  def every(self, flat, weights, chosen):
    return _every(self.experts, self.num_experts, flat, weights, chosen)

  def dispatch(self, flat, weights, chosen):
    """Each token through its chosen experts, weighted: grouped on TPU and GPU, every expert
    on CPU; split over the mesh's fsdp axis with expert parallelism (`parallel`)."""
    mesh = self._expert_mesh()
    if mesh is not None:
      return self.parallel(flat, weights, chosen, mesh)
    return jax.lax.platform_dependent(flat, weights, chosen, cpu=self.every,
                                      default=self.grouped)

  def _expert_mesh(self):
    """The mesh in context when its fsdp axis splits the experts, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if experts_per_device(self.expert_parallel, self.num_experts, mesh) else None

  def parallel(self, flat, weights, chosen, mesh, grouped: bool | None = None):
    """Expert parallelism: the f devices of an fsdp group each hold num_experts / f whole
    experts. Each gathers the group's tokens and their picks, runs the rows routed to its
    own experts, and the outputs are summed back onto the tokens' devices (a reduce-
    scatter): tokens cross the network, not expert weights. Experts split over tensor sum
    their partial outputs over it; the down bias is added by one tensor shard. `grouped`:
    the TPU/GPU dispatch (True) or the CPU's (False) on any platform (None: by platform)."""
    graphdef, state = nnx.split(self.experts)
    specs = shd.param_specs(state, nnx.get_partition_spec(state), mesh)
    rows = shd.fit_spec(P(tuple(a for a in shd.BATCH_AXES if a in mesh.axis_names)),
                        flat.shape, mesh)
    gathered = "fsdp" in _axes(rows)
    split = "tensor" in _axes(specs["gate_proj"], 2)  # each expert's width over tensor
    local = experts_per_device(True, self.num_experts, mesh)

    def body(x, w, c, state):
      if gathered:
        x, w, c = (jax.lax.all_gather(a, "fsdp", axis=0, tiled=True) for a in (x, w, c))
      c = c - jax.lax.axis_index("fsdp") * local
      mine = (c >= 0) & (c < local)
      w, c = jnp.where(mine, w, 0.0), jnp.where(mine, c, local)  # local: no expert here
      experts = nnx.merge(graphdef, state)
      if split and experts.has_bias:
        experts.down_bias.value = jnp.where(jax.lax.axis_index("tensor") == 0,
                                            experts.down_bias.value, 0)
      runs = {False: functools.partial(_every, experts, local),
              True: functools.partial(_grouped, experts, local)}
      out = (runs[grouped](x, w, c) if grouped is not None else
             jax.lax.platform_dependent(x, w, c, cpu=runs[False], default=runs[True]))
      if split:
        out = jax.lax.psum(out, "tensor")
      if gathered:
        return jax.lax.psum_scatter(out, "fsdp", scatter_dimension=0, tiled=True)
      return jax.lax.psum(out, "fsdp")

    return jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, specs),
                         out_specs=rows)(flat, weights, chosen, state)

  def __call__(self, x, replay=None, mask=None):
    """(output [B, T, H], RouterStats); replay [B, T, k] or None (route); mask [B, T]: the
    real tokens the statistics count (None: all)."""
    b, t, h = x.shape
    flat = x.reshape(b * t, h)
    weights, chosen, picked, probs = self.route(
        flat, None if replay is None else replay.reshape(b * t, self.top_k))
    out = self.dispatch(flat, weights, chosen)
    if self.shared_gated:
      out = out + jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
    elif self.shared:
      out = out + self.shared_expert(flat)
    m = jnp.ones((b * t,), jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
    stats = RouterStats(
        picked=picked.reshape(b, t, self.top_k),
        counts=jnp.einsum("t,tke->ke", m, jax.nn.one_hot(chosen, self.num_experts)),
        prob_sums=m @ probs, tokens=jnp.sum(m))
    return out.reshape(b, t, h), stats


class Block(nnx.Module):
  """Residual block, attention then MLP. Pre-norm: each branch's input is normed
  (`post_attn_norm` is the norm before the MLP); sandwich norms (Gemma) norm each branch's
  output too; post-norms (OLMo 2/3) norm only the outputs."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
    self.pre = not config.post_norms
    if self.pre:
      self.input_norm = RMSNorm(config, rngs=rngs)
    self.attn = (LatentAttention if config.kv_lora_rank else Attention)(config, rngs=rngs)
    if self.pre:
      self.post_attn_norm = RMSNorm(config, rngs=rngs)
    self.mlp = MoE(config, rngs=rngs) if moe else MLP(config, rngs=rngs)
    self.out_norms = config.sandwich_norms or config.post_norms
    self.residual_multiplier = config.residual_multiplier  # Granite
    if self.out_norms:
      self.attn_out_norm = RMSNorm(config, rngs=rngs)
      self.mlp_out_norm = RMSNorm(config, rngs=rngs)

  def __call__(self, x, cos, sin, attend: Callable, replay=None, mask=None,
               cached: bool = False):
    """(output, RouterStats or None in a dense layer); replay, mask: MoE; cached: attend
    writes a decoding cache."""
    attn = self.attn(self.input_norm(x) if self.pre else x, cos, sin, attend, cached)
    x = x + self._branch(self.attn_out_norm(attn) if self.out_norms else attn)
    y = self.post_attn_norm(x) if self.pre else x
    moe = isinstance(self.mlp, MoE)
    mlp, stats = self.mlp(y, replay, mask) if moe else (self.mlp(y), None)
    return x + self._branch(self.mlp_out_norm(mlp) if self.out_norms else mlp), stats

  def _branch(self, y):
    return y if self.residual_multiplier == 1.0 else y * self.residual_multiplier


class Transformer(nnx.Module):
  """The language model: tokens [B, T] -> float32 logits [B, T, vocab]."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.embed = nnx.Embed(
        c.vocab_size, c.hidden_size, dtype=jnp.dtype(c.dtype),
        param_dtype=jnp.dtype(c.param_dtype), embedding_init=_normal(("tensor", "fsdp")),
        rngs=rngs)
    self.layers = nnx.List([Block(c, rngs=rngs, moe=c.moe_layer(i))
                            for i in range(c.num_layers)])
    self.norm = RMSNorm(c, rngs=rngs)
    if not c.tie_word_embeddings:
      self.lm_head = _dense(c, c.hidden_size, c.vocab_size, ("fsdp", "tensor"), False, rngs)

  def hidden_states(self, tokens, *, positions=None, segment_ids=None, cache=None,
                    attention_fn: Callable = dot_product_attention, remat: bool = False,
                    routes=None, record_routes: bool = False):
    """Final-norm hidden states [B, T, H] and the updated cache (None without one).
    `remat` (training, no cache): keep only each layer's input for the backward pass and
    recompute the rest, trading a forward pass for most of the activation memory.

    Routing replay (mixture of experts): `routes` [M, B, T, k] int, for the M MoE layers in
    order, are the experts each token goes to where >= 0 (-1: the router's own pick);
    `record_routes` also returns a third output, `Routing`: the routers' own picks
    [M, B, T, k] int32 and the load-balancing loss's parts over the real tokens (segment
    id > 0).

    `cache` is any object with the KVCache protocol: `write_meta(segment_ids, positions)`,
    `attend(layer, q, k, v, q_segment_ids, q_positions, attention_fn) -> (out, cache)` and
    `advance(t)`; the workers' shared-prefix cache plugs in the same way. A latent-attention
    layer attends with v None, the cache reading its keys as values (`kv_cache_layout`).
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
      raise ValueError(f"tokens: expected shape [batch, seq], got {tokens.shape}")
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
      if cache is not None:
        positions = positions + cache.index
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    if cache is not None:
      cache = cache.write_meta(segment_ids, positions)

    c = self.config
    angles = rope.model_angles(c, positions, segment_ids)
    local_angles = angles
    if c.rope_local_theta is not None:
      local = c.replace(rope_theta=c.rope_local_theta, rope_scaling=None)
      local_angles = rope.rotary_angles(positions, rope.inverse_frequencies(local))
    x = self.embed(tokens)
    if c.scale_embeddings:
      x = x * jnp.asarray(c.hidden_size ** 0.5, c.param_dtype).astype(x.dtype)
    if c.embedding_multiplier != 1.0:  # Granite
      x = x * c.embedding_multiplier
    if remat and cache is not None:
      raise ValueError("remat: expected no cache (it serves training, not decoding)")
    sm_scale, softcap = c.attention_scale, c.attn_logit_softcapping
    moe_layers = c.moe_layers
    if (routes is not None or record_routes) and not moe_layers:
      raise ValueError("routes, record_routes: a model without mixture-of-experts layers "
                       "has no routes")
    if routes is not None and routes.shape != (len(moe_layers), b, t, c.num_experts_per_tok):
      raise ValueError(f"routes: expected shape [moe layers={len(moe_layers)}, {b}, {t}, "
                       f"top_k={c.num_experts_per_tok}], got {routes.shape}")
    layer_stats = []  # RouterStats of each MoE layer
    real = segment_ids > 0
    for i, layer in enumerate(self.layers):
      replay = (None if routes is None or i not in moe_layers
                else routes[moe_layers.index(i)])
      window = c.layer_window(i)
      cos, sin = (None, None) if i in c.nope_layers else (
          local_angles if c.sliding_layer(i) else angles)
      if cache is None:
        def attend(q, k, v, sinks=None, window=window):
          return attention_fn(q, k, v, segment_ids, positions, segment_ids, positions,
                              window=window, sm_scale=sm_scale, softcap=softcap,
                              **({} if sinks is None else {"sinks": sinks}))
        if remat:
          x, stats = jax.checkpoint(
              lambda x, replay, layer=layer, attend=attend, cos=cos, sin=sin:
              layer(x, cos, sin, attend, replay, real))(x, replay)
          layer_stats += [] if stats is None else [stats]
          continue
      else:
        def attend(q, k, v, sinks=None, i=i, window=window):
          nonlocal cache
          out, cache = cache.attend(i, q, k, v, segment_ids, positions, attention_fn,
                                    window=window, sm_scale=sm_scale, softcap=softcap,
                                    sinks=sinks)
          return out
      x, stats = layer(x, cos, sin, attend, replay, real, cached=cache is not None)
      layer_stats += [] if stats is None else [stats]
    x = self.norm(x)
    cache = None if cache is None else cache.advance(t)
    if not record_routes:
      return x, cache
    return x, cache, Routing(jnp.stack([s.picked for s in layer_stats]),
                             *(sum(getattr(s, f) for s in layer_stats)
                               for f in ("counts", "prob_sums", "tokens")))

  def logits_from_hidden(self, x):
    """Float32 logits of hidden states, divided by logits_scaling (Granite) and soft-capped
    where the model caps them (Gemma 2)."""
    logits = self.project_logits(x)
    if self.config.logits_scaling != 1.0:
      logits = logits / self.config.logits_scaling
    cap = self.config.final_logit_softcapping
    return logits if cap is None else jnp.tanh(logits / cap) * cap

  def project_logits(self, x):
    """Project hidden states to float32 logits (tied: through the embedding table)."""
    dtype = jnp.dtype(self.config.dtype)
    if self.config.tie_word_embeddings:
      table = self.embed.embedding[...].astype(dtype)
      return jnp.einsum("bth,vh->btv", x, table, preferred_element_type=jnp.float32)
    kernel = self.lm_head.kernel[...].astype(dtype)
    return jnp.einsum("bth,hv->btv", x, kernel, preferred_element_type=jnp.float32)

  def __call__(self, tokens, *, positions=None, segment_ids=None, cache=None,
               attention_fn: Callable = dot_product_attention):
    x, new_cache = self.hidden_states(tokens, positions=positions, segment_ids=segment_ids,
                                      cache=cache, attention_fn=attention_fn)
    logits = self.logits_from_hidden(x)
    return logits if cache is None else (logits, new_cache)
