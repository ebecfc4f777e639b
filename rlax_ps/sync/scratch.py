"""Per-thread scratch buffers that outlive a call: the codec's temporaries (a pack's
concatenations, a scan's outputs, the joint encoder's streams) reuse them instead of
fresh memory, whose pages cost a fault each (or a 2 MB zeroing each once numpy asks for
huge pages): for a small model that is most of an encode."""

import threading
import weakref

import numpy as np

KEEP_MAX = 1 << 24  # bytes a buffer may keep between calls; larger requests are one-off
_LOCAL = threading.local()
# (thread, its buffers) of every live thread that has some: release(all_threads=True)
# reaches the codec's pool threads too; finished threads' entries go when a thread
# registers and on release(all_threads=True).
_ALL: list[tuple[weakref.ref, dict]] = []
_LOCK = threading.Lock()


def buffer(slot: str, n: int, dtype) -> np.ndarray:
  """n elements of dtype from this thread's buffer `slot`; the contents are whatever the
  previous user left. Valid until the next request for the same slot on this thread."""
  dtype = np.dtype(dtype)
  bufs = _LOCAL.__dict__.get("buffers")
  if bufs is None:
    bufs = _LOCAL.buffers = {}
    with _LOCK:
      _prune()
      _ALL.append((weakref.ref(threading.current_thread()), bufs))
  nbytes = n * dtype.itemsize
  buf = bufs.get(slot)
  if buf is None or buf.nbytes < nbytes:
    buf = np.empty(max(nbytes, 1), np.uint8)
    if nbytes <= KEEP_MAX:
      bufs[slot] = buf
  return buf[:nbytes].view(dtype)


def raw(slot: str, nbytes: int) -> np.ndarray:
  """This thread's uint8 buffer `slot`, whole and of at least nbytes (contents as buffer()'s):
  for a compiled call that cuts its own pieces, where each numpy step (a dtype, a slice, a
  view) costs microseconds when the caches are cold."""
  kept = _LOCAL.__dict__.get("buffers", _NONE).get((slot, "raw"))
  if kept is not None and kept[0] >= nbytes:
    return kept[1]
  buf = buffer(slot, nbytes, np.uint8)
  if nbytes <= KEEP_MAX:
    _LOCAL.buffers[(slot, "raw")] = (nbytes, buf)  # with the buffers: release() drops it too
  return buf


_NONE: dict = {}


def buffers(slot: str, specs: tuple) -> tuple:
  """buffer() of each (n, dtype) of `specs`, in slots of their own under `slot`, as one
  tuple: while a thread asks for the same specs again, the same arrays (one lookup, where
  a compiled call takes several buffers at once). Valid until the next request for `slot`
  on this thread."""
  bufs = _LOCAL.__dict__.get("buffers")
  kept = None if bufs is None else bufs.get((slot,))
  if kept is not None and (kept[0] is specs or kept[0] == specs):
    return kept[1]
  arrays = tuple(buffer(f"{slot} {i}", n, dtype) for i, (n, dtype) in enumerate(specs))
  _LOCAL.buffers[(slot,)] = (specs, arrays)  # with the buffers: release() drops it too
  return arrays


def release(all_threads: bool = False) -> None:
  """Drops this thread's buffers (each keeps up to KEEP_MAX bytes between calls; a thread
  that encodes keeps a few tens of MB for a large model), or with all_threads every
  thread's, the encode/apply pool's included: call it while no encode or apply runs."""
  if not all_threads:
    _LOCAL.__dict__.get("buffers", {}).clear()
    return
  with _LOCK:
    _prune()
    for _, bufs in _ALL:
      bufs.clear()


def _prune() -> None:
  """Forgets the buffers of finished threads (the caller holds _LOCK)."""
  _ALL[:] = [(t, b) for t, b in _ALL if t() is not None and t().is_alive()]
