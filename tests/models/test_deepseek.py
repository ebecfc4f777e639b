"""DeepSeek-V3 / V2 checkpoints (multi-head latent attention): the fixtures exercise what
their parity tests (test_hf_parity) check, the configs read as transformers reads them (the
Hub's sizes give the published parameter counts), what transformers cannot hold is refused by
field, and the packed RL loss, LoRA and routing replay work on latent attention."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from benchmarks_lib import load_benchmark
from hf_fixtures import FIXTURES, decode, fixture_model, forward, reference
from rl_grads import rl_loss_and_grads
from rlax_ps.models import (KVCache, ModelConfig, Transformer, assign_params, config_from_hf,
                            config_to_hf, flatten_params, load_hf_checkpoint,
                            save_hf_checkpoint)
from rlax_ps.models import rope
from rlax_ps.models.peft import peft_adapter_names

TOLERANCE = 1e-4

# The Hub's DeepSeek-V3 (671B parameters without its multi-token-prediction layer) and
# DeepSeek-V2-Lite (no q bottleneck, softmax routing over all 64 experts; 15.7B) config.json.
_WORKER_CACHE = load_benchmark("worker_cache")
DEEPSEEK_V3, DEEPSEEK_V2_LITE = _WORKER_CACHE.DEEPSEEK_V3, _WORKER_CACHE.DEEPSEEK_V2_LITE
# Latent attention without experts, q straight from q_proj, values half the q/k width.
DENSE_MLA = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=2, head_dim=8, kv_lora_rank=4,
                        qk_rope_head_dim=4, v_head_dim=4, architecture="deepseek_v2")


def read_json(path):
  with open(path) as f:
    return json.load(f)


def fixture_copy(tmp_path, name, tensors=None, **config_changes):
  """Fixture `name` in tmp_path with its tensors replaced and config.json changed."""
  src = os.path.join(FIXTURES, name)
  tensors = load_file(os.path.join(src, "model.safetensors")) if tensors is None else tensors
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  config = {**read_json(os.path.join(src, "config.json")), **config_changes}
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config, f)
  return str(tmp_path)


def max_diff(model, name):
  tokens, expected = reference(name)
  return float(np.abs(np.asarray(forward(model, tokens)) - expected).max())


def test_config_fields_read_from_the_hub_configs():
  v3 = config_from_hf(DEEPSEEK_V3)
  assert (v3.head_dim, v3.rotary_dim, v3.kv_lora_rank, v3.q_lora_rank, v3.v_head_dim,
          v3.num_kv_heads, v3.mlp_only_layers, v3.expert_groups, v3.topk_groups,
          v3.router_scoring, v3.shared_expert_intermediate_size) == (
              192, 64, 512, 1536, 128, 128, (0, 1, 2), 8, 4, "sigmoid", 2048)
  assert round(v3.num_params / 1e9) == 671
  # The softmax scale: 192**-0.5 times YaRN's mscale(40, mscale_all_dim=1)**2.
  assert v3.attention_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)
  lite = config_from_hf(DEEPSEEK_V2_LITE)
  assert (lite.q_lora_rank, lite.router_scoring, lite.expert_groups, lite.norm_topk_prob,
          lite.shared_expert_intermediate_size, lite.mlp_only_layers[-1]) == (
              0, "softmax", 1, False, 2816, 0)
  assert round(lite.num_params / 1e8) == 157
  # transformers' defaults where the file is silent (5.x's num_local_experts alias too).
  bare = {k: v for k, v in DEEPSEEK_V3.items() if k not in (
      "n_group", "topk_group", "first_k_dense_replace", "q_lora_rank", "n_routed_experts")}
  defaults = config_from_hf(dict(bare, num_local_experts=64))
  assert (defaults.expert_groups, defaults.topk_groups, defaults.mlp_only_layers,
          defaults.q_lora_rank, defaults.num_experts) == (8, 4, (0, 1, 2), 1536, 64)


def test_the_fixture_configs_round_trip_through_config_to_hf():
  for name in ("deepseek_v3", "deepseek_v2"):
    c = fixture_model(name).config
    assert config_from_hf(config_to_hf(c)) == c


@pytest.mark.parametrize("arch,change,field", [
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias"),
    ("deepseek_v3", {"q_lora_rank": 0}, "q_lora_rank"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "ModelConfig.num_kv_heads"),
    ("deepseek_v3", {"v_head_dim": 24}, "ModelConfig.v_head_dim")])
def test_configs_transformers_would_read_otherwise_are_refused_by_field(arch, change, field):
  d = read_json(os.path.join(FIXTURES, arch, "config.json"))
  with pytest.raises(ValueError, match=field):
    config_from_hf({**d, **change})


def test_configs_the_classes_cannot_hold_are_refused_on_export():
  v3, v2 = fixture_model("deepseek_v3").config, fixture_model("deepseek_v2").config
  with pytest.raises(ValueError, match="ModelConfig.router_scoring: DeepseekV2ForCausalLM"):
    config_to_hf(v3.replace(architecture="deepseek_v2"))
  with pytest.raises(ValueError, match="ModelConfig.norm_topk_prob: DeepseekV2ForCausalLM"):
    config_to_hf(v2.replace(norm_topk_prob=True))
  with pytest.raises(ValueError, match="ModelConfig.kv_lora_rank: LlamaForCausalLM has no"):
    config_to_hf(DENSE_MLA.replace(architecture="llama"))
  with pytest.raises(ValueError, match="ModelConfig.kv_lora_rank: DeepseekV3ForCausalLM needs"):
    config_to_hf(fixture_model("glm4_moe").config.replace(
        architecture="deepseek_v3", qkv_bias=False, qk_norm=False, partial_rotary_factor=1.0))


@pytest.mark.parametrize("field,value", [("qk_rope_head_dim", 16), ("qk_rope_head_dim", 3),
                                         ("v_head_dim", 0), ("num_kv_heads", 2),
                                         ("qk_norm", True), ("q_lora_rank", -1)])
def test_bad_latent_attention_fields_are_named(field, value):
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    fixture_model("deepseek_v3").config.replace(**{field: value})


def test_latent_attention_fields_without_it_are_named():
  with pytest.raises(ValueError, match="ModelConfig.v_head_dim: expected 0 without latent"):
    DENSE_MLA.replace(kv_lora_rank=0, qk_rope_head_dim=0)


def test_rope_interleave_false_reads_rotate_half_rows(tmp_path):
  # transformers' non-interleaved RoPE on rows de-interleaved (pairs to halves) is its
  # interleaved RoPE on the stored rows, so those rows with rope_interleave false give the
  # reference logits; the stored rows read as rotate-half clearly do not.
  c = read_json(os.path.join(FIXTURES, "deepseek_v3", "config.json"))
  nope, r, rank = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["kv_lora_rank"]
  halves = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
  q_rows = (np.arange(c["num_attention_heads"])[:, None] * (nope + r)
            + np.concatenate([np.arange(nope), nope + halves])).reshape(-1)
  tensors = load_file(os.path.join(FIXTURES, "deepseek_v3", "model.safetensors"))
  stored = dict(tensors)
  for k, v in tensors.items():
    if k.endswith("q_b_proj.weight"):
      tensors[k] = np.ascontiguousarray(v[q_rows])
    elif k.endswith("kv_a_proj_with_mqa.weight"):
      tensors[k] = np.ascontiguousarray(v[np.concatenate([np.arange(rank), rank + halves])])
  for sub in ("a", "b"):
    (tmp_path / sub).mkdir()
  assert max_diff(load_hf_checkpoint(fixture_copy(tmp_path / "a", "deepseek_v3", tensors,
                                                  rope_interleave=False)),
                  "deepseek_v3") < TOLERANCE
  assert max_diff(load_hf_checkpoint(fixture_copy(tmp_path / "b", "deepseek_v3", stored,
                                                  rope_interleave=False)),
                  "deepseek_v3") > 1e-2


@pytest.mark.parametrize("name,change", [
    ("deepseek_v3", "yarn"),  # YaRN's ramp and both mscales
    ("deepseek_v3", "mscale_all_dim"),  # the softmax scale's mscale**2 alone
    ("deepseek_v2", "groups")])  # group_limited_greedy
def test_the_fixtures_exercise_yarn_mscale_and_group_limited_routing(name, change):
  model = fixture_model(name)
  config = model.config
  if change == "yarn":
    config = config.replace(rope_scaling=None)
  elif change == "groups":
    config = config.replace(expert_groups=1, topk_groups=1)
  else:  # mscale_all_dim 0.8 -> 1 with the cos/sin factor kept as it was
    scaling = {**config.rope_scaling, "mscale_all_dim": 1.0,
               "attention_factor": rope.attention_scaling(config)}
    assert config.replace(rope_scaling=scaling).attention_scale > config.attention_scale
    config = config.replace(rope_scaling=scaling)
  other = Transformer(config, rngs=nnx.Rngs(0))
  assign_params(other, flatten_params(model))
  assert max_diff(other, name) > 1e-2


def test_multi_token_prediction_layers_are_skipped(tmp_path):
  tensors = load_file(os.path.join(FIXTURES, "deepseek_v3", "model.safetensors"))
  tensors["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)
  tensors["model.layers.3.self_attn.kv_b_proj.weight"] = np.zeros((80, 12), np.float32)
  model = load_hf_checkpoint(fixture_copy(tmp_path, "deepseek_v3", tensors,
                                          num_nextn_predict_layers=1))
  assert len(model.layers) == 3 and max_diff(model, "deepseek_v3") < TOLERANCE


@pytest.mark.slow  # ~4 s
def test_the_packed_rl_loss_trains_latent_attention_and_leaves_the_bias():
  model = fixture_model("deepseek_v3")
  loss, grad = rl_loss_and_grads(model, response_len=5, vocab_hi=70)
  assert np.isfinite(float(loss))
  attn = grad["layers"][1]["attn"]
  for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
    g = np.asarray(attn[name]["kernel"])
    assert np.isfinite(g).all() and np.abs(g).sum() > 0, name
  for norm in ("q_a_norm", "kv_a_norm"):
    assert np.abs(np.asarray(attn[norm]["scale"])).sum() > 0, norm
  assert not np.asarray(grad["layers"][1]["mlp"]["correction_bias"]).any()


def test_lora_adapts_the_latent_projections_and_merges_on_export(tmp_path):
  # With B away from 0 the adapters change the logits; the merged export reloads to them.
  base = fixture_model("deepseek_v3")
  config = base.config.replace(lora_rank=2, lora_targets=("q_b_proj", "kv_b_proj", "o_proj"))
  model = Transformer(config, rngs=nnx.Rngs(0))
  flat = {**flatten_params(base)}
  rng = np.random.default_rng(0)
  adapters = {k: jnp.asarray(rng.normal(0, 0.3, v.shape), jnp.float32)
              for k, v in flatten_params(model).items() if ".lora_" in k}
  assert len(adapters) == 2 * 3 * config.num_layers
  assign_params(model, {**flat, **adapters})
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert config.num_params == sum(int(np.prod(p.shape)) for p in params)
  tokens, _ = reference("deepseek_v3")
  want = np.asarray(forward(model, tokens))
  assert max_diff(model, "deepseek_v3") > 1e-2
  np.testing.assert_allclose(cached_logits(model, tokens), want, atol=TOLERANCE)  # absorbed
  save_hf_checkpoint(model, str(tmp_path))
  np.testing.assert_allclose(np.asarray(forward(load_hf_checkpoint(str(tmp_path)), tokens)),
                             want, atol=TOLERANCE)
  with pytest.raises(ValueError, match="model.lora_targets: deepseek_v3 checkpoints"):
    peft_adapter_names(config)


def cached_logits(model, tokens, prefill=12):
  """Logits of tokens [B, T] through the decoding cache: a prefill, then a token at a time."""
  cache = KVCache.init(model.config, batch=tokens.shape[0], max_len=tokens.shape[1])
  first, cache = decode(model, tokens[:, :prefill], cache)
  steps = [np.asarray(first)]
  for t in range(prefill, tokens.shape[1]):
    step, cache = decode(model, tokens[:, t:t + 1], cache)
    steps.append(np.asarray(step))
  return np.concatenate(steps, axis=1)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_cached_decoding_reads_one_latent_head_and_equals_the_uncached_forward(name):
  """The decoding cache holds one kv head per token, [normed latent, rotary key], read
  absorbed by every query head; logits equal the decompressed uncached forward's."""
  model = fixture_model(name)
  c, (tokens, _) = model.config, reference(name)
  cache = KVCache.init(c, batch=2, max_len=tokens.shape[1])
  assert cache.k[0].shape == (2, tokens.shape[1], 1, c.kv_lora_rank + c.qk_rope_head_dim)
  assert cache.v == ()  # the values are the latent part of the keys
  np.testing.assert_allclose(cached_logits(model, tokens), np.asarray(forward(model, tokens)),
                             atol=1e-5)


@pytest.mark.parametrize("kv_dtype,heads_before", [("bfloat16", 128 * (192 + 128) * 2),
                                                   ("int8", 128 * (192 + 128) + 2 * 128 * 4)])
def test_the_hub_deepseek_v3_worker_cache_holds_the_latent_per_token(kv_dtype, heads_before):
  """DeepSeek-V3's worker cache per token and layer: kv_lora_rank + qk_rope_head_dim = 576
  values (int8: and one scale), 71x less than 128 heads' keys (192) and values (128)."""
  v3 = config_from_hf(DEEPSEEK_V3)
  width = 576 * (2 if kv_dtype == "bfloat16" else 1) + (4 if kv_dtype == "int8" else 0)
  assert _WORKER_CACHE.cache_bytes_per_token_layer(v3, kv_dtype) == width
  assert _WORKER_CACHE.decompressed_bytes_per_token_layer(v3, kv_dtype) == heads_before
  assert jax.eval_shape(lambda: KVCache.init(v3, 1, 1)).k[0].shape == (1, 1, 1, 576)


@pytest.mark.slow  # ~5 s
def test_an_int8_worker_decodes_latent_attention_from_the_latent_cache():
  """Int8 weights: the absorbed heads use kv_b_proj's codes times their scales, so cached
  logits equal the int8 model's own uncached ones."""
  from inference_workers.weights import HeldPolicy
  from rlax_ps import sync
  base = fixture_model("deepseek_v3")
  params = {k: np.asarray(v) for k, v in flatten_params(base).items()}
  policy = HeldPolicy(base.config, "int8")
  policy.apply(sync.encode(None, params, "int8", version=0))
  tokens, _ = reference("deepseek_v3")
  np.testing.assert_allclose(cached_logits(policy.model, tokens),
                             np.asarray(forward(policy.model, tokens)), atol=1e-4)


def test_group_limited_routes_are_recorded_and_replayed_exactly():
  moe = fixture_model("deepseek_v2").layers[1].mlp
  x = jax.random.normal(jax.random.key(1), (1, 12, 32))
  out, stats = moe(x)
  scores = jax.nn.softmax(np.asarray(x[0]) @ np.asarray(moe.router.kernel[...]), -1)
  best_group = np.argmax(np.asarray(scores).reshape(12, 2, 4).max(-1), -1)
  assert (np.asarray(stats.picked[0]) // 4 == best_group[:, None]).all()
  replayed, _ = moe(x, stats.picked)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(out))


def test_a_model_config_from_scratch_builds_latent_attention():
  model = Transformer(DENSE_MLA, rngs=nnx.Rngs(0))
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert DENSE_MLA.num_params == sum(int(np.prod(p.shape)) for p in params)
  assert forward(model, np.zeros((1, 3), np.int32)).shape == (1, 3, 40)


@pytest.mark.slow  # the Pallas kernel interpreted on CPU
@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_packed_response_logprobs_by_either_kernel_equal_separate_forwards(backend):
  # Values zero-padded to the q/k width go through the shared-prompt kernels unchanged.
  from rlax_ps.kernels import pack_group, packed_response_logprobs
  from rlax_ps.kernels.schedule import BlockSizes
  model = fixture_model("deepseek_v3")
  tokens, _ = reference("deepseek_v3")
  prompt, responses = tokens[:1, :6], tokens[:, 6:10][None]
  lens = np.asarray([[4, 3]], np.int32)
  packed, layout = pack_group(prompt, np.asarray([6]), responses, lens)
  got = packed_response_logprobs(model, packed, responses, layout, backend=backend,
                                 interpret=backend == "pallas_tpu",
                                 block_sizes=BlockSizes(8, 8))
  rows = np.concatenate([np.repeat(prompt, 2, 0), responses[0]], 1)
  logp = jax.nn.log_softmax(np.asarray(forward(model, rows))[:, 5:9], -1)
  want = np.take_along_axis(np.asarray(logp), responses[0][..., None], -1)[..., 0]
  for n in range(2):
    np.testing.assert_allclose(np.asarray(got)[0, n, :lens[0, n]], want[n, :lens[0, n]],
                               atol=TOLERANCE)


@pytest.mark.slow  # ~4 s; test_hf_parity checks greedy decoding with one cache per sample
def test_shared_prefill_decoding_equals_transformers_greedy_generate():
  from inference_workers.sampler import generate_shared
  from test_hf_parity import _greedy_reference
  prompts, params, expected = _greedy_reference("deepseek_v3")
  got = generate_shared(fixture_model("deepseek_v3"), prompts, 2, [[i, i] for i in range(3)],
                        params)
  for group, want in zip(got, expected):
    assert [list(s.tokens) for s in group] == [want, want]
