"""Our logits against transformers' on the committed tiny checkpoints (tests/fixtures/hf).

The reference logits were computed by tests/fixtures/make_hf_fixtures.py with transformers
in float32; no torch is needed here.
"""

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from hf_fixtures import FIXTURES, decode, fixture_model, forward, reference
from inference_workers.sampler import generate, generate_shared
from inference_workers.sampling import SamplingParams
from rlax_ps.models import (KVCache, Transformer, assign_params, flatten_params,
                            load_hf_checkpoint)

TOLERANCE = 1e-4  # max abs logit difference in float32


def with_config(name, config_file, tmp_path):
  """The fixture checkpoint with `config_file` standing in as its config.json."""
  src = os.path.join(FIXTURES, name)
  for f in os.listdir(src):
    if f.endswith(".safetensors") or f.endswith(".index.json"):
      os.symlink(os.path.join(src, f), tmp_path / f)
  shutil.copy(os.path.join(src, config_file), tmp_path / "config.json")
  return str(tmp_path)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2_sharded", "qwen3", "mistral",
                                  "qwen3_yarn", "mistral_window", "gemma3", "gemma3_vision",
                                  "gemma2", "qwen3_moe", "mixtral", "olmo2", "olmo3",
                                  "qwen2_moe", "phi3", "smollm3", "granite", "glm4",
                                  "gpt_oss", "gpt_oss_mxfp4", "glm4_moe", "deepseek_v3",
                                  "deepseek_v3_fp8", "qwen3_fp8_dynamic", "deepseek_v2",
                                  "olmoe"])
def test_logits_match_transformers(name):
  # config.json only: test_hf_checkpoint checks that config_4x.json gives the same config.
  tokens, expected = reference(name)
  logits = np.asarray(forward(fixture_model(name), tokens))
  err = float(np.abs(logits - expected).max())
  print(f"parity {name}: max abs diff {err:.3g} (max |logit| {np.abs(expected).max():.3g})")
  assert logits.shape == expected.shape
  assert err < TOLERANCE


@pytest.mark.parametrize("name,scaled", [("llama", "llama3"), ("qwen3_yarn", "yarn")])
def test_the_scaled_rope_fixtures_exercise_their_scaling(name, scaled, tmp_path):
  # Without the scaling the same weights give clearly different logits, so the parity test
  # above really checks the Llama-3 frequency bands and YaRN's ramp and attention factor.
  path = with_config(name, "config.json", tmp_path)
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  assert config["rope_parameters"]["rope_type"] == scaled
  config["rope_parameters"] = {"rope_type": "default",
                               "rope_theta": config["rope_parameters"]["rope_theta"]}
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  tokens, expected = reference(name)
  model = load_hf_checkpoint(path)
  assert model.config.rope_scaling is None
  assert np.abs(np.asarray(forward(model, tokens)) - expected).max() > 1e-2


@pytest.mark.parametrize("name", ["mistral_window", "mixtral", "olmo3", "phi3", "smollm3",
                                  "gpt_oss"])
def test_the_windowed_fixtures_exercise_their_window(name, tmp_path):
  # Their 20-token references reach past the 6-token window: without it the logits differ.
  path = with_config(name, "config.json", tmp_path)
  with open(tmp_path / "config.json") as f:
    config = json.load(f)
  assert config["sliding_window"] == 6
  with open(tmp_path / "config.json", "w") as f:
    json.dump(dict(config, sliding_window=None), f)
  tokens, expected = reference(name)
  model = load_hf_checkpoint(path)
  assert model.config.sliding_window is None
  assert np.abs(np.asarray(forward(model, tokens)) - expected).max() > 1e-2


@pytest.mark.parametrize("field", ["attention_multiplier", "embedding_multiplier",
                                   "residual_multiplier", "logits_scaling"])
def test_the_granite_fixture_exercises_each_multiplier(field):
  # With one multiplier back at 1 the same weights give clearly different logits.
  tokens, expected = reference("granite")
  model = fixture_model("granite")
  assert getattr(model.config, field) != 1.0
  other = Transformer(model.config.replace(**{field: 1.0}), rngs=nnx.Rngs(0))
  nnx.update(other, nnx.state(model, nnx.Param))
  assert np.abs(np.asarray(forward(other, tokens)) - expected).max() > 1e-2


def test_the_glm4_fixture_exercises_its_interleaved_partial_rope():
  # Loading skips the q/k reordering, or turns every dim: the logits move by more than 1e-2.
  from rlax_ps.models import hf
  tokens, expected = reference("glm4")
  model = fixture_model("glm4")
  assert model.config.rotary_dim == 8 and model.config.head_dim == 16
  whole = Transformer(model.config.replace(partial_rotary_factor=1.0), rngs=nnx.Rngs(0))
  nnx.update(whole, nnx.state(model, nnx.Param))
  unpermuted = Transformer(model.config, rngs=nnx.Rngs(0))
  nnx.update(unpermuted, nnx.state(model, nnx.Param))
  flat = {k: np.asarray(v) for k, v in flatten_params(unpermuted).items()}
  hf._permute_rotary(flat, model.config, inverse=True)
  assign_params(unpermuted, flat)
  for other in (whole, unpermuted):
    assert np.abs(np.asarray(forward(other, tokens)) - expected).max() > 1e-2


@pytest.mark.parametrize("change", ["correction_bias", "expert_groups"])
def test_the_glm4_moe_fixture_exercises_its_biased_group_limited_routing(change):
  # With the correction bias zeroed, or every group open to every token, the routers pick
  # other experts and the same weights give clearly different logits.
  tokens, expected = reference("glm4_moe")
  model = fixture_model("glm4_moe")
  assert (model.config.expert_groups, model.config.topk_groups) == (4, 2)
  params = {k: np.asarray(v) for k, v in flatten_params(model).items()}
  config = model.config
  if change == "correction_bias":
    params = {k: np.zeros_like(v) if k.endswith(change) else v for k, v in params.items()}
  else:
    config = config.replace(expert_groups=1, topk_groups=1)
  other = Transformer(config, rngs=nnx.Rngs(0))
  assign_params(other, params)
  assert np.abs(np.asarray(forward(other, tokens)) - expected).max() > 1e-2


def test_the_smollm3_fixture_exercises_its_layers_without_rope():
  # With RoPE on every layer the same weights give clearly different logits.
  tokens, expected = reference("smollm3")
  model = fixture_model("smollm3")
  assert model.config.nope_layers == (1, 3)
  roped = Transformer(model.config.replace(nope_layers=()), rngs=nnx.Rngs(0))
  nnx.update(roped, nnx.state(model, nnx.Param))
  assert np.abs(np.asarray(forward(roped, tokens)) - expected).max() > 1e-2


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3", "gemma2", "qwen3_moe",
                                  "mixtral", "olmo2", "olmo3", "qwen2_moe", "smollm3",
                                  "granite", "glm4", "gpt_oss", "glm4_moe", "deepseek_v3",
                                  "deepseek_v2", "olmoe"])
def test_packed_sequences_match_transformers(name):
  # Causal logits of a prefix equal the full row's first logits, so a row packing the first
  # 12 tokens of sequence 0 with the first 8 of sequence 1 must reproduce both references.
  tokens, expected = reference(name)
  packed = np.concatenate([tokens[0, :12], tokens[1, :8]])[None]
  positions = np.concatenate([np.arange(12), np.arange(8)])[None]
  segments = np.concatenate([np.full(12, 1), np.full(8, 2)])[None]
  logits = np.asarray(forward(fixture_model(name), packed, positions, segments))[0]
  assert np.abs(logits[:12] - expected[0, :12]).max() < TOLERANCE
  assert np.abs(logits[12:] - expected[1, :8]).max() < TOLERANCE


# Dense, windowed, softcapped, sinks, MoE and latent attention here; the rest (~1-2 s each)
# with the slow suite.
@pytest.mark.parametrize("name", ["llama", "mistral_window", "gemma2", "qwen3_moe", "gpt_oss",
                                  "deepseek_v3"] + [
    pytest.param(name, marks=pytest.mark.slow)
    for name in ("gemma3", "mixtral", "olmo3", "smollm3", "granite")])
def test_cached_decoding_matches_transformers(name):
  # A 14-token prefill then one token at a time: the windowed fixtures decode past the window.
  tokens, expected = reference(name)
  model = fixture_model(name)
  cache = KVCache.init(model.config, batch=2, max_len=tokens.shape[1])
  first, cache = decode(model, tokens[:, :14], cache)
  steps = [np.asarray(first)]
  for t in range(14, tokens.shape[1]):
    step, cache = decode(model, tokens[:, t:t + 1], cache)
    steps.append(np.asarray(step))
  assert np.abs(np.concatenate(steps, axis=1) - expected).max() < TOLERANCE


# Every family's logits and cached decoding are matched above; the sampling loop on top of
# them runs here for one of each attention kind, the rest (~1-3 s each) with the slow suite.
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral_window", "gemma3", "gemma2",
                                  "gpt_oss"] + [
    pytest.param(name, marks=pytest.mark.slow)
    for name in ("qwen3_moe", "mixtral", "olmo2", "olmo3", "qwen2_moe", "phi3", "smollm3",
                 "granite", "glm4", "glm4_moe", "deepseek_v3", "deepseek_v2", "olmoe")])
def test_greedy_generate_equals_transformers_greedy_generate(name):
  """greedy.npz: transformers' generate(do_sample=False) on left-padded prompts with an
  explicit attention mask (tests/fixtures/make_hf_fixtures.py)."""
  prompts, params, expected = _greedy_reference(name)
  got = generate(fixture_model(name), prompts, list(range(len(prompts))), params)
  for sample, want in zip(got, expected):
    assert list(sample.tokens) == want


def _greedy_reference(name):
  """(prompts, greedy SamplingParams, transformers' continuations up to eos) of greedy.npz."""
  ref = np.load(os.path.join(FIXTURES, name, "greedy.npz"))
  prompts = [list(row[mask.astype(bool)]) for row, mask in zip(ref["input_ids"],
                                                               ref["attention_mask"])]
  assert any(0 in p for p in prompts)  # a pad-id token inside a prompt stays a token
  params = SamplingParams(temperature=0.0, max_new_tokens=int(ref["new_tokens"].shape[1]),
                          stop_tokens=(int(ref["eos_token_id"]),))
  eos = ref["eos_token_id"]
  expected = [list(w[:int(np.argmax(w == eos)) + 1] if eos in w else w)
              for w in ref["new_tokens"]]
  return prompts, params, expected


@nnx.jit
def _load_balance(model, tokens, segment_ids):
  return model.hidden_states(tokens, segment_ids=segment_ids, record_routes=True)[2].load_balance


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_the_load_balancing_loss_equals_transformers_aux_loss(name):
  # router_aux.npz: output_router_logits=True's aux_loss, the padding masked out.
  ref = np.load(os.path.join(FIXTURES, name, "router_aux.npz"))
  assert ref["attention_mask"].min() == 0
  got = float(_load_balance(fixture_model(name), ref["tokens"], ref["attention_mask"]))
  assert abs(got - float(ref["aux_loss"])) < 1e-5
  unmasked = float(_load_balance(fixture_model(name), ref["tokens"],
                                 np.ones_like(ref["attention_mask"])))
  assert abs(unmasked - got) > 1e-4  # the padding's routes are left out


@pytest.mark.slow  # ~5 s
def test_gpt_oss_shared_prefill_decoding_equals_transformers_greedy_generate():
  # The samples read one prefix cache and merge two partials by log-sum-exp; the sinks
  # rescale the merged softmax, past the 6-token window.
  prompts, params, expected = _greedy_reference("gpt_oss")
  got = generate_shared(fixture_model("gpt_oss"), prompts, 2, [[i, i] for i in range(3)],
                        params)
  for group, want in zip(got, expected):
    assert [list(s.tokens) for s in group] == [want, want]
