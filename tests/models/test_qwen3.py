"""A Qwen3 checkpoint (per-head q/k RMS norms) through the user's path beyond the logits
(test_hf_parity): held by a worker from a published keyframe, sampled with a shared prefill,
and trained by the packed RL loss, whose gradient reaches the q/k norms."""

import os

import numpy as np
import pytest
from flax import nnx

from inference_workers.sampler import generate, generate_shared
from inference_workers.sampling import SamplingParams
from inference_workers.weights import HeldPolicy
from rlax_ps import sync
from rlax_ps.models import flatten_params, load_hf_checkpoint
from rl_grads import rl_loss_and_grads

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf", "qwen3")


@pytest.fixture(scope="module")
def model():
  loaded = load_hf_checkpoint(FIXTURE, dtype="bfloat16")
  assert loaded.config.qk_norm and loaded.config.architecture == "qwen3"
  return loaded


@nnx.jit
def forward(model, tokens):
  return model(tokens)


def test_a_worker_holding_the_published_keyframe_computes_the_trainers_logits(model):
  params = {k: np.asarray(v) for k, v in flatten_params(model).items()}
  assert {"layers.0.attn.q_norm.scale", "layers.1.attn.k_norm.scale"} <= set(params)
  policy = HeldPolicy(model.config, "bf16")
  policy.apply(sync.encode(None, params, "bf16", version=0))
  tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9))
  np.testing.assert_array_equal(np.asarray(forward(policy.model, tokens)),
                                np.asarray(forward(model, tokens)))


@pytest.mark.slow  # ~8 s; test_sampler_decoding covers shared prefills by default
def test_shared_prefill_samples_as_one_prefill_per_sample(model):
  params = SamplingParams(temperature=0.0, max_new_tokens=5)
  prompts = [[1, 5, 9, 12], [1, 7]]
  single = generate(model, prompts, [0, 1], params)
  shared = generate_shared(model, prompts, 3, [[0, 1, 2], [3, 4, 5]], params)
  for one, group in zip(single, shared):
    assert len(group) == 3
    for sample in group:
      np.testing.assert_array_equal(sample.tokens, one.tokens)


def test_the_packed_rl_loss_trains_the_qk_norms(model):
  _, grad = rl_loss_and_grads(model, response_len=4, vocab_hi=70)
  for layer in grad["layers"].values():
    for norm in ("q_norm", "k_norm"):
      g = np.asarray(layer["attn"][norm]["scale"])
      assert np.isfinite(g).all() and np.abs(g).sum() > 0, norm
