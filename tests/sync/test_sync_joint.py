"""The fast layouts: joint Rice + Huffman sections, four-stream Rice gaps, 4-state rANS."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlax_ps import sync
from rlax_ps.sync import entropy, huffman, intrinsics, joint, loops, rans, tensor_codec
from rlax_ps.sync.bits import BF16
from rlax_ps.sync.byte_reader import ByteReader, varint, varints
from rlax_ps.sync.errors import CodecError

OFFSETS = np.array([1, 0xFFFF, 2, 0xFFFE, 3, 9, 0xFFF0, 300, 0x8000], np.uint16)
P = [0.35, 0.35, 0.1, 0.1, 0.04, 0.02, 0.02, 0.015, 0.005]


def changed(rng, base, density, offsets=OFFSETS, p=P):
  target = base.copy()
  idx = rng.choice(base.size, int(density * base.size), replace=False)
  target[idx] += rng.choice(offsets, idx.size, p=p).astype(base.dtype)
  return target


def section(base, target):
  enc = tensor_codec.encode_section(base, target)
  dec = tensor_codec.decode_section("tensor 'w'", enc.mode, enc.section, base.size, base.dtype)
  return enc, dec


@pytest.fixture(scope="module")
def pair():
  rng = np.random.default_rng(0)
  base = rng.integers(0, 1 << 16, (1 << 20) + 777, dtype=np.uint16)  # a short last block
  return base, changed(rng, base, 0.05)


def test_joint_layout_round_trips_through_apply_inplace_and_changes(pair):
  base, target = pair
  enc, dec = section(base, target)
  assert tensor_codec.MODE_NAMES[enc.mode] == "joint"
  out, digest = dec.apply(base, base.dtype)
  assert np.array_equal(out, target)
  assert digest == sync.checksum(target)
  held = base.copy()
  out, _ = dec.apply(held, base.dtype, inplace=True)
  assert out is held and np.array_equal(held, target)
  idx, off = dec.sparse()
  assert np.array_equal(idx, np.flatnonzero(base != target))
  assert np.array_equal(off, (target - base)[idx])


@pytest.mark.parametrize("n,dtype", [(1 << 16, np.uint16), ((1 << 16) + 1, np.uint16),
                                     (3 * (1 << 16) + 100, np.uint16), (5 << 16, np.uint8)])
def test_joint_sections_of_fewer_blocks_than_streams_round_trip(n, dtype):
  """Tensors from joint.MIN_ELEMENTS up: one to five blocks (streams left empty, a short
  last block, a round of fewer than four blocks)."""
  rng = np.random.default_rng(n)
  base = rng.integers(0, np.iinfo(dtype).max + 1, n, dtype=dtype)
  target = changed(rng, base, 0.06, OFFSETS.astype(dtype), P)
  enc, dec = section(base, target)
  assert tensor_codec.MODE_NAMES[enc.mode] == "joint"
  out, digest = dec.apply(base, base.dtype)
  assert np.array_equal(out, target) and digest == sync.checksum(target)
  held = base.copy()
  dec.apply(held, base.dtype, inplace=True)
  assert np.array_equal(held, target)
  idx, off = dec.sparse()
  assert np.array_equal(idx, np.flatnonzero(base != target))
  assert np.array_equal(off, (target - base)[idx])


def test_joint_layout_is_near_the_bound_and_smaller_than_the_general_one_allows(pair):
  base, target = pair
  enc, _ = section(base, target)
  idx = np.flatnonzero(base != target)
  d = idx.size / base.size
  _, counts = np.unique((target[idx] - base[idx]).view(np.int16), return_counts=True)
  p = counts / counts.sum()
  bound = (base.size * -(d * np.log2(d) + (1 - d) * np.log2(1 - d))
           + idx.size * -(p * np.log2(p)).sum()) / 8
  assert bound < len(enc.section) < 1.06 * bound


def test_values_missing_from_the_sample_take_the_escape_code():
  rng = np.random.default_rng(1)
  n = 4 << 20
  base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
  target = changed(rng, base, 0.04, OFFSETS[:4], [0.25] * 4)
  sampled = np.zeros(n, bool)
  for s in joint.sample_starts(n):
    sampled[s:s + joint.SAMPLE_WINDOW] = True
  odd = np.flatnonzero(~sampled)[::9973][:50]
  target[odd] = base[odd] + np.uint16(12345)  # a value no sampled window holds
  enc, dec = section(base, target)
  assert tensor_codec.MODE_NAMES[enc.mode] == "joint"
  assert np.array_equal(dec.apply(base, base.dtype)[0], target)


def test_int8_codes_use_the_joint_layout_too():
  rng = np.random.default_rng(2)
  base = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
  target = changed(rng, base, 0.03, np.array([1, 255, 2, 254, 100], np.uint8),
                   [0.45, 0.45, 0.04, 0.04, 0.02])
  enc, dec = section(base, target)
  assert tensor_codec.MODE_NAMES[enc.mode] == "joint"
  assert np.array_equal(dec.apply(base, base.dtype)[0], target)


@pytest.mark.parametrize("size,density", [(joint.BLOCK, 0.01), (joint.BLOCK, 0.0),
                                          (joint.BLOCK, 1.0), (1000 + 37, 0.05), (40, 0.3)])
def test_int8_blocks_walk_exactly_their_changed_groups(size, density):
  """_changed_groups lists the masks and first elements of the groups holding changes, in
  order, the tail of a short block included, and nothing else."""
  rng = np.random.default_rng(int(density * 100) + size)
  a = rng.integers(0, 256, size, dtype=np.uint8)
  b = a.copy()
  spots = rng.random(size) < density
  b[spots] += np.uint8(1)
  groups = size // 64
  ahead = np.zeros(groups, np.uint64)
  for g in range(groups):
    ahead[g] = sum(1 << t for t in range(64) if spots[g * 64 + t])
  masks = np.full(joint.BLOCK // 64 + 1, 7, np.uint64)  # leftovers must not matter
  starts = np.full(joint.BLOCK // 64 + 1, 7, np.int64)
  c = joint._changed_groups(a, b, ahead, masks, starts)
  want = [(sum(1 << t for t, hit in enumerate(spots[lo:lo + 64]) if hit), lo)
          for lo in range(0, size, 64) if spots[lo:lo + 64].any()]
  assert c == len(want)
  assert [(int(m), int(s)) for m, s in zip(masks[:c], starts[:c])] == want
  if density:  # and the encoder's section built on them decodes to the target
    whole = np.concatenate([a] * (joint.MIN_ELEMENTS // size + 1))
    moved = np.concatenate([b] * (joint.MIN_ELEMENTS // size + 1))
    coded = joint.encode(whole, moved, 1, np.bincount([2, 2, 3], minlength=entropy.ALPHABET))
    out = whole.copy()
    joint.Section(ByteReader(coded[0], "t"), whole.size, np.dtype(np.uint8)).apply(
        whole, out, None)
    assert np.array_equal(out, moved)


@pytest.mark.parametrize("k", [0, 3])
def test_codes_longer_than_one_store_take_the_split_path_and_decode(k):
  """Gaps whose unary part (gap >> k) plus the value code passes the 56 bits that one
  8-byte store of the encoder takes, around and far past that edge, with short and
  escaped values (zigzags past the encoder's table, capped there), in every stream and in
  the short last block's elementwise tail, round trip exactly."""
  rng = np.random.default_rng(11)
  n = 5 * joint.BLOCK + 1000
  base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
  target = base.copy()
  for b in range(6):
    gaps = np.concatenate([np.arange(0, 90) << k, [700 << k, 5000, 20000]])
    idx = b * joint.BLOCK + np.cumsum(gaps + 1) - 1
    idx = idx[idx < min(n, (b + 1) * joint.BLOCK)]
    offsets = rng.choice(np.array([1, 0xFFFF, 0x1234, 0x8000], np.uint16), idx.size)
    target[idx] += offsets
  counts = np.bincount([1, 1, 2, 2, 3], minlength=entropy.ALPHABET)  # 0x1234: escaped
  assert np.any(base[n - n % 64:] != target[n - n % 64:])  # the tail holds changes
  coded = joint.encode(base, target, k, counts)
  out = base.copy()
  joint.Section(ByteReader(coded[0], "t"), n, np.dtype(np.uint16)).apply(base, out, None)
  assert np.array_equal(out, target)


def _listed_cases():
  """(name, base, target, k, counts) of bf16 blocks to code both ways: dense and sparse
  lists, escapes and zigzags past the table, values the closed set lacks (the block coded
  again with the open set), gaps past one store, empty blocks, short last blocks."""
  rng = np.random.default_rng(12)
  n = 5 * joint.BLOCK + 1000
  base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
  five = changed(rng, base, 0.05)
  plan = joint.plan(base, five)
  yield "5%", base, five, plan[0], plan[1]
  dense = changed(rng, base, 0.9)
  yield "90%, the 5% tables", base, dense, plan[0], plan[1]
  small = changed(rng, base, 0.05, OFFSETS[:4], [0.25] * 4)
  closed = joint.plan(base, small)
  yield "the closed set", base, small, closed[0], closed[1]
  small[joint.BLOCK + 77] = base[joint.BLOCK + 77] + np.uint16(12345)
  yield "a value the closed set lacks", base, small, closed[0], closed[1]
  empty = five.copy()
  empty[2 * joint.BLOCK:3 * joint.BLOCK] = base[2 * joint.BLOCK:3 * joint.BLOCK]
  yield "an empty block", base, empty, plan[0], plan[1]
  long_gaps = base.copy()
  for b in range(6):
    gaps = np.concatenate([np.arange(0, 90), [700, 5000, 20000]])
    idx = b * joint.BLOCK + np.cumsum(gaps + 1) - 1
    idx = idx[idx < min(n, (b + 1) * joint.BLOCK)]
    long_gaps[idx] += rng.choice(np.array([1, 0xFFFF, 0x1234, 0x8000], np.uint16), idx.size)
  counts = np.bincount([1, 1, 2, 2, 3], minlength=entropy.ALPHABET)
  yield "gaps past one store, k=0", base, long_gaps, 0, counts
  for size in (joint.BLOCK + 1, joint.BLOCK + 63, 2 * joint.BLOCK - 64):
    yield f"{size} elements", base[:size], five[:size], plan[0], plan[1]
  size = joint.BLOCK + 3 * joint.LIST + 63  # a last list of LIST + 63 changes
  yield "a full last list and tail", base[:size], base[:size] + np.uint16(1), plan[0], plan[1]
  codes = rng.integers(0, 256, n, dtype=np.uint8)  # int8 codes (as held: uint8 bits)
  steps = changed(rng, codes, 0.02, np.array([1, 255, 2, 254], np.uint8),
                  [0.45, 0.45, 0.05, 0.05])
  plan8 = joint.plan(codes, steps)
  yield "int8 2%", codes, steps, plan8[0], plan8[1]
  odd = steps.copy()
  odd[joint.BLOCK + 5] = codes[joint.BLOCK + 5] + np.uint8(77)
  yield "int8, a value the closed set lacks", codes, odd, plan8[0], plan8[1]
  yield "int8 every element", codes[:size], codes[:size] + np.uint8(1), plan8[0], plan8[1]
  sparse = codes.copy()
  sparse[::5000] += np.uint8(1)
  yield "int8 gaps past one store, k=0", codes, sparse, 0, plan8[1]


@pytest.mark.slow  # two internal paths compared byte for byte
@pytest.mark.parametrize("case", list(_listed_cases()), ids=lambda c: c[0])
def test_joint_blocks_coded_from_lists_write_the_bytes_of_the_group_walk(case):
  """_code_block_listed (list the changes with a SIMD compress or with byte shuffles, code
  them 8 at a time, append) and _code_block's walk write the same section, bf16 and int8;
  it round trips."""
  _, base, target, k, counts = case
  walked = joint.encode(base, target, k, counts, listed=intrinsics.WALK)
  for way in joint.WAYS[8 * base.itemsize][1:]:
    listed = joint.encode(base, target, k, counts, listed=way)
    assert listed == walked, way
  out = base.copy()
  joint.Section(ByteReader(listed[0], "t"), base.size, base.dtype).apply(base, out, None)
  assert np.array_equal(out, target)


def _sampled(base, target, listed):
  """Everything plan's sample gives for base -> target (every window walked, as at any
  density): (changes, walked, k, Rice bits, gap entropy bits, symbols present), the gaps,
  the value and gap symbol counts."""
  n = base.size
  probe, rest = joint._probe_split(n)
  gaps = np.zeros(joint.SAMPLE_WINDOW * joint.sample_starts(n).size, np.uint64)
  vhist = np.zeros(entropy.ALPHABET, np.int64)
  ghist = np.zeros(entropy.ALPHABET, np.int64)
  m = n - n % 64
  got = joint._SAMPLERS[8 * base.itemsize, listed](
      base[:m].view(np.uint64), target[:m].view(np.uint64), base, target, probe, rest, gaps,
      vhist, ghist, entropy.WIDTHS, 0.0)  # a float, as plan's: one compile of each sampler
  return got, gaps[:got[0]], vhist, ghist


@pytest.mark.slow  # two internal paths compared
def test_the_sample_listed_with_a_compress_or_shuffles_is_the_walked_one():
  """plan's windows listed with a SIMD compress or with byte shuffles (the host's choice
  where it has either) and walked group by group give the same changes, gaps and symbol
  counts, bf16 and int8, so the same plan."""
  for name, base, target, _, _ in _listed_cases():
    if base.size < joint.MIN_ELEMENTS:
      continue
    ways = joint.WAYS[8 * base.itemsize]
    (walked, *w), *others = (_sampled(base, target, way) for way in ways)
    for listed, *l in others:
      assert walked == listed and walked[0] > 0, name
      assert all(np.array_equal(x, y) for x, y in zip(w, l)), name
    plans = [joint.plan(base, target, listed=way) for way in ways]
    for other in plans[1:]:
      assert (plans[0] is None) == (other is None), name
      if plans[0] is not None:
        assert plans[0][0] == other[0] and plans[0][2:] == other[2:], name


def _lister(fn, takes_top):
  """A compiled call of the list intrinsic fn over arrays (old, new, zigzags, lane numbers)."""
  import numba  # noqa: PLC0415

  @numba.njit
  def run(old, new, z, i, first, top):
    if takes_top:
      return fn(old.ctypes.data, new.ctypes.data, z.ctypes.data, i.ctypes.data, first, top)
    return fn(old.ctypes.data, new.ctypes.data, z.ctypes.data, i.ctypes.data, first)
  return run


@pytest.mark.parametrize("bits", [16, 8])
def test_list_intrinsics_pack_the_changed_lanes_to_the_front(bits):
  """list_u16 (by compress and by byte shuffles) and list_u8 list exactly the changed
  lanes, in order: their zigzag offsets (capped at top for uint16) and lane numbers plus
  `first`, for every pattern of 8 lanes (every row of the shuffle table) and random ones."""
  rng = np.random.default_rng(21)
  dtype, lanes = (np.uint16, intrinsics.LIST_LANES) if bits == 16 else (np.uint8, 64)
  fns = ((intrinsics.list_u16_compress, intrinsics.list_u16_shuffle) if bits == 16
         else (intrinsics.list_u8,))
  runs = [_lister(fn, bits == 16) for fn in fns]
  seen = set()
  tiled = [np.tile((m >> np.arange(8)) & 1, lanes // 8).astype(bool) for m in range(256)]
  for mask in tiled + [rng.random(lanes) < d for d in [0.1, 0.3, 0.5, 0.7, 0.9] * 20]:
    old = rng.integers(0, 1 << bits, lanes, dtype=dtype)
    step = rng.integers(1, 1 << bits, lanes, dtype=dtype)
    new = np.where(mask, old + step, old).astype(dtype)
    density = mask.mean()
    diff = (new - old).astype(np.int64)
    diff = np.where(diff >= 1 << (bits - 1), diff - (1 << bits), diff)  # wrapping offset
    zig = np.where(diff < 0, -2 * diff - 1, 2 * diff)
    changed = np.flatnonzero(new != old)
    top = 1000
    want_z = np.minimum(zig[changed], top) if bits == 16 else zig[changed]
    first = int(rng.integers(0, 1 << 15))
    for run in runs:
      z = np.zeros(lanes + 16, dtype)
      i = np.zeros(lanes + 16, np.uint16)
      n = run(old, new, z, i, first, top)
      assert n == changed.size
      assert np.array_equal(z[:n], want_z), (run, density)
      assert np.array_equal(i[:n], changed + first), (run, density)
    seen.update(int(m) for m in np.packbits(new != old, bitorder="little"))
  assert len(seen) == 256


def test_the_listed_path_follows_the_cpu_features_numba_compiles_for(monkeypatch):
  """HAS_COMPRESS and HAS_SHUFFLE read NUMBA_CPU_FEATURES where it is set (numba compiles
  for those), else the host's: a cache built for a CPU without AVX-512 VBMI2 lists changes
  with byte shuffles, one without SSSE3 (not x86) walks them."""
  from numba.core import config  # noqa: PLC0415
  monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+ssse3,+avx512bw,+avx512vl,-avx512vbmi2")
  assert not intrinsics.has_compress() and intrinsics.has_shuffle()
  monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,+ssse3,+avx512bw,+avx512vl,+avx512vbmi2")
  assert intrinsics.has_compress()
  monkeypatch.setattr(config, "CPU_FEATURES", "+neon,+fp-armv8")
  assert not intrinsics.has_compress() and not intrinsics.has_shuffle()
  monkeypatch.setattr(config, "CPU_FEATURES", None)
  import llvmlite.binding  # noqa: PLC0415
  host = llvmlite.binding.get_host_cpu_features()
  assert intrinsics.has_compress() == all(
      host.get(f, False) for f in ("avx512vbmi2", "avx512bw", "avx512vl"))
  assert intrinsics.has_shuffle() == host.get("ssse3", False)
  assert joint.LISTING[16] == (intrinsics.COMPRESS if intrinsics.HAS_COMPRESS else
                               intrinsics.SHUFFLE if intrinsics.HAS_SHUFFLE else intrinsics.WALK)
  assert joint.LISTING[8] == (intrinsics.COMPRESS if intrinsics.HAS_COMPRESS else
                              intrinsics.WALK)


def _decoded(data, base, quad, monkeypatch):
  """base's decode of the joint section `data` with four streams in lockstep or two, or the
  CodecError's message."""
  monkeypatch.setattr(joint, "QUAD", quad)
  out = base.copy()
  try:
    joint.Section(ByteReader(data, "t"), base.size, base.dtype).apply(base, out, None)
  except CodecError as e:
    return str(e)
  return out


def test_four_streams_in_lockstep_decode_as_two_do(monkeypatch):
  """joint.QUAD (the host's choice) changes how many streams the decoder runs side by
  side, never what it decodes or rejects: whole and short rounds, and corrupted bytes."""
  rng = np.random.default_rng(13)
  for name, base, target, k, counts in _listed_cases():
    data = joint.encode(base, target, k, counts)[0]
    four, two = (_decoded(data, base, q, monkeypatch) for q in (True, False))
    assert np.array_equal(four, target) and np.array_equal(two, target), name
    for _ in range(4):
      bad = bytearray(data)
      at = rng.integers(len(bad) // 2, len(bad), 3)
      for i in at:
        bad[i] ^= 1 << int(rng.integers(8))
      four, two = (_decoded(bytes(bad), base, q, monkeypatch) for q in (True, False))
      assert type(four) is type(two), name
      assert (four == two) if isinstance(four, str) else np.array_equal(four, two), name


def test_a_rejected_change_leaves_the_held_decoder_just_past_its_end():
  """The four-stream loop decodes GROUP changes of a stream from one window and checks the
  stream's end once per group: a change _next rejects (here a stream of zeros, no stop
  bit before its end at bit 128) must leave the position at end + 1, so that the check
  fails and no later window is loaded further out than words_of's zero padding reaches."""
  words = entropy.words_of(bytes(16))
  assert words.nbytes - 16 >= 25
  table = np.full(1 << huffman.MAX_LEN, joint._ESC_FLAG, np.uint32)  # no code at all
  whole = np.zeros(1 << joint.WHOLE, np.uint32)
  bits, p, _, _ = joint._decode_held(words.ctypes.data, np.uint64(0), 0, 128, -1, 2, table,
                                     np.uint64(16), whole)
  assert (p, bits) == (129, 0)


@pytest.fixture(scope="module")
def int8_pair():
  """int8 codes moved by +-1 at 1%, plus a value no sampled window holds in blocks 5 and
  20: (base, target, those blocks)."""
  rng = np.random.default_rng(5)
  n = 3 << 20
  base = rng.integers(0, 256, n, dtype=np.uint8)
  target = changed(rng, base, 0.01, np.array([1, 255], np.uint8), [0.5, 0.5])
  sampled = np.zeros(n, bool)
  for s in joint.sample_starts(n):
    sampled[s:s + joint.SAMPLE_WINDOW] = True
  odd = []
  for block in (5, 20):
    lo = block * joint.BLOCK
    spot = lo + np.flatnonzero(~sampled[lo:lo + joint.BLOCK])[[100, 200, 300]]
    target[spot] = base[spot] + np.uint8(7)
    odd.append(block)
  return base, target, odd


def _bound_bytes(base, target):
  idx = np.flatnonzero(base != target)
  d = idx.size / base.size
  _, counts = np.unique(target[idx] - base[idx], return_counts=True)
  p = counts / counts.sum()
  return (base.size * -(d * np.log2(d) + (1 - d) * np.log2(1 - d))
          + idx.size * -(p * np.log2(p)).sum()) / 8


def test_a_closed_code_set_spares_the_escape_where_two_values_dominate(int8_pair):
  """+-1 steps of int8 codes: the closed set codes them in one bit each (with the escape,
  one of them would take two: about 5% more bytes); only the blocks holding a value the
  sample lacked take the open set."""
  base, target, odd = int8_pair
  enc, dec = section(base, target)
  assert tensor_codec.MODE_NAMES[enc.mode] == "joint"
  assert np.flatnonzero(dec.streams.sets).tolist() == odd
  assert len(enc.section) < 1.02 * _bound_bytes(base, target)
  out, digest = dec.apply(base, base.dtype)
  assert np.array_equal(out, target) and digest == sync.checksum(target)
  idx, off = dec.sparse()
  assert np.array_equal(idx, np.flatnonzero(base != target))
  assert np.array_equal(off, (target - base)[idx])


def test_int8_codes_take_the_joint_layout_from_half_a_percent():
  rng = np.random.default_rng(6)
  base = rng.integers(0, 256, 1 << 21, dtype=np.uint8)
  steps = np.array([1, 255], np.uint8), [0.5, 0.5]
  assert joint.plan(base, changed(rng, base, 0.002, *steps)) is None
  planned = joint.plan(base, changed(rng, base, 0.008, *steps))
  assert planned is not None and planned[3] == planned[1].sum() > 0  # changes sampled


def _table_end(section):
  """Position of the first block count varint of a joint section, and its closed flag."""
  r = ByteReader(section, "w")
  r.u8()
  m = r.u8()
  r.take(m)
  closed = r.u8()
  r.take((m + 1) // 2 + (m // 2 if closed else 0))
  return r.pos, closed


def test_joint_block_code_sets_are_checked(pair):
  """A section without a closed set whose block names it, or an unknown closed-set flag,
  raises CodecError naming the tensor."""
  base, target = pair
  enc, _ = section(base, target)
  pos, closed = _table_end(enc.section)
  assert closed == 0
  data = bytearray(enc.section)
  first = ByteReader(enc.section, "w", pos).varint()
  assert first & 1  # every block: open set
  data[pos] ^= 1
  with pytest.raises(sync.CodecError, match="tensor 'w'.*closed code set the section lacks"):
    tensor_codec.decode_section("tensor 'w'", enc.mode, bytes(data), base.size, base.dtype)
  data = bytearray(enc.section)
  m = data[1]
  data[2 + m] = 2
  with pytest.raises(sync.CodecError, match="tensor 'w'.*unknown closed-set flag 2"):
    tensor_codec.decode_section("tensor 'w'", enc.mode, bytes(data), base.size, base.dtype)


@pytest.mark.parametrize("density,mode", [(0.005, "sparse"), (0.4, "dense")])
def test_sparse_and_dense_tensors_keep_the_general_layouts(density, mode):
  rng = np.random.default_rng(3)
  base = rng.integers(0, 1 << 16, 1 << 21, dtype=np.uint16)
  target = changed(rng, base, density, OFFSETS[:2], [0.5, 0.5])
  assert joint.plan(base, target) is None
  enc, dec = section(base, target)
  assert tensor_codec.MODE_NAMES[enc.mode] == mode
  assert np.array_equal(dec.apply(base, base.dtype)[0], target)


def test_long_sparse_sections_split_their_gaps_into_four_rice_streams():
  rng = np.random.default_rng(4)
  base = rng.integers(0, 1 << 16, 1 << 19, dtype=np.uint16)
  target = changed(rng, base, 0.015)  # below joint.MIN_DENSITY
  enc, dec = section(base, target)
  assert tensor_codec.MODE_NAMES[enc.mode] == "sparse"
  nnz = ByteReader(enc.section, "w").varint()
  coder = enc.section[len(varint(nnz))]
  assert nnz >= 4096 and coder & 0xC0 == 0xC0  # Rice, four streams
  assert np.array_equal(dec.apply(base, base.dtype)[0], target)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                    min_size=1, max_size=4))
def test_corrupted_joint_sections_raise_codec_error_or_decode_exactly(ops, pair, int8_pair):
  for base, target in (pair, int8_pair[:2]):
    _check_corrupted(ops, base, target)


def _check_corrupted(ops, base, target):
  enc, _ = section(base, target)
  data = bytearray(enc.section)
  for where, byte in ops:
    data[int(where * len(data))] ^= byte or 1
  try:
    dec = tensor_codec.decode_section("tensor 'w'", enc.mode, bytes(data), base.size,
                                      base.dtype)
  except sync.CodecError as e:
    assert "tensor 'w'" in str(e)
    return
  try:
    out, digest = dec.apply(base, base.dtype)
    assert digest == sync.checksum(out)  # decoded something well-formed; the seal decides
  except sync.CodecError as e:
    assert "tensor 'w'" in str(e)
  try:  # the arrays an on-device scatter takes: in range, one offset per index
    idx, off = dec.sparse()
    assert idx.size == off.size and np.all(np.diff(idx) > 0)
    assert idx.size == 0 or (idx[0] >= 0 and idx[-1] < base.size)
  except sync.CodecError as e:
    assert "tensor 'w'" in str(e)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 1000, 1001, 1002, 1003])
def test_four_state_rans_round_trips_any_length(n):
  rng = np.random.default_rng(n)
  z = rng.choice([1, 2, 3, 4, 40, 5000], n, p=[0.4, 0.4, 0.1, 0.05, 0.04, 0.01]).astype(np.uint64)
  z[0] = 1
  z[-1] = 2  # at least two symbols: the rANS words are used
  data = entropy.encode_stream(entropy.histogram(z), z)
  assert np.array_equal(entropy.decode_stream(ByteReader(data, "test"), n), z)


def test_rans_normalisation_keeps_every_symbol_and_the_total():
  counts = np.concatenate([[10**6] * 30, [1] * 190]).astype(np.int64)  # many rare symbols
  f = rans.normalize(counts)
  assert f.sum() == rans.PROB_SCALE and f.min() >= 1
  assert np.all(f[:30] > f[30:].max())


def test_huffman_codes_are_length_limited_prefix_free_and_decodable():
  counts = np.array([int(1.6**i) + 1 for i in range(40)], np.int64)  # would exceed MAX_LEN
  lengths = huffman.code_lengths(counts)
  assert lengths.max() <= huffman.MAX_LEN and (2.0 ** -lengths).sum() <= 1.0
  codes = huffman.canonical_codes(lengths)
  table = huffman.decode_table(lengths, codes, np.arange(40) + 1)
  for i, (n, c) in enumerate(zip(lengths, codes)):
    entry = int(table[int(c)])
    assert entry >> 24 == n and entry & 0xFFFFFF == i + 1
  with pytest.raises(ValueError, match="Kraft"):
    huffman.canonical_codes(np.array([1, 1, 1]))


def _heap_huffman_cost(counts):
  """Total code bits of an optimal (unlimited) Huffman code, merging with a heap."""
  import heapq  # noqa: PLC0415
  heap = [int(c) for c in counts]
  heapq.heapify(heap)
  total = 0
  while len(heap) > 1:
    merged = heapq.heappop(heap) + heapq.heappop(heap)
    total += merged
    heapq.heappush(heap, merged)
  return total


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 10_000), min_size=2, max_size=60))
def test_huffman_lengths_are_optimal_when_no_limit_binds(counts):
  counts = np.array(counts, np.int64)
  optimal = huffman.tree_lengths(counts)  # before the length limit
  assert int((optimal * counts).sum()) == _heap_huffman_cost(counts)
  assert (2.0 ** -optimal.astype(float)).sum() == 1.0  # a full tree
  lengths = huffman.code_lengths(counts)
  assert lengths.max() <= huffman.MAX_LEN and (2.0 ** -lengths.astype(float)).sum() <= 1.0
  if optimal.max() <= huffman.MAX_LEN:
    assert np.array_equal(lengths, optimal)


def test_the_gap_plan_costs_rice_and_the_entropy_stage_exactly():
  gaps = np.random.default_rng(3).geometric(0.03, 5000).astype(np.uint32) - 1
  k, rice_bits, entropy_bits, present = loops.gap_plan(gaps, 1, entropy.WIDTHS)
  for other in range(max(0, k - 1), k + 2):
    assert rice_bits <= loops.rice_encode(gaps, other)[1]
  assert rice_bits == loops.rice_encode(gaps, k)[1]
  hist = entropy.histogram(gaps.astype(np.uint64))
  assert present == np.count_nonzero(hist)
  assert entropy.cost_of(entropy_bits, present) == pytest.approx(entropy.cost_bytes(hist))


def _whole_codes_numpy(k, table, width):
  """The decoder's whole-code table, computed array-wise (the reference)."""
  x = np.arange(1 << joint.WHOLE, dtype=np.uint64)
  low = x & -x
  t = np.where(x > 0, np.log2(np.maximum(low, 1).astype(np.float64)),
               joint.WHOLE).astype(np.int64)
  head = t + 1 + k
  y = x >> np.minimum(head, 63).astype(np.uint64)
  e = table[(y & np.uint64((1 << huffman.MAX_LEN) - 1)).astype(np.int64)].astype(np.uint64)
  hl, rw = e >> np.uint64(24), (e >> np.uint64(16)) & np.uint64(31)
  total = head + (hl + rw).astype(np.int64)
  ok = (x > 0) & ((e & np.uint64(joint._ESC_FLAG)) == 0) & (total <= joint.WHOLE)
  z = (e & np.uint64(0xFFFF)) | ((y >> hl) & ((np.uint64(1) << rw) - np.uint64(1)))
  off = ((z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1)))) & np.uint64((1 << width) - 1)
  gap = (t.astype(np.uint64) << np.uint64(k)) | (
      (x >> (t + 1).astype(np.uint64)) & np.uint64((1 << k) - 1))
  entry = off | (gap << np.uint64(16)) | (total.astype(np.uint64) << np.uint64(28))
  return np.where(ok, entry, 0).astype(np.uint32)


def test_the_whole_code_table_matches_its_array_wise_definition(pair):
  enc, dec = section(*pair)
  assert enc.mode == tensor_codec.JOINT
  table = dec.streams.tables[0]
  for k in {dec.streams.k, 0, 3, 9, joint.WHOLE - 1, joint.WHOLE, joint.MAX_K}:
    for width in (8, 16):
      assert np.array_equal(joint.whole_codes(k, table, width),
                            _whole_codes_numpy(k, table, width)), (k, width)


@pytest.mark.parametrize("width,wide", [(8, False), (16, False), (16, True)])
def test_the_code_tables_match_their_symbol_by_symbol_definition(width, wide):
  """joint.tables' value codes against loops.symbol_of applied to every zigzag value:
  from ctab within its reach (0 past it), from the symbol table and the escape above; the
  open set codes every value, the closed set the sample's symbols alone, with one code
  fewer."""
  rng = np.random.default_rng(width + wide)
  counts = np.zeros(entropy.ALPHABET, np.int64)
  top = 4 * width if wide else 2 * width + 8  # wide: up to the largest symbol (sign crossings)
  present = rng.choice(np.arange(1, top), 20, replace=False)
  counts[present] = rng.integers(1, 1000, present.size)
  k = 5
  _, (ctabs, symtabs, escs), made = joint.tables(counts, width, k, min_gain=0.0)
  assert made and not joint.tables(counts, width, k, min_gain=1.0)[2]
  closed, opened = (ctabs[0], symtabs[0], escs[0]), (ctabs[1], symtabs[1], escs[1])
  syms = np.append(np.flatnonzero(counts), joint.ESCAPE)
  weights = np.append(counts[counts > 0], max(1, int(counts.sum()) >> 12))
  for (ctab, symtab, esc), n in ((opened, syms.size), (closed, syms.size - 1)):
    assert ctab.size == (1 << width if width == 8 else joint.CTAB_MAX + 1)  # int8: every z
    # bf16: up to the end of the bucket of the sample's largest symbol
    largest = int(present.max())
    bits = largest.bit_length() if largest < loops.DIRECT else (largest - loops.DIRECT) // 4 + 5
    reach = ctab.size if width == 8 else min(1 << max(4, bits), joint.CTAB_MAX)
    lengths = huffman.code_lengths(weights[:n])
    codes = huffman.canonical_codes(lengths)
    code_of = dict(zip(syms[:n].tolist(), zip(codes.tolist(), lengths.tolist())))
    entries = joint.value_entries(np.arange(1 << width, dtype=np.uint64), symtab, esc, k)
    assert ctab[0] == 0
    for z in range(1, 1 << width):
      sym, rw, extra = (int(v) for v in loops.symbol_of(z))
      if sym in code_of:
        code, length = code_of[sym]
        bits, length = code | (extra << length), length + rw
      elif joint.ESCAPE in code_of:
        code, length = code_of[joint.ESCAPE]
        bits, length = code | (z << length), length + width
      else:  # closed set: no code; the entry's length (top byte) is 0
        bits, length = z, -(k + 1)
      want = ((bits & ((1 << 56) - 1)) << (k + 1) & ((1 << 64) - 1)) | ((length + k + 1) << 56)
      want |= 1  # the gap's stop bit
      assert int(entries[z]) == want, z
      if z < reach:
        assert int(ctab[z]) == want, z
      elif z < ctab.size:  # bf16 entries past the reach (CTAB_MAX: capped z) take value_entry
        assert ctab[z] == 0, z
      if z >= reach and not wide:  # the table reaches past the sample's largest symbol
        assert sym not in code_of, z


def test_varints_round_trip_and_match_the_scalar_coder():
  values = np.array([0, 1, 127, 128, 300, 2**40, 2**63 - 1], np.int64)
  data = varints(values)
  assert data == b"".join(varint(int(v)) for v in values)
  r = ByteReader(data + b"\x05", "test")
  assert np.array_equal(r.varints(values.size), values) and r.u8() == 5


def test_varint_arrays_reject_truncation_and_63_bit_values_by_name():
  with pytest.raises(CodecError, match="tensor 'w': truncated: 3 varints from offset 0"):
    ByteReader(varints([1, 300]) + b"\x80", "tensor 'w'").varints(3)
  with pytest.raises(CodecError, match="tensor 'w': a varint of 63 bits or more"):
    ByteReader(b"\x01" + varint(2**63), "tensor 'w'").varints(2)


def test_joint_update_through_the_public_api(pair):
  base, target = pair
  update = sync.encode({"w": base.view(BF16)}, {"w": target.view(BF16)}, version=1)
  assert update.tensors["w"].mode == "joint"
  again = sync.Update.from_bytes(update.to_bytes())
  out = sync.apply({"w": base.view(BF16)}, again)
  assert np.array_equal(out["w"].view(np.uint16), target)


def test_sections_with_the_same_code_table_share_one_decoder_table_build(monkeypatch):
  """int8 sections of one update mostly carry equal tables: the second parse reuses the
  first one's decoder tables, each still decodes exactly, and the cache stays bounded."""
  monkeypatch.setattr(joint, "_DECODER_TABLES", {})
  rng = np.random.default_rng(8)
  n = 1 << 19
  pairs = []
  for _ in range(2):  # same statistics, different positions and bases
    base = rng.integers(0, 256, n, dtype=np.uint8)
    pairs.append((base, changed(rng, base, 0.02, np.array([1, 255], np.uint8), [0.7, 0.3])))
  encs = [tensor_codec.encode_section(b, t) for b, t in pairs]
  assert all(tensor_codec.MODE_NAMES[e.mode] == "joint" for e in encs)
  m = encs[0].section[1]  # k, m, m symbols (+-1, the escape), closed flag, lengths
  tables = [bytes(e.section[:3 + m + (m + 1) // 2 + m // 2]) for e in encs]
  assert tables[0] == tables[1]
  decs = [tensor_codec.decode_section("tensor 'w'", e.mode, e.section, n, np.dtype(np.uint8))
          for e in encs]
  assert decs[0].streams.tables is decs[1].streams.tables
  assert len(joint._DECODER_TABLES) == 1
  for (base, target), dec in zip(pairs, decs):
    assert np.array_equal(dec.apply(base, base.dtype)[0], target)
  monkeypatch.setattr(joint, "_DECODER_TABLES_MAX", 2)
  for density in (0.05, 0.1, 0.2):  # other tables: the oldest go first
    base = pairs[0][0]
    target = changed(rng, base, density, OFFSETS[:6].astype(np.uint8), None)
    enc = tensor_codec.encode_section(base, target)
    dec = tensor_codec.decode_section("tensor 'w'", enc.mode, enc.section, n,
                                      np.dtype(np.uint8))
    assert np.array_equal(dec.apply(base, base.dtype)[0], target)
    assert len(joint._DECODER_TABLES) <= 2
  joint.forget_tables()
  assert joint._DECODER_TABLES == {}
  again = tensor_codec.decode_section("tensor 'w'", encs[0].mode, encs[0].section, n,
                                      np.dtype(np.uint8))
  assert again.streams.tables is not decs[0].streams.tables  # built anew
  assert np.array_equal(again.apply(*pairs[0][:1], np.dtype(np.uint8))[0], pairs[0][1])


def test_a_bad_code_table_is_rejected_every_time_and_never_kept(pair, monkeypatch):
  monkeypatch.setattr(joint, "_DECODER_TABLES", {})
  base, target = pair
  data = bytearray(tensor_codec.encode_section(base, target).section)
  m = data[1]
  data[3 + m] = 0xFF  # two code lengths of 15: no longer a prefix code
  for _ in range(2):
    with pytest.raises(CodecError, match="tensor 'w': joint code table"):
      tensor_codec.decode_section("tensor 'w'", tensor_codec.JOINT, bytes(data), base.size,
                                  np.dtype(np.uint16))
  assert joint._DECODER_TABLES == {}


def _parses(data, n):
  """(joint._parse's result or None, parse_general's or the CodecError it raised)."""
  fast = joint._parse(np.frombuffer(data, np.uint8), n)
  try:
    general = joint.parse_general(ByteReader(data, "tensor 'w'"), n)
  except CodecError as e:
    general = e
  return (fast if fast[0] else None), general


def _same_parse(a, b):
  return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_the_compiled_joint_parse_reads_what_the_general_reader_does(pair, int8_pair):
  for base, target in (pair, int8_pair[:2]):
    data = bytes(tensor_codec.encode_section(base, target).section)
    fast, general = _parses(data, base.size)
    assert fast is not None and _same_parse(fast, general)
    assert fast[5] == np.count_nonzero(base != target)  # changes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
                    min_size=1, max_size=3),
       head=st.booleans(), cut=st.integers(-2, 2))
def test_fuzzed_joint_sections_parse_alike_both_ways(ops, head, cut, int8_pair):
  """The compiled parse accepts exactly what the general reader accepts, with the same
  fields; where it declines, the general reader raises the error that names the field."""
  base, target = int8_pair[:2]
  data = bytearray(tensor_codec.encode_section(base, target).section)
  span = 80 if head else len(data)  # the header fields, or anywhere
  for where, byte in ops:
    data[int(where * span)] ^= byte
  data = bytes(data[:len(data) + cut] if cut < 0 else data + bytes(cut))
  fast, general = _parses(data, base.size)
  if fast is None:
    assert isinstance(general, CodecError) and "tensor 'w'" in str(general)
  else:
    assert not isinstance(general, CodecError), general
    assert _same_parse(fast, general)


@pytest.mark.parametrize("n", [1 << 16, (1 << 20) + 777, 3 << 18, (3 << 18) + 1])
def test_the_decoder_prefetches_the_stretch_apply_copies_next(n):
  """While decoding a stretch, the decoder prefetches the base elements that Section.apply
  copies in for the next one; after the last, nothing."""
  step = loops.CALL_BYTES // 2
  stretches = [(s, min(s + step, n)) for s in range(0, n, step)]
  for (s, _), following in zip(stretches, stretches[1:] + [(n, n)]):
    assert joint.next_stretch(s // joint.BLOCK, (s + step) // joint.BLOCK, n) == following


def test_a_compiled_call_covers_whole_rounds_of_joint_blocks():
  """Joint encode and apply take CALL_BYTES of each array per call in whole rounds of
  STREAMS blocks (the decoder runs a round's streams side by side): for bf16 and int8."""
  for itemsize in (1, 2):
    assert (loops.CALL_BYTES // itemsize) % (joint.STREAMS * joint.BLOCK) == 0


def test_the_streams_rows_grow_only_where_a_call_might_not_fit():
  out = np.arange(joint.STREAMS * 10, dtype=np.uint64).reshape(joint.STREAMS, 10)
  step = 4 * joint.STREAMS  # a call's rows take step // STREAMS + 2 = 6 words at most
  assert joint.with_room(out, 4, step) is out
  grown = joint.with_room(out, 5, step)
  assert grown.shape == (joint.STREAMS, 20)
  np.testing.assert_array_equal(grown[:, :10], out)
