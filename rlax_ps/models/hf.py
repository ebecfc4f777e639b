"""Hugging Face checkpoints (config.json + safetensors) to and from our Transformer.

Covers LlamaForCausalLM, MistralForCausalLM (v0.1's sliding window included),
MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM,
Qwen3MoeForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (Gemma 3's text model),
Olmo2ForCausalLM, Olmo3ForCausalLM, Phi3ForCausalLM (Phi-3, Phi-4), SmolLM3ForCausalLM,
GraniteForCausalLM (Granite 3), Glm4ForCausalLM (GLM-4-0414, GLM-Z1), Glm4MoeForCausalLM
(GLM-4.5, GLM-4.5-Air), DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi K2, Moonlight) and
DeepseekV2ForCausalLM (DeepSeek-V2, V2-Lite) as transformers 4.x
(top-level `rope_theta`/`rope_scaling`) and 5.x (`rope_parameters`) write them, with one
`model.safetensors` or a sharded `model.safetensors.index.json`. HF linear weights are
[out, in]; our kernels are [in, out], so every kernel is transposed on the way. Checkpoints
hold one tensor per expert (`mlp.experts.{e}.gate_proj.weight`; Mixtral's Hub layout, which
transformers 5.x still writes and 4.x reads, `block_sparse_moe.experts.{e}.w1.weight` with
w1/w3/w2 = gate/up/down), our experts one param stacked over them ([E, H, I]). Phi-3's fused
`qkv_proj` and `gate_up_proj` are split into our q/k/v and gate/up kernels by row ranges
(`Rows`) and fused again on export (GLM-4's gate_up_proj too); gpt-oss interleaves its
experts' gate and up columns (`Columns`), and its Hub checkpoints store the experts in MXFP4
(`*_blocks`, `*_scales`), dequantized on load (exported unquantized), as are block-scaled
FP8 weights (`quant_method: fp8`: DeepSeek-V3/R1, Kimi K2, Qwen3-FP8; models/quantized.py).
GLM-4 turns interleaved pairs
of each head's rotary dims; its q/k output channels are permuted on load into the
rotate-half order our RoPE turns (attention scores are unchanged) and back on export (GLM-4.5
turns rotate-half pairs, as stored). GLM-4.5's router keeps its `e_score_correction_bias`
(our `mlp.correction_bias`, held fixed in training); its multi-token-prediction layers
(`model.layers.{n}` for n >= num_hidden_layers) serve speculative decoding only, are skipped
on load as transformers skips them, and are not exported. DeepSeek-V3 routes as GLM-4.5 does
(its MTP layers skipped alike), DeepSeek-V2 by softmax scores (`topk_method` greedy or
group_limited_greedy). Their latent attention's q and k_pe output channels are permuted on load
so that each head holds its rotary dims first in rotate-half order (from interleaved pairs
under V3's `rope_interleave`, V2's always), and back on export, which writes interleaved pairs.

Mixtral's `router_jitter_noise` is read and ignored: transformers multiplies the router's
input by that noise only in train mode, never in eval mode or in vLLM, and RL losses need our
log-probs to equal the sampler's, so we never jitter; export writes no jitter (0.0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from rlax_ps.models.config import ModelConfig, dtype_name
from rlax_ps.models.params import flatten_params
from rlax_ps.models.quantized import (FP8_TYPES, QUANTIZATION_FIELD, Fp8Layout, RawTensors,
                                      check_fp8, dequantize_fp8, dequantize_mxfp4, fp8_layout,
                                      mxfp4_shape, quantize_fp8, quantize_mxfp4)
from rlax_ps.models.transformer import Transformer
from rlax_ps.sharding import fit_spec

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class Rows(NamedTuple):
  """Rows [start, stop) of a fused HF tensor (e.g. Phi-3's qkv_proj) that hold one param."""
  name: str
  start: int
  stop: int


class Columns(NamedTuple):
  """Last-axis entries start, start + step, ... of a fused HF tensor stored in our
  orientation (gpt-oss's experts.gate_up_proj [E, H, 2I]: gate even, up odd)."""
  name: str
  start: int
  step: int


# MXFP4 (OCP microscaling FP4, as gpt-oss ships its experts): the value of each 4-bit code,
# two codes per byte (low nibble first), 32 codes per block sharing a power-of-two scale
# stored as a biased exponent (e8m0, bias 127).
# HF class name -> our ModelConfig.architecture, and back.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen2MoeForCausalLM": "qwen2_moe",
                 "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
                 "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                 "Olmo2ForCausalLM": "olmo2", "Olmo3ForCausalLM": "olmo3",
                 "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3",
                 "GraniteForCausalLM": "granite", "Glm4ForCausalLM": "glm4",
                 "GptOssForCausalLM": "gpt_oss", "Glm4MoeForCausalLM": "glm4_moe",
                 "DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2",
                 "OlmoeForCausalLM": "olmoe"}
_HF_CLASS = {ours: hf for hf, ours in ARCHITECTURES.items()}
# Image-text checkpoints whose language model we train (exported as the text-only class).
_TEXT_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# What transformers' Gemma3TextConfig assumes for fields a config.json leaves out (the Hub's
# image-text Gemma 3 configs state little more than their widths and depth).
_GEMMA_DEFAULTS = {
    "gemma3": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, query_pre_attn_scalar=256,
        sliding_window=4096, tie_word_embeddings=True, rope_theta=1000000.0,
        rope_local_base_freq=10000.0),
    "gemma2": dict(  # transformers' Gemma2Config, likewise
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
        rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096,
        tie_word_embeddings=True, rope_theta=10000.0, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0),
}
_GEMMA_FAMILY = {"hidden_act": "gelu_tanh", "zero_centered_norms": True,
                 "scale_embeddings": True, "sandwich_norms": True}
_OLMO_FAMILY = {"qk_norm": True, "qk_norm_across_heads": True, "post_norms": True}
_OLMO_THETA = 500000.0  # transformers' Olmo3Config.default_theta
# transformers' rms_norm_eps where a config.json leaves it out (else 1e-6).
_DEFAULT_RMS_EPS = {"olmo2": 1e-5, "olmo3": 1e-5, "phi3": 1e-5, "glm4": 1.5625e-7,
                    "gpt_oss": 1e-5, "mixtral": 1e-5, "glm4_moe": 1e-5, "olmoe": 1e-5}
# Other fields whose transformers default, where a config.json leaves them out, is not ours
# (RoPE base 10000, untied head).
_CLASS_DEFAULTS = {"mixtral": {"rope_theta": 1e6},
                   "smollm3": {"rope_theta": 2e6, "tie_word_embeddings": True}}
_MODEL_TYPE = {"gemma3": "gemma3_text"}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen2_moe": 32768, "qwen3": 32768,
                          "qwen3_moe": 32768, "mistral": 131072, "mixtral": 131072,
                          "gemma2": 8192, "gemma3": 131072, "olmo2": 2048, "olmo3": 2048,
                          "phi3": 4096, "smollm3": 32768, "granite": 2048, "glm4": 131072,
                          "gpt_oss": 131072, "glm4_moe": 131072, "deepseek_v3": 4096,
                          "deepseek_v2": 2048, "olmoe": 4096}
# What each family fixes in the block (ModelConfig fields), beyond its config.json numbers.
_FAMILY = {
    "llama": {}, "mistral": {}, "mixtral": {}, "qwen2": {"qkv_bias": True},
    "qwen2_moe": {"qkv_bias": True},
    "qwen3": {"qk_norm": True}, "qwen3_moe": {"qk_norm": True}, "gemma2": _GEMMA_FAMILY,
    "gemma3": {"qk_norm": True, **_GEMMA_FAMILY},
    "olmo2": _OLMO_FAMILY, "olmo3": _OLMO_FAMILY, "phi3": {}, "smollm3": {}, "granite": {},
    "glm4": {"qkv_bias": True, "sandwich_norms": True},
    "gpt_oss": {"qkv_bias": True, "attention_out_bias": True, "attention_sinks": True},
    "glm4_moe": {},  # its q/k/v biases and q/k norms come from config.json (_GLM4_MOE_FLAGS)
    "deepseek_v3": {}, "deepseek_v2": {},
    # OLMoE: OLMo 2's q/k norms over all heads, but pre-norm blocks.
    "olmoe": {"qk_norm": True, "qk_norm_across_heads": True},
}
# GLM-4.5's config.json flags of ModelConfig fields that _FAMILY fixes for the others.
_GLM4_MOE_FLAGS = {"qkv_bias": "attention_bias", "qk_norm": "use_qk_norm"}
_FAMILY_FIELDS = ("qkv_bias", "attention_out_bias", "attention_sinks", "qk_norm",
                  "qk_norm_across_heads", "hidden_act", "zero_centered_norms",
                  "scale_embeddings", "sandwich_norms", "post_norms")
# Phi3Config's original_max_position_embeddings, where a config.json leaves it out.
_PHI3_ORIGINAL_CONTEXT = 4096
# transformers' sliding_window where a config.json leaves the field out (an explicit null is
# no window); Gemma's come with _GEMMA_DEFAULTS, and Qwen's apply with use_sliding_window.
_DEFAULT_WINDOW = {"mistral": 4096, "qwen2": 4096, "qwen2_moe": 4096, "qwen3": 4096,
                   "qwen3_moe": 4096, "gpt_oss": 128, "olmo3": 4096}
# transformers' GptOssConfig RoPE where a config.json states none: YaRN x32 over 4096 tokens.
_GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_HF_ACT = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Mixture-of-experts fields of ModelConfig, under their config.json names.
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
               "decoder_sparse_step", "mlp_only_layers")
# Mixtral's expert tensors (the Hub layout) under our expert params' names.
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v3",
              "deepseek_v2", "olmoe")
# The families with multi-head latent attention (ModelConfig.kv_lora_rank > 0).
_MLA_ARCHS = ("deepseek_v3", "deepseek_v2")
# transformers' Glm4MoeConfig where a config.json leaves a routing field out.
_GLM4_MOE_DEFAULTS = {"n_routed_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 1408, "n_shared_experts": 1, "n_group": 1,
                      "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
                      "routed_scaling_factor": 1.0}
# transformers' DeepseekV3Config and DeepseekV2Config where a config.json leaves a field out.
_DEEPSEEK_DEFAULTS = {
    "deepseek_v3": {"n_routed_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_group": 8,
                    "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128},
    "deepseek_v2": {"n_routed_experts": 64, "moe_intermediate_size": 1407,
                    "n_shared_experts": 2, "n_group": 1, "topk_group": 1,
                    "first_k_dense_replace": 0, "norm_topk_prob": False,
                    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
                    "topk_method": "greedy"},
}
# The router scoring each DeepSeek class computes (whatever config.json's scoring_func says).
_DEEPSEEK_SCORING = {"deepseek_v3": "sigmoid", "deepseek_v2": "softmax"}
# Configs without layer_types: every 6th Gemma 3 layer and every 2nd Gemma 2 one is full.
_GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
# Buffers some checkpoints carry that hold nothing our model needs.
_IGNORABLE = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _get(d: Mapping[str, Any], key: str, default: Any = ..., *, where: str = CONFIG_FILE):
  if key in d and d[key] is not None:
    return d[key]
  if default is ...:
    raise ValueError(f"{where}: missing field {key!r}")
  return default


def _rope_from_hf(d: Mapping[str, Any], arch: str
                  ) -> tuple[float, dict[str, Any] | None, float]:
  """(rope_theta, rope_scaling, partial_rotary_factor) from 5.x `rope_parameters` or 4.x
  `rope_theta`/`rope_scaling`. Phi-3 reads its legacy "su" and "yarn" types as LongRoPE (as
  transformers does) and keeps original_max_position_embeddings at the top level."""
  params, scaling = d.get("rope_parameters"), d.get("rope_scaling")
  if isinstance(params, Mapping) and isinstance(params.get("full_attention"), Mapping):
    params = params["full_attention"]  # 5.x nests per layer type in some configs.
  if isinstance(scaling, Mapping):  # (4.x's "type" is 5.x's "rope_type")
    scaling = {"rope_type" if k == "type" else k: v for k, v in scaling.items()}
  if params and scaling and not (isinstance(params, Mapping) and isinstance(scaling, Mapping)
                                 and {**params, **scaling} == dict(params)):
    # (the scaling within the parameters, as transformers writes both: one and the same)
    raise ValueError(f"{CONFIG_FILE}: rope_parameters and rope_scaling: expected one of them, "
                     f"or the same scaling, got {params!r} and {scaling!r}; transformers "
                     f"reads rope_scaling, so delete the one you did not mean")
  rope = dict(params or scaling or {})
  theta = float(rope.pop("rope_theta", d.get("rope_theta") or 10000.0))
  rope_type = rope.pop("rope_type", rope.pop("type", "default"))
  partial = (rope.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor")
             or (0.5 if arch in ("glm4", "glm4_moe") else 1.0))  # Glm4(Moe)Config's default
  if partial != 1 and arch not in ("phi3", "glm4", "glm4_moe"):
    raise ValueError(f"{CONFIG_FILE}: partial_rotary_factor: expected 1.0, got {partial!r}")
  if arch == "phi3" and rope_type in ("su", "yarn"):
    rope_type = "longrope"
  if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
    raise ValueError(f"{CONFIG_FILE}: rope type: expected one of ['default', 'linear', 'llama3', "
                     f"'yarn', 'longrope'], got {rope_type!r}")
  if rope_type in ("llama3", "yarn", "longrope"):
    rope["original_max_position_embeddings"] = _original_context(d, rope, arch)
  if rope_type == "yarn" and rope.get("factor") is None:  # transformers' YaRN: the ratio
    rope["factor"] = _max_positions(d, arch) / rope["original_max_position_embeddings"]
  if rope_type == "default":
    return theta, None, float(partial)
  return theta, {"rope_type": rope_type, **rope}, float(partial)


def _max_positions(d: Mapping[str, Any], arch: str) -> int:
  return int(_get(d, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch]))


def _original_context(d: Mapping[str, Any], rope: Mapping[str, Any], arch: str) -> int:
  """The pre-extension context of Llama-3, YaRN and LongRoPE scaling, as transformers 5's
  standardize_rope_params sets it: a top-level field over the rope dict's (Phi-3's 4096 when
  left out, as Phi3Config holds one), else max_position_embeddings; Gemma 3's and OLMo 3's
  per-layer-type rope dicts read only their own."""
  if arch == "phi3":
    return int(_get(d, "original_max_position_embeddings", _PHI3_ORIGINAL_CONTEXT))
  own = int(_get(rope, "original_max_position_embeddings", _max_positions(d, arch)))
  if arch in ("gemma3", "olmo3"):
    return own
  return int(_get(d, "original_max_position_embeddings", own))


def _local_rope_theta(d: Mapping[str, Any], arch: str) -> float:
  """The RoPE base of sliding layers, which are never scaled: 5.x
  `rope_parameters.sliding_attention`, else Gemma 3's 4.x `rope_local_base_freq` or OLMo 3's
  `rope_theta` (one base for all layers, the global ones scaled)."""
  local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
  kind = local.get("rope_type", local.get("type", "default"))
  if kind != "default":
    raise ValueError(f"{CONFIG_FILE}: rope_parameters.sliding_attention.rope_type: expected "
                     f"'default', got {kind!r}")
  if arch == "olmo3":
    return float(local.get("rope_theta") or d.get("rope_theta") or _OLMO_THETA)
  return float(local.get("rope_theta") or d.get("rope_local_base_freq")
               or _GEMMA_DEFAULTS["gemma3"]["rope_local_base_freq"])


def _sliding(d: Mapping[str, Any], arch: str, num_layers: int
             ) -> tuple[int | None, tuple[str, ...] | None]:
  """(sliding_window, layer_types) as each family's config.json states them."""
  types = d.get("layer_types")
  window = d["sliding_window"] if "sliding_window" in d else _DEFAULT_WINDOW.get(arch)
  if arch in _GEMMA_DEFAULTS:
    if d.get("use_bidirectional_attention"):
      raise ValueError(f"{CONFIG_FILE}: use_bidirectional_attention: expected false (a causal "
                       "language model), got true")
    if not types:
      pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern")
                    or _GEMMA_WINDOW_PATTERN[arch])
      types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
               for i in range(num_layers)]
  elif arch in ("mistral", "mixtral", "phi3"):
    types = None  # every layer slides when a window is set
  elif arch == "gpt_oss":  # transformers' GptOssConfig: every other layer slides, over 128
    types = types or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                      for i in range(num_layers)]
  elif arch == "smollm3":  # transformers' SmolLM3Config: the NoPE layers slide
    if not d.get("use_sliding_window"):
      return None, None
    nope = set(_nope_layers(d, num_layers))
    types = types or ["sliding_attention" if i in nope and window is not None
                      else "full_attention" for i in range(num_layers)]
  elif arch == "olmo3":  # transformers' Olmo3Config: 3 sliding layers of every 4, 4096 wide
    types = types or ["sliding_attention" if (i + 1) % 4 else "full_attention"
                      for i in range(num_layers)]
  elif arch in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
    if not d.get("use_sliding_window"):
      return None, None
    if arch == "qwen3_moe":  # transformers slides every layer, whatever layer_types says
      types = None
    elif arch == "qwen2_moe" and not types:  # even layers below max_window_layers slide
      start = int(d.get("max_window_layers", 28))
      types = ["sliding_attention" if i % 2 == 0 and i < start else "full_attention"
               for i in range(num_layers)]
    elif not types:  # Qwen2Config and Qwen3Config: layers from max_window_layers (28) on
      start = int(_get(d, "max_window_layers", 28))
      types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
  else:
    return None, None
  max_positions = _max_positions(d, arch)
  if window is not None and int(window) >= max_positions:  # a window no sequence outgrows
    window = None
  if arch in ("gemma3", "olmo3"):  # local layers keep their RoPE base with or without a window
    return (None if window is None else int(window)), tuple(types)
  types = tuple(types) if types else None
  if window is None or (types is not None and "sliding_attention" not in types):
    return None, None
  return int(window), types


# Granite's scalars, named alike in config.json and ModelConfig.
_GRANITE_FIELDS = ("attention_multiplier", "embedding_multiplier", "residual_multiplier",
                   "logits_scaling")


def _granite_multipliers(d: Mapping[str, Any]) -> dict[str, float]:
  """Granite's multipliers; transformers' GraniteConfig takes 1.0 for each left out (so an
  attention scale of 1, not head_dim**-0.5)."""
  return {key: float(_get(d, key, 1.0)) for key in _GRANITE_FIELDS}


def _nope_layers(d: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
  """SmolLM3's layers without RoPE: `no_rope_layers` (1: rotary, 0: none) or, as
  transformers' SmolLM3Config, every `no_rope_layer_interval`-th layer."""
  flags = d.get("no_rope_layers")
  if flags is None:
    interval = int(d.get("no_rope_layer_interval") or 4)
    flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
  if len(flags) != num_layers:
    raise ValueError(f"{CONFIG_FILE}: no_rope_layers: expected {num_layers} entries, got "
                     f"{len(flags)}")
  return tuple(i for i, rotary in enumerate(flags) if not rotary)


def language_model_config(d: Mapping[str, Any], hf_class: str) -> dict[str, Any]:
  """An image-text config.json `d` as its language model's, of the text-only class
  `hf_class`: its text_config, with the top-level quantization_config (the whole
  checkpoint's) so that its quant_method is checked too."""
  text = {**(d.get("text_config") or {}), "architectures": [hf_class]}
  if text.get(QUANTIZATION_FIELD) is None and d.get(QUANTIZATION_FIELD) is not None:
    text[QUANTIZATION_FIELD] = d[QUANTIZATION_FIELD]
  return text


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
  """A ModelConfig from a parsed HF config.json (either transformers 4.x or 5.x layout)."""
  archs = d.get("architectures") or []
  text_models = [_TEXT_MODEL_OF[a] for a in archs if a in _TEXT_MODEL_OF]
  if text_models:  # an image-text model: its language model is what we load
    d = language_model_config(d, text_models[0])
    archs = text_models[:1]
  known = [a for a in archs if a in ARCHITECTURES]
  if not known:
    got = archs if archs else d.get("model_type")
    raise ValueError(f"{CONFIG_FILE}: architectures: expected one of "
                     f"{sorted(ARCHITECTURES) + sorted(_TEXT_MODEL_OF)}, got {got!r}")
  arch = ARCHITECTURES[known[0]]
  gemma = arch in _GEMMA_DEFAULTS
  if gemma:
    d = {**_GEMMA_DEFAULTS[arch], **d}
  d = {**d, **{k: v for k, v in _CLASS_DEFAULTS.get(arch, {}).items() if d.get(k) is None}}
  family = dict(_FAMILY[arch])
  if arch == "glm4_moe":  # Glm4MoeConfig: no biases, no q/k norms where the file is silent
    family.update({ours: bool(_get(d, key, False)) for ours, key in _GLM4_MOE_FLAGS.items()})
  act_key = "hidden_activation" if gemma else "hidden_act"
  act = d.get(act_key) or d.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
  if _HF_ACT.get(act) != family.get("hidden_act", "silu"):
    want = [k for k, v in _HF_ACT.items() if v == family.get("hidden_act", "silu")][0]
    raise ValueError(f"{CONFIG_FILE}: {act_key}: expected {want!r}, got {act!r}")
  flags = {"llama": ("attention_bias", "mlp_bias"), "smollm3": ("attention_bias", "mlp_bias"),
           "granite": ("attention_bias", "mlp_bias"),
           "qwen3": ("attention_bias",), "qwen3_moe": ("attention_bias",),
           "gemma2": ("attention_bias",), "gemma3": ("attention_bias",),
           "olmo2": ("attention_bias",), "olmo3": ("attention_bias",),
           "olmoe": ("attention_bias", "clip_qkv"),
           "deepseek_v3": ("attention_bias",),
           "deepseek_v2": ("attention_bias", "mlp_bias")}.get(arch, ())
  for flag in flags:
    if d.get(flag):
      raise ValueError(f"{CONFIG_FILE}: {flag}: expected false (not supported), got {d[flag]!r}")
  if arch == "qwen2_moe" and d.get("qkv_bias") is False:
    raise ValueError(f"{CONFIG_FILE}: qkv_bias: expected true (not supported), got false")
  if arch in ("glm4", "gpt_oss") and d.get("attention_bias") is False:
    raise ValueError(f"{CONFIG_FILE}: attention_bias: expected true (not supported), got false")
  quant = (d.get(QUANTIZATION_FIELD) or {}).get("quant_method")
  if quant not in (None, "mxfp4", "fp8", "compressed-tensors"):
    raise ValueError(f"{CONFIG_FILE}: {QUANTIZATION_FIELD}.quant_method: expected none, "
                     f"'mxfp4', 'fp8' or 'compressed-tensors' (dequantized on load), got "
                     f"{quant!r}")
  try:
    fp8_layout(d.get(QUANTIZATION_FIELD) or {})
  except ValueError as e:
    raise ValueError(f"{CONFIG_FILE}: {e}") from None
  if arch == "gpt_oss":  # GptOssConfig's RoPE where the file states none of it
    d = {**d, "rope_theta": d.get("rope_theta") or _GPT_OSS_ROPE["rope_theta"]}
    if not (d.get("rope_parameters") or d.get("rope_scaling")):
      d["rope_parameters"] = {**_GPT_OSS_ROPE, "rope_theta": d["rope_theta"]}
  for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
    if d.get(cap) is not None and not gemma:
      raise ValueError(f"{CONFIG_FILE}: {cap}: expected null ({known[0]} has no logit "
                       f"soft-capping), got {d[cap]!r}")
  num_heads = int(_get(d, "num_attention_heads"))
  num_layers = int(_get(d, "num_hidden_layers"))
  if arch == "olmo3" and not d.get("rope_theta"):
    d = {**d, "rope_theta": _OLMO_THETA}
  theta, scaling, partial = _rope_from_hf(d, arch)
  window, layer_types = _sliding(d, arch, num_layers)
  cap = lambda key: None if d.get(key) is None else float(d[key])
  moe = _moe_from_hf(d, arch) if arch in _MOE_ARCHS else {}
  mla = _mla_from_hf(d, arch) if arch in _MLA_ARCHS else {}
  return ModelConfig(
      vocab_size=int(_get(d, "vocab_size")),
      hidden_size=int(_get(d, "hidden_size")),
      intermediate_size=int(_get(d, "intermediate_size")),
      num_layers=num_layers,
      num_heads=num_heads,
      num_kv_heads=int(_get(d, "num_key_value_heads", num_heads)),
      head_dim=mla.pop("head_dim") if mla else _get(d, "head_dim", None),
      rope_theta=theta,
      rope_scaling=scaling,
      partial_rotary_factor=partial,
      rms_norm_eps=float(_get(d, "rms_norm_eps", _DEFAULT_RMS_EPS.get(arch, 1e-6))),
      tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False)),
      max_position_embeddings=int(_get(d, "max_position_embeddings",
                                       _DEFAULT_MAX_POSITIONS[arch])),
      query_pre_attn_scalar=float(_get(d, "query_pre_attn_scalar")) if gemma else None,
      sliding_window=window,
      layer_types=layer_types,
      rope_local_theta=_local_rope_theta(d, arch) if arch in ("gemma3", "olmo3") else None,
      nope_layers=_nope_layers(d, num_layers) if arch == "smollm3" else (),
      **(_granite_multipliers(d) if arch == "granite" else {}),
      attn_logit_softcapping=cap("attn_logit_softcapping"),
      final_logit_softcapping=cap("final_logit_softcapping"),
      architecture=arch,
      **family,
      **moe,
      **mla)


def _moe_from_hf(d: Mapping[str, Any], arch: str) -> dict[str, Any]:
  """The ModelConfig MoE fields of a Qwen2-MoE or Qwen3-MoE config.json (5.x writes
  `num_experts` as `num_local_experts`) or a Mixtral one (every layer sparse, experts
  intermediate_size wide, top-k weights renormalised), a gpt-oss one or a GLM-4.5 one
  (`_glm4_moe_from_hf`). Only Qwen2-MoE and GLM-4.5 have a shared expert."""
  if arch == "glm4_moe":
    return _glm4_moe_from_hf(d)
  if arch in _MLA_ARCHS:
    return _deepseek_moe_from_hf(d, arch)
  if arch == "olmoe":  # OlmoeConfig: 64 experts, top 8, as wide as intermediate_size
    experts = d.get("num_experts", d.get("num_local_experts", 64))
    return dict(num_experts=int(experts),
                num_experts_per_tok=int(_get(d, "num_experts_per_tok", 8)),
                moe_intermediate_size=int(_get(d, "intermediate_size")),
                norm_topk_prob=bool(_get(d, "norm_topk_prob", False)))
  if arch == "mixtral":
    return dict(num_experts=int(_get(d, "num_local_experts")),
                num_experts_per_tok=int(_get(d, "num_experts_per_tok")),
                moe_intermediate_size=int(_get(d, "intermediate_size")), norm_topk_prob=True)
  if arch == "gpt_oss":  # softmax over the top-k router logits: renormalised top-k
    return dict(num_experts=int(_get(d, "num_local_experts")),
                num_experts_per_tok=int(_get(d, "num_experts_per_tok", 4)),
                moe_intermediate_size=int(_get(d, "intermediate_size")), norm_topk_prob=True,
                moe_bias=True, swiglu_limit=float(_get(d, "swiglu_limit", 7.0)),
                swiglu_alpha=float(_get(d, "swiglu_alpha", 1.702)))
  # Left out, transformers' Qwen2MoeConfig takes 5632 (Qwen1.5-MoE's width); null or 0: none.
  shared = int(d.get("shared_expert_intermediate_size", 5632) or 0) if arch == "qwen2_moe" else 0
  if arch != "qwen2_moe" and d.get("shared_expert_intermediate_size"):
    raise ValueError(f"{CONFIG_FILE}: shared_expert_intermediate_size: expected 0 (no shared "
                     f"expert), got {d['shared_expert_intermediate_size']!r}")
  if d.get("num_experts") is None and d.get("num_local_experts") is not None:
    d = {**d, "num_experts": d["num_local_experts"]}
  return dict(num_experts=int(_get(d, "num_experts")),
              num_experts_per_tok=int(_get(d, "num_experts_per_tok")),
              moe_intermediate_size=int(_get(d, "moe_intermediate_size")),
              norm_topk_prob=bool(_get(d, "norm_topk_prob", False)),
              decoder_sparse_step=int(_get(d, "decoder_sparse_step", 1)),
              mlp_only_layers=tuple(int(i) for i in _get(d, "mlp_only_layers", ())),
              shared_expert_intermediate_size=shared)


def _glm4_moe_from_hf(d: Mapping[str, Any],
                      defaults: Mapping[str, Any] = _GLM4_MOE_DEFAULTS) -> dict[str, Any]:
  """GLM-4.5's routing, DeepSeek-V3's too (`n_routed_experts`, or the alias
  `num_local_experts` / `num_experts`): sigmoid scores with a correction bias over n_group
  groups, n_shared_experts ungated shared experts as one MLP moe_intermediate_size *
  n_shared_experts wide, and its first first_k_dense_replace layers dense (our
  mlp_only_layers); `defaults`: the class's, for fields config.json leaves out."""
  for alias in ("num_local_experts", "num_experts"):
    if d.get("n_routed_experts") is None and d.get(alias) is not None:
      d = {**d, "n_routed_experts": d[alias]}
  get = lambda key: _get(d, key, defaults.get(key, ...))  # noqa: E731
  for key in ("n_shared_experts", "first_k_dense_replace"):
    if not isinstance(get(key), int) or get(key) < 0:
      raise ValueError(f"{CONFIG_FILE}: {key}: expected an int >= 0, got {get(key)!r}")
  width = int(get("moe_intermediate_size"))
  dense = min(get("first_k_dense_replace"), int(_get(d, "num_hidden_layers")))
  return dict(num_experts=int(get("n_routed_experts")),
              num_experts_per_tok=int(get("num_experts_per_tok")),
              moe_intermediate_size=width, norm_topk_prob=bool(get("norm_topk_prob")),
              mlp_only_layers=tuple(range(dense)),
              shared_expert_intermediate_size=width * get("n_shared_experts"),
              shared_expert_gated=False, router_scoring="sigmoid",
              expert_groups=int(get("n_group")), topk_groups=int(get("topk_group")),
              routed_scaling_factor=float(get("routed_scaling_factor")))


def _deepseek_moe_from_hf(d: Mapping[str, Any], arch: str) -> dict[str, Any]:
  """DeepSeek-V3's routing (GLM-4.5's) or DeepSeek-V2's: softmax scores, the top k of all
  experts (`topk_method` greedy) or of the topk_group groups holding the best single scores
  (group_limited_greedy), not renormalised, times routed_scaling_factor; config.json fields
  the class ignores are refused where they say otherwise."""
  scoring = d.get("scoring_func")
  if scoring is not None and scoring != _DEEPSEEK_SCORING[arch]:
    raise ValueError(f"{CONFIG_FILE}: scoring_func: expected {_DEEPSEEK_SCORING[arch]!r} (what "
                     f"transformers' {_HF_CLASS[arch]} computes), got {scoring!r}")
  defaults = _DEEPSEEK_DEFAULTS[arch]
  moe = _glm4_moe_from_hf(d, defaults)
  if arch == "deepseek_v3":
    return moe
  method = _get(d, "topk_method", defaults["topk_method"])
  if method not in ("greedy", "group_limited_greedy"):
    raise ValueError(f"{CONFIG_FILE}: topk_method: expected 'greedy' or "
                     f"'group_limited_greedy', got {method!r}")
  if moe["norm_topk_prob"]:
    raise ValueError(f"{CONFIG_FILE}: norm_topk_prob: expected false (transformers' "
                     "DeepseekV2ForCausalLM does not renormalise the top-k weights), got true")
  groups = method == "group_limited_greedy"
  return {**moe, "router_scoring": "softmax", "group_scoring": "max" if groups else "top2_sum",
          "expert_groups": moe["expert_groups"] if groups else 1,
          "topk_groups": moe["topk_groups"] if groups else 1}


def _mla_from_hf(d: Mapping[str, Any], arch: str) -> dict[str, Any]:
  """Latent attention's ModelConfig fields (head_dim: the q/k head width, nope + rope) of a
  DeepSeek config.json; a null q_lora_rank (V2-Lite) is a plain q_proj (0)."""
  defaults = _DEEPSEEK_DEFAULTS[arch]
  get = lambda key: _get(d, key, defaults[key])  # noqa: E731
  sizes = {}
  for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
    if not isinstance(get(key), int) or get(key) <= 0:
      raise ValueError(f"{CONFIG_FILE}: {key}: expected a positive int, got {get(key)!r}")
    sizes[key] = get(key)
  q_rank = d["q_lora_rank"] if "q_lora_rank" in d else defaults["q_lora_rank"]
  if q_rank is not None and (not isinstance(q_rank, int) or q_rank <= 0):
    raise ValueError(f"{CONFIG_FILE}: q_lora_rank: expected a positive int or null, got "
                     f"{q_rank!r}")
  return dict(head_dim=sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"],
              kv_lora_rank=sizes["kv_lora_rank"], q_lora_rank=q_rank or 0,
              qk_rope_head_dim=sizes["qk_rope_head_dim"], v_head_dim=sizes["v_head_dim"])


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """The config.json dict for a ModelConfig, readable by transformers 4.x and 5.x alike.

  It carries the RoPE settings both ways: 4.x's top-level `rope_theta`/`rope_scaling` and
  5.x's `rope_parameters` (5.x reads either, 4.x ignores the latter).
  """
  c = config
  arch, hf_class = c.architecture, _HF_CLASS[c.architecture]
  defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
  for field in _FAMILY_FIELDS:
    if arch == "glm4_moe" and field in _GLM4_MOE_FLAGS:
      continue  # either way, as config.json says
    want = _FAMILY[arch].get(field, defaults[field])
    if getattr(c, field) != want:
      raise ValueError(f"ModelConfig.{field}: {hf_class} needs {want!r}, got "
                       f"{getattr(c, field)!r}")
  gemma = arch in _GEMMA_DEFAULTS
  for field, needed in (("query_pre_attn_scalar", gemma),
                        ("rope_local_theta", arch in ("gemma3", "olmo3"))):
    if (getattr(c, field) is not None) != needed:
      raise ValueError(f"ModelConfig.{field}: {hf_class} needs "
                       f"{'a value' if needed else 'None'}, got {getattr(c, field)!r}")
  for field in ("attn_logit_softcapping", "final_logit_softcapping"):
    if getattr(c, field) is not None and not gemma:
      raise ValueError(f"ModelConfig.{field}: {hf_class} has no logit soft-capping, got "
                       f"{getattr(c, field)!r}")
  if c.partial_rotary_factor != 1 and arch not in ("phi3", "glm4", "glm4_moe"):
    raise ValueError(f"ModelConfig.partial_rotary_factor: {hf_class} turns every head dim, got "
                     f"{c.partial_rotary_factor}")
  granite = arch == "granite"
  for field in _GRANITE_FIELDS:
    default = None if field == "attention_multiplier" else 1.0
    if granite and getattr(c, field) is None:
      raise ValueError(f"ModelConfig.{field}: {hf_class} needs a value, got None")
    if not granite and getattr(c, field) != default:
      raise ValueError(f"ModelConfig.{field}: {hf_class} has no {field}, got "
                       f"{getattr(c, field)!r}")
  if c.nope_layers and arch != "smollm3":
    raise ValueError(f"ModelConfig.nope_layers: {hf_class} turns every layer by RoPE, got "
                     f"{list(c.nope_layers)}")
  if c.sliding_window is not None and arch in ("llama", "olmo2", "olmoe"):
    raise ValueError(f"ModelConfig.sliding_window: {hf_class} has no sliding window, got "
                     f"{c.sliding_window}")
  if (arch in ("mistral", "mixtral", "qwen3_moe", "phi3") and c.layer_types
      and "full_attention" in c.layer_types):
    raise ValueError(f"ModelConfig.layer_types: {hf_class} slides on every layer or none, got "
                     f"{list(c.layer_types)}")
  if c.num_experts and arch not in _MOE_ARCHS:
    raise ValueError(f"ModelConfig.num_experts: {hf_class} has no experts, got {c.num_experts}")
  if c.shared_expert_intermediate_size and arch not in ("qwen2_moe", "glm4_moe", *_MLA_ARCHS):
    raise ValueError(f"ModelConfig.shared_expert_intermediate_size: {hf_class} has no shared "
                     f"expert, got {c.shared_expert_intermediate_size}")
  if bool(c.kv_lora_rank) != (arch in _MLA_ARCHS):
    raise ValueError(f"ModelConfig.kv_lora_rank: {hf_class} "
                     f"{'needs' if arch in _MLA_ARCHS else 'has no'} latent attention, got "
                     f"{c.kv_lora_rank}")
  if arch in ("glm4_moe", *_MLA_ARCHS):
    _check_glm4_moe(c, hf_class)
  else:
    for field, want in _SOFTMAX_ROUTING.items():
      if getattr(c, field) != want:
        raise ValueError(f"ModelConfig.{field}: {hf_class} routes by softmax with one expert "
                         f"group, unscaled, its shared expert gated: needs {want!r}, got "
                         f"{getattr(c, field)!r}")
  if (c.moe_bias or c.swiglu_limit is not None) and arch != "gpt_oss":
    raise ValueError(f"ModelConfig.{'moe_bias' if c.moe_bias else 'swiglu_limit'}: "
                     f"{hf_class} has no expert biases or clamped SwiGLU, got "
                     f"{c.moe_bias if c.moe_bias else c.swiglu_limit!r}")
  if arch in ("mixtral", "gpt_oss", "olmoe"):
    _check_sparse_everywhere(c, hf_class)
  scaling = dict(c.rope_scaling) if c.rope_scaling else None
  rope = {"rope_type": "default", **(scaling or {}), "rope_theta": c.rope_theta}
  d = {
      "architectures": [hf_class],
      "model_type": _MODEL_TYPE.get(arch, arch),
      "vocab_size": c.vocab_size,
      "hidden_size": c.hidden_size,
      "intermediate_size": c.intermediate_size,
      "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads,
      "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": c.max_position_embeddings,
      "rms_norm_eps": c.rms_norm_eps,
      "tie_word_embeddings": c.tie_word_embeddings,
      "rope_theta": c.rope_theta,
      "rope_scaling": scaling,
      "rope_parameters": rope,
      "dtype": c.param_dtype,
      "torch_dtype": c.param_dtype,
      # Some classes' defaults (Phi3Config's pad 32000, SmolLM3Config's 128004, OLMo's eos
      # 50279) lie outside a small vocabulary; the ids a checkpoint really uses come as
      # extra_config (a trainer's export: its tokenizer's).
      "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
  }
  types = ["sliding_attention" if c.sliding_layer(i) else "full_attention"
           for i in range(c.num_layers)]
  if arch == "llama":
    d.update(attention_bias=False, mlp_bias=False)
  elif arch == "mistral":
    d.update(sliding_window=c.sliding_window)
  elif granite:
    d.update(attention_bias=False, mlp_bias=False,
             **{key: getattr(c, key) for key in _GRANITE_FIELDS})
  elif arch == "smollm3":
    d.update(attention_bias=False, mlp_bias=False, use_sliding_window=c.sliding_window is not None,
             sliding_window=c.sliding_window, layer_types=types,
             no_rope_layers=[int(i not in c.nope_layers) for i in range(c.num_layers)])
  elif arch == "glm4":
    d.update(attention_bias=True)
  elif arch == "phi3":  # 4.x reads this at the top level, 5.x inside rope_parameters too
    d.update(sliding_window=c.sliding_window)
    if scaling and scaling["rope_type"] == "longrope":
      d.update(original_max_position_embeddings=scaling["original_max_position_embeddings"])
  elif arch in ("olmo2", "olmo3"):
    d.update(attention_bias=False)
  elif arch == "olmoe":
    d.update(attention_bias=False, clip_qkv=None, num_experts=c.num_experts,
             num_experts_per_tok=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob)
  elif arch == "mixtral":
    d.update(sliding_window=c.sliding_window, num_local_experts=c.num_experts,
             num_experts_per_tok=c.num_experts_per_tok, router_jitter_noise=0.0)
  elif arch == "qwen3_moe":
    d.update(use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window)
  elif arch == "gpt_oss":  # an unbounded window: transformers' default would be 128
    d.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
             swiglu_limit=c.swiglu_limit, swiglu_alpha=c.swiglu_alpha, attention_bias=True,
             sliding_window=c.sliding_window or c.max_position_embeddings, layer_types=types)
  elif arch in ("qwen2", "qwen2_moe", "qwen3"):
    sliding = c.sliding_window is not None
    d.update(use_sliding_window=sliding, sliding_window=c.sliding_window,
             max_window_layers=types.index("sliding_attention") if sliding else c.num_layers,
             layer_types=types if sliding else ["full_attention"] * c.num_layers)
  if arch in ("qwen2_moe", "qwen3_moe"):
    d.update({f: getattr(c, f) for f in _MOE_FIELDS}, mlp_only_layers=list(c.mlp_only_layers))
  if arch == "qwen2_moe":
    d.update(shared_expert_intermediate_size=c.shared_expert_intermediate_size, qkv_bias=True)
  if arch == "glm4_moe":  # no multi-token-prediction layers are written
    d.update(attention_bias=c.qkv_bias, use_qk_norm=c.qk_norm, n_routed_experts=c.num_experts,
             num_experts_per_tok=c.num_experts_per_tok,
             moe_intermediate_size=c.moe_intermediate_size,
             n_shared_experts=c.shared_expert_intermediate_size // c.moe_intermediate_size,
             norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor,
             n_group=c.expert_groups, topk_group=c.topk_groups,
             first_k_dense_replace=len(c.mlp_only_layers), num_nextn_predict_layers=0)
  if arch in _MLA_ARCHS:  # exported with interleaved rotary pairs; no MTP layers written
    d.update(_deepseek_to_hf(c))
  if arch in ("phi3", "glm4", "glm4_moe"):  # 4.x reads it at the top, 5.x in rope_parameters
    rope["partial_rotary_factor"] = c.partial_rotary_factor
    d.update(partial_rotary_factor=c.partial_rotary_factor)
  if arch in ("qwen3", "qwen3_moe") or gemma:
    d.update(attention_bias=False)
  if gemma:  # an unbounded window: transformers refuses a null beside sliding layer_types
    scalar = c.query_pre_attn_scalar
    d.pop("hidden_act")
    d.update(hidden_activation="gelu_pytorch_tanh",
             query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
             sliding_window=c.sliding_window or c.max_position_embeddings, layer_types=types,
             final_logit_softcapping=c.final_logit_softcapping,
             attn_logit_softcapping=c.attn_logit_softcapping,
             use_bidirectional_attention=False)
  if arch == "olmo3":  # an unbounded window: transformers' default would be 4096
    d.update(sliding_window=c.sliding_window or c.max_position_embeddings, layer_types=types)
  if arch in ("gemma3", "olmo3"):
    d.update(rope_parameters={"full_attention": rope,
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": c.rope_local_theta}})
  if arch == "gemma3":
    d.update(rope_local_base_freq=c.rope_local_theta)
  return d


# The routing of every MoE class but GLM-4.5's and DeepSeek's (ModelConfig fields).
_SOFTMAX_ROUTING = {"router_scoring": "softmax", "expert_groups": 1, "topk_groups": 1,
                    "routed_scaling_factor": 1.0, "shared_expert_gated": True,
                    "group_scoring": "top2_sum"}


def _check_glm4_moe(c: ModelConfig, hf_class: str) -> None:
  """Refuses, by field, a config GLM-4.5's or DeepSeek-V3's class cannot hold: experts after
  the first len(mlp_only_layers) layers, all of them, routed by biased sigmoid scores (V2's:
  softmax scores, not renormalised), beside an ungated shared expert a whole number of
  experts wide."""
  if not c.num_experts:
    raise ValueError(f"ModelConfig.num_experts: {hf_class} needs experts, got 0")
  dense = len(c.mlp_only_layers)
  v2 = c.architecture == "deepseek_v2"
  needs = {"router_scoring": "softmax" if v2 else "sigmoid", "shared_expert_gated": False,
           "decoder_sparse_step": 1, "mlp_only_layers": tuple(range(dense)),
           "sliding_window": None}
  needs.update({"norm_topk_prob": False} if v2 else {"group_scoring": "top2_sum"})
  for field, want in needs.items():
    if getattr(c, field) != want:
      raise ValueError(f"ModelConfig.{field}: {hf_class} needs {want!r} (dense first layers, "
                       f"then experts routed by {'softmax' if v2 else 'biased sigmoid'} "
                       f"scores), got {getattr(c, field)!r}")
  shared = c.shared_expert_intermediate_size
  if shared % c.moe_intermediate_size:
    raise ValueError(f"ModelConfig.shared_expert_intermediate_size: {hf_class} needs a "
                     f"multiple of moe_intermediate_size={c.moe_intermediate_size} (its "
                     f"n_shared_experts), got {shared}")


def _deepseek_to_hf(c: ModelConfig) -> dict[str, Any]:
  """A DeepSeek config.json's latent-attention and routing fields (head_dim as transformers
  writes it: the rotary part)."""
  d = dict(attention_bias=False, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank or None,
           qk_rope_head_dim=c.qk_rope_head_dim, qk_nope_head_dim=c.head_dim - c.qk_rope_head_dim,
           v_head_dim=c.v_head_dim, head_dim=c.qk_rope_head_dim, n_routed_experts=c.num_experts,
           num_experts_per_tok=c.num_experts_per_tok,
           moe_intermediate_size=c.moe_intermediate_size,
           n_shared_experts=c.shared_expert_intermediate_size // c.moe_intermediate_size,
           norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor,
           n_group=c.expert_groups, topk_group=c.topk_groups,
           first_k_dense_replace=len(c.mlp_only_layers))
  if c.architecture == "deepseek_v3":
    d.update(rope_interleave=True, num_nextn_predict_layers=0)
  else:
    d.update(mlp_bias=False, topk_method="group_limited_greedy" if c.expert_groups > 1
             else "greedy")
  return d


def _check_sparse_everywhere(c: ModelConfig, hf_class: str) -> None:
  """Refuses, by field, a config Mixtral, gpt-oss or OLMoE cannot hold: experts on every
  layer, as wide as intermediate_size, their top-k weights renormalised (OLMoE: either way;
  gpt-oss: with biases and the clamped SwiGLU)."""
  if not c.num_experts:
    raise ValueError(f"ModelConfig.num_experts: {hf_class} needs experts, got 0")
  needs = {"decoder_sparse_step": 1, "mlp_only_layers": (), "norm_topk_prob": True,
           "moe_intermediate_size": c.intermediate_size}
  if c.architecture == "olmoe":
    del needs["norm_topk_prob"]
  if c.architecture == "gpt_oss":
    needs["moe_bias"] = True
    if c.swiglu_limit is None:
      raise ValueError(f"ModelConfig.swiglu_limit: {hf_class} needs a value, got None")
  for field, want in needs.items():
    if getattr(c, field) != want:
      raise ValueError(f"ModelConfig.{field}: {hf_class} needs {want!r} (experts on every "
                       f"layer, intermediate_size wide, top-k renormalised), got "
                       f"{getattr(c, field)!r}")


def hf_tensor_names(config: ModelConfig) -> dict[str, tuple[str | tuple[str, ...], bool]]:
  """Our dotted param name -> (HF tensor name, whether the array is transposed between them).

  A param stacked over experts maps to a tuple of HF names, one per expert (its slices along
  axis 0, each transposed on its own), or (gpt-oss) to one stacked HF tensor; a param fused
  with others in one HF tensor maps to its `Rows` or `Columns` of that tensor.
  """
  names = {"embed.embedding": ("model.embed_tokens.weight", False),
           "norm.scale": ("model.norm.weight", False)}
  if not config.tie_word_embeddings:
    names["lm_head.kernel"] = ("lm_head.weight", True)
  arch = config.architecture
  mixtral, fused, fused_mlp = arch == "mixtral", arch == "phi3", arch in ("phi3", "glm4")
  q, kv, inner = (config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                  config.intermediate_size)
  for i in range(config.num_layers):
    ours, hf = f"layers.{i}", f"model.layers.{i}"
    if config.kv_lora_rank:
      names.update(_latent_attention_names(config, f"{ours}.attn", f"{hf}.self_attn"))
    for proj in (() if config.kv_lora_rank else ("o_proj",) if fused
                 else ("q_proj", "k_proj", "v_proj", "o_proj")):
      names[f"{ours}.attn.{proj}.kernel"] = (f"{hf}.self_attn.{proj}.weight", True)
    if fused:  # Phi-3: q, k, v stacked in qkv_proj
      qkv = f"{hf}.self_attn.qkv_proj.weight"
      for proj, start, stop in (("q_proj", 0, q), ("k_proj", q, q + kv),
                                ("v_proj", q + kv, q + 2 * kv)):
        names[f"{ours}.attn.{proj}.kernel"] = (Rows(qkv, start, stop), True)
    if fused_mlp:  # gate and up stacked in gate_up_proj
      gate_up = f"{hf}.mlp.gate_up_proj.weight"
      names[f"{ours}.mlp.gate_proj.kernel"] = (Rows(gate_up, 0, inner), True)
      names[f"{ours}.mlp.up_proj.kernel"] = (Rows(gate_up, inner, 2 * inner), True)
    if config.qkv_bias:
      for proj in ("q_proj", "k_proj", "v_proj"):
        names[f"{ours}.attn.{proj}.bias"] = (f"{hf}.self_attn.{proj}.bias", False)
    if config.attention_out_bias:
      names[f"{ours}.attn.o_proj.bias"] = (f"{hf}.self_attn.o_proj.bias", False)
    if config.attention_sinks:
      names[f"{ours}.attn.sinks"] = (f"{hf}.self_attn.sinks", False)
    if config.qk_norm:
      for norm in ("q_norm", "k_norm"):
        names[f"{ours}.attn.{norm}.scale"] = (f"{hf}.self_attn.{norm}.weight", False)
    if config.moe_layer(i) and arch == "gpt_oss":
      names.update(_gpt_oss_moe_names(ours, f"{hf}.mlp"))
    elif config.moe_layer(i):
      moe = f"{hf}.block_sparse_moe" if mixtral else f"{hf}.mlp"
      names[f"{ours}.mlp.router.kernel"] = (f"{moe}.gate.weight", True)
      if config.router_scoring == "sigmoid":
        names[f"{ours}.mlp.correction_bias"] = (f"{moe}.gate.e_score_correction_bias", False)
      shared = (f"{moe}.shared_experts" if arch in ("glm4_moe", *_MLA_ARCHS)
                else f"{moe}.shared_expert")
      for proj in ("gate_proj", "up_proj", "down_proj"):
        hf_proj = _MIXTRAL_EXPERTS[proj] if mixtral else proj
        names[f"{ours}.mlp.experts.{proj}"] = (tuple(
            f"{moe}.experts.{e}.{hf_proj}.weight" for e in range(config.num_experts)), True)
        if config.shared_expert_intermediate_size:
          names[f"{ours}.mlp.shared_expert.{proj}.kernel"] = (f"{shared}.{proj}.weight", True)
      if config.shared_expert_intermediate_size and config.shared_expert_gated:
        names[f"{ours}.mlp.shared_expert_gate.kernel"] = (f"{moe}.shared_expert_gate.weight", True)
    else:
      for proj in ("down_proj",) if fused_mlp else ("gate_proj", "up_proj", "down_proj"):
        names[f"{ours}.mlp.{proj}.kernel"] = (f"{hf}.mlp.{proj}.weight", True)
    if config.post_norms:  # OLMo: post_attention_layernorm norms the attention output.
      names[f"{ours}.attn_out_norm.scale"] = (f"{hf}.post_attention_layernorm.weight", False)
      names[f"{ours}.mlp_out_norm.scale"] = (f"{hf}.post_feedforward_layernorm.weight", False)
      continue
    names[f"{ours}.input_norm.scale"] = (f"{hf}.input_layernorm.weight", False)
    if arch == "glm4":  # sandwich norms under GLM's names: post_attention_layernorm is pre-MLP
      names[f"{ours}.attn_out_norm.scale"] = (f"{hf}.post_self_attn_layernorm.weight", False)
      names[f"{ours}.post_attn_norm.scale"] = (f"{hf}.post_attention_layernorm.weight", False)
      names[f"{ours}.mlp_out_norm.scale"] = (f"{hf}.post_mlp_layernorm.weight", False)
    elif config.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output.
      names[f"{ours}.attn_out_norm.scale"] = (f"{hf}.post_attention_layernorm.weight", False)
      names[f"{ours}.post_attn_norm.scale"] = (f"{hf}.pre_feedforward_layernorm.weight", False)
      names[f"{ours}.mlp_out_norm.scale"] = (f"{hf}.post_feedforward_layernorm.weight", False)
    else:
      names[f"{ours}.post_attn_norm.scale"] = (f"{hf}.post_attention_layernorm.weight", False)
  return names


def _latent_attention_names(config: ModelConfig, ours: str, hf: str
                            ) -> dict[str, tuple[str, bool]]:
  """One layer's latent-attention params under DeepSeek's names (the latent norms are our
  q_a_norm and kv_a_norm)."""
  projs = ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
  projs += ["q_a_proj", "q_b_proj"] if config.q_lora_rank else ["q_proj"]
  names = {f"{ours}.{p}.kernel": (f"{hf}.{p}.weight", True) for p in projs}
  for norm in ("q_a", "kv_a") if config.q_lora_rank else ("kv_a",):
    names[f"{ours}.{norm}_norm.scale"] = (f"{hf}.{norm}_layernorm.weight", False)
  return names


def _gpt_oss_moe_names(ours: str, moe: str) -> dict[str, tuple[Any, bool]]:
  """gpt-oss's router (with bias) and its experts stacked in [E, in, out] tensors, gate and
  up interleaved in gate_up_proj (columns 0, 2, ... and 1, 3, ...), biases alike."""
  experts, gate_up = f"{moe}.experts", f"{moe}.experts.gate_up_proj"
  return {f"{ours}.mlp.router.kernel": (f"{moe}.router.weight", True),
          f"{ours}.mlp.router.bias": (f"{moe}.router.bias", False),
          f"{ours}.mlp.experts.gate_proj": (Columns(gate_up, 0, 2), False),
          f"{ours}.mlp.experts.up_proj": (Columns(gate_up, 1, 2), False),
          f"{ours}.mlp.experts.down_proj": (f"{experts}.down_proj", False),
          f"{ours}.mlp.experts.gate_bias": (Columns(f"{gate_up}_bias", 0, 2), False),
          f"{ours}.mlp.experts.up_bias": (Columns(f"{gate_up}_bias", 1, 2), False),
          f"{ours}.mlp.experts.down_bias": (f"{experts}.down_proj_bias", False)}


def read_json(file: str) -> dict[str, Any]:
  """The JSON object in `file` (a config.json, an index); one that is not is a ValueError
  naming the file, where json's own error names none."""
  with open(file, encoding="utf-8") as f:
    try:
      d = json.load(f)
    except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
      raise ValueError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(d, dict):
    raise ValueError(f"{file}: expected a JSON object at the top level, got "
                     f"{type(d).__name__}")
  return d


def read_hf_config(path: str) -> ModelConfig:
  """ModelConfig of the HF checkpoint folder at `path`."""
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no {CONFIG_FILE} in HF checkpoint folder {path!r}")
  return config_from_hf(read_json(file))


def model_config_from(cfg, vocab_size: int, init_from_hf: str = "",
                      max_sequence: int = 0) -> ModelConfig:
  """ModelConfig from the `model` config block (vocab_size 0 takes the tokenizer's), or
  from the HF checkpoint to start from, keeping only the block's dtypes and run settings
  (LoRA, expert_parallel). A LongRoPE model's factors are fixed by `max_sequence` (> 0: the
  run's longest prompt + response), so that the trainer and the workers turn every token
  alike."""
  if init_from_hf:
    run = {k: cfg[k] for k in _RUN_FIELDS if k in cfg}
    config = read_hf_config(init_from_hf).replace(param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                                                  **run)
    if config.vocab_size < vocab_size:
      raise ValueError(f"init_from_hf: the model's vocab_size {config.vocab_size} is smaller "
                       f"than the tokenizer's {vocab_size}")
    return _fix_long_factors(config, max_sequence)
  d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
  if d.get("vocab_size", 0) in (0, None):
    d["vocab_size"] = vocab_size
  elif d["vocab_size"] < vocab_size:
    raise ValueError(f"model.vocab_size: expected >= the tokenizer's {vocab_size}, got "
                     f"{d['vocab_size']}")
  try:
    return _fix_long_factors(ModelConfig.from_dict(d), max_sequence)
  except TypeError as e:  # missing shape fields
    raise ValueError(f"model: {e}; give the shape in the model block or init_from_hf naming "
                     f"a Hugging Face checkpoint") from None


# The block's settings of the run, not of the checkpoint's model: kept over init_from_hf.
_RUN_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dtype", "expert_parallel")


def longest_sequence(recipe) -> int:
  """The longest prompt + response an RL recipe runs (rl.max_prompt_tokens +
  worker.max_new_tokens), 0 for other recipes: what fixes LongRoPE's factors alike for its
  trainer and its workers."""
  if "rl" not in recipe:
    return 0
  return int(recipe.rl.max_prompt_tokens) + int(recipe.worker.max_new_tokens)


def _fix_long_factors(config: ModelConfig, max_sequence: int) -> ModelConfig:
  """config with LongRoPE's long factors fixed on iff max_sequence tokens outgrow the
  original context (transformers' rule for one forward of that length)."""
  s = config.rope_scaling
  if max_sequence <= 0 or s is None or s["rope_type"] != "longrope":
    return config
  return config.replace(
      rope_long_factors=max_sequence > s["original_max_position_embeddings"])


@contextlib.contextmanager
def _safetensors(file: str):
  """safe_open(file); a file safetensors cannot read (a download cut short, not safetensors)
  is a ValueError naming it, not safetensors' own error type."""
  try:
    f = safe_open(file, framework="numpy")
  except SafetensorError as e:
    raise ValueError(f"{file}: not a readable safetensors file ({e}); a download cut short? "
                     "fetch it again") from None
  with f:
    yield f


def _tensor_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file holding it (single file first, as transformers does)."""
  single = os.path.join(path, SINGLE_FILE)
  if os.path.isfile(single):
    with _safetensors(single) as f:
      return {name: single for name in f.keys()}
  index = os.path.join(path, INDEX_FILE)
  if not os.path.isfile(index):
    raise FileNotFoundError(f"HF checkpoint folder {path!r} has neither {SINGLE_FILE} "
                            f"nor {INDEX_FILE}{_torch_weights_hint(path)}")
  weight_map = read_json(index).get("weight_map")
  if not isinstance(weight_map, dict):
    raise ValueError(f"{index}: weight_map: expected a dict of tensor -> file, got {weight_map!r}")
  return {name: os.path.join(path, file) for name, file in weight_map.items()}


# The weight files of torch-pickle checkpoints (save_pretrained(safe_serialization=False)).
_TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def _torch_weights_hint(path: str) -> str:
  """What to do about a folder holding torch-pickle weights instead of safetensors, or ''."""
  found = [f for f in _TORCH_WEIGHTS if os.path.isfile(os.path.join(path, f))]
  if not found:
    return ""
  return (f" (its weights are in {found[0]}, a torch pickle, which is not read: save them as "
          "safetensors, e.g. transformers' model.save_pretrained(folder) with "
          "safe_serialization=True)")


def _language_model_view(files: Mapping[str, str], keep: Sequence[str] = ()
                         ) -> dict[str, tuple[str, str]]:
  """{causal-LM tensor name: (file, stored name)}. An image-text checkpoint (Gemma 3 4B and
  up) stores its language model under `language_model.model.` (or `model.language_model.`);
  only those tensors are seen, under the text-only model's names, and the `keep` ones (a
  classifier's `score.weight`) under their own; the vision tower's are left out. Any other
  checkpoint maps to itself."""
  for prefix in ("language_model.model.", "model.language_model."):
    if any(name.startswith(prefix) for name in files):
      view = {"model." + name[len(prefix):]: (file, name)
              for name, file in files.items() if name.startswith(prefix)}
      for head in ("language_model.lm_head.weight", "lm_head.weight"):
        if head in files:
          view["lm_head.weight"] = (files[head], head)
      view.update({name: (files[name], name) for name in keep if name in files})
      return view
  return {name: (file, name) for name, file in files.items()}


def _open_tensors(view: Mapping[str, tuple[str, str]], wanted: list[str]
                  ) -> Iterator[tuple[str, Any, str]]:
  """(name, its open safetensors file, its stored name) for each wanted tensor, opening each
  file once; an error names a file the index names that is missing or lacks the tensor."""
  by_file: dict[str, list[str]] = {}
  for name in wanted:
    by_file.setdefault(view[name][0], []).append(name)
  for file, names in by_file.items():
    if not os.path.isfile(file):
      raise FileNotFoundError(f"tensor {view[names[0]][1]!r}: file {file!r} named by "
                              f"{INDEX_FILE} does not exist")
    with _safetensors(file) as f:
      present = set(f.keys())
      for name in names:
        stored = view[name][1]
        if stored not in present:
          raise ValueError(f"tensor {stored!r}: {INDEX_FILE} places it in {file!r}, "
                           "which does not hold it")
        yield name, f, stored


def _read_tensors(view: Mapping[str, tuple[str, str]], wanted: list[str]
                  ) -> Iterator[tuple[str, np.ndarray]]:
  """(name, array) for each wanted tensor, opening each file once; FP8 ones, which
  safetensors' numpy reader refuses, as ml_dtypes' FP8 types."""
  raw = RawTensors()
  for name, f, stored in _open_tensors(view, wanted):
    if f.get_slice(stored).get_dtype() in FP8_TYPES:
      yield name, raw.read(view[name][0], stored)
    else:
      yield name, f.get_tensor(stored)


# safetensors' dtype codes under numpy's names (as the loader reads the tensors).
_SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16",
                       "I16": "int16", "U32": "uint32", "I32": "int32", "U64": "uint64",
                       "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
                       "F64": "float64", **{code: t.name for code, t in FP8_TYPES.items()}}


def _header_shapes(view: Mapping[str, tuple[str, str]], wanted: list[str]
                   ) -> dict[str, tuple[tuple[int, ...], str]]:
  """(shape, numpy dtype name) of each wanted tensor, from its file's header: no data read."""
  out = {}
  for name, f, stored in _open_tensors(view, wanted):
    header = f.get_slice(stored)
    dtype = header.get_dtype()
    out[name] = (tuple(header.get_shape()), _SAFETENSORS_DTYPES.get(dtype, dtype))
  return out


def check_hf_checkpoint(path: str) -> ModelConfig:
  """The ModelConfig of the HF checkpoint folder `path`, once its safetensors' headers (no
  weights read) name every tensor that config needs and no other, in files that exist, each
  of the shape the loader requires: what load_hf_checkpoint would refuse for its config or
  tensors, found before loading."""
  config = read_hf_config(path)
  files = _language_model_view(_tensor_files(path))
  layout = _fp8_layout_of(path)
  needed, stored, quantized = _needed_tensors(path, config, files, layout)
  for file in sorted({file for file, _ in files.values()}):
    if not os.path.isfile(file):
      raise FileNotFoundError(f"HF checkpoint {path!r}: file {file!r} named by {INDEX_FILE} "
                              "does not exist")
  want = _tensor_shapes(_param_shapes(config), needed)
  try:
    headers = _header_shapes(files, sorted(stored))
    for name in sorted(want):
      _check_shape(name, want[name], _shape_as_read(name, headers, quantized, layout))
  except ValueError as e:
    raise ValueError(f"HF checkpoint {path!r}: {e}") from None
  return config


def _shape_as_read(name: str, headers: Mapping[str, tuple[tuple[int, ...], str]],
                   quantized: Mapping[str, str], layout: Fp8Layout | None
                   ) -> tuple[int, ...]:
  """The shape the loader reads tensor `name` as, from `headers`: a quantized one's once
  dequantized (a ValueError names one whose parts do not fit its format, or an FP8 tensor
  without its scale)."""
  kind = quantized.get(name)
  if kind is None:
    _check_unscaled(name, headers[name][1])
    return headers[name][0]
  try:
    if kind == "mxfp4":
      return mxfp4_shape(headers[f"{name}_blocks"], headers[f"{name}_scales"])
    weight = headers[name]
    return check_fp8(weight, headers[name + layout.suffix], layout.block_for(weight[0]))
  except ValueError as e:
    raise ValueError(f"tensor {name!r}: {e}") from None


def _check_unscaled(name: str, dtype: str) -> None:
  """A ValueError for tensor `name` stored in an 8-bit float type without its scale."""
  if dtype in {t.name for t in FP8_TYPES.values()}:
    raise ValueError(f"tensor {name!r}: stored as {dtype} without its scale (a quant_method "
                     f"'fp8' checkpoint's {name + '_scale_inv'!r}, compressed-tensors' "
                     f"{name + '_scale'!r}) to dequantize it by")


def _fp8_layout_of(path: str) -> Fp8Layout | None:
  """How the FP8 weights of the checkpoint at `path` carry their scales (its config.json's
  quantization_config; None: it holds no FP8)."""
  return fp8_layout(read_json(os.path.join(path, CONFIG_FILE)).get(QUANTIZATION_FIELD) or {})


def _tensor_shapes(shapes: Mapping[str, tuple[int, ...]], needed: Mapping[str, list]
                   ) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> the shape the loader requires of it as read, from our params'
  `shapes` and `_needed_tensors`' map: its param's (reversed where transposed), one
  expert's slice of a stacked param, or a whole fused tensor (Rows: every part's rows by
  the params' input; Columns: the params' last axis `step` times)."""
  want = {}
  for hf, parts in needed.items():
    ours, part, transposed = parts[0]
    shape = shapes[ours]
    if isinstance(part, Rows):  # [sum of rows, in] HF-side
      want[hf] = (max(p.stop for _, p, _ in parts), *shape[:-1][::-1])
    elif isinstance(part, Columns):
      want[hf] = (*shape[:-1], shape[-1] * part.step)
    else:
      shape = shape[1:] if isinstance(part, int) else shape
      want[hf] = shape[::-1] if transposed else shape
  return want


def _check_shape(name: str, want: tuple[int, ...], got: Sequence[int]) -> None:
  """The loader's and the check's refusal of a tensor of another shape than `want`."""
  if tuple(got) != want:
    raise ValueError(f"tensor {name!r}: expected shape {want}, got {tuple(got)}")


def _needed_tensors(path: str, config: ModelConfig, files: Mapping[str, tuple[str, str]],
                    layout: Fp8Layout | None, extra: Sequence[str] = ()
                    ) -> tuple[dict[str, list], set[str], dict[str, str]]:
  """(HF name -> [(our param, its expert's index in a stacked param, its Rows or Columns of a
  fused tensor, or None, transposed)], the stored names to read, the quantized names ->
  'mxfp4' or 'fp8') for `config` over the checkpoint's `files` (FP8 scales as `layout`,
  `_fp8_layout_of`); a ValueError names a missing or unexpected tensor."""
  needed: dict[str, list] = {}
  for ours, (hf, transposed) in hf_tensor_names(config).items():
    if isinstance(hf, (Rows, Columns)):
      needed.setdefault(hf.name, []).append((ours, hf, transposed))
    elif isinstance(hf, tuple):
      for e, name in enumerate(hf):
        needed.setdefault(name, []).append((ours, e, transposed))
    else:
      needed.setdefault(hf, []).append((ours, None, transposed))
  for name in extra:
    needed[name] = [(name, None, False)]
  # Quantized tensors, dequantized as read: MXFP4 (gpt-oss) stored as `_blocks` and
  # `_scales`; FP8 as itself beside its scale (`layout`).
  fp8 = layout is not None
  quantized = {}
  for name in needed:
    if name not in files and f"{name}_blocks" in files and f"{name}_scales" in files:
      quantized[name] = "mxfp4"
    elif fp8 and name in files and name + layout.suffix in files:
      quantized[name] = "fp8"
  parts = {"mxfp4": ("_blocks", "_scales"), "fp8": ("", layout.suffix if fp8 else "")}
  stored = {f"{n}{part}" for n in needed for part in parts.get(quantized.get(n), ("",))}
  missing = [name for name in needed if name not in files and name not in quantized]
  if missing:
    raise ValueError(f"HF checkpoint {path!r}: missing tensor {missing[0]!r} "
                     f"({len(missing)} missing in all)")
  def ignorable(name):
    return (_IGNORABLE.fullmatch(name) or _mtp_layer(name, config)
            or (config.tie_word_embeddings and name == "lm_head.weight")
            or (fp8 and _ACTIVATION_SCALE.fullmatch(name)))

  unexpected = sorted(n for n in set(files) - stored if not ignorable(n))
  if unexpected:
    raise ValueError(f"HF checkpoint {path!r}: unexpected tensor {unexpected[0]!r} "
                     f"({len(unexpected)} unexpected in all) for a {config.architecture} config")
  return needed, stored, quantized


# Static FP8 activation scales: for FP8 matmuls, which we do not run (activations stay bf16).
_ACTIVATION_SCALE = re.compile(r".+\.(input_scale|activation_scale)")


def _mtp_layer(name: str, config: ModelConfig) -> bool:
  """Whether tensor `name` is in a GLM-4.5 or DeepSeek-V3 multi-token-prediction layer
  (`model.layers.{n}.`, n >= num_hidden_layers): speculative decoding's, which transformers
  skips on load too."""
  match = re.match(r"model\.layers\.(\d+)\.", name)
  return (config.architecture in ("glm4_moe", "deepseek_v3") and match is not None
          and int(match[1]) >= config.num_layers)


def load_hf_params(path: str, config: ModelConfig, extra: Sequence[str] = ()
                   ) -> dict[str, np.ndarray]:
  """Our flat params (host numpy, config.param_dtype) from the safetensors at `path`.

  Every tensor the config needs must be there and nothing else may be, except rotary
  `inv_freq` buffers, a tied checkpoint's redundant `lm_head.weight`, an image-text
  checkpoint's vision tensors and GLM-4.5's multi-token-prediction layers. Per-expert
  tensors are stacked into their param. `extra` names tensors beyond the language model's
  (a reward model's `score.weight`): each must be there too, and comes back as stored,
  under its own name.
  """
  files = _language_model_view(_tensor_files(path), keep=extra)
  layout = _fp8_layout_of(path)
  needed, stored, quantized = _needed_tensors(path, config, files, layout, extra)
  dtype = NP_DTYPES[config.param_dtype]
  shapes = _param_shapes(config)
  want = _tensor_shapes(shapes, {hf: parts for hf, parts in needed.items() if hf not in extra})
  flat, experts = {}, {}
  tensors = _read_tensors(files, sorted(stored))
  for hf, full in _dequantized(tensors, quantized, layout, dtype):
    if hf in extra:
      flat[hf] = np.ascontiguousarray(full.astype(dtype, copy=False))
      continue
    _check_shape(hf, want[hf], full.shape)  # so each part fits: its range is the config's
    for ours, part, transposed in needed[hf]:
      if isinstance(part, Rows):
        array = full[part.start:part.stop]
      elif isinstance(part, Columns):
        array = full[..., part.start::part.step]
      else:
        array = full
      array = (array.T if transposed else array).astype(dtype, copy=False)
      if not isinstance(part, int):
        flat[ours] = np.ascontiguousarray(array)
        continue
      parts = experts.setdefault(ours, {})
      parts[part] = array
      if len(parts) == shapes[ours][0]:  # stacked once its last expert is read
        flat[ours] = np.stack([parts[e] for e in range(len(parts))])
        del experts[ours]
  if config.architecture == "glm4":
    _permute_rotary(flat, config, inverse=False)
  if config.kv_lora_rank:
    _permute_latent_rotary(flat, config, interleaved=_rope_interleaved(path, config),
                           inverse=False)
  return flat


def _dequantized(tensors: Iterator[tuple[str, np.ndarray]], quantized: Mapping[str, str],
                 layout: Fp8Layout | None, dtype) -> Iterator[tuple[str, np.ndarray]]:
  """`tensors` with the parts of each quantized tensor (`quantized`: name -> 'mxfp4' or
  'fp8'; FP8 scales as `layout` says) replaced by (name, its weights dequantized to
  `dtype`)."""
  parts_of = {"mxfp4": ("_blocks", "_scales"), "fp8": ("", layout.suffix if layout else "")}
  owner = {f"{base}{part}": (base, part) for base, kind in quantized.items()
           for part in parts_of[kind]}
  pending: dict[str, dict[str, np.ndarray]] = {}
  for name, array in tensors:
    if name not in owner:
      _check_unscaled(name, array.dtype.name)
      yield name, array
      continue
    base, part = owner[name]
    parts = pending.setdefault(base, {})
    parts[part] = array
    if len(parts) < 2:
      continue
    del pending[base]
    try:
      if quantized[base] == "mxfp4":
        yield base, dequantize_mxfp4(parts["_blocks"], parts["_scales"], dtype)
      else:
        weight = parts[""]
        yield base, dequantize_fp8(weight, parts[layout.suffix],
                                   layout.block_for(weight.shape), dtype)
    except ValueError as e:
      raise ValueError(f"tensor {base!r}: {e}") from None


def _permute_rotary(flat: dict, config: ModelConfig, *, inverse: bool) -> None:
  """GLM-4's interleaved RoPE as our rotate-half RoPE, in place: each head's rotary dims of
  the q and k projections (kernels' output channels, biases) reordered from pairs (2j,
  2j + 1) to halves (j, j + r/2), so that our rotation of the same positions gives the same
  q.k scores; `inverse` restores the checkpoint's order for export."""
  r, d = config.rotary_dim, config.head_dim
  order = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2), np.arange(r, d)])
  if inverse:
    order = np.argsort(order)
  for name, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
    index = (np.arange(heads)[:, None] * d + order[None, :]).reshape(-1)
    for i in range(config.num_layers):
      for kind in ("kernel", "bias"):
        key = f"layers.{i}.attn.{name}.{kind}"
        if key in flat:
          flat[key] = np.ascontiguousarray(np.asarray(flat[key])[..., index])


def _rope_interleaved(path: str, config: ModelConfig) -> bool:
  """Whether the DeepSeek checkpoint at `path` turns interleaved rotary pairs: V2 always, V3
  as its config.json's rope_interleave says (transformers' default: true)."""
  if config.architecture != "deepseek_v3":
    return True
  return bool(read_json(os.path.join(path, CONFIG_FILE)).get("rope_interleave", True))


def _permute_latent_rotary(flat: dict, config: ModelConfig, *, interleaved: bool,
                           inverse: bool) -> None:
  """DeepSeek's latent attention in our layout, in place: each head's query channels from
  [nope, rope] to [rope, nope] (our RoPE turns leading dims) and, `interleaved`, the rotary
  dims of the query and of kv_a_proj_with_mqa's shared key from pairs (2j, 2j + 1) to halves
  (j, j + r/2), so that the same q.k scores come out; `inverse` restores the checkpoint's
  order for export."""
  r, d, rank = config.qk_rope_head_dim, config.head_dim, config.kv_lora_rank
  rope = (np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]) if interleaved
          else np.arange(r))
  q_order = np.concatenate([d - r + rope, np.arange(d - r)])
  kv_order = np.concatenate([np.arange(rank), rank + rope])
  if inverse:
    q_order, kv_order = np.argsort(q_order), np.argsort(kv_order)
  q_index = (np.arange(config.num_heads)[:, None] * d + q_order[None, :]).reshape(-1)
  q_proj = "q_b_proj" if config.q_lora_rank else "q_proj"
  for i in range(config.num_layers):
    for key, index in ((f"layers.{i}.attn.{q_proj}.kernel", q_index),
                       (f"layers.{i}.attn.kv_a_proj_with_mqa.kernel", kv_order)):
      flat[key] = np.ascontiguousarray(np.asarray(flat[key])[..., index])


def _abstract_params(config: ModelConfig):
  """(graphdef, state, {dotted name: Param}) of a Transformer built without allocating it."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
  return graphdef, state, {".".join(str(p) for p in path): var
                           for path, var in nnx.to_flat_state(state)}


def _param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  return {name: tuple(var.get_value().shape) for name, var in _abstract_params(config)[2].items()}


def load_hf_checkpoint(path: str, dtype: str = "float32", *, compute_dtype: str | None = None,
                       mesh: jax.sharding.Mesh | None = None) -> Transformer:
  """The Transformer stored in the HF checkpoint folder `path`; `model.config` is its config.

  `dtype` sets the param dtype ("float32" or "bfloat16"), `compute_dtype` the activation
  dtype (default: the same). The full model is never initialised: each tensor goes from
  the file straight into its param, and with a `mesh` straight into its sharding.
  """
  dtype = dtype_name(dtype)
  compute = dtype if compute_dtype is None else dtype_name(compute_dtype, "compute_dtype")
  config = read_hf_config(path).replace(param_dtype=dtype, dtype=compute)
  return place_params(config, load_hf_params(path, config), mesh)


def place_params(config: ModelConfig, flat: dict[str, np.ndarray],
                 mesh: jax.sharding.Mesh | None = None) -> Transformer:
  """The Transformer of `config` holding `flat` (host arrays under our param names, popped
  as each goes to its device, or with a `mesh` straight into its sharding)."""
  graphdef, state, variables = _abstract_params(config)
  for name, var in variables.items():
    array = flat.pop(name)  # drop each host copy once it is on device
    if mesh is None:
      var.set_value(jax.numpy.asarray(array))
    else:
      spec = fit_spec(jax.sharding.PartitionSpec(*var.get_metadata()["out_sharding"]),
                      array.shape, mesh)
      var.set_value(jax.device_put(array, jax.sharding.NamedSharding(mesh, spec)))
  return nnx.merge(graphdef, state)


def save_hf_checkpoint(model: Transformer, path: str, *, dtype: str | None = None,
                       quantization: str = "", max_shard_bytes: int = 5 * 2**30,
                       extra_config: Mapping[str, Any] | None = None) -> None:
  """Write `model` as an HF checkpoint folder (config.json + safetensors) for transformers/vLLM.

  `dtype` converts the weights (default: the model's param dtype). `quantization` "fp8"
  writes each layer's projections in block-scaled FP8 as DeepSeek-V3 ships (float8_e4m3fn,
  a weight_scale_inv per 128 x 128 block, `quant_method: fp8`: half a bf16 export, what
  vLLM and SGLang serve natively), the rest (embeddings, head, norms, routers) in `dtype`;
  "fp8_ue8m0" likewise with each scale a power of two, `scale_fmt: ue8m0`, as DeepSeek-V3.1
  ships (what DeepGEMM's Blackwell kernels take without requantizing). "mxfp4" (gpt-oss
  alone) writes its experts in MXFP4 as gpt-oss ships, a quarter of bf16.
  Above `max_shard_bytes`
  the tensors are split over numbered files with a `model.safetensors.index.json`.
  `extra_config` adds config.json fields our config does not hold (e.g. bos/eos token ids).
  Old safetensors files in `path` are removed first so no stale shard can be read back.
  LoRA adapters are merged into their kernels (W + A @ B * alpha / rank).
  """
  config: ModelConfig = model.config
  dtype = config.param_dtype if dtype is None else dtype_name(dtype)
  check_quantization(quantization, config.architecture)
  flat = flatten_params(model)
  if config.lora_rank:
    flat, config = merge_adapters(flat, config)
  names = hf_tensor_names(config)
  if set(flat) != set(names):
    odd = sorted(set(flat) ^ set(names))
    raise ValueError(f"model params do not match its config: e.g. {odd[0]!r}")
  if config.architecture == "glm4" or config.kv_lora_rank:
    flat = {k: np.asarray(jax.device_get(v)) for k, v in flat.items()}
  if config.architecture == "glm4":
    _permute_rotary(flat, config, inverse=True)
  if config.kv_lora_rank:
    _permute_latent_rotary(flat, config, interleaved=True, inverse=True)
  tensors, fused, interleaved = {}, {}, {}
  for ours, (hf, transposed) in names.items():
    array = np.asarray(jax.device_get(flat[ours])).astype(NP_DTYPES[dtype], copy=False)
    if isinstance(hf, Rows):
      fused.setdefault(hf.name, []).append((hf.start, array.T if transposed else array))
      continue
    if isinstance(hf, Columns):
      interleaved.setdefault(hf.name, []).append((hf, array))
      continue
    parts = zip(hf, array) if isinstance(hf, tuple) else [(hf, array)]  # experts: axis 0
    for name, part in parts:
      tensors[name] = np.ascontiguousarray(part.T if transposed else part)
  for name, parts in fused.items():
    tensors[name] = np.ascontiguousarray(  # safetensors writes the buffer as if C-ordered
        np.concatenate([a for _, a in sorted(parts, key=lambda p: p[0])]))
  for name, parts in interleaved.items():
    first = parts[0][1]
    full = np.empty((*first.shape[:-1], first.shape[-1] * parts[0][0].step), first.dtype)
    for columns, array in parts:
      full[..., columns.start::columns.step] = array
    tensors[name] = full
  quantization_config = (_mxfp4_quantized(tensors) if quantization == "mxfp4" else
                         _fp8_quantized(tensors, quantization) if quantization else None)

  os.makedirs(path, exist_ok=True)
  for f in os.listdir(path):
    if f.endswith(".safetensors") or f == INDEX_FILE:
      os.remove(os.path.join(path, f))
  shards = _split_shards(tensors, max_shard_bytes)
  metadata = {"format": "pt"}
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, SINGLE_FILE), metadata=metadata)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(path, file), metadata=metadata)
      weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    _write_json(os.path.join(path, INDEX_FILE), index)
  hf_config = config_to_hf(config.replace(param_dtype=dtype))
  if quantization_config:
    hf_config[QUANTIZATION_FIELD] = quantization_config
  hf_config.update(extra_config or {})
  _write_json(os.path.join(path, CONFIG_FILE), hf_config)


QUANTIZATIONS = ("", "fp8", "fp8_ue8m0", "mxfp4")


def check_quantization(quantization: str, architecture: str) -> None:
  """ValueError naming `quantization` unless save_hf_checkpoint writes a model of
  `architecture` so: FP8 the projections of any but gpt-oss, MXFP4 gpt-oss's experts."""
  if quantization not in QUANTIZATIONS:
    raise ValueError(f"quantization: expected one of {QUANTIZATIONS}, got {quantization!r}")
  if quantization.startswith("fp8") and architecture == "gpt_oss":
    raise ValueError(f"quantization: {quantization!r} does not write gpt-oss's fused experts; "
                     "export it as 'mxfp4' (as gpt-oss ships) or unquantized")
  if quantization == "mxfp4" and architecture != "gpt_oss":
    raise ValueError(f"quantization: 'mxfp4' writes gpt-oss's experts (as gpt-oss ships); "
                     f"this model is {architecture!r}: 'fp8', 'fp8_ue8m0' or ''")
FP8_EXPORT_BLOCK = (128, 128)
# A decoder layer's projections (nn.Linear in transformers, FP8Linear under quant_method
# fp8): attention, MLP, experts (Mixtral's w1/w2/w3); not norms, routers or expert gates.
_FP8_PROJECTION = re.compile(
    r"model\.layers\.\d+\..*(_proj|_proj_with_mqa|experts\.\d+\.w[123])\.weight")


def _fp8_quantized(tensors: dict[str, np.ndarray], quantization: str) -> dict[str, Any]:
  """Each projection of `tensors` replaced, in place, by its FP8 codes and weight_scale_inv
  (FP8_EXPORT_BLOCK blocks; "fp8_ue8m0": scales that are powers of two); -> the config.json
  quantization_config that says so, naming the layers' other linear weights (routers,
  expert gates) as left unquantized."""
  scale_fmt = "ue8m0" if quantization == "fp8_ue8m0" else "float"
  kept = set()
  for name in list(tensors):
    array = tensors[name]
    if _FP8_PROJECTION.fullmatch(name) and array.ndim == 2:
      tensors[name], tensors[f"{name}_scale_inv"] = quantize_fp8(array, FP8_EXPORT_BLOCK,
                                                                 scale_fmt)
    elif name.startswith("model.layers.") and array.ndim == 2:
      kept.add(re.sub(r"^model\.layers\.\d+\.", "model.layers.*.", name[:-len(".weight")]))
  config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_EXPORT_BLOCK),
            "modules_to_not_convert": ["lm_head", *sorted(kept)]}
  if scale_fmt == "ue8m0":
    config["scale_fmt"] = scale_fmt
  return config


# gpt-oss's stacked experts, [E, in, out]: what its MXFP4 checkpoints hold packed.
_MXFP4_EXPERTS = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)")


def _mxfp4_quantized(tensors: dict[str, np.ndarray]) -> dict[str, Any]:
  """gpt-oss's experts in `tensors` replaced, in place, by their MXFP4 `_blocks` and
  `_scales` (quantize_mxfp4); -> the quantization_config gpt-oss ships, naming what stays
  unquantized (attention, routers, embeddings, head)."""
  for name in [n for n in tensors if _MXFP4_EXPERTS.fullmatch(n)]:
    tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(tensors.pop(name))
  return {"quant_method": "mxfp4",
          "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                     "model.embed_tokens", "lm_head"]}


def merge_adapters(flat: Mapping[str, Any], config: ModelConfig
                   ) -> tuple[dict[str, np.ndarray], ModelConfig]:
  """(flat params with each LoRA adapter folded into its kernel, in float32: a bf16 base
  rounded the small update away before a float32 export could hold it; the config without
  LoRA)."""
  scale = config.lora_alpha / config.lora_rank
  out = {k: np.asarray(jax.device_get(v)) for k, v in flat.items()
         if ".lora_" not in k}
  for key in flat:
    match = re.fullmatch(r"(.*\.)lora_a", key) or re.fullmatch(r"(.*\.)lora_(\w+)_a", key)
    if not match:
      continue
    stem = key[:-1]  # "...lora_" or "...lora_gate_"; B is stem + "b"
    # a LoRALinear's kernel, or an expert stack's `{gate,up,down}_proj`
    target = match[1] + ("kernel" if match.lastindex == 1 else f"{match[2]}_proj")
    a, b = (np.asarray(jax.device_get(flat[stem + p]), np.float32) for p in "ab")
    kernel = out[target]
    out[target] = kernel.astype(np.float32) + (a @ b) * scale
  return out, config.replace(lora_rank=0)


def _split_shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
  """Greedy split in name order; a tensor larger than max_bytes gets a shard of its own."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name in sorted(tensors):
    array = tensors[name]
    if shards[-1] and size + array.nbytes > max_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  return shards


def _write_json(file: str, obj: Any) -> None:
  with open(file, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write("\n")
