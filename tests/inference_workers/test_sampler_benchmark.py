"""benchmarks/roofline.py: the decode tokens/s that memory bandwidth and matmul FLOP/s allow."""

import pytest

from benchmarks_lib import load_benchmark
from rlax_ps.models import ModelConfig

bench = load_benchmark("roofline")

CONFIG = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16)


def test_the_roofline_is_the_bandwidth_bound_when_flops_are_free():
  batch, prompt, new, bw = 8, 16, 4, 1e9
  kv = 2 * CONFIG.num_layers * CONFIG.num_kv_heads * CONFIG.head_dim * 4
  seconds = sum((4 * CONFIG.num_params + batch * (prompt + t) * kv) / bw for t in range(new))
  got = bench.roofline_rate(CONFIG, batch, prompt, new, bandwidth=bw, flops=1e30)
  assert got == pytest.approx(batch * new / seconds)


def test_the_roofline_is_the_flop_bound_when_bandwidth_is_free():
  batch, prompt, new, flops = 64, 16, 4, 1e9
  attn = 4 * CONFIG.num_layers * CONFIG.num_heads * CONFIG.head_dim
  per_token = lambda ctx: 2 * CONFIG.num_params + attn * ctx  # noqa: E731
  seconds = batch * prompt * per_token(prompt / 2) / flops + sum(
      batch * per_token(prompt + t) / flops for t in range(new))
  got = bench.roofline_rate(CONFIG, batch, prompt, new, bandwidth=1e30, flops=flops)
  assert got == pytest.approx(batch * new / seconds)


def test_larger_batches_raise_the_bandwidth_bound_roofline():
  rates = [bench.roofline_rate(CONFIG, b, 16, 8, bandwidth=1e10, flops=1e13)
           for b in (8, 64, 256)]
  assert rates[0] < rates[1] < rates[2]


def test_bfloat16_weights_and_cache_double_the_bandwidth_bound_roofline():
  bf16 = ModelConfig(**{**CONFIG.__dict__, "param_dtype": "bfloat16", "dtype": "bfloat16"})
  f32 = bench.roofline_rate(CONFIG, 8, 16, 4, bandwidth=1e9, flops=1e30)
  assert bench.roofline_rate(bf16, 8, 16, 4, bandwidth=1e9, flops=1e30) == pytest.approx(2 * f32)


def test_latent_attention_reads_its_one_latent_head_per_token_and_layer():
  """DeepSeek's cache: kv_lora_rank + qk_rope_head_dim values a token and layer, read as keys
  and values (ModelConfig.kv_cache_layout), not a key and a value per head."""
  mla = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=4, head_dim=24, kv_lora_rank=32,
                    qk_rope_head_dim=8, v_head_dim=16)
  batch, prompt, new, bw = 8, 16, 4, 1e9
  kv = mla.num_layers * (32 + 8) * 4
  seconds = sum((4 * mla.num_params + batch * (prompt + t) * kv) / bw for t in range(new))
  got = bench.roofline_rate(mla, batch, prompt, new, bandwidth=bw, flops=1e30)
  assert got == pytest.approx(batch * new / seconds)


def test_the_bandwidth_is_the_fastest_of_a_copy_a_read_and_numpys_copy():
  """XLA:CPU's copy alone ran ~5x below the memory: decode (which reads its weights) went
  past the 'roofline'. Each measurement's seconds are given here: the fastest rate counts,
  bytes read + written for a copy, read for the sum."""
  seconds = iter([1.0, 0.25, 2.0, 0.5])  # jitted copy, jitted sum, numpy copy, matmul

  def best_time(fn, reps):
    return next(seconds), None

  bandwidth, flops = bench.machine_limits(1, best_time)
  nbytes = 256 << 20
  assert bandwidth == pytest.approx(max(2 * nbytes / 1.0, nbytes / 0.25, 2 * nbytes / 2.0))
  assert flops == pytest.approx(2 * 1024**3 / 0.5)
