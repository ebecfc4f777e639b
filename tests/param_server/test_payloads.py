"""Compaction's materialisation of a keyframe and its delta chain."""

import numpy as np
import pytest

from param_server import payloads
from rlax_ps import sync


def _chain(fmt, steps=3):
  """Keyframe and delta blobs of a small model stepped `steps` times, and the last held state."""
  rng = np.random.default_rng(3)
  w = {"a.kernel": rng.standard_normal((300, 256), np.float32) * 0.02,
       "b.kernel": rng.standard_normal((64, 32), np.float32) * 0.02,
       "norm.scale": np.ones(32, np.float32)}
  held = sync.held_state(w, fmt)
  blobs = [sync.encode(None, held, fmt, version=0).to_bytes()]
  for v in range(1, steps + 1):
    w = {k: x - np.float32(1e-4) * np.sign(rng.standard_normal(x.shape)).astype(np.float32)
         for k, x in w.items()}
    new = sync.held_state(w, fmt)
    blobs.append(sync.encode(held, new, fmt, version=v, base_version=v - 1).to_bytes())
    held = new
  return blobs, held


def _reader(blob: bytes, reads: list):
  """read(start, stop) of a stored blob: a new array of those bytes; `reads` records them."""
  def read(start, stop):
    reads.append((start, stop))
    return np.frombuffer(blob[start:stop], np.uint8).copy()
  return read


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_materialize_reads_the_keyframe_a_tensor_at_a_time_and_patches_it_in_place(
    fmt, monkeypatch):
  blobs, want = _chain(fmt)
  calls, reads = [], []
  real_apply = sync.apply

  def spy(base, update, **kw):
    ids = {k: id(v) for k, v in base.items()}
    out = real_apply(base, update, **kw)
    calls.append((kw.get("inplace", False), ids == {k: id(v) for k, v in out.items()}))
    return out

  monkeypatch.setattr(sync, "apply", spy)
  got = payloads.materialize(_reader(blobs[0], reads), len(blobs[0]), blobs[1:])
  assert calls == [(True, True)] * 3  # each delta patched the keyframe's arrays
  header = sync.read_header(blobs[0])
  assert max(stop - start for start, stop in reads) == max(
      m.nbytes for m in header.tensors.values())  # never more than one tensor at a time
  assert sorted(got) == sorted(want)
  for k in want:
    assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), k


def test_materialize_rejects_a_corrupted_keyframe_tensor_or_delta():
  blobs, _ = _chain("bf16", steps=2)
  bad = bytearray(blobs[2])
  bad[-5] ^= 0x21
  with pytest.raises(sync.CodecError):
    payloads.materialize(_reader(blobs[0], []), len(blobs[0]), [blobs[1], bytes(bad)])
  bad = bytearray(blobs[0])
  bad[-5] ^= 0x21  # inside the last tensor: its checksum fails, named
  with pytest.raises(sync.CodecError, match="'norm.scale'.*result checksum mismatch"):
    payloads.materialize(_reader(bytes(bad), []), len(bad), [])
  with pytest.raises(sync.CodecError, match="starts at a keyframe"):
    payloads.materialize(_reader(blobs[1], []), len(blobs[1]), [])


def test_stored_info_reads_only_the_header():
  blobs, _ = _chain("bf16", steps=1)
  reads = []
  info = payloads.read_stored_info(_reader(blobs[1], reads), len(blobs[1]))
  assert (info.version, info.base_version, info.tensors) == (1, 0, None)
  assert max(stop for _, stop in reads) == sync.header_nbytes(blobs[1][:sync.PREFIX_BYTES])


def test_keyframe_parts_are_the_keyframe_and_views_of_the_weights():
  blobs, held = _chain("bf16", steps=1)
  parts = payloads.keyframe_parts(held, "bf16", 1)
  assert b"".join(parts) == sync.encode(None, held, "bf16", version=1).to_bytes()
  assert any(np.shares_memory(np.frombuffer(p, np.uint8), held["a.kernel"]) for p in parts[1:])


def _with_header(blob: bytes, edit) -> bytes:
  """`blob` with its header's fields edited by edit(bytearray) -> bytes-like, compressed
  again, its prefix's length and crc32 made to fit (a well-formed but lying publication)."""
  import zlib

  from rlax_ps.sync import wire
  hlen = wire._PREFIX.unpack(blob[:wire._PREFIX.size])[2]
  start = wire._PREFIX.size
  fields = bytearray(wire._ZSTD.decompressor().decompress(blob[start:start + hlen]))
  head = wire._ZSTD.compressor().compress(bytes(edit(fields)))
  prefix = wire._PREFIX.pack(wire.MAGIC, wire.WIRE_VERSION, len(head), zlib.crc32(head))
  return prefix + head + blob[start + hlen:]


@pytest.mark.parametrize("printed", [False, True])
def test_a_keyframe_whose_section_or_fingerprint_seal_lies_is_refused(printed):
  """The server's keyframe check covers what every worker checks of it: the section seal
  (from_bytes) and, where sealed, the device fingerprints; a keyframe stored with either
  wrong could be applied by no worker, ever."""
  from rlax_ps.sync import wire
  held = sync.held_state({"a.kernel": np.ones((8, 4), np.float32),
                          "b.kernel": np.full((4, 4), 2, np.float32)}, "bf16")
  update = sync.encode(None, held, "bf16", version=0, fingerprints=True)
  blob = update.to_bytes()
  payloads.verify(blob, decode_keyframe=True)  # as sent: good
  header = sync.read_header(blob)
  seal = header.fingerprints if printed else header.sections
  tail = len(wire._seal_bytes(header.fingerprints))  # the last seal (no model given)
  at = -tail if printed else -tail - len(wire._seal_bytes(header.sections))

  def lie(fields):
    fields[at] ^= 1  # the seal's digest's low byte
    return fields

  bad = _with_header(blob, lie)
  assert sync.read_header(bad).fingerprints is not None
  got = (sync.read_header(bad).fingerprints if printed else sync.read_header(bad).sections)
  assert got.digest != seal.digest
  with pytest.raises(sync.CodecError, match="fingerprint mismatch" if printed else
                     "section corrupted"):
    payloads.verify(bad, decode_keyframe=True)


def test_a_header_that_decompresses_past_its_limit_or_past_int64_is_refused():
  """A header stating a huge size was decompressed whole (zstd ignores the output limit
  where the frame states its size); a version past int64 was stored and then broke every
  version RPC for good; a dimension past the limit beside a 0 passed the element count."""
  from rlax_ps.sync import wire
  blob = sync.encode(None, sync.held_state({"a": np.ones((0, 4), np.float32)}, "bf16"),
                     "bf16", version=0).to_bytes()
  huge = _with_header(blob, lambda f: bytes(f) + bytes(wire.MAX_HEADER))
  with pytest.raises(sync.CodecError, match="decompressed, at most"):
    sync.read_header(huge)
  past = _with_header(blob, lambda f: f[:2] + bytes([0x80] * 9 + [0x01]) + f[3:])  # v 2**63
  with pytest.raises(sync.CodecError, match="past int64"):
    sync.read_header(past)

  def wide(fields):  # the dims (0, 4) written (0, 2**62)
    at = bytes(fields).index(b"a") + 3
    assert fields[at - 1:at + 2] == b"\x02\x00\x04"
    return fields[:at + 1] + bytes([0x80] * 8 + [0x40]) + fields[at + 2:]

  with pytest.raises(sync.CodecError, match="has a dimension over"):
    sync.read_header(_with_header(blob, wide))
  with pytest.raises(ValueError, match="version: expected below 2"):
    sync.encode(None, {"a": np.ones(4, np.float32)}, version=1 << 63)
  from rlax_ps.sync.byte_reader import ByteReader
  eleven = ByteReader(bytes([0xFF] * 9 + [0x02]), "v")  # the 65th bit
  with pytest.raises(sync.CodecError, match="varint longer than 64 bits"):
    eleven.varint()
  assert ByteReader(bytes([0xFF] * 9 + [0x01]), "v").varint() == (1 << 64) - 1
