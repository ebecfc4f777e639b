"""LoRA: a model whose projections carry low-rank adapters trains the adapters alone. The
adapter starts as a no-op and adds (x @ A) @ B * alpha / rank; gradients and optimizer state
cover the adapters only; the frozen base never changes, so each published delta carries
the adapters alone and workers (bf16 or int8) compute the trainer's adapted model; exports
merge the adapters into the kernels."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from benchmarks_lib import load_benchmark
from inference_workers.weights import HeldPolicy
from rl_testlib import FakeWorker, client, rl_config, start_server
from rlax_ps import sync
from rlax_ps.models import (ModelConfig, Transformer, assign_params, flatten_params,
                            load_hf_checkpoint, save_hf_checkpoint)
from rlax_ps.models.transformer import LoRALinear
from rlax_ps.sharding import make_mesh
from rlax_ps.train.publisher import flat_params
from rlax_ps.train.rl import RLTrainer
from rlax_ps.train.state import hf_params
from rlax_ps.train.trainable import join, split_trainable, trainable_value_and_grad

BASE = ModelConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_layers=2,
                   num_heads=4, num_kv_heads=2, qkv_bias=True, architecture="qwen2")
LORA = BASE.replace(lora_rank=4, lora_alpha=8.0)
TOKENS = np.random.default_rng(0).integers(0, 48, (2, 7))


@nnx.jit
def forward(model, tokens):
  return model(tokens)


def _adapted(seed=0):
  """A LoRA model whose B matrices are random (trained-looking), and its params."""
  model = Transformer(LORA, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  params = {k: np.asarray(v) + (rng.normal(0, 0.3, v.shape).astype(np.float32)
                                if k.endswith("lora_b") else 0)
            for k, v in flatten_params(model).items()}
  assign_params(model, params)
  return model, params


def test_an_adapter_starts_as_a_no_op_and_adds_its_low_rank_product():
  lora = Transformer(LORA, rngs=nnx.Rngs(0))
  flat = flatten_params(lora)
  assert sorted(k for k in flat if "layers.0." in k and ".lora_" in k) == sorted(
      f"layers.0.{m}.{p}_proj.lora_{ab}" for m, p in
      [("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "o"), ("mlp", "gate"),
       ("mlp", "up"), ("mlp", "down")] for ab in "ab")
  assert LORA.num_params == sum(int(np.prod(v.shape)) for v in flat.values())
  base = Transformer(BASE, rngs=nnx.Rngs(0))
  assign_params(base, {k: v for k, v in flat.items() if ".lora_" not in k})
  np.testing.assert_array_equal(np.asarray(forward(lora, TOKENS)),
                                np.asarray(forward(base, TOKENS)))  # B = 0
  layer = LoRALinear(6, 5, rank=2, alpha=3.0, sharding=(None, None), use_bias=True,
                     rngs=nnx.Rngs(1))
  layer.lora_b.value = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5)), jnp.float32)
  x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 6)), jnp.float32)
  want = (x @ layer.kernel[...] + layer.bias[...]
          + (x @ layer.lora_a[...]) @ layer.lora_b[...] * 1.5)
  np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(want), atol=1e-5)
  with pytest.raises(ValueError, match="ModelConfig.lora_targets"):
    BASE.replace(lora_rank=4, lora_targets=("lm_head",))


def test_targets_naming_none_of_the_models_projections_are_refused():
  """LoRA on "experts" of a dense model, or on the dense MLP of one whose every layer routes
  to experts, built no adapter: every weight trained, as without LoRA."""
  moe = BASE.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
  for config, targets in ((BASE, ("experts",)), (moe, ("gate_proj", "up_proj", "down_proj"))):
    with pytest.raises(ValueError, match=r"ModelConfig.lora_targets: expected some of this "
                                         rf"model's projections .*got \('{targets[0]}'"):
      config.replace(lora_rank=4, lora_targets=targets)
  model = Transformer(moe.replace(lora_rank=4, lora_targets=("experts",)), rngs=nnx.Rngs(0))
  trainable, frozen = split_trainable(nnx.state(model, nnx.Param).to_pure_dict())
  assert frozen and all(".lora_" in k for k in flat_params(trainable))
  # A checkpoint saved with such targets (before they were refused) trained every weight:
  # read back as that plain model, so that it still resumes or exports.
  saved = dict(BASE.to_dict(), lora_rank=4, lora_targets=["experts"])
  assert ModelConfig.from_dict(saved).lora_rank == 0
  # A layer of its own dense MLP (mlp_only_layers) or a shared expert gives the MLP targets.
  moe.replace(lora_rank=4, lora_targets=("gate_proj",), mlp_only_layers=(0,))
  moe.replace(lora_rank=4, lora_targets=("gate_proj",), shared_expert_intermediate_size=8)


def test_only_the_adapters_take_a_gradient():
  model, _ = _adapted()
  params = nnx.state(model, nnx.Param).to_pure_dict()
  trainable, frozen = split_trainable(params)
  assert jax.tree.leaves(trainable) and all(
      ".lora_" in ".".join(str(getattr(k, "key", k)) for k in path)
      for path, _ in jax.tree_util.tree_flatten_with_path(trainable)[0])
  assert jax.tree.structure(join(trainable, frozen)) == jax.tree.structure(params)
  graphdef = nnx.graphdef(model)

  def loss(p):
    return jnp.mean(nnx.merge(graphdef, p)(TOKENS) ** 2), {}

  (_, _), grads = jax.jit(trainable_value_and_grad(loss))(params)
  assert jax.tree.structure(grads) == jax.tree.structure(trainable)
  full = jax.jit(jax.grad(lambda p: loss(p)[0]))(params)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                          jax.tree.leaves(split_trainable(full)[0])):
    np.testing.assert_allclose(g, w, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 0
  # Without adapters every param trains.
  plain = nnx.state(Transformer(BASE, rngs=nnx.Rngs(0)), nnx.Param).to_pure_dict()
  assert split_trainable(plain) == (plain, {})


def test_exports_merge_the_adapters_into_the_kernels(tmp_path):
  model, _ = _adapted()
  save_hf_checkpoint(model, str(tmp_path))
  merged = load_hf_checkpoint(str(tmp_path))
  assert merged.config.lora_rank == 0 and not any(".lora_" in k
                                                  for k in flatten_params(merged))
  np.testing.assert_allclose(np.asarray(forward(merged, TOKENS)),
                             np.asarray(forward(model, TOKENS)), atol=1e-5)


def test_a_float32_export_of_a_bf16_base_holds_the_whole_update(tmp_path):
  """The merge was stored in the base kernel's bf16 before the export's cast: most of a small
  update rounded away even in a float32 export."""
  model = Transformer(LORA.replace(param_dtype="bfloat16"), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  flat = flatten_params(model)
  assign_params(model, {k: np.asarray(v) + (rng.normal(0, 1e-3, v.shape).astype(np.float32)
                                            if k.endswith("lora_b") else 0)
                        for k, v in flat.items()})
  flat = {k: np.asarray(v, np.float32) for k, v in flatten_params(model).items()}
  save_hf_checkpoint(model, str(tmp_path), dtype="float32")
  got = load_file(os.path.join(tmp_path, "model.safetensors"))[
      "model.layers.0.self_attn.q_proj.weight"]
  stem = "layers.0.attn.q_proj."
  want = flat[stem + "kernel"] + flat[stem + "lora_a"] @ flat[stem + "lora_b"] * (
      LORA.lora_alpha / LORA.lora_rank)
  np.testing.assert_allclose(got.T, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_worker_computes_the_adapted_model(fmt):
  model, params = _adapted()
  held = sync.held_state(params, fmt)
  assert held["layers.0.attn.q_proj.lora_a"].dtype == held["layers.0.attn.q_proj.bias"].dtype
  policy = HeldPolicy(LORA, fmt)
  policy.apply(sync.encode(None, params, fmt, version=0))
  reference = Transformer(LORA.replace(param_dtype="bfloat16") if fmt == "bf16" else LORA,
                          rngs=nnx.Rngs(0))
  assign_params(reference, sync.dequantize(held) if fmt == "int8" else
                {k: jnp.asarray(v, jnp.bfloat16) for k, v in params.items()})
  np.testing.assert_allclose(np.asarray(forward(policy.model, TOKENS)),
                             np.asarray(forward(reference, TOKENS)), atol=2e-3, rtol=2e-3)
  # The adapters matter: the same worker without them is another model.
  assert np.abs(np.asarray(forward(policy.model, TOKENS))
                - np.asarray(forward(Transformer(BASE, rngs=nnx.Rngs(0)), TOKENS))).max() > 0.01


def test_a_checkpoint_to_start_from_gets_fresh_no_op_adapters(tmp_path):
  base = Transformer(BASE, rngs=nnx.Rngs(5))
  save_hf_checkpoint(base, str(tmp_path))
  mesh = make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
  params = hf_params(LORA, mesh, str(tmp_path), seed=1)
  model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Transformer(LORA, rngs=nnx.Rngs(0)))),
                    params)
  lora_b = [v for k, v in flatten_params(model).items() if k.endswith("lora_b")]
  assert lora_b and all(float(jnp.abs(b).max()) == 0 for b in lora_b)
  assert any(float(jnp.abs(v).max()) > 0 for k, v in flatten_params(model).items()
             if k.endswith("lora_a"))
  np.testing.assert_allclose(np.asarray(forward(model, TOKENS)),
                             np.asarray(forward(base, TOKENS)), atol=1e-6)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("lora")
  server = start_server(tmp / "ps")
  worker = FakeWorker(server.address, samples=4).start()
  config = rl_config("tiny")
  config.rl.steps = 2
  config.eval.num_examples = 2  # evaluated greedily: pass@k samples with the same model
  config.eval.batch_size = 2
  config.eval.pass_k = 0
  config.model.lora_rank = 4
  config.model.lora_alpha = 8.0
  config.model.param_dtype = "bfloat16"  # the frozen base, as configs/rl_lora.py
  config.model.lora_dtype = "float32"
  config.optimizer.lr = 1e-2
  with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp / "rl"), tc) as tr:
    before = {k: np.asarray(v) for k, v in flat_params(tr.state.params).items()}
    opt_leaves = [".".join(str(getattr(k, "key", k)) for k in path)
                  for path, x in jax.tree_util.tree_flatten_with_path(tr.state.opt_state)[0]
                  if np.ndim(x) >= 2]
    tr.train()
    after = {k: np.asarray(v) for k, v in flat_params(tr.state.params).items()}
  worker.stop()
  with client(server.address, "worker") as wc:
    updates = [sync.Update.from_bytes(bytes(b)) for b in wc.pull(None)]
  yield dict(tmp=tmp, before=before, after=after, updates=updates, opt_leaves=opt_leaves)
  server.stop(grace=0)


@pytest.mark.slow  # ~13 s; the supervised LoRA step test holds the same in the default suite
def test_a_lora_run_trains_the_adapters_and_leaves_the_base_alone(lora_run):
  before, after = lora_run["before"], lora_run["after"]
  adapters = [k for k in before if ".lora_" in k]
  assert adapters and len(adapters) < len(before)
  assert {str(before[k].dtype) for k in before} == {"bfloat16", "float32"}
  assert {str(before[k].dtype) for k in adapters} == {"float32"}  # the base is bf16
  for k in before:
    if k in adapters:
      continue
    np.testing.assert_array_equal(after[k], before[k], err_msg=k)  # frozen, bit for bit
  assert any(np.abs(after[k] - before[k]).max() > 0 for k in adapters if k.endswith("lora_b"))
  # Optimizer moments exist for the adapters alone.
  assert lora_run["opt_leaves"] and all(".lora_" in k for k in lora_run["opt_leaves"])


def test_a_lora_runs_deltas_carry_only_the_adapters_and_decode_to_its_weights(lora_run):
  updates, after = lora_run["updates"], lora_run["after"]
  assert updates[0].is_keyframe and len(updates) > 1
  held = sync.apply(None, updates[0])
  for u in updates[1:]:
    assert not u.is_keyframe
    u = u.bind(held)
    changed = [name for name in u.tensors if u.changes(name).kind != "unchanged"]
    assert changed and all(".lora_" in name for name in changed), changed
    held = sync.apply(held, u)
  want = sync.held_state(after, "bf16")
  for k in want:
    assert held[k].tobytes() == want[k].tobytes(), k


def test_a_lora_runs_export_holds_the_merged_model(lora_run):
  path = str(lora_run["tmp"] / "rl" / "hf")
  export = flatten_params(load_hf_checkpoint(path, dtype="bfloat16"))
  after = lora_run["after"]
  assert not any(".lora_" in k for k in export)
  for key in ("layers.0.attn.q_proj.kernel", "layers.0.mlp.down_proj.kernel"):
    stem = key[:-len("kernel")]
    merged = (after[key].astype(np.float32) + after[stem + "lora_a"] @ after[stem + "lora_b"]
              * 2.0).astype(after[key].dtype)  # alpha / rank = 8 / 4, stored as the base
    assert np.abs(merged.astype(np.float32) - after[key].astype(np.float32)).max() > 0
    np.testing.assert_array_equal(np.asarray(export[key]), merged, err_msg=key)
  # ... and the adapters alone as a PEFT adapter (tests/models/test_peft.py loads one in PEFT).
  adapter = load_file(os.path.join(path, "adapter", "adapter_model.safetensors"))
  np.testing.assert_array_equal(
      adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
      after["layers.0.attn.q_proj.lora_b"].T)
  assert len(adapter) == len([k for k in after if ".lora_" in k])


@pytest.mark.parametrize("num_micro", [1, pytest.param(2, marks=pytest.mark.slow)])  # (~5 s)
def test_a_supervised_lora_step_moves_the_adapters_alone(num_micro):
  from rlax_ps import optim
  from rlax_ps.train.state import sharded_init
  from rlax_ps.train.step import make_train_step
  mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  optimizer = optim.make_optimizer({"lr": 1e-2, "warmup_steps": 0}, 10)
  state, shardings, graphdef = sharded_init(LORA, optimizer, mesh, seed=0)
  before = {k: np.asarray(v) for k, v in flat_params(state.params).items()}
  tokens = np.random.default_rng(1).integers(0, 48, (4, 8)).astype(np.int32)
  batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1),
           "loss_mask": np.ones((4, 8), np.float32),
           "positions": np.broadcast_to(np.arange(8, dtype=np.int32), (4, 8)).copy(),
           "segment_ids": np.ones((4, 8), np.int32)}
  step = make_train_step(graphdef, optimizer, shardings, mesh, num_micro=num_micro)
  losses = []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  after = {k: np.asarray(v) for k, v in flat_params(state.params).items()}
  moved = {k for k in before if np.abs(after[k] - before[k]).max() > 0}
  assert moved <= {k for k in before if ".lora_" in k}  # the base stays as it was
  assert {k for k in before if k.endswith("lora_b")} <= moved
  assert losses[-1] < losses[0]  # the adapters learn the batch


def _moe_with_adapters():
  """(config, model, flat params) of a tiny Qwen3-MoE with adapters on its experts, their B
  drawn away from 0 (so that they matter)."""
  moe = LORA.replace(architecture="qwen3_moe", qkv_bias=False, qk_norm=True, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True)
  model = Transformer(moe, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(4)
  params = {k: np.asarray(v) + (rng.normal(0, 0.3, v.shape).astype(np.float32)
                                if "lora_" in k and k.endswith("_b") else 0)
            for k, v in flatten_params(model).items()}
  assign_params(model, params)
  return moe, model, params


def _merged(params, moe):
  from rlax_ps.models.hf import merge_adapters
  merged_params, merged_config = merge_adapters(params, moe)
  merged = Transformer(merged_config, rngs=nnx.Rngs(0))
  assign_params(merged, merged_params)
  return merged, merged_params


def test_expert_adapters_merge_into_the_experts():
  moe, model, params = _moe_with_adapters()
  assert params["layers.0.mlp.experts.lora_down_a"].shape == (4, 8, 4)
  assert moe.num_params == sum(int(np.prod(v.shape)) for v in params.values())
  merged, merged_params = _merged(params, moe)
  np.testing.assert_allclose(np.asarray(forward(model, TOKENS)),
                             np.asarray(forward(merged, TOKENS)), atol=1e-5)
  assert np.abs(merged_params["layers.1.mlp.experts.up_proj"]
                - params["layers.1.mlp.experts.up_proj"]).max() > 1e-3  # adapters merged


@pytest.mark.slow  # ~5 s
def test_expert_adapters_equal_merged_experts_by_the_grouped_dispatch_and_in_int8_workers():
  moe, model, params = _moe_with_adapters()
  merged, _ = _merged(params, moe)
  # The grouped (TPU/GPU) dispatch adds each row's own expert's adapter.
  flat = jax.random.normal(jax.random.key(1), (10, 16))
  weights, chosen, *_ = merged.layers[0].mlp.route(flat)
  np.testing.assert_allclose(
      np.asarray(model.layers[0].mlp.grouped(flat, weights, chosen)),
      np.asarray(merged.layers[0].mlp.grouped(flat, weights, chosen)), atol=1e-5)
  # An int8 worker holds the adapters in bf16 beside its int8 experts.
  held = sync.held_state(params, "int8")
  assert held["layers.0.mlp.experts.lora_gate_b"].dtype == held["layers.0.mlp.router.kernel"].dtype
  policy = HeldPolicy(moe, "int8")
  policy.apply(sync.encode(None, params, "int8", version=0))
  reference = Transformer(moe, rngs=nnx.Rngs(0))
  assign_params(reference, sync.dequantize(held))
  np.testing.assert_allclose(np.asarray(forward(policy.model, TOKENS)),
                             np.asarray(forward(reference, TOKENS)), atol=2e-3, rtol=2e-3)


def test_the_memory_benchmarks_state_accounting_counts_what_trains():
  bench = load_benchmark("rl_step_memory")
  adapters = sum(int(np.prod(v.shape)) * 4 for k, v in
                 flatten_params(Transformer(LORA, rngs=nnx.Rngs(0))).items() if ".lora_" in k)
  params, opt, grad = bench.state_bytes(LORA.replace(param_dtype="bfloat16"))
  assert grad == adapters  # float32 adapters alone take a gradient
  assert 2 * adapters <= opt < 2 * adapters + 64  # AdamW's two moments (and its counts)
  assert params == 2 * (LORA.num_params - adapters // 4) + adapters  # bf16 base + f32 adapters
  whole = bench.state_bytes(BASE)
  assert whole[2] == 4 * BASE.num_params and whole[1] >= 8 * BASE.num_params


def test_the_memory_benchmark_prints_one_table_with_a_baseline_per_block():
  bench = load_benchmark("rl_step_memory")
  lines = bench.table([
      ("step temp", "MiB", [("whole batch", 4 * 2**20), ("chunked", 2**20)]),
      ("state", "GiB", [("whole", 8 * 2**30, 2 * 2**30, 4 * 2**30, 2 * 2**30),
                        ("lora", 2**30, 2**29, 2**28, 2**28)])])
  assert len(lines) == 5 and lines[0].split() == ["setting", "total", "params", "optimizer",
                                                  "gradient", "vs", "baseline"]
  assert [line.split()[-1] for line in lines[1:]] == ["1.000x", "0.250x", "1.000x", "0.125x"]
  assert lines[2].split()[2:] == ["chunked", "1.0", "MiB", "-", "-", "-", "0.250x"]
  assert lines[3].split()[1:] == ["whole", "8.0", "GiB", "2.0", "4.00", "2.00", "1.000x"]
