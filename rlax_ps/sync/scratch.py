"""Per-thread scratch buffers that outlive a call: the codec's temporaries (a pack's
concatenations, a scan's outputs, the joint encoder's streams) reuse them instead of
fresh memory, whose pages cost a fault each (or a 2 MB zeroing each once numpy asks for
huge pages): for a small model that is most of an encode."""

import threading

import numpy as np

KEEP_MAX = 1 << 24  # bytes a buffer may keep between calls; larger requests are one-off
_LOCAL = threading.local()


def buffer(slot: str, n: int, dtype) -> np.ndarray:
  """n elements of dtype from this thread's buffer `slot`; the contents are whatever the
  previous user left. Valid until the next request for the same slot on this thread."""
  dtype = np.dtype(dtype)
  bufs = _LOCAL.__dict__.setdefault("buffers", {})
  nbytes = n * dtype.itemsize
  buf = bufs.get(slot)
  if buf is None or buf.nbytes < nbytes:
    buf = np.empty(max(nbytes, 1), np.uint8)
    if nbytes <= KEEP_MAX:
      bufs[slot] = buf
  return buf[:nbytes].view(dtype)


def release() -> None:
  """Drops this thread's buffers (each keeps up to KEEP_MAX bytes between calls; a thread
  that encodes keeps a few tens of MB for a large model)."""
  _LOCAL.__dict__.pop("buffers", None)
