"""Routing replay (mixture of experts): the sampler records the experts each token went to,
and the trainer's packed forward sends each token to those experts, weighted by its own
router's probabilities of them (so the router still learns). Replaying the router's own
picks changes nothing; other experts route as by hand; the recorded routes are what a full
forward of the sample picks; replayed, the trainer's log-probs are the sampler's, and the
router agreement says how often the trainer's routers would have picked alike."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks_lib import load_benchmark
from inference_workers.sampler import generate, generate_shared
from inference_workers.sampling import SamplingParams
from rlax_ps.models import ModelConfig, Transformer
from rlax_ps.models.transformer import MoE
from rlax_ps.train.rl_loss import response_logprobs
from rlax_ps.train.rollouts import BatchShape, Group, build_batch

CONFIG = ModelConfig(vocab_size=80, hidden_size=16, intermediate_size=32, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                     architecture="qwen3", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=8, norm_topk_prob=True, mlp_only_layers=(1,))
M, K = len(CONFIG.moe_layers), CONFIG.num_experts_per_tok
PROMPTS = [[1, 5, 9, 12, 3], [1, 7, 30]]


@pytest.fixture(scope="module")
def model():
  return Transformer(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def samples(model):
  params = SamplingParams(temperature=1.0, max_new_tokens=6)
  return generate_shared(model, PROMPTS, 2, [[0, 1], [2, 3]], params, record_routes=True)


def _distinct_routes(rng, shape):
  """Random expert ids [..., K], distinct along the last axis."""
  flat = np.stack([rng.permutation(CONFIG.num_experts)[:K]
                   for _ in range(int(np.prod(shape)))])
  return flat.reshape(*shape, K).astype(np.int32)


@nnx.jit(static_argnames="record")
def _hidden(model, tokens, routes=None, record=False):
  return model.hidden_states(tokens, routes=routes, record_routes=record)


def test_replaying_the_routers_own_picks_changes_nothing(model):
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 80, (2, 7)))
  x, _, routing = _hidden(model, tokens, record=True)
  picks = routing.picks
  assert picks.shape == (M, 2, 7, K) and picks.dtype == jnp.int32
  replayed, _ = _hidden(model, tokens, picks)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(x))
  # Other experts move the hidden states; -1 everywhere is the router's own choice again.
  other = _distinct_routes(np.random.default_rng(1), (M, 2, 7))
  assert (other != np.asarray(picks)).any()
  moved = np.asarray(_hidden(model, tokens, jnp.asarray(other))[0])
  assert np.abs(moved - x).max() > 1e-3
  remat = nnx.jit(lambda m, t, r: m.hidden_states(t, routes=r, remat=True)[0])
  np.testing.assert_allclose(np.asarray(remat(model, tokens, jnp.asarray(other))), moved,
                             atol=1e-6)
  np.testing.assert_array_equal(
      np.asarray(_hidden(model, tokens, jnp.full(picks.shape, -1, jnp.int16))[0]), x)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_experts_are_weighted_by_the_routers_probabilities(norm_topk_prob):
  moe = Transformer(CONFIG.replace(norm_topk_prob=norm_topk_prob), rngs=nnx.Rngs(2)).layers[0].mlp
  x = jax.random.normal(jax.random.key(0), (1, 6, CONFIG.hidden_size))
  replay = _distinct_routes(np.random.default_rng(3), (1, 6))
  replay[0, 2] = -1  # this token keeps the router's own picks
  out, stats = moe(x, jnp.asarray(replay))
  flat = x.reshape(6, -1)
  probs = np.asarray(jax.nn.softmax(moe.router(flat), -1))
  own_w, own = jax.lax.top_k(probs, K)
  want = np.zeros(flat.shape, np.float32)
  for t in range(6):
    experts = np.asarray(own[t]) if t == 2 else replay[0, t]
    w = probs[t, experts]
    w = w / w.sum() if norm_topk_prob else w
    combine = np.zeros((1, CONFIG.num_experts), np.float32)
    combine[0, experts] = w
    want[t] = np.asarray(moe.experts.every(flat[t:t + 1], jnp.asarray(combine)))[0]
  np.testing.assert_allclose(np.asarray(out).reshape(6, -1), want, atol=1e-6, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(stats.picked)[0], np.asarray(own))  # its own
  # The router keeps its gradient under replay.
  graphdef, state = nnx.split(moe)
  grad = jax.grad(lambda st: jnp.sum(nnx.merge(graphdef, st)(x, jnp.asarray(replay))[0] ** 2))(
      state)
  assert np.abs(np.asarray(grad["router"]["kernel"].value)).sum() > 0


def test_glm4_moe_records_its_biased_group_limited_picks_and_replays_them_exactly():
  # GLM-4.5 picks by sigmoid score + correction bias within each token's best 2 of 4 expert
  # groups: those picks (not the plain scores' top k) are the routes a sampler records.
  config = CONFIG.replace(architecture="glm4_moe", qk_norm=False, qkv_bias=True,
                          num_experts=8, router_scoring="sigmoid", expert_groups=4,
                          topk_groups=2)
  moe = MoE(config, rngs=nnx.Rngs(4))
  bias = np.random.default_rng(6).normal(0, 0.3, 8).astype(np.float32)
  moe.correction_bias.value = jnp.asarray(bias)
  x = jax.random.normal(jax.random.key(1), (1, 12, CONFIG.hidden_size))
  out, stats = moe(x)
  picked = np.asarray(stats.picked[0])
  scores = 1 / (1 + np.exp(-np.asarray(x[0] @ moe.router.kernel[...], np.float64)))
  biased = scores + bias
  groups = biased.reshape(12, 4, 2).sum(-1)  # a group's best two: both of its experts
  for t in range(12):
    open_groups = np.argsort(-groups[t])[:2]
    allowed = np.where(np.isin(np.arange(8) // 2, open_groups), biased[t], -np.inf)
    assert set(picked[t]) == set(np.argsort(-allowed)[:K])
  plain = np.argsort(-scores, -1)[:, :K]
  assert any(set(plain[t]) != set(picked[t]) for t in range(12))
  replayed, _ = moe(x, stats.picked)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(out))


def test_routes_of_the_wrong_shape_or_for_a_dense_model_are_refused(model):
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match=r"routes: expected shape \[moe layers=2, 1, 4, top_k=2\]"):
    model.hidden_states(tokens, routes=jnp.zeros((1, 1, 4, K), jnp.int32))
  dense = Transformer(CONFIG.replace(num_experts=0, num_experts_per_tok=0, mlp_only_layers=()),
                      rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="record_routes: a model without mixture-of-experts"):
    generate(dense, [[1, 2]], [0], SamplingParams(max_new_tokens=2), record_routes=True)


@pytest.mark.slow  # ~7 s
def test_the_sampler_records_the_experts_a_full_forward_picks(model, samples):
  for prompt, group in zip(PROMPTS, samples):
    for s in group:
      assert s.prompt_routes.shape == (len(prompt), M, K)
      assert s.routes.shape == (len(s.tokens) - 1, M, K)
      seq = jnp.asarray([prompt + s.tokens[:-1].tolist()])
      picks = _hidden(model, seq, record=True)[2].picks
      want = np.asarray(picks)[:, 0].transpose(1, 0, 2)  # [tokens, M, K]
      np.testing.assert_array_equal(s.prompt_routes, want[:len(prompt)])
      np.testing.assert_array_equal(s.routes, want[len(prompt):])
  # One prefill per sample records the same routes as the shared prefill.
  single = generate(model, [PROMPTS[1]], [2], SamplingParams(temperature=1.0, max_new_tokens=6),
                    record_routes=True)[0]
  np.testing.assert_array_equal(single.tokens, samples[1][0].tokens)
  np.testing.assert_array_equal(single.routes, samples[1][0].routes)
  np.testing.assert_array_equal(single.prompt_routes, samples[1][0].prompt_routes)


def _batch(samples, routes: str):
  """The packed batch of the sampled groups, with their recorded routes ("recorded"), with
  random ones ("random") or without ("none")."""
  rng = np.random.default_rng(5)
  groups = []
  for i, (prompt, group) in enumerate(zip(PROMPTS, samples)):
    extra = {}
    if routes == "recorded":
      extra = dict(prompt_routes=group[0].prompt_routes,
                   response_routes=tuple(s.routes for s in group))
    elif routes == "random":
      extra = dict(prompt_routes=_distinct_routes(rng, (len(prompt), M)),
                   response_routes=tuple(_distinct_routes(rng, (len(s.tokens) - 1, M))
                                         for s in group))
    groups.append(Group(i, np.asarray(prompt, np.int32), tuple(s.tokens for s in group),
                        tuple(s.logprobs for s in group), np.asarray([1.0, 0.0], np.float32),
                        0, **extra))
  shape = BatchShape(groups=2, samples=2, prompt_len=8, response_len=6, moe_layers=M,
                     top_k=K, num_experts=CONFIG.num_experts)
  return {k: jnp.asarray(v) for k, v in build_batch(groups, shape).items()}


@pytest.fixture(scope="module")
def trainer_logprobs(model):
  graphdef, state = nnx.split(model)
  fn = jax.jit(lambda st, b: response_logprobs(st, graphdef, b, "xla", with_stats=True))
  return lambda batch: jax.device_get(fn(state, batch))


@pytest.mark.slow  # ~6 s
def test_replayed_the_trainers_log_probs_are_the_samplers(samples, trainer_logprobs):
  batch = _batch(samples, "recorded")
  assert batch["prompt_routes"].dtype == jnp.int16
  logp, stats = trainer_logprobs(batch)
  lens = np.asarray(batch["response_lens"]).reshape(-1)
  behaviour = [s.logprobs for group in samples for s in group]
  for row, want in enumerate(behaviour):
    np.testing.assert_allclose(logp[row, :lens[row]], want, atol=1e-4)
  assert stats["router_agreement"] == 1.0  # same weights: the trainer picks alike
  # Groups without routes (-1 throughout) are routed by the trainer's routers.
  none_logp, none_stats = trainer_logprobs(_batch(samples, "none"))
  np.testing.assert_allclose(none_logp, logp, atol=1e-5)
  assert none_stats["router_agreement"] == 0.0  # nothing replayed
  # Other experts: other log-probs, and the agreement shows the mismatch.
  random_logp, random_stats = trainer_logprobs(_batch(samples, "random"))
  assert np.abs(random_logp - logp).max() > 1e-3
  assert 0.0 < random_stats["router_agreement"] < 0.9


def test_the_benchmarks_mismatch_statistics_on_a_hand_case():
  bench = load_benchmark("routing_replay")
  worker = np.log(np.array([0.5, 0.5, 0.2, 0.1]))
  trainer = np.log(np.array([0.5, 0.6, 0.12, 0.25]))  # ratios 1, 1.2, 0.6, 2.5
  got = bench.mismatch(trainer, worker)
  d = trainer - worker
  assert got["mean |dlogp|"] == pytest.approx(np.abs(d).mean())
  assert got["behaviour KL (k1)"] == pytest.approx(-d.mean())
  assert got["ratio outside [0.8, 1.25]"] == 0.5  # 0.6 and 2.5
  assert got["ratio outside [0.5, 2]"] == 0.25  # 2.5
  assert got["max |dlogp|"] == pytest.approx(np.log(2.5))


@pytest.mark.slow  # ~10 s
def test_the_load_balancing_term_joins_the_loss_with_its_coefficient(model, samples):
  from rlax_ps.train.rl_loss import LossConfig, rl_loss
  graphdef, state = nnx.split(model)
  batch = _batch(samples, "recorded")

  @functools.partial(jax.jit, static_argnums=1)
  def loss_and_grad(st, coef):
    def f(p):
      return rl_loss(p, graphdef, batch, None, num_groups=2,
                     cfg=LossConfig(backend="xla", router_aux_coef=coef))
    return jax.value_and_grad(f, has_aux=True)(st)

  (plain, metrics), grad = loss_and_grad(state, 0.0)
  (with_aux, _), grad_aux = loss_and_grad(state, 0.5)
  aux = float(metrics["router_aux_loss"])
  assert 1.0 <= aux <= CONFIG.num_experts  # E * sum f p: 1 when perfectly balanced
  assert abs(float(with_aux) - float(plain) - 0.5 * aux) < 1e-5
  router = lambda g: np.asarray(g["layers"][0]["mlp"]["router"]["kernel"].value)  # noqa: E731
  assert np.abs(router(grad_aux) - router(grad)).max() > 1e-6  # it trains the router
