"""ModelConfig: the shape of a Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / OLMo 2 /
OLMo 3 / Phi-3 / SmolLM3 / Granite / GLM-4 / GLM-4.5 / DeepSeek-V2 / DeepSeek-V3 family decoder,
independent of any checkpoint format."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mistral", "mixtral",
                 "gemma2", "gemma3", "olmo2", "olmo3", "phi3", "smollm3", "granite", "glm4",
                 "gpt_oss", "glm4_moe", "deepseek_v3", "deepseek_v2", "olmoe")
DTYPES = ("float32", "bfloat16")
# The projections LoRA can adapt (attention, latent attention's and MLP, the shared expert's
# included; "experts": every routed expert's gate, up and down, each with adapters of its own).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "experts", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_MLA_TARGETS = LORA_TARGETS[-4:]  # dropped from a model without latent attention
ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ROUTER_SCORINGS = ("softmax", "sigmoid")
GROUP_SCORINGS = ("top2_sum", "max")
# Multi-head latent attention's fields, idle (and 0) without it.
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")
# Fields that leave what the model computes from its weights alone: dtypes (the published
# weights fix the held ones; each side picks its compute dtype), where weights live, the
# HF export name, and the context a side allows (a worker may allow fewer positions).
_NOT_FORWARD = ("param_dtype", "dtype", "lora_dtype", "expert_parallel", "architecture",
                "max_position_embeddings")
_MOE_FIELDS = ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size",
               "shared_expert_gated", "moe_bias", "swiglu_limit", "swiglu_alpha",
               "router_scoring", "expert_groups", "topk_groups", "routed_scaling_factor",
               "group_scoring")


class FrozenScaling(dict):
  """rope_scaling as a read-only dict that hashes: the config sits in the model's graphdef,
  which jit hashes as a static argument (a plain dict made Llama-3 models unsampleable)."""

  def __hash__(self):
    return hash(tuple(sorted(self.items())))  # list values (LongRoPE's factors) are tuples

  def _read_only(self, *args, **kwargs):
    raise TypeError("ModelConfig.rope_scaling is read-only; use config.replace(rope_scaling=...)")

  __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only


def dtype_name(value: Any, field: str = "dtype") -> str:
  """'float32' or 'bfloat16' from a name, a numpy dtype or a numpy/JAX scalar type
  (np.float32, jnp.bfloat16, np.dtype("float32")); anything else is a ValueError naming
  `field`."""
  if isinstance(value, str):
    name = value
  else:
    try:
      import ml_dtypes  # noqa: F401  pylint: disable=unused-import (numpy's bfloat16)
      import numpy as np
      name = np.dtype(value).name
    except TypeError:
      name = repr(value)
  if name not in DTYPES:
    raise ValueError(f"{field}: expected one of {DTYPES} (a name, numpy dtype or jnp type), "
                     f"got {value!r}")
  return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only transformer (Llama 2/3, Mistral, Qwen2/2.5, Qwen3,
  Gemma 2, Gemma 3, OLMo 2, OLMo 3, Phi-3, Phi-4, SmolLM3, Granite 3, GLM-4, gpt-oss,
  GLM-4.5, DeepSeek-V2, DeepSeek-V3)."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int  # SwiGLU inner width.
  num_layers: int
  num_heads: int  # Query heads.
  num_kv_heads: int  # Key/value heads (grouped-query attention when < num_heads).
  head_dim: int | None = None  # None -> hidden_size // num_heads.
  rope_theta: float = 10000.0
  # HF style: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
  # "original_max_position_embeddings"}, {"rope_type": "yarn", "factor",
  # "original_max_position_embeddings"[, "beta_fast", "beta_slow", "attention_factor",
  # "mscale", "mscale_all_dim", "truncate"]}, {"rope_type": "linear", "factor"} or
  # {"rope_type": "longrope", "short_factor", "long_factor", "original_max_position_embeddings"
  # [, "factor", "attention_factor"]} (Phi-3.5, Phi-4-mini); None = plain.
  rope_scaling: dict[str, Any] | None = None
  partial_rotary_factor: float = 1.0  # RoPE turns the first int(head_dim * this) dims.
  # LongRoPE: None picks the long factors per call, when a position reaches
  # original_max_position_embeddings (transformers' forward); True / False fixes them, so a
  # trainer and its workers turn every token alike (model_config_from sets it from the run's
  # longest sequence). Not part of the HF config.
  rope_long_factors: bool | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections.
  attention_out_bias: bool = False  # gpt-oss: and on the output projection.
  # gpt-oss: a learned logit per head joins each query's softmax and takes its share of the
  # weight without adding a value (an "attention sink").
  attention_sinks: bool = False
  qk_norm: bool = False  # Qwen3 and Gemma 3 RMS-normalise each head's q and k before RoPE.
  qk_norm_across_heads: bool = False  # OLMo 2/3: over the whole q and k projections instead.
  hidden_act: str = "silu"  # The MLP gate: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma).
  zero_centered_norms: bool = False  # Gemma: a norm weight w scales by 1 + w, in float32.
  scale_embeddings: bool = False  # Gemma: token embeddings times sqrt(hidden_size).
  sandwich_norms: bool = False  # Gemma 2/3: attention and MLP outputs are RMS-normed too.
  post_norms: bool = False  # OLMo 2/3: attention and MLP outputs are RMS-normed, not inputs.
  query_pre_attn_scalar: float | None = None  # Attention logits times this**-0.5 (None: head_dim).
  # Granite: attention logits times attention_multiplier (instead of any **-0.5 scale), token
  # embeddings times embedding_multiplier, each branch's output times residual_multiplier
  # before its residual add, and output logits divided by logits_scaling.
  attention_multiplier: float | None = None
  embedding_multiplier: float = 1.0
  residual_multiplier: float = 1.0
  logits_scaling: float = 1.0
  # Sliding-window attention: a query sees keys fewer than `sliding_window` positions back, in
  # the layers `layer_types` marks "sliding_attention" (None: every layer when a window is set).
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers (unscaled).
  nope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose q and k take no rotary embedding.
  # Gemma 2: attention logits and output logits soft-capped as cap * tanh(x / cap).
  attn_logit_softcapping: float | None = None
  final_logit_softcapping: float | None = None
  # Multi-head latent attention (DeepSeek-V2/V3): kv_lora_rank > 0 compresses each token's keys
  # and values into an RMS-normed latent of that width, which kv_b_proj expands per head into
  # a key part of head_dim - qk_rope_head_dim dims and a value of v_head_dim dims; one rotary
  # key of qk_rope_head_dim dims is shared by every head (num_kv_heads = num_heads). Queries
  # go through a q_lora_rank-wide RMS-normed bottleneck (0: one q_proj). head_dim is the q/k
  # head width; softmax scale head_dim**-0.5, times YaRN's mscale(mscale_all_dim)**2.
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  # Mixture of experts (Qwen3-MoE): num_experts > 0 gives the layers `moe_layer` picks a
  # router over num_experts SwiGLU experts of width moe_intermediate_size, each token going
  # to its num_experts_per_tok best (their softmax weights renormalised if norm_topk_prob);
  # the others keep the dense MLP of width intermediate_size.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % decoder_sparse_step == 0
  mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
  # Qwen2-MoE: a sparse layer also runs every token through a shared SwiGLU expert of this
  # width, scaled by sigmoid(x @ shared_expert_gate); 0: none. shared_expert_gated False
  # (GLM-4.5): its output is added unscaled, and there is no gate.
  shared_expert_intermediate_size: int = 0
  shared_expert_gated: bool = True
  # GLM-4.5 (DeepSeek-V3's routing): "sigmoid" scores each expert sigmoid(logit) and picks the
  # top k of score + correction_bias, a fixed per-expert bias (HF's e_score_correction_bias)
  # that moves the picks but not their weights (the picked plain scores); "softmax": the
  # softmax probabilities do both. With expert_groups > 1 the experts form that many equal
  # groups and a token picks only from the topk_groups groups whose best two biased scores
  # sum highest (group_scoring "top2_sum"; DeepSeek-V2's "max": softmax scores, a group
  # scored by its best expert). The picked weights (renormalised if norm_topk_prob) are then
  # times routed_scaling_factor.
  router_scoring: str = "softmax"
  expert_groups: int = 1
  topk_groups: int = 1
  routed_scaling_factor: float = 1.0
  group_scoring: str = "top2_sum"
  # gpt-oss: the router and the experts' projections have biases, and the experts' gate is
  # SwiGLU clamped at swiglu_limit: (clip(up, -l, l) + 1) * g * sigmoid(alpha * g) with
  # g = min(gate, l) (None: silu(gate) * up).
  moe_bias: bool = False
  swiglu_limit: float | None = None
  swiglu_alpha: float = 1.702
  # Expert parallelism: each device of the mesh's fsdp axis holds num_experts / fsdp whole
  # experts (their matrices still split over tensor) and the tokens routed to them come to
  # it, instead of every expert's matrices split over fsdp and gathered for each layer. Not
  # part of the HF config; it changes where the weights live, not what the model computes.
  expert_parallel: bool = False
  # LoRA: each projection named in lora_targets also adds (x @ A) @ B * lora_alpha / lora_rank,
  # A [in, rank], B [rank, out] (B starts at 0; stacked experts: one pair per expert); a run
  # with lora_rank > 0 trains only A and B. 0: none. Not part of the HF config (exports merge
  # the adapters into the kernels).
  lora_rank: int = 0
  lora_alpha: float = 16.0
  # The adapters' storage dtype, apart from param_dtype: a LoRA run can hold its frozen base
  # in bfloat16 (half the memory) and still train float32 adapters.
  lora_dtype: str = "float32"
  lora_targets: tuple[str, ...] = LORA_TARGETS
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 2048
  param_dtype: str = "float32"  # Storage dtype of the weights.
  dtype: str = "float32"  # Compute dtype of activations (logits are always float32).
  architecture: str = "llama"  # One of ARCHITECTURES: decides the HF export names.

  def __post_init__(self):
    def need(cond, field, expected, got):
      if not cond:
        raise ValueError(f"ModelConfig.{field}: expected {expected}, got {got!r}")

    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "max_position_embeddings", "head_dim"):
      v = getattr(self, f)
      if v is None and f == "head_dim":
        continue
      # numpy ints (sizes read from arrays) are the ints they hold; a bool is not a size.
      need(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0, f,
           "a positive int", v)
      object.__setattr__(self, f, int(v))
    need(isinstance(self.rope_theta, numbers.Real) and self.rope_theta > 0, "rope_theta",
         "a positive number", self.rope_theta)
    need(isinstance(self.rms_norm_eps, numbers.Real) and self.rms_norm_eps >= 0,
         "rms_norm_eps", "a number >= 0", self.rms_norm_eps)
    need(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
         f"a divisor of num_heads={self.num_heads}", self.num_kv_heads)
    if self.head_dim is None:
      need(self.hidden_size % self.num_heads == 0, "head_dim",
           f"set explicitly since hidden_size={self.hidden_size} is not divisible by "
           f"num_heads={self.num_heads}", None)
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    need(self.head_dim % 2 == 0, "head_dim", "an even int (RoPE rotates pairs)", self.head_dim)
    self._check_latent_attention(need)
    need(isinstance(self.partial_rotary_factor, (int, float))
         and 0 < self.partial_rotary_factor <= 1 and self.rotary_dim > 0
         and self.rotary_dim % 2 == 0, "partial_rotary_factor",
         f"a number in (0, 1] turning an even number of the {self.head_dim} head dims",
         self.partial_rotary_factor)
    for f in ("param_dtype", "dtype", "lora_dtype"):
      object.__setattr__(self, f, dtype_name(getattr(self, f), f"ModelConfig.{f}"))
    need(self.architecture in ARCHITECTURES, "architecture", f"one of {ARCHITECTURES}",
         self.architecture)
    need(self.hidden_act in ACTIVATIONS, "hidden_act", f"one of {ACTIVATIONS}", self.hidden_act)
    need(not (self.qk_norm_across_heads and not self.qk_norm), "qk_norm_across_heads",
         "False unless qk_norm", self.qk_norm_across_heads)
    need(not (self.post_norms and self.sandwich_norms), "post_norms",
         "False with sandwich_norms (a block norms its outputs one way)", self.post_norms)
    if self.query_pre_attn_scalar is not None:
      need(isinstance(self.query_pre_attn_scalar, (int, float)) and self.query_pre_attn_scalar > 0,
           "query_pre_attn_scalar", "a positive number or None", self.query_pre_attn_scalar)
    need(self.attention_multiplier is None or self.query_pre_attn_scalar is None,
         "attention_multiplier", "None with query_pre_attn_scalar (one attention scale)",
         self.attention_multiplier)
    for f in ("attention_multiplier", "embedding_multiplier", "residual_multiplier",
              "logits_scaling"):
      v = getattr(self, f)
      if v is not None or f != "attention_multiplier":
        need(isinstance(v, (int, float)) and v > 0, f, "a positive number", v)
    for f in ("attn_logit_softcapping", "final_logit_softcapping"):
      v = getattr(self, f)
      need(v is None or (isinstance(v, (int, float)) and v > 0), f, "a positive number or None",
           v)
    if self.num_experts:
      need(isinstance(self.num_experts, int) and self.num_experts > 0, "num_experts",
           "a positive int (0: dense)", self.num_experts)
      need(isinstance(self.num_experts_per_tok, int)
           and 0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
           f"an int in [1, num_experts={self.num_experts}]", self.num_experts_per_tok)
      need(isinstance(self.moe_intermediate_size, int) and self.moe_intermediate_size > 0,
           "moe_intermediate_size", "a positive int", self.moe_intermediate_size)
      need(isinstance(self.decoder_sparse_step, int) and self.decoder_sparse_step > 0,
           "decoder_sparse_step", "a positive int", self.decoder_sparse_step)
    self._check_routing(need)
    if self.moe_bias or self.swiglu_limit is not None:
      need(self.num_experts > 0, "moe_bias" if self.moe_bias else "swiglu_limit",
           "False / None without experts (they shape the experts)",
           self.moe_bias if self.moe_bias else self.swiglu_limit)
    need(isinstance(self.expert_parallel, bool) and (self.num_experts or not
                                                     self.expert_parallel),
         "expert_parallel", "a bool, False without experts", self.expert_parallel)
    if self.swiglu_limit is not None:
      for f in ("swiglu_limit", "swiglu_alpha"):
        v = getattr(self, f)
        need(isinstance(v, (int, float)) and v > 0, f, "a positive number", v)
    need(isinstance(self.lora_rank, int) and self.lora_rank >= 0, "lora_rank",
         "an int >= 0 (0: no LoRA)", self.lora_rank)
    need(isinstance(self.lora_alpha, (int, float)) and self.lora_alpha > 0, "lora_alpha",
         "a positive number", self.lora_alpha)
    targets = (self.lora_targets,) if isinstance(self.lora_targets, str) else self.lora_targets
    targets = tuple(t.strip() for t in targets for t in t.split(",") if t.strip())
    need(set(targets) <= set(LORA_TARGETS) and (targets or not self.lora_rank), "lora_targets",
         f"some of {LORA_TARGETS}", self.lora_targets)
    if not self.kv_lora_rank:  # as the targets of an rlax-ps before latent attention
      targets = tuple(t for t in targets if t not in _MLA_TARGETS)
      need(targets or not self.lora_rank, "lora_targets",
           f"some of {LORA_TARGETS[:-4]} without latent attention", self.lora_targets)
    object.__setattr__(self, "lora_targets", targets)
    need(isinstance(self.shared_expert_intermediate_size, int)
         and self.shared_expert_intermediate_size >= 0
         and not (self.shared_expert_intermediate_size and not self.num_experts),
         "shared_expert_intermediate_size", "an int >= 0, and 0 without experts",
         self.shared_expert_intermediate_size)
    for f in ("mlp_only_layers", "nope_layers"):
      layers = tuple(int(i) for i in getattr(self, f))
      need(all(0 <= i < self.num_layers for i in layers), f,
           f"layer indices in [0, {self.num_layers})", getattr(self, f))
      object.__setattr__(self, f, layers)
    # Targets naming none of this model's projections built no adapter: the run trained every
    # weight, as if LoRA were off.
    need(not self.lora_rank or set(self.lora_targets) & self.lora_projections(), "lora_targets",
         f"some of this model's projections {sorted(self.lora_projections())}",
         self.lora_targets)
    if self.sliding_window is not None:
      need(isinstance(self.sliding_window, int) and self.sliding_window > 0, "sliding_window",
           "a positive int or None", self.sliding_window)
    if self.layer_types is not None:
      types = tuple(self.layer_types)
      need(len(types) == self.num_layers and set(types) <= set(LAYER_TYPES), "layer_types",
           f"{self.num_layers} entries from {LAYER_TYPES}", self.layer_types)
      object.__setattr__(self, "layer_types", types)
    if self.rope_scaling is not None:
      scaling = dict(self.rope_scaling)
      rope_type = scaling.get("rope_type", scaling.get("type", "default"))
      need(rope_type in ROPE_TYPES, "rope_scaling.rope_type", f"one of {ROPE_TYPES}", rope_type)
      if rope_type in ("linear", "llama3", "yarn"):
        need(isinstance(scaling.get("factor"), (int, float)), "rope_scaling.factor", "a number",
             scaling.get("factor"))
      if rope_type == "yarn":
        need("original_max_position_embeddings" in scaling,
             "rope_scaling.original_max_position_embeddings", "a number", None)
      if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
          need(key in scaling, f"rope_scaling.{key}", "a number", None)
      if rope_type == "longrope":
        need(isinstance(scaling.get("original_max_position_embeddings"), int),
             "rope_scaling.original_max_position_embeddings", "an int",
             scaling.get("original_max_position_embeddings"))
        for key in ("short_factor", "long_factor"):
          factors = scaling.get(key)
          need(isinstance(factors, (list, tuple)) and len(factors) == self.rotary_dim // 2
               and all(isinstance(f, (int, float)) for f in factors), f"rope_scaling.{key}",
               f"{self.rotary_dim // 2} numbers (one per rotated pair)", factors)
          scaling[key] = tuple(float(f) for f in factors)
      scaling["rope_type"] = rope_type
      scaling.pop("type", None)
      object.__setattr__(self, "rope_scaling",
                         FrozenScaling(scaling) if rope_type != "default" else None)

  def _check_latent_attention(self, need) -> None:
    """Multi-head latent attention's fields (kv_lora_rank, q_lora_rank, qk_rope_head_dim,
    v_head_dim), each named where it is bad; all 0 without it."""
    for f in _MLA_FIELDS:
      v = getattr(self, f)
      need(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0, f,
           "an int >= 0", v)
      object.__setattr__(self, f, int(v))
    if not self.kv_lora_rank:
      for f in _MLA_FIELDS[1:]:
        need(getattr(self, f) == 0, f, "0 without latent attention (kv_lora_rank 0)",
             getattr(self, f))
      return
    rope = self.qk_rope_head_dim
    need(0 < rope < self.head_dim and rope % 2 == 0, "qk_rope_head_dim",
         f"an even int in (0, head_dim={self.head_dim}) (the q/k head's rotary part)", rope)
    need(0 < self.v_head_dim <= self.head_dim, "v_head_dim",
         f"an int in [1, head_dim={self.head_dim}] (values are zero-padded to the q/k width)",
         self.v_head_dim)
    need(self.num_kv_heads == self.num_heads, "num_kv_heads",
         f"num_heads={self.num_heads} with latent attention (a key and value per head)",
         self.num_kv_heads)
    for f in ("qkv_bias", "qk_norm", "attention_out_bias", "attention_sinks"):
      need(not getattr(self, f), f, "False with latent attention", getattr(self, f))
    need(self.partial_rotary_factor == 1, "partial_rotary_factor",
         "1 with latent attention (qk_rope_head_dim sets the rotary dims)",
         self.partial_rotary_factor)

  def _check_routing(self, need) -> None:
    """The router's fields (router_scoring, expert_groups, topk_groups,
    routed_scaling_factor, shared_expert_gated), each named where it is bad."""
    need(self.router_scoring in ROUTER_SCORINGS, "router_scoring", f"one of {ROUTER_SCORINGS}",
         self.router_scoring)
    need(isinstance(self.shared_expert_gated, bool), "shared_expert_gated", "a bool",
         self.shared_expert_gated)
    need(isinstance(self.routed_scaling_factor, numbers.Real)
         and not isinstance(self.routed_scaling_factor, bool)
         and self.routed_scaling_factor > 0, "routed_scaling_factor", "a positive number",
         self.routed_scaling_factor)
    g = self.expert_groups
    need(isinstance(g, int) and not isinstance(g, bool) and g > 0
         and (g == 1 or (self.num_experts % g == 0 and self.num_experts // g >= 2)),
         "expert_groups", f"1, or a divisor of num_experts={self.num_experts} leaving >= 2 "
         "experts a group", g)
    need(self.group_scoring in GROUP_SCORINGS, "group_scoring", f"one of {GROUP_SCORINGS}",
         self.group_scoring)
    need(g == 1 or (self.router_scoring, self.group_scoring) in (("sigmoid", "top2_sum"),
                                                                  ("softmax", "max")),
         "expert_groups", "1 unless the groups are DeepSeek-V3's (router_scoring='sigmoid', "
         "group_scoring='top2_sum') or DeepSeek-V2's ('softmax', 'max')", g)
    k = self.topk_groups
    need(isinstance(k, int) and not isinstance(k, bool) and 0 < k <= g
         and (g == 1 or k * (self.num_experts // g) >= self.num_experts_per_tok),
         "topk_groups", f"an int in [1, expert_groups={g}] whose groups hold at least "
         f"num_experts_per_tok={self.num_experts_per_tok} experts", k)
    if not self.num_experts:
      for field, default in (("router_scoring", "softmax"), ("topk_groups", 1),
                             ("routed_scaling_factor", 1.0), ("group_scoring", "top2_sum")):
        need(getattr(self, field) == default, field, f"{default!r} without experts",
             getattr(self, field))

  @property
  def rotary_dim(self) -> int:
    """How many leading dims of each head RoPE turns (all but with partial_rotary_factor;
    latent attention: qk_rope_head_dim, its q/k heads hold those dims first)."""
    if self.kv_lora_rank:
      return self.qk_rope_head_dim
    return int(self.head_dim * self.partial_rotary_factor)

  def moe_layer(self, layer: int) -> bool:
    """Whether layer `layer` routes tokens to experts (else it has the dense MLP)."""
    return (self.num_experts > 0 and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0)

  def lora_projections(self) -> frozenset[str]:
    """The LORA_TARGETS this model has: its attention's projections, the dense MLP's where a
    layer or a shared expert has one, "experts" where layers route to experts."""
    if self.kv_lora_rank:
      names = {"o_proj", "kv_a_proj_with_mqa", "kv_b_proj"} | (
          {"q_a_proj", "q_b_proj"} if self.q_lora_rank else {"q_proj"})
    else:
      names = {"q_proj", "k_proj", "v_proj", "o_proj"}
    if self.shared_expert_intermediate_size or not all(
        self.moe_layer(i) for i in range(self.num_layers)):
      names |= {"gate_proj", "up_proj", "down_proj"}
    if self.moe_layers:
      names.add("experts")
    return frozenset(names)

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """The layers that route tokens to experts, in order (routing replay's layer axis)."""
    return tuple(i for i in range(self.num_layers) if self.moe_layer(i))

  def sliding_layer(self, layer: int) -> bool:
    """Whether layer `layer` is a sliding (local) one: its window, and its RoPE base when
    rope_local_theta is set (a Gemma 3 local layer keeps that base even with no window)."""
    if self.layer_types is not None:
      return self.layer_types[layer] == "sliding_attention"
    return self.sliding_window is not None

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of layer `layer`, or None where it attends every earlier key."""
    return self.sliding_window if self.sliding_layer(layer) else None

  @property
  def kv_cache_layout(self) -> tuple[int, int, bool]:
    """(heads, width, separate values) of one token's decoding-cache entry in each layer.
    Latent attention caches one head [normed latent, rotary key] of kv_lora_rank +
    qk_rope_head_dim dims that every query head reads absorbed, its first kv_lora_rank dims
    being the values too (no separate values); else num_kv_heads keys and values of head_dim."""
    if self.kv_lora_rank:
      return 1, self.kv_lora_rank + self.qk_rope_head_dim, False
    return self.num_kv_heads, self.head_dim, True

  @property
  def attention_scale(self) -> float | None:
    """The attention logits' scale when it is not head_dim**-0.5 (Gemma, Granite, latent
    attention under YaRN with mscale_all_dim), else None."""
    if self.kv_lora_rank:
      return self.head_dim ** -0.5 * _mla_mscale(self.rope_scaling) ** 2
    if self.attention_multiplier is not None:
      return float(self.attention_multiplier)
    if self.query_pre_attn_scalar is None:
      return None
    return float(self.query_pre_attn_scalar) ** -0.5

  @staticmethod
  def absent_defaults(fields: dict[str, Any]) -> dict[str, Any]:
    """{name: default, as a JSON value} of the fields `fields` (a config's to_dict or
    forward_fields, maybe an older rlax-ps's) lacks: what the older code computed with."""
    return {f.name: json.loads(json.dumps(f.default)) for f in dataclasses.fields(ModelConfig)
            if f.name not in fields and f.default is not dataclasses.MISSING}

  def forward_fields(self) -> dict[str, Any]:
    """The fields that decide what the model computes from given weights, as JSON values
    (tuples as lists), less those another setting makes idle: what a trainer publishes with
    its weights and a worker must equal (shapes alone do not show e.g. rope_theta)."""
    scaling = self.rope_scaling or {}
    longrope = scaling.get("rope_type") == "longrope"
    idle = set(_NOT_FORWARD)
    if not self.lora_rank:
      idle |= {"lora_alpha", "lora_targets"}
    if not self.num_experts:
      idle |= set(_MOE_FIELDS)
    if self.swiglu_limit is None:
      idle.add("swiglu_alpha")
    if not longrope:
      idle.add("rope_long_factors")
    if not self.kv_lora_rank:
      idle |= set(_MLA_FIELDS)
    if longrope and not scaling.get("factor") and scaling.get("attention_factor") is None:
      idle.discard("max_position_embeddings")  # LongRoPE's scale is derived from it
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
              if f.name not in idle}
    return json.loads(json.dumps(fields, default=lambda v: v.item()))

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    """The config of dict `d` (a checkpoint's saved one). One saved with LoRA targets naming
    none of its model's projections (before those were refused) built no adapter and
    trained every weight: it is read as that plain model, which its checkpoint holds."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"ModelConfig: unknown fields {unknown}; known: {sorted(known)}")
    try:
      return cls(**d)
    except ValueError as e:
      if not (d.get("lora_rank") and "ModelConfig.lora_targets: expected some of this "
              "model's projections" in str(e)):
        raise
      return cls(**{**d, "lora_rank": 0})

  @property
  def num_params(self) -> int:
    """Parameter count (embeddings included, lm_head counted once when tied; LoRA's
    adapters included)."""
    h, d = self.hidden_size, self.head_dim
    lora = lambda name, n_in, n_out: (  # noqa: E731
        self.lora_rank * (n_in + n_out) if self.lora_rank and name in self.lora_targets else 0)
    mlp_lora = lambda width: (lora("gate_proj", h, width) + lora("up_proj", h, width)  # noqa: E731
                              + lora("down_proj", width, h))
    if self.kv_lora_rank:
      attn = self._latent_attention_params(lora)
    else:
      attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
      attn += (lora("q_proj", h, self.num_heads * d) + lora("k_proj", h, self.num_kv_heads * d)
               + lora("v_proj", h, self.num_kv_heads * d) + lora("o_proj", self.num_heads * d, h))
    if self.qkv_bias:
      attn += d * (self.num_heads + 2 * self.num_kv_heads)
    attn += h * self.attention_out_bias + self.num_heads * self.attention_sinks
    if self.qk_norm:
      attn += d * (self.num_heads + self.num_kv_heads) if self.qk_norm_across_heads else 2 * d
    norms = (4 if self.sandwich_norms else 2) * h
    dense = 3 * h * self.intermediate_size + mlp_lora(self.intermediate_size)
    moe = h * self.num_experts + 3 * h * self.moe_intermediate_size * self.num_experts
    moe += self.num_experts * (self.router_scoring == "sigmoid")  # the correction bias
    if self.lora_rank and "experts" in self.lora_targets:
      moe += 3 * self.num_experts * self.lora_rank * (h + self.moe_intermediate_size)
    if self.moe_bias:  # the router's and each expert's gate, up and down biases
      moe += self.num_experts * (1 + 2 * self.moe_intermediate_size + h)
    if self.shared_expert_intermediate_size:
      moe += (3 * h * self.shared_expert_intermediate_size + h * self.shared_expert_gated
              + mlp_lora(self.shared_expert_intermediate_size))
    layers = sum(attn + norms + (moe if self.moe_layer(i) else dense)
                 for i in range(self.num_layers))
    head = 0 if self.tie_word_embeddings else h * self.vocab_size
    return self.vocab_size * h + layers + h + head

  def _latent_attention_params(self, lora) -> int:
    """One layer's latent-attention parameters (projections, latent norms, adapters)."""
    h, heads, d, r = self.hidden_size, self.num_heads, self.head_dim, self.kv_lora_rank
    q, qr, v = heads * d, self.q_lora_rank, heads * self.v_head_dim
    kv_a, kv_b = r + self.qk_rope_head_dim, heads * (d - self.qk_rope_head_dim) + v
    if qr:
      n = h * qr + qr + qr * q + lora("q_a_proj", h, qr) + lora("q_b_proj", qr, q)
    else:
      n = h * q + lora("q_proj", h, q)
    n += h * kv_a + r + r * kv_b + v * h
    return n + lora("kv_a_proj_with_mqa", h, kv_a) + lora("kv_b_proj", r, kv_b) + lora(
        "o_proj", v, h)


def _mla_mscale(scaling) -> float:
  """YaRN's mscale(factor, mscale_all_dim) (1 without it), which latent attention's softmax
  scale takes squared, as transformers' yarn_apply_mscale."""
  if not scaling or not scaling.get("mscale_all_dim"):
    return 1.0
  factor = float(scaling["factor"])
  return 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
