"""One train step gives the same loss and the same updated params on 1 device and on
8 fake CPU devices, whatever the (data, fsdp, tensor) mesh; init is sharded from the start."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax_ps import optim
from rlax_ps import sharding as shd
from rlax_ps.models import ModelConfig
from rlax_ps.models.transformer import MoE
from rlax_ps.tasks import get_task
from rlax_ps.tokenizers import CharTokenizer
from rlax_ps.train.data import SFTBatches
from rlax_ps.train.state import TrainState, abstract_model, make_init_fn, sharded_init, \
  state_shardings
from rlax_ps.train.step import make_train_step

TOKENIZER = CharTokenizer()
MODEL = ModelConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=32, intermediate_size=64,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
# eps well above float noise: Adam's first step is ~sign(g), which rounding could flip for g ~ 0.
OPT = {"lr": 1e-2, "warmup_steps": 0, "eps": 1e-4, "clip_norm": 0.5, "weight_decay": 0.1}
MESHES = [(8, 1, 1), (2, 2, 2), (1, 2, 4),
          pytest.param((2, 4, 1), marks=pytest.mark.slow)]  # Each mesh costs a compile.


def _batch():
  data = SFTBatches([get_task("addition"), get_task("reversal")], [1.0, 1.0], TOKENIZER,
                    batch_size=8, seq_len=32, seed=0)
  return data.batch(0)


def _mesh(axes, n=None):
  return shd.make_mesh(dict(zip(shd.MESH_AXES, axes)), jax.devices()[:n or np.prod(axes)])


@pytest.fixture(scope="module")
def optimizer():
  return optim.make_optimizer(OPT, total_steps=10)


@pytest.fixture(scope="module")
def reference(optimizer):
  """(initial state on host, loss, updated params on host) on a single device."""
  mesh = _mesh((1, 1, 1))
  state, shardings, graphdef = sharded_init(MODEL, optimizer, mesh, seed=0)
  initial = jax.device_get(state)
  step = make_train_step(graphdef, optimizer, shardings, mesh)
  new_state, metrics = step(state, shd.shard_batch(mesh, _batch()))
  return initial, float(metrics["loss"]), jax.device_get(new_state.params)


@pytest.mark.parametrize("axes", MESHES)
def test_step_matches_single_device(axes, optimizer, reference):
  initial, ref_loss, ref_params = reference
  mesh = _mesh(axes)
  graphdef, _, spec_tree = abstract_model(MODEL)
  abstract = jax.eval_shape(make_init_fn(MODEL, optimizer), jax.random.PRNGKey(0))
  shardings = state_shardings(abstract, spec_tree, mesh)
  state = jax.device_put(initial, shardings)
  step = make_train_step(graphdef, optimizer, shardings, mesh)
  batch = shd.shard_batch(mesh, _batch())
  with jax.transfer_guard("disallow"):  # No hidden host round trip inside the step.
    new_state, metrics = step(state, batch)
  np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=1e-5)
  assert int(new_state.step) == 1
  flat_ref = jax.tree_util.tree_leaves_with_path(ref_params)
  for (path, ref), new in zip(flat_ref, jax.tree.leaves(new_state.params)):
    np.testing.assert_allclose(np.asarray(new), ref, rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))
  # The update moved the params (the comparison above is not between two copies of init).
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), ref_params, initial.params)
  assert max(jax.tree.leaves(moved)) > 1e-3
  # The new state stays on the mesh's shardings (donation and out_shardings kept it there).
  assert jax.tree.map(lambda x: x.sharding, new_state) == shardings


def test_sharded_init_matches_single_device_and_splits_params(optimizer, reference):
  initial = reference[0]
  mesh = _mesh((2, 2, 2))
  state, shardings, _ = sharded_init(MODEL, optimizer, mesh, seed=0)
  assert isinstance(state, TrainState)
  assert jax.tree.map(lambda x: x.sharding, state) == shardings  # Born on its shardings.
  for ref, new in zip(jax.tree.leaves(initial.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(new), ref)
  gate = state.params["layers"][0]["mlp"]["gate_proj"]["kernel"]
  assert gate.sharding.spec == P("fsdp", "tensor")
  assert gate.addressable_shards[0].data.shape == (16, 32)  # [32, 64] split 2 x 2.
  mu = state.opt_state.inner_state[1][0].mu["layers"][0]["mlp"]["gate_proj"]["kernel"]
  assert mu.sharding.spec == P("fsdp", "tensor")  # Adam moments follow their params.
  embed = state.params["embed"]["embedding"]  # [99, 32]: 99 is not divisible by tensor=2.
  assert embed.sharding.spec == P(None, "fsdp")



GEMMA = MODEL.replace(
    num_layers=2, architecture="gemma3", qk_norm=True, hidden_act="gelu_tanh",
    zero_centered_norms=True, scale_embeddings=True, sandwich_norms=True,
    query_pre_attn_scalar=6, sliding_window=5, rope_local_theta=100.0,
    layer_types=("sliding_attention", "full_attention"), tie_word_embeddings=True,
    attn_logit_softcapping=20.0, final_logit_softcapping=10.0)
MOE = MODEL.replace(num_layers=2, architecture="qwen3", qk_norm=True, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                    mlp_only_layers=(1,))


# ~15 s each: slow (experts' sharding is also checked by test_expert_parallel).
@pytest.mark.parametrize("model,moved", [
    pytest.param(GEMMA, ("layers", 0, "attn_out_norm", "scale"), marks=pytest.mark.slow),
    pytest.param(MOE, ("layers", 0, "mlp", "experts", "down_proj"), marks=pytest.mark.slow)],
    ids=["gemma", "moe"])
def test_other_families_step_as_on_one_device(model, moved, optimizer):
  # Gemma 3's sandwich and q/k norms, soft-capped logits and a window cutting the 32-token
  # rows, and Qwen3-MoE's router and stacked experts (their expert axis unsharded, the
  # others on fsdp/tensor) shard like the rest: the (2, 2, 2) step equals one device's.
  results = []
  for axes in ((1, 1, 1), (2, 2, 2)):
    mesh = _mesh(axes)
    state, shardings, graphdef = sharded_init(model, optimizer, mesh, seed=0)
    initial = jax.device_get(state.params)
    step = make_train_step(graphdef, optimizer, shardings, mesh)
    new_state, metrics = step(state, shd.shard_batch(mesh, _batch()))
    results.append((float(metrics["loss"]), jax.device_get(new_state.params)))
  (loss_1, params_1), (loss_8, params_8) = results
  np.testing.assert_allclose(loss_8, loss_1, rtol=1e-5)
  get = lambda tree: functools.reduce(lambda t, k: t[k], moved, tree)
  assert np.abs(get(params_8) - get(initial)).max() > 1e-4  # the step reached it
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params_1),
                          jax.tree.leaves(params_8)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_the_grouped_expert_dispatch_on_a_mesh_equals_one_device():
  # The CPU programs above run every expert; the grouped (TPU/GPU) dispatch is checked here
  # directly: expert params on their (None, fsdp, tensor) shardings, tokens over data.
  moe = MoE(MOE, rngs=nnx.Rngs(0))
  flat = jax.random.normal(jax.random.key(1), (24, MOE.hidden_size))
  weights, chosen, *_ = moe.route(flat)
  want = np.asarray(moe.grouped(flat, weights, chosen))
  mesh = _mesh((2, 2, 2))
  graphdef, state = nnx.split(moe)
  state = jax.device_put(state, jax.tree.map(lambda p: NamedSharding(mesh, p),
                                             nnx.get_partition_spec(state)))
  rows = NamedSharding(mesh, P("data"))
  got = jax.jit(lambda st, *a: nnx.merge(graphdef, st).grouped(*a))(
      state, *(jax.device_put(a, rows) for a in (flat, weights, chosen)))
  assert state["experts"]["gate_proj"].value.sharding.spec == P(None, "fsdp", "tensor")
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=1e-5)
