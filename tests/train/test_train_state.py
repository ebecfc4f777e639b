"""A train state's RNG: each update splits it (Clip-Cov's draws are new each update), and a
run from given weights (init_from_hf) seeds it with the run's seed."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlax_ps.train.state import TrainState
from rlax_ps.train.step import apply_gradients


def test_each_update_splits_the_rng():
  params = {"w": jnp.ones((3,), jnp.float32)}
  opt = optax.sgd(0.1)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params),
                     rng=jax.random.PRNGKey(0))
  keys = [np.asarray(state.rng)]
  for _ in range(3):
    state, _ = apply_gradients(state, {"w": jnp.ones((3,), jnp.float32)}, {}, opt)
    keys.append(np.asarray(state.rng))
  assert int(state.step) == 3
  assert len({k.tobytes() for k in keys}) == 4  # a new key every update


def test_a_run_from_given_params_seeds_its_rng_with_the_run_seed():
  from rlax_ps.train.state import state_from_params
  s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  opt = optax.sgd(0.1)
  shardings = TrainState(step=s, params=s, opt_state=s, rng=s)
  params = {"w": jnp.ones((3,), jnp.float32)}
  keys = {np.asarray(state_from_params(params, opt, shardings, seed).rng).tobytes()
          for seed in (0, 1, 2)}
  assert len(keys) == 3
