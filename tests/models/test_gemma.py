"""Gemma 2 and 3 checkpoints beyond the logits (test_hf_parity): each Gemma feature is
exercised by the fixtures, the image-text checkpoints' language model loads as the text
model, a worker holding the published keyframe computes the trainer's logits, sampling with
a shared prefill crosses the sliding window as separate prefills do, and the packed RL loss
trains the sandwich norms."""

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from inference_workers.sampler import generate, generate_shared
from inference_workers.sampling import SamplingParams
from inference_workers.weights import HeldPolicy
from rlax_ps import sync
from rlax_ps.models import config_from_hf, flatten_params, load_hf_checkpoint
from safetensors.numpy import load_file, save_file
from rl_grads import rl_loss_and_grads

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf")
VISION = os.path.join(FIXTURES, "gemma3_vision")


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def model(request):
  return load_hf_checkpoint(os.path.join(FIXTURES, request.param), dtype="bfloat16")


@nnx.jit
def forward(model, tokens):
  return model(tokens)


def _edited(tmp_path, name, edit):
  src = os.path.join(FIXTURES, name)
  for f in os.listdir(src):
    if f.endswith(".safetensors"):
      os.symlink(os.path.join(src, f), tmp_path / f)
  with open(os.path.join(src, "config.json")) as f:
    config = json.load(f)
  edit(config)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  return str(tmp_path)


def _no_window(c):
  c["sliding_window"] = 4096


def _one_rope_base(c):
  c["rope_parameters"]["sliding_attention"]["rope_theta"] = 1e6


def _head_dim_scale(c):
  c["query_pre_attn_scalar"] = c["head_dim"]


def _no_attention_cap(c):
  c["attn_logit_softcapping"] = None


def _no_output_cap(c):
  c["final_logit_softcapping"] = None


@pytest.mark.parametrize("name,edit", [
    ("gemma3", _no_window), ("gemma3", _one_rope_base), ("gemma3", _head_dim_scale),
    ("gemma2", _no_window), ("gemma2", _no_attention_cap), ("gemma2", _no_output_cap)],
    ids=["window", "local-rope", "query-scale", "gemma2-window", "attention-cap", "output-cap"])
def test_each_gemma_feature_moves_the_reference_logits(name, edit, tmp_path):
  # With the feature undone the same weights give clearly different logits, so the parity
  # test really checks the sliding window, the local RoPE base, query_pre_attn_scalar and
  # both soft-caps.
  ref = np.load(os.path.join(FIXTURES, name, "reference.npz"))
  changed = load_hf_checkpoint(_edited(tmp_path, name, edit), dtype="float32")
  assert np.abs(np.asarray(forward(changed, ref["tokens"])) - ref["logits"]).max() > 1e-2


def test_the_hubs_short_image_text_config_takes_transformers_defaults():
  # google/gemma-3-4b-it's config.json states little more than widths and depth.
  config = config_from_hf({
      "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
      "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                      "model_type": "gemma3_text", "num_hidden_layers": 34,
                      "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                      "sliding_window": 1024},
      "vision_config": {"model_type": "siglip_vision_model"}})
  assert (config.architecture, config.vocab_size, config.num_heads, config.num_kv_heads,
          config.head_dim, config.query_pre_attn_scalar, config.sliding_window) == (
              "gemma3", 262208, 8, 4, 256, 256, 1024)
  assert (config.rope_theta, config.rope_local_theta, config.max_position_embeddings) == (
      1e6, 1e4, 131072)
  assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
  assert config.tie_word_embeddings and config.hidden_act == "gelu_tanh"
  assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [
      5, 11, 17, 23, 29]


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_an_image_text_checkpoint_loads_its_language_model(prefix, tmp_path):
  # transformers writes language_model.model.* (the Hub's layout); model.language_model.* is
  # its in-memory naming. Either way the vision tower is skipped and the logits are the
  # reference's (transformers' Gemma3ForConditionalGeneration on text alone).
  tensors = load_file(os.path.join(VISION, "model.safetensors"))
  assert any(k.startswith("vision_tower.") for k in tensors)
  renamed = {(prefix + k[len("language_model.model."):]
              if k.startswith("language_model.model.") else k): v for k, v in tensors.items()}
  save_file(renamed, str(tmp_path / "model.safetensors"))
  shutil.copy(os.path.join(VISION, "config.json"), tmp_path / "config.json")
  model = load_hf_checkpoint(str(tmp_path))
  ref = np.load(os.path.join(VISION, "reference.npz"))
  assert np.abs(np.asarray(forward(model, ref["tokens"])) - ref["logits"]).max() < 1e-4


def test_an_image_text_checkpoints_quantization_is_checked():
  """transformers writes an image-text model's quantization_config at the top level, beside
  its text_config; reading the text_config alone skipped the quant_method check."""
  with open(os.path.join(VISION, "config.json")) as f:
    d = json.load(f)
  d["quantization_config"] = {"quant_method": "bitsandbytes"}
  with pytest.raises(ValueError, match="quant_method: expected none.*got 'bitsandbytes'"):
    config_from_hf(d)


def test_a_worker_holding_the_published_keyframe_computes_the_trainers_logits(model):
  params = {k: np.asarray(v) for k, v in flatten_params(model).items()}
  assert {"layers.0.attn_out_norm.scale", "layers.2.mlp_out_norm.scale"} <= set(params)
  assert model.config.architecture in ("gemma2", "gemma3")
  policy = HeldPolicy(model.config, "bf16")
  policy.apply(sync.encode(None, params, "bf16", version=0))
  tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 15))
  np.testing.assert_array_equal(np.asarray(forward(policy.model, tokens)),
                                np.asarray(forward(model, tokens)))


@pytest.mark.slow  # ~8 s a case
@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_shared_prefill_samples_past_the_window_as_one_prefill_per_sample(name):
  model = load_hf_checkpoint(os.path.join(FIXTURES, name), dtype="float32")
  params = SamplingParams(temperature=1.0, max_new_tokens=12)  # 8-token prompt + 12 > window 6
  prompts = [[2, 5, 9, 12, 30, 41, 7, 8], [2, 7, 19]]
  seeds = [[0, 1, 2], [3, 4, 5]]
  shared = generate_shared(model, prompts, 3, seeds, params)
  single = generate(model, [p for p in prompts for _ in range(3)], sum(seeds, []), params)
  for b, group in enumerate(shared):
    for j, sample in enumerate(group):
      one = single[b * 3 + j]
      np.testing.assert_array_equal(sample.tokens, one.tokens)
      np.testing.assert_allclose(sample.logprobs, one.logprobs, atol=1e-4)


# gemma2 slow (suite time): gemma3 has the same sandwich norms, and the gemma2 model runs in
# the other tests of this module.
@pytest.mark.parametrize("model", ["gemma3", pytest.param("gemma2", marks=pytest.mark.slow)],
                         indirect=True)
def test_the_packed_rl_loss_trains_the_sandwich_norms(model):
  _, grad = rl_loss_and_grads(model, response_len=9, vocab_hi=80)
  for layer in grad["layers"].values():
    for norm in ("attn_out_norm", "mlp_out_norm", "input_norm", "post_attn_norm"):
      g = np.asarray(layer[norm]["scale"])
      assert np.isfinite(g).all() and np.abs(g).sum() > 0, norm
