"""Device fingerprints: host and device agree bit for bit, any changed element shows, and
updates seal them so that a worker checks its weights where they are."""

import itertools
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_ps import sync
from rlax_ps.sync import device, fingerprints, wire
from rlax_ps.sync.bits import BF16, UINT_OF
from rlax_ps.sync.integrity import group_count

MASK = (1 << 32) - 1


def reference(a: np.ndarray) -> int:
  """The fingerprint as the module docstring defines it, in plain Python integers."""
  bits = np.ascontiguousarray(a).reshape(-1).view(UINT_OF[a.dtype]).tolist()
  lo = hi = 0
  for i, x in enumerate(bits):
    i &= MASK
    h = ((x * fingerprints.M_BITS) & MASK) ^ ((i * fingerprints.M_INDEX) & MASK)
    h ^= h >> 16
    h = (h * fingerprints.F1) & MASK
    h ^= h >> 13
    h = (h * fingerprints.F2) & MASK
    h ^= h >> 16
    lo = (lo + h) & MASK
    hi = (hi + h * (2 * i + 1)) & MASK
  return lo | hi << 32


def random_held(rng, shape, dtype):
  """Arbitrary bit patterns of a held dtype: NaN payloads, infinities, -0.0, subnormals."""
  n = int(np.prod(shape))
  if dtype == BF16:
    return rng.integers(0, 1 << 16, n, dtype=np.uint16).view(BF16).reshape(shape)
  return rng.integers(-128, 128, n, dtype=np.int8).reshape(shape)


CASES = [((), BF16), ((0,), BF16), ((7,), BF16), ((33, 17), BF16), ((3, 5, 8), np.int8),
         ((64, 40), np.int8)]


@pytest.mark.parametrize("shape,dtype", CASES)
def test_host_and_device_fingerprints_follow_the_definition(shape, dtype):
  a = random_held(np.random.default_rng(len(shape)), shape, np.dtype(dtype))
  want = reference(a)
  assert fingerprints.fingerprint(a) == want
  assert fingerprints.join(*map(int, device.fingerprint(jnp.asarray(a)))) == want
  assert device.fingerprints_of({"a": jnp.asarray(a)}) == {"a": want}


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       int8=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_fingerprints_of_random_arrays_follow_the_definition(shape, int8, seed):
  a = random_held(np.random.default_rng(seed), tuple(shape), np.dtype(np.int8) if int8 else BF16)
  want = reference(a)
  assert fingerprints.fingerprint(a) == want
  assert fingerprints.join(*map(int, device.fingerprint(jnp.asarray(a)))) == want


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto,
                                       jax.sharding.AxisType.Explicit])
def test_device_fingerprints_of_sharded_arrays(axis_type):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
  rng = np.random.default_rng(1)
  state = {"kernel": random_held(rng, (64, 48), BF16), "codes": random_held(rng, (32, 16), np.int8)}
  spec = jax.sharding.PartitionSpec("data", "model")
  placed = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, spec)) for k, v in state.items()}
  assert device.fingerprints_of(placed) == fingerprints.of_state(state, threads=2)


def test_every_single_change_and_every_swap_changes_the_fingerprint():
  rng = np.random.default_rng(2)
  a = random_held(rng, (6, 5), BF16)
  bits = a.reshape(-1).view(np.uint16)
  seen = {fingerprints.fingerprint(a)}
  for i, bit in itertools.product(range(bits.size), range(16)):
    b = bits.copy()
    b[i] ^= 1 << bit
    seen.add(fingerprints.fingerprint(b.view(BF16)))
  assert len(seen) == 1 + bits.size * 16  # every one differs from the original and each other
  for i, j in itertools.combinations(range(bits.size), 2):
    if bits[i] != bits[j]:
      b = bits.copy()
      b[[i, j]] = b[[j, i]]
      assert fingerprints.fingerprint(b.view(BF16)) != fingerprints.fingerprint(a), (i, j)


def test_non_held_dtypes_are_refused_by_name():
  with pytest.raises(ValueError, match="float32"):
    fingerprints.fingerprint(np.zeros(4, np.float32))
  with pytest.raises(ValueError, match="'w'.*float32"):
    device.fingerprints_of({"w": jnp.zeros(4, jnp.float32)})


def states(fmt, seed=3):
  rng = np.random.default_rng(seed)
  base = {"layer.kernel": rng.standard_normal((64, 48)).astype(np.float32) * 0.02,
          "other.kernel": rng.standard_normal((16, 16)).astype(np.float32) * 0.02,
          "norm.scale": np.ones(48, np.float32)}
  target = dict(base, **{"layer.kernel": base["layer.kernel"] * np.float32(1.01)})
  return sync.held_state(base, fmt), sync.held_state(target, fmt)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_updates_seal_fingerprints_given_or_computed(fmt):
  base, target = states(fmt)
  plain = sync.encode(base, target, fmt, version=1)
  assert not plain.fingerprinted and plain.fingerprints is None
  with pytest.raises(sync.CodecError, match="no fingerprint seal"):
    plain.check_fingerprints(fingerprints.of_state(target))
  computed = sync.encode(base, target, fmt, version=1, fingerprints=True)
  on_device = device.fingerprints_of({k: jnp.asarray(v) for k, v in target.items()})
  given = sync.encode(base, target, fmt, version=1, fingerprints=on_device)
  assert computed.fingerprints == on_device == fingerprints.of_state(target)
  assert given.to_bytes() == computed.to_bytes()
  # The seal adds a few bytes and changes nothing else: the sections are the same.
  assert computed.nbytes - plain.nbytes == 8 + group_count(len(target))  # digest, locators
  assert [m.mode for m in computed.tensors.values()] == [m.mode for m in plain.tensors.values()]
  parsed = sync.Update.from_bytes(computed.to_bytes(), base)
  assert parsed.fingerprinted and parsed.header.fingerprints == computed.header.fingerprints
  parsed.check_fingerprints(on_device)
  result = sync.apply(base, parsed)
  parsed.check_fingerprints(fingerprints.of_state(result))
  keyframe = sync.encode(None, target, fmt, version=0, fingerprints=True)  # a keyframe too
  sync.Update.from_bytes(keyframe.to_bytes()).check_fingerprints(on_device)


def test_a_wrong_fingerprint_names_its_tensor():
  base, target = states("bf16")
  update = sync.Update.from_bytes(
      sync.encode(base, target, "bf16", version=1, fingerprints=True).to_bytes(), base)
  wrong = fingerprints.of_state(target)
  wrong["other.kernel"] ^= 1 << 40
  with pytest.raises(sync.CodecError, match="'other.kernel'.*fingerprint mismatch"):
    update.check_fingerprints(wrong)
  with pytest.raises(sync.CodecError, match="'norm.scale'.*missing"):
    update.check_fingerprints({k: v for k, v in wrong.items() if k != "norm.scale"})


def test_bad_fingerprint_arguments_are_named():
  base, target = states("bf16")
  good = fingerprints.of_state(target)
  with pytest.raises(sync.CodecError, match="'norm.scale'.*missing"):
    sync.encode(base, target, version=1, fingerprints={k: v for k, v in good.items()
                                                       if k != "norm.scale"})
  with pytest.raises(sync.CodecError, match="'layer.kernel'.*fingerprints expected a u64"):
    sync.encode(base, target, version=1, fingerprints=dict(good, **{"layer.kernel": -1}))
  with pytest.raises(sync.CodecError, match="'layer.kernel'.*fingerprints expected a u64"):
    sync.encode(base, target, version=1, fingerprints=dict(good, **{"layer.kernel": 1.5}))
  with pytest.raises(ValueError, match="fingerprints"):
    sync.encode(base, target, version=1, fingerprints="yes")


def test_the_fingerprint_flag_without_its_seal_is_rejected():
  base, target = states("bf16")
  data = sync.encode(base, target, version=1).to_bytes()
  hlen = struct.unpack("<I", data[6:10])[0]
  fields = bytearray(wire._ZSTD.decompressor().decompress(data[14:14 + hlen]))  # noqa: SLF001
  fields[1] |= wire.FINGERPRINTED
  header = wire._ZSTD.compressor().compress(bytes(fields))  # noqa: SLF001
  with pytest.raises(sync.CodecError, match="truncated"):
    sync.read_header(struct.pack("<4sHII", b"RLXW", 4, len(header), zlib.crc32(header)) + header
                     + data[14 + hlen:])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_the_device_fingerprint_lowers_for_tpu_and_gpu(dtype):
  exported = jax.export.export(device.fingerprint, platforms=["tpu", "cuda"])(
      jax.ShapeDtypeStruct((1024, 768), dtype))
  assert exported.platforms == ("tpu", "cuda")
  assert [str(a.dtype) for a in exported.out_avals] == ["uint32"]


def test_state_digest_is_of_the_names_in_order_whatever_the_dict_order():
  a = {"embed.embedding": 11, "layers.0.mlp.kernel": 22, "norm.scale": 33}
  b = dict(reversed(list(a.items())))
  assert sync.state_digest(a) == sync.state_digest(b)
