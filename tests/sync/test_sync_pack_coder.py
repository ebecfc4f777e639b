"""A pack coded and applied in one compiled call (pack_coder.py): the same bytes and
checksums as the general path, every layout it does not make left to that path, and no
section it cannot read taken."""


import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_ps import sync
from rlax_ps.sync import (arena, codec, entropy, integrity, joint, loops, pack_coder, rans,
                          tensor_codec, wire)
from rlax_ps.sync.byte_reader import ByteReader
from rlax_ps.sync.integrity import XXH3

def test_the_xxh3_address_is_found_and_hashes_as_checksum():
  assert XXH3  # the xxhash package exports its C functions on every platform we ship
  rng = np.random.default_rng(0)
  for n in (0, 1, 16, 17, 128, 129, 240, 241, 1000, 1 << 20):
    buf = rng.integers(0, 256, n, dtype=np.uint8)
    ends = np.array([n], np.int64)
    out = np.zeros(1, np.uint64)
    loops.hash_all(XXH3, buf.ctypes.data, 1, ends, out)
    assert int(out[0]) == xxhash.xxh3_64_intdigest(buf), n


def _pack(rng, sizes, dtype, density, offsets=(1, -1, 2, -2, 1, 1, -1, 300),
          clustered=False):
  """(old, new, ends) of a pack of members of `sizes` elements with `density` changed."""
  n = sum(sizes)
  bits = 8 * np.dtype(dtype).itemsize
  old = rng.integers(0, 2**bits, n).astype(dtype)
  new = old.copy()
  k = int(n * density)
  if clustered:  # runs of changes
    starts = rng.choice(max(1, n - 64), max(1, k // 64), replace=False)
    idx = np.unique(np.clip((starts[:, None] + np.arange(64)).ravel(), 0, n - 1))
  else:
    idx = rng.choice(n, k, replace=False) if k else np.zeros(0, np.int64)
  new[idx] += (rng.choice(np.array(offsets), idx.size) % 2**bits).astype(dtype)
  return old, new, np.cumsum(sizes, dtype=np.int64)


def _general(old, new, ends):
  """tensor_codec's general path for a pack: (mode, section bytes, member digests)."""
  enc = tensor_codec.encode_section(old, new, hashed=(False, False))
  starts = [0, *ends[:-1].tolist()]
  return enc.mode, bytes(enc.section), [xxhash.xxh3_64_intdigest(new[a:b])
                                        for a, b in zip(starts, ends.tolist())]


def _general_only(old, new, mode) -> bool:
  """Whether the general path decides a layout the compiled call leaves to it: not joint,
  and dense, bitmap, or clustered changes (entropy-coded gaps, the bitmap probe), whatever
  it then chose."""
  if mode in (tensor_codec.DENSE, tensor_codec.BITMAP):
    return True
  if mode == tensor_codec.JOINT:
    return False
  ch = tensor_codec.scan_changes(old, new, (False, False))
  if ch.nnz == 0:
    return False
  costs = loops.sparse_costs(old, new, ch.gaps, ch.hist, tensor_codec.gap_step(ch.gaps),
                             entropy.WIDTHS, entropy.LITERAL_MAX)
  return tensor_codec._encode_gaps(ch.gaps, costs[4:])[2]


WIDE = tuple(range(1, 65535, 997))  # offsets of no pattern: raw bytes are smallest
CASES = {  # name: (sizes, density, offsets, clustered)
    "unchanged": ([5000, 64, 9000], 0.0, None, False),
    "sparse literal": ([5000, 64, 9000], 0.0006, None, False),  # a few changes
    "sparse": ([5000, 64, 9000], 0.003, None, False),
    "joint": ([40_000, 30_000, 30_000], 0.045, None, False),
    "sparse rANS": ([60_000] * 20, 0.004, (1, -1), False),  # > 4096 changes
    "sparse small": ([300, 200], 0.1, None, False),
    "dense": ([2000, 2000], 0.5, None, False),
    "clustered": ([30_000, 40_000], 0.02, None, True),
    "empty members": ([0, 700, 0, 33], 0.05, None, False),
    "no elements": ([0, 0], 0.0, None, False),
    "raw": ([100], 0.9, WIDE, False),
}


def _case(name, dtype):
  sizes, density, offsets, clustered = CASES[name]
  rng = np.random.default_rng(len(name) + 100 * len(sizes))
  return _pack(rng, sizes, dtype, density, offsets or (1, -1, 2, -2, 1, 1, -1, 300), clustered)


def _layout(mode, section) -> str:
  """The layout a compiled-call result names (the sparse values' kind read off the bytes)."""
  if mode != pack_coder.SPARSE:
    return tensor_codec.MODE_NAMES[mode]
  literal = loops.sparse_literal(np.frombuffer(bytes(section), np.uint8), 1 << 30,
                                 np.empty(0, np.uint16))[0]
  return "sparse literal" if literal else "sparse rANS"


@pytest.mark.parametrize("dtype", [np.uint16, np.uint8])
@pytest.mark.parametrize("name", list(CASES))
def test_a_pack_is_coded_as_the_general_path_codes_it(dtype, name):
  old, new, ends = _case(name, dtype)
  mode, section, digests = _general(old, new, ends)
  got = pack_coder.encode(old, new, ends, True, XXH3)
  if _general_only(old, new, mode):
    assert got is None  # left to the general path, which makes those layouts
    return
  assert got is not None, tensor_codec.MODE_NAMES[mode]
  got_mode, got_section, got_digests = got
  assert got_mode == mode
  if mode != tensor_codec.RAW:  # (raw: no bytes; the pack is then not made)
    assert bytes(got_section) == section
  assert got_digests[0].tolist() == digests
  assert got_digests[1].tolist() == [xxhash.xxh3_64_intdigest(old[a:b]) for a, b in
                                     zip([0, *ends[:-1].tolist()], ends.tolist())]


def test_the_cases_reach_every_layout():
  """CASES reach each layout the compiled call makes (both value streams), and layouts it
  leaves to the general path, for both lane widths."""
  for dtype in (np.uint16, np.uint8):
    seen = set()
    for name in CASES:
      old, new, ends = _case(name, dtype)
      got = pack_coder.encode(old, new, ends, False, XXH3)
      seen.add("general" if got is None else _layout(got[0], got[1]))
    assert {"unchanged", "raw", "joint", "sparse literal", "sparse rANS",
            "general"} <= seen, (dtype, seen)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       sizes=st.lists(st.integers(0, 40_000), min_size=1, max_size=6),
       density=st.sampled_from([0.0, 0.0005, 0.004, 0.03, 0.12, 0.3]),
       wide=st.booleans())
def test_random_packs_code_as_the_general_path(seed, sizes, density, wide):
  rng = np.random.default_rng(seed)
  old, new, ends = _pack(rng, sizes, np.uint16 if wide else np.uint8, density)
  mode, section, digests = _general(old, new, ends)
  got = pack_coder.encode(old, new, ends, False, XXH3)
  assert (got is None) == _general_only(old, new, mode)
  if got is None:
    return
  assert got[0] == mode and got[2][0].tolist() == digests
  if mode != tensor_codec.RAW:
    assert bytes(got[1]) == section


@pytest.mark.parametrize("dtype", [np.uint16, np.uint8])
@pytest.mark.parametrize("density", [0.0001, 0.045])  # sparse with literal values; joint
def test_a_pack_is_applied_as_the_general_path_applies_it(dtype, density):
  rng = np.random.default_rng(3)
  old, new, ends = _pack(rng, [40_000, 30_000, 31], dtype, density)
  mode, section, digests = pack_coder.encode(old, new, ends, False, XXH3)
  assert mode in (pack_coder.JOINT, pack_coder.SPARSE)
  out = np.zeros_like(old)
  got = pack_coder.apply(mode, bytes(section), old, out, ends, XXH3)
  assert np.array_equal(out, new) and got.tolist() == digests[0].tolist()
  held = old.copy()  # in place
  got = pack_coder.apply(mode, bytes(section), held, held, ends, XXH3)
  assert np.array_equal(held, new) and got.tolist() == digests[0].tolist()


def test_sections_the_call_does_not_read_are_left_to_the_general_path():
  rng = np.random.default_rng(4)
  old, new, ends = _pack(rng, [3000, 3000], np.uint16, 0.5)  # dense
  enc = tensor_codec.encode_section(old, new, hashed=(False, False))
  assert enc.mode == tensor_codec.DENSE
  assert pack_coder.apply(enc.mode, bytes(enc.section), old, np.zeros_like(old), ends,
                          XXH3) is None
  old, new, ends = _case("sparse rANS", np.uint16)  # rANS values
  enc = tensor_codec.encode_section(old, new, hashed=(False, False))
  assert enc.mode == tensor_codec.SPARSE
  assert pack_coder.apply(enc.mode, bytes(enc.section), old, np.zeros_like(old), ends,
                          XXH3) is None


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), joint=st.booleans(), cut=st.booleans())
def test_mutated_pack_sections_never_crash_and_never_apply_as_what_they_are_not(seed, joint,
                                                                               cut):
  """Random byte flips or a cut: the call declines (None), or decodes something whose
  member checksums then differ from the original's (codec.apply's result seal rejects
  it), or, where the flip left the decoded changes intact, the true result."""
  rng = np.random.default_rng(seed)
  old, new, ends = _pack(np.random.default_rng(5), [40_000, 30_000], np.uint16,
                         0.045 if joint else 0.0001)
  mode, section, digests = pack_coder.encode(old, new, ends, False, XXH3)
  data = bytearray(section)
  if cut:
    data = data[:int(rng.integers(0, len(data)))]
  else:
    for i in rng.integers(0, len(data), int(rng.integers(1, 4))):
      data[i] ^= int(rng.integers(1, 256))
  out = np.zeros_like(old)
  got = pack_coder.apply(mode, bytes(data), old, out, ends, XXH3)
  if got is not None:
    same = got.tolist() == digests[0].tolist()
    assert same == np.array_equal(out, new)


@pytest.mark.parametrize("density", [0.003, 0.045])
def test_a_corrupted_pack_is_named_by_codec_apply(density):
  """A pack section damaged behind a valid section seal: the compiled call decodes it or
  declines, and either way apply raises a CodecError naming a member of the pack."""
  rng = np.random.default_rng(6)
  base = {f"l{i}.kernel": rng.standard_normal((64, 100)).astype(np.float32) * 0.02
          for i in range(12)}
  held = sync.held_state(base, "bf16")
  target = {k: v.copy() for k, v in held.items()}
  for v in target.values():
    flat = v.reshape(-1).view(np.uint16)
    flat[rng.choice(flat.size, int(flat.size * density), replace=False)] += np.uint16(1)
  update = sync.encode(held, target, "bf16", version=1)
  head = next(iter(update.tensors))
  assert update.tensors[head].mode in ("joint", "sparse") and update.pack(head)
  data = update.to_bytes()
  sections = [bytearray(data[m.offset:m.offset + m.nbytes]) for m in update.tensors.values()]
  sections[0][len(sections[0]) // 2] ^= 0x10
  header = update.header._replace(sections=wire.section_seal(sections))
  forged = sync.Update.from_bytes(wire.assemble(header, sections).to_bytes())
  for out in (None, sync.held_state(base, "bf16")):  # new arrays, or a recorded spare
    with pytest.raises(sync.CodecError) as err:
      sync.apply(held, forged, out=out)
    assert any(repr(n) in str(err.value) for n in update.pack(head)), str(err.value)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_updates_are_the_same_bytes_without_compiled_xxh3(monkeypatch, fmt):
  """Where the xxh3 C function is not found, the general path and Python seals make the
  same message."""
  rng = np.random.default_rng(7)
  base = {f"l{i}.kernel": rng.standard_normal((48, 64)).astype(np.float32) * 0.02
          for i in range(9)} | {"norm.scale": np.ones(64, np.float32)}
  target = {k: v + 1e-3 * rng.standard_normal(v.shape).astype(np.float32)
            for k, v in base.items()}
  want = sync.encode(base, target, fmt, version=3)
  for module in (codec, integrity, tensor_codec, wire):
    monkeypatch.setattr(module, "XXH3", 0)
  got = sync.encode(base, target, fmt, version=3)
  assert got.to_bytes() == want.to_bytes() and got.header == want.header
  out = sync.apply(sync.held_state(base, fmt), sync.Update.from_bytes(got.to_bytes()))
  assert set(out) == set(want.tensors)


def _normalize_reference(counts):
  """rans.normalize as first written (numpy, Python loop): the frequencies the wire
  format fixes."""
  n = int(counts.sum())
  f = np.maximum(1, (counts.astype(np.int64) * rans.PROB_SCALE) // n)
  excess = int(f.sum()) - rans.PROB_SCALE
  while excess > 0:
    i = int(np.argmax(f))
    d = min(excess, max(1, int(f[i]) // 8))
    f[i] -= d
    excess -= d
  f[int(np.argmax(f))] -= excess
  return f


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 10**9), min_size=2, max_size=200))
def test_compiled_normalize_gives_the_reference_frequencies(counts):
  c = np.array(counts, np.int64)
  assert np.array_equal(rans.normalize(c), _normalize_reference(c))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 6000),
       top=st.sampled_from([0, 1, 3, 40, 70_000]))
def test_compiled_value_streams_decode_to_their_values(seed, n, top):
  rng = np.random.default_rng(seed)
  z = rng.integers(0, top + 1, n).astype(np.uint64)
  stream = entropy.encode_stream(entropy.histogram(z), z)
  assert np.array_equal(entropy.decode_stream(ByteReader(stream, "s"), n), z)
  if 0 < n <= entropy.LITERAL_MAX:  # z + 1 stored less 1: z, in z.max()'s bits
    lit = entropy.encode_literal(z + 1, 1)
    assert lit[0] == entropy.LITERAL and lit[1] == int(z.max()).bit_length()
    assert np.array_equal(entropy.decode_stream(ByteReader(lit, "s"), n), z)


def _small_model(rng, fmt, n=7, step=1e-3, still=()):
  """(base, target) float weights of a model whose every tensor is small (one pack a held
  dtype); tensors named in `still` do not move."""
  base = {f"l{i}.kernel": rng.standard_normal((24 + i, 40)).astype(np.float32) * 0.02
          for i in range(n)} | {"norm.scale": np.ones(40, np.float32)}
  target = {k: v if k in still else v + step * rng.standard_normal(v.shape).astype(np.float32)
            for k, v in base.items()}
  return sync.held_state(base, fmt), target


def _general_encode(monkeypatch, *args, **kwargs):
  """encode() with the one-call path of packed models turned off."""
  with monkeypatch.context() as m:
    m.setattr(codec, "_encode_packed", lambda *a, **k: None)
    return sync.encode(*args, **kwargs)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("step", [0.0, 2e-4, 1e-3, 3e-2])
@pytest.mark.parametrize("known", [False, True])
def test_a_packed_model_is_encoded_in_one_call_as_the_general_path_encodes_it(
    monkeypatch, fmt, step, known):
  rng = np.random.default_rng(int(step * 1e4) + 3 * known)
  base, target = _small_model(rng, fmt, step=step)
  kf = sync.encode(None, base, fmt, version=0)
  sums = kf.checksums if known else None
  calls = []
  packed = codec._encode_packed
  monkeypatch.setattr(codec, "_encode_packed",
                      lambda *a, **k: calls.append(1) or packed(*a, **k))
  got = sync.encode(base, target, fmt, version=1, base_checksums=sums, fingerprints=True)
  assert calls  # the layout takes the one-call path
  want = _general_encode(monkeypatch, base, target, fmt, version=1, base_checksums=sums,
                         fingerprints=True)
  assert got.to_bytes() == want.to_bytes() and got.header == want.header
  assert got.checksums == want.checksums and got.fingerprints == want.fingerprints
  assert got.packs() == want.packs()
  out = sync.apply(base, sync.Update.from_bytes(got.to_bytes()))
  held = sync.held_state(target, fmt)
  assert all(np.array_equal(out[k].view(np.uint8), held[k].view(np.uint8)) for k in held)


@pytest.mark.parametrize("fmt, n, mode", [("int8", 7, "sparse"), ("bf16", 40, "joint"),
                                          ("int8", 40, "joint")])
def test_a_packed_model_is_applied_in_one_call_as_the_general_path_applies_it(
    monkeypatch, fmt, n, mode):
  """apply of a small model's delta decodes each pack in one call into one new arena: the
  same arrays as the general path, each pack's members back to back in it (so that the
  next encode reads them as one span). (Sparse sections with rANS values, as bf16 packs of
  7 tensors get here, are the general path's: test_sections_the_call_does_not_read...)"""
  rng = np.random.default_rng(n)
  base, target = _small_model(rng, fmt, n=n, step=1e-5)
  update = sync.encode(base, target, fmt, version=1)
  assert update.tensors["l0.kernel"].mode == mode and update.pack("l0.kernel")
  calls = []
  packed = codec._apply_packed
  monkeypatch.setattr(codec, "_apply_packed",
                      lambda *a, **k: calls.append(packed(*a, **k)) or calls[-1])
  got = sync.apply(base, sync.Update.from_bytes(update.to_bytes()))
  assert calls and calls[0] is not None  # taken, and not declined
  monkeypatch.setattr(codec, "_apply_packed", lambda *a, **k: None)
  want = sync.apply(base, sync.Update.from_bytes(update.to_bytes()))
  assert list(got) == list(want) == list(base)
  for k in want:
    assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
    assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), k
  for head, members in update.packs().items():
    assert arena.span_of([got[n] for n in members]) is not None, head


def test_a_packed_apply_the_call_cannot_finish_is_left_to_the_general_path(monkeypatch):
  """Where the compiled call declines a pack, apply's general path takes the update whole
  and still makes the target."""
  rng = np.random.default_rng(12)
  base, target = _small_model(rng, "int8", step=1e-5)
  update = sync.encode(base, target, "int8", version=1)
  declined = []
  monkeypatch.setattr(pack_coder, "apply", lambda *a: declined.append(1))
  out = sync.apply(base, sync.Update.from_bytes(update.to_bytes()))
  assert declined
  held = sync.held_state(target, "int8")
  assert all(np.array_equal(out[k].view(np.uint8), held[k].view(np.uint8)) for k in held)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_an_update_frame_holds_each_piece_aligned_and_a_lone_pack_twice(fmt):
  """The frame's table gives each piece's bytes (64-byte aligned) as the layout has them,
  and scratch entries that do not overlap; a lone pack (bf16) is pack 0 and pack 1."""
  rng = np.random.default_rng(13)
  base, _ = _small_model(rng, fmt, n=40)
  lay = codec._layout(tuple((n, v.shape, v.dtype) for n, v in base.items()))
  frame = lay.frame
  assert frame is not None and not frame.consts.flags.writeable
  table = frame.consts[:8 * pack_coder._TABLE].view(np.int64)
  piece = lambda i: frame.consts[table[2 * i]:table[2 * i] + table[2 * i + 1]]  # noqa: E731
  assert all(table[2 * i] % 64 == 0 for i in range(pack_coder._PIECES + 2 * pack_coder._SCRATCH))
  packs = list(lay.pack_list) * (3 - len(lay.pack_list))  # a lone pack, twice
  assert len(lay.pack_list) == (1 if fmt == "bf16" else 2)
  for j, (_, ends, _) in enumerate(packs[:2]):
    assert np.array_equal(piece(3 * j + 2).view(np.int64), ends)
  assert np.array_equal(piece(6).view(np.int64), lay.perm)
  for i, column in enumerate(lay.columns[:3]):
    assert piece(7 + i).tobytes() == np.ascontiguousarray(column).tobytes()
  spans = sorted((table[2 * i], table[2 * i] + table[2 * i + 1]) for i in range(
      pack_coder._PIECES, pack_coder._PIECES + pack_coder._SCRATCH * len(lay.pack_list)))
  assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
  assert spans[-1][1] <= frame.scratch_bytes
  if len(lay.pack_list) == 1:
    first = table[2 * pack_coder._PIECES:][:2 * pack_coder._SCRATCH]
    second = table[2 * (pack_coder._PIECES + pack_coder._SCRATCH):][:2 * pack_coder._SCRATCH]
    assert np.array_equal(first, second)


def test_a_packed_model_whose_pack_has_nothing_to_share_takes_the_general_path(monkeypatch):
  """Every element of the bf16 pack changed by an offset of no pattern: raw bytes are the
  smallest, no pack is made, and the general path codes the members alone."""
  rng = np.random.default_rng(9)
  base, _ = _small_model(rng, "bf16", n=3)
  target = {k: (v.view(np.uint16) + rng.integers(1, 60000, v.shape).astype(np.uint16))
            .view(v.dtype) for k, v in base.items()}
  update = sync.encode(base, target, "bf16", version=1)
  assert update.packs() == {}
  assert update.to_bytes() == _general_encode(monkeypatch, base, target, "bf16",
                                              version=1).to_bytes()


def test_a_model_with_a_still_pack_codes_it_unchanged_in_one_call(monkeypatch):
  """int8 codes changed, scales as they were: the scales' pack is unchanged (no section),
  the codes' coded, in one call as in the general path."""
  rng = np.random.default_rng(10)
  base, _ = _small_model(rng, "int8")
  target = {k: v.copy() for k, v in base.items()}
  for k, v in target.items():
    if v.dtype == np.int8:
      flat = v.reshape(-1)
      at = rng.choice(flat.size, 20, replace=False)
      flat[at] = np.clip(flat[at].astype(np.int16) + 1, -127, 127).astype(np.int8)
  update = sync.encode(base, target, "int8", version=1)
  modes = {m.mode for n, m in update.tensors.items() if n.endswith(".scale")}
  assert modes == {"unchanged"} and len(update.packs()) == 1
  assert update.to_bytes() == _general_encode(monkeypatch, base, target, "int8",
                                              version=1).to_bytes()


def test_writable_and_read_only_ends_share_one_compiled_coder_and_applier():
  """A caller's writable ends (np.cumsum's) are taken as the layouts' read-only ones: numba
  compiles each coder once per signature, and a second compile costs seconds."""
  rng = np.random.default_rng(5)
  old, new, ends = _pack(rng, [40_000, 30_000, 31], np.uint16, 0.045)
  read_only = ends.copy()
  read_only.flags.writeable = False
  code = pack_coder._CODERS[16, joint.LISTING[16]]
  applier = pack_coder._APPLIERS[bool(joint.QUAD)]
  got = [pack_coder.encode(old, new, e, False, XXH3) for e in (ends, read_only)]
  assert bytes(got[0][1]) == bytes(got[1][1])
  for e in (ends, read_only):
    out = np.zeros_like(old)
    pack_coder.apply(got[0][0], bytes(got[0][1]), old, out, e, XXH3)
    assert np.array_equal(out, new)
  assert ends.flags.writeable  # the caller's array is left as it was
  assert [str(s[8]) for s in code.signatures] == ["readonly array(int64, 1d, C)"]
  assert all(str(s[5]) == "readonly array(int64, 1d, C)" for s in applier.signatures)
