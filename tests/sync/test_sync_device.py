"""The publisher's device side: host copies from changed elements, device fingerprints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import device, fingerprints
from rlax_ps.sync.bits import BF16


def _states(fmt):
  """(old, new) held states on device: a sparse, a dense, an unchanged and a small tensor."""
  rng = np.random.default_rng(1)
  old = {
      "sparse.kernel": rng.standard_normal((128, 64)).astype(np.float32) * 0.02,
      "dense.kernel": rng.standard_normal((32, 32)).astype(np.float32) * 0.02,
      "same.kernel": rng.standard_normal((16, 8)).astype(np.float32) * 0.02,
      "norm": np.ones(64, np.float32),
      "empty.kernel": np.zeros((0, 8), np.float32),  # (a gather from it failed on device)
  }
  new = dict(old)
  new["sparse.kernel"] = old["sparse.kernel"] * np.where(rng.random((128, 64)) < 0.02, 1.05, 1.0
                                                          ).astype(np.float32)
  new["dense.kernel"] = old["dense.kernel"] * np.float32(1.1)
  new["norm"] = old["norm"] + np.float32(0.01) * (rng.random(64) < 0.1)
  held = lambda p: {k: jnp.asarray(v) for k, v in sync.held_state(p, fmt).items()}  # noqa: E731
  return held(old), held(new)


@pytest.fixture(params=["device", "host memory", "device by rows"])
def fetch_path(request, monkeypatch):
  """host_state's two paths on CPU arrays: diffed on the devices (as on an accelerator), or
  copied from host memory (the CPU backend's default); "by rows": with the two largest
  tensors past device.LARGE (as DeepSeek-V3's 3.8e9-element experts are past 2**31), so
  compared and fetched by [row, column]."""
  monkeypatch.setattr(device, "HOST_MEMORY_DIRECT", request.param == "host memory")
  if request.param == "device by rows":
    monkeypatch.setattr(device, "LARGE", 1024)
    return "device"
  return request.param


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_host_state_fetches_changes_and_encodes_the_same_update(fmt, fetch_path):
  old, new = _states(fmt)
  host_old = {k: np.asarray(v) for k, v in old.items()}
  frozen = {k: v.copy() for k, v in host_old.items()}
  host_new = device.host_state(host_old, old, new)
  for name, arr in new.items():
    want = np.asarray(arr)
    assert host_new[name].dtype == want.dtype and np.array_equal(
        host_new[name].view(np.uint8), want.view(np.uint8)), name
    assert np.array_equal(host_old[name].view(np.uint8), frozen[name].view(np.uint8)), name
  if fetch_path == "device":  # an unchanged tensor (a LoRA run's frozen base): not copied
    assert host_new["same.kernel"] is host_old["same.kernel"]
  keyframe = sync.encode(None, host_old, fmt, version=0)
  update = sync.encode(host_old, host_new, fmt, version=1, base_checksums=keyframe.checksums)
  assert update.to_bytes() == sync.encode(frozen, {k: np.asarray(v) for k, v in new.items()},
                                          fmt, version=1).to_bytes()


def test_a_large_tensor_whose_rows_pass_int32_is_refused_naming_it(monkeypatch):
  monkeypatch.setattr(device, "LARGE", 64)
  flat = jnp.zeros(128, jnp.bfloat16)  # one row of 128 >= LARGE: by rows, none fits
  with pytest.raises(ValueError, match=r"tensor 'new': 128 elements are handled by rows"):
    device.changed_elements(flat, flat)
  assert device.row_size("w", (4, 32)) == 32


def test_a_tensor_of_2_to_the_31_elements_is_handled_by_rows():
  """Its flat indices pass int32 (the padding index 2**31 would wrap into the tensor)."""
  assert device.is_large((2**31,)) and device.is_large((128, 4096, 4096))
  assert not device.is_large((2**31 - 1,))


def test_changed_elements_fetches_only_the_changes_or_nothing_when_dense():
  old, new = _states("bf16")
  idx, values = device.changed_elements(old["sparse.kernel"], new["sparse.kernel"])
  a = np.asarray(old["sparse.kernel"]).reshape(-1).view(np.uint16)
  b = np.asarray(new["sparse.kernel"]).reshape(-1).view(np.uint16)
  assert np.array_equal(idx, np.flatnonzero(a != b)) and idx.size > 0
  assert np.array_equal(values, b[idx])
  assert device.changed_elements(old["dense.kernel"], new["dense.kernel"]) is None
  for name in ("same.kernel", "empty.kernel"):
    idx, values = device.changed_elements(old[name], new[name])
    assert idx.size == 0 and values.size == 0, name
  with pytest.raises(ValueError, match="must match"):
    device.changed_elements(old["sparse.kernel"], new["dense.kernel"])


def test_changes_past_a_third_of_a_tensors_bytes_are_fetched_as_the_whole_tensor():
  """bf16: a change fetches a 4-byte index and 2 bytes where the whole costs 2 bytes an
  element; past a third of those (910 of 8192 elements) it is fetched whole, as the fetch's
  padding to a power of two could double the bytes (and the device buffer) again."""
  zeros = np.zeros((128, 64), BF16)  # _states' sparse.kernel: its programs again
  old = jnp.asarray(zeros)
  for n, fetched in ((910, True), (911, False), (2000, False)):
    new = zeros.copy()
    new.reshape(-1)[:n] = 1
    got = device.changed_elements(old, jnp.asarray(new))
    assert (got is not None) == fetched, n
    if fetched:
      assert np.array_equal(got[0], np.arange(n))


def test_host_state_rejects_a_host_copy_that_is_not_the_old_state(fetch_path):
  old, new = _states("bf16")
  stale = {k: np.asarray(v).copy() for k, v in old.items()}
  stale["sparse.kernel"].reshape(-1).view(np.uint16)[5] += 1  # not what the devices hold
  with pytest.raises(sync.CodecError, match="'sparse.kernel': host_old is not the host copy"):
    device.host_state(stale, old, new)
  good = {k: np.asarray(v) for k, v in old.items()}
  wrong_shape = dict(good, norm=np.ones(3, BF16))
  with pytest.raises(sync.CodecError, match="'norm': host_old is"):
    device.host_state(wrong_shape, old, new)
  with pytest.raises(sync.CodecError, match="'norm': missing from the host_old"):
    device.host_state({k: v for k, v in good.items() if k != "norm"}, old, new)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_host_state_reads_sharded_arrays(axis_type, fetch_path):
  mesh = jax.make_mesh((jax.device_count(),), ("x",),
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  old, new = _states("bf16")
  old_s = {k: jax.device_put(v, sharding) for k, v in old.items() if v.shape[0] % 8 == 0}
  new_s = {k: jax.device_put(new[k], sharding) for k in old_s}
  host_old = {k: np.asarray(v) for k, v in old_s.items()}
  host_new = device.host_state(host_old, old_s, new_s)
  for name in old_s:
    assert np.array_equal(host_new[name].view(np.uint16), np.asarray(new_s[name]).view(np.uint16))


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_publish_state_fetches_in_few_round_trips_and_gives_the_seals_fingerprints(
    fmt, monkeypatch):
  old, new = _states(fmt)
  host_old = {k: np.asarray(v) for k, v in old.items()}
  changes = [device.changed_elements(old[k], new[k]) for k in new]
  by_changes = [c is not None and c[0].size > 0 for c in changes]  # (unchanged: no fetch)
  assert 0 < sum(by_changes) < len(new)  # some fetched as changes, some whole
  gets = []
  real_get = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: gets.append(x) or real_get(x))
  monkeypatch.setattr(device, "HOST_MEMORY_DIRECT", False)  # the accelerators' path
  monkeypatch.setattr(device, "FETCH_BYTES", 1)  # each tensor's changes: a trip of their own
  host_new, printed = device.publish_state(host_old, old, new)
  # counts and fingerprints, then a trip after each tensor fetched as changes (whole ones
  # join the next trip), and one for whole ones left at the end
  assert len(gets) == 1 + sum(by_changes) + (not by_changes[-1])
  monkeypatch.setattr(device, "FETCH_BYTES", 1 << 30)
  gets.clear()
  assert device.publish_state(host_old, old, new)[1] == printed
  assert len(gets) == 2  # counts and fingerprints, then every tensor's changes
  monkeypatch.setattr(jax, "device_get", real_get)
  for name, arr in new.items():
    assert np.array_equal(host_new[name].view(np.uint8), np.asarray(arr).view(np.uint8)), name
  assert printed == fingerprints.of_state(host_new)
  update = sync.encode(host_old, host_new, fmt, version=1, fingerprints=printed)
  update.check_fingerprints(device.fingerprints_of(new))


def test_publish_state_copies_host_memory_arrays_without_diffing_on_device(monkeypatch):
  old, new = _states("bf16")
  host_old = {k: np.asarray(v) for k, v in old.items()}
  assert device.HOST_MEMORY_DIRECT  # the default on the CPU backend

  def no_diff(*args):
    raise AssertionError("diffed on device")

  monkeypatch.setattr(device, "_count", no_diff)
  host_new, printed = device.publish_state(host_old, old, new)
  for name, arr in new.items():
    assert np.array_equal(host_new[name].view(np.uint8), np.asarray(arr).view(np.uint8)), name
    assert not np.shares_memory(host_new[name], np.asarray(arr))  # a copy, not a view
  assert printed == device.fingerprints_of(new)


def test_publish_state_without_host_joins_the_same_gathers_and_keeps_nothing(
    fetch_path, monkeypatch):
  """host=False, a multi-host slice's non-encoding process: the gathers are collective, so
  it must make the same ones in the same order, but it copies and scatters nothing."""
  old, new = _states("bf16")
  host_old = {k: np.asarray(v) for k, v in old.items()}
  monkeypatch.setattr(device, "FETCH_BYTES", 1)  # several trips
  calls, real = [], device.to_host
  monkeypatch.setattr(device, "to_host", lambda tree, keep=True: calls.append(
      jax.tree.map(lambda x: (x.shape, str(x.dtype)), tree)) or real(tree, keep))
  host_new, printed = device.publish_state(host_old, old, new)
  encoder_calls, calls[:] = list(calls), []

  def no_host_work(*args):
    raise AssertionError("host work without host")

  monkeypatch.setattr(device, "_host_tensor", no_host_work)
  monkeypatch.setattr(device, "_copied", no_host_work)
  assert device.publish_state(None, old, new, host=False) == (None, None)
  assert calls == encoder_calls
  assert len(calls) == (1 if fetch_path == "host memory" else 4)
