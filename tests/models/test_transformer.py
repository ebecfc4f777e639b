"""The model's forward: caching, packing, padding, dtypes and param plumbing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_ps.models import KVCache, ModelConfig, Transformer, assign_params, flatten_params

CONFIG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, qkv_bias=True, architecture="qwen2")


@nnx.jit
def _forward(model, tokens, positions=None, segment_ids=None, cache=None):
  return model(tokens, positions=positions, segment_ids=segment_ids, cache=cache)


@pytest.fixture(scope="module")
def model():
  return Transformer(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (2, 9), 0, CONFIG.vocab_size)


def test_incremental_decoding_with_cache_matches_full_forward(model, tokens):
  full = _forward(model, tokens)
  cache = KVCache.init(CONFIG, batch=2, max_len=12)
  prefix, cache = _forward(model, tokens[:, :5], cache=cache)
  steps = [prefix]
  for t in range(5, 9):
    step, cache = _forward(model, tokens[:, t:t + 1], cache=cache)
    steps.append(step)
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=2e-5)
  assert int(cache.index) == 9



def test_tokens_past_the_cache_are_refused(model, tokens):
  """A prefill longer than the cache (a TypeError deep in the slice write before), in jit or
  not, and an eager decode step past its end (clamped over the last slot: wrong logits)
  name the cache's max_len."""
  with pytest.raises(ValueError, match="overflow a KVCache of max_len=4"):
    _forward(model, tokens[:, :6], cache=KVCache.init(CONFIG, batch=2, max_len=4))
  _, cache = model(tokens[:, :4], cache=KVCache.init(CONFIG, batch=2, max_len=4))
  with pytest.raises(ValueError, match="1 new tokens after 4 filled slots overflow"):
    model(tokens[:, 4:5], cache=cache)

def test_packed_row_equals_separate_sequences(model, tokens):
  a, b = tokens[0, :4], tokens[1, :5]
  packed = jnp.concatenate([a, b])[None]
  positions = jnp.concatenate([jnp.arange(4), jnp.arange(5)])[None]
  segments = jnp.concatenate([jnp.full(4, 1), jnp.full(5, 2)])[None]
  out = _forward(model, packed, positions, segments)
  np.testing.assert_allclose(out[0, :4], _forward(model, a[None])[0], atol=2e-5)
  np.testing.assert_allclose(out[0, 4:], _forward(model, b[None])[0], atol=2e-5)


def test_left_padding_does_not_change_real_tokens(model, tokens):
  real = tokens[:1, :6]
  padded = jnp.concatenate([jnp.zeros((1, 3), real.dtype), real], axis=1)
  positions = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), jnp.arange(6)[None]], axis=1)
  segments = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 6), jnp.int32)], axis=1)
  out = _forward(model, padded, positions, segments)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out[:, 3:], _forward(model, real), atol=2e-5)


def test_bfloat16_params_and_compute_stay_close_to_float32(model, tokens):
  bf16 = Transformer(CONFIG.replace(param_dtype="bfloat16", dtype="bfloat16"), rngs=nnx.Rngs(0))
  assign_params(bf16, flatten_params(model))
  assert flatten_params(bf16)["layers.0.mlp.up_proj.kernel"].dtype == jnp.bfloat16
  out = _forward(bf16, tokens)
  assert out.dtype == jnp.float32
  ref = _forward(model, tokens)
  assert float(jnp.max(jnp.abs(out - ref))) < 0.05 * float(jnp.max(jnp.abs(ref))) + 1e-2


def test_tied_embeddings_have_no_lm_head_and_use_the_table(tokens):
  tied = Transformer(CONFIG.replace(tie_word_embeddings=True), rngs=nnx.Rngs(3))
  params = flatten_params(tied)
  assert not any(name.startswith("lm_head") for name in params)
  params["embed.embedding"] = params["embed.embedding"] * 2.0
  before = _forward(tied, tokens)
  assign_params(tied, params)
  assert not np.allclose(before, _forward(tied, tokens))


def test_param_names_and_partition_annotations(model):
  params = flatten_params(model)
  assert params["layers.1.attn.q_proj.kernel"].shape == (32, 4 * 8)
  assert params["layers.1.attn.k_proj.bias"].shape == (2 * 8,)
  assert params["lm_head.kernel"].shape == (32, 61)
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  assert tuple(specs["layers"][0]["attn"]["o_proj"]["kernel"].get_value()) == ("tensor", "fsdp")
  assert tuple(specs["embed"]["embedding"].get_value()) == ("tensor", "fsdp")


def test_assign_params_names_the_bad_tensor(model):
  params = dict(flatten_params(model))
  bad = dict(params, **{"layers.0.mlp.down_proj.kernel": jnp.zeros((3, 3))})
  with pytest.raises(ValueError, match="layers.0.mlp.down_proj.kernel"):
    assign_params(model, bad)
  missing = {k: v for k, v in params.items() if k != "norm.scale"}
  with pytest.raises(KeyError, match="norm.scale"):
    assign_params(model, missing)
  with pytest.raises(KeyError, match="layers.9.attn"):
    assign_params(model, dict(params, **{"layers.9.attn.q_proj.kernel": jnp.zeros(1)}))


@pytest.mark.parametrize("field,value,match", [
    ("num_kv_heads", 3, "num_kv_heads"),
    ("dtype", "float16", "dtype"),
    ("architecture", "gpt2", "architecture"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_type"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "original_max_position_embeddings"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ("hidden_act", "relu", "hidden_act"),
    ("sliding_window", 0, "sliding_window"),
    ("layer_types", ("sliding_attention",), "layer_types"),
    ("layer_types", ("local",) * 2, "layer_types"),
    ("query_pre_attn_scalar", -1.0, "query_pre_attn_scalar"),
    ("max_position_embeddings", 0, "max_position_embeddings"),  # accepted before
    ("rope_theta", -1.0, "rope_theta"),  # accepted before: NaN logits
    ("rms_norm_eps", -1e-6, "rms_norm_eps"),
    ("head_dim", 0, "head_dim"),  # named partial_rotary_factor before
    ("vocab_size", True, "vocab_size"),
])
def test_config_rejects_bad_fields_by_name(field, value, match):
  with pytest.raises(ValueError, match=match):
    CONFIG.replace(**{field: value})



def test_config_takes_numpy_ints_as_sizes():
  """Sizes read from arrays (np.int64) are the ints they hold (a ValueError before)."""
  config = CONFIG.replace(vocab_size=np.int64(61), hidden_size=np.int32(32),
                          max_position_embeddings=np.int64(128))
  assert config == CONFIG.replace(max_position_embeddings=128)
  assert type(config.vocab_size) is int and type(config.max_position_embeddings) is int

def test_tokens_must_be_two_dimensional(model):
  with pytest.raises(ValueError, match="tokens"):
    model(jnp.zeros((4,), jnp.int32))


def test_num_params_counts_every_parameter(model):
  counted = sum(int(np.prod(v.shape)) for v in flatten_params(model).values())
  assert CONFIG.num_params == counted
  for other in (CONFIG.replace(qk_norm=True, sandwich_norms=True, tie_word_embeddings=True),
                CONFIG.replace(qk_norm=True, qk_norm_across_heads=True, post_norms=True)):
    params = flatten_params(Transformer(other, rngs=nnx.Rngs(0)))
    assert other.num_params == sum(int(np.prod(v.shape)) for v in params.values())
