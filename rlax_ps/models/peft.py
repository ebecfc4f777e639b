"""A LoRA model's adapters as a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors), which PEFT's `PeftModel.from_pretrained` and vLLM's LoRA serving
load over the base checkpoint; the merged export (`save_hf_checkpoint`) stays the other way.

PEFT computes x @ lora_A.weight.T @ lora_B.weight.T * lora_alpha / r on a Linear whose
weight is [out, in]; our A [in, r] and B [r, out] are those weights transposed, under the
HF name of the kernel they adapt. Adapters of the routed experts or of projections a
checkpoint fuses or permutes (Phi-3's qkv_proj, GLM-4's gate_up_proj and q/k, DeepSeek's q and
rotary key) have no PEFT LoRA module to go to: `peft_adapter_names` says which, and the caller
keeps the merged export alone.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

import jax
import numpy as np
from safetensors.numpy import save_file

from rlax_ps.models.config import ModelConfig, dtype_name
from rlax_ps.models.hf import _TEXT_MODEL_OF, NP_DTYPES, hf_tensor_names, read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PeftModel wraps the causal LM
# Model types whose experts transformers 5 fuses and whose gate/up/down_proj targets PEFT
# (0.19 and up) reads as the fused experts' parameters: a dense MLP's or shared expert's
# adapters of those names would not load (transformers' _MODEL_TO_CONVERSION_PATTERN).
_PEFT_FUSED_MLP_NAMES = ("qwen3_moe", "glm4_moe", "olmoe", "deepseek_v2", "deepseek_v3")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _language_model_root(base_model: str) -> str:
  """Where the adapted layers sit in transformers' module tree of the base checkpoint:
  "model." for a causal LM, "model.language_model." for an image-text one we train the
  language model of (Gemma 3 4B and up: Gemma3ForConditionalGeneration), read from its
  config.json where `base_model` is a folder (else a causal LM)."""
  path = os.path.join(base_model, "config.json") if base_model else ""
  if path and os.path.isfile(path):
    archs = read_json(path).get("architectures") or []
    if any(a in _TEXT_MODEL_OF for a in archs):
      return "model.language_model."
  return "model."


def peft_adapter_names(config: ModelConfig, root: str = "model.") -> dict[str, str]:
  """Our adapter param (".lora_a"/".lora_b") -> its PEFT tensor name, the layers under
  `root` (_language_model_root); ValueError naming model.lora_targets when an adapter has
  no PEFT module (experts, fused projections)."""
  if not config.lora_rank:
    raise ValueError("model.lora_rank: expected > 0 (a model with adapters), got 0")
  if "experts" in config.lora_targets and config.moe_layers:
    raise ValueError("model.lora_targets: the routed experts' adapters have no PEFT LoRA "
                     "module; use the merged export")
  if config.architecture in ("phi3", "glm4") or config.kv_lora_rank:
    raise ValueError(f"model.lora_targets: {config.architecture} checkpoints fuse projections "
                     f"(or permute q/k) that the adapters are split over; use the merged export")
  names = {}
  for ours, (hf, transposed) in hf_tensor_names(config.replace(lora_rank=0)).items():
    proj = ours.rsplit(".", 2)[-2] if ours.endswith(".kernel") else ""
    if proj not in config.lora_targets or "experts" in ours:
      continue
    assert isinstance(hf, str) and transposed and hf.endswith(".weight") and hf.startswith(
        "model."), (ours, hf)
    stem = _PREFIX + root + hf[len("model."):-len("weight")]
    names[ours[:-len("kernel")] + "lora_a"] = stem + "lora_A.weight"
    names[ours[:-len("kernel")] + "lora_b"] = stem + "lora_B.weight"
  mlp = sorted({m for m in _MLP for n in names if f".{m}." in n})
  if mlp and config.moe_layers and config.architecture in _PEFT_FUSED_MLP_NAMES:
    raise ValueError(f"model.lora_targets: PEFT reads {mlp} of a {config.architecture} model "
                     f"as its fused experts', so the dense MLP's and shared expert's adapters "
                     f"would not load; leave them out for a PEFT adapter, or use the merged "
                     f"export")
  return names


def save_peft_adapter(flat: Mapping[str, Any], config: ModelConfig, path: str, *,
                      base_model: str = "", dtype: str | None = None) -> None:
  """Write the adapters of `flat` (our flat params, adapters included) as a PEFT adapter
  folder at `path`; `base_model` names the checkpoint it goes over; `dtype` converts the
  weights (default: the adapters' own)."""
  root = _language_model_root(base_model)
  names = peft_adapter_names(config, root)
  tensors = {}
  for ours, peft in names.items():
    array = np.asarray(jax.device_get(flat[ours]))
    if dtype is not None:
      array = array.astype(NP_DTYPES[dtype_name(dtype)])
    tensors[peft] = np.ascontiguousarray(array.T)
  # (the projections adapted: a target of no layer's here, such as an all-MoE model's
  # gate_proj, is not named, which PEFT would read as a module to add adapters to)
  modules = sorted({t for t in config.lora_targets for n in names if f".{t}." in n})
  # An image-text base has projections of those names in its vision tower too: a pattern
  # (PEFT full-matches it against module names) keeps the adapters on the language model.
  targets = modules if root == "model." else (
      re.escape(root) + r"layers\.\d+\..*\.(" + "|".join(modules) + ")")
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
  adapter_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.lora_rank,
      "lora_alpha": config.lora_alpha, "target_modules": targets, "lora_dropout": 0.0,
      "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "modules_to_save": None, "base_model_name_or_path": base_model, "inference_mode": True}
  with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
    json.dump(adapter_config, f, indent=2, sort_keys=True)
    f.write("\n")
