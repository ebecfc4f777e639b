"""The server's only contact with the weight codec (`rlax_ps.sync`, numpy only).

Publications are opaque `Update.to_bytes()` blobs; the server reads their
header to validate them and materialises weights only to verify a keyframe's
checksums or to compact a delta chain into a new keyframe.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from rlax_ps import sync

CodecError = sync.CodecError


@dataclasses.dataclass(frozen=True)
class PayloadInfo:
  """What the server needs to know about one publication, from its header."""
  version: int
  base_version: int | None  # None: a keyframe
  fmt: str
  # name -> (shape, dtype name)
  tensors: dict[str, tuple[tuple[int, ...], str]]

  @property
  def is_keyframe(self) -> bool:
    return self.base_version is None


def read_info(blob: bytes) -> PayloadInfo:
  """Parses the header of an Update blob without decoding its payloads."""
  header = sync.read_header(blob)
  return PayloadInfo(
      version=int(header.version),
      base_version=None if header.base_version is None else int(header.base_version),
      fmt=str(header.fmt),
      tensors={name: (tuple(int(d) for d in meta.shape), str(np.dtype(meta.dtype)))
               for name, meta in header.tensors.items()})


def verify(blob: bytes, *, decode_keyframe: bool) -> None:
  """Checks every section's digest; with `decode_keyframe`, also checks a keyframe's weight checksums.

  Decodes one tensor at a time, so checking costs one tensor of memory, not a model."""
  update = sync.Update.from_bytes(blob)
  if decode_keyframe and update.is_keyframe:
    for name in update.tensors:
      update.verify(name, update.changes(name).array)


def materialize(blobs) -> dict[str, np.ndarray]:
  """Applies a keyframe blob and the delta blobs after it; raises CodecError on a checksum mismatch."""
  weights = None
  for blob in blobs:
    weights = sync.apply(weights, sync.Update.from_bytes(blob))
  return weights


def encode_keyframe(weights: dict[str, np.ndarray], fmt: str, version: int) -> bytes:
  """Re-encodes materialised weights as a keyframe blob at `version`."""
  return sync.encode(None, weights, fmt, version=version).to_bytes()
