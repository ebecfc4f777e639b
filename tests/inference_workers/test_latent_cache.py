"""A DeepSeek model (multi-head latent attention) on the workers' decoding paths: continuous
batching over one shared prompt cache per group, rows refilled, resumed samples fed at once,
a sample at a time (SampleBatch) and an int8 KV cache, all reading the latent cache (one
kv head per token), give the log-probs of the uncached, decompressed forward."""

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest

from inference_workers.continuous import ContinuousBatch
from inference_workers.sample_batch import SampleBatch
from inference_workers.sampler import generate
from inference_workers.sampling import SamplingParams
from rlax_ps.models import load_hf_checkpoint

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf")
PARAMS = SamplingParams(max_new_tokens=10, stop_tokens=tuple(range(2, 10)))
PROMPTS = [[3, 14, 15, 9], [26, 5], [35, 8, 9, 7, 9, 3]]
SEEDS = [[10 * i + j for j in range(3)] for i in range(len(PROMPTS))]

pytestmark = pytest.mark.slow  # each batch compiles a MoE model's prefill and decode chunk


@functools.cache
def deepseek(name="deepseek_v3"):
  return load_hf_checkpoint(os.path.join(FIXTURES, name), dtype="float32")


def forward_gaps(model, samples):
  """|log-prob of each sampled token under the uncached forward - the sample's own|, over
  samples {prompt index: [Sample]}."""
  gaps = []
  for i, group in samples.items():
    for s in group:
      tokens = np.asarray([PROMPTS[i] + s.tokens.tolist()], np.int32)
      logp = np.asarray(jax.nn.log_softmax(model(tokens), axis=-1))[0]
      at = np.arange(len(PROMPTS[i]) - 1, tokens.shape[1] - 1)
      gaps.append(np.abs(logp[at, s.tokens] - s.logprobs))
  return np.concatenate(gaps)


def assert_latent(batch, model, kv_dtype=None):
  c, cfg = batch._dev.slots.cache, model.config
  assert c.prefix_v == c.suffix_v == ()  # the keys are the values
  assert c.suffix_k[0].shape[-2:] == (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
  if kv_dtype:
    assert c.suffix_k[0].dtype.name == kv_dtype


def assert_same_samples(got, want):
  """Each prompt's samples `got` ({prompt: [Sample]}) are `want`'s: tokens and log-probs."""
  for i, group in got.items():
    for a, b in zip(group, want[i], strict=True):
      assert a.tokens.tolist() == b.tokens.tolist()
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_refilled_and_resumed_samples_equal_generate_and_the_uncached_forward(name):
  """3 samples on 2 rows a prompt (a row takes the next sample when its own ends), some
  resumed from begun tokens (fed to the latent cache at once): each equals generate's
  sample for its seed, with the decompressed forward's log-probs."""
  model = deepseek(name)
  want = {i: generate(model, [p] * 3, SEEDS[i], PARAMS) for i, p in enumerate(PROMPTS)}
  j = max(range(3), key=lambda j: len(want[0][j].tokens))  # the longest: begun mid-way
  k = min(3, len(want[0][j].tokens) - 1)
  assert k >= 2

  def cut(sample, k):
    return dataclasses.replace(sample, tokens=sample.tokens[:k], finish_reason="",
                               logprobs=sample.logprobs[:k],
                               sampling_logprobs=sample.sampling_logprobs[:k])

  batch = ContinuousBatch(model, 3, 2, PARAMS, rows_per_prompt=2, resume=True)
  for i, p in enumerate(PROMPTS):
    batch.add(i, p, SEEDS[i],
              [cut(want[0][m], k if m == j else 0) for m in range(j + 1)] if i == 0 else None)
  got = dict(batch.run())
  assert_latent(batch, model)
  assert_same_samples(got, want)
  assert got[0][j].resumed
  assert forward_gaps(model, got).max() < 1e-5


def test_a_sample_batch_decodes_from_the_latent_cache():
  model = deepseek()
  batch = SampleBatch(model, 3, 4, PARAMS)
  for i, p in enumerate(PROMPTS):
    batch.add(i, p, SEEDS[i])
  got = dict(batch.run())
  assert_latent(batch._inner, model)
  assert forward_gaps(model, got).max() < 1e-5


def test_an_int8_latent_cache_keeps_the_policys_log_probs():
  """worker.kv_cache_dtype=int8: the latent and rotary key share a scale per token; the
  samples' log-probs stay within its rounding of the full-precision forward's (this random
  fixture is sensitive: int8 per-head decompressed keys and values miss by as much)."""
  model = deepseek()
  batch = ContinuousBatch(model, 3, 2, PARAMS, kv_dtype="int8")
  for i, p in enumerate(PROMPTS):
    batch.add(i, p, SEEDS[i])
  got = dict(batch.run())
  assert_latent(batch, model, "int8")
  gaps = forward_gaps(model, got)
  assert 1e-6 < gaps.max() < 0.1 and gaps.mean() < 0.01, (gaps.max(), gaps.mean())


def test_the_pallas_decode_kernel_reads_the_latent_cache():
  """The TPU decode kernel (interpreted) on the latent cache, one array read as keys and
  values: N samples of a prompt equal generate's (XLA, one cache per sample)."""
  from inference_workers.sampler import generate_shared
  from rlax_ps.kernels.dispatch import shared_prefix_decode_attention
  model = deepseek()
  kernel = functools.partial(shared_prefix_decode_attention, backend="pallas_tpu",
                             interpret=True, block_s=8)
  got = generate_shared(model, PROMPTS[:2], 2, [s[:2] for s in SEEDS[:2]], PARAMS, kernel)
  for i, group in enumerate(got):
    want = generate(model, [PROMPTS[i]] * 2, SEEDS[i][:2], PARAMS)
    for a, b in zip(group, want, strict=True):
      assert a.tokens.tolist() == b.tokens.tolist()
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_heads_split_over_tensor_while_every_device_reads_the_latent_cache():
  """A tensor-parallel worker (data 2 x tensor 2): the one cached latent head stays whole on
  every device, the absorbed query heads split over tensor; its samples equal one device's."""
  from flax import nnx
  from rlax_ps import sharding as shd
  model = deepseek()
  mesh = shd.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
  graphdef, state = nnx.split(model)
  on_mesh = nnx.merge(graphdef, jax.device_put(state, shd.named(
      mesh, shd.param_specs(state, nnx.get_partition_spec(state), mesh))))
  want = {i: generate(model, [p] * 3, SEEDS[i], PARAMS) for i, p in enumerate(PROMPTS)}
  batch = ContinuousBatch(on_mesh, 3, 2, PARAMS, rows_per_prompt=2, mesh=mesh)
  for i, p in enumerate(PROMPTS):
    batch.add(i, p, SEEDS[i])
  got = dict(batch.run())
  assert_latent(batch, model)
  assert_same_samples(got, want)
