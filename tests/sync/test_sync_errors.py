"""Every bad input is a CodecError naming the tensor; fuzzed bytes never crash or lie."""

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlax_ps import sync
from rlax_ps.sync import wire
from rlax_ps.sync.bits import BF16, bit_view
from rlax_ps.sync.integrity import Seal


def make_pair(seed=0, n=1 << 16):  # layer.kernel: a section of its own; the rest: packs
  rng = np.random.default_rng(seed)
  base = {
      "emb.embedding": (rng.standard_normal((16, 32)) * 0.02).astype(BF16),
      "layer.kernel": (rng.standard_normal((32, n // 32)) * 0.02).astype(BF16),
      "norm.scale": np.ones(32, BF16),
  }
  target = {k: v.copy() for k, v in base.items()}
  for v in target.values():
    flat = v.reshape(-1).view(np.uint16)
    flat[rng.choice(flat.size, max(1, flat.size // 20), replace=False)] += 1
  return base, target


@pytest.fixture(scope="module")
def pair():
  base, target = make_pair()
  return base, target, sync.encode(base, target, version=5)


def parts(update):
  """(metas, sections, packs) of an encoder-made update, as wire.build takes them."""
  view = update.to_bytes()
  metas = [(m.name, m.shape, m.dtype, wire.MODES.index(m.mode)) for m in update.tensors.values()]
  sections = [view[m.offset:m.offset + m.nbytes] for m in update.tensors.values()]
  packs = {d: view[at:at + n] for d, (at, n) in update.header.packs.items()}
  return metas, sections, packs


def rebuild(update, sections=None, packs=None):
  """The message of an encoder-made `update` with some sections (name -> bytes) or packs
  replaced and the section seal made valid; the result and base seals are kept."""
  metas, old_sections, old_packs = parts(update)
  sections = [(sections or {}).get(m[0], s) for m, s in zip(metas, old_sections)]
  names = list(update.tensors)
  return wire.build(update.fmt, update.version, update.base_version, metas, sections,
                    {**old_packs, **(packs or {})}, [update.checksums[n] for n in names],
                    None if update.is_keyframe else [update.base_checksums[n] for n in names],
                    None).to_bytes()


def raises_naming(name, fn, *words):
  with pytest.raises(sync.CodecError) as err:
    fn()
  msg = str(err.value)
  assert repr(name) in msg, msg
  for w in words:
    assert w in msg, msg


@pytest.mark.parametrize("inplace", [False, True])
def test_wrong_base_content_names_the_tensor_and_inplace_writes_nothing(pair, inplace):
  base, _, update = pair
  for name in base:  # a packed and a sectioned tensor
    wrong = {k: v.copy() for k, v in base.items()}
    bit_view(wrong[name])[7] ^= 0x10
    before = {k: v.copy() for k, v in wrong.items()}
    raises_naming(name, lambda: sync.apply(wrong, update, inplace=inplace), "wrong base")
    assert all(np.array_equal(bit_view(wrong[k]), bit_view(before[k])) for k in base)


def test_wrong_bases_in_several_tensors_are_listed_as_suspects(pair):
  base, _, update = pair
  wrong = {k: v.copy() for k, v in base.items()}
  for name in ("emb.embedding", "norm.scale"):
    bit_view(wrong[name])[0] ^= 1
  with pytest.raises(sync.CodecError, match="wrong base") as err:
    sync.apply(wrong, update, inplace=True)
  assert "'emb.embedding'" in str(err.value) and "'norm.scale'" in str(err.value)


def test_wrong_base_version_shape_dtype_and_names_are_rejected(pair):
  base, _, update = pair
  with pytest.raises(sync.CodecError, match="wrong base version: update applies to 4, base is 3"):
    sync.apply(base, update, base_version=3)
  with pytest.raises(sync.CodecError, match="wrong base version: update applies to 4, base is 5"):
    sync.apply(base, update, base_version=5)  # newer is no better
  raises_naming("norm.scale", lambda: sync.apply(dict(base, **{"norm.scale": np.ones(31, BF16)}),
                                                 update), "[32]")
  raises_naming("norm.scale", lambda: sync.apply(
      dict(base, **{"norm.scale": np.ones(32, np.float32)}), update), "bfloat16")
  raises_naming("norm.scale", lambda: sync.apply(
      {k: v for k, v in base.items() if k != "norm.scale"}, update), "missing")
  raises_naming("extra", lambda: sync.apply(dict(base, extra=np.ones(2, BF16)), update),
                "not in the update")
  with pytest.raises(sync.CodecError, match="a base is required"):
    sync.apply(None, update)
  raises_naming("nope", lambda: update.changes("nope"), "not in this update")


def test_a_corrupted_section_is_named_on_parse(pair):
  _, _, update = pair
  meta = update.tensors["layer.kernel"]
  data = bytearray(update.to_bytes())
  data[meta.offset + meta.nbytes // 2] ^= 0x40
  raises_naming("layer.kernel", lambda: sync.Update.from_bytes(bytes(data), pair[0]),
                "section corrupted")
  raises_naming("#1", lambda: sync.Update.from_bytes(bytes(data)), "section corrupted")  # unbound
  pack_at, _ = update.header.packs[BF16]
  data = bytearray(update.to_bytes())
  data[pack_at + 3] ^= 0x01
  raises_naming("bfloat16 pack", lambda: sync.Update.from_bytes(bytes(data), pair[0]),
                "section corrupted")


def test_sections_forged_behind_a_valid_seal_fail_the_result_check(pair):
  base, target, update = pair
  other = sync.encode(base, make_pair(seed=1)[1], version=5)
  forged = rebuild(update, sections={"layer.kernel": parts(other)[1][1]})
  raises_naming("layer.kernel", lambda: sync.apply(base, sync.Update.from_bytes(forged)),
                "result checksum mismatch")
  forged = rebuild(update, packs={BF16: parts(other)[2][BF16]})
  with pytest.raises(sync.CodecError, match="result checksum mismatch"):
    sync.apply(base, sync.Update.from_bytes(forged))


def test_truncated_and_trailing_bytes_are_rejected(pair):
  _, _, update = pair
  data = update.to_bytes()
  for bad in (data[:-1], data + b"\0", data[:10]):
    with pytest.raises(sync.CodecError, match="truncated|trailing"):
      sync.read_header(bad)


@pytest.mark.parametrize("version", [1, 2, 3, 5])
def test_other_wire_versions_are_rejected_clearly(pair, version):
  data = bytearray(pair[2].to_bytes())
  data[4:6] = struct.pack("<H", version)
  with pytest.raises(sync.CodecError, match=f"wire format version {version} is not supported: "
                                            f"this reader reads version 4 only"):
    sync.Update.from_bytes(bytes(data))


def test_bad_magic_crc_and_flags_are_rejected(pair):
  data = pair[2].to_bytes()
  with pytest.raises(sync.CodecError, match="magic"):
    sync.read_header(b"RLXQ" + data[4:])  # another magic
  hlen = struct.unpack("<I", data[6:10])[0]
  bad = bytearray(data)
  bad[14 + hlen // 2] ^= 1
  with pytest.raises(sync.CodecError, match="crc32"):
    sync.read_header(bytes(bad))
  fields = bytearray(wire._ZSTD.decompressor().decompress(data[14:14 + hlen]))  # noqa: SLF001
  fields[1] |= 0x80
  header = wire._ZSTD.compressor().compress(bytes(fields))  # noqa: SLF001
  with pytest.raises(sync.CodecError, match="unknown flags"):
    sync.read_header(struct.pack("<4sHII", b"RLXW", 4, len(header), zlib.crc32(header)) + header
                     + data[14 + hlen:])


def test_read_header_reports_versions_metas_and_packs_without_payloads(pair):
  base, _, update = pair
  assert sync.read_header(update.to_bytes()).tensors is None  # a delta names its tensors by its base
  header = sync.read_header(memoryview(update.to_bytes()), base)
  assert (header.version, header.base_version, header.fmt, header.is_keyframe) == (5, 4, "bf16", False)
  assert {n: (m.shape, m.dtype, m.mode) for n, m in header.tensors.items()} == {
      "emb.embedding": ((16, 32), BF16, "packed"), "layer.kernel": ((32, 2048), BF16, "sparse"),
      "norm.scale": ((32,), BF16, "packed")}
  assert header.nbytes == update.nbytes and set(header.packs) == {BF16}
  keyframe = sync.read_header(sync.encode(None, base, version=0).to_bytes())
  assert keyframe.is_keyframe and keyframe.bases is None and not keyframe.packs


def test_bad_arguments_name_the_field(pair):
  base, target, _ = pair
  for kwargs, words in [(dict(fmt="fp8"), "fmt"), (dict(base_version=3), "base_version"),
                        (dict(base_checksums={}), "base_checksums")]:
    with pytest.raises(ValueError, match=words):
      sync.encode(None, target, version=1, **kwargs)
  with pytest.raises(ValueError, match="versions must satisfy"):
    sync.encode(base, target, version=3, base_version=3)
  with pytest.raises(ValueError, match="target"):
    sync.encode(None, {}, version=0)
  raises_naming("norm.scale", lambda: sync.encode(
      base, target, version=1, base_checksums={"emb.embedding": 1, "layer.kernel": 2}), "missing")
  for bad in (-1, 1 << 64, "12", 1.5, True, None):
    raises_naming("norm.scale", lambda: sync.encode(base, target, version=1, base_checksums={
        "emb.embedding": 1, "layer.kernel": 2, "norm.scale": bad}), "base_checksums expected a u64")
  with pytest.raises(ValueError, match="base_checksums expected a dict"):
    sync.encode(base, target, version=1, base_checksums=[1, 2, 3])
  raises_naming("x", lambda: sync.encode(None, {"x": np.arange(3)}, version=0), "floating")
  with pytest.raises(TypeError, match="Update"):
    sync.apply(base, b"bytes")



def test_bad_versions_and_non_dicts_name_the_argument(pair):
  """A float or str version (a TypeError deep in the varint writer before) and a list of
  arrays for a dict (an AttributeError) are ValueErrors naming the argument; numpy ints
  are ints."""
  base, target, _ = pair
  for bad in (1.5, "1", True):
    with pytest.raises(ValueError, match="version expected an int"):
      sync.encode(None, target, version=bad)
  with pytest.raises(ValueError, match="base_version expected an int"):
    sync.encode(base, target, version=2, base_version=1.0)
  with pytest.raises(ValueError, match="target expected a dict"):
    sync.encode(None, list(target.values()), version=0)
  with pytest.raises(ValueError, match="base expected a dict"):
    sync.encode(list(base.values()), target, version=1)
  assert sync.encode(base, target, version=np.int64(2)).base_version == 1

def test_wrong_base_checksums_never_give_wrong_weights(pair):
  base, target, _ = pair
  target = dict(target, **{"norm.scale": base["norm.scale"]})  # one tensor unchanged
  lying = sync.encode(base, target, version=5,
                      base_checksums=dict.fromkeys(base, 12345))
  with pytest.raises(sync.CodecError, match="wrong base"):
    sync.apply({k: v.copy() for k, v in base.items()}, lying, inplace=True)
  got = sync.apply(base, sync.Update.from_bytes(lying.to_bytes()))  # copying: results checked
  assert all(np.array_equal(bit_view(got[k]), bit_view(target[k])) for k in target)


@given(data=st.binary(max_size=300))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_bytes_only_raise_codec_error(data, pair):
  for blob in (data, pair[2].to_bytes()[:14] + data):
    with pytest.raises(sync.CodecError):
      sync.Update.from_bytes(blob)


mutations = st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(1, 255)), min_size=1,
                     max_size=4)


@given(ops=mutations)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mutated_messages_raise_codec_error_or_give_the_exact_target(ops, pair):
  base, target, update = pair
  data = bytearray(update.to_bytes())
  for at, x in ops:
    data[at % len(data)] ^= x
  try:
    got = sync.apply(base, sync.Update.from_bytes(bytes(data)))
  except sync.CodecError:
    return
  assert all(np.array_equal(bit_view(got[k]), bit_view(target[k])) for k in target)


@given(ops=mutations, which=st.sampled_from(["layer.kernel", "pack"]))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mutated_sections_behind_valid_digests_never_give_wrong_weights(ops, which, pair):
  base, target, update = pair
  _, sections, packs = parts(update)
  section = bytearray(sections[1] if which == "layer.kernel" else packs[BF16])
  for at, x in ops:
    section[at % len(section)] ^= x
  forged = rebuild(update, **({"sections": {which: bytes(section)}} if which == "layer.kernel"
                              else {"packs": {BF16: bytes(section)}}))
  for inplace in (False, True):
    held = {k: v.copy() for k, v in base.items()}
    try:
      got = sync.apply(held, sync.Update.from_bytes(forged), inplace=inplace)
    except sync.CodecError as e:
      assert "tensor" in str(e) or "pack" in str(e), e
      continue
    assert all(np.array_equal(bit_view(got[k]), bit_view(target[k])) for k in target)


@given(st.data())
def test_one_bad_item_is_the_only_suspect_and_several_are_all_suspects(data):
  n = data.draw(st.integers(2, 70))
  digests = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))
  seal = Seal.of(digests, bits=32)  # no locator collisions (8-bit ones blur 1 in 256)
  assert seal.matches(digests) and len(seal.locators) == 2 * (n - 1).bit_length()
  bad = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=3))
  changed = [d ^ (1 << 7) if i in bad else d for i, d in enumerate(digests)]
  assert not seal.matches(changed)
  suspects = seal.suspects(changed)
  assert set(suspects) >= bad
  if len(bad) == 1:
    assert suspects == [*bad]


def test_a_delta_binds_to_the_layout_it_was_made_for_only(pair):
  base, target, update = pair
  parsed = sync.Update.from_bytes(update.to_bytes())
  with pytest.raises(sync.CodecError, match="bind it first"):
    parsed.changes("norm.scale")
  other = dict(base, **{"norm.scale": np.ones(33, BF16)})
  for wrong in (other, {k: v for k, v in base.items() if k != "norm.scale"}):
    with pytest.raises(sync.CodecError, match="update 5: made for other tensors"):
      sync.apply(wrong, sync.Update.from_bytes(update.to_bytes()))
  assert parsed.bind(base).tensors == update.tensors
  with pytest.raises(sync.CodecError, match="made for other tensors"):
    parsed.bind(other)  # bound already: checked all the same
  got = sync.apply(base, parsed)
  assert all(np.array_equal(bit_view(got[k]), bit_view(target[k])) for k in target)


def test_a_sparse_section_naming_an_index_past_its_tensor_or_no_change_is_refused():
  """The sparse writer does not check bounds (numba): an index == size would write past the
  array, so the section's decode must refuse it, as it must no changes and a gap stream one
  byte past the section."""
  from rlax_ps.sync import sparse
  from rlax_ps.sync.entropy import encode as entropy_encode
  from rlax_ps.sync.errors import CodecError
  from rlax_ps.sync.wire import varint
  u16 = np.dtype(np.uint16)
  idx, off = sparse.decode(sparse.encode(np.array([1, 7]), np.array([3, 5], u16)), 8, u16, "t")
  assert idx.tolist() == [1, 7] and off.tolist() == [3, 5]  # the last element: in bounds
  with pytest.raises(CodecError, match="t gaps: .*exceeds its limit 7"):
    sparse.decode(sparse.encode(np.array([1, 8]), np.array([3, 5], u16)), 8, u16, "t")
  with pytest.raises(CodecError, match="t: 0 changes in a tensor of 8 elements"):
    sparse.decode(varint(0) + varint(0), 8, u16, "t")
  gaps = entropy_encode(np.array([1], np.uint64))
  with pytest.raises(CodecError, match="t: truncated: the gap stream runs past the section"):
    sparse.decode(varint(1) + varint(len(gaps) + 1) + gaps, 8, u16, "t")
