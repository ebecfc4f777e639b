"""Lossless bf16 deltas and keyframes: bit-exact for any pattern, every mode, host changes."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlax_ps import sync
from rlax_ps.sync import wire
from rlax_ps.sync.bits import BF16

# +-0, +-inf, quiet/signalling NaNs with payloads, subnormals, +-1, largest finite.
SPECIAL = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7FFF, 0xFFFF,
                    0x0001, 0x8001, 0x007F, 0x807F, 0x3F80, 0xBF80, 0x7F7F], np.uint16)


def random_bits(rng, shape):
  bits = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
  special = rng.random(shape) < 0.2
  bits[special] = rng.choice(SPECIAL, int(special.sum()))
  return bits


def mutate(rng, bits, density):
  """A copy of `bits` where `density` of the elements change: mostly by 1-2 ulps, some to
  special or random patterns (sign flips, NaN payloads, wraparound)."""
  new = bits.copy()
  flat = new.reshape(-1)
  k = int(round(density * flat.size))
  idx = rng.choice(flat.size, k, replace=False)
  kind = rng.random(k)
  step = rng.choice(np.array([1, 2, 0xFFFF, 0xFFFE], np.uint16), k)
  flat[idx] = np.where(kind < 0.8, flat[idx] + step,
                       np.where(kind < 0.9, rng.choice(SPECIAL, k),
                                rng.integers(0, 1 << 16, k, dtype=np.uint16)))
  return new


def as_bf16(bits):
  return bits.view(BF16)


def assert_same_bits(got, want):
  assert set(got) == set(want)
  for name in want:
    assert got[name].dtype == want[name].dtype, name
    assert got[name].shape == want[name].shape, name
    assert np.array_equal(got[name].view(np.uint16), want[name].view(np.uint16)), name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1),
       shapes=st.lists(st.lists(st.integers(0, 37), min_size=0, max_size=3), min_size=1,
                       max_size=4),
       density=st.sampled_from([0.0, 0.001, 0.02, 0.2, 0.6, 1.0]))
def test_delta_roundtrip_is_bit_exact(seed, shapes, density):
  rng = np.random.default_rng(seed)
  base = {f"t{i}": as_bf16(random_bits(rng, tuple(s))) for i, s in enumerate(shapes)}
  target = {k: as_bf16(mutate(rng, v.view(np.uint16), density)) for k, v in base.items()}
  update = sync.encode(base, target, version=3, base_version=2)
  wire = sync.Update.from_bytes(update.to_bytes())
  assert (wire.version, wire.base_version, wire.fmt, wire.is_keyframe) == (3, 2, "bf16", False)
  assert_same_bits(sync.apply(base, wire, base_version=2), target)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       shape=st.lists(st.integers(0, 50), min_size=0, max_size=3))
def test_keyframe_roundtrip_is_bit_exact(seed, shape):
  rng = np.random.default_rng(seed)
  params = {"a": as_bf16(random_bits(rng, tuple(shape))),
            "b.kernel": as_bf16(random_bits(rng, (3, 5)))}
  update = sync.encode(None, params, version=0)
  assert update.is_keyframe and update.base_version is None
  assert_same_bits(sync.apply(None, sync.Update.from_bytes(update.to_bytes())), params)


def test_float32_targets_are_rounded_to_nearest_even_bf16():
  x = np.array([1.0, 1.00390625, 1.01171875, -0.0, np.inf, np.nan, 1e-40], np.float32)
  update = sync.encode(None, {"x": x}, version=0)
  held = sync.apply(None, update)
  assert np.array_equal(held["x"].view(np.uint16), x.astype(BF16).view(np.uint16))
  assert held["x"].view(np.uint16)[1] == 0x3F80  # 1 + 2**-8 is a tie: rounds to even (1.0)


def modes_for(base_bits, target_bits):
  update = sync.encode({"w": as_bf16(base_bits)}, {"w": as_bf16(target_bits)}, version=1)
  held = sync.apply({"w": as_bf16(base_bits)}, update)
  assert np.array_equal(held["w"].view(np.uint16), target_bits)
  return update.tensors["w"].mode


def test_each_mode_is_chosen_where_it_is_smallest_and_round_trips():
  rng = np.random.default_rng(0)
  base = random_bits(rng, (1 << 16,))
  assert modes_for(base, base.copy()) == "unchanged"
  sparse = base.copy()
  sparse[rng.choice(base.size, 300, replace=False)] += 1
  assert modes_for(base, sparse) == "sparse"
  dense = base + (rng.random(base.size) < 0.7).astype(np.uint16)
  assert modes_for(base, dense) == "dense"
  periodic = base + np.resize(np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1], np.uint16), base.size)
  assert modes_for(base, periodic) == "bitmap"
  assert modes_for(base, rng.integers(0, 1 << 16, base.shape, dtype=np.uint16)) == "raw"


def test_only_clustered_changes_pay_for_the_bitmap_probe(monkeypatch):
  from rlax_ps.sync import tensor_codec  # noqa: PLC0415
  probed = []
  real = tensor_codec._bitmap_estimate
  monkeypatch.setattr(tensor_codec, "_bitmap_estimate",
                      lambda *a: probed.append(1) or real(*a))
  rng = np.random.default_rng(2)
  base = random_bits(rng, (1 << 15,))
  scattered = base.copy()
  scattered[rng.choice(base.size, 500, replace=False)] += 1
  assert modes_for(base, scattered) == "sparse" and not probed
  periodic = base + np.resize(np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1], np.uint16), base.size)
  assert modes_for(base, periodic) == "bitmap" and probed


def test_changes_give_indices_offsets_and_new_values():
  rng = np.random.default_rng(1)
  base_bits = random_bits(rng, (64, 32))
  target_bits = mutate(rng, base_bits, 0.05)
  base, target = {"w": as_bf16(base_bits)}, {"w": as_bf16(target_bits)}
  update = sync.encode(base, target, version=1)
  ch = update.changes("w", base["w"])
  assert ch.kind == "sparse" and ch.dtype == BF16 and ch.shape == (64, 32)
  want = np.flatnonzero(base_bits.reshape(-1) != target_bits.reshape(-1))
  assert np.array_equal(ch.indices, want)
  assert np.array_equal(ch.values.view(np.uint16), target_bits.reshape(-1)[want])
  flat = base_bits.reshape(-1).copy()
  flat[ch.indices] += update.changes("w").offsets  # no base on the host: offsets suffice
  assert np.array_equal(flat, target_bits.reshape(-1))
  update.verify_all(target)


def test_update_records_versions_shapes_dtypes_and_seals():
  rng = np.random.default_rng(2)
  base = {"a.kernel": as_bf16(random_bits(rng, (4, 6))), "b": as_bf16(random_bits(rng, (6,)))}
  target = {k: as_bf16(mutate(rng, v.view(np.uint16), 0.5)) for k, v in base.items()}
  update = sync.encode(base, target, version=7)
  assert update.base_version == 6 and update.version == 7
  header = sync.read_header(update.to_bytes())
  assert list(header.tensors) == ["a.kernel", "b"]
  for name, meta in header.tensors.items():
    assert meta.shape == target[name].shape and meta.dtype == BF16
  assert header.results.matches([sync.checksum(target[n]) for n in header.tensors])
  assert header.bases.matches([sync.checksum(base[n]) for n in header.tensors])
  assert not header.results.matches([sync.checksum(base[n]) for n in header.tensors])
  assert header.nbytes == update.nbytes == len(update.to_bytes())


def test_package_imports_without_jax():
  code = "import sys, rlax_ps.sync; assert 'jax' not in sys.modules, sorted(sys.modules)"
  subprocess.run([sys.executable, "-c", code], check=True)


def test_inplace_apply_writes_the_exact_target_into_the_base_arrays():
  rng = np.random.default_rng(4)
  base_bits = random_bits(rng, (96, 40))
  target_bits = mutate(rng, base_bits, 0.03)
  update = sync.encode({"w": as_bf16(base_bits)}, {"w": as_bf16(target_bits)}, version=1)
  held = {"w": as_bf16(base_bits.copy())}
  out = sync.apply(held, update, inplace=True)
  assert out["w"] is held["w"]
  assert np.array_equal(held["w"].view(np.uint16), target_bits)


def test_inplace_apply_rejects_a_wrong_base_before_writing():
  rng = np.random.default_rng(5)
  base_bits = random_bits(rng, (32, 32))
  update = sync.encode({"w": as_bf16(base_bits)}, {"w": as_bf16(mutate(rng, base_bits, 0.1))},
                       version=1)
  wrong = base_bits.copy()
  wrong[3, 3] ^= 0x40
  held = {"w": as_bf16(wrong.copy())}
  with pytest.raises(sync.CodecError, match="'w'.*wrong base"):
    sync.apply(held, update, inplace=True)
  assert np.array_equal(held["w"].view(np.uint16), wrong)


def _double_buffer_states(fmt):
  """(base, target) held states with a joint tensor, a sparse one, an unchanged one and a
  pack of small ones."""
  rng = np.random.default_rng(21)
  base = {"big.kernel": rng.standard_normal((256, 512), np.float32) * 0.02,
          "mid.kernel": rng.standard_normal((128, 96), np.float32) * 0.02,
          "same.kernel": rng.standard_normal((256, 256), np.float32) * 0.02,
          "norm.scale": np.ones(512, np.float32), "bias": np.zeros(96, np.float32)}
  target = {k: v.copy() for k, v in base.items()}
  target["big.kernel"][rng.random((256, 512)) < 0.05] *= np.float32(1 + 2 ** -7)
  target["mid.kernel"][::7, ::5] *= np.float32(1.01)
  target["norm.scale"][::3] += np.float32(0.01)
  return sync.held_state(base, fmt), sync.held_state(target, fmt)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_apply_into_a_spare_state_writes_the_target_there_and_returns_it(fmt):
  base, target = _double_buffer_states(fmt)
  update = sync.encode(base, target, fmt, version=1)
  modes = {m.mode for m in update.tensors.values()}
  assert modes >= {"packed", "unchanged"} | ({"joint"} if fmt == "bf16" else set())
  before = {k: v.copy() for k, v in base.items()}
  spare = {k: np.full_like(v, 7) for k, v in base.items()}
  for threads in (1, 2):
    got = sync.apply(base, sync.Update.from_bytes(update.to_bytes()), out=spare,
                     threads=threads)
    assert list(got) == list(update.tensors)
    for k in target:
      assert got[k] is spare[k]
      assert np.array_equal(got[k].view(np.uint8), target[k].view(np.uint8)), k
      assert np.array_equal(base[k].view(np.uint8), before[k].view(np.uint8)), k
  keyframe = sync.encode(None, target, fmt, version=2)
  fresh = {k: np.zeros_like(v) for k, v in base.items()}
  got = sync.apply(None, keyframe, out=fresh)
  for k in target:
    assert got[k] is fresh[k] and np.array_equal(got[k].view(np.uint8), target[k].view(np.uint8))


def test_apply_into_a_spare_state_rejects_unfit_arrays_by_name():
  base, target = _double_buffer_states("bf16")
  update = sync.encode(base, target, version=1)
  spare = {k: np.empty_like(v) for k, v in base.items()}
  cases = [
      (dict(spare, **{"mid.kernel": np.empty((96, 128), BF16)}), "'mid.kernel': out has shape"),
      (dict(spare, **{"bias": np.empty(96, np.float32)}), "'bias': out has shape .* dtype"),
      (dict(spare, **{"big.kernel": spare["big.kernel"].T}), "'big.kernel': out must be"),
      (dict(spare, **{"same.kernel": base["same.kernel"]}), "'same.kernel': out shares memory"),
      ({k: v for k, v in spare.items() if k != "norm.scale"}, "'norm.scale': missing from the out"),
  ]
  readonly = dict(spare)
  readonly["bias"] = spare["bias"].copy()
  readonly["bias"].flags.writeable = False
  cases.append((readonly, "'bias': out must be a writable"))
  for out, message in cases:
    with pytest.raises(sync.CodecError, match=message):
      sync.apply(base, update, out=out)
  with pytest.raises(sync.CodecError, match="inplace=True or out, not both"):
    sync.apply(base, update, out=spare, inplace=True)
  corrupted = bytearray(update.to_bytes())
  corrupted[-3] ^= 0x10
  with pytest.raises(sync.CodecError):
    sync.apply(base, sync.Update.from_bytes(bytes(corrupted)), out=spare)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_an_encoded_update_makes_the_header_its_bytes_parse_to(fmt):
  """An encoded Update makes its header when first asked for (a publisher sends the bytes):
  the same header the bytes parse to, and its checksums and packs without it."""
  rng = np.random.default_rng(11)
  base = {f"l{i}.kernel": rng.standard_normal((24, 40)).astype(np.float32) * 0.02
          for i in range(7)} | {"big.kernel": rng.standard_normal((300, 256)).astype(np.float32)}
  target = {k: v + 1e-3 * rng.standard_normal(v.shape).astype(np.float32)
            for k, v in base.items()}
  update = sync.encode(base, target, fmt, version=4)
  assert set(update.checksums) == set(sync.held_state(target, fmt))
  assert update.packs() and update.pack(next(iter(update.packs())))
  parsed = sync.Update.from_bytes(update.to_bytes())
  assert update.header == parsed.header and update.header is update.header
  assert update.nbytes == len(update.to_bytes()) == parsed.nbytes
  want = tuple((n, m.shape, m.dtype) for n, m in parsed.tensors.items())
  assert update.layout == parsed.layout == parsed.header.layout == want


def _meta_codec(update) -> tuple[int, int]:
  """(the prefix's meta codec, the header's bytes) of an update's message."""
  _, _, codec, header_len, _ = wire._PREFIX.unpack(update.to_bytes()[:wire._PREFIX.size])
  return codec, header_len


def test_a_meta_small_beside_its_sections_is_kept_raw_and_a_larger_share_compressed():
  """zstd runs on the meta only where it is at least 1/RAW_META_SHARE of the sections'
  bytes: a keyframe's (its sections are the weights) is raw, a small delta's compressed;
  both parse to the same header and apply exactly."""
  rng = np.random.default_rng(12)
  base = {f"layers.{i}.mlp.kernel": rng.standard_normal((64, 64)).astype(np.float32) * 0.02
          for i in range(8)}
  target = dict(base, **{"layers.3.mlp.kernel": base["layers.3.mlp.kernel"] * 1.001})
  keyframe = sync.encode(None, base, version=0)
  delta = sync.encode(base, target, version=1)
  assert _meta_codec(keyframe)[0] == 0 and _meta_codec(delta)[0] == 1
  body = keyframe.nbytes - wire._PREFIX.size - _meta_codec(keyframe)[1]
  assert body >= 8 * 64 * 64 * 2 > wire.RAW_META_SHARE * _meta_codec(keyframe)[1]
  for update, held, want in ((keyframe, None, base), (delta, sync.held_state(base, "bf16"),
                                                      target)):
    parsed = sync.Update.from_bytes(update.to_bytes())
    assert parsed.header == update.header
    assert_same_bits(sync.apply(held, parsed), sync.held_state(want, "bf16"))
