"""The packed RL loss and its gradient for a loaded model on one scripted group (two
samples, one rewarded), shared by the per-architecture tests."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_ps.train.rl_loss import LossConfig, rl_loss
from rlax_ps.train.rollouts import BatchShape, Group, build_batch


def rl_loss_and_grads(model, *, response_len: int, vocab_hi: int):
  """(loss, grads) of rl_loss at the model's params in float32, responses of
  `response_len` random ids below `vocab_hi`."""
  graphdef, state = nnx.split(model)
  params = jax.tree.map(lambda x: x.astype(jnp.float32), state.to_pure_dict())
  rng = np.random.default_rng(0)
  group = Group(0, np.array([1, 5, 9], np.int32),
                tuple(rng.integers(3, vocab_hi, response_len) for _ in range(2)),
                tuple(np.full(response_len, -2.0, np.float32) for _ in range(2)),
                np.array([1.0, 0.0], np.float32), 0)
  shape = BatchShape(groups=1, samples=2, prompt_len=4, response_len=response_len)
  batch = {k: jnp.asarray(v) for k, v in build_batch([group], shape).items()}
  return jax.jit(jax.value_and_grad(
      lambda p, g: rl_loss(p, g, batch, None, num_groups=1, cfg=LossConfig(backend="xla"))[0]),
      static_argnums=1)(params, graphdef)
