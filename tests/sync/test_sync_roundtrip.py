"""Round trips are bit-exact for every bf16 and int8 bit pattern, in every mode and path."""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_ps import sync
from rlax_ps.sync.bits import BF16, bit_view


def same(a, b) -> bool:
  return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bit_view(a), bit_view(b))


def random_bits(rng, shape, dtype=BF16):
  """Arrays of any bit pattern: NaN payloads, infinities, -0.0 and subnormals included."""
  width = np.uint16 if dtype == BF16 else np.uint8
  return rng.integers(0, np.iinfo(width).max + 1, shape, dtype=width).view(dtype)


def changed(rng, a, density):
  out = a.copy()
  bits = bit_view(out)
  where = rng.random(bits.size) < density
  bits[where] += rng.integers(1, np.iinfo(bits.dtype).max + 1, int(where.sum()), dtype=bits.dtype)
  return out


def roundtrip(base, target, **kwargs):
  """target as applied from the bytes of encode(base, target), copying and in place."""
  update = sync.encode(base, target, version=3, **kwargs)
  parsed = sync.Update.from_bytes(update.to_bytes())
  got = sync.apply(base, parsed)
  inplace = sync.apply({k: v.copy() for k, v in base.items()}, parsed, inplace=True)
  for name, want in target.items():
    assert same(got[name], want) and same(inplace[name], want), name
  return update


@given(seed=st.integers(0, 2**32 - 1),
       shapes=st.lists(st.sampled_from([(1,), (7,), (3, 5), (64, 33), (300, 256), (0,)]),
                       min_size=1, max_size=4),
       density=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]), int8=st.booleans())
@settings(max_examples=60, deadline=None)
def test_delta_roundtrip_is_bit_exact(seed, shapes, density, int8):
  rng = np.random.default_rng(seed)
  dtype = np.dtype(np.int8) if int8 else BF16
  base = {f"t{i}": random_bits(rng, s, dtype) for i, s in enumerate(shapes)}
  if int8:  # an int8 held state: codes, their scales and a 1-D bf16 tensor
    base = {f"t{i}.kernel": random_bits(rng, (4, 6), dtype) for i in range(len(shapes))}
    base.update({f"{n}.scale": random_bits(rng, (6,)) for n in list(base)}, norm=random_bits(rng, (6,)))
  target = {k: changed(rng, v, density) for k, v in base.items()}
  roundtrip(base, target, fmt="int8" if int8 else "bf16")


@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from([(0,), (1,), (5, 3), (70000,)]))
@settings(max_examples=20, deadline=None)
def test_keyframe_roundtrip_is_bit_exact(seed, shape):
  held = {"w": random_bits(np.random.default_rng(seed), shape)}
  update = sync.encode(None, held, version=0)
  got = sync.apply(None, sync.Update.from_bytes(update.to_bytes()))
  assert same(got["w"], held["w"]) and got["w"].flags.writeable
  assert update.is_keyframe and update.tensors["w"].mode == "raw"


def test_float32_targets_are_rounded_to_nearest_even_bf16():
  x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0, np.nan, np.inf, 1e-40], np.float32)
  held = sync.apply(None, sync.encode(None, {"x": x}, version=0))
  assert same(held["x"], x.astype(ml_dtypes.bfloat16))
  assert bit_view(held["x"])[1] == 0x3F80 and bit_view(held["x"])[2] == 0x3F82  # ties to even


def test_each_mode_is_chosen_where_it_is_smallest():
  rng = np.random.default_rng(0)
  base = {"same": random_bits(rng, (300, 300)), "noise": random_bits(rng, (300, 300)),
          "few": random_bits(rng, (300, 300)), "small": random_bits(rng, (10, 10))}
  target = {"same": base["same"], "noise": random_bits(rng, (300, 300)),
            "few": changed(rng, base["few"], 0.01), "small": changed(rng, base["small"], 0.1)}
  update = roundtrip(base, target)
  assert {n: m.mode for n, m in update.tensors.items()} == {
      "few": "sparse", "noise": "raw", "same": "unchanged", "small": "packed"}
  few = update.tensors["few"].nbytes
  assert few < 0.01 * 90000 * 5  # under 5 bytes a change even for random offsets


def test_changes_give_indices_offsets_and_new_values():
  rng = np.random.default_rng(1)
  base = {"big": random_bits(rng, (256, 512)), "small": random_bits(rng, (4000,)),
          "raw": random_bits(rng, (300, 300))}
  target = {"big": changed(rng, base["big"], 0.01), "small": changed(rng, base["small"], 0.01),
            "raw": random_bits(rng, (300, 300))}
  update = sync.Update.from_bytes(sync.encode(base, target, version=1).to_bytes(), base)
  for name in ("big", "small"):
    ch = update.changes(name, base[name])
    old, new = bit_view(base[name]), bit_view(target[name])
    assert ch.kind == "sparse" and np.array_equal(ch.indices, np.flatnonzero(old != new))
    assert np.array_equal(ch.offsets, (new - old)[ch.indices])
    assert np.array_equal(bit_view(ch.values), new[ch.indices])
  ch = update.changes("raw")
  assert ch.kind == "replace" and same(ch.array, target["raw"])


def test_an_encoded_update_knows_its_checksums_and_a_parsed_one_does_not():
  rng = np.random.default_rng(2)
  base = {"a": random_bits(rng, (70000,)), "b": random_bits(rng, (8,))}
  target = {"a": changed(rng, base["a"], 0.01), "b": base["b"]}
  update = sync.encode(base, target, version=4)
  assert update.checksums == {k: sync.checksum(v) for k, v in target.items()}
  assert update.base_checksums == {k: sync.checksum(v) for k, v in base.items()}
  assert sync.Update.from_bytes(update.to_bytes()).checksums is None
  again = sync.encode(base, target, version=4, base_checksums=update.base_checksums)
  assert again.to_bytes() == update.to_bytes()  # the base is not hashed, the bytes are the same
  update.verify_all(target)
  update.verify_all(update.checksums)
  with pytest.raises(sync.CodecError, match="'a'.*result checksum mismatch"):
    update.verify_all(dict(update.checksums, a=1))


def test_views_that_are_not_c_contiguous_hash_and_encode_as_their_c_order_copies():
  """A transposed or strided view (an [out, in] checkpoint read as numpy .T) hashes as its
  C-order bytes, so it encodes, applies and verifies as its copy does (not a ValueError)."""
  rng = np.random.default_rng(5)
  base = {"t.kernel": random_bits(rng, (48, 40)).T, "s.kernel": random_bits(rng, (30, 64))[:, ::2]}
  codes = random_bits(rng, (12, 10), np.int8)[::2].T  # (int8: no dtype change to hide it)
  for name, view in {**base, "codes": codes}.items():
    assert not view.flags.c_contiguous, name
    assert sync.checksum(view) == sync.checksum(np.ascontiguousarray(view)), name
  target = {k: changed(rng, np.ascontiguousarray(v), 0.05).T.copy().T for k, v in base.items()}
  update = roundtrip(base, target)
  update.verify_all(target)
  assert update.checksums == {k: sync.checksum(np.ascontiguousarray(v)) for k, v in target.items()}


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_threads_and_dict_order_give_the_same_bytes(fmt):
  rng = np.random.default_rng(3)
  base = {f"l{i}.kernel": rng.standard_normal((256, 300)).astype(np.float32) for i in range(4)}
  base["norm"] = np.ones(300, np.float32)
  target = {k: v * np.float32(1.001) for k, v in reversed(base.items())}
  one = sync.encode(base, target, fmt, version=1, threads=1).to_bytes()
  assert sync.encode(base, target, fmt, version=1, threads=3).to_bytes() == one
  held = sync.held_state(base, fmt)
  got = sync.apply(held, sync.Update.from_bytes(one), threads=3)
  want = sync.held_state(target, fmt)
  assert all(same(got[k], want[k]) for k in want) and list(got) == sorted(want)


def test_int8_deltas_track_the_quantized_target_from_float_or_held_bases():
  rng = np.random.default_rng(4)
  w = {"emb.embedding": rng.standard_normal((50, 16)).astype(np.float32),
       "l.kernel": rng.standard_normal((16, 300)).astype(np.float32),
       "norm.scale": np.ones(16, np.float32)}
  held = sync.apply(None, sync.encode(None, w, "int8", version=0))
  assert set(held) == {"emb.embedding", "emb.embedding.scale", "l.kernel", "l.kernel.scale",
                       "norm.scale"}
  for v in range(1, 4):
    new = {k: x - np.float32(0.01 * v) * np.sign(rng.standard_normal(x.shape)).astype(np.float32)
           for k, x in w.items()}
    update = sync.encode(w, new, "int8", version=v)
    assert sync.encode(held, new, "int8", version=v).to_bytes() == update.to_bytes()
    held = sync.apply(held, sync.Update.from_bytes(update.to_bytes()))
    want = sync.quantize_params(new)
    assert all(same(held[k], want[k]) for k in want)
    w = new


def test_package_imports_without_jax():
  code = "import sys, rlax_ps.sync; assert 'jax' not in sys.modules, 'jax imported'"
  subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_scalars_and_empty_tensors_keep_their_shapes(fmt):
  """A float32 scalar was published as shape (1,) (a worker of the model refused the
  keyframe; a delta onto a bf16 scalar failed); int8 crashed on a kernel with no columns."""
  params = {"t.scale": np.float32(1.5), "w.kernel": np.ones((4, 0), np.float32),
            "v.kernel": np.ones((3, 2), np.float32)}
  held = sync.held_state(params, fmt)
  assert held["t.scale"].shape == () and held["w.kernel"].shape == (4, 0)
  got = sync.apply(None, sync.Update.from_bytes(sync.encode(None, held, fmt,
                                                            version=0).to_bytes()))
  assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in held.items()}
  again = sync.encode(held, sync.held_state(dict(params, **{"t.scale": np.float32(2)}), fmt),
                      fmt, version=1)
  assert sync.apply(got, sync.Update.from_bytes(again.to_bytes()))["t.scale"].shape == ()


def test_a_pulled_bytearray_is_kept_not_copied_and_its_tensors_stay_read_only():
  """A keyframe pulled (a bytearray) was copied to bytes while the pull still held it:
  twice the model in host memory for a moment."""
  held = sync.held_state({"w": np.ones((8, 4), np.float32)}, "bf16")
  pulled = bytearray(sync.encode(None, held, "bf16", version=0).to_bytes())
  update = sync.Update.from_bytes(pulled)
  assert update.to_view() is pulled
  raw = update.raw("w")
  assert not raw.flags.writeable and np.shares_memory(raw, np.frombuffer(pulled, np.uint8))
  np.testing.assert_array_equal(sync.apply(None, update)["w"].view(np.uint16),
                                held["w"].view(np.uint16))
