"""min_p sampling (vLLM V1's order: temperature, min-p, top-k, top-p): the kept set, the
behaviour log-probs of the distribution sampled from, the worker's setting and its errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inference_workers.decoding import Sample
from inference_workers.loop import Worker
from inference_workers.sampler import generate
from inference_workers.sampling import (DecodeMode, SamplingParams, choose_tokens, step_keys,
                                        truncated_logprobs)
from inference_workers.worker_config import WorkerConfig
from param_server.protos import param_server_pb2 as pb
from rlax_ps.models import Transformer
from worker_testlib import CONFIG, TOKENIZER

VOCAB = 40
LOGITS = np.random.default_rng(0).normal(size=(6, VOCAB)).astype(np.float32) * 2.5
CASES = [  # (temperature, top_k, top_p, min_p): each min_p drops tokens the others keep
    (1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.3), (1.5, 8, 1.0, 0.2), (1.0, 0, 0.9, 0.1),
    (2.0, 12, 0.8, 0.15), (1.0, 0, 1.0, 1.0)]


def reference(logits, temperature, top_k, top_p, min_p):
  """{token: log q(token)} of one row's sampling distribution, in numpy float64: min-p on the
  tempered vocabulary, then top-k, then top-p on what is left, renormalised."""
  scaled = logits.astype(np.float64) / np.float32(temperature)
  probs = np.exp(scaled - scaled.max())
  probs /= probs.sum()
  order = np.argsort(-scaled, kind="stable")
  kept = [t for t in order if probs[t] >= min_p * probs.max()]
  kept = kept[:top_k or len(kept)]
  p = probs[kept] / probs[kept].sum()
  kept = [t for t, before in zip(kept, np.cumsum(p) - p) if before < top_p]
  logq = scaled[kept] - np.log(np.sum(np.exp(scaled[kept])))
  return dict(zip(map(int, kept), logq))


@functools.partial(jax.jit, static_argnames="mode")
def _truncated(logits, mode, temperature, top_p, min_p):
  return truncated_logprobs(logits, mode, temperature, top_p, min_p)


def _mode(temperature, top_k, top_p, min_p):
  return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).mode


def _kept(logp, ids):
  """{token: log q} over one row's candidates of finite log-prob."""
  ids = np.arange(logp.shape[-1]) if ids is None else np.asarray(ids)
  return {int(t): float(q) for t, q in zip(ids, np.asarray(logp)) if np.isfinite(q)}


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", CASES)
def test_kept_set_and_log_probs_equal_the_numpy_reference(temperature, top_k, top_p, min_p):
  logp, ids = _truncated(jnp.asarray(LOGITS), _mode(temperature, top_k, top_p, min_p),
                         temperature, top_p, min_p)
  dropped = 0
  for b, row in enumerate(LOGITS):
    got = _kept(logp[b], None if ids is None else ids[b])
    want = reference(row, temperature, top_k, top_p, min_p)
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose([got[t] for t in want], list(want.values()), atol=1e-5)
    dropped += len(reference(row, temperature, top_k, top_p, 0.0)) - len(want)
  assert dropped > 0  # min_p drops tokens the other settings keep


def test_min_p_comes_before_top_p_as_in_vllm_v1():
  """p = (.5, .3, .2), min_p .5 drops .2; top_p .6 on the renormalised (.625, .375) then keeps
  one token (Hugging Face's order, top-p first, would keep two)."""
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32))
  logp, ids = _truncated(logits, _mode(1.0, 0, 0.6, 0.5), 1.0, 0.6, 0.5)
  assert _kept(logp[0], ids[0]) == {0: 0.0}


def test_sampled_tokens_are_kept_and_carry_the_tempered_policys_log_prob():
  temperature, top_k, top_p, min_p = 1.5, 0, 0.95, 0.1
  params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
  rows = np.repeat(LOGITS, 64, axis=0)  # 64 draws of each row
  keys = step_keys(jnp.arange(len(rows), dtype=jnp.int32), 0)
  tokens, slogp, logp = jax.jit(choose_tokens, static_argnames="mode")(
      jnp.asarray(rows), keys, mode=params.mode, temperature=temperature, top_p=top_p,
      min_p=min_p)
  model_logp = jax.nn.log_softmax(rows, axis=-1)
  for row, token, q, p, full in zip(rows, np.asarray(tokens), np.asarray(slogp),
                                    np.asarray(logp), np.asarray(model_logp)):
    want = reference(row, temperature, top_k, top_p, min_p)
    assert int(token) in want
    # the behaviour log-prob: the tempered policy's, what the trainer's ratios are of
    np.testing.assert_allclose(q, jax.nn.log_softmax(row / temperature)[token], atol=1e-5)
    assert q < want[int(token)] - 1e-3  # not the narrowed set's (on-policy ratios < 1)
    np.testing.assert_allclose(p, full[token], atol=1e-6)  # the policy's, untruncated
  assert len(set(np.asarray(tokens).tolist())) > len(LOGITS)  # sampled, not argmax


def test_the_decode_loop_samples_with_min_p():
  """Through `generate`: every token in the min-p set of the model's logits at its step, its
  behaviour log-prob that of the tempered policy (the trainer's ratios' distribution)."""
  model = Transformer(CONFIG, rngs=nnx.Rngs(0))
  prompt = TOKENIZER.encode_prompt("12+34=")
  params = SamplingParams(temperature=0.1, min_p=0.3, max_new_tokens=4)
  out = generate(model, [prompt] * 4, [1, 2, 3, 4], params)
  for sample in out:
    seq = jnp.asarray([list(prompt) + sample.tokens.tolist()], jnp.int32)
    steps = np.asarray(model(seq)[0, len(prompt) - 1:-1])
    for row, token, q in zip(steps, sample.tokens, sample.sampling_logprobs):
      want = reference(row, 0.1, 0, 1.0, 0.3)
      assert int(token) in want and len(want) < CONFIG.vocab_size
      np.testing.assert_allclose(q, jax.nn.log_softmax(row / 0.1)[token], atol=1e-4)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (7, 0.6)])
def test_min_p_zero_compiles_the_program_without_min_p(top_k, top_p):
  """min_p=0 is the DecodeMode of the settings without min-p: the same compiled program,
  min_p an unread knob, so the samples are those of the path without it, bit for bit."""
  for greedy in (False, True):
    params = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p, min_p=0.0,
                            greedy=greedy)
    assert params.mode == DecodeMode(greedy=greedy, top_k=top_k, nucleus=top_p < 1.0)
    assert not params.mode.min_p_on
  assert SamplingParams(top_k=top_k, top_p=top_p, min_p=1e-6).mode.min_p_on


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), True, "0.1"])
def test_bad_min_p_is_named(value):
  with pytest.raises(ValueError, match="SamplingParams.min_p: expected a number in"):
    SamplingParams(min_p=value)


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_bad_worker_min_p_is_named(value):
  with pytest.raises(ValueError, match="WorkerConfig.min_p: expected a number in"):
    WorkerConfig(min_p=value)


def test_the_worker_samples_with_its_min_p_and_records_it_in_the_group():
  worker = Worker(None, CONFIG, TOKENIZER, WorkerConfig(min_p=0.25, max_new_tokens=8))
  assert worker.params.min_p == 0.25 and worker.params.mode.min_p_on
  ids = np.asarray(TOKENIZER.encode("12"), np.int32)
  sample = Sample(ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.float32), "stop")
  group = worker._group(pb.Prompt(id="p1", text="5+7=", task="addition"), 0, [sample], [1.0])
  assert group.metadata["min_p"] == "0.25"


def test_each_group_names_the_settings_and_the_tokenizer_it_was_sampled_with():
  """What the trainer compares with its own (rl.check_sampling, rl.check_tokenizer)."""
  worker = Worker(None, CONFIG, TOKENIZER, WorkerConfig(max_new_tokens=8, samples_per_prompt=3,
                                                        temperature=0.7, top_k=5, top_p=0.9))
  group = worker._group(pb.Prompt(id="p1", text="5+7=", task="addition"), 0, [], [])
  assert {k: group.metadata[k] for k in ("temperature", "top_k", "top_p", "min_p",
                                         "max_new_tokens", "samples_per_prompt", "tokenizer")
          } == {"temperature": "0.7", "top_k": "5", "top_p": "0.9", "min_p": "0.0",
                "max_new_tokens": "8", "samples_per_prompt": "3",
                "tokenizer": TOKENIZER.identity}
