"""Expert parallelism (ModelConfig.expert_parallel): the experts split over the mesh's fsdp
axis and the tokens sent to them give the one-device layer's output and gradients, and the
sharded train step's update, without gathering any expert's weights."""

import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from benchmarks_lib import load_benchmark
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax_ps import optim
from rlax_ps import sharding as shd
from rlax_ps.models import ModelConfig, Transformer
from rlax_ps.models.hf import model_config_from
from rlax_ps.models.transformer import MoE
from rlax_ps.tasks import get_task
from rlax_ps.tokenizers import CharTokenizer
from rlax_ps.train import evaluate
from rlax_ps.train.data import SFTBatches
from rlax_ps.train.run import TrainerRun
from rlax_ps.train.state import mesh_layout, sharded_init
from rlax_ps.train.step import make_train_step

TOKENIZER = CharTokenizer()
MOE = ModelConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, architecture="qwen3",
                  qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                  norm_topk_prob=True, mlp_only_layers=(1,))
# gpt-oss's biases and clamped gate; LoRA adapters on every expert projection.
BIASED = MOE.replace(moe_bias=True, swiglu_limit=7.0, norm_topk_prob=False)
ADAPTED = MOE.replace(lora_rank=4, lora_targets=("experts",))
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")


def _mesh(axes):
  return shd.make_mesh(dict(zip(shd.MESH_AXES, axes)), jax.devices()[:int(np.prod(axes))])


def _layer(config):
  """(graphdef, params) of one MoE layer, every param (biases, adapters' B) made nonzero."""
  graphdef, state = nnx.split(MoE(config, rngs=nnx.Rngs(0)))
  keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(state))))
  return graphdef, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape),
                                state)


def _loss(state, x, graphdef):
  out, _ = nnx.merge(graphdef, state)(x)
  return jnp.sum(out * jnp.cos(out)), out


@pytest.mark.parametrize("config,axes,tokens,grouped", [
    (MOE, (1, 4, 2), (4, 6), True),
    # gpt-oss's biased router, grouped: the two cases beside it hold each half (~3 s).
    pytest.param(BIASED, (2, 2, 2), (4, 6), True, marks=pytest.mark.slow),
    (BIASED, (2, 2, 2), (4, 6), False),
    (ADAPTED, (1, 2, 4), (4, 6), True),  # LoRA experts: no other default test on a mesh
    # Slow (~4 s, suite time): qwen3-grouped and gpt-oss-cpu hold the dispatch's output and
    # gradients on a mesh. 15 tokens: not split over fsdp, summed (psum)
    pytest.param(BIASED, (1, 2, 1), (3, 5), True, marks=pytest.mark.slow),
], ids=["qwen3-grouped", "gpt-oss-grouped", "gpt-oss-cpu", "lora-grouped", "rows-unsplit"])
def test_the_layer_equals_one_devices_output_and_gradients(config, axes, tokens, grouped,
                                                           monkeypatch):
  graphdef, state = _layer(config)
  x = jax.random.normal(jax.random.key(1), tokens + (config.hidden_size,))
  (want_loss, want), want_grads = jax.value_and_grad(_loss, has_aux=True)(state, x, graphdef)

  ep_graphdef, ep_state = nnx.split(MoE(config.replace(expert_parallel=True), rngs=nnx.Rngs(0)))
  ep_state = jax.tree.unflatten(jax.tree.structure(ep_state), jax.tree.leaves(state))
  mesh = _mesh(axes)
  specs = shd.param_specs(ep_state, nnx.get_partition_spec(ep_state), mesh)
  assert specs["experts"]["gate_proj"] == shd.fit_spec(P("fsdp", None, "tensor"),
                                                       (4, 32, 16), mesh)
  ep_state = jax.device_put(ep_state, shd.named(mesh, specs))
  x = jax.device_put(x, NamedSharding(mesh, shd.batch_spec(mesh, x.shape)))
  calls = []
  parallel = MoE.parallel

  def spy(self, *args, **kwargs):  # the dispatch under test, on any platform
    calls.append(1)
    return parallel(self, *args, **kwargs, grouped=grouped)

  monkeypatch.setattr(MoE, "parallel", spy)

  def ep_loss(state, x):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.value_and_grad(_loss, has_aux=True)(state, x, ep_graphdef)

  (loss, got), grads = jax.jit(ep_loss)(ep_state, x)
  assert calls  # the expert-parallel path ran
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                          jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-4,
                               err_msg=jax.tree_util.keystr(path))


def _gathered(compiled_hlo: str, num_experts: int) -> list[str]:
  """The all-gathers of the program whose result is a stack of experts ([E, ., .])."""
  shapes = re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(", compiled_hlo)
  return [s for s in shapes if s.count(",") == 2 and int(s.split(",")[0]) == num_experts]


@pytest.mark.slow  # suite time: the layer-level equality tests stay in the default suite
def test_the_train_step_matches_one_device_and_gathers_no_expert_weights():
  optimizer = optim.make_optimizer({"lr": 1e-2, "warmup_steps": 0, "eps": 1e-4}, total_steps=10)
  batch = SFTBatches([get_task("addition")], [1.0], TOKENIZER, batch_size=8, seq_len=32,
                     seed=0).batch(0)
  results = {}
  for name, config, axes in (("one device", MOE, (1, 1, 1)),
                             ("fsdp", MOE, (2, 2, 2)),
                             ("expert parallel", MOE.replace(expert_parallel=True), (2, 2, 2))):
    mesh = _mesh(axes)
    state, shardings, graphdef = sharded_init(config, optimizer, mesh, seed=0)
    initial = jax.device_get(state.params)
    step = make_train_step(graphdef, optimizer, shardings, mesh)
    sharded = shd.shard_batch(mesh, batch)
    hlo = step.lower(state, sharded).compile().as_text()
    new_state, metrics = step(state, sharded)
    results[name] = (float(metrics["loss"]), jax.device_get(new_state.params), hlo, initial,
                     new_state.params["layers"][0]["mlp"]["experts"]["gate_proj"].sharding)
  loss_1, params_1, _, initial, _ = results["one device"]
  loss_ep, params_ep, hlo_ep, _, sharding_ep = results["expert parallel"]
  np.testing.assert_allclose(loss_ep, loss_1, rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params_1),
                          jax.tree.leaves(params_ep)):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  moved = params_ep["layers"][0]["mlp"]["experts"]["down_proj"]
  assert np.abs(moved - initial["layers"][0]["mlp"]["experts"]["down_proj"]).max() > 1e-4
  assert sharding_ep.spec == P("fsdp", None, "tensor")  # 2 whole experts a device
  # Plain fsdp gathers the stacked experts for the layer; expert parallelism never does.
  assert _gathered(results["fsdp"][2], MOE.num_experts)
  assert not _gathered(hlo_ep, MOE.num_experts)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_layer_exports_for_tpu_and_gpu(platform):
  graphdef, state = nnx.split(MoE(BIASED.replace(expert_parallel=True), rngs=nnx.Rngs(0)))
  mesh = _mesh((2, 2, 2))
  specs = shd.named(mesh, shd.param_specs(state, nnx.get_partition_spec(state), mesh))

  def layer(state, x):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return nnx.merge(graphdef, state)(x)[0]

  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
  exported = jax.export.export(
      jax.jit(layer, in_shardings=(specs, NamedSharding(mesh, P(("data", "fsdp"))))),
      platforms=[platform])(abstract, jax.ShapeDtypeStruct((4, 6, 32), jnp.float32))
  text = exported.mlir_module()
  # The grouped matmuls over a device's own experts, the tokens gathered and scattered back.
  assert "ragged_dot" in text and "all_gather" in text and "reduce_scatter" in text


def test_expert_parallel_needs_experts_and_is_kept_over_a_checkpoint():
  with pytest.raises(ValueError, match="ModelConfig.expert_parallel"):
    ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                num_kv_heads=1, expert_parallel=True)
  with pytest.raises(ValueError, match="ModelConfig.expert_parallel"):
    MOE.replace(expert_parallel=1)
  block = ml_collections.ConfigDict(dict(param_dtype="float32", dtype="float32",
                                         expert_parallel=True))
  got = model_config_from(block, 80, os.path.join(FIXTURES, "qwen3_moe"))
  assert got.expert_parallel and got.num_experts > 0
  block.expert_parallel = False
  assert not model_config_from(block, 80, os.path.join(FIXTURES, "qwen3_moe")).expert_parallel


def test_an_fsdp_axis_that_does_not_divide_the_experts_is_refused_before_step_one():
  """Expert parallelism takes the experts' matrices off fsdp for whole experts a device: on
  fsdp=8 and 60 experts (Qwen1.5-MoE) each device held all of them whole (7x the params of
  plain fsdp), while the trainer's line said they were split along their matrices."""
  import types
  config = MOE.replace(expert_parallel=True)  # 4 experts
  trainer = lambda axes, c=config: types.SimpleNamespace(model_config=c, mesh=_mesh(axes),
                                                          leader=True)
  TrainerRun.check_mesh(trainer((1, 4, 2)))  # 1 whole expert a device
  TrainerRun.check_mesh(trainer((1, 8, 1), MOE))  # plain fsdp: along their matrices
  with pytest.raises(ValueError, match=r"^model.expert_parallel: mesh.fsdp=8 does not divide "
                                       r"the model's 4 experts"):
    TrainerRun.check_mesh(trainer((1, 8, 1)))
  TrainerRun.check_mesh(trainer((8, 1, 1)))  # one fsdp device: nothing to split
  assert mesh_layout(config, _mesh((8, 1, 1))).endswith("expert parallel idle (fsdp=1): "
                                                        "every expert on each device")
  assert "2 whole experts a device" in mesh_layout(config, _mesh((1, 2, 4)))


def test_the_benchmark_counts_fewer_collective_bytes_with_whole_experts():
  bench = load_benchmark("expert_parallel")
  assert bench.collective_bytes(
      "%a = bf16[8,4]{1,0} all-gather(%x)\n%b = f32[2]{0} reduce-scatter(%y)\n"
      "%c = f32[3,3]{1,0} add(%a, %b)") == 8 * 4 * 2 + 2 * 4
  # A tuple of merged all-reduces counts each shape; groups of one device move nothing.
  assert bench.collective_bytes(
      "%d = (f32[16,8]{1,0}, bf16[4]{0}) all-reduce(%p, %q), channel_id=1, "
      "replica_groups={{0,1,2,3}}, to_apply=%sum\n"
      "%e = f32[64]{0} all-reduce(%r), replica_groups={{0},{1},{2},{3}}, to_apply=%sum\n"
      "%f = f32[64]{0} all-reduce(%r), replica_groups=[4,1]<=[4], to_apply=%sum\n"
      "%g = f32[8]{0} all-reduce(%r), replica_groups=[1,4]<=[4], to_apply=%sum") == (
          16 * 8 * 4 + 4 * 2 + 8 * 4)
  mesh = _mesh((1, 4, 1))
  small = MOE.replace(num_experts=8, num_experts_per_tok=4, hidden_size=64)
  split = bench.collective_bytes(bench.layer_program(small, mesh, 64))
  whole = bench.collective_bytes(bench.layer_program(small.replace(expert_parallel=True), mesh,
                                                     64))
  assert 0 < whole < split


def test_held_out_decoding_on_the_mesh_runs_the_experts_parallel(monkeypatch):
  # The trainer's evaluation decodes with its sharded params: traced in their mesh, so the
  # experts stay put there too, and the answers equal one device's.
  config = MOE.replace(expert_parallel=True)
  mesh = _mesh((1, 4, 2))
  graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  prompts = ["12+34=", "7+8=", "99+1=", "5+5="]
  want = evaluate.completions(graphdef, state, TOKENIZER, prompts, max_new_tokens=6,
                              batch_size=4, prompt_len=8)
  calls = []
  parallel = MoE.parallel
  monkeypatch.setattr(MoE, "parallel", lambda self, *a, **k: calls.append(1) or parallel(
      self, *a, **k))
  sharded = jax.device_put(state, shd.named(mesh, shd.param_specs(
      state, nnx.get_partition_spec(state), mesh)))
  got = evaluate.completions(graphdef, sharded, TOKENIZER, prompts, max_new_tokens=6,
                             batch_size=4, prompt_len=8)
  assert calls and got == want


def test_inside_a_shard_map_the_layer_runs_on_what_each_device_holds():
  # Manual axes already (a user's shard_map): no second shard_map; each device's tokens go
  # through the whole experts it was given, as on one device.
  graphdef, state = _layer(MOE.replace(expert_parallel=True))
  x = jax.random.normal(jax.random.key(1), (4, 6, MOE.hidden_size))
  want = nnx.merge(graphdef, state)(x)[0]
  mesh = _mesh((1, 2, 1))  # fsdp 2 would split the 4 experts, outside a shard_map

  def per_device(state, x):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.shard_map(lambda st, x: nnx.merge(graphdef, st)(x)[0], mesh=mesh,
                           in_specs=(P(), P("fsdp")), out_specs=P("fsdp"))(state, x)

  got = jax.jit(per_device)(state, jax.device_put(x, NamedSharding(mesh, P("fsdp"))))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
