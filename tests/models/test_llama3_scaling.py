"""A Llama-3 config (rope_scaling of type llama3, as every Llama-3.x checkpoint has) can be
hashed, so a model loaded from such a checkpoint samples (the graphdef is a static jit
argument; its greedy output is checked in test_hf_parity), trains with the SFT step and the RL loss,
and round-trips its config through JSON."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_grads import rl_loss_and_grads
from inference_workers.sampler import generate, generate_shared
from inference_workers.sampling import SamplingParams
from rlax_ps import optim
from rlax_ps import sharding as shd
from rlax_ps.models import ModelConfig, load_hf_checkpoint
from rlax_ps.train.state import abstract_model, make_init_fn, state_from_params, \
  state_shardings
from rlax_ps.train.step import make_train_step

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf", "llama")


@pytest.fixture(scope="module")
def model():
  loaded = load_hf_checkpoint(FIXTURE)  # config.json: rope_parameters of type llama3
  assert loaded.config.rope_scaling["rope_type"] == "llama3"
  return loaded


def test_the_config_hashes_and_round_trips_through_json(model):
  config = model.config
  assert config.rope_scaling["rope_type"] == "llama3"
  assert hash(config) == hash(config.replace())
  assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
  hash(nnx.graphdef(model))
  with pytest.raises(TypeError, match="read-only"):
    config.rope_scaling["factor"] = 2.0


@pytest.mark.slow  # ~3 s; test_hf_parity's llama greedy/cached decoding holds it by default
def test_generate_and_generate_shared_sample_the_llama3_model(model):
  params = SamplingParams(temperature=0.0, max_new_tokens=4)
  prompts = [[1, 5, 9], [2, 7]]
  single = generate(model, prompts, [0, 1], params)
  shared = generate_shared(model, prompts, 2, [[0, 1], [2, 3]], params)
  for one, group in zip(single, shared):  # greedy: every sample of a prompt is the same
    for sample in group:
      np.testing.assert_array_equal(sample.tokens, one.tokens)


@pytest.mark.slow  # ~3 s; the SFT step test below trains the llama3 model by default
def test_the_rl_loss_trains_the_llama3_model(model):
  loss, grads = rl_loss_and_grads(model, response_len=3, vocab_hi=50)
  assert np.isfinite(float(loss))
  assert float(jax.tree.reduce(lambda a, b: a + jnp.sum(jnp.abs(b)), grads, 0.0)) > 0


def test_the_sft_step_trains_the_llama3_model(model):
  mesh = shd.make_mesh(dict(zip(shd.MESH_AXES, (1, 1, 1))), jax.devices()[:1])
  optimizer = optim.make_optimizer({"lr": 3e-3, "warmup_steps": 0}, total_steps=20)
  graphdef, _, spec_tree = abstract_model(model.config)
  shardings = state_shardings(jax.eval_shape(make_init_fn(model.config, optimizer),
                                             jax.random.PRNGKey(0)), spec_tree, mesh)
  state = state_from_params(nnx.state(model, nnx.Param).to_pure_dict(), optimizer, shardings, 0)
  step = make_train_step(graphdef, optimizer, shardings, mesh)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, model.config.vocab_size, (2, 17)).astype(np.int32)
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
           "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16)),
           "segment_ids": np.ones((2, 16), np.int32), "loss_mask": np.ones((2, 16), np.int32)}
  losses = []
  for _ in range(10):
    state, metrics = step(state, shd.shard_batch(mesh, batch))
    losses.append(float(metrics["loss"]))
  assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0]
