"""Whole model: per-response log-probs (and their parameter gradients) of a packed
group equal those of the N separate sequences."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_ps.kernels.packing import pack_group, packed_response_logprobs, response_logit_index
from rlax_ps.kernels.schedule import BlockSizes
from rlax_ps.models import ModelConfig, Transformer

B, N, P, R, V = 2, 3, 9, 5, 64
PROMPT_LENS = np.array([9, 4])
RESPONSE_LENS = np.array([[5, 1, 3], [2, 5, 0]])


@pytest.fixture(scope="module")
def group():
  cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=4, num_kv_heads=2)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, V, (B, P))
  responses = rng.integers(1, V, (B, N, R))
  return graphdef, state, prompts, responses


@pytest.fixture(scope="module")
def windowed_group():
  """A Gemma shaped model: a 3-position sliding window with its own RoPE base on layer 0
  (it cuts both prompts and the responses), full attention on layer 1, a non-default
  softmax scale, soft-capped attention and output logits, sandwich and zero-centred norms."""
  cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                    architecture="gemma3", hidden_act="gelu_tanh", zero_centered_norms=True,
                    scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=5,
                    sliding_window=3, layer_types=("sliding_attention", "full_attention"),
                    rope_local_theta=100.0, tie_word_embeddings=True,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
  # Weights 20x the init's std put the raw attention and output logits past both caps.
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(1)))
  state = jax.tree.map(lambda x: x * 20, state)
  model = nnx.merge(graphdef, state)
  raw = model.project_logits(model.hidden_states(jnp.arange(P)[None])[0])
  assert float(jnp.abs(raw).max()) > 2 * cfg.final_logit_softcapping
  rng = np.random.default_rng(1)
  return graphdef, state, rng.integers(1, V, (B, P)), rng.integers(1, V, (B, N, R))


@pytest.fixture(scope="module")
def sink_group():
  """A gpt-oss shaped model: attention sinks (far from 0) that rescale each softmax by its
  log-sum-exp in the packed path, a 3-position window on layer 0, q/k/v/o biases, biased
  experts with the clamped SwiGLU."""
  cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=8, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, architecture="gpt_oss",
                    qkv_bias=True, attention_out_bias=True, attention_sinks=True,
                    sliding_window=3, layer_types=("sliding_attention", "full_attention"),
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                    norm_topk_prob=True, moe_bias=True, swiglu_limit=0.5)
  model = Transformer(cfg, rngs=nnx.Rngs(2))
  rng = np.random.default_rng(2)
  for layer in model.layers:
    layer.attn.sinks.value = jnp.asarray(rng.normal(0.0, 2.0, 4), jnp.float32)
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x * 10 if x.ndim > 1 else x, state)  # the clamp binds
  return graphdef, state, rng.integers(1, V, (B, P)), rng.integers(1, V, (B, N, R))


def _separate_rows(prompts, responses):
  """N independent [prompt, response i] rows (numpy), and where each response token is scored."""
  toks = np.zeros((B * N, P + R), np.int32)
  seg = np.zeros((B * N, P + R), np.int32)
  idx = np.zeros((B * N, R), np.int32)
  for b in range(B):
    for i in range(N):
      row = list(prompts[b, :PROMPT_LENS[b]]) + list(responses[b, i, :RESPONSE_LENS[b, i]])
      toks[b * N + i, :len(row)] = row
      seg[b * N + i, :len(row)] = 1
      idx[b * N + i] = np.minimum(PROMPT_LENS[b] - 1 + np.arange(R), P + R - 1)
  return toks, seg, idx


def _separate_logprobs(graphdef, state, prompts, responses):
  """The stock model (default attention) on the N separate rows."""
  toks, seg, idx = _separate_rows(prompts, responses)
  logits = nnx.merge(graphdef, state)(jnp.asarray(toks), segment_ids=jnp.asarray(seg))
  logp = jax.nn.log_softmax(jnp.take_along_axis(logits, jnp.asarray(idx)[..., None], 1), -1)
  out = jnp.take_along_axis(logp, jnp.asarray(responses).reshape(B * N, R, 1), -1)
  valid = np.arange(R)[None, None] < RESPONSE_LENS[:, :, None]
  return jnp.where(valid, out.reshape(B, N, R), 0.0)


def _packed_logprobs(graphdef, state, prompts, responses, **kw):
  tokens, lay = pack_group(prompts, PROMPT_LENS, responses, RESPONSE_LENS)
  return packed_response_logprobs(nnx.merge(graphdef, state), tokens, responses, lay, **kw)


@pytest.mark.parametrize("kw", [dict(backend="xla"),
                                dict(backend="pallas_tpu", interpret=True,
                                     block_sizes=BlockSizes(8, 8))], ids=["xla", "pallas"])
def test_packed_logprobs_equal_separate_sequences(group, kw):
  graphdef, state, prompts, responses = group
  want = jax.jit(lambda st: _separate_logprobs(graphdef, st, prompts, responses))(state)
  got = jax.jit(lambda st: _packed_logprobs(graphdef, st, prompts, responses, **kw))(state)
  assert np.all(np.asarray(want)[np.arange(R)[None, None] < RESPONSE_LENS[:, :, None]] < 0)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


# Pallas slow (suite time): test_packed_logprobs_equal_separate_sequences[pallas] holds the
# packed kernel path, tests/kernels/test_shared_prompt_window.py its window.
@pytest.mark.parametrize("kw", [dict(backend="xla"),
                                pytest.param(dict(backend="pallas_tpu", interpret=True,
                                                  block_sizes=BlockSizes(8, 8)),
                                             marks=pytest.mark.slow)], ids=["xla", "pallas"])
def test_packed_logprobs_of_a_sliding_window_model_equal_separate_sequences(windowed_group, kw):
  test_packed_logprobs_equal_separate_sequences(windowed_group, kw)


# Pallas slow (suite time): the sinks-pallas_tpu gradient case below runs its forward pass.
@pytest.mark.parametrize("kw", [dict(backend="xla"),
                                pytest.param(dict(backend="pallas_tpu", interpret=True,
                                                  block_sizes=BlockSizes(8, 8)),
                                             marks=pytest.mark.slow)], ids=["xla", "pallas"])
def test_packed_logprobs_of_a_model_with_attention_sinks_equal_separate_sequences(sink_group,
                                                                                   kw):
  test_packed_logprobs_equal_separate_sequences(sink_group, kw)


# Sinks through XLA (~7 s) with the slow suite: the Pallas case holds the sinks' gradient.
# Windowed (~4 s) too: full-xla holds the packed gradient, the windowed logprobs test the window.
@pytest.mark.parametrize("which,backend", [("full", "xla"),
                                           pytest.param("windowed", "xla", marks=pytest.mark.slow),
                                           pytest.param("sinks", "xla", marks=pytest.mark.slow),
                                           ("sinks", "pallas_tpu")])
def test_packed_param_gradients_equal_separate_sequences(group, windowed_group, sink_group,
                                                         which, backend):
  graphdef, state, prompts, responses = {"full": group, "windowed": windowed_group,
                                         "sinks": sink_group}[which]
  loss = lambda fn: jax.jit(jax.grad(
      lambda st: fn(graphdef, st, prompts, responses).sum()))(state)
  want = loss(_separate_logprobs)
  extra = dict(interpret=True, block_sizes=BlockSizes(8, 8)) if backend == "pallas_tpu" else {}
  got = loss(functools.partial(_packed_logprobs, backend=backend, **extra))
  for (path, g), (_, w) in zip(jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_first_response_token_is_read_at_last_prompt_token():
  _, lay = pack_group(np.zeros((B, P)), PROMPT_LENS, np.zeros((B, N, R)), RESPONSE_LENS)
  idx = np.asarray(response_logit_index(lay))
  np.testing.assert_array_equal(idx[:, :, 0], np.repeat(PROMPT_LENS[:, None] - 1, N, 1))
  np.testing.assert_array_equal(idx[0, 1, 1:], P + R + np.arange(R - 1))


def test_pack_group_rejects_bad_response_shape():
  with pytest.raises(ValueError, match=r"response_tokens must be \[B=2, N, R\]"):
    pack_group(np.zeros((B, P)), PROMPT_LENS, np.zeros((B, R)), RESPONSE_LENS)


def test_packed_entropy_equals_the_entropy_of_each_separate_next_token_distribution(group):
  graphdef, state, prompts, responses = group
  toks, seg, idx = _separate_rows(prompts, responses)
  logits = nnx.merge(graphdef, state)(jnp.asarray(toks), segment_ids=jnp.asarray(seg))
  p = np.asarray(jax.nn.softmax(jnp.take_along_axis(logits, jnp.asarray(idx)[..., None], 1), -1),
                 np.float64)
  want = (-(p * np.log(p)).sum(-1)).reshape(B, N, R)
  valid = np.arange(R)[None, None] < RESPONSE_LENS[:, :, None]
  logp, entropy = _packed_logprobs(graphdef, state, prompts, responses, backend="xla",
                                   with_entropy=True)
  np.testing.assert_allclose(logp, _separate_logprobs(graphdef, state, prompts, responses),
                             atol=2e-5)
  np.testing.assert_allclose(np.asarray(entropy)[valid], want[valid], atol=2e-5, rtol=1e-5)
  assert np.all(np.asarray(entropy)[~valid] == 0) and np.all(want[valid] > 0.1)


@pytest.mark.parametrize("chunk", [0, 4], ids=["whole", "chunked"])
def test_log_probs_at_a_temperature_are_of_the_logits_over_it(group, chunk):
  """What a worker sampling at temperature 0.7 draws from: softmax(logits / 0.7)."""
  graphdef, state, prompts, responses = group
  toks, seg, idx = _separate_rows(prompts, responses)
  logits = nnx.merge(graphdef, state)(jnp.asarray(toks), segment_ids=jnp.asarray(seg))
  logp = jax.nn.log_softmax(jnp.take_along_axis(logits, jnp.asarray(idx)[..., None], 1) / 0.7)
  want = jnp.take_along_axis(logp, jnp.asarray(responses).reshape(B * N, R, 1), -1)
  valid = np.arange(R)[None, None] < RESPONSE_LENS[:, :, None]
  want = np.where(valid, np.asarray(want).reshape(B, N, R), 0.0)
  got = _packed_logprobs(graphdef, state, prompts, responses, backend="xla", temperature=0.7,
                         logits_chunk=chunk)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  plain = _packed_logprobs(graphdef, state, prompts, responses, backend="xla")
  assert np.abs(np.asarray(plain) - want)[valid].max() > 1e-2


# A chunk past the row and remat alone (~3 s each) with the slow suite: remat-chunk holds both.
@pytest.mark.parametrize("kw", [dict(logits_chunk=4), dict(logits_chunk=7),
                                pytest.param(dict(logits_chunk=64), marks=pytest.mark.slow),
                                pytest.param(dict(remat=True), marks=pytest.mark.slow),
                                dict(remat=True, logits_chunk=4)],
                         ids=["chunk-divides", "chunk-does-not", "chunk-exceeds", "remat",
                              "remat-chunk"])
def test_chunked_logits_and_remat_give_the_same_logprobs_entropy_and_gradients(group, kw):
  graphdef, state, prompts, responses = group

  def loss(st, **kw):
    logp, ent = _packed_logprobs(graphdef, st, prompts, responses, backend="xla",
                                 with_entropy=True, **kw)
    return jnp.sum(logp * jnp.arange(1, R + 1)), (logp, ent)

  (want, (lp, ent)), g_want = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  (got, (lp_c, ent_c)), g_got = jax.jit(jax.value_and_grad(
      functools.partial(loss, **kw), has_aux=True))(state)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(lp_c, lp, atol=2e-5)
  np.testing.assert_allclose(ent_c, ent, atol=2e-5)
  for (path, a), (_, b) in zip(jax.tree.leaves_with_path(g_got), jax.tree.leaves_with_path(g_want)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("chunk", [0, 4], ids=["whole", "chunked"])
def test_a_teachers_top_tokens_and_the_policys_log_probs_of_them_are_each_positions(group,
                                                                                    chunk):
  """packed_response_topk: the response tokens' log-probs and the k most likely next tokens
  at each response position with theirs, as the separate rows' distributions give them
  (one forward pass); `targets`: the packed
  path's log-probs of given ids there, after the entropy (whole rows or chunked)."""
  from rlax_ps.kernels.packing import packed_response_topk
  graphdef, state, prompts, responses = group
  toks, seg, idx = _separate_rows(prompts, responses)
  logits = nnx.merge(graphdef, state)(jnp.asarray(toks), segment_ids=jnp.asarray(seg))
  logp = np.asarray(jax.nn.log_softmax(
      jnp.take_along_axis(logits, jnp.asarray(idx)[..., None], 1), -1)).reshape(B, N, R, V)
  valid = np.arange(R)[None, None] < RESPONSE_LENS[:, :, None]
  tokens, lay = pack_group(prompts, PROMPT_LENS, responses, RESPONSE_LENS)
  sampled, ids, top = packed_response_topk(nnx.merge(graphdef, state), tokens, responses, lay,
                                           3, backend="xla", logits_chunk=chunk)
  ids, top = np.asarray(ids), np.asarray(top)
  np.testing.assert_allclose(sampled, _separate_logprobs(graphdef, state, prompts, responses),
                             atol=2e-5)
  np.testing.assert_array_equal(ids[valid], np.argsort(-logp, -1, kind="stable")[..., :3][valid])
  np.testing.assert_allclose(top[valid], np.sort(logp, -1)[..., ::-1][..., :3][valid],
                             atol=2e-5)
  assert not ids[~valid].any() and not top[~valid].any()
  targets = np.random.default_rng(3).integers(0, V, (B, N, R, 2))
  got_logp, _, at = _packed_logprobs(graphdef, state, prompts, responses, backend="xla",
                                     with_entropy=True, targets=targets, logits_chunk=chunk)
  np.testing.assert_allclose(np.asarray(at)[valid],
                             np.take_along_axis(logp, targets, -1)[valid], atol=2e-5)
  np.testing.assert_allclose(got_logp, _separate_logprobs(graphdef, state, prompts, responses),
                             atol=2e-5)
  assert not np.asarray(at)[~valid].any()


def test_remat_wraps_each_layer_and_the_chunks_in_a_checkpoint(group):
  graphdef, state, prompts, responses = group

  def count(**kw):
    jaxpr = jax.make_jaxpr(lambda st: jnp.sum(_packed_logprobs(
        graphdef, st, prompts, responses, backend="xla", **kw)))(state)
    return str(jaxpr).count("remat2[")  # jax.checkpoint's primitive

  layers = len(nnx.merge(graphdef, state).layers)
  assert count() == 0
  assert count(remat=True) == layers
  assert count(remat=True, logits_chunk=4) == layers + 1
