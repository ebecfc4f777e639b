"""PEFT adapters: a LoRA model's adapters written as a PEFT adapter folder load in PEFT over
the base checkpoint to the same model. The committed tests/fixtures/hf/qwen3/peft_adapter
was written by `_write` below from `_adapted_qwen3()`; its reference.npz holds PEFT's logits
of it (make_hf_fixtures.py --peft). Adapters PEFT cannot hold are refused by name."""

import json
import os

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from hf_fixtures import FIXTURES, forward
from rlax_ps.models import ModelConfig, Transformer, assign_params, flatten_params
from rlax_ps.models.hf import load_hf_params, read_hf_config
from rlax_ps.models.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_peft_adapter

BASE = os.path.join(FIXTURES, "qwen3")
COMMITTED = os.path.join(BASE, "peft_adapter")
DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapted_qwen3():
  """(config, flat params): the qwen3 fixture with rank-4 adapters on every dense projection,
  A and B drawn from numpy's default_rng(0) (numpy: the same bits in every process)."""
  config = read_hf_config(BASE).replace(lora_rank=4, lora_alpha=8.0, lora_targets=DENSE)
  flat = {k: np.asarray(v) for k, v in flatten_params(
      Transformer(config, rngs=nnx.Rngs(0))).items()}
  flat.update(load_hf_params(BASE, read_hf_config(BASE)))
  rng = np.random.default_rng(0)
  for k in sorted(flat):
    if ".lora_" in k:
      flat[k] = rng.normal(0, 0.2, flat[k].shape).astype(np.float32)
  return config, flat


def _write(path):
  config, flat = _adapted_qwen3()
  save_peft_adapter(flat, config, path, base_model="tests/fixtures/hf/qwen3")
  return config, flat


def test_our_adapter_folder_is_the_committed_one_and_peft_computes_our_model(tmp_path):
  config, flat = _write(str(tmp_path))
  with open(tmp_path / ADAPTER_CONFIG) as f, open(os.path.join(COMMITTED, ADAPTER_CONFIG)) as g:
    assert json.load(f) == json.load(g)
  ours, committed = (load_file(os.path.join(p, ADAPTER_WEIGHTS)) for p in (tmp_path, COMMITTED))
  assert sorted(ours) == sorted(committed) and len(ours) == 2 * 7 * config.num_layers
  for k in committed:
    np.testing.assert_array_equal(ours[k], committed[k], err_msg=k)
  assert committed["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (
      4, config.hidden_size)  # PEFT's [r, in]
  # PEFT over the transformers checkpoint computes our adapted model.
  model = Transformer(config, rngs=nnx.Rngs(0))
  assign_params(model, flat)
  ref = np.load(os.path.join(COMMITTED, "reference.npz"))
  logits = np.asarray(forward(model, ref["tokens"]))
  assert np.abs(logits - ref["logits"]).max() < 1e-4
  base_logits = np.load(os.path.join(BASE, "reference.npz"))["logits"]
  assert np.abs(ref["logits"] - base_logits).max() > 0.1  # the adapter matters


def test_an_adapter_is_written_in_the_export_dtype(tmp_path):
  """export.dtype converts the adapter as it does the merged export (bf16: half the bytes)."""
  import ml_dtypes
  config, flat = _adapted_qwen3()
  save_peft_adapter(flat, config, str(tmp_path), dtype="bfloat16")
  written = load_file(os.path.join(tmp_path, ADAPTER_WEIGHTS))
  name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
  assert {a.dtype for a in written.values()} == {np.dtype(ml_dtypes.bfloat16)}
  np.testing.assert_array_equal(
      written[name], flat["layers.0.attn.q_proj.lora_a"].T.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("config,field", [
    (ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                 num_kv_heads=1, architecture="qwen3_moe", qk_norm=True, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=8, lora_rank=2), "experts"),
    (ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                 num_kv_heads=1, architecture="phi3", lora_rank=2), "phi3"),
    (ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                 num_kv_heads=1), "lora_rank")])
def test_adapters_peft_cannot_hold_are_refused_naming_why(config, field, tmp_path):
  flat = flatten_params(Transformer(config, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=f"model.lora_\\w+: .*{field}|{field}"):
    save_peft_adapter(flat, config, str(tmp_path))
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("name", ["glm4_moe", "qwen3_moe"])
def test_an_moe_models_dense_mlp_adapters_which_peft_reads_as_its_experts_are_refused(
    name, tmp_path):
  """PEFT reads gate/up/down_proj targets of these transformers-5 MoE types as the fused
  experts' parameters: a dense layer's (GLM-4.5's first, Qwen3-MoE's mlp_only_layers) or
  shared expert's adapters of those names loaded nowhere and the logits were wrong."""
  base = read_hf_config(os.path.join(FIXTURES, name)).replace(lora_rank=2, lora_alpha=4.0)
  config = base.replace(lora_targets=DENSE)
  flat = flatten_params(Transformer(config, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"^model.lora_targets: PEFT reads \['down_proj', "
                                       r"'gate_proj', 'up_proj'\] of a " + name):
    save_peft_adapter(flat, config, str(tmp_path / "mlp"))
  assert not os.path.exists(tmp_path / "mlp")
  attention = base.replace(lora_targets=DENSE[:4])
  save_peft_adapter(flatten_params(Transformer(attention, rngs=nnx.Rngs(0))), attention,
                    str(tmp_path / "attention"))
  with open(tmp_path / "attention" / ADAPTER_CONFIG) as f:
    assert json.load(f)["target_modules"] == sorted(DENSE[:4])


def test_target_modules_name_only_the_projections_adapted(tmp_path):
  """An all-MoE model's gate/up/down_proj targets adapt no layer (the experts' are left
  out): named, PEFT would read them as modules to add adapters to."""
  config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=1, architecture="qwen2_moe", num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=8, lora_rank=2,
                       lora_targets=("q_proj", "gate_proj"))
  save_peft_adapter(flatten_params(Transformer(config, rngs=nnx.Rngs(0))), config,
                    str(tmp_path))
  with open(tmp_path / ADAPTER_CONFIG) as f:
    assert json.load(f)["target_modules"] == ["q_proj"]
  assert sorted(load_file(os.path.join(tmp_path, ADAPTER_WEIGHTS))) == [
      "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
      "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]


def test_an_adapter_over_an_image_text_base_targets_its_language_model(tmp_path):
  """Over Gemma3ForConditionalGeneration (we train its language model) transformers' module
  tree has the layers under model.language_model., and the vision tower has q_proj, k_proj,
  ... too: the keys name the language model's, the targets a pattern that leaves the
  vision tower out (its keys were a causal LM's: PEFT loaded none, and adapted both)."""
  import re

  base = os.path.join(FIXTURES, "gemma3_vision")
  config = read_hf_config(base).replace(lora_rank=2, lora_alpha=4.0, lora_targets=DENSE)
  flat = flatten_params(Transformer(config, rngs=nnx.Rngs(0)))
  save_peft_adapter(flat, config, str(tmp_path), base_model=base)
  keys = sorted(load_file(os.path.join(tmp_path, ADAPTER_WEIGHTS)))
  assert len(keys) == 2 * len(DENSE) * config.num_layers
  prefix = "base_model.model.model.language_model.layers."
  assert all(k.startswith(prefix) for k in keys), keys[:2]
  with open(tmp_path / ADAPTER_CONFIG) as f:
    pattern = json.load(f)["target_modules"]
  # module names of transformers 5.25's Gemma3ForConditionalGeneration of this fixture
  assert re.fullmatch(pattern, "model.language_model.layers.1.self_attn.q_proj")
  assert re.fullmatch(pattern, "model.language_model.layers.0.mlp.down_proj")
  assert not re.fullmatch(pattern, "model.vision_tower.encoder.layers.0.self_attn.q_proj")
  for k in keys:  # every tensor's module is one the pattern adapts
    assert re.fullmatch(pattern, k[len("base_model.model."):].rsplit(".lora_", 1)[0]), k


def test_a_base_model_config_that_is_not_json_is_named(tmp_path):
  from rlax_ps.models.peft import _language_model_root
  (tmp_path / "config.json").write_text("{bad")
  with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
    _language_model_root(str(tmp_path))
