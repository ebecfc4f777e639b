"""A worker's in-place patching of held bit arrays equals the host apply, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import device, patch, wire
from rlax_ps.sync.bits import UINT_OF
from rlax_ps.sync.device import bits_of, values_of


def _on_device(held: dict) -> dict:
  """A held state (numpy bf16/int8) as bit arrays on device, as a worker holds it."""
  return {k: jnp.asarray(np.asarray(v).view(UINT_OF[np.asarray(v).dtype])) for k, v in held.items()}


def _same(got, want) -> bool:
  got, want = np.asarray(jax.device_get(got)), np.asarray(want)
  return got.dtype == UINT_OF[want.dtype] and got.shape == want.shape and (
      got.tobytes() == want.tobytes())


def _base(rng, fmt):
  base = {
      "sparse.kernel": rng.standard_normal((64, 48)).astype(np.float32) * 0.02,
      "dense.kernel": rng.standard_normal((32, 16)).astype(np.float32) * 0.02,
      "same.kernel": rng.standard_normal((8, 8)).astype(np.float32),
      "norm": np.ones(16, np.float32),
  }
  if fmt == "bf16":  # bits kept as they are (int8 quantizes finite weights only)
    base["sparse.kernel"].reshape(-1)[:3] = [np.nan, -0.0, np.inf]
  return base


@pytest.mark.parametrize("by_rows", [False, True], ids=["flat", "by rows"])
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_patching_matches_the_host_apply_for_every_kind(fmt, by_rows, monkeypatch):
  """by rows: the two largest tensors past device.LARGE, as DeepSeek-V3's experts (3.8e9
  elements) are past 2**31, which a flat int32 index cannot reach: patched by [row, column]
  (they were refused, keyframes too)."""
  if by_rows:
    monkeypatch.setattr(device, "LARGE", 512)
  rng = np.random.default_rng(0)
  base = _base(rng, fmt)
  target = dict(base)
  target["sparse.kernel"] = base["sparse.kernel"].copy()
  target["sparse.kernel"][rng.random((64, 48)) < 0.05] *= 1.1
  if fmt == "bf16":
    target["sparse.kernel"].reshape(-1)[1] = np.float32(0.0)  # -0.0 -> 0.0: a sign bit
  target["dense.kernel"] = base["dense.kernel"] * np.float32(1.03)
  target["norm"] = base["norm"] + rng.standard_normal(16).astype(np.float32)
  held = sync.held_state(base, fmt)
  update = sync.encode(held, target, fmt, version=1)
  want = sync.apply(held, update)
  kinds = {name: update.changes(name).kind for name in update.tensors}
  assert {"sparse", "unchanged"} <= set(kinds.values())
  on_device = _on_device(held)
  before = dict(on_device)
  changed = patch.Patcher().apply(on_device, update)
  assert sorted(changed) == sorted(n for n, k in kinds.items() if k != "unchanged")
  for name in update.tensors:
    assert _same(on_device[name], want[name]), name
  for name in changed:  # patched in place, or replaced with the old buffer freed
    assert before[name].is_deleted(), name
  update.verify_all({n: sync.checksum(np.asarray(v)) for n, v in on_device.items()})
  # A keyframe replaces every tensor; each old buffer is freed as its new one is placed
  # (no second copy of the model on device).
  keyframe = sync.encode(None, sync.held_state(base, fmt), fmt, version=2)
  before = dict(on_device)
  patch.Patcher().apply(on_device, keyframe)
  assert all(before[name].is_deleted() for name in before)
  for name, value in sync.held_state(base, fmt).items():
    assert _same(on_device[name], value), name


def test_bits_and_values_are_bitcasts_that_keep_every_pattern():
  bits = jnp.asarray(np.arange(1 << 16, dtype=np.uint16))  # NaN payloads, -0.0, subnormals
  values = values_of(bits)
  assert values.dtype == jnp.bfloat16 and np.array_equal(np.asarray(bits_of(values)), bits)
  codes = jnp.asarray(np.arange(256, dtype=np.uint8))
  assert values_of(codes).dtype == jnp.int8 and np.array_equal(bits_of(values_of(codes)), codes)
  floats = jnp.ones(3, jnp.float32)
  assert values_of(floats) is floats and bits_of(floats) is floats


def test_a_mismatched_buffer_is_named_and_nothing_is_written():
  base = {"a": np.zeros((4, 4), np.float32), "w": np.zeros((4, 4), np.float32)}
  update = sync.encode(base, {"a": np.ones((4, 4)), "w": np.ones((4, 4))}, version=1)
  held = _on_device(sync.held_state(base, "bf16"))
  bad = dict(held, w=jnp.zeros((4, 5), jnp.uint16))
  with pytest.raises(sync.CodecError, match="'w'.*expected uint16\\[4, 4\\]"):
    patch.Patcher().apply(bad, update)
  values = dict(held, w=jnp.zeros((4, 4), jnp.bfloat16))  # values, not their bits
  with pytest.raises(sync.CodecError, match="'w'.*the bits of bfloat16"):
    patch.Patcher().apply(values, update)
  with pytest.raises(sync.CodecError, match="differ from the held ones.*'w'"):
    patch.Patcher().apply({"a": held["a"]}, update)
  assert not any(v.is_deleted() for v in held.values())
  big = {"w": np.zeros((64, 64), np.float32)}
  one = sync.encode(big, {"w": big["w"] + np.eye(64, dtype=np.float32)}, version=1)
  assert one.changes("w").kind == "sparse"
  shapes = {"w": jax.ShapeDtypeStruct((64, 64), jnp.uint16)}  # before any keyframe
  with pytest.raises(sync.CodecError, match="'w'.*none are loaded yet"):
    patch.Patcher().apply(shapes, one)


def _moved(params, density, seed):
  rng = np.random.default_rng(seed)
  return {k: np.where(rng.random(v.shape) < density, v * 1.1 + 0.01, v).astype(np.float32)
          for k, v in params.items()}


def test_capacities_grow_keep_and_shrink_so_like_updates_reuse_one_program(monkeypatch):
  rng = np.random.default_rng(2)
  base = {f"t{i}.kernel": rng.standard_normal((256, 256)).astype(np.float32) for i in range(3)}
  calls, real = [], patch._scatter
  monkeypatch.setattr(patch, "_scatter", lambda *a: calls.append(a[3]) or real(*a))
  patcher, held, state = patch.Patcher(), _on_device(sync.held_state(base, "bf16")), base
  caps = []
  for version, density in enumerate([0.05, 0.04, 0.2, 0.05, 0.002], start=1):
    target = _moved(state, density, version)
    update = sync.encode(state, target, version=version)
    patcher.apply(held, update)
    for name, want in sync.held_state(target, "bf16").items():
      assert _same(held[name], want), (version, name)
    state = target
    caps.append(patcher.capacities["t0.kernel"])
  # 0.05 of 65536 (3277, twice 6554) -> 8192; 0.04 fits; 0.2 (13107) -> 32768; 0.05
  # (3277 > 32768 / 16) keeps it; 0.002 (131) shrinks to the floor
  assert caps == [8192, 8192, 32768, 32768, patch.MIN_PAD]
  assert calls[0] == calls[1] and calls[2] == calls[3] and calls[1] != calls[2]
  assert len(calls) == 5 and all(len(c) == 3 for c in calls)


def test_groups_are_fixed_runs_of_the_held_tensors_each_one_call(monkeypatch):
  rng = np.random.default_rng(3)
  base = {f"t{i}.kernel": rng.standard_normal((128, 128)).astype(np.float32) for i in range(5)}
  target = _moved(base, 0.05, 1)
  target["t2.kernel"] = base["t2.kernel"]  # unchanged: still in its group's call
  update = sync.encode(base, target, version=1)
  calls, real = [], patch._scatter
  monkeypatch.setattr(patch, "_scatter", lambda *a: calls.append(len(a[3])) or real(*a))
  patcher = patch.Patcher()
  patcher.GROUP_BYTES = 2 * 128 * 128 * 2  # two tensors' bf16 bytes per group
  held = _on_device(sync.held_state(base, "bf16"))
  assert sorted(patcher.apply(held, update)) == ["t0.kernel", "t1.kernel", "t3.kernel",
                                                 "t4.kernel"]
  assert calls == [2, 2, 1]
  for name, want in sync.held_state(target, "bf16").items():
    assert _same(held[name], want), name


def test_a_bad_tensor_is_named_and_the_groups_before_it_are_held(monkeypatch):
  rng = np.random.default_rng(5)
  base = {f"t{i}.kernel": rng.standard_normal((256, 512)).astype(np.float32) * 0.02
          for i in range(5)}
  target = _moved(base, 0.1, 6)
  held_base = sync.held_state(base, "bf16")
  update = sync.encode(held_base, target, version=1)
  names = sorted(update.tensors)
  data = update.to_bytes()  # t3's section cut short behind re-sealed digests
  sections = [data[m.offset:m.offset + m.nbytes] for m in update.tensors.values()]
  sections[3] = sections[3][:len(sections[3]) // 2]
  broken = wire.build("bf16", 1, 0, [(m.name, m.shape, m.dtype, wire.SPARSE)
                                     for m in update.tensors.values()], sections, {},
                      [update.checksums[n] for n in names],
                      [update.base_checksums[n] for n in names], None)
  broken.bind(held_base)
  patcher = patch.Patcher()
  patcher.GROUP_BYTES = 1  # a group per tensor
  held = _on_device(held_base)
  before = dict(held)
  with pytest.raises(sync.CodecError, match="t3.kernel"):
    patcher.apply(held, broken)
  want = sync.held_state(target, "bf16")
  for name in names[:3]:  # patched, and their new arrays held
    assert before[name].is_deleted() and _same(held[name], want[name]), name
  for name in names[3:]:  # untouched
    assert held[name] is before[name] and _same(held[name], held_base[name]), name


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_held_arrays_are_replaced_and_patched_where_they_are(axis_type):
  mesh = jax.make_mesh((jax.device_count(),), ("x",),
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  rng = np.random.default_rng(7)
  base = {"a.kernel": rng.standard_normal((64, 256)).astype(np.float32),
          "b.kernel": rng.standard_normal((64, 8)).astype(np.float32)}
  target = _moved(base, 0.02, 8)
  held = {k: jax.device_put(jnp.zeros(v.shape, jnp.uint16), sharding) for k, v in base.items()}
  patcher = patch.Patcher()
  for version, (old, new) in enumerate([(None, base), (base, target)]):
    update = sync.encode(old, new, version=version)
    kinds = {update.changes(n).kind for n in update.tensors}
    assert kinds == ({"replace"} if old is None else {"sparse"})
    patcher.apply(held, update)
    for name, want in sync.held_state(new, "bf16").items():
      assert held[name].sharding.is_equivalent_to(sharding, 2), (version, name)
      assert _same(held[name], want), (version, name)
