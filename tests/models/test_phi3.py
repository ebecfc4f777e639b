"""Phi-3 / Phi-4 checkpoints beyond the logits (test_hf_parity): fused qkv_proj and
gate_up_proj load into separate kernels, RoPE turns only the leading partial_rotary_factor of
each head, LongRoPE's short and long factors each equal transformers' (per call, or fixed
for a run so its trainer and workers agree, packed and cached decoding included), legacy
configs read, bad ones are named, and an int8 worker computes the dequantized logits."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hf_fixtures import FIXTURES, decode, fixture_config, fixture_model, forward
from inference_workers.weights import HeldPolicy
from rlax_ps import config_files, sync
from rlax_ps.models import (KVCache, ModelConfig, Transformer, assign_params, config_from_hf,
                            config_to_hf, flatten_params, longest_sequence, model_config_from)
from rlax_ps.models import rope
from safetensors.numpy import load_file

FIXTURE = os.path.join(FIXTURES, "phi3")
REF = np.load(os.path.join(FIXTURE, "reference.npz"))
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model():
  return fixture_model("phi3")


def with_factors(model, long):
  other = Transformer(model.config.replace(rope_long_factors=long), rngs=nnx.Rngs(0))
  nnx.update(other, nnx.state(model, nnx.Param))
  return other


def test_fused_tensors_split_into_the_kernels(model):
  hf = load_file(os.path.join(FIXTURE, "model.safetensors"))
  p = flatten_params(model)
  qkv = hf["model.layers.1.self_attn.qkv_proj.weight"]
  q, kv = model.config.num_heads * 8, model.config.num_kv_heads * 8
  np.testing.assert_array_equal(np.asarray(p["layers.1.attn.k_proj.kernel"]), qkv[q:q + kv].T)
  gate_up = hf["model.layers.1.mlp.gate_up_proj.weight"]
  np.testing.assert_array_equal(np.asarray(p["layers.1.mlp.up_proj.kernel"]),
                                gate_up[model.config.intermediate_size:].T)


def test_short_and_long_factors_each_equal_transformers(model):
  short, full = REF["short_tokens"], REF["tokens"]
  assert short.shape[1] == model.config.rope_scaling["original_max_position_embeddings"]
  # Per call (None): the short prefix takes the short factors, the full rows the long ones.
  assert np.abs(np.asarray(forward(model, short)) - REF["short_logits"]).max() < TOLERANCE
  assert np.abs(np.asarray(forward(model, full)) - REF["logits"]).max() < TOLERANCE
  # Fixed for a run: the same, and the other set clearly differs, so each is checked.
  long_model, short_model = with_factors(model, True), with_factors(model, False)
  assert np.abs(np.asarray(forward(short_model, short)) - REF["short_logits"]).max() < TOLERANCE
  assert np.abs(np.asarray(forward(long_model, full)) - REF["logits"]).max() < TOLERANCE
  assert np.abs(np.asarray(forward(long_model, short)) - REF["short_logits"]).max() > 1e-2
  assert np.abs(np.asarray(forward(short_model, full)) - REF["logits"]).max() > 1e-2


def test_packed_rows_and_cached_decoding_with_fixed_long_factors(model):
  # As in a run whose sequences outgrow the original context: every token long, prefixes
  # packed into one row and a cached decode reproduce the reference rows.
  long_model = with_factors(model, True)
  packed = np.concatenate([REF["tokens"][0, :12], REF["tokens"][1, :8]])[None]
  positions = np.concatenate([np.arange(12), np.arange(8)])[None]
  segments = np.concatenate([np.full(12, 1), np.full(8, 2)])[None]
  logits = np.asarray(forward(long_model, packed, positions, segments))[0]
  assert np.abs(logits[:12] - REF["logits"][0, :12]).max() < TOLERANCE
  assert np.abs(logits[12:] - REF["logits"][1, :8]).max() < TOLERANCE
  cache = KVCache.init(long_model.config, batch=2, max_len=20)
  steps = []
  for start, stop in [(0, 14)] + [(t, t + 1) for t in range(14, 20)]:
    out, cache = decode(long_model, REF["tokens"][:, start:stop], cache)
    steps.append(np.asarray(out))
  assert np.abs(np.concatenate(steps, axis=1) - REF["logits"]).max() < TOLERANCE


def test_rope_turns_only_the_leading_dims():
  x = jax.random.normal(jax.random.key(0), (1, 3, 2, 8))
  cos, sin = rope.rotary_angles(jnp.arange(3)[None], np.array([1.0, 0.5], np.float32))
  y = rope.apply_rotary(x, cos, sin)
  np.testing.assert_array_equal(np.asarray(y[..., 4:]), np.asarray(x[..., 4:]))
  np.testing.assert_allclose(np.asarray(y[..., :4]),
                             np.asarray(rope.apply_rotary(x[..., :4], cos, sin)))
  assert np.abs(np.asarray(y[:, 1:, :, :4] - x[:, 1:, :, :4])).max() > 1e-2


def test_config_fields_legacy_types_and_bad_configs():
  c = config_from_hf(fixture_config("phi3"))
  assert (c.architecture, c.partial_rotary_factor, c.rotary_dim, c.sliding_window) == (
      "phi3", 0.5, 4, 6)
  assert c.rope_scaling["short_factor"] == (1.0, 1.5) and c.rope_long_factors is None
  old = fixture_config("phi3", "config_4x.json")
  assert old["rope_scaling"]["type"] == "longrope" and config_from_hf(old) == c
  # Phi-3's first configs call it "su"; transformers reads that, and "yarn", as LongRoPE.
  su = dict(old, rope_scaling=dict(old["rope_scaling"], type="su"))
  assert config_from_hf(su) == c
  # Phi3Config holds original_max_position_embeddings (4096 when left out) over the rope dict's.
  no_original = {k: v for k, v in old.items() if k != "original_max_position_embeddings"}
  assert config_from_hf(no_original).rope_scaling["original_max_position_embeddings"] == 4096
  with pytest.raises(ValueError, match=r"ModelConfig.rope_scaling.long_factor: expected 2"):
    c.replace(rope_scaling=dict(c.rope_scaling, long_factor=[1.0, 2.0, 3.0]))
  with pytest.raises(ValueError, match="ModelConfig.partial_rotary_factor"):
    c.replace(partial_rotary_factor=0.1)  # 0.8 of a dim
  llama = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=1, partial_rotary_factor=0.5)
  with pytest.raises(ValueError, match="ModelConfig.partial_rotary_factor: LlamaForCausalLM"):
    config_to_hf(llama)


@pytest.mark.parametrize("prompt,response,want", [(10, 8, False), (10, 9, True)])
def test_an_rl_recipe_fixes_the_factors_by_its_longest_sequence(prompt, response, want):
  # The trainer and the workers both build their config this way (train/run.py,
  # inference_workers/cli.py), so they turn every token alike.
  recipe = config_files.load("configs/rl_instruct.py", "tiny")
  recipe.rl.max_prompt_tokens, recipe.worker.max_new_tokens = prompt, response
  assert longest_sequence(recipe) == prompt + response
  got = model_config_from(recipe.model, 80, FIXTURE, longest_sequence(recipe))
  assert got.rope_long_factors is want
  assert model_config_from(recipe.model, 80, FIXTURE).rope_long_factors is None
  sft = config_files.load("configs/sft_tiny.py", "tiny")
  assert longest_sequence(sft) == 0  # packed SFT rows: transformers' per-call choice


def test_an_int8_worker_computes_the_dequantized_models_logits(model):
  params = {k: np.asarray(v) for k, v in flatten_params(model).items()}
  policy = HeldPolicy(model.config, "int8")
  policy.apply(sync.encode(None, params, "int8", version=0))
  reference = Transformer(model.config, rngs=nnx.Rngs(0))
  assign_params(reference, sync.dequantize(sync.held_state(params, "int8")))
  tokens = REF["tokens"]
  np.testing.assert_allclose(np.asarray(forward(policy.model, tokens)),
                             np.asarray(forward(reference, tokens)), atol=2e-3, rtol=2e-3)
