"""One buffer for a whole held state, each pack's members back to back (packs.py).

Held states made here (`held_state` of float weights, `apply`'s new arrays) share one
allocation: a few page faults and huge pages where a buffer per tensor faults on every
4 KB page, and a pack's members form one flat span (`span_of`) that the codec reads and
writes as one array, with no concatenation.
"""

import weakref

import numpy as np

from rlax_ps.sync import packs
from rlax_ps.sync.bits import UINT_OF

ALIGN = 64
# id(a pack's first array) -> (its span, weak references to its arrays): see register.
_PACKS: dict[int, tuple] = {}


class Arena:
  """A buffer handed out piece by piece (each piece ALIGN-byte aligned); the arrays it
  returns share it, and it is freed once none of them is referenced."""

  def __init__(self, pieces):
    """pieces: the (elements, dtype) of every take() to come."""
    self._buf = np.empty(sum(_aligned(n, d) for n, d in pieces) + ALIGN, np.uint8)
    self._pos = -self._buf.ctypes.data % ALIGN

  def take(self, size: int, dtype: np.dtype) -> np.ndarray:
    """The next `size` elements, as a flat array of dtype's unsigned type."""
    part = self._buf[self._pos:self._pos + size * dtype.itemsize]
    self._pos += _aligned(size, dtype)
    return part.view(UINT_OF[dtype])


def _aligned(size: int, dtype: np.dtype) -> int:
  return -(-size * dtype.itemsize // ALIGN) * ALIGN


def lay_out(sizes: dict, dtypes: dict, groups: dict) -> tuple[dict, dict]:
  """(name -> flat unsigned slot, pack head -> the span its members fill) in one new
  arena: first each pack's members back to back (groups: head -> member names, head
  first), then every other tensor. A pack is written first and whole, so its first
  touches of fresh pages come in order (out of order they cost about half a copy of the
  model more, measured)."""
  members = {n for names in groups.values() for n in names}
  alone = [n for n in sizes if n not in members]
  arena = Arena([(sum(sizes[n] for n in names), dtypes[names[0]]) for names in groups.values()]
                + [(sizes[n], dtypes[n]) for n in alone])
  slots, spans = {}, {}
  for head, names in groups.items():
    spans[head] = span = arena.take(sum(sizes[n] for n in names), dtypes[head])
    for n, at in zip(names, packs.starts([sizes[n] for n in names])):
      slots[n] = span[at:at + sizes[n]]
  for n in alone:
    slots[n] = arena.take(sizes[n], dtypes[n])
  return {n: slots[n] for n in sizes}, spans


def held_arena(shapes: dict, dtypes: dict) -> dict:
  """name -> a new array of shapes[name] and dtypes[name], laid out by lay_out with the
  packs a held state of them has (packs.members_by_dtype)."""
  sizes = {n: int(np.prod(shape, dtype=np.int64)) for n, shape in shapes.items()}
  groups = {names[0]: names for names in packs.members_by_dtype(sizes, dtypes).values()}
  slots, spans = lay_out(sizes, dtypes, groups)
  held = {n: s.view(dtypes[n]).reshape(shapes[n]) for n, s in slots.items()}
  for head, names in groups.items():
    register([held[n] for n in names], spans[head])
  return held


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
