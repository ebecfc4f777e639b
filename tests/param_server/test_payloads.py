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
