"""The limits a decode benchmark is held against: this machine's copy bandwidth and matmul
FLOP/s, measured in the same run, and the tokens/s they allow a greedy decode."""

import jax
import jax.numpy as jnp
import numpy as np

from rlax_ps.models import ModelConfig


def machine_limits(reps: int, best_time) -> tuple[float, float]:
  """(bytes/s a copy moves (read + written), float32 matmul FLOP/s), best of `reps` by
  `best_time(fn, reps) -> (seconds, result)`."""
  src = np.ones(256 << 18, np.float32)  # 256 MiB
  dst = np.empty_like(src)
  t_copy, _ = best_time(lambda: np.copyto(dst, src), reps)
  a = jnp.ones((1024, 1024), jnp.float32)
  mm = jax.jit(lambda x, y: x @ y)
  mm(a, a).block_until_ready()
  t_mm, _ = best_time(lambda: mm(a, a), reps)
  return 2 * src.nbytes / t_copy, 2 * 1024**3 / t_mm


def roofline_rate(config: ModelConfig, batch: int, prompt_len: int, new: int,
                  bandwidth: float, flops: float) -> float:
  """New tokens/s the machine allows for one greedy call: prefill FLOPs at `flops`, then
  per step the slower of its bytes (float32 weights, the KV cache so far) at `bandwidth`
  and its FLOPs (2 per weight per token, attention over the context) at `flops`."""
  weights = 4 * config.num_params
  kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
  attn_per_ctx = 4 * config.num_layers * config.num_heads * config.head_dim

  def token_flops(ctx):
    return 2 * config.num_params + attn_per_ctx * ctx

  seconds = batch * prompt_len * token_flops(prompt_len / 2) / flops
  for t in range(new):
    ctx = prompt_len + t
    seconds += max((weights + batch * ctx * kv_per_token) / bandwidth,
                   batch * token_flops(ctx) / flops)
  return batch * new / seconds
