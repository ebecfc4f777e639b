"""Mixture-of-experts layers (Qwen3-MoE): the grouped dispatch (TPU, GPU) and the CPU's
all-experts one equal routing each token by hand, the TPU and CUDA programs multiply only the
chosen experts' rows, the packed RL loss trains the router and the experts, a worker holding
the bf16 keyframe computes the trainer's logits and samples with a shared prefill as with
separate ones, and one holding int8 experts (scales per expert, routers bf16) computes the
dequantized model's logits by either dispatch. GLM-4.5's sigmoid routing: its correction
bias and expert groups move the picks (by hand), not their weights, and training leaves the
bias as loaded."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inference_workers.sampler import generate, generate_shared
from inference_workers.sampling import SamplingParams
from inference_workers.weights import HeldPolicy
import optax

from rlax_ps import sync
from rlax_ps.optim import make_optimizer
from rlax_ps.models import ModelConfig, Transformer, assign_params, flatten_params
from rlax_ps.models.transformer import MoE
from rlax_ps.sync.bits import BF16
from rl_grads import rl_loss_and_grads

CONFIG = ModelConfig(vocab_size=80, hidden_size=16, intermediate_size=32, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     architecture="qwen3", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=8, norm_topk_prob=True, mlp_only_layers=(1,))
# Qwen2-MoE: a shared expert beside the routed ones, weights not renormalised.
SHARED = CONFIG.replace(architecture="qwen2_moe", qk_norm=False, qkv_bias=True,
                        norm_topk_prob=False, shared_expert_intermediate_size=12)
# gpt-oss: attention sinks, an output-projection bias, a biased router, biased experts with
# the clamped SwiGLU.
GPT_OSS = CONFIG.replace(architecture="gpt_oss", qk_norm=False, qkv_bias=True,
                         attention_out_bias=True, attention_sinks=True, moe_bias=True,
                         swiglu_limit=0.05)
# GLM-4.5: sigmoid scores chosen with a correction bias, experts in 2 groups of 2 (each token
# picks from the best group), weights renormalised and scaled by 2.5, an ungated shared expert.
GLM = CONFIG.replace(architecture="glm4_moe", qkv_bias=True, router_scoring="sigmoid",
                     expert_groups=2, topk_groups=1, routed_scaling_factor=2.5,
                     shared_expert_intermediate_size=8, shared_expert_gated=False)
# DeepSeek-V3: GLM-4.5's routing beside latent attention (q through a rank-8 bottleneck, k/v
# from a rank-6 latent, 4 of each head's 8 q/k dims rotary, 6-wide values).
DEEPSEEK = GLM.replace(architecture="deepseek_v3", qk_norm=False, qkv_bias=False,
                       num_kv_heads=4, kv_lora_rank=6, q_lora_rank=8, qk_rope_head_dim=4,
                       v_head_dim=6)
# DeepSeek-V2's group_limited_greedy: softmax scores, a group scored by its best expert.
DEEPSEEK_V2 = CONFIG.replace(architecture="deepseek_v2", router_scoring="softmax",
                             group_scoring="max", expert_groups=2, topk_groups=1,
                             norm_topk_prob=False)


@pytest.fixture(scope="module")
def model():
  return Transformer(CONFIG, rngs=nnx.Rngs(0))


@nnx.jit
def forward(model, tokens):
  return model(tokens)


def _silu_mlp(x, gate, up, down):
  g = x @ gate
  return ((g / (1 + np.exp(-g))) * (x @ up)) @ down


def _by_hand(moe, x, norm_topk_prob):
  """(routed, shared): each token through its top-k experts one at a time, and through the
  shared expert gated (zeros without one), in float64."""
  p = {k: np.asarray(v, np.float64) for k, v in flatten_params(moe).items()}
  flat = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
  logits = flat @ p["router.kernel"]
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out, shared = np.zeros_like(flat), np.zeros_like(flat)
  for t in range(flat.shape[0]):
    top = np.argsort(-probs[t])[:moe.top_k]
    w = probs[t, top] / (probs[t, top].sum() if norm_topk_prob else 1.0)
    for e, we in zip(top, w):
      out[t] += we * _silu_mlp(flat[t],
                               *(p[f"experts.{n}_proj"][e] for n in ("gate", "up", "down")))
    if "shared_expert_gate.kernel" in p:
      gate = 1 / (1 + np.exp(-(flat[t] @ p["shared_expert_gate.kernel"])))
      shared[t] = gate * _silu_mlp(flat[t], *(p[f"shared_expert.{n}_proj.kernel"]
                                              for n in ("gate", "up", "down")))
  return out.reshape(x.shape), shared.reshape(x.shape)


@pytest.mark.parametrize("norm_topk_prob,shared", [(True, 0), (False, 0), (False, 12)])
def test_both_dispatches_equal_routing_each_token_by_hand(norm_topk_prob, shared):
  config = CONFIG.replace(norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=shared)
  moe = Transformer(config, rngs=nnx.Rngs(1)).layers[0].mlp
  x = jax.random.normal(jax.random.key(0), (2, 7, CONFIG.hidden_size))
  routed, shared_out = _by_hand(moe, x, norm_topk_prob)
  assert (np.abs(shared_out).max() > 1e-4) == bool(shared)  # 10x the tolerance below
  np.testing.assert_allclose(np.asarray(moe(x)[0]), routed + shared_out, atol=1e-5, rtol=1e-5)
  flat = x.reshape(-1, CONFIG.hidden_size)
  weights, chosen, *_ = moe.route(flat)
  for got in (moe.grouped(flat, weights, chosen), moe.every(flat, weights, chosen)):
    np.testing.assert_allclose(np.asarray(got).reshape(x.shape), routed, atol=1e-5, rtol=1e-5)
  # Every expert is used somewhere, so the test covers the whole sort and scatter.
  probs = jax.nn.softmax(x.reshape(-1, CONFIG.hidden_size) @ moe.router.kernel[...], -1)
  assert len(set(np.asarray(jax.lax.top_k(probs, 2)[1]).ravel().tolist())) == 4


def _ragged_dots(model, platform):
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))
  text = jax.export.export(fn, platforms=[platform])(
      state, jax.ShapeDtypeStruct((2, 5), jnp.int32)).mlir_module()
  return len(re.findall(r"chlo\.ragged_dot\b(?!\.)", text))


@pytest.mark.parametrize("platform,grouped", [("tpu", 3 * 2), ("cuda", 3 * 2), ("cpu", 0)])
def test_tpu_and_gpu_multiply_only_the_chosen_experts_rows(model, platform, grouped):
  # Three grouped matmuls (gate, up, down) per sparse layer (0 and 2; layer 1 is dense) on
  # TPU and GPU; the CPU program runs every expert instead.
  assert _ragged_dots(model, platform) == grouped
  assert CONFIG.num_params == sum(int(np.prod(v.shape)) for v in flatten_params(model).values())


def test_the_packed_rl_loss_trains_the_router_and_the_experts(model):
  _, grad = rl_loss_and_grads(model, response_len=5, vocab_hi=70)
  for i in (0, 2):
    mlp = grad["layers"][i]["mlp"]
    for g in (mlp["router"]["kernel"], *mlp["experts"].values()):
      g = np.asarray(g)
      assert np.isfinite(g).all() and np.abs(g).sum() > 0
  assert "gate_proj" in grad["layers"][1]["mlp"]  # the dense layer


@pytest.mark.slow  # ~3 s; the int8 worker test below holds an MoE keyframe by default
def test_a_worker_holding_the_bf16_keyframe_computes_the_trainers_logits(model):
  params = {k: np.asarray(v) for k, v in flatten_params(model).items()}
  policy = HeldPolicy(CONFIG, "bf16")
  policy.apply(sync.encode(None, params, "bf16", version=0))
  bf16 = Transformer(CONFIG.replace(param_dtype="bfloat16"), rngs=nnx.Rngs(0))
  assign_params(bf16, {k: jnp.asarray(v, jnp.bfloat16) for k, v in params.items()})
  tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 9))
  np.testing.assert_array_equal(np.asarray(forward(policy.model, tokens)),
                                np.asarray(forward(bf16, tokens)))
  np.testing.assert_allclose(np.asarray(forward(policy.model, tokens)),
                             np.asarray(forward(model, tokens)), atol=0.05)


@pytest.mark.slow  # ~8 s; test_sampler_decoding covers shared prefills by default
def test_shared_prefill_samples_as_one_prefill_per_sample(model):
  params = SamplingParams(temperature=1.0, max_new_tokens=6)
  prompts = [[1, 5, 9, 12], [1, 7]]
  seeds = [[0, 1], [2, 3]]
  shared = generate_shared(model, prompts, 2, seeds, params)
  single = generate(model, [p for p in prompts for _ in range(2)], sum(seeds, []), params)
  for b, group in enumerate(shared):
    for j, sample in enumerate(group):
      np.testing.assert_array_equal(sample.tokens, single[b * 2 + j].tokens)
      np.testing.assert_allclose(sample.logprobs, single[b * 2 + j].logprobs, atol=1e-4)


# The shared expert and GLM's grouped routing (~2 s each) with the slow suite: their int8
# weights are the routed case's (gpt-oss's stacked expert biases and sinks stay bf16).
@pytest.mark.parametrize("config", [CONFIG, pytest.param(SHARED, marks=pytest.mark.slow), GPT_OSS,
                                    pytest.param(GLM, marks=pytest.mark.slow), DEEPSEEK],
                         ids=["routed", "shared-expert", "gpt-oss", "glm4-moe", "deepseek"])
def test_an_int8_worker_computes_the_dequantized_models_logits_by_either_dispatch(config):
  model = Transformer(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(3)  # biases and sinks away from their zero init
  params = {k: np.asarray(v) + (rng.normal(0, 0.3, v.shape).astype(np.float32)
                                if k.endswith(("bias", "sinks")) else 0)
            for k, v in flatten_params(model).items()}
  held = sync.held_state(params, "int8")
  assert held["layers.0.mlp.experts.gate_proj.scale"].shape == (4, 8)  # per expert, channel
  assert held["layers.0.mlp.router.kernel"].dtype == BF16  # routes as the trainer does
  if config.moe_bias:  # expert biases [E, out] stay bf16, as other biases do
    assert held["layers.0.mlp.experts.gate_bias"].dtype == BF16
    assert held["layers.0.attn.sinks"].dtype == BF16
  policy = HeldPolicy(config, "int8")
  policy.apply(sync.encode(None, params, "int8", version=0))
  reference = Transformer(config, rngs=nnx.Rngs(0))
  assign_params(reference, sync.dequantize(held))
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, (2, 9))
  np.testing.assert_allclose(np.asarray(forward(policy.model, tokens)),
                             np.asarray(forward(reference, tokens)), atol=2e-3, rtol=2e-3)
  # The TPU/GPU dispatch of the int8 experts (each row scaled by its own expert's scales)
  # equals the CPU one and the dequantized experts.
  moe, want = policy.model.layers[2].mlp, reference.layers[2].mlp
  flat = jax.random.normal(jax.random.key(2), (14, CONFIG.hidden_size))
  weights, chosen, *_ = want.route(flat)
  expected = np.asarray(want.every(flat, weights, chosen))
  for got in (moe.grouped(flat, weights, chosen), moe.every(flat, weights, chosen)):
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-3, rtol=2e-3)
  assert _ragged_dots(policy.model, "tpu") == 3 * 2


@pytest.mark.parametrize("bias,groups,want", [
    ((0, 0, 0, 0), 1, (0, 1)),  # the best two scores
    ((0, 0, 0.5, 0), 1, (0, 2)),  # the bias lifts expert 2 past expert 1
    ((0, 0, 0.5, 0), 2, (0, 1)),  # ... but its group {2, 3} sums lower than {0, 1}
    ((0, 0, 0.5, 0.6), 2, (2, 3))])  # ... unless expert 3's bias lifts that group too
def test_the_correction_bias_and_groups_move_the_picks_not_their_weights(bias, groups, want):
  moe = MoE(GLM.replace(expert_groups=groups), rngs=nnx.Rngs(0))
  logits = np.array([2.0, 1.0, 0.0, -1.0])  # sigmoid: 0.881, 0.731, 0.5, 0.269
  kernel = np.zeros((GLM.hidden_size, 4), np.float32)
  kernel[0] = logits
  moe.router.kernel.value = jnp.asarray(kernel)
  moe.correction_bias.value = jnp.asarray(bias, jnp.float32)
  x = jnp.zeros((1, GLM.hidden_size)).at[0, 0].set(1.0)
  weights, chosen, picked, _ = moe.route(x)
  np.testing.assert_array_equal(chosen, picked)
  order = np.argsort(np.asarray(chosen[0]))
  assert tuple(np.asarray(chosen[0])[order]) == want
  scores = 1 / (1 + np.exp(-logits[list(want)]))  # the plain scores weigh them
  np.testing.assert_allclose(np.asarray(weights[0])[order], 2.5 * scores / scores.sum(),
                             rtol=1e-6)


@pytest.mark.parametrize("groups,want", [
    (1, (0, 2)),  # the best two softmax scores
    (2, (0, 1))])  # ... within the group {0, 1} holding the best single score
def test_deepseek_v2_groups_are_scored_by_their_best_expert(groups, want):
  # Group {2, 3} sums higher (0.9 + 0.8) than {0, 1} (1.0 + 0.0) but its best is lower.
  moe = MoE(DEEPSEEK_V2.replace(expert_groups=groups, routed_scaling_factor=2.0),
            rngs=nnx.Rngs(0))
  logits = np.array([1.0, 0.0, 0.9, 0.8])
  kernel = np.zeros((CONFIG.hidden_size, 4), np.float32)
  kernel[0] = logits
  moe.router.kernel.value = jnp.asarray(kernel)
  x = jnp.zeros((1, CONFIG.hidden_size)).at[0, 0].set(1.0)
  weights, chosen, _, _ = moe.route(x)
  order = np.argsort(np.asarray(chosen[0]))
  assert tuple(np.asarray(chosen[0])[order]) == want
  probs = np.exp(logits) / np.exp(logits).sum()  # not renormalised, times 2
  np.testing.assert_allclose(np.asarray(weights[0])[order], 2 * probs[list(want)], rtol=1e-6)


def test_training_leaves_the_correction_bias_as_loaded():
  # The bias only moves the picks: no gradient reaches it, AdamW does not decay a vector,
  # so a step changes the router and keeps the bias bit for bit (published unchanged).
  moe = MoE(GLM, rngs=nnx.Rngs(0))
  moe.correction_bias.value = jnp.asarray([0.1, -0.2, 0.3, 0.05])
  graphdef, state = nnx.split(moe)
  params = state.to_pure_dict()
  x = jax.random.normal(jax.random.key(0), (2, 7, GLM.hidden_size))
  loss = lambda p: jnp.sum(nnx.merge(graphdef, nnx.State(p))(x)[0] ** 2)  # noqa: E731
  optimizer = make_optimizer({"warmup_steps": 0}, total_steps=10)

  @jax.jit
  def step(params):
    grad = jax.grad(loss)(params)
    updates, _ = optimizer.update(grad, optimizer.init(params), params)
    return grad, optax.apply_updates(params, updates)

  grad, stepped = step(params)
  assert not np.asarray(grad["correction_bias"]).any()
  np.testing.assert_array_equal(stepped["correction_bias"], params["correction_bias"])
  assert np.abs(np.asarray(stepped["router"]["kernel"] - params["router"]["kernel"])).max() > 0
  shapes = jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: Transformer(GLM, rngs=nnx.Rngs(0))),
                                     nnx.Param))
  assert GLM.num_params == sum(int(np.prod(v.shape)) for v in shapes)


@pytest.mark.parametrize("field,value", [("num_experts_per_tok", 5), ("moe_intermediate_size", 0),
                                         ("mlp_only_layers", (3,)), ("decoder_sparse_step", 0),
                                         ("router_scoring", "tanh"), ("expert_groups", 2),
                                         ("topk_groups", 2), ("routed_scaling_factor", 0.0),
                                         ("group_scoring", "mean")])
def test_bad_expert_fields_are_named(field, value):
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    CONFIG.replace(**{field: value})


def test_bad_glm4_moe_routing_fields_are_named():
  # Groups hold >= 2 experts each, and the groups a token may pick from hold its top k.
  with pytest.raises(ValueError, match="ModelConfig.topk_groups"):
    GLM.replace(num_experts_per_tok=3)
  with pytest.raises(ValueError, match="ModelConfig.expert_groups"):
    GLM.replace(expert_groups=3)
  with pytest.raises(ValueError, match="ModelConfig.router_scoring"):
    GLM.replace(num_experts=0, num_experts_per_tok=0, expert_groups=1,
                shared_expert_intermediate_size=0)
