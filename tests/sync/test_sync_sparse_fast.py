"""The sparse layout's compiled one-call paths: costs, Rice gap bytes, and the fast reader
that must agree with the general one and accept nothing it rejects."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_ps.sync import entropy, loops, tensor_codec
from rlax_ps.sync.byte_reader import ByteReader, u8, varint
from rlax_ps.sync.errors import CodecError


def _sparse_pair(dtype, nnz, n=200_000, seed=0, offsets=(1, 2, -1, -2, 7)):
  """(old, new, ascending changed indices) with nnz changes by `offsets` (wrapping)."""
  rng = np.random.default_rng(seed)
  bits = 8 * np.dtype(dtype).itemsize
  old = rng.integers(0, 2**bits, n).astype(dtype)
  idx = np.sort(rng.choice(n, nnz, replace=False))
  new = old.copy()
  new[idx] += (rng.choice(np.array(offsets), nnz) % 2**bits).astype(dtype)
  return old, new, idx


def _gaps(idx):
  return (np.diff(idx, prepend=-1) - 1).astype(np.uint32)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint8])
@pytest.mark.parametrize("nnz,step", [(700, 1), (5000, 1), (5000, 3)])
def test_sparse_costs_are_the_zigzag_codes_value_entropy_and_gap_plan(dtype, nnz, step):
  old, new, idx = _sparse_pair(dtype, nnz)
  gaps = _gaps(idx)
  z_all = loops.zigzag_at(old, new, gaps)
  hist = entropy.histogram(z_all.astype(np.uint64))
  z, top, vbits, vpresent, k, rice_bits, gbits, gpresent = loops.sparse_costs(
      old, new, gaps, hist, step, entropy.WIDTHS, entropy.LITERAL_MAX)
  if nnz <= entropy.LITERAL_MAX:
    assert z.dtype == dtype and np.array_equal(z, z_all) and top == int(z_all.max())
  else:  # too long for the literal layout: no codes gathered
    assert z.size == 0 and top == 0
  assert (vbits, vpresent) == pytest.approx(loops.entropy_bits(hist, entropy.WIDTHS))
  assert (k, rice_bits, gbits, gpresent) == pytest.approx(
      loops.gap_plan(gaps, step, entropy.WIDTHS))


@pytest.mark.parametrize("nnz,streams", [(1, 1), (300, 1), (4099, 4), (20_000, 4)])
def test_rice_layout_is_its_documented_byte_layout_and_decodes(nnz, streams):
  """u8 head, S varint byte lengths, S - 1 varint indices of the change before each later
  stream, then each stream (rice_encode of an equal share of the gaps, the last the rest)."""
  _, _, idx = _sparse_pair(np.uint16, nnz, n=10 * nnz + 10)
  gaps, k = _gaps(idx), 3
  share = nnz // streams
  cuts = [j * share for j in range(streams)] + [nnz]
  parts = [loops.rice_encode(gaps[cuts[j]:cuts[j + 1]], k) for j in range(streams)]
  lengths = [(bits + 7) // 8 for _, bits, _ in parts]
  want = (u8(0x80 | (0x40 if streams > 1 else 0) | k)
          + b"".join(varint(n) for n in lengths)
          + b"".join(varint(int(idx[c - 1])) for c in cuts[1:-1])
          + b"".join(words.view(np.uint8)[:n].tobytes()
                     for (words, _, _), n in zip(parts, lengths)))
  head = 0x80 | (0x40 if streams > 1 else 0) | k
  assert loops.rice_layout(gaps, k, streams, head).tobytes() == want
  got = tensor_codec._decode_gaps(ByteReader(want, "tensor 'w'"), nnz, 10 * nnz + 10)
  assert np.array_equal(got, idx)


def _decode_both(data, n, dtype):
  """(fast result or None, general result or the CodecError it raised)."""
  ok, idx, off = loops.sparse_literal(np.frombuffer(data, np.uint8), n, np.empty(0, dtype))
  try:
    dec = tensor_codec.decode_section("tensor 'w'", tensor_codec.SPARSE, data, n,
                                      np.dtype(dtype), fast=False)
    general = dec.indices, dec.offsets
  except CodecError as e:
    general = e
  return ((idx, off) if ok else None), general


@pytest.mark.parametrize("dtype", [np.uint16, np.uint8])
@pytest.mark.parametrize("nnz", [1, 10, 63, 64, 100, 4096])
def test_the_fast_sparse_reader_decodes_what_the_general_one_does(dtype, nnz):
  # +-1 steps (int8 codes at low learning rates): literal offsets win at every length
  # (0.2% or less: below the joint layout's density)
  old, new, idx = _sparse_pair(dtype, nnz, n=max(200_000, 500 * nnz), seed=nnz, offsets=(1, -1))
  enc = tensor_codec.encode_section(old, new)
  assert enc.mode == tensor_codec.SPARSE
  fast, general = _decode_both(bytes(enc.section), old.size, dtype)
  assert fast is not None  # the usual layout: one compiled call
  assert np.array_equal(fast[0], idx) and np.array_equal(general[0], idx)
  assert fast[1].dtype == dtype and np.array_equal(fast[1], general[1])
  assert np.array_equal(fast[1], (new - old)[idx])
  dec = tensor_codec.decode_section("tensor 'w'", enc.mode, enc.section, old.size,
                                    np.dtype(dtype))
  assert np.array_equal(dec.apply(old, np.dtype(dtype))[0], new)


def test_the_fast_sparse_reader_leaves_other_layouts_to_the_general_one():
  old, new, idx = _sparse_pair(np.uint16, 300)
  gaps = _gaps(idx).astype(np.uint64)
  z = loops.zigzag_at(old, new, gaps.astype(np.uint32)).astype(np.uint64)
  rice = tensor_codec._rice_bytes(gaps.astype(np.uint32), 8).tobytes()
  layouts = {
      "entropy-coded gaps": varint(300) + u8(tensor_codec.GAPS_ENTROPY)
      + entropy.encode_stream(entropy.histogram(gaps), gaps) + entropy.encode_literal(z, 1),
      "rANS values": varint(300) + rice + entropy.encode_stream(entropy.histogram(z), z)}
  for name, data in layouts.items():
    fast, general = _decode_both(data, old.size, np.uint16)
    assert fast is None, name
    assert np.array_equal(general[0], idx) and np.array_equal(general[1], (new - old)[idx])
    dec = tensor_codec.decode_section("tensor 'w'", tensor_codec.SPARSE, data, old.size,
                                      np.dtype(np.uint16))
    assert np.array_equal(dec.indices, idx), name


@pytest.mark.parametrize("cut", [1, 5, -1])
def test_truncated_and_padded_sparse_sections_still_raise_the_named_error(cut):
  old, new, _ = _sparse_pair(np.uint8, 500)
  data = bytes(tensor_codec.encode_section(old, new).section)
  bad = data[:cut] if cut > 0 else data + b"\0"
  assert _decode_both(bad, old.size, np.uint8)[0] is None
  with pytest.raises(CodecError, match="tensor 'w'"):
    tensor_codec.decode_section("tensor 'w'", tensor_codec.SPARSE, bad, old.size,
                                np.dtype(np.uint8))


@settings(max_examples=200, deadline=None)
@given(nnz=st.sampled_from([3, 64, 900, 4096]), dtype=st.sampled_from([np.uint8, np.uint16]),
       ops=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
                    min_size=1, max_size=3),
       cut=st.integers(-3, 3))
def test_fuzzed_sparse_sections_the_fast_reader_accepts_decode_the_same(nnz, dtype, ops, cut):
  """Whatever the fast reader accepts, the general one accepts with the same result: the
  fast path never lets through bytes that the general reader would reject."""
  old, new, _ = _sparse_pair(dtype, nnz, n=50_000, seed=nnz)
  data = bytearray(tensor_codec.encode_section(old, new).section)
  for where, byte in ops:
    data[int(where * len(data))] ^= byte
  data = bytes(data[:len(data) + cut] if cut < 0 else data + bytes(cut))
  fast, general = _decode_both(data, old.size, dtype)
  if fast is not None:
    assert not isinstance(general, CodecError), general
    assert np.array_equal(fast[0], general[0]) and np.array_equal(fast[1], general[1])
