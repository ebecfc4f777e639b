"""The server's only contact with the weight codec (`rlax_ps.sync`, numpy only).

Publications are opaque `Update.to_bytes()` blobs; the server reads their
header to validate them and materialises weights only to verify a keyframe's
checksums or to compact a delta chain into a new keyframe.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from rlax_ps import sync
from rlax_ps.sync.fingerprints import fingerprint
from rlax_ps.sync.integrity import check_seal

CodecError = sync.CodecError


@dataclasses.dataclass(frozen=True)
class PayloadInfo:
  """What the server needs to know about one publication, from its header."""
  version: int
  base_version: int | None  # None: a keyframe
  fmt: str
  # name -> (shape, dtype name); None for a delta read without its model's layout
  tensors: dict[str, tuple[tuple[int, ...], str]] | None
  fingerprinted: bool = False  # seals its results' device fingerprints
  # The publishing model's config fields (ModelConfig.forward_fields), where it gave them.
  model: dict | None = None
  results: int = 0  # its results' seal digest: what the next delta's base seal must be
  bases: int | None = None  # a delta's base seal digest: the version it was made from

  @property
  def is_keyframe(self) -> bool:
    return self.base_version is None


def read_info(blob, layout: dict | None = None) -> PayloadInfo:
  """Parses the header of an Update blob (any buffer) without decoding its payloads. A delta
  names its tensors by its model's layout (`layout`: name -> (shape, dtype name), e.g. the
  keyframe's `tensors`); CodecError when it was made for another one."""
  return _info(sync.read_header(blob, layout))


def read_stored_info(read: Callable[[int, int], np.ndarray], nbytes: int) -> PayloadInfo:
  """read_info of a stored blob of `nbytes` bytes, reading only its header through
  `read(start, stop)` (a new array of its bytes [start, stop))."""
  return _info(_stored_header(read, nbytes)[1])


def _stored_header(read, nbytes: int):
  """(the prefix and header bytes, the parsed header) of a stored blob."""
  head = np.asarray(read(0, sync.PREFIX_BYTES))
  head = np.asarray(read(0, sync.header_nbytes(head)))
  return head, sync.read_header(head, nbytes=nbytes)


def _info(header) -> PayloadInfo:
  return PayloadInfo(
      version=int(header.version),
      base_version=None if header.base_version is None else int(header.base_version),
      fmt=str(header.fmt),
      tensors=None if header.tensors is None else {
          name: (tuple(int(d) for d in meta.shape), str(np.dtype(meta.dtype)))
          for name, meta in header.tensors.items()},
      fingerprinted=header.fingerprints is not None, model=header.model,
      results=int(header.results.digest),
      bases=None if header.bases is None else int(header.bases.digest))


def verify(blob, *, decode_keyframe: bool, layout: dict | None = None,
           done: Callable[[int, int], None] | None = None) -> None:
  """Raises CodecError unless the blob (any buffer) is intact.

  A keyframe with `decode_keyframe` is checked in place, one tensor at a time, against its
  result, section and fingerprint seals (what workers check of it) and costs one tensor of
  memory; `done(start, stop)` is told each section's byte range once
  it is read. Anything else goes through `Update.from_bytes`, which copies the blob
  (deltas are small) and checks its section seal; `layout` names a delta's tensors in
  errors, as read_info takes it."""
  header = sync.read_header(blob)
  if decode_keyframe and header.is_keyframe:
    update = sync.Update(blob, header)
    checksums, prints = {}, {}
    for name, meta in header.tensors.items():
      array = update.changes(name).array
      checksums[name] = sync.checksum(array)
      if header.fingerprints is not None:
        prints[name] = fingerprint(array)
      if done is not None and meta.nbytes:
        done(meta.offset, meta.offset + meta.nbytes)
    update.verify_all(checksums)
    # and what every worker checks of it: its section seal (a keyframe's sections are its
    # raw tensors: their digests are the checksums), its device fingerprints where sealed
    check_seal(header.sections, [checksums[n] for n, m in header.tensors.items() if m.nbytes],
               [n for n, m in header.tensors.items() if m.nbytes], "section corrupted")
    if prints:
      update.check_fingerprints(prints)
  else:
    sync.Update.from_bytes(blob, None if header.is_keyframe else layout)


def materialize(read: Callable[[int, int], np.ndarray], nbytes: int, deltas) -> dict[str, np.ndarray]:
  """The weights of a stored keyframe of `nbytes` bytes and the delta blobs after it;
  raises CodecError on a seal mismatch.

  The keyframe is read a tensor at a time through `read(start, stop)` (a new array of its
  bytes [start, stop)) and checked against its result seal; the deltas then patch those
  arrays in place: a chain costs one model of memory and writes only changed elements."""
  head, header = _stored_header(read, nbytes)
  if not header.is_keyframe:
    raise CodecError(f"update {header.version}: a chain starts at a keyframe, got a delta")
  weights = {}
  for name, meta in header.tensors.items():
    raw = np.asarray(read(meta.offset, meta.offset + meta.nbytes))
    weights[name] = (raw if raw.flags.writeable else raw.copy()).view(meta.dtype).reshape(meta.shape)
  sync.Update(head, header).verify_all(weights)
  for blob in deltas:
    weights = sync.apply(weights, sync.Update.from_bytes(blob), inplace=True)
    del blob
  return weights


def keyframe_parts(weights: dict[str, np.ndarray], fmt: str, version: int, *,
                   fingerprints: bool = False, model: dict | None = None) -> list:
  """Materialised weights re-encoded as a keyframe at `version`, as a list of buffers (its
  header, then views of the weights): written out a part at a time, never held twice.
  With `fingerprints` (as the update it replaces had), its results' device fingerprints
  are sealed too, so that workers on accelerators keep checking their weights on device.
  `model`: the replaced update's model fields, carried on so that workers still check them."""
  return sync.keyframe_parts(weights, fmt, version=version,
                             fingerprints=True if fingerprints else None, model=model)
