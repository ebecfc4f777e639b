"""Mesh sizes from config, partition specs fitted to shapes, optimizer state following params."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from rlax_ps import sharding as shd


def test_mesh_shape_fills_one_minus_one_axis():
  assert shd.mesh_shape({"data": -1, "tensor": 2}, 8) == (4, 1, 2)
  assert shd.mesh_shape({"fsdp": 8}, 8) == (1, 8, 1)


@pytest.mark.parametrize("axes, message", [
    ({"data": 3}, "data\\*fsdp\\*tensor == 8 devices"),
    ({"data": -1, "fsdp": -1}, "at most one axis may be -1"),
    ({"pipeline": 2}, "unknown axes \\['pipeline'\\]"),
    ({"data": 0}, "mesh.data: expected a positive int or -1, got 0"),
    ({"data": -1, "tensor": 3}, "not divisible"),
])
def test_bad_mesh_config_is_named(axes, message):
  with pytest.raises(ValueError, match=message):
    shd.mesh_shape(axes, 8)


def test_make_mesh_has_the_three_axes():
  mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  assert mesh.axis_names == shd.MESH_AXES and dict(mesh.shape) == {"data": 2, "fsdp": 2,
                                                                    "tensor": 2}


def test_fit_spec_drops_axes_that_do_not_divide():
  mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  assert shd.fit_spec(P("tensor", "fsdp"), (99, 32), mesh) == P(None, "fsdp")
  assert shd.fit_spec(P("fsdp", "tensor"), (32, 64), mesh) == P("fsdp", "tensor")
  assert shd.fit_spec(P(("data", "fsdp")), (6, 5), mesh) == P("data")  # 6 % 4 != 0.
  assert shd.fit_spec(P(("data", "fsdp")), (8, 5), mesh) == P(("data", "fsdp"))
  assert shd.fit_spec(P(None), (3,), mesh) == P()


def test_params_a_mesh_cannot_split_are_named_with_the_bytes_a_device_then_holds():
  """fit_spec's dropped axes left whole weights (and their Adam moments) on every device,
  silently: a user saw only the memory run out."""
  abstract = {"q_proj": jax.ShapeDtypeStruct((96, 96), np.float32),
              "norm": jax.ShapeDtypeStruct((96,), np.float32)}
  specs = {"q_proj": P("fsdp", "tensor"), "norm": P()}
  six = shd.make_mesh({"fsdp": 4, "tensor": 2})  # 96 splits 4 ways and 2 ways: as asked
  assert shd.replication_note(abstract, specs, six) is None
  odd = {"q_proj": jax.ShapeDtypeStruct((2050, 1024), np.float32), "norm": abstract["norm"]}
  note = shd.replication_note(odd, specs, shd.make_mesh({"fsdp": 8}))  # 2050 % 8 != 0
  assert note is not None and "1 params cannot be split as their specs ask" in note
  assert "q_proj (2050, 1024)" in note and "holds 8.0 MiB of params, not 1.0 MiB" in note


def test_batch_spec_splits_rows_over_data_and_fsdp():
  mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  batch = shd.shard_batch(mesh, {"tokens": np.arange(8 * 3).reshape(8, 3)})
  tokens = batch["tokens"]
  assert tokens.sharding.spec == P(("data", "fsdp"))
  assert tokens.addressable_shards[0].data.shape == (2, 3)
  np.testing.assert_array_equal(np.asarray(tokens), np.arange(24).reshape(8, 3))


def test_optimizer_state_follows_param_specs():
  params = {"w": np.zeros((4, 8), np.float32), "b": np.zeros((8,), np.float32)}
  specs = {"w": P("fsdp", "tensor"), "b": P("tensor")}
  opt_state = jax.eval_shape(optax.adamw(1e-3).init, params)
  out = shd.follow_param_specs(opt_state, params, specs)
  adam = out[0]
  assert adam.mu == specs and adam.nu == specs
  assert adam.count == P()  # Scalars are replicated.


def test_rows_that_the_batch_axes_do_not_divide_are_named():
  mesh = shd.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
  assert shd.unsplit_rows(mesh, 16) is None
  assert shd.unsplit_rows(mesh, 12) == ("12 rows a micro-batch are not a multiple of mesh "
                                        "data*fsdp = 8, so they are split 2 way(s) and each "
                                        "share is computed 4 times over")


def test_heads_that_the_tensor_axis_does_not_split_are_named():
  """Qwen2.5-7B's 28 query heads on tensor=8: the kernels ran every head on every device."""
  mesh = shd.make_mesh({"data": 1, "fsdp": 1, "tensor": 8})
  assert shd.unsplit_heads(mesh, 32, 8) is None and shd.unsplit_heads(mesh, 32, 4) is None
  assert shd.unsplit_heads(mesh, 32, 16) is None
  assert shd.unsplit_heads(mesh, 28, 4) == (
      "mesh tensor=8 does not split the attention's 28 query and 4 kv heads, so each of the 8 "
      "tensor devices computes all of them; a tensor axis that divides the query heads, and "
      "divides or is divided by the kv heads, splits them")
  assert shd.unsplit_heads(mesh, 24, 3) is not None  # 8 neither divides nor is divided by 3
  assert shd.unsplit_heads(shd.make_mesh({"data": 8, "fsdp": 1, "tensor": 1}), 28, 4) is None
