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


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_materialize_patches_the_keyframe_arrays_in_place_through_the_chain(fmt, monkeypatch):
  blobs, want = _chain(fmt)
  calls = []
  real_apply = sync.apply

  def spy(base, update, **kw):
    out = real_apply(base, update, **kw)
    calls.append((kw.get("inplace", False), {k: id(v) for k, v in out.items()}))
    return out

  monkeypatch.setattr(sync, "apply", spy)
  got = payloads.materialize(blobs)
  assert [inplace for inplace, _ in calls] == [False, True, True, True]
  assert all(ids == calls[0][1] for _, ids in calls)  # the keyframe's arrays, patched
  assert sorted(got) == sorted(want)
  for k in want:
    assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), k


def test_materialize_rejects_a_corrupted_delta():
  blobs, _ = _chain("bf16", steps=2)
  bad = bytearray(blobs[2])
  bad[-5] ^= 0x21
  with pytest.raises(sync.CodecError):
    payloads.materialize(blobs[:2] + [bytes(bad)])
