"""The attention kernels traced with a mesh in context (the train step's) run per device
under shard_map, rows over (data, fsdp) and heads over tensor: the same outputs and
gradients as on one device, for the XLA path and the Pallas kernels (interpret mode), and
the TPU export holds the Mosaic kernel inside the per-device computation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kernel_cases import ODD_GQA_PADDED
from rlax_ps import sharding as shd
from rlax_ps.kernels.dispatch import (shared_prefix_decode_attention,
                                      shared_prefix_extend_attention, shared_prompt_attention)
from rlax_ps.kernels.kv_quant import quantize

# Two rows, 4 q heads over 2 kv heads: rows split over data, heads over tensor.
MESH_AXES = {"data": 2, "fsdp": 1, "tensor": 2}


def _mesh(tensor=MESH_AXES["tensor"]):
  axes = {**MESH_AXES, "tensor": tensor}
  return shd.make_mesh(axes, jax.devices()[:axes["data"] * tensor])


def _traced(mesh, fn):
  """fn jitted, traced with the mesh in context (as jit_step does)."""
  def on_mesh(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args)
  return jax.jit(on_mesh)


# "auto" is slow (suite time): wider_than_kv_heads runs the same backend on a wider mesh.
@pytest.mark.parametrize("backend,kw,tensor", [pytest.param("auto", {}, 2,
                                                            marks=pytest.mark.slow),
                                               ("pallas_tpu", dict(interpret=True), 2),
                                               ("auto", {}, 4)],
                         ids=["auto", "pallas", "wider_than_kv_heads"])
def test_training_attention_per_device_equals_one_device(backend, kw, tensor):
  # On a tensor axis wider than the 2 kv heads, each is repeated to one per device: the
  # 4 query heads still split, and k's and v's gradients sum over the repeats.
  layout, q, k, v, do = ODD_GQA_PADDED.inputs()
  attend = functools.partial(shared_prompt_attention, layout=layout, backend=backend, **kw)

  def loss(q, k, v):
    o, lse = attend(q, k, v)
    return jnp.sum(o * do) + jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse)), (o, lse)

  (want, (o1, lse1)), grads1 = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
      q, k, v)
  mesh = _mesh(tensor)
  heads = NamedSharding(mesh, P("data", None, "tensor"))
  step = _traced(mesh, jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
  args = [jax.device_put(a, heads if a.shape[2] % tensor == 0 else NamedSharding(mesh, P()))
          for a in (q, k, v)]
  # It runs per device, on its share of the heads (after the layout's closed-over arrays).
  q_local, k_local = [s for s in _shard_map_inputs(step, args) if len(s) == 4][:2]
  assert (q_local[2], k_local[2]) == (q.shape[2] // tensor, max(k.shape[2] // tensor, 1))
  (got, (o, lse)), grads = step(*args)
  np.testing.assert_allclose(np.asarray(o), np.asarray(o1), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse1))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for a, b in zip(grads, grads1):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def _decode_cases():
  """(extend, held, kv heads): one kv head with an int8 cache joins two paths each case
  tests apart (~3 s each), so it runs with the slow suite; so does decode with an int8 cache
  (extend-int8-gqa splits the int8 codes and scales, decode-None-gqa the decode kernel)."""
  for extend in (False, True):
    for held in (None, "int8"):
      for hkv in (2, 1):
        yield pytest.param(extend, held, hkv,
                           id=f"{'extend' if extend else 'decode'}-{held}-"
                              f"{'gqa' if hkv == 2 else 'one_kv_head'}",
                           marks=[pytest.mark.slow] if held and (hkv == 1 or not extend)
                           else [])


@pytest.mark.parametrize("extend,held,hkv", _decode_cases())
def test_decode_attention_per_device_equals_one_device(extend, held, hkv):
  # One kv head (multi-query; latent attention's cache): every device reads it whole while
  # the query heads still split over tensor.
  ks = jax.random.split(jax.random.key(7), 5)
  b, n, h, d, s, ss, t = 2, 3, 4, 16, 20, 12, 3
  q = jax.random.normal(ks[0], (b, n, t, h, d) if extend else (b, n, h, d))
  args = (q, jax.random.normal(ks[1], (b, s, hkv, d)),
          jax.random.normal(ks[2], (b, s, hkv, d)), np.array([20, 5], np.int32),
          jax.random.normal(ks[3], (b, n, ss, hkv, d)),
          jax.random.normal(ks[4], (b, n, ss, hkv, d)),
          np.array([[1, 9, 0], [3, 0, 7]], np.int32))  # lengths, or where t tokens go
  if held:  # int8 codes and their scales split alike (heads over tensor)
    args = tuple(quantize(a) if i in (1, 2, 4, 5) else a for i, a in enumerate(args))
  attend = functools.partial(
      shared_prefix_extend_attention if extend else shared_prefix_decode_attention,
      backend="pallas_tpu", interpret=True, block_s=8)
  want = jax.jit(attend)(*args)
  mesh = _mesh()
  step = _traced(mesh, attend)
  args = jax.device_put(args, NamedSharding(mesh, P()))  # the cache on the mesh's devices
  per_device = _shard_map_inputs(step, args)
  assert per_device[0][-2] == h // MESH_AXES["tensor"]  # q's heads split
  assert per_device[1][2] == hkv // MESH_AXES["tensor"] or hkv == 1  # the cache's where they can
  for got, ref in zip(step(*args), want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-5)


def _shard_map_inputs(fn, args):
  """The shapes the per-device computation of jitted `fn` takes (its one shard_map's)."""
  def find(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "shard_map":
        return [v.aval.shape for v in eqn.params["jaxpr"].invars]
      for sub in jax.core.jaxprs_in_params(eqn.params):
        found = find(sub)
        if found:
          return found
    return None
  found = find(jax.make_jaxpr(fn)(*args).jaxpr)
  assert found is not None, "no shard_map: not run per device"
  return found


def test_one_device_or_no_mesh_calls_the_kernel_as_it_is():
  layout, q, k, v, _ = ODD_GQA_PADDED.inputs()
  attend = functools.partial(shared_prompt_attention, layout=layout)
  assert "shard_map" not in str(jax.make_jaxpr(attend)(q, k, v))
  one = shd.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  assert "shard_map" not in str(jax.make_jaxpr(_traced(one, attend))(q, k, v))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_export_runs_the_kernel_per_device(platform):
  layout, q, k, v, do = ODD_GQA_PADDED.inputs()
  mesh = _mesh()

  def grads(q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(shared_prompt_attention(q, k, v, layout)[0] * do),
                    (0, 1, 2))(q, k, v)

  heads = NamedSharding(mesh, P("data", None, "tensor"))
  abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=heads) for a in (q, k, v)]
  checks = [] if platform == "tpu" else [  # Triton calls have no stability guarantee
      jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  text = jax.export.export(_traced(mesh, grads), platforms=[platform],
                           disabled_checks=checks)(*abstract).mlir_module()
  kernel = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
  manual = text.index("sdy.manual_computation")
  assert kernel in text[manual:]  # the kernel sits inside the per-device computation


def test_inside_a_shard_map_the_kernel_is_already_per_device():
  layout, q, k, v, _ = ODD_GQA_PADDED.inputs()
  want = shared_prompt_attention(q, k, v, layout)[0]
  mesh = _mesh()
  rows = P("data")

  def per_device(q, k, v, prompt_lens, response_lens):
    local = layout.__class__(prompt_lens, response_lens, layout.num_responses,
                             layout.prompt_capacity, layout.response_capacity)
    return shared_prompt_attention(q, k, v, local)[0]

  fn = _traced(mesh, jax.shard_map(per_device, mesh=mesh, in_specs=(rows,) * 5,
                                   out_specs=rows, check_vma=False))  # as Pallas wants
  args = jax.device_put((q, k, v, layout.prompt_lens, layout.response_lens),
                        NamedSharding(mesh, rows))
  np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(want), atol=1e-5, rtol=1e-5)
