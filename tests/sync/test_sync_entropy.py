"""Entropy stage and bit packing: exact inverses, and payloads near the information bound."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_ps import sync
from rlax_ps.sync import entropy, loops
from rlax_ps.sync.byte_reader import ByteReader
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.bits import BF16, fixed_nbytes, pack_fixed, unpack_fixed


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([0, 1, 7, 63, 64, 65, 1000]),
       width=st.integers(0, 56))
def test_fixed_width_packing_round_trips_in_the_declared_size(seed, n, width):
  values = np.random.default_rng(seed).integers(0, 2**63, n, dtype=np.uint64)
  values &= (np.uint64(1) << np.uint64(width)) - np.uint64(1)
  buf = pack_fixed(values, width)
  assert len(buf) == fixed_nbytes(n, width) <= (n + 7) // 8 * width
  assert np.array_equal(unpack_fixed(buf, n, width, "test"), values)


@pytest.mark.parametrize("width", [1, 3, 8, 9, 13, 16, 23, 56])
@pytest.mark.parametrize("n,low,dtype", [(64, 0, np.uint64), (1001, 1, np.uint64),
                                         (777, 1, np.uint8)])
def test_fixed_width_layout_matches_its_plane_definition(width, n, low, dtype):
  """The documented layout, built here with numpy: per plane of up to 8 bits, each 8
  values (zero-padded) as w-bit fields of a little-endian word, its low w bytes."""
  rng = np.random.default_rng(width * n)
  top = min(width, 8 * np.dtype(dtype).itemsize)
  values = (rng.integers(0, 2**top - 1, n, dtype=np.uint64, endpoint=True) | np.uint64(low))
  values = values.astype(dtype)
  m = -(-n // 8)
  v = np.zeros(m * 8, np.uint64)
  v[:n] = values.astype(np.uint64) - np.uint64(low)
  planes = []
  for shift in range(0, width, 8):
    w = min(8, width - shift)
    fields = ((v >> np.uint64(shift)) & np.uint64((1 << w) - 1)).reshape(m, 8)
    words = np.zeros(m, np.uint64)
    for j in range(8):
      words |= fields[:, j] << np.uint64(j * w)
    planes.append(words.astype("<u8").view(np.uint8).reshape(m, 8)[:, :w].tobytes())
  buf = pack_fixed(values, width, low)
  assert buf == b"".join(planes)
  assert np.array_equal(unpack_fixed(buf, n, width, "test") + np.uint64(low),
                        values.astype(np.uint64))


@pytest.mark.parametrize("dtype", [np.uint16, np.uint8])
def test_zigzag_codes_at_the_changes_match_their_definition(dtype):
  rng = np.random.default_rng(3)
  bits = 8 * np.dtype(dtype).itemsize
  old = rng.integers(0, 2**bits, 5000).astype(dtype)
  new = old.copy()
  idx = np.sort(rng.choice(old.size, 700, replace=False))
  idx[0], idx[-1] = 0, old.size - 1  # both ends
  new[idx] = rng.integers(0, 2**bits, idx.size).astype(dtype)  # any offset, wrapping too
  gaps = np.diff(idx, prepend=-1) - 1
  d = (new[idx].astype(np.int64) - old[idx].astype(np.int64) + 2**(bits - 1)) % 2**bits
  d -= 2**(bits - 1)  # the wrapping offset as a signed value
  z = loops.zigzag_at(old, new, gaps.astype(np.uint32))
  assert z.dtype == dtype
  assert np.array_equal(z.astype(np.int64), np.where(d >= 0, 2 * d, -2 * d - 1))


@pytest.mark.parametrize("unzig", [0, 1, 2])
def test_literal_streams_decode_offsets_and_reject_codes_past_the_limit(unzig):
  z = np.array([1, 2, 3, 4, 255, 6, 7, 8, 9, 10] * 8, np.uint64)  # 80 values: planes
  low = 1 if unzig == 1 else 0
  data = entropy.encode_literal(z, low)
  got = entropy.decode_stream(ByteReader(data, "tensor 'w'"), z.size, np.uint8, 256, unzig)
  want = (z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1))) if unzig else z
  assert np.array_equal(got, want.astype(np.uint8))
  with pytest.raises(CodecError, match=r"tensor 'w': value 255 out of range \(limit 200\)"):
    entropy.decode_stream(ByteReader(data, "tensor 'w'"), z.size, np.uint8, 200, unzig)


def test_streams_round_trip_every_bucket_up_to_56_bits():
  z = np.concatenate([np.arange(300, dtype=np.uint64),
                      (np.uint64(1) << np.arange(4, 56, dtype=np.uint64)) - np.uint64(1),
                      np.uint64(1) << np.arange(4, 56, dtype=np.uint64),
                      np.random.default_rng(0).integers(0, 2**56, 1000, dtype=np.uint64)])
  hist = entropy.histogram(z)
  assert hist.sum() == z.size and np.flatnonzero(hist).max() < entropy.ALPHABET
  data = entropy.encode_stream(hist, z)
  r = ByteReader(data, "test")
  assert np.array_equal(entropy.decode_stream(r, z.size), z)
  r.done()


def information_bound(base_bits, target_bits):
  """N*H(d) + nnz*H_v in bytes, H_v the zeroth-order entropy of the changed offsets."""
  idx = np.flatnonzero(base_bits != target_bits)
  d = idx.size / base_bits.size
  h = -(d * np.log2(d) + (1 - d) * np.log2(1 - d))
  _, counts = np.unique((target_bits[idx] - base_bits[idx]).view(np.int16), return_counts=True)
  p = counts / counts.sum()
  return (base_bits.size * h + idx.size * -(p * np.log2(p)).sum()) / 8


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_payload_is_within_five_percent_of_the_bound(density):
  rng = np.random.default_rng(5)
  n = 1 << 21
  base = rng.integers(0x3000, 0x3F00, n, dtype=np.uint16)
  target = base.copy()
  idx = rng.choice(n, int(density * n), replace=False)
  target[idx] += rng.choice(np.array([1, 0xFFFF, 2, 0xFFFE, 5, 0xFF00], np.uint16), idx.size,
                            p=[0.4, 0.4, 0.08, 0.08, 0.03, 0.01])
  update = sync.encode({"w": base.view(BF16)}, {"w": target.view(BF16)}, version=1)
  bound = information_bound(base, target)
  assert update.nbytes <= 1.05 * bound + 300  # 300 bytes: header and tables
  assert update.nbytes < idx.size * 6 / 3  # well below int32 + bf16 per change


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4099])
def test_the_compiled_bitmap_is_np_packbits_of_the_mask(n):
  from rlax_ps.sync import loops  # noqa: PLC0415
  rng = np.random.default_rng(n)
  idx = np.flatnonzero(rng.random(n) < 0.3)
  mask = np.zeros(n, bool)
  mask[idx] = True
  assert np.array_equal(loops.bitmap(idx, (n + 7) // 8), np.packbits(mask))


def test_streams_from_bytes_bytearrays_and_odd_offsets_share_one_compiled_decoder():
  """rANS words read from read-only bytes, a writable bytearray or an unaligned offset
  (copied) reach the compiled rANS decoder in one form: numba compiles once per signature."""
  from rlax_ps.sync import rans
  z = np.random.default_rng(1).integers(0, 2**20, 5000, dtype=np.uint64)
  data = entropy.encode_stream(entropy.histogram(z), z)
  for buf, at in ((data, 0), (bytearray(data), 0), (b"x" + data, 1),
                  (bytearray(b"x" + data), 1)):
    r = ByteReader(buf, "test")
    r.take(at)
    assert np.array_equal(entropy.decode_stream(r, z.size), z)
  words = {str(sig[0]) for sig in rans._decode.signatures if "uint64" in str(sig[3])}
  assert words == {"readonly array(uint16, 1d, C)"}
