"""Whole-update seals: 64-bit detection, errors that still name the tensor, small headers."""


import collections.abc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_ps import sync
from rlax_ps.sync import integrity, wire
from rlax_ps.sync.bits import BF16

N_TENSORS = 24


def make_model(seed=0):
  """Many small tensors; the target changes one element in most of them."""
  rng = np.random.default_rng(seed)
  base = {f"block{i:02d}.w": (rng.standard_normal((4, 8)) * 0.02).astype(BF16)
          for i in range(N_TENSORS)}
  target = {k: v.copy() for k, v in base.items()}
  for i, v in enumerate(target.values()):
    if i % 5:
      v.reshape(-1).view(np.uint16)[i % v.size] += 1
  return base, target


@pytest.fixture(scope="module")
def model():
  base, target = make_model()
  return base, target, sync.encode(base, target, version=3)


def sections_of(update):
  data = update.to_bytes()
  return [data[m.offset:m.offset + m.nbytes] for m in update.tensors.values()]


def reassembled(update, **header_changes):
  header = update.header._replace(**header_changes)
  return sync.Update.from_bytes(wire.assemble(header, sections_of(update)).to_bytes())


def error_of(fn) -> str:
  with pytest.raises(sync.CodecError) as err:
    fn()
  return str(err.value)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_one_bad_item_is_the_only_suspect_and_several_are_all_suspects(data):
  n = data.draw(st.integers(1, 80))
  digests = data.draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))
  bad = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n))
  seal = integrity.Seal.of(digests, bits=32)  # wide locators: no collision in a test's life
  got = [d ^ (1 << 7) if i in bad else d for i, d in enumerate(digests)]
  assert seal.matches(digests) and not seal.matches(got)
  suspects = seal.suspects(got)
  assert bad <= set(suspects)
  if len(bad) == 1:
    assert suspects == sorted(bad)
  assert len(seal.locators) <= 2 * n.bit_length()  # logarithmic in n


def test_a_corrupted_result_in_one_tensor_names_it(model):
  _, target, update = model
  name = "block07.w"
  wrong = dict(target, **{name: target[name].copy()})
  wrong[name].reshape(-1).view(np.uint16)[3] ^= 0x4
  msg = error_of(lambda: update.verify_all(wrong))
  assert msg.startswith(f"tensor {name!r}: corrupted") and "checksum" in msg
  # the same through apply: a keyframe whose raw section was altered behind a valid seal
  keyframe = sync.encode(None, target, version=3)
  sections = sections_of(keyframe)
  index = list(keyframe.tensors).index(name)
  sections[index] = bytes([sections[index][0] ^ 1]) + sections[index][1:]
  forged = wire.assemble(keyframe.header._replace(sections=wire.section_seal(sections)),
                         sections)
  msg = error_of(lambda: sync.apply(None, sync.Update.from_bytes(forged.to_bytes())))
  assert msg.startswith(f"tensor {name!r}: corrupted")


def test_verify_all_takes_checksums_or_arrays_and_names_what_is_missing(model):
  _, target, update = model
  mixed = {k: sync.checksum(v) if i % 2 else v for i, (k, v) in enumerate(target.items())}
  update.verify_all(mixed)
  del mixed["block03.w"]
  assert "'block03.w'" in error_of(lambda: update.verify_all(mixed))


@pytest.mark.parametrize("name", ["block05.w", "block06.w"])  # unchanged, changed
@pytest.mark.parametrize("inplace", [False, True])
def test_a_wrong_base_in_one_tensor_names_it_and_writes_nothing(model, name, inplace):
  base, _, update = model
  wrong = {k: v.copy() for k, v in base.items()}
  wrong[name].reshape(-1).view(np.uint16)[-1] ^= 0x100
  before = {k: v.copy() for k, v in wrong.items()}
  msg = error_of(lambda: sync.apply(wrong, update, inplace=inplace))
  assert msg.startswith(f"tensor {name!r}: wrong base"), msg
  assert all(np.array_equal(wrong[k].view(np.uint16), before[k].view(np.uint16)) for k in base)


def test_a_wrong_base_in_several_tensors_lists_them_as_suspects(model):
  base, _, update = model
  wrong = {k: v.copy() for k, v in base.items()}
  for name in ("block01.w", "block02.w"):
    wrong[name].reshape(-1).view(np.uint16)[0] ^= 0x1
  msg = error_of(lambda: sync.apply(wrong, update, inplace=True))
  assert msg.startswith("wrong base") and "'block01.w'" in msg and "'block02.w'" in msg


@pytest.mark.parametrize("seal", ["results", "bases"])
def test_a_digest_mismatch_that_no_locator_sees_is_a_clear_error(model, seal):
  base, _, update = model
  old = getattr(update.header, seal)
  forged = reassembled(update, **{seal: old._replace(digest=old.digest ^ 1)})
  msg = error_of(lambda: sync.apply(base, forged, inplace=seal == "bases"))
  assert "no locator mismatches" in msg and f"{N_TENSORS} tensors" in msg
  assert "'block00.w'" in msg  # the suspects are listed
  assert ("wrong base" if seal == "bases" else "corrupted") in msg


def test_a_corrupted_section_seal_locator_is_named_on_parse(model):
  _, _, update = model
  data = bytearray(update.to_bytes())
  name = next(n for n, m in update.tensors.items() if m.nbytes)  # the pack's head
  meta = update.tensors[name]
  data[meta.offset] ^= 0x20
  msg = error_of(lambda: sync.Update.from_bytes(bytes(data)))
  assert msg.startswith(f"tensor '{name}': section corrupted")


def test_a_many_tensor_small_update_has_a_header_below_the_old_checksums_alone(model):
  """Version 2 spent, per tensor, a u64 result checksum, a u32 base checksum (changed
  tensors) and a u8 section locator, whatever else the header held."""
  _, _, update = model
  header = update.nbytes - sum(m.nbytes for m in update.tensors.values())
  changed = sum(m.mode != "unchanged" for m in update.tensors.values())
  assert header < 8 * N_TENSORS + (4 + 1) * changed
  seal_bytes = 3 * 8 + (integrity.group_count(N_TENSORS) * 2
                        + integrity.group_count(changed)) * wire.LOCATOR_BITS // 8
  assert seal_bytes < 8 * N_TENSORS / 2  # and the seals grow with log(n), not n


def test_version_2_messages_are_rejected_by_name(model):
  data = bytearray(model[2].to_bytes())
  data[4] = 2
  msg = error_of(lambda: sync.read_header(bytes(data)))
  assert "unknown wire format version 2" in msg and "per-tensor checksums" in msg


def mixed_model(seed=0):
  """A pack of small tensors plus a joint-sized and a sparse-sized tensor."""
  rng = np.random.default_rng(seed)
  base = {f"small{i}.w": (rng.standard_normal(300) * 0.02).astype(BF16) for i in range(4)}
  base["mid.w"] = (rng.standard_normal(1 << 17) * 0.02).astype(BF16)
  base["big.w"] = (rng.standard_normal(1 << 20) * 0.02).astype(BF16)
  target = {k: v.copy() for k, v in base.items()}
  for k, v in target.items():
    flat = v.view(np.uint16)
    flat[rng.choice(flat.size, max(2, flat.size // 20), replace=False)] += np.uint16(1)
  return base, target


@pytest.fixture(scope="module")
def mixed():
  base, target = mixed_model()
  keyframe = sync.encode(None, base, version=0)
  return base, target, keyframe, sync.encode(base, target, version=1)


def test_an_encoded_update_knows_its_result_checksums_and_a_parsed_one_does_not(mixed):
  base, target, keyframe, delta = mixed
  assert {m.mode for m in delta.tensors.values()} >= {"joint", "sparse", "packed"}
  for update, want in ((keyframe, base), (delta, target)):
    assert update.checksums == {k: integrity.checksum(v) for k, v in want.items()}
    update.verify_all(update.checksums)
    assert sync.Update.from_bytes(update.to_bytes()).checksums is None


def test_base_checksums_from_the_previous_update_give_the_same_bytes(mixed):
  base, target, keyframe, delta = mixed
  again = sync.encode(base, target, version=1, base_checksums=keyframe.checksums)
  assert again.to_bytes() == delta.to_bytes()
  # A delta's base seal is the seal its base's update made over its results (Seal.of keeps
  # the last few); a parsed header holds the same seals.
  assert delta.header.bases == keyframe.header.results
  assert sync.read_header(delta.to_bytes()).bases == keyframe.header.results
  digests = list(keyframe.checksums.values())
  assert integrity.Seal.of(digests, 8) == integrity.Seal.of(np.array(digests, np.uint64), 8)
  assert integrity.Seal.of(digests[::-1], 8).digest != integrity.Seal.of(digests, 8).digest


def test_wrong_base_checksums_never_give_wrong_weights(mixed):
  """An in-place apply checks the base seal first and refuses; a copying apply checks only
  its results, which are right (the delta was made from the true base)."""
  base, target, keyframe, _ = mixed
  wrong = dict(keyframe.checksums, **{"mid.w": keyframe.checksums["mid.w"] ^ 1})
  update = sync.encode(base, target, version=1, base_checksums=wrong)
  held = {k: v.copy() for k, v in base.items()}
  with pytest.raises(sync.CodecError, match="'mid.w': wrong base"):
    sync.apply(held, update, inplace=True)
  out = sync.apply(held, update)
  for k in base:  # nothing written in place; the copies are exact
    assert np.array_equal(held[k].view(np.uint16), base[k].view(np.uint16)), k
    assert np.array_equal(out[k].view(np.uint16), target[k].view(np.uint16)), k


def test_base_checksums_must_name_every_tensor_and_need_a_base(mixed):
  base, target, keyframe, _ = mixed
  partial = {k: v for k, v in keyframe.checksums.items() if k != "big.w"}
  with pytest.raises(sync.CodecError, match="'big.w': missing from the base_checksums"):
    sync.encode(base, target, version=1, base_checksums=partial)
  with pytest.raises(ValueError, match="base_checksums"):
    sync.encode(None, target, version=1, base_checksums=keyframe.checksums)


def test_an_encoders_checksums_are_a_read_only_mapping_that_encode_reads_as_a_column(mixed):
  base, target, keyframe, delta = mixed
  sums = keyframe.checksums
  assert isinstance(sums, collections.abc.Mapping) and not isinstance(sums, dict)
  want = {k: integrity.checksum(v) for k, v in base.items()}
  assert sums == want and dict(sums) == want and list(sums) == list(base)
  assert sums["mid.w"] == want["mid.w"] and len(sums) == len(want)
  assert not sums.column.flags.writeable and sums.column.dtype == np.uint64
  with pytest.raises(KeyError):
    sums["nope"]
  # the column as it is, a dict of the same values, and one listed in another order: the
  # same bytes
  reordered = dict(reversed(list(want.items())))
  for given in (sums, want, reordered):
    again = sync.encode(base, target, version=1, base_checksums=given)
    assert again.to_bytes() == delta.to_bytes()
  assert isinstance(again.checksums, wire.Checksums)
  with pytest.raises(ValueError, match="3 names for 2 values"):
    wire.Checksums(("a", "b", "c"), np.zeros(2, np.uint64))


@pytest.mark.parametrize("value", [-1, 1 << 64, "12", 1.5, True, None])
def test_a_base_checksum_that_is_not_a_u64_is_named(mixed, value):
  base, target, keyframe, _ = mixed
  given = dict(keyframe.checksums, **{"mid.w": value})
  with pytest.raises(sync.CodecError, match=r"'mid.w': base checksum expected an int"):
    sync.encode(base, target, version=1, base_checksums=given)


def test_base_checksums_that_are_not_a_mapping_are_refused(mixed):
  base, target, keyframe, _ = mixed
  with pytest.raises(ValueError, match="base_checksums: expected a mapping"):
    sync.encode(base, target, version=1, base_checksums=list(keyframe.checksums.values()))


def test_checksum_is_the_xxh3_of_the_exact_held_bytes_whatever_the_array_layout():
  import xxhash  # noqa: PLC0415
  rng = np.random.default_rng(5)
  w = (rng.standard_normal((6, 10)) * 0.02).astype(BF16)
  want = xxhash.xxh3_64_intdigest(w.tobytes())
  assert integrity.checksum(w) == want
  assert integrity.checksum(w.view(np.uint16)) == want  # its unsigned bit view
  assert integrity.checksum(np.asfortranarray(w)) == want  # C order, whatever the memory
  assert integrity.checksum(w.T.T) == want
  codes = rng.integers(-127, 128, (4, 9), dtype=np.int8)
  assert integrity.checksum(codes) == xxhash.xxh3_64_intdigest(codes.tobytes())
  strided = codes[:, ::2]
  assert integrity.checksum(strided) == xxhash.xxh3_64_intdigest(strided.tobytes())
  scalar = np.array(1.5, BF16)
  assert integrity.checksum(scalar) == xxhash.xxh3_64_intdigest(scalar.tobytes())
  assert integrity.checksum(w) != integrity.checksum(w[::-1])
