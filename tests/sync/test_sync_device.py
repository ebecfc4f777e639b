"""On-device application of TensorChanges equals the host apply, bit for bit."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import device, fingerprints, wire
from rlax_ps.sync.bits import BF16


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_device_apply_matches_host_apply_for_every_kind(fmt):
  rng = np.random.default_rng(0)
  base = {
      "sparse.kernel": rng.standard_normal((64, 48)).astype(np.float32) * 0.02,
      "dense.kernel": rng.standard_normal((32, 16)).astype(np.float32) * 0.02,
      "same.kernel": rng.standard_normal((8, 8)).astype(np.float32),
      "norm": np.ones(16, np.float32),
  }
  target = dict(base)
  target["sparse.kernel"] = base["sparse.kernel"].copy()
  target["sparse.kernel"][rng.random((64, 48)) < 0.05] *= 1.1
  target["dense.kernel"] = base["dense.kernel"] * np.float32(1.03)
  target["norm"] = base["norm"] + rng.standard_normal(16).astype(np.float32)
  held = sync.held_state(base, fmt)
  update = sync.encode(held, target, fmt, version=1)
  want = sync.apply(held, update)
  kinds, results = set(), {}
  for name, meta in update.tensors.items():
    ch = update.changes(name)
    kinds.add(ch.kind)
    out = device.apply_changes(jnp.asarray(held[name]), ch)
    got = np.asarray(jax.device_get(out))
    assert got.dtype == want[name].dtype and np.array_equal(
        got.view(np.uint8), want[name].view(np.uint8)), name
    results[name] = got
  update.verify_all(results)
  assert {"sparse", "unchanged"} <= kinds


def test_device_apply_rejects_a_mismatched_buffer():
  base = {"w": np.zeros((4, 4), BF16)}
  update = sync.encode(base, {"w": np.ones((4, 4), np.float32)}, version=1)
  with pytest.raises(sync.CodecError, match="'w'.*expected bfloat16\\[4, 4\\]"):
    device.apply_changes(jnp.zeros((4, 5), jnp.bfloat16), update.changes("w"))


def _states(fmt):
  """(old, new) held states on device: a sparse, a dense, an unchanged and a small tensor."""
  rng = np.random.default_rng(1)
  old = {
      "sparse.kernel": rng.standard_normal((128, 64)).astype(np.float32) * 0.02,
      "dense.kernel": rng.standard_normal((32, 32)).astype(np.float32) * 0.02,
      "same.kernel": rng.standard_normal((16, 8)).astype(np.float32) * 0.02,
      "norm": np.ones(64, np.float32),
  }
  new = dict(old)
  new["sparse.kernel"] = old["sparse.kernel"] * np.where(rng.random((128, 64)) < 0.02, 1.05, 1.0
                                                          ).astype(np.float32)
  new["dense.kernel"] = old["dense.kernel"] * np.float32(1.1)
  new["norm"] = old["norm"] + np.float32(0.01) * (rng.random(64) < 0.1)
  held = lambda p: {k: jnp.asarray(v) for k, v in sync.held_state(p, fmt).items()}  # noqa: E731
  return held(old), held(new)


@pytest.fixture(params=["device", "host memory"])
def fetch_path(request, monkeypatch):
  """host_state's two paths on CPU arrays: diffed on the devices (as on an accelerator), or
  copied from host memory (the CPU backend's default)."""
  monkeypatch.setattr(device, "HOST_MEMORY_DIRECT", request.param == "host memory")
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
  keyframe = sync.encode(None, host_old, fmt, version=0)
  update = sync.encode(host_old, host_new, fmt, version=1, base_checksums=keyframe.checksums)
  assert update.to_bytes() == sync.encode(frozen, {k: np.asarray(v) for k, v in new.items()},
                                          fmt, version=1).to_bytes()


def test_changed_elements_fetches_only_the_changes_or_nothing_when_dense():
  old, new = _states("bf16")
  idx, values = device.changed_elements(old["sparse.kernel"], new["sparse.kernel"])
  a = np.asarray(old["sparse.kernel"]).reshape(-1).view(np.uint16)
  b = np.asarray(new["sparse.kernel"]).reshape(-1).view(np.uint16)
  assert np.array_equal(idx, np.flatnonzero(a != b)) and idx.size > 0
  assert np.array_equal(values, b[idx])
  assert device.changed_elements(old["dense.kernel"], new["dense.kernel"]) is None
  idx, values = device.changed_elements(old["same.kernel"], new["same.kernel"])
  assert idx.size == 0 and values.size == 0
  with pytest.raises(ValueError, match="must match"):
    device.changed_elements(old["sparse.kernel"], new["dense.kernel"])


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
def test_padded_changes_decode_into_the_scatters_arrays_and_apply_exactly(fmt):
  """A worker's path: sparse tensors and pack members in padded int32 arrays
  (apply_changes takes them as they are); other kinds as changes()."""
  rng = np.random.default_rng(3)
  shape = (256, 512)  # past codec.PACK_MAX: coded alone
  base = {name: rng.standard_normal(shape).astype(np.float32) * 0.02
          for name in ("dense.kernel", "sparse.kernel", "same.kernel")}
  base |= {f"l{i}.norm": np.ones(64, np.float32) for i in range(3)}
  target = dict(base)
  target["dense.kernel"] = base["dense.kernel"] * np.where(rng.random(shape) < 0.2, 1.02, 1)
  target["sparse.kernel"] = base["sparse.kernel"] * np.where(rng.random(shape) < 0.002, 1.1, 1)
  target["l1.norm"] = base["l1.norm"] + np.float32(0.5) * (rng.random(64) < 0.2)
  held = sync.held_state(base, fmt)
  update = sync.encode(held, target, fmt, version=1)
  want = sync.apply(held, update)
  modes = {name: meta.mode for name, meta in update.tensors.items()}
  assert modes["dense.kernel"] == modes["sparse.kernel"] == "sparse", modes
  assert modes["l1.norm"] == "packed" and modes["same.kernel"] == "unchanged", modes
  results, padded = {}, 0
  for name, meta in update.tensors.items():
    ch, plain = device.padded_changes(update, name), update.changes(name)
    assert ch.kind == plain.kind, name
    if ch.kind == "sparse":  # pack members too (their pack decoded once, then cut)
      nnz = plain.indices.size
      assert ch.indices.dtype == np.int32 and ch.indices.size == ch.offsets.size
      assert ch.indices.size >= max(nnz, 1024) and ch.indices.size & (ch.indices.size - 1) == 0
      assert np.array_equal(ch.indices[:nnz], plain.indices), name
      assert np.array_equal(ch.offsets[:nnz], plain.offsets), name
      assert np.all(ch.indices[nnz:] == meta.size) and not ch.offsets[nnz:].any()
      idx, off = device._padded(ch.indices, ch.offsets, meta.size)
      assert idx is ch.indices and off is ch.offsets  # no second pass
      padded += 1
    out = device.apply_changes(jnp.asarray(held[name]), ch)
    results[name] = got = np.asarray(jax.device_get(out))
    assert np.array_equal(got.view(np.uint8), want[name].view(np.uint8)), name
  update.verify_all(results)
  assert padded >= 3


@pytest.mark.parametrize("threads", [1, 3])
def test_each_padded_changes_decodes_ahead_in_order_and_names_a_bad_tensor(threads):
  rng = np.random.default_rng(5)
  base = {f"t{i}.kernel": rng.standard_normal((256, 512)).astype(np.float32) * 0.02
          for i in range(5)}
  target = {k: v * np.where(rng.random(v.shape) < 0.1, 1.02, 1) for k, v in base.items()}
  held = sync.held_state(base, "bf16")
  update = sync.encode(held, target, version=1)
  names = sorted(update.tensors)
  got = list(device.each_padded_changes(update, names, threads=threads))
  assert [n for n, _ in got] == names
  for name, ch in got:
    want = device.padded_changes(update, name)
    assert ch.kind == want.kind == "sparse", name
    assert np.array_equal(ch.indices, want.indices) and np.array_equal(ch.offsets, want.offsets)
  data = update.to_bytes()  # t3's section cut short behind re-sealed digests
  sections = [data[m.offset:m.offset + m.nbytes] for m in update.tensors.values()]
  sections[3] = sections[3][:len(sections[3]) // 2]
  broken = wire.build("bf16", 1, 0, [(m.name, m.shape, m.dtype, wire.SPARSE)
                                     for m in update.tensors.values()], sections, {},
                      [update.checksums[n] for n in names],
                      [update.base_checksums[n] for n in names], None)
  seen = []
  with pytest.raises(sync.CodecError, match="t3.kernel"):
    for name, _ in device.each_padded_changes(broken, names, threads=threads):
      seen.append(name)
  assert seen == names[:3]


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_publish_state_fetches_in_few_round_trips_and_gives_the_seals_fingerprints(
    fmt, monkeypatch):
  old, new = _states(fmt)
  host_old = {k: np.asarray(v) for k, v in old.items()}
  by_changes = [device.changed_elements(old[k], new[k]) is not None for k in new]
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


def test_host_buffers_reuse_arrays_by_length_and_dtype_within_a_bound():
  pool = device.HostBuffers(max_free_bytes=3 << 20)
  a = pool.take(1 << 19, np.int32)  # 2 MB
  b = pool.take(1 << 19, np.uint16)  # 1 MB
  small = pool.take(100, np.int32)
  assert pool.free_bytes == 0
  pool.give(a, b, small, None)
  assert pool.free_bytes == 3 << 20  # the small one is not kept
  assert pool.take(1 << 19, np.uint16) is b
  assert pool.take(1 << 19, np.int32) is a
  assert pool.take(1 << 19, np.int32) is not a  # taken already: a new one
  pool.give(a)
  pool.give(a)  # given twice: kept once
  assert pool.free_bytes == 2 << 20
  c = pool.take(1 << 20, np.uint16)  # 2 MB, another key
  pool.give(c, b)  # 2 + 2 + 1 MB > 3 MB: a (given back first) is dropped
  assert pool.free_bytes == 3 << 20
  assert pool.take(1 << 19, np.int32) is not a
  assert pool.take(1 << 20, np.uint16) is c


def test_host_buffers_hand_each_array_to_one_taker_across_threads():
  pool = device.HostBuffers()
  arrays = [pool.take(1 << 18, np.int32) for _ in range(8)]
  pool.give(*arrays)
  got, lock = [], threading.Lock()

  def taker():
    mine = [pool.take(1 << 18, np.int32) for _ in range(4)]
    with lock:
      got.extend(mine)

  threads = [threading.Thread(target=taker) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len({id(a) for a in got}) == 16  # no array handed out twice
  assert sum(any(a is b for b in arrays) for a in got) == 8  # every kept one reused


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_padded_changes_take_their_arrays_from_the_buffers(fmt):
  old, new = _states(fmt)
  host_old = {k: np.asarray(v) for k, v in old.items()}
  update = sync.Update.from_bytes(sync.encode(host_old, {k: np.asarray(v) for k, v in new.items()},
                                              fmt, version=1).to_bytes(), host_old)
  pool = device.HostBuffers()
  pool.MIN_BYTES = 0  # the test's tensors are small
  first = {n: device.padded_changes(update, n, pool) for n in update.tensors}
  sparse = [n for n, ch in first.items() if ch.kind == "sparse"]
  assert sparse
  for name in sparse:
    want = device.padded_changes(update, name)
    assert np.array_equal(first[name].indices, want.indices)
    assert np.array_equal(first[name].offsets, want.offsets)
    pool.give(first[name].indices, first[name].offsets)
  again = {n: device.padded_changes(update, n, pool) for n in sparse}
  kept = {id(a) for n in sparse for a in (first[n].indices, first[n].offsets)}
  assert {id(a) for ch in again.values() for a in (ch.indices, ch.offsets)} == kept
  for name in sparse:  # reused arrays are filled anew: tails and all
    want = device.padded_changes(update, name)
    assert np.array_equal(again[name].indices, want.indices)
    assert np.array_equal(again[name].offsets, want.offsets)


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
