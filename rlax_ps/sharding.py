"""Device meshes and shardings: a (data, fsdp, tensor) mesh from config, parameter specs from
the model's NNX sharding metadata, optimizer-state specs that follow their parameters, and
batch sharding over (data, fsdp).

An axis that does not divide the dimension it would split is dropped for that array (it is
replicated along that axis instead), so any mesh works with any model size.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # The batch dimension is split over both.


def check_mesh_axes(axes: Mapping[str, int]) -> list[int]:
  """Sizes of (data, fsdp, tensor) as the `mesh` block gives them (-1 kept), checked
  without knowing the devices: ValueError naming the field."""
  unknown = sorted(set(axes) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"mesh: unknown axes {unknown}; expected some of {MESH_AXES}")
  sizes = [int(axes.get(a, 1)) for a in MESH_AXES]
  for name, s in zip(MESH_AXES, sizes):
    if s == 0 or s < -1:
      raise ValueError(f"mesh.{name}: expected a positive int or -1, got {s}")
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
  return sizes


def mesh_shape(axes: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
  """Sizes of (data, fsdp, tensor) from config; one axis may be -1 (= what remains)."""
  sizes = check_mesh_axes(axes)
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if num_devices % known:
      raise ValueError(f"mesh: {num_devices} devices are not divisible by the fixed axes "
                       f"{dict(zip(MESH_AXES, sizes))}")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh: expected data*fsdp*tensor == {num_devices} devices, got "
                     f"{dict(zip(MESH_AXES, sizes))} (product {math.prod(sizes)})")
  return tuple(sizes)


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with axes (data, fsdp, tensor), all of AxisType.Auto (GSPMD propagation)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(axes, len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
  """`spec` with every mesh axis removed whose size does not divide what it splits."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if len(entries) > len(shape):
    raise ValueError(f"partition spec {spec} has more entries than the array has dims {shape}")
  out = []
  for dim, entry in zip(shape, entries):
    if entry is None:
      out.append(None)
      continue
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    kept, prod = [], 1
    for a in axes:
      size = mesh.shape[a]
      if dim % (prod * size) == 0:
        kept.append(a)
        prod *= size
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def _is_spec(x) -> bool:
  return isinstance(x, P)


def param_specs(abstract_params: Any, spec_tree: Any, mesh: Mesh) -> Any:
  """Fit a tree of PartitionSpecs (from `nnx.get_partition_spec`) to the param shapes."""
  return jax.tree.map(lambda s, x: fit_spec(s, x.shape, mesh), spec_tree, abstract_params,
                      is_leaf=_is_spec)


def _shards(spec: P, mesh: Mesh) -> int:
  """How many pieces `spec` cuts an array into on `mesh`."""
  axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
  return math.prod(mesh.shape[a] for a in axes)


def replication_note(abstract_params: Any, spec_tree: Any, mesh: Mesh) -> str | None:
  """What fit_spec's dropped axes cost (a mesh axis that does not divide a dimension leaves
  it whole on each device): a line naming the params and the bytes a device then holds,
  or None when that is within 10% of what the specs ask."""
  want = got = 0.0
  lost = []
  leaves = jax.tree_util.tree_flatten_with_path(spec_tree, is_leaf=_is_spec)[0]
  for (path, spec), x in zip(leaves, jax.tree.leaves(abstract_params)):
    nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
    asked, fitted = _shards(spec, mesh), _shards(fit_spec(spec, x.shape, mesh), mesh)
    want, got = want + nbytes / asked, got + nbytes / fitted
    if fitted < asked:
      lost.append((nbytes / fitted - nbytes / asked, "/".join(_path_key(path)), x.shape))
  if got <= 1.1 * want:
    return None
  lost.sort(reverse=True)
  named = ", ".join(f"{name} {tuple(shape)}" for _, name, shape in lost[:3])
  return (f"mesh {dict(mesh.shape)}: {len(lost)} params cannot be split as their specs ask "
          f"(a mesh axis does not divide a dimension; e.g. {named}), so each device holds "
          f"{got / 2**20:,.1f} MiB of params, not {want / 2**20:,.1f} MiB, and their "
          f"optimizer moments alike; choose mesh axis sizes that divide the model's "
          f"dimensions (powers of two usually do)")


def _path_key(path) -> tuple:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def follow_param_specs(tree: Any, params: Any, specs: Any) -> Any:
  """Specs for any tree holding copies of the params (optimizer moments, gradients): a leaf
  whose path ends with a param's path and has its shape gets that param's spec; every other
  leaf (step counts, scalars) is replicated."""
  by_path = {}
  for (path, spec), x in zip(
      jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0], jax.tree.leaves(params)):
    by_path[_path_key(path)] = (spec, tuple(x.shape))

  def spec_for(path, leaf):
    key = _path_key(path)
    shape = tuple(np.shape(leaf))
    for start in range(len(key)):
      hit = by_path.get(key[start:])
      if hit is not None and hit[1] == shape:
        return hit[0]
    return P()

  return jax.tree_util.tree_map_with_path(spec_for, tree)


def named(mesh: Mesh, specs: Any) -> Any:
  """PartitionSpec tree -> NamedSharding tree on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def batch_spec(mesh: Mesh, shape: Sequence[int]) -> P:
  """Split dim 0 over (data, fsdp) as far as it divides; other dims replicated."""
  return fit_spec(P(BATCH_AXES), shape, mesh)


def unsplit_rows(mesh: Mesh, rows: int) -> str | None:
  """Why `rows` (a micro-batch's) would not be split over all data*fsdp devices, or None: the
  axes that do not divide it are dropped, and the devices along them repeat one another's
  work."""
  split = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if rows % split == 0:
    return None
  kept = batch_spec(mesh, (rows,))
  used = math.prod(mesh.shape[a] for e in kept if e for a in ((e,) if isinstance(e, str) else e))
  return (f"{rows} rows a micro-batch are not a multiple of mesh data*fsdp = {split}, so they "
          f"are split {used} way(s) and each share is computed {split // used} times over")


def unsplit_heads(mesh: Mesh, q_heads: int, kv_heads: int) -> str | None:
  """Why attention would not split over the mesh's tensor axis, or None: the kernels split
  the query heads, and kv heads as many or repeated up to it (kernels.dispatch); otherwise
  every tensor device computes every head."""
  t = mesh.shape.get("tensor", 1)
  if t == 1 or (q_heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)):
    return None
  return (f"mesh tensor={t} does not split the attention's {q_heads} query and {kv_heads} kv "
          f"heads, so each of the {t} tensor devices computes all of them; a tensor axis "
          f"that divides the query heads, and divides or is divided by the kv heads, splits "
          f"them")


def shard_batch(mesh: Mesh, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
  """Place a global host batch on the mesh, rows split over (data, fsdp).

  Every process holds the whole batch and hands each of its devices the slice that device
  owns, so the same call is right on one host and on a multi-host slice.
  """
  out = {}
  for k, v in batch.items():
    v = np.asarray(v)
    sharding = NamedSharding(mesh, batch_spec(mesh, v.shape))
    out[k] = jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
  return out


def to_host(tree: Any, keep: bool = True) -> Any:
  """jax.device_get(tree), also where an array has shards on other processes (a multi-host
  slice): those are gathered from them, so every process must make the same call.
  keep=False (a process that needs none of it): only the gathers, which are collective,
  one array at a time and nothing kept; returns None."""
  def local(x):
    return not isinstance(x, jax.Array) or x.is_fully_addressable

  if all(local(x) for x in jax.tree.leaves(tree)):
    return jax.device_get(tree) if keep else None
  from jax.experimental import multihost_utils

  def one(x):
    if not (local(x) or x.is_fully_replicated):
      gathered = multihost_utils.process_allgather(x, tiled=True)  # collective
      return gathered if keep else None
    if not keep:
      return None
    return jax.device_get(x) if local(x) else np.asarray(x.addressable_data(0))

  out = jax.tree.map(one, tree)
  return out if keep else None


def agreed_stop(stop: bool, signum: int | None) -> tuple[bool, int | None]:
  """(whether any process of a multi-host job was asked to stop, a signal one was stopped
  by) on every process (a collective): all stop at one step, saving, evaluating and exiting
  alike (a save or evaluation some processes skip waits for them for ever)."""
  if jax.process_count() == 1:
    return stop, signum
  from jax.experimental import multihost_utils
  asked = np.max(multihost_utils.process_allgather(
      np.asarray([stop, signum or 0], np.int32)), axis=0)
  return bool(asked[0]), int(asked[1]) or None


def broadcast_int(value: int) -> int:
  """Process 0's `value` (any int64) on every process of a multi-host job (a collective):
  as its 8 bytes, since JAX without x64 holds an int64 as int32 (a 3 GB keyframe's length
  crossed as -1.3 GB, and the followers got none of it)."""
  from jax.experimental import multihost_utils
  raw = np.frombuffer(np.asarray(value, np.int64).tobytes(), np.uint8)
  got = np.asarray(multihost_utils.broadcast_one_to_all(raw), np.uint8)
  return int(np.frombuffer(got.tobytes(), np.int64)[0])
