"""HF checkpoint IO: config.json in both transformers layouts, dtypes, round trips."""

import json
import os
import re
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from rlax_ps.models import (ModelConfig, config_from_hf, config_to_hf, flatten_params,
                            load_hf_checkpoint, save_hf_checkpoint)
from rlax_ps.models.hf import check_hf_checkpoint, dequantize_mxfp4
from rlax_ps.models.quantized import (FP8_TYPES, Fp8Layout, RawTensors, dequantize_fp8,
                                      fp8_layout, quantize_fp8)
from rlax_ps.models.rope import inverse_frequencies
from rlax_ps.sharding import make_mesh
from tests.models.hf_fixtures import forward

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf")


def fixture(name):
  return os.path.join(FIXTURES, name)


def read_json(path):
  with open(path) as f:
    return json.load(f)


def hf_tensors(path):
  """All tensors of a single-file or sharded checkpoint folder (FP8 ones as ml_dtypes')."""
  out = {}
  for f in sorted(os.listdir(path)):
    if f.endswith(".safetensors"):
      file, raw = os.path.join(path, f), RawTensors()
      with safe_open(file, framework="numpy") as opened:
        for k in opened.keys():
          fp8 = opened.get_slice(k).get_dtype() in FP8_TYPES
          out[k] = raw.read(file, k) if fp8 else opened.get_tensor(k)
  return out


def copy_with(tmp_path, name, tensors=None, config=None):
  """The fixture `name` copied to tmp_path as one model.safetensors, with edits."""
  tensors = hf_tensors(fixture(name)) if tensors is None else tensors
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  config = read_json(os.path.join(fixture(name), "config.json")) if config is None else config
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  return str(tmp_path)


@pytest.mark.parametrize("name", sorted(
    n for n in os.listdir(FIXTURES) if os.path.exists(os.path.join(FIXTURES, n, "config_4x.json"))))
def test_both_config_layouts_give_the_same_config(name):
  # The same config and tensors give the same logits, so test_hf_parity compares the
  # logits of config.json alone.
  new_style = read_json(os.path.join(fixture(name), "config.json"))
  old_style = read_json(os.path.join(fixture(name), "config_4x.json"))
  new_text, old_text = (new_style.get("text_config", new_style),
                        old_style.get("text_config", old_style))
  assert "rope_parameters" in new_text and "rope_parameters" not in old_text
  assert "rope_theta" in old_text
  assert config_from_hf(new_style) == config_from_hf(old_style)


def test_config_fields_read_from_llama_and_qwen2():
  llama = config_from_hf(read_json(os.path.join(fixture("llama"), "config_4x.json")))
  assert (llama.architecture, llama.num_kv_heads, llama.head_dim, llama.rope_theta) == (
      "llama", 2, 16, 500000.0)
  assert llama.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
  assert not llama.qkv_bias and not llama.tie_word_embeddings
  qwen = config_from_hf(read_json(os.path.join(fixture("qwen2"), "config.json")))
  assert (qwen.architecture, qwen.qkv_bias, qwen.tie_word_embeddings, qwen.rope_theta) == (
      "qwen2", True, True, 1e6)
  assert qwen.rope_scaling is None and not qwen.qk_norm
  qwen3 = config_from_hf(read_json(os.path.join(fixture("qwen3"), "config.json")))
  assert (qwen3.architecture, qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim,
          qwen3.tie_word_embeddings) == ("qwen3", True, False, 16, False)


def test_config_fields_read_from_qwen3_moe():
  new_style = read_json(os.path.join(fixture("qwen3_moe"), "config.json"))
  assert new_style["num_local_experts"] == 4 and "num_experts" not in new_style  # 5.x's name
  moe = config_from_hf(new_style)
  assert (moe.architecture, moe.qk_norm, moe.num_experts, moe.num_experts_per_tok,
          moe.moe_intermediate_size, moe.norm_topk_prob, moe.intermediate_size,
          moe.decoder_sparse_step, moe.mlp_only_layers) == (
              "qwen3_moe", True, 4, 2, 16, True, 64, 1, (1,))
  assert [moe.moe_layer(i) for i in range(3)] == [True, False, True]
  d = dict(new_style, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[])
  assert [config_from_hf(d).moe_layer(i) for i in range(4)] == [False, True, False, True]
  # transformers slides every Qwen3-MoE layer once use_sliding_window is set, whatever
  # max_window_layers or layer_types say.
  d = dict(new_style, use_sliding_window=True, sliding_window=6, max_window_layers=2,
           layer_types=["full_attention"] * 3)
  windowed = config_from_hf(d)
  assert windowed.layer_types is None
  assert [windowed.layer_window(i) for i in range(3)] == [6, 6, 6]
  assert config_from_hf(dict(d, use_sliding_window=False)).sliding_window is None


def test_config_fields_read_from_qwen2_moe():
  d = read_json(os.path.join(fixture("qwen2_moe"), "config_4x.json"))
  moe = config_from_hf(d)
  assert (moe.architecture, moe.qkv_bias, moe.qk_norm, moe.num_experts, moe.norm_topk_prob,
          moe.moe_intermediate_size, moe.shared_expert_intermediate_size) == (
              "qwen2_moe", True, False, 4, False, 16, 24)
  # transformers' Qwen2MoeConfig without layer_types: even layers below max_window_layers slide.
  d = dict(d, use_sliding_window=True, sliding_window=6, max_window_layers=2)
  d.pop("layer_types", None)
  assert [config_from_hf(d).layer_window(i) for i in range(3)] == [6, None, None]
  # Left out, the shared expert is transformers' default width; null means none.
  d.pop("shared_expert_intermediate_size")
  assert config_from_hf(d).shared_expert_intermediate_size == 5632
  assert config_from_hf(dict(d, shared_expert_intermediate_size=None)).shared_expert_intermediate_size == 0
  # Only Qwen2-MoE has a shared expert.
  with pytest.raises(ValueError, match="ModelConfig.shared_expert_intermediate_size"):
    config_to_hf(moe.replace(architecture="mixtral", qkv_bias=False))
  with pytest.raises(ValueError, match="ModelConfig.shared_expert_intermediate_size"):
    moe.replace(num_experts=0, num_experts_per_tok=0)


def test_config_fields_read_from_mixtral():
  new_style = read_json(os.path.join(fixture("mixtral"), "config.json"))
  mixtral = config_from_hf(new_style)
  assert (mixtral.architecture, mixtral.num_experts, mixtral.num_experts_per_tok,
          mixtral.moe_intermediate_size, mixtral.intermediate_size, mixtral.norm_topk_prob,
          mixtral.qk_norm, mixtral.qkv_bias, mixtral.sliding_window, mixtral.layer_types) == (
              "mixtral", 4, 2, 16, 16, True, False, False, 6, None)
  assert all(mixtral.moe_layer(i) and mixtral.layer_window(i) == 6 for i in range(2))
  # Mixtral 8x7B's own config.json (4.x): no window, head_dim from the widths.
  hub = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
         "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
         "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
         "rope_theta": 1e6, "sliding_window": None, "router_aux_loss_coef": 0.02,
         "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
  big = config_from_hf(hub)
  assert (big.head_dim, big.num_experts, big.moe_intermediate_size, big.sliding_window) == (
      128, 8, 14336, None)
  assert config_from_hf(dict(hub, sliding_window=32768)) == big  # no sequence outgrows it
  # router_jitter_noise is train-mode noise on the router's input in transformers (never in
  # eval mode or vLLM): the log-probs we train on must be the sampler's, so it is ignored.
  assert config_from_hf(dict(new_style, router_jitter_noise=0.01)) == mixtral
  assert config_to_hf(mixtral)["router_jitter_noise"] == 0.0


def test_config_fields_read_from_gpt_oss():
  d = read_json(os.path.join(fixture("gpt_oss"), "config.json"))
  c = config_from_hf(d)
  assert (c.architecture, c.qkv_bias, c.attention_out_bias, c.attention_sinks, c.num_experts,
          c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob, c.moe_bias,
          c.swiglu_limit, c.swiglu_alpha, c.sliding_window, c.layer_types) == (
              "gpt_oss", True, True, True, 4, 2, 32, True, True, 0.8, 1.702, 6,
              ("sliding_attention", "full_attention"))
  # What GptOssConfig assumes where a config.json is silent: every other layer sliding over
  # 128 tokens (the first slides), YaRN x32 over 4096 at base 150000, the clamp at 7.
  bare = {k: v for k, v in d.items() if k not in (
      "sliding_window", "layer_types", "rope_parameters", "swiglu_limit", "swiglu_alpha",
      "max_position_embeddings")}
  defaults = config_from_hf(bare)
  assert (defaults.sliding_window, defaults.layer_types, defaults.swiglu_limit,
          defaults.swiglu_alpha, defaults.rope_theta) == (
              128, ("sliding_attention", "full_attention"), 7.0, 1.702, 150000.0)
  assert dict(defaults.rope_scaling) == {
      "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
      "truncate": False, "original_max_position_embeddings": 4096}
  # The Hub's MXFP4 experts are dequantized on load; other quantizations are refused.
  mxfp4 = read_json(os.path.join(fixture("gpt_oss_mxfp4"), "config.json"))
  assert mxfp4["quantization_config"]["quant_method"] == "mxfp4"
  assert config_from_hf(mxfp4) == c
  with pytest.raises(ValueError, match="quantization_config.quant_method: expected none, "
                                       "'mxfp4', 'fp8' or 'compressed-tensors'"):
    config_from_hf(dict(d, quantization_config={"quant_method": "bitsandbytes"}))


# GLM-4.5-Air's config.json (transformers 4.x layout): 106B parameters, 12B active.
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944,
    "partial_rotary_factor": 0.5, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96,
    "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_qk_norm": False,
    "vocab_size": 151552}


def test_config_fields_read_from_glm4_moe():
  c = config_from_hf(read_json(os.path.join(fixture("glm4_moe"), "config.json")))
  assert (c.architecture, c.qkv_bias, c.qk_norm, c.partial_rotary_factor, c.num_experts,
          c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size,
          c.shared_expert_gated, c.router_scoring, c.expert_groups, c.topk_groups,
          c.routed_scaling_factor, c.norm_topk_prob, c.mlp_only_layers, c.moe_layers) == (
              "glm4_moe", True, True, 0.5, 8, 2, 16, 16, False, "sigmoid", 4, 2, 2.5, True,
              (0,), (1, 2))
  air = config_from_hf(GLM45_AIR)
  assert (air.qkv_bias, air.qk_norm, air.head_dim, air.rotary_dim, air.moe_layers[:2],
          air.shared_expert_intermediate_size, air.expert_groups) == (
              True, False, 128, 64, (1, 2), 1408, 1)
  assert round(air.num_params / 1e9) == 107
  # GLM-4.5 itself: 3 dense layers, 160 experts scaled by 2.5, q/k norms; 355B with its
  # multi-token-prediction layer, which is not loaded.
  full = config_from_hf(dict(GLM45_AIR, hidden_size=5120, intermediate_size=12288,
                             moe_intermediate_size=1536, n_routed_experts=160,
                             num_hidden_layers=92, first_k_dense_replace=3,
                             routed_scaling_factor=2.5, use_qk_norm=True))
  assert (full.mlp_only_layers, full.qk_norm, full.routed_scaling_factor) == ((0, 1, 2), True, 2.5)
  assert round(full.num_params / 1e9) == 353
  # Glm4MoeConfig's defaults where a config.json is silent (5.x may write num_local_experts).
  bare = {k: v for k, v in GLM45_AIR.items() if k not in (
      "partial_rotary_factor", "n_group", "topk_group", "n_shared_experts", "norm_topk_prob",
      "routed_scaling_factor", "first_k_dense_replace", "use_qk_norm", "attention_bias",
      "rms_norm_eps", "n_routed_experts")}
  defaults = config_from_hf(dict(bare, num_local_experts=64))
  assert (defaults.partial_rotary_factor, defaults.expert_groups, defaults.topk_groups,
          defaults.shared_expert_intermediate_size, defaults.norm_topk_prob,
          defaults.routed_scaling_factor, defaults.mlp_only_layers, defaults.qk_norm,
          defaults.qkv_bias, defaults.rms_norm_eps, defaults.num_experts) == (
              0.5, 1, 1, 1408, True, 1.0, (0,), False, False, 1e-5, 64)
  with pytest.raises(ValueError, match="n_shared_experts: expected an int >= 0"):
    config_from_hf(dict(GLM45_AIR, n_shared_experts=-1))
  with pytest.raises(ValueError, match="ModelConfig.topk_groups"):
    config_from_hf(dict(GLM45_AIR, n_group=4, topk_group=5))


def test_glm4_moe_configs_transformers_cannot_hold_are_refused_on_export():
  c = config_from_hf(read_json(os.path.join(fixture("glm4_moe"), "config.json")))
  for field, value in (("mlp_only_layers", (1,)), ("shared_expert_gated", True),
                       ("router_scoring", "softmax"), ("decoder_sparse_step", 2),
                       ("shared_expert_intermediate_size", 24)):
    changes = {field: value}
    if field == "router_scoring":
      changes.update(expert_groups=1, topk_groups=1)
    with pytest.raises(ValueError, match=f"ModelConfig.{field}: Glm4MoeForCausalLM"):
      config_to_hf(c.replace(**changes))
  # ... and GLM-4.5's routing in another class.
  qwen = config_from_hf(read_json(os.path.join(fixture("qwen2_moe"), "config.json")))
  for field, value in (("router_scoring", "sigmoid"), ("routed_scaling_factor", 2.5),
                       ("shared_expert_gated", False)):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}: Qwen2MoeForCausalLM"):
      config_to_hf(qwen.replace(**{field: value}))


def test_glm4_moe_multi_token_prediction_layers_are_skipped(tmp_path):
  # GLM-4.5 ships one more layer for speculative decoding; transformers skips it, as we do.
  tensors = hf_tensors(fixture("glm4_moe"))
  tensors["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)
  tensors["model.layers.3.mlp.gate.e_score_correction_bias"] = np.zeros(8, np.float32)
  model = load_hf_checkpoint(copy_with(tmp_path, "glm4_moe", tensors))
  assert len(model.layers) == 3
  llama = hf_tensors(fixture("llama"))
  llama["model.layers.2.input_layernorm.weight"] = np.ones(48, np.float32)
  with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.2\."):
    load_hf_checkpoint(copy_with(tmp_path, "llama", llama))


def test_mxfp4_dequantizes_as_microscaled_fp4_and_exports_unquantized(tmp_path):
  # One byte holds two codes, low nibble first; a block of 32 shares 2**(scale - 127).
  blocks = np.zeros((1, 2, 1, 16), np.uint8)
  blocks[0, 0, 0, 0] = 0x21  # codes 1 (0.5) then 2 (1.0)
  blocks[0, 1, 0, 15] = 0xF7  # codes 7 (6.0) then 15 (-6.0): inputs 30 and 31
  scales = np.array([[[127 + 3], [127 - 1]]], np.uint8)
  w = dequantize_mxfp4(blocks, scales)  # [E, in = 32, out = 2]
  assert w.shape == (1, 32, 2)
  assert (w[0, :2, 0].tolist(), w[0, 30:, 1].tolist()) == ([4.0, 8.0], [3.0, -3.0])
  assert np.count_nonzero(w) == 4
  with pytest.raises(ValueError, match="MXFP4: expected uint8 blocks"):
    dequantize_mxfp4(blocks.astype(np.int8), scales)
  # Loaded from MXFP4, a model exports plain tensors that transformers reads without the
  # quantization config (and they hold the dequantized values).
  model = load_hf_checkpoint(fixture("gpt_oss_mxfp4"))
  save_hf_checkpoint(model, str(tmp_path))
  saved, packed = hf_tensors(str(tmp_path)), hf_tensors(fixture("gpt_oss_mxfp4"))
  key = "model.layers.1.mlp.experts.down_proj"
  np.testing.assert_array_equal(
      saved[key], dequantize_mxfp4(packed[f"{key}_blocks"], packed[f"{key}_scales"]))
  assert not any(k.endswith(("_blocks", "_scales")) for k in saved)
  assert "quantization_config" not in read_json(tmp_path / "config.json")
  # Exported as MXFP4 (as gpt-oss ships): the Hub's own layout, names and config, the
  # experts read back as what was packed (these values are MXFP4's already) and the rest
  # as they were.
  save_hf_checkpoint(model, str(tmp_path / "mxfp4"), quantization="mxfp4")
  again = hf_tensors(str(tmp_path / "mxfp4"))
  assert read_json(tmp_path / "mxfp4" / "config.json")["quantization_config"] == read_json(
      os.path.join(fixture("gpt_oss_mxfp4"), "config.json"))["quantization_config"]
  assert {k: (v.shape, v.dtype) for k, v in again.items()} == {
      k: (v.shape, v.dtype) for k, v in packed.items()}
  for k in packed:
    if k.endswith(("_blocks", "_scales")):
      base = k.rsplit("_", 1)[0]
      np.testing.assert_array_equal(
          dequantize_mxfp4(again[f"{base}_blocks"], again[f"{base}_scales"]),
          dequantize_mxfp4(packed[f"{base}_blocks"], packed[f"{base}_scales"]), err_msg=k)
  for name, value in flatten_params(load_hf_checkpoint(str(tmp_path / "mxfp4"))).items():
    np.testing.assert_array_equal(value, flatten_params(model)[name], err_msg=name)
  with pytest.raises(ValueError, match="quantization: 'fp8' does not write gpt-oss's fused "
                                       "experts; export it as 'mxfp4'"):
    save_hf_checkpoint(model, str(tmp_path / "x"), quantization="fp8")
  # A pair missing its scales is named.
  del packed["model.layers.0.mlp.experts.gate_up_proj_scales"]
  os.makedirs(tmp_path / "broken")
  with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.experts.gate_up_proj'"):
    load_hf_checkpoint(copy_with(tmp_path / "broken", "gpt_oss_mxfp4", packed))


def test_fp8_dequantizes_block_by_block_as_deepseek_does():
  # Block (i, j) of the weight times scale[i, j], the last block of a width that does not
  # divide partial (DeepSeek-V3's 576-row kv_a_proj in 128-row blocks), over leading dims.
  rng = np.random.default_rng(0)
  w = rng.uniform(-2, 2, (2, 5, 7)).astype(ml_dtypes.float8_e4m3fn)
  s = rng.uniform(0.5, 3, (2, 3, 2)).astype(np.float32)
  expected = np.empty(w.shape, np.float32)
  for e, r, c in np.ndindex(*w.shape):
    expected[e, r, c] = float(w[e, r, c]) * float(s[e, r // 2, c // 4])
  np.testing.assert_array_equal(dequantize_fp8(w, s, (2, 4)), expected)
  assert dequantize_fp8(w, s, (2, 4), ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
  # E8M0 scales (DeepSeek-V3.1's ue8m0), as float8_e8m0fnu or as exponent bytes: 2^(e - 127).
  exponents = rng.integers(120, 134, (2, 3, 2)).astype(np.uint8)
  powers = np.ldexp(np.float32(1), exponents.astype(np.int32) - 127)
  for scale in (exponents, exponents.view(ml_dtypes.float8_e8m0fnu)):
    np.testing.assert_array_equal(dequantize_fp8(w, scale, (2, 4)),
                                  dequantize_fp8(w, powers, (2, 4)))
  # No blocks (weight_block_size null): one scale for the whole tensor.
  np.testing.assert_array_equal(dequantize_fp8(w[0], np.float32([0.25]), None),
                                w[0].astype(np.float32) * 0.25)
  with pytest.raises(ValueError, match=re.escape(
      "FP8: expected a float scale of shape (2, 3, 2) for a weight (2, 5, 7) in blocks of "
      "(2, 4), got float32 (2, 2, 2)")):
    dequantize_fp8(w, s[:, :2], (2, 4))
  with pytest.raises(ValueError, match="FP8: expected a float8_e4m3fn or float8_e5m2 weight"):
    dequantize_fp8(w.astype(np.float32), s, (2, 4))


def test_an_fp8_checkpoint_loads_dequantized_and_exports_unquantized(tmp_path):
  # The Hub's DeepSeek-V3/R1, Kimi K2 and Qwen3-FP8 layout: each projection in float8_e4m3fn
  # beside its float32 weight_scale_inv (test_hf_parity: its logits equal transformers').
  packed = hf_tensors(fixture("deepseek_v3_fp8"))
  key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 20 rows: a partial block
  assert packed[key].dtype == ml_dtypes.float8_e4m3fn and packed[key].shape == (20, 32)
  model = load_hf_checkpoint(fixture("deepseek_v3_fp8"))
  save_hf_checkpoint(model, str(tmp_path))
  saved = hf_tensors(str(tmp_path))
  for name in (key, "model.layers.1.mlp.experts.3.down_proj.weight"):
    np.testing.assert_array_equal(
        saved[name], dequantize_fp8(packed[name], packed[f"{name}_scale_inv"], (8, 8)))
  assert not any(k.endswith("_scale_inv") for k in saved)
  np.testing.assert_array_equal(saved["model.layers.1.mlp.gate.weight"],
                                packed["model.layers.1.mlp.gate.weight"])  # never quantized
  assert "quantization_config" not in read_json(tmp_path / "config.json")


def test_fp8_checkpoints_it_cannot_read_are_named(tmp_path):
  config = read_json(os.path.join(fixture("deepseek_v3_fp8"), "config.json"))
  packed = hf_tensors(fixture("deepseek_v3_fp8"))
  key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
  cases = [  # (tensors, config, the message from the check and from the loader)
      ({k: v for k, v in packed.items() if k != f"{key}_scale_inv"}, config,
       f"tensor {key!r}: stored as float8_e4m3fn without its scale (a quant_method 'fp8' "
       f"checkpoint's '{key}_scale_inv'"),
      ({**packed, f"{key}_scale_inv": packed[f"{key}_scale_inv"][:2]}, config,
       f"tensor {key!r}: FP8: expected a float scale of shape (3, 4) for a weight (20, 32) "
       "in blocks of (8, 8), got float32 (2, 4)"),
      (packed, {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 8]}},
       "quantization_config.weight_block_size: expected two positive integers or null, got [0, 8]"),
      (packed, {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e3m4"}},
       "quantization_config.fmt: expected 'e4m3' or 'e5m2', got 'e3m4'"),
  ]
  for i, (tensors, cfg, message) in enumerate(cases):
    os.makedirs(tmp_path / str(i))
    path = copy_with(tmp_path / str(i), "deepseek_v3_fp8", tensors, cfg)
    with pytest.raises(ValueError, match=re.escape(message)):
      check_hf_checkpoint(path)
    with pytest.raises(ValueError, match=re.escape(message)):
      load_hf_checkpoint(path)
  # Outside quant_method fp8 the scales are tensors it does not know.
  os.makedirs(tmp_path / "plain")
  plain = {k: v for k, v in config.items() if k != "quantization_config"}
  with pytest.raises(ValueError, match=r"unexpected tensor '.*_scale_inv'"):
    load_hf_checkpoint(copy_with(tmp_path / "plain", "deepseek_v3_fp8", packed, plain))


def test_compressed_tensors_fp8_layouts_and_what_they_refuse():
  # llm-compressor's FP8 schemes: a weight_scale per tensor, output channel, input group or
  # block (test_hf_parity: the per-channel fixture's logits equal transformers').
  def config(**weights):
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "symmetric": True, **weights}}}}

  for weights, shape, block in (
      (dict(strategy="tensor"), (20, 32), None),
      (dict(strategy="channel"), (20, 32), (1, 32)),
      (dict(strategy="group", group_size=16), (20, 32), (1, 16)),
      (dict(strategy="block", block_structure=[8, 8]), (20, 32), (8, 8))):
    layout = fp8_layout(config(**weights))
    assert (layout.suffix, layout.block_for(shape)) == ("_scale", block)
  assert fp8_layout({"quant_method": "fp8"}) == Fp8Layout("_scale_inv", (128, 128))
  assert fp8_layout({"quant_method": "mxfp4"}) is None
  for bad, message in (
      ({**config(strategy="channel"), "format": "pack-quantized"},
       "quantization_config.format: expected 'float-quantized'"),
      (config(strategy="channel", type="int"),
       "quantization_config.config_groups.group_0.weights: expected type 'float' of num_bits "
       "8 (FP8), got 'int' of 8"),
      (config(strategy="channel", symmetric=False),
       "quantization_config.config_groups.group_0.weights.symmetric: expected true"),
      (config(strategy="group"), "quantization_config.config_groups.group_0.weights.strategy"),
      ({**config(strategy="channel"), "config_groups": {}},
       "quantization_config.config_groups: expected a group of FP8 weights")):
    with pytest.raises(ValueError, match=re.escape(message)):
      fp8_layout(bad)
  d = read_json(os.path.join(fixture("qwen3_fp8_dynamic"), "config.json"))
  assert config_from_hf(d) == config_from_hf(read_json(os.path.join(fixture("qwen3"),
                                                                    "config.json")))
  d["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
  with pytest.raises(ValueError, match=r"config.json: quantization_config.config_groups"):
    config_from_hf(d)


def test_mxfp4_quantization_rounds_each_value_to_its_blocks_nearest_code():
  from rlax_ps.models.quantized import dequantize_mxfp4, quantize_mxfp4
  rng = np.random.default_rng(3)
  w = rng.normal(0, 0.02, (2, 64, 5)).astype(np.float32)
  w[0, :32, 0] = 0.0  # a block of zeros
  w[1, 32:, 4] = 0.0
  # Scale 1 (6 the largest); ties go to the even code: 5 -> 4, -2.5 -> -2, 0.25 -> 0, and
  # up: 3.5 -> 4, -0.75 -> -1.
  w[1, 32:38, 4] = [6.0, 5.0, -2.5, 0.25, 3.5, -0.75]
  blocks, scales = quantize_mxfp4(w)
  assert blocks.shape == (2, 5, 2, 16) and scales.shape == (2, 5, 2) and blocks.dtype == np.uint8
  back = dequantize_mxfp4(blocks, scales)
  np.testing.assert_array_equal(back[1, 32:38, 4], [6.0, 4.0, -2.0, 0.0, 4.0, -1.0])
  assert not back[0, :32, 0].any()
  # No value clipped: each block's scale 2^k brings its largest magnitude to (3, 6], and each
  # value is off by at most half E2M1's gap where it lies (0.5 below 2, 1 to 4, 2 to 6).
  step = np.ldexp(1.0, scales.astype(np.int32) - 127)  # [E, out, G]
  full = np.repeat(step.transpose(0, 2, 1), 32, axis=1)  # [E, in, out]
  peak = np.abs(w).reshape(2, 2, 32, 5).max(axis=2).transpose(0, 2, 1) / step
  assert np.all((peak[peak > 0] > 3) & (peak[peak > 0] <= 6))
  a = np.abs(w) / full
  gap = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
  assert np.all(np.abs(back - w) <= gap / 2 * full + 1e-12)
  # Values MXFP4 holds come back exactly.
  codes = rng.integers(0, 256, (2, 5, 2, 16), dtype=np.uint8)
  exact = dequantize_mxfp4(codes, rng.integers(118, 136, (2, 5, 2), dtype=np.uint8))
  np.testing.assert_array_equal(dequantize_mxfp4(*quantize_mxfp4(exact)), exact)
  with pytest.raises(ValueError, match=r"MXFP4: expected weights \[E, in, out\] with in a "
                                       r"multiple of 32, got \(2, 40, 5\)"):
    quantize_mxfp4(np.zeros((2, 40, 5), np.float32))


def test_fp8_quantization_scales_each_block_to_the_formats_range():
  rng = np.random.default_rng(1)
  w = rng.normal(size=(2, 20, 33)).astype(np.float32)
  w[0, :8, :16] = 0.0  # a block of zeros: scale 1, codes 0
  codes, scale_inv = quantize_fp8(w, (8, 16))
  assert codes.dtype == ml_dtypes.float8_e4m3fn and scale_inv.shape == (2, 3, 3)
  assert scale_inv[0, 0, 0] == 1.0 and not codes[0, :8, :16].astype(np.float32).any()
  # Each other block's largest magnitude is 448, the format's; the rest round to e4m3 (3
  # mantissa bits: within 1/16 of the value, and of the smallest normal step near zero).
  blocks = np.abs(codes.astype(np.float32)).reshape(2, 20, 33)
  assert blocks[1, 16:, 32:].max() == 448.0 and blocks[0, 8:16, 16:32].max() == 448.0
  back = dequantize_fp8(codes, scale_inv, (8, 16))
  full = np.repeat(np.repeat(scale_inv, 8, 1), 16, 2)[:, :20, :33]
  assert (np.abs(back - w) <= np.abs(w) / 16 + full * 2.0 ** -9 + 1e-7).all()
  # UE8M0 (DeepSeek-V3.1's): each scale the power of two at or above the float one, so each
  # block's largest code lies in (224, 448]; the zero block keeps scale 1.
  w[1, 8, 0] = 448.0  # a block whose scale is 2^0 exactly
  float_codes, float_scale = quantize_fp8(w, (8, 16))
  codes, scale_inv = quantize_fp8(w, (8, 16), "ue8m0")
  assert np.array_equal(scale_inv, 2.0 ** np.round(np.log2(scale_inv)))
  assert ((scale_inv >= float_scale) & (scale_inv < 2 * float_scale)).all()
  assert scale_inv[0, 0, 0] == 1.0 and scale_inv[1, 1, 0] == 1.0
  peaks = np.abs(codes.astype(np.float32)).reshape(2, 20, 33)
  assert peaks[1, 8:16, :16].max() == 448.0 and 224.0 < peaks[1, 16:, 32:].max() <= 448.0
  back = dequantize_fp8(codes, scale_inv, (8, 16))
  full = np.repeat(np.repeat(scale_inv, 8, 1), 16, 2)[:, :20, :33]
  assert (np.abs(back - w) <= np.abs(w) / 16 + full * 2.0 ** -9 + 1e-7).all()
  with pytest.raises(ValueError, match="scale_fmt: expected 'float' or 'ue8m0', got 'e5m2'"):
    quantize_fp8(w, (8, 16), "e5m2")


def test_an_fp8_export_is_read_back_as_its_dequantized_weights(tmp_path):
  # DeepSeek-V3's own layout (what transformers, vLLM and SGLang read: this export of 8
  # fixture families loads in transformers 5.25 to our logits within 2.4e-6; recheck with
  # tests/fixtures/make_hf_fixtures.py --check). Routers, norms, embeddings, head unquantized.
  model = load_hf_checkpoint(fixture("deepseek_v3"))
  save_hf_checkpoint(model, str(tmp_path), dtype="bfloat16", quantization="fp8")
  saved, config = hf_tensors(str(tmp_path)), read_json(tmp_path / "config.json")
  assert config["quantization_config"] == {
      "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": [128, 128],
      "modules_to_not_convert": ["lm_head", "model.layers.*.mlp.gate"]}
  key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
  assert saved[key].dtype == ml_dtypes.float8_e4m3fn and saved[f"{key}_scale_inv"].shape == (1, 1)
  for name in ("model.layers.1.mlp.gate.weight", "model.embed_tokens.weight",
               "model.layers.0.input_layernorm.weight", "lm_head.weight"):
    assert saved[name].dtype == ml_dtypes.bfloat16 and f"{name}_scale_inv" not in saved
  quantized = sorted(k[:-len("_scale_inv")] for k in saved if k.endswith("_scale_inv"))
  assert len(quantized) == 3 * 5 + 3 + 2 * (8 + 1) * 3  # attention, a dense MLP, 2 MoE layers
  back = flatten_params(load_hf_checkpoint(str(tmp_path)))
  kernel = np.asarray(flatten_params(model)["layers.0.attn.kv_a_proj_with_mqa.kernel"])
  np.testing.assert_array_equal(  # (the rotary columns are permuted alike both ways)
      back["layers.0.attn.kv_a_proj_with_mqa.kernel"].astype(np.float32),
      dequantize_fp8(*quantize_fp8(kernel.T.astype(ml_dtypes.bfloat16), (128, 128)),
                     (128, 128)).T)
  # With power-of-two scales (DeepSeek-V3.1's ue8m0): the same tensors, the scale format said.
  save_hf_checkpoint(model, str(tmp_path / "ue8m0"), dtype="bfloat16", quantization="fp8_ue8m0")
  ue8m0 = hf_tensors(str(tmp_path / "ue8m0"))
  assert read_json(tmp_path / "ue8m0" / "config.json")["quantization_config"] == {
      **config["quantization_config"], "scale_fmt": "ue8m0"}
  assert set(ue8m0) == set(saved)
  for name in quantized:
    scale = ue8m0[f"{name}_scale_inv"]
    assert scale.dtype == np.float32 and np.array_equal(scale, 2.0 ** np.round(np.log2(scale)))
  np.testing.assert_array_equal(
      flatten_params(load_hf_checkpoint(str(tmp_path / "ue8m0")))[
          "layers.0.attn.kv_a_proj_with_mqa.kernel"].astype(np.float32),
      dequantize_fp8(*quantize_fp8(kernel.T.astype(ml_dtypes.bfloat16), (128, 128), "ue8m0"),
                     (128, 128)).T)
  with pytest.raises(ValueError, match="quantization: 'mxfp4' writes gpt-oss's experts"):
    save_hf_checkpoint(model, str(tmp_path / "x"), quantization="mxfp4")
  with pytest.raises(ValueError, match=r"quantization: expected one of \('', 'fp8', "
                                       r"'fp8_ue8m0', 'mxfp4'\), got 'int4'"):
    save_hf_checkpoint(model, str(tmp_path / "x"), quantization="int4")


def test_config_fields_read_from_gemma_and_sliding_windows():
  gemma = config_from_hf(read_json(os.path.join(fixture("gemma3"), "config.json")))
  assert (gemma.architecture, gemma.sliding_window, gemma.query_pre_attn_scalar,
          gemma.rope_theta, gemma.rope_local_theta, gemma.hidden_act) == (
              "gemma3", 6, 24, 1e6, 1e4, "gelu_tanh")
  assert gemma.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
  assert [gemma.layer_window(i) for i in range(3)] == [6, None, 6]
  assert gemma.rope_scaling == {"rope_type": "linear", "factor": 4.0}
  assert gemma.qk_norm and gemma.zero_centered_norms and gemma.sandwich_norms
  assert gemma.scale_embeddings and gemma.tie_word_embeddings
  # Without a window Gemma's local layers still take their own RoPE base, as transformers'.
  d = read_json(os.path.join(fixture("gemma3"), "config.json"))
  d["sliding_window"] = None
  unwindowed = config_from_hf(d)
  assert unwindowed.sliding_window is None and unwindowed.layer_types == gemma.layer_types
  assert unwindowed.sliding_layer(0) and unwindowed.layer_window(0) is None
  assert config_from_hf(config_to_hf(unwindowed)) == unwindowed
  # 4.x Gemma 3 configs may state only the pattern: every 6th layer attends fully.
  d = read_json(os.path.join(fixture("gemma3"), "config_4x.json"))
  del d["layer_types"]
  d.update(num_hidden_layers=7, sliding_window_pattern=6)
  types = config_from_hf(d).layer_types
  assert [i for i, t in enumerate(types) if t == "full_attention"] == [5]
  gemma2 = config_from_hf(read_json(os.path.join(fixture("gemma2"), "config.json")))
  assert (gemma2.architecture, gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping,
          gemma2.rope_local_theta, gemma2.qk_norm, gemma2.sandwich_norms) == (
              "gemma2", 2.0, 3.0, None, False, True)
  assert [gemma2.layer_window(i) for i in range(3)] == [6, None, 6]
  d = read_json(os.path.join(fixture("gemma2"), "config_4x.json"))
  for key in ("attn_logit_softcapping", "final_logit_softcapping", "layer_types"):
    del d[key]  # transformers' Gemma2Config defaults: caps 50 and 30, every 2nd layer full
  d["num_hidden_layers"] = 4
  default = config_from_hf(d)
  assert (default.attn_logit_softcapping, default.final_logit_softcapping) == (50.0, 30.0)
  assert [default.layer_window(i) for i in range(4)] == [6, None, 6, None]
  mistral = config_from_hf(read_json(os.path.join(fixture("mistral_window"), "config.json")))
  assert mistral.sliding_window == 6 and mistral.layer_types is None
  assert mistral.layer_window(0) == mistral.layer_window(1) == 6
  # Qwen2 4.x: layers from max_window_layers on slide when use_sliding_window is set.
  qwen = read_json(os.path.join(fixture("qwen2"), "config_4x.json"))
  qwen.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
  qwen.pop("layer_types", None)
  assert config_from_hf(qwen).layer_types == ("full_attention", "sliding_attention")


@pytest.mark.parametrize("config", [
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                num_kv_heads=1, rope_theta=5e5, architecture="llama",
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=4,
                num_kv_heads=2, qkv_bias=True, tie_word_embeddings=True, architecture="qwen2",
                rope_scaling={"rope_type": "linear", "factor": 2.0}, rms_norm_eps=1e-5,
                max_position_embeddings=77),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, qk_norm=True, architecture="qwen3", rope_theta=1e6),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=4,
                num_kv_heads=1, head_dim=8, architecture="mistral", rope_theta=1e6),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=4,
                num_kv_heads=2, head_dim=8, qk_norm=True, architecture="qwen3",
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                              "original_max_position_embeddings": 32768}),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=1, head_dim=8, architecture="mistral", sliding_window=7),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=4,
                num_kv_heads=2, qkv_bias=True, architecture="qwen2", sliding_window=9,
                layer_types=("full_attention", "sliding_attention", "sliding_attention")),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=8, architecture="gemma3", qk_norm=True,
                hidden_act="gelu_tanh", zero_centered_norms=True, scale_embeddings=True,
                sandwich_norms=True, query_pre_attn_scalar=12, sliding_window=5,
                layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                rope_theta=1e6, rope_local_theta=1e4, tie_word_embeddings=True,
                rope_scaling={"rope_type": "linear", "factor": 8.0}),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, architecture="gemma2", hidden_act="gelu_tanh",
                zero_centered_norms=True, scale_embeddings=True, sandwich_norms=True,
                query_pre_attn_scalar=8, sliding_window=5, tie_word_embeddings=True,
                layer_types=("sliding_attention", "full_attention"),
                attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=8, qk_norm=True, architecture="qwen3_moe",
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                decoder_sparse_step=2, mlp_only_layers=(3,), rope_theta=1e6),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, qk_norm=True, architecture="qwen3_moe",
                num_experts=4, num_experts_per_tok=1, moe_intermediate_size=8,
                norm_topk_prob=True, sliding_window=7),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, architecture="mixtral", rope_theta=1e6,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
                norm_topk_prob=True, max_position_embeddings=64),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=2, num_heads=4,
                num_kv_heads=1, architecture="mixtral", num_experts=3, num_experts_per_tok=1,
                moe_intermediate_size=8, norm_topk_prob=True, sliding_window=7,
                rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, architecture="olmo2", qk_norm=True, qk_norm_across_heads=True,
                post_norms=True, rope_theta=5e5, rms_norm_eps=1e-5),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=8, architecture="olmo3", qk_norm=True,
                qk_norm_across_heads=True, post_norms=True, sliding_window=5,
                layer_types=("sliding_attention",) * 3 + ("full_attention",), rope_theta=5e5,
                rope_local_theta=5e5, rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                    "original_max_position_embeddings": 64}),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=4,
                num_kv_heads=2, qkv_bias=True, architecture="qwen2_moe", num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=(1,),
                shared_expert_intermediate_size=12, sliding_window=9,
                layer_types=("sliding_attention", "full_attention", "full_attention")),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=1, architecture="phi3", rope_theta=2.5e5, rms_norm_eps=1e-5,
                max_position_embeddings=64),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                num_kv_heads=2, architecture="phi3", partial_rotary_factor=0.75,
                sliding_window=9, max_position_embeddings=64, tie_word_embeddings=True,
                rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 16,
                              "short_factor": [1.0, 1.0, 1.5], "long_factor": [2.0, 3.0, 4.0]}),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=4, num_heads=4,
                num_kv_heads=1, architecture="smollm3", nope_layers=(3,), sliding_window=5,
                layer_types=("full_attention",) * 3 + ("sliding_attention",),
                tie_word_embeddings=True, rope_theta=5e6),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=1, architecture="granite", attention_multiplier=0.0078125,
                embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
                tie_word_embeddings=True, rope_theta=1e7),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, architecture="glm4", qkv_bias=True,
                sandwich_norms=True, partial_rotary_factor=0.5, rms_norm_eps=1.5625e-7,
                max_position_embeddings=64),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, architecture="gpt_oss", qkv_bias=True,
                attention_out_bias=True, attention_sinks=True, sliding_window=4,
                layer_types=("sliding_attention", "full_attention"), num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
                moe_bias=True, swiglu_limit=7.0, rms_norm_eps=1e-5, rope_theta=1.5e5,
                rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 4096}),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=8, architecture="glm4_moe", qkv_bias=True,
                qk_norm=True, partial_rotary_factor=0.5, rms_norm_eps=1e-5, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=4, norm_topk_prob=True,
                mlp_only_layers=(0, 1), shared_expert_intermediate_size=8,
                shared_expert_gated=False, router_scoring="sigmoid", expert_groups=4,
                topk_groups=2, routed_scaling_factor=2.5, rope_theta=1e6),
    ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, architecture="glm4_moe", partial_rotary_factor=0.25,
                num_experts=4, num_experts_per_tok=1, moe_intermediate_size=4,
                shared_expert_gated=False, router_scoring="sigmoid",
                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 512}),
], ids=["llama", "qwen2", "qwen3", "mistral", "qwen3-yarn", "mistral-window", "qwen2-window",
        "gemma3", "gemma2", "qwen3-moe", "qwen3-moe-window", "mixtral", "mixtral-window",
        "olmo2", "olmo3", "qwen2-moe", "phi4", "phi4-mini", "smollm3", "granite", "glm4",
        "gpt-oss", "glm-4.5", "glm-4.5-plain"])
def test_config_to_hf_and_back_is_identity(config):
  hf = config_to_hf(config)
  assert config_from_hf(hf) == config
  # Either layout alone carries the rope settings.
  old_only = {k: v for k, v in hf.items() if k != "rope_parameters"}
  new_only = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
  assert config_from_hf(old_only) == config_from_hf(new_only) == config


def test_config_fields_read_from_smollm3():
  d = read_json(os.path.join(fixture("smollm3"), "config_4x.json"))
  c = config_from_hf(d)
  assert c.nope_layers == (1, 3) and [c.layer_window(i) for i in range(4)] == [None, 6, None, 6]
  # transformers' SmolLM3Config: without no_rope_layers every 4th layer (interval) has no
  # RoPE, and only those layers slide, only with use_sliding_window.
  for key in ("no_rope_layers", "no_rope_layer_interval", "layer_types"):
    d.pop(key, None)
  d["num_hidden_layers"] = 8
  default = config_from_hf(d)
  assert default.nope_layers == (3, 7)
  assert [i for i in range(8) if default.layer_window(i)] == [3, 7]
  assert config_from_hf(dict(d, use_sliding_window=False)).sliding_window is None
  with pytest.raises(ValueError, match="no_rope_layers: expected 8 entries"):
    config_from_hf(dict(d, no_rope_layers=[1, 0]))
  with pytest.raises(ValueError, match="ModelConfig.nope_layers: LlamaForCausalLM"):
    config_to_hf(c.replace(architecture="llama", sliding_window=None, layer_types=None))


def test_granite_multipliers_default_to_transformers_and_are_refused_elsewhere():
  d = read_json(os.path.join(fixture("granite"), "config_4x.json"))
  for key in ("attention_multiplier", "embedding_multiplier", "residual_multiplier",
              "logits_scaling"):
    del d[key]
  default = config_from_hf(d)  # GraniteConfig: 1.0 each, so attention logits are unscaled
  assert default.attention_scale == 1.0 and default.logits_scaling == 1.0
  llama = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1,
                      num_heads=2, num_kv_heads=1, residual_multiplier=0.5)
  with pytest.raises(ValueError, match="ModelConfig.residual_multiplier: LlamaForCausalLM"):
    config_to_hf(llama)
  with pytest.raises(ValueError, match="ModelConfig.attention_multiplier: GraniteForCausalLM"):
    config_to_hf(default.replace(attention_multiplier=None))
  with pytest.raises(ValueError, match="ModelConfig.logits_scaling: expected a positive"):
    default.replace(logits_scaling=0.0)


def test_glm4_defaults_are_transformers():
  d = read_json(os.path.join(fixture("glm4"), "config_4x.json"))
  d.pop("partial_rotary_factor", None)
  d.pop("rms_norm_eps")
  if d.get("rope_scaling"):
    d["rope_scaling"].pop("partial_rotary_factor", None)
  c = config_from_hf(d)  # Glm4Config: half of each head turns, RMS eps 1.5625e-7
  assert (c.partial_rotary_factor, c.rotary_dim, c.rms_norm_eps) == (0.5, 8, 1.5625e-7)
  assert c.qkv_bias and c.sandwich_norms and not c.zero_centered_norms


def test_unknown_architecture_is_named():
  d = read_json(os.path.join(fixture("llama"), "config.json"))
  d["architectures"] = ["FalconForCausalLM"]
  with pytest.raises(ValueError, match="FalconForCausalLM"):
    config_from_hf(d)


@pytest.mark.parametrize("field,value,arch", [
    ("attention_bias", True, "llama"), ("mlp_bias", True, "llama"),
    ("hidden_act", "gelu", "llama"), ("attention_bias", True, "qwen3"),
    ("hidden_activation", "gelu", "gemma3"), ("hidden_activation", "gelu", "gemma2"),
    ("final_logit_softcapping", 30.0, "qwen3"), ("use_bidirectional_attention", True, "gemma3"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}, "llama"),
    ("attention_bias", True, "qwen3_moe"), ("shared_expert_intermediate_size", 64, "qwen3_moe"),
    ("attention_bias", True, "olmo2"), ("hidden_act", "gelu", "olmo3"),
    ("qkv_bias", False, "qwen2_moe"), ("attention_bias", False, "glm4"),
    ("attention_bias", False, "gpt_oss"), ("quantization_config", {"quant_method": "awq"}, "llama"),
    ("clip_qkv", 8.0, "olmoe"), ("attention_bias", True, "olmoe"),
])
def test_unsupported_config_field_is_named(field, value, arch):
  d = read_json(os.path.join(fixture(arch), "config.json"))
  d[field] = value
  want = "dynamic" if isinstance(value, dict) and value.get("rope_type") == "dynamic" else field
  with pytest.raises(ValueError, match=want):
    config_from_hf(d)


def test_missing_config_field_is_named():
  d = read_json(os.path.join(fixture("qwen2"), "config.json"))
  del d["intermediate_size"]
  with pytest.raises(ValueError, match="intermediate_size"):
    config_from_hf(d)
  d = read_json(os.path.join(fixture("qwen3_moe"), "config.json"))
  del d["num_local_experts"]
  with pytest.raises(ValueError, match="missing field 'num_experts'"):
    config_from_hf(d)
  d = read_json(os.path.join(fixture("mixtral"), "config_4x.json"))
  del d["num_local_experts"]
  with pytest.raises(ValueError, match="missing field 'num_local_experts'"):
    config_from_hf(d)


@pytest.mark.parametrize("name,tensor", [
    ("qwen3_moe", "model.layers.2.mlp.experts.3.down_proj.weight"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    ("mixtral", "model.layers.0.block_sparse_moe.gate.weight"),
    ("qwen2_moe", "model.layers.2.mlp.shared_expert.up_proj.weight"),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert_gate.weight"),
    ("glm4_moe", "model.layers.1.mlp.gate.e_score_correction_bias"),
    ("glm4_moe", "model.layers.2.mlp.shared_experts.down_proj.weight"),
    ("glm4_moe", "model.layers.0.mlp.up_proj.weight")])
def test_missing_expert_tensor_is_named(name, tensor, tmp_path):
  tensors = hf_tensors(fixture(name))
  del tensors[tensor]
  with pytest.raises(ValueError, match=re.escape(f"missing tensor {tensor!r}")):
    load_hf_checkpoint(copy_with(tmp_path, name, tensors))


def test_missing_tensor_is_named(tmp_path):
  tensors = hf_tensors(fixture("llama"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    load_hf_checkpoint(copy_with(tmp_path, "llama", tensors))


def test_qwen2_checkpoint_without_biases_is_missing_them(tmp_path):
  tensors = {k: v for k, v in hf_tensors(fixture("qwen2")).items() if not k.endswith(".bias")}
  with pytest.raises(ValueError, match=r"missing tensor '.*_proj\.bias'"):
    load_hf_checkpoint(copy_with(tmp_path, "qwen2", tensors))


def test_a_mistral_window_longer_than_any_sequence_is_full_attention():
  d = read_json(os.path.join(fixture("mistral"), "config.json"))
  d["sliding_window"] = d["max_position_embeddings"]
  assert config_from_hf(d) == config_from_hf(read_json(os.path.join(fixture("mistral"),
                                                                    "config.json")))


def test_qwen3_checkpoint_without_qk_norms_is_missing_them(tmp_path):
  tensors = {k: v for k, v in hf_tensors(fixture("qwen3")).items()
             if "self_attn.q_norm" not in k and "self_attn.k_norm" not in k}
  with pytest.raises(ValueError, match=r"missing tensor '.*self_attn\.[qk]_norm\.weight'"):
    load_hf_checkpoint(copy_with(tmp_path, "qwen3", tensors))


def test_config_that_contradicts_the_architecture_is_refused_on_export():
  config = config_from_hf(read_json(os.path.join(fixture("qwen3"), "config.json")))
  with pytest.raises(ValueError, match="ModelConfig.qk_norm"):
    config_to_hf(config.replace(architecture="qwen2", qkv_bias=True))
  with pytest.raises(ValueError, match="ModelConfig.qk_norm"):
    config_to_hf(config.replace(qk_norm=False))
  gemma = config_from_hf(read_json(os.path.join(fixture("gemma3"), "config.json")))
  with pytest.raises(ValueError, match="ModelConfig.sandwich_norms"):
    config_to_hf(gemma.replace(sandwich_norms=False))
  with pytest.raises(ValueError, match="ModelConfig.hidden_act"):
    config_to_hf(config.replace(hidden_act="gelu_tanh"))
  with pytest.raises(ValueError, match="ModelConfig.sliding_window"):
    config_to_hf(config.replace(architecture="llama", qk_norm=False, sliding_window=8))
  with pytest.raises(ValueError, match="ModelConfig.attn_logit_softcapping: Qwen3ForCausalLM"):
    config_to_hf(config.replace(attn_logit_softcapping=50.0))
  with pytest.raises(ValueError, match="ModelConfig.rope_local_theta: Gemma2ForCausalLM"):
    config_to_hf(gemma.replace(architecture="gemma2", qk_norm=False))


def test_moe_config_transformers_cannot_hold_is_refused_on_export():
  moe = config_from_hf(read_json(os.path.join(fixture("qwen3_moe"), "config.json")))
  with pytest.raises(ValueError, match="ModelConfig.num_experts: Qwen3ForCausalLM"):
    config_to_hf(moe.replace(architecture="qwen3"))
  with pytest.raises(ValueError, match="ModelConfig.layer_types: Qwen3MoeForCausalLM"):
    config_to_hf(moe.replace(sliding_window=8, layer_types=(
        "full_attention", "sliding_attention", "sliding_attention")))
  # Mixtral: experts on every layer, intermediate_size wide, top-k weights renormalised.
  as_mixtral = moe.replace(architecture="mixtral", qk_norm=False, mlp_only_layers=(),
                           intermediate_size=16)
  assert config_from_hf(config_to_hf(as_mixtral)) == as_mixtral
  for field, value in (("mlp_only_layers", (1,)), ("decoder_sparse_step", 2),
                       ("norm_topk_prob", False), ("moe_intermediate_size", 8),
                       ("num_experts", 0)):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}: MixtralForCausalLM"):
      config_to_hf(as_mixtral.replace(**{field: value}))
  with pytest.raises(ValueError, match="ModelConfig.layer_types: MixtralForCausalLM"):
    config_to_hf(as_mixtral.replace(sliding_window=8, layer_types=(
        "full_attention", "sliding_attention", "sliding_attention")))
  # gpt-oss: biased experts with the clamped SwiGLU, which no other class holds.
  with pytest.raises(ValueError, match="ModelConfig.moe_bias: Qwen3MoeForCausalLM"):
    config_to_hf(moe.replace(moe_bias=True))
  gpt_oss = config_from_hf(read_json(os.path.join(fixture("gpt_oss"), "config.json")))
  for field, value in (("swiglu_limit", None), ("moe_bias", False), ("attention_sinks", False)):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}: GptOssForCausalLM"):
      config_to_hf(gpt_oss.replace(**{field: value}))


def test_unexpected_tensor_is_named(tmp_path):
  tensors = hf_tensors(fixture("llama"))
  tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(48, np.float32)
  with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj"):
    load_hf_checkpoint(copy_with(tmp_path, "llama", tensors))


def test_rotary_buffers_and_tied_lm_head_are_ignored(tmp_path):
  tensors = hf_tensors(fixture("qwen2"))
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  tensors["model.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
  model = load_hf_checkpoint(copy_with(tmp_path, "qwen2", tensors))
  np.testing.assert_array_equal(model.embed.embedding[...], tensors["model.embed_tokens.weight"])
  assert not hasattr(model, "lm_head")


@pytest.mark.parametrize("name,tensor,shape", [
    ("llama", "model.layers.0.self_attn.k_proj.weight", (32, 48)),
    ("qwen3_moe", "model.layers.0.mlp.experts.1.gate_proj.weight", (16, 32)),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w2.weight", (32, 16))])
def test_wrong_shape_is_named(name, tensor, shape, tmp_path):
  tensors = hf_tensors(fixture(name))
  assert tensors[tensor].shape == shape
  tensors[tensor] = np.zeros(shape[::-1], np.float32)
  with pytest.raises(ValueError, match=re.escape(
      f"tensor {tensor!r}: expected shape {shape}, got {shape[::-1]}")):
    load_hf_checkpoint(copy_with(tmp_path, name, tensors))


def test_folder_without_weights_or_config_is_an_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_hf_checkpoint(str(tmp_path))
  shutil.copy(os.path.join(fixture("llama"), "config.json"), tmp_path / "config.json")
  with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
    load_hf_checkpoint(str(tmp_path))


@pytest.mark.parametrize("text,why", [
    ("{bad", "not valid JSON \\(Expecting"),
    ("[1, 2]", "expected a JSON object at the top level, got list")])
def test_a_config_that_is_not_a_json_object_is_named(text, why, tmp_path):
  """json's own error (a bare JSONDecodeError) names no file."""
  shutil.copy(os.path.join(fixture("llama"), "model.safetensors"), tmp_path)
  (tmp_path / "config.json").write_text(text)
  for read in (load_hf_checkpoint, check_hf_checkpoint):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "config.json")) + ": " + why):
      read(str(tmp_path))


def test_an_index_that_is_not_valid_json_is_named(tmp_path):
  shutil.copytree(fixture("qwen2_sharded"), tmp_path / "ckpt")
  index = tmp_path / "ckpt" / "model.safetensors.index.json"
  index.write_text(index.read_text()[:-10])
  with pytest.raises(ValueError, match=re.escape(str(index)) + ": not valid JSON"):
    load_hf_checkpoint(str(tmp_path / "ckpt"))


def test_index_naming_a_missing_shard_is_an_error(tmp_path):
  shutil.copytree(fixture("qwen2_sharded"), tmp_path / "ckpt")
  os.remove(tmp_path / "ckpt" / "model-00002-of-00003.safetensors")
  with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
    load_hf_checkpoint(str(tmp_path / "ckpt"))


def test_kernels_are_transposed_hf_weights():
  model = load_hf_checkpoint(fixture("llama"))
  tensors = hf_tensors(fixture("llama"))
  np.testing.assert_array_equal(model.layers[1].attn.q_proj.kernel[...],
                                tensors["model.layers.1.self_attn.q_proj.weight"].T)
  np.testing.assert_array_equal(model.lm_head.kernel[...], tensors["lm_head.weight"].T)
  np.testing.assert_array_equal(model.layers[0].post_attn_norm.scale[...],
                                tensors["model.layers.0.post_attention_layernorm.weight"])


def test_expert_params_stack_transposed_hf_experts():
  model = load_hf_checkpoint(fixture("qwen3_moe"))
  tensors = hf_tensors(fixture("qwen3_moe"))
  for i in (0, 2):
    mlp = model.layers[i].mlp
    np.testing.assert_array_equal(mlp.router.kernel[...],
                                  tensors[f"model.layers.{i}.mlp.gate.weight"].T)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      stacked = np.asarray(getattr(mlp.experts, proj)[...])
      assert stacked.shape[0] == 4
      for e in range(4):
        np.testing.assert_array_equal(
            stacked[e], tensors[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"].T)
  np.testing.assert_array_equal(model.layers[1].mlp.up_proj.kernel[...],
                                tensors["model.layers.1.mlp.up_proj.weight"].T)


def test_mixtral_experts_stack_w1_w3_w2_as_gate_up_down():
  model = load_hf_checkpoint(fixture("mixtral"))
  tensors = hf_tensors(fixture("mixtral"))
  for i in (0, 1):
    mlp, moe = model.layers[i].mlp, f"model.layers.{i}.block_sparse_moe"
    np.testing.assert_array_equal(mlp.router.kernel[...], tensors[f"{moe}.gate.weight"].T)
    for proj, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
      stacked = np.asarray(getattr(mlp.experts, proj)[...])
      for e in range(4):
        np.testing.assert_array_equal(stacked[e], tensors[f"{moe}.experts.{e}.{w}.weight"].T)


def test_bfloat16_dtype_sets_every_param_and_rounds_once():
  model = load_hf_checkpoint(fixture("qwen2"), dtype="bfloat16")
  assert model.config.param_dtype == model.config.dtype == "bfloat16"
  params = flatten_params(model)
  assert {str(p.dtype) for p in params.values()} == {"bfloat16"}
  bias = hf_tensors(fixture("qwen2"))["model.layers.1.self_attn.v_proj.bias"]
  np.testing.assert_array_equal(np.asarray(params["layers.1.attn.v_proj.bias"]),
                                bias.astype(ml_dtypes.bfloat16))


def test_bad_dtype_is_named():
  with pytest.raises(ValueError, match="float16"):
    load_hf_checkpoint(fixture("qwen2"), dtype="float16")
  with pytest.raises(ValueError, match="ModelConfig.param_dtype.*int32"):
    ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                num_kv_heads=1, param_dtype=np.int32)


@pytest.mark.parametrize("dtype,name", [
    (jax.numpy.float32, "float32"), (jax.numpy.bfloat16, "bfloat16"), (np.float32, "float32"),
    (np.dtype("float32"), "float32"), (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
    ("bfloat16", "bfloat16")])
def test_dtypes_are_taken_as_names_numpy_dtypes_or_jax_types(dtype, name, tmp_path):
  model = load_hf_checkpoint(fixture("llama"), dtype=dtype, compute_dtype=dtype)
  assert model.config.param_dtype == model.config.dtype == name
  assert {str(p.dtype) for p in flatten_params(model).values()} == {name}
  save_hf_checkpoint(model, str(tmp_path), dtype=dtype)
  assert read_json(os.path.join(tmp_path, "config.json"))["torch_dtype"] == name


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2_sharded", "qwen3", "mistral",
                                  "mistral_window", "gemma3", "gemma2", "qwen3_moe",
                                  "mixtral", "olmo2", "olmo3", "qwen2_moe", "phi3", "smollm3",
                                  "granite", "glm4", "gpt_oss", "glm4_moe", "deepseek_v3",
                                  "deepseek_v2", "olmoe"])
def test_save_writes_back_the_same_tensors(name, tmp_path):
  save_hf_checkpoint(load_hf_checkpoint(fixture(name)), str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  saved, original = hf_tensors(str(tmp_path)), hf_tensors(fixture(name))
  assert sorted(saved) == sorted(original)  # tied qwen2: no lm_head.weight either side
  for key in original:
    assert saved[key].dtype == original[key].dtype
    np.testing.assert_array_equal(saved[key], original[key], err_msg=key)
  assert config_from_hf(read_json(tmp_path / "config.json")) == config_from_hf(
      read_json(os.path.join(fixture(name), "config.json")))


def test_a_save_without_token_ids_writes_none_not_the_classes_defaults(tmp_path):
  """Phi3Config's and Olmo3Config's default eos ids (32000, 50279) lie outside a small
  vocabulary: transformers' generate then never stops. A trainer's export passes its
  tokenizer's ids."""
  for name in ("phi3", "olmo3"):  # (a field config.json leaves out takes the class default)
    save_hf_checkpoint(load_hf_checkpoint(fixture(name)), str(tmp_path / name))
    written = read_json(tmp_path / name / "config.json")
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
      assert field in written and written[field] is None, (name, field)
  save_hf_checkpoint(load_hf_checkpoint(fixture("phi3")), str(tmp_path / "ids"),
                     extra_config={"bos_token_id": 1, "eos_token_id": 2})
  assert (read_json(tmp_path / "ids" / "config.json")["eos_token_id"],
          read_json(tmp_path / "ids" / "config.json")["bos_token_id"]) == (2, 1)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_export_without_a_window_writes_one_transformers_reads(name, tmp_path):
  """A window no sequence outgrows is read as none; written back as null beside sliding
  layer_types, transformers refused it (Gemma2Config: ValueError, Gemma 3: TypeError)."""
  d = read_json(os.path.join(fixture(name), "config.json"))
  d["sliding_window"] = 2 * d["max_position_embeddings"]
  os.mkdir(tmp_path / "in")
  model = load_hf_checkpoint(copy_with(tmp_path / "in", name, config=d))
  assert model.config.sliding_window is None
  save_hf_checkpoint(model, str(tmp_path / "out"))
  window = read_json(tmp_path / "out" / "config.json")["sliding_window"]
  assert isinstance(window, int) and window >= 1
  again = load_hf_checkpoint(str(tmp_path / "out"))
  assert again.config == model.config
  tokens = np.arange(12)[None] % model.config.vocab_size
  np.testing.assert_array_equal(np.asarray(forward(again, tokens)),
                                np.asarray(forward(model, tokens)))


def test_rope_parameters_and_a_rope_scaling_that_disagree_are_refused_naming_both():
  """transformers applies rope_scaling over rope_parameters: a YaRN scaling added beside
  plain parameters (Qwen's long-context recipe) was read as plain RoPE here."""
  d = read_json(os.path.join(fixture("qwen3"), "config.json"))
  assert d["rope_parameters"]["rope_type"] == "default"
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
  with pytest.raises(ValueError, match="rope_parameters and rope_scaling: expected one"):
    config_from_hf(dict(d, rope_scaling=yarn))
  both = dict(d, rope_parameters={**d["rope_parameters"], **yarn},  # the same: one scaling
              rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
  assert config_from_hf(both).rope_scaling["rope_type"] == "yarn"


@pytest.mark.parametrize("name,file", [("llama", "config.json"), ("llama", "config_4x.json"),
                                       ("qwen3_yarn", "config.json"),
                                       ("qwen3_yarn", "config_4x.json")])
def test_a_top_level_original_context_overrides_the_rope_dicts(name, file):
  """transformers 5 sets a Llama-3 or YaRN rope dict's original_max_position_embeddings from a
  top-level field of that name when it builds the model (not in AutoConfig's dict)."""
  d = read_json(os.path.join(fixture(name), file))
  key = "rope_parameters" if "rope_parameters" in d else "rope_scaling"
  other = 4 * d[key]["original_max_position_embeddings"]
  top = config_from_hf(dict(d, original_max_position_embeddings=other))
  inside = config_from_hf(dict(d, **{key: {**d[key], "original_max_position_embeddings": other}}))
  assert top == inside and top.rope_scaling["original_max_position_embeddings"] == other
  assert not np.array_equal(inverse_frequencies(top), inverse_frequencies(config_from_hf(d)))


def test_a_top_level_original_context_is_not_read_by_per_layer_type_rope():
  """Gemma 3's and OLMo 3's rope_parameters hold a dict per layer type, and transformers 5
  keeps each dict's own original_max_position_embeddings there."""
  d = read_json(os.path.join(fixture("olmo3"), "config.json"))
  assert d["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
  plain = config_from_hf(d)
  assert config_from_hf(dict(d, original_max_position_embeddings=3)) == plain


def test_bfloat16_save_load_round_trip_is_exact(tmp_path):
  model = load_hf_checkpoint(fixture("llama"), dtype="bfloat16")
  save_hf_checkpoint(model, str(tmp_path))
  assert {str(t.dtype) for t in hf_tensors(str(tmp_path)).values()} == {"bfloat16"}
  assert read_json(tmp_path / "config.json")["torch_dtype"] == "bfloat16"
  again = flatten_params(load_hf_checkpoint(str(tmp_path), dtype="bfloat16"))
  for key, value in flatten_params(model).items():
    np.testing.assert_array_equal(np.asarray(again[key]), np.asarray(value), err_msg=key)


def test_sharded_save_writes_an_index_and_loads_back(tmp_path):
  model = load_hf_checkpoint(fixture("llama"))
  save_hf_checkpoint(model, str(tmp_path), dtype="bfloat16", max_shard_bytes=30_000,
                     extra_config={"bos_token_id": 1, "eos_token_id": 2})
  files = sorted(os.listdir(tmp_path))
  shards = [f for f in files if f.endswith(".safetensors")]
  assert "model.safetensors.index.json" in files and "model.safetensors" not in files
  assert len(shards) > 1 and all(os.path.getsize(tmp_path / f) < 40_000 for f in shards)
  index = read_json(tmp_path / "model.safetensors.index.json")
  assert set(index["weight_map"].values()) == set(shards)
  assert read_json(tmp_path / "config.json")["eos_token_id"] == 2
  again = flatten_params(load_hf_checkpoint(str(tmp_path)))
  for key, value in flatten_params(model).items():
    expected = np.asarray(value).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(again[key]), expected, err_msg=key)
  # Saving again as one file removes the old shards, so nothing stale can be read back.
  save_hf_checkpoint(model, str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_load_onto_a_mesh_shards_each_param():
  mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
  model = load_hf_checkpoint(fixture("llama"), mesh=mesh)
  kernel = model.layers[0].mlp.down_proj.kernel[...]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  assert len(kernel.addressable_shards) == 8
  assert kernel.addressable_shards[0].data.shape == (64 // 4, 48 // 2)
  reference = load_hf_checkpoint(fixture("llama"))
  np.testing.assert_array_equal(np.asarray(kernel), reference.layers[0].mlp.down_proj.kernel[...])


def test_load_moe_onto_a_mesh_shards_expert_params():
  mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
  model = load_hf_checkpoint(fixture("qwen3_moe"), mesh=mesh)
  reference = load_hf_checkpoint(fixture("qwen3_moe"))
  for proj, spec, shard in (("gate_proj", ("fsdp", "tensor"), (4, 32 // 2, 16 // 4)),
                            ("down_proj", ("tensor", "fsdp"), (4, 16 // 4, 32 // 2))):
    experts = getattr(model.layers[2].mlp.experts, proj)[...]
    assert experts.sharding.spec == jax.sharding.PartitionSpec(None, *spec)
    assert len(experts.addressable_shards) == 8
    assert experts.addressable_shards[0].data.shape == shard
    np.testing.assert_array_equal(np.asarray(experts),
                                  getattr(reference.layers[2].mlp.experts, proj)[...])
  router = model.layers[0].mlp.router.kernel[...]
  assert router.sharding.spec == jax.sharding.PartitionSpec("fsdp")
