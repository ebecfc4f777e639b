"""One buffer for a whole held state, each pack's members back to back (packs.py).

Held states made here (`held_state` of float weights, `apply`'s new arrays) share one
allocation: a few page faults and huge pages where a buffer per tensor faults on every
4 KB page, and a pack's members form one flat span (`span_of`) that the codec reads and
writes as one array, with no concatenation.

Spares: once no array of an arena is referenced, its memory is kept (the SPARES most
recently freed) for the next arena of the same size, as a caching allocator does. A worker
that applies update after update, dropping each older state, then writes into memory whose
pages are mapped already: a fresh model-sized buffer costs a page fault per page (and the
kernel's zeroing), about a copy of the model. It keeps at most SPARES model-sized buffers
that the process no longer uses; release_spares() hands them back to the system.
"""

import math
import threading
import weakref

import numpy as np

from rlax_ps.sync import packs
from rlax_ps.sync.bits import UINT_OF

ALIGN = 64
SPARES = 2  # freed arenas' buffers kept for reuse (most recent first)
_SPARES: list[tuple[np.ndarray, int]] = []  # (buffer, its address)
_SPARES_LOCK = threading.RLock()  # re-entrant: a finalizer may run inside a locked block
# id(a pack's first array) -> (its span, weak references to its arrays): see register.
_PACKS: dict[int, tuple] = {}


class Arena:
  """A buffer handed out piece by piece (each piece ALIGN-byte aligned); the arrays it
  returns share it, and it becomes a spare (see above) once none of them is referenced."""

  def __init__(self, pieces):
    """pieces: the (elements, dtype) of every take() to come."""
    raw, address = _spare(sum(_aligned(n, d) for n, d in pieces) + ALIGN)
    owner = _Owner(raw.size, address)
    weakref.finalize(owner, _keep_spare, raw, address).atexit = False
    self._buf = np.asarray(owner)  # views of it have owner as their base
    self._pos = -address % ALIGN

  def take(self, size: int, dtype: np.dtype) -> np.ndarray:
    """The next `size` elements, as a flat array of dtype's unsigned type."""
    part = self._buf[self._pos:self._pos + size * dtype.itemsize]
    self._pos += _aligned(size, dtype)
    return part.view(UINT_OF[dtype])


def _aligned(size: int, dtype: np.dtype) -> int:
  return -(-size * dtype.itemsize // ALIGN) * ALIGN


class _Owner:
  """The base object of an arena's arrays (numpy keeps a view's first non-array base, so
  every array cut from the arena references it): it lives exactly as long as some array
  of the arena does, and its finalizer makes the memory a spare."""

  __slots__ = ("__array_interface__", "__weakref__")

  def __init__(self, nbytes: int, address: int):
    self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                "data": (address, False)}


def _spare(nbytes: int) -> tuple[np.ndarray, int]:
  """(a buffer of nbytes, its address): a spare of that size if one is kept, else a new
  one (numpy's .ctypes costs microseconds: the address is read once per buffer)."""
  with _SPARES_LOCK:
    for i in range(len(_SPARES) - 1, -1, -1):
      if _SPARES[i][0].size == nbytes:
        return _SPARES.pop(i)
  raw = np.empty(nbytes, np.uint8)
  return raw, raw.__array_interface__["data"][0]


def _keep_spare(raw: np.ndarray, address: int) -> None:
  """Keeps a freed arena's buffer, dropping the oldest spare past SPARES."""
  with _SPARES_LOCK:
    _SPARES.append((raw, address))
    del _SPARES[:-SPARES or len(_SPARES)]


def release_spares() -> int:
  """Hands the spare buffers back to the system; returns the bytes released. Arrays in
  use are not affected."""
  with _SPARES_LOCK:
    released = sum(raw.size for raw, _ in _SPARES)
    _SPARES.clear()
  return released


def lay_out(sizes: dict, dtypes: dict, groups: dict) -> tuple[dict, dict]:
  """(name -> flat unsigned slot of each tensor in no pack, pack head -> the span its
  members fill back to back (members_of)) in one new arena: first the packs (groups: head
  -> member names, head first), then every other tensor. A pack is written first and
  whole, so its first touches of fresh pages come in order (out of order they cost about
  half a copy of the model more, measured)."""
  members = {n for names in groups.values() for n in names}
  alone = [n for n in sizes if n not in members]
  arena = Arena([(sum(sizes[n] for n in names), dtypes[names[0]]) for names in groups.values()]
                + [(sizes[n], dtypes[n]) for n in alone])
  spans = {head: arena.take(sum(sizes[n] for n in names), dtypes[head])
           for head, names in groups.items()}
  return {n: arena.take(sizes[n], dtypes[n]) for n in alone}, spans


def members_of(span: np.ndarray, shapes: list, dtype: np.dtype) -> list[np.ndarray]:
  """The arrays (of `shapes`, in order, of `dtype`) that lie back to back in `span`."""
  typed, at, out = span.view(dtype), 0, []
  for shape in shapes:
    size = math.prod(shape)
    out.append(typed[at:at + size].reshape(shape))
    at += size
  return out


def held_arena(shapes: dict, dtypes: dict) -> dict:
  """name -> a new array of shapes[name] and dtypes[name], laid out by lay_out with the
  packs a held state of them has (packs.members_by_dtype)."""
  sizes = {n: math.prod(shape) for n, shape in shapes.items()}
  groups = {names[0]: names for names in packs.members_by_dtype(sizes, dtypes).values()}
  slots, spans = lay_out(sizes, dtypes, groups)
  held = {n: s.view(dtypes[n]).reshape(shapes[n]) for n, s in slots.items()}
  for head, names in groups.items():
    arrays = members_of(spans[head], [shapes[n] for n in names], dtypes[head])
    held.update(zip(names, arrays))
    register(arrays, spans[head])
  return {n: held[n] for n in shapes}


def register(members: list[np.ndarray], span: np.ndarray) -> None:
  """Records that the arrays `members` (a pack's, in order) lie back to back in `span`
  (their flat unsigned bits), until the first of them is freed."""
  key = id(members[0])
  _PACKS[key] = (span, tuple(weakref.ref(a) for a in members))
  weakref.finalize(members[0], _PACKS.pop, key, None)


def span_of(members: list[np.ndarray]) -> np.ndarray | None:
  """The span `register` recorded for exactly these arrays (the same objects, in order),
  else None (the caller concatenates). Identity, not addresses: reading an array's
  address costs microseconds in numpy."""
  entry = _PACKS.get(id(members[0]))
  if entry is None or len(entry[1]) != len(members):
    return None
  for ref, a in zip(entry[1], members):
    if ref() is not a:
      return None
  return entry[0]
