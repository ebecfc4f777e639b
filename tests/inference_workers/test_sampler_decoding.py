"""The jitted sampler: greedy exactness, log-probs, truncation, stops, seeds, the shared prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inference_workers import sampler
from inference_workers.sampler import generate, generate_shared
from inference_workers.sampling import GREEDY_SEED, SamplingParams
from rlax_ps.kernels.reference import decode_two_pass
from rlax_ps.models import ModelConfig, Transformer
from inference_workers.sampling import SamplingParams, choose_tokens, step_keys

CONFIG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, qkv_bias=True, architecture="qwen2")
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]  # two lengths: padding in play
NEW = 6


@pytest.fixture(scope="module")
def model():
  return Transformer(CONFIG, rngs=nnx.Rngs(0))


FULL_LEN = 32  # every full-recompute forward pads to this: one compile (causal, so exact)


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def full_logits(model, prompt, generated):
  """Logits after every position of prompt + generated, by a full forward without a cache."""
  seq = list(prompt) + list(map(int, generated))
  tokens = np.zeros((1, FULL_LEN), np.int32)
  tokens[0, :len(seq)] = seq
  return np.asarray(_forward(model, jnp.asarray(tokens))[0, len(prompt) - 1:len(seq) - 1])


@pytest.fixture(scope="module")
def sampled(model):
  """Temperature-1 samples of both prompts (the plain sampling program, compiled once)."""
  return generate(model, PROMPTS, [11, 12], SamplingParams(max_new_tokens=NEW))


def test_greedy_equals_full_recompute_argmax(model):
  out = generate(model, PROMPTS, [0, 0], SamplingParams(greedy=True, max_new_tokens=NEW))
  for prompt, sample in zip(PROMPTS, out):
    seq = list(prompt)
    for _ in range(NEW):  # step by step, each step a full forward of everything so far
      seq.append(int(np.argmax(full_logits(model, seq, [0])[-1])))
    assert sample.tokens.tolist() == seq[len(prompt):]
    assert sample.finish_reason == "length"
    np.testing.assert_array_equal(sample.sampling_logprobs, 0.0)


def test_a_row_seeded_greedy_decodes_greedily_beside_sampled_rows(model, sampled):
  """GREEDY_SEED (ReMax's baseline sample) makes its row greedy; the other rows draw as
  they would without it."""
  out = generate(model, PROMPTS, [11, GREEDY_SEED], SamplingParams(max_new_tokens=NEW))
  greedy = generate(model, PROMPTS, [0, 0], SamplingParams(greedy=True, max_new_tokens=NEW))
  assert out[0].tokens.tolist() == sampled[0].tokens.tolist()
  assert out[1].tokens.tolist() == greedy[1].tokens.tolist() != sampled[1].tokens.tolist()
  np.testing.assert_array_equal(out[1].sampling_logprobs, 0.0)
  np.testing.assert_allclose(out[1].logprobs, greedy[1].logprobs, rtol=1e-6)
  with pytest.raises(ValueError, match="seeds: expected ints"):
    generate(model, PROMPTS, [11, -2], SamplingParams(max_new_tokens=NEW))


def test_logprobs_equal_log_softmax_at_chosen_tokens(model, sampled):
  for prompt, sample in zip(PROMPTS, sampled):
    logits = full_logits(model, prompt, sample.tokens)
    want = jax.nn.log_softmax(logits, axis=-1)[np.arange(NEW), sample.tokens]
    np.testing.assert_allclose(sample.logprobs, want, atol=1e-5)
    # Temperature 1, no truncation: the sampling distribution is the model's.
    np.testing.assert_allclose(sample.sampling_logprobs, want, atol=1e-5)


def test_sampling_logprobs_follow_the_temperature(model):
  out = generate(model, PROMPTS[:1], [5], SamplingParams(temperature=0.5, max_new_tokens=NEW))[0]
  logits = full_logits(model, PROMPTS[0], out.tokens)
  want = jax.nn.log_softmax(logits / 0.5, axis=-1)[np.arange(NEW), out.tokens]
  np.testing.assert_allclose(out.sampling_logprobs, want, atol=1e-4)


def test_top_k_restricts_support_and_the_behaviour_logprob_is_the_tempered_policys(model):
  """The behaviour log-prob is of softmax(logits / T), what the trainer's ratios are of: of
  the renormalised top k, every on-policy ratio was the kept mass < 1."""
  params = SamplingParams(temperature=2.0, top_k=3, max_new_tokens=NEW)
  out = generate(model, PROMPTS, [7, 8], params)
  for prompt, sample in zip(PROMPTS, out):
    logits = full_logits(model, prompt, sample.tokens) / 2.0
    top3 = np.argsort(-logits, axis=-1)[:, :3]
    assert all(t in row for t, row in zip(sample.tokens, top3))
    want = jax.nn.log_softmax(logits, axis=-1)[np.arange(NEW), sample.tokens]
    np.testing.assert_allclose(sample.sampling_logprobs, want, atol=1e-4)


def test_top_p_keeps_only_the_nucleus(model):
  params = SamplingParams(temperature=3.0, top_p=0.3, max_new_tokens=NEW)
  out = generate(model, PROMPTS, [1, 2], params)
  for prompt, sample in zip(PROMPTS, out):
    probs = np.asarray(jax.nn.softmax(full_logits(model, prompt, sample.tokens) / 3.0, axis=-1))
    for step, token in enumerate(sample.tokens):
      order = np.argsort(-probs[step])
      mass_before = np.cumsum(probs[step][order]) - probs[step][order]
      nucleus = set(order[mass_before < 0.3].tolist())
      assert int(token) in nucleus
      assert len(nucleus) < CONFIG.vocab_size  # the test is not vacuous


def test_stop_token_stops_and_is_kept(model):
  greedy = generate(model, PROMPTS[:1], [0], SamplingParams(greedy=True, max_new_tokens=NEW))[0]
  stop = int(greedy.tokens[2])
  first = greedy.tokens.tolist().index(stop)
  out = generate(model, PROMPTS[:1], [0], SamplingParams(greedy=True, max_new_tokens=NEW,
                                                         stop_tokens=(stop,)))[0]
  assert out.tokens.tolist() == greedy.tokens[:first + 1].tolist()
  assert out.finish_reason == "stop"


def test_seed_alone_decides_a_sample(model, sampled):
  again = generate(model, PROMPTS[::-1], [12, 11], SamplingParams(max_new_tokens=NEW))
  assert again[1].tokens.tolist() == sampled[0].tokens.tolist()
  assert again[0].tokens.tolist() == sampled[1].tokens.tolist()
  other = generate(model, PROMPTS, [13, 14], SamplingParams(max_new_tokens=NEW))
  assert any(a.tokens.tolist() != b.tokens.tolist() for a, b in zip(other, sampled))


def test_shared_prefix_gives_the_unshared_samples(model):
  n = 3
  seeds = [[21, 22, 23], [24, 25, 26]]
  params = SamplingParams(max_new_tokens=NEW)
  shared = generate_shared(model, PROMPTS, n, seeds, params)
  flat_prompts = [p for p in PROMPTS for _ in range(n)]
  unshared = generate(model, flat_prompts, [s for row in seeds for s in row], params)
  for b in range(len(PROMPTS)):
    for j in range(n):
      a, u = shared[b][j], unshared[b * n + j]
      assert a.tokens.tolist() == u.tokens.tolist()
      np.testing.assert_allclose(a.logprobs, u.logprobs, atol=1e-5)
      assert a.finish_reason == u.finish_reason


def test_shared_prefix_takes_a_pluggable_decode_function(model):
  calls = []

  def counting(*args, **kwargs):
    calls.append(args[0].shape)
    return decode_two_pass(*args, **kwargs)

  params = SamplingParams(greedy=True, max_new_tokens=NEW)
  out = generate_shared(model, PROMPTS[:1], 2, [[0, 1]], params, decode_fn=counting)
  base = generate(model, PROMPTS[:1], [0], params)[0]
  assert calls and calls[0][:2] == (1, 2)  # q is [B prompts, N samples, heads, head_dim]
  assert out[0][0].tokens.tolist() == base.tokens.tolist() == out[0][1].tokens.tolist()


def test_prompt_lengths_in_one_bucket_share_one_program(model, sampled):
  before = sampler._generate_jit._cache_size()
  generate(model, [[1] * 9, [2] * 16], [0, 1], SamplingParams(max_new_tokens=NEW - 1))
  assert sampler._generate_jit._cache_size() == before


def test_bad_input_is_named():
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    SamplingParams(max_new_tokens=0)


def test_bad_prompts_and_seeds_are_named(model):
  with pytest.raises(ValueError, match="seeds"):
    generate(model, PROMPTS, [0], SamplingParams())
  with pytest.raises(ValueError, match=r"prompts\[1\]"):
    generate(model, [[1], [CONFIG.vocab_size]], [0, 1], SamplingParams())
  with pytest.raises(ValueError, match="seeds: expected shape"):
    generate_shared(model, PROMPTS, 2, [[0, 1]], SamplingParams())


def test_sampling_params_take_numpy_numbers(model, sampled):
  """Numbers read from numpy arrays (np.int64 ids, np.float32 temperature) are the numbers
  they hold: the same samples as Python's."""
  params = SamplingParams(temperature=np.float32(1.0), top_p=np.float64(1.0),
                          top_k=np.int32(0), max_new_tokens=np.int64(NEW),
                          stop_tokens=np.array([], np.int64))
  assert params == SamplingParams(max_new_tokens=NEW)
  assert SamplingParams(stop_tokens=(np.int64(3), 1)).stop_tokens == (1, 3)
  again = generate(model, PROMPTS, np.array([11, 12]), params)
  assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in sampled]


@pytest.mark.parametrize("field, value", [
    ("greedy", "no"),  # truthy: it made the sampler greedy
    ("top_k", True),  # a bool is not top-1
    ("temperature", True),
    ("temperature", float("inf")),  # every token equally likely
    ("stop_tokens", 3),  # TypeError: 'int' object is not iterable
    ("stop_tokens", "3"),
])
def test_bad_sampling_params_are_named(field, value):
  with pytest.raises(ValueError, match=f"SamplingParams.{field}: expected"):
    SamplingParams(**{field: value})


def test_malformed_prompts_and_seeds_are_named(model):
  """Wrong shapes and float ids fail naming the argument before anything compiles, instead
  of a TypeError from len() or a float silently cut to an int."""
  params = SamplingParams(max_new_tokens=NEW)
  with pytest.raises(ValueError, match="seeds: expected a sequence of 1 ints"):
    generate(model, PROMPTS[:1], 0, params)
  with pytest.raises(ValueError, match="seeds: expected a sequence"):
    generate(model, PROMPTS[:1], [0.5], params)
  with pytest.raises(ValueError, match=r"prompts\[0\]: expected a sequence of int token ids"):
    generate(model, [1, 2, 3], [0, 1, 2], params)
  with pytest.raises(ValueError, match=r"prompts\[1\]: expected a sequence of int token ids"):
    generate(model, [[1, 2], [1.5, 2.0]], [0, 1], params)
  with pytest.raises(ValueError, match="seeds: expected ints"):
    generate_shared(model, PROMPTS, 2, [[0.5, 1.0], [2.0, 3.0]], params)


def test_shared_prefix_takes_a_numpy_n(model):
  params = SamplingParams(greedy=True, max_new_tokens=NEW)
  out = generate_shared(model, PROMPTS[:1], np.int64(2), np.array([[0, 1]]), params)
  base = generate(model, PROMPTS[:1], [0], params)[0]
  assert [s.tokens.tolist() for s in out[0]] == [base.tokens.tolist()] * 2


def test_one_row_draws_afresh_at_each_step():
  """Uniform logits over 50 tokens: 32 steps of one seed give many different tokens (one
  key reused at every step would draw the same token every time)."""
  mode = SamplingParams().mode
  logits = jnp.zeros((1, 50), jnp.float32)
  seeds = jnp.asarray([7], jnp.int32)
  drawn = [int(choose_tokens(logits, step_keys(seeds, t), mode, 1.0, 1.0)[0][0])
           for t in range(32)]
  assert len(set(drawn)) > 10
