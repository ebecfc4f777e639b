"""Every bad input is a CodecError naming the tensor; fuzzed bytes never crash or lie."""

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlax_ps import sync
from rlax_ps.sync import wire
from rlax_ps.sync.bits import BF16


def make_pair(seed=0, n=1 << 16):  # layer.kernel: a section of its own; the rest: a pack
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


def rebuild(update, sections, header=None):
  """The message of `update` (or of `header`) with some sections replaced and the section
  seal made valid; the result and base seals are kept."""
  data = update.to_bytes()
  sections = [sections.get(name, data[meta.offset:meta.offset + meta.nbytes])
              for name, meta in update.tensors.items()]
  header = (header or update.header)._replace(sections=wire.section_seal(sections))
  return wire.assemble(header, sections).to_bytes()


def raises_naming(name, fn, *words):
  with pytest.raises(sync.CodecError) as err:
    fn()
  msg = str(err.value)
  assert repr(name) in msg, msg
  for w in words:
    assert w in msg, msg


def test_wrong_base_content_names_the_tensor(pair):
  base, _, update = pair
  wrong = dict(base, **{"layer.kernel": base["layer.kernel"].copy()})
  wrong["layer.kernel"].reshape(-1).view(np.uint16)[7] ^= 0x10
  raises_naming("layer.kernel", lambda: sync.apply(wrong, update), "wrong base")


def test_wrong_base_version_is_rejected(pair):
  base, _, update = pair
  with pytest.raises(sync.CodecError, match="wrong base version.*4.*3"):
    sync.apply(base, update, base_version=3)


def test_wrong_shape_and_dtype_name_the_tensor(pair):
  base, _, update = pair
  reshaped = dict(base, **{"emb.embedding": base["emb.embedding"].reshape(32, 16)})
  raises_naming("emb.embedding", lambda: sync.apply(reshaped, update), "shape", "(16, 32)")
  widened = dict(base, **{"norm.scale": base["norm.scale"].astype(np.float32)})
  raises_naming("norm.scale", lambda: sync.apply(widened, update), "dtype", "float32")


def test_missing_and_extra_tensors_are_named(pair):
  base, _, update = pair
  missing = {k: v for k, v in base.items() if k != "norm.scale"}
  raises_naming("norm.scale", lambda: sync.apply(missing, update), "missing")
  raises_naming("extra.bias", lambda: sync.apply(dict(base, **{"extra.bias": base["norm.scale"]}),
                                                 update), "not in the update")
  raises_naming("norm.scale", lambda: sync.encode(missing, pair[1], version=1), "missing")


def test_corrupted_section_names_the_tensor(pair):
  _, _, update = pair
  data = bytearray(update.to_bytes())
  meta = update.tensors["layer.kernel"]
  data[meta.offset + meta.nbytes // 2] ^= 0x01
  raises_naming("layer.kernel", lambda: sync.Update.from_bytes(bytes(data)), "corrupted")


def test_corrupted_section_with_valid_digest_fails_the_checksum(pair):
  _, target, _ = pair
  keyframe = sync.encode(None, target, version=5)
  meta = keyframe.tensors["layer.kernel"]
  section = bytearray(keyframe.to_bytes()[meta.offset:meta.offset + meta.nbytes])
  section[5] ^= 0x01  # one raw bit: decodes fine, yields a wrong element
  forged = sync.Update.from_bytes(rebuild(keyframe, {"layer.kernel": bytes(section)}))
  raises_naming("layer.kernel", lambda: sync.apply(None, forged), "corrupted", "checksum")


def test_truncated_message_names_the_tensor(pair):
  _, _, update = pair
  data = update.to_bytes()
  last = [n for n, m in update.tensors.items() if m.nbytes][-1]  # its section ends the message
  raises_naming(last, lambda: sync.Update.from_bytes(data[:-3]), "truncated")
  with pytest.raises(sync.CodecError, match="header.*truncated"):
    sync.read_header(data[:20])


def test_unknown_section_format_version_names_the_tensor(pair, monkeypatch):
  base, target, _ = pair
  monkeypatch.setattr(wire, "SECTION_CODEC_VERSION", 9)
  data = sync.encode(base, target, version=5).to_bytes()
  monkeypatch.undo()
  raises_naming("emb.embedding", lambda: sync.read_header(data), "unknown section format version 9")


@pytest.mark.parametrize("version", [1, 2, 4])
def test_unknown_wire_version_is_rejected(pair, version):
  _, _, update = pair
  data = bytearray(update.to_bytes())
  data[4] = version  # 1: rANS sections; 2: per-tensor checksums; 4: a future one
  with pytest.raises(sync.CodecError, match=f"unknown wire format version {version}"):
    sync.Update.from_bytes(bytes(data))


def test_read_header_reports_versions_and_metas_without_payloads(pair):
  base, target, update = pair
  data = update.to_bytes()
  cut = min(m.offset for m in update.tensors.values())
  header = sync.read_header(data)
  assert (header.version, header.base_version, header.fmt) == (5, 4, "bf16")
  assert {k: m.shape for k, m in header.tensors.items()} == {k: v.shape for k, v in target.items()}
  # Payload bytes are not decoded: garbage there passes read_header (digests are checked
  # by from_bytes, results by apply).
  garbled = data[:cut] + bytes(len(data) - cut)
  assert sync.read_header(garbled).tensors.keys() == header.tensors.keys()
  with pytest.raises(sync.CodecError, match="corrupted"):
    sync.Update.from_bytes(garbled)


def decode_all(data, base):
  """What a worker does with bytes: parse, apply; returns the result or raises CodecError."""
  return sync.apply(base, sync.Update.from_bytes(data))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_random_bytes_only_raise_codec_error(data, pair):
  with pytest.raises(sync.CodecError):
    decode_all(data, pair[0])
  with pytest.raises(sync.CodecError):
    sync.read_header(data)


mutations = st.lists(st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "cut"]),
                               st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                     min_size=1, max_size=4)


def apply_mutations(data, ops):
  data = bytearray(data)
  for op, where, byte in ops:
    i = int(where * len(data)) if data else 0
    if op == "flip" and data:
      data[i] ^= 1 << (byte % 8)
    elif op == "set" and data:
      data[i] = byte
    elif op == "insert":
      data.insert(i, byte)
    elif op == "delete" and data:
      del data[i]
    elif op == "cut":
      del data[i:]
  return bytes(data)


def exact_or_codec_error(fn, target):
  try:
    out = fn()
  except sync.CodecError:
    return
  for k, v in target.items():
    assert np.array_equal(out[k].view(np.uint16), v.view(np.uint16)), k


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=mutations)
def test_mutated_messages_raise_codec_error_or_give_the_exact_target(ops, pair):
  base, target, update = pair
  data = apply_mutations(update.to_bytes(), ops)
  exact_or_codec_error(lambda: decode_all(data, base), target)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=mutations, which=st.sampled_from(["emb.embedding", "layer.kernel", "norm.scale"]))
def test_mutated_sections_behind_valid_digests_never_give_wrong_weights(ops, which, pair):
  """Forged digests reach the decoders themselves: they must fail cleanly."""
  base, target, update = pair
  meta = update.tensors[which]
  section = apply_mutations(update.to_bytes()[meta.offset:meta.offset + meta.nbytes], ops)
  try:
    data = rebuild(update, {which: section})
  except sync.CodecError:
    return  # e.g. a raw section whose length no longer matches the shape
  exact_or_codec_error(lambda: decode_all(data, base), target)
  try:  # changes() decodes without the result checksum: CodecError or a well-formed answer
    ch = sync.Update.from_bytes(data).changes(which, base[which])
  except sync.CodecError:
    return
  if ch.kind == "sparse":
    assert ch.indices.size == ch.offsets.size == ch.values.size
    assert ch.indices.min() >= 0 and ch.indices.max() < base[which].size


def test_unknown_tensor_name_in_changes_is_named(pair):
  raises_naming("nope", lambda: pair[2].changes("nope"), "not in this update")


def test_bad_arguments_name_the_field(pair):
  base, target, _ = pair
  with pytest.raises(ValueError, match="fmt expected one of"):
    sync.encode(base, target, "fp8", version=1)
  with pytest.raises(ValueError, match=re.escape("base_version=4, version=4")):
    sync.encode(base, target, version=4, base_version=4)
  with pytest.raises(sync.CodecError, match="'x'.*dtype expected a floating type, got int32"):
    sync.encode(None, {"x": np.zeros(3, np.int32)}, version=0)
  for empty_base in (None, {}):
    with pytest.raises(ValueError, match="target: expected at least one tensor"):
      sync.encode(empty_base, {}, version=1 if empty_base is not None else 0)
