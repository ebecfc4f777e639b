"""The limits a decode benchmark is held against: the default device's copy bandwidth and
matmul FLOP/s, measured in the same run, and the tokens/s they allow a greedy decode."""

import jax
import jax.numpy as jnp
import numpy as np

from rlax_ps.models import ModelConfig


def machine_limits(reps: int, best_time, dtype: str = "float32") -> tuple[float, float]:
  """(memory bytes/s of the default device, `dtype` matmul FLOP/s), best of `reps` by
  `best_time(fn, reps) -> (seconds, result)`. The bandwidth is the fastest of a jitted copy
  (bytes read + written), a jitted sum (read) and, on the CPU, numpy's copy: XLA:CPU's copy
  runs well below what the memory does (a decode, which reads its weights, went past it). An
  accelerator gets sizes that fill it (2 GiB, 8192^3 matmul); the CPU 256 MiB and 1024^3."""
  accelerator = jax.default_backend() != "cpu"
  src = jnp.ones((2 << 30 if accelerator else 256 << 20) // 4, jnp.float32)
  rates = []
  for fn, moved in ((jax.jit(jnp.copy), 2), (jax.jit(jnp.sum), 1)):
    fn(src).block_until_ready()
    rates.append(moved * src.nbytes / best_time(lambda f=fn: f(src), reps)[0])
  if not accelerator:
    host, out = np.asarray(src), np.empty(src.shape, np.float32)
    rates.append(2 * host.nbytes / best_time(lambda: np.copyto(out, host), reps)[0])
  n = 8192 if accelerator else 1024
  a = jnp.ones((n, n), dtype)
  mm = jax.jit(lambda x, y: x @ y)
  mm(a, a).block_until_ready()
  t_mm, _ = best_time(lambda: mm(a, a), reps)
  return max(rates), 2 * n**3 / t_mm


def roofline_rate(config: ModelConfig, batch: int, prompt_len: int, new: int,
                  bandwidth: float, flops: float) -> float:
  """New tokens/s the machine allows for one greedy call: prefill FLOPs at `flops`, then
  per step the slower of its bytes (the weights in config.param_dtype, the KV cache so far
  in config.dtype) at `bandwidth` and its FLOPs (2 per weight per token, attention over the
  context) at `flops`."""
  weights = jnp.dtype(config.param_dtype).itemsize * config.num_params
  heads, width, values = config.kv_cache_layout
  kv_per_token = ((1 + values) * config.num_layers * heads * width
                  * jnp.dtype(config.dtype).itemsize)
  # Per query head and cached position: a width-long dot for the logit, one for the value.
  attn_per_ctx = 4 * config.num_layers * config.num_heads * (width if not values else
                                                              config.head_dim)

  def token_flops(ctx):
    return 2 * config.num_params + attn_per_ctx * ctx

  seconds = batch * prompt_len * token_flops(prompt_len / 2) / flops
  for t in range(new):
    ctx = prompt_len + t
    seconds += max((weights + batch * ctx * kv_per_token) / bandwidth,
                   batch * token_flops(ctx) / flops)
  return batch * new / seconds
