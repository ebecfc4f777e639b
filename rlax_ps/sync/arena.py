"""One buffer for a whole held state, each pack's members back to back (packs.py).

Held states made here (`held_state` of float weights, `apply`'s new arrays) share one
allocation: a few page faults and huge pages where a buffer per tensor faults on every
4 KB page, and a pack's members form one flat span (`span_of`) that the codec reads and
writes as one array, with no concatenation.

Spares: once no array of an arena is referenced, its memory is kept (at most SPARES of
them) for the next arena of the same size, as a caching allocator does. A worker that
applies update after update, dropping each older state, then writes into memory whose
pages are mapped already: a fresh model-sized buffer costs a page fault per page (and the
kernel's zeroing), about a copy of the model. The KEEP most recently made arenas are
tracked, and one is free when its owner (the base of every array cut from it) has no
reference but the tracker's: a reference count, read when an arena is wanted, where a
finalizer a buffer would cost more than a small model's whole apply takes elsewhere.
release_spares() hands the free buffers back to the system.
"""

import functools
import itertools
import math
import operator
import sys
import threading
import weakref

import numpy as np

from rlax_ps.sync import packs
from rlax_ps.sync.bits import UINT_OF

ALIGN = 64
SPARES = 2  # free arenas' buffers kept for reuse
KEEP = SPARES + 2  # arenas tracked (most recent last), in use or free
# (buffer, owner, the array through it: every view's base, address, bytes) of each tracked
# arena, most recent last
_ARENAS: list[tuple] = []
_ARENAS_LOCK = threading.Lock()
# id(a pack's first array) -> (its span, the pack's other arrays): see register.
_PACKS: dict[int, tuple] = {}
# id(a held state's first array) -> (its names, where its anchor is, its other arrays, a
# weak reference to the anchor, its layout key, its packs' spans): see record_state.
_STATES: dict[int, tuple] = {}
_KEYS: dict[tuple, tuple] = {}  # layout key -> the one equal key object records share


def _aligned(size: int, dtype: np.dtype) -> int:
  return -(-size * dtype.itemsize // ALIGN) * ALIGN


class _Owner:
  """What the arena's own array reads the buffer through (__array_interface__): numpy
  collapses a view's base to that array, the first that owns no data, so every array cut
  from the arena references it, and it is referenced by the tracker alone when none of
  them lives."""

  __slots__ = ("__array_interface__", "raw")

  def __init__(self, raw: np.ndarray, address: int):
    self.raw = raw  # the memory: alive while any array of the arena is, tracked or not
    self.__array_interface__ = {"shape": (raw.size,), "typestr": "|u1", "version": 3,
                                "data": (address, False)}


def _free(entry: tuple) -> bool:
  """Whether no array of a tracked arena lives: its own array (every view's base) is
  referenced by the entry alone (and by the call's argument)."""
  return sys.getrefcount(entry[2]) == 2


def _arena(nbytes: int) -> tuple:
  """A tracked arena of nbytes: a free one of that size (the most recent), else a new one
  (numpy's .ctypes costs microseconds: the address is read once per buffer); the oldest
  are no longer tracked past KEEP, the oldest free ones dropped past SPARES."""
  with _ARENAS_LOCK:
    for i in range(len(_ARENAS) - 1, -1, -1):
      entry = _ARENAS[i]
      if entry[4] == nbytes and _free(entry):
        _ARENAS.append(_ARENAS.pop(i))
        return entry
  raw = np.empty(nbytes, np.uint8)
  address = raw.__array_interface__["data"][0]
  owner = _Owner(raw, address)
  entry = (raw, owner, np.asarray(owner), address, nbytes)  # views of the array: its base
  with _ARENAS_LOCK:
    _ARENAS.append(entry)
    del _ARENAS[:-KEEP]
    free = [i for i, e in enumerate(_ARENAS) if _free(e)]
    for i in reversed(free[:-SPARES or len(free)]):  # by position: entries hold arrays
      del _ARENAS[i]
  return entry


def release_spares() -> int:
  """Hands the free arenas' buffers back to the system; returns the bytes released.
  Arrays in use are not affected."""
  with _ARENAS_LOCK:
    free, kept = [], []
    for entry in _ARENAS:
      (free if _free(entry) else kept).append(entry)
    _ARENAS[:] = kept
  return sum(e[0].size for e in free)


def lay_out(sizes: dict, dtypes: dict, groups: dict) -> tuple[dict, dict]:
  """(name -> flat unsigned slot of each tensor in no pack, pack head -> the span its
  members fill back to back (members_of)) in one new arena: first the packs (groups: head
  -> member names, head first), then every other tensor. A pack is written first and
  whole, so its first touches of fresh pages come in order (page faults out of order cost
  far more)."""
  members = {n for names in groups.values() for n in names}
  alone = [n for n in sizes if n not in members]
  got = spans(tuple((sum(sizes[n] for n in names), dtypes[head])
                    for head, names in groups.items())
              + tuple((sizes[n], dtypes[n]) for n in alone))
  return dict(zip(alone, got[len(groups):])), dict(zip(groups, got))


def spans(pieces: tuple) -> list[np.ndarray]:
  """Flat unsigned arrays of the (elements, dtype) `pieces`, in order in one new arena
  (lay_out's spans, for callers that know their packs' sizes): one array over the arena's
  buffer each."""
  nbytes, plan = _plan(pieces)
  _, _, buf, address, _ = _arena(nbytes)
  at = -address % ALIGN
  return [np.ndarray(shape, dtype, buf, at + offset) for shape, dtype, offset in plan]


@functools.lru_cache(maxsize=64)
def _plan(pieces: tuple) -> tuple[int, tuple]:
  """(an arena's bytes, (shape, unsigned dtype, offset from its first aligned byte) of each
  piece, each ALIGN-byte aligned, in order) for spans(pieces)."""
  plan, at = [], 0
  for n, dtype in pieces:
    plan.append(((n,), np.dtype(UINT_OF[dtype]), at))
    at += _aligned(n, dtype)
  return at + ALIGN, tuple(plan)


def members_of(span: np.ndarray, shapes: list, dtype: np.dtype) -> list[np.ndarray]:
  """The arrays (of `shapes`, in order, of `dtype`) that lie back to back in `span`."""
  shapes = tuple(shapes)
  return cut(span, offsets(shapes, np.dtype(dtype).itemsize), shapes, dtype)


def cut(span: np.ndarray, at: tuple, shapes: tuple, dtype: np.dtype) -> list[np.ndarray]:
  """members_of with the pieces' byte offsets (offsets(shapes, itemsize)) known: one
  numpy call an array (np.ndarray over span's buffer, whose base numpy collapses to the
  arena's own array as a view's), where a slice and a reshape would be two."""
  return list(map(np.ndarray, shapes, itertools.repeat(dtype), itertools.repeat(span), at))


@functools.lru_cache(maxsize=64)
def offsets(shapes: tuple, itemsize: int) -> tuple[int, ...]:
  """The byte offsets of arrays of `shapes` laid back to back."""
  return tuple(piece.start * itemsize for piece in cuts(shapes))


@functools.lru_cache(maxsize=64)
def cuts(shapes: tuple) -> tuple[slice, ...]:
  """The slices of arrays of `shapes` laid back to back."""
  ends = list(itertools.accumulate(map(math.prod, shapes), initial=0))
  return tuple(map(slice, ends[:-1], ends[1:]))


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
  held = {n: held[n] for n in shapes}
  names = tuple(held)
  if names:
    record_state(names, tuple(held.values()), anchor_of(names, groups.values()),
                 tuple(spans.values()))
  return held


def register(members: list[np.ndarray], span: np.ndarray) -> None:
  """Records that the arrays `members` (a pack's, in order) lie back to back in `span`
  (their flat unsigned bits), until the first of them is freed (a weak reference's
  callback: a weakref.finalize costs several times as much). The record holds the others
  (views of the same buffer, alive while the first is) and not the first."""
  key = id(members[0])
  _PACKS[key] = (span, tuple(members[1:]), weakref.ref(members[0], lambda _: _forget(key)))


def _forget(key: int) -> None:
  _PACKS.pop(key, None)


def record_state(names: tuple, values: tuple, at: int, spans: tuple,
                 key: tuple | None = None) -> None:
  """Records a held state made here (its names and arrays, in order) whole: its layout key
  ((name, shape, dtype) per tensor, as codec._held keys a state) and its packs' spans (in
  the order codec's layouts list its packs), so that state_record finds both for a dict of
  these very arrays without reading any array's shape or dtype (each a cache miss or two
  on a heap that training has scattered: tens of microseconds for a small model). The
  record goes when the state's anchor, values[at], is freed: it must be an array no span
  record holds (anchor_of); the record holds the others, which its death then frees.
  key: the state's layout key where the caller knows it (interned()), else read from the
  arrays."""
  if key is None:
    key = interned(tuple((n, a.shape, a.dtype) for n, a in zip(names, values)))
  first = id(values[0])
  ref = weakref.ref(values[at], functools.partial(_forget_state, first))
  _STATES[first] = (names, at, values[:at] + values[at + 1:], ref, key, spans)


def anchor_of(names, groups) -> int:
  """Where the first of `names` lies that is no pack's member but its first (groups: each
  pack's members, head first): what a state's record can hang on (record_state)."""
  held = {n for members in groups for n in members[1:]}
  return next((i for i, n in enumerate(names) if n not in held), 0)  # (0: no names)


def interned(key: tuple) -> tuple:
  """The one object of layout keys equal to `key` (records and codec's layouts share it,
  so that comparing them compares pointers)."""
  if len(_KEYS) >= 64 and key not in _KEYS:
    _KEYS.clear()
  return _KEYS.setdefault(key, key)


def _forget_state(first: int, ref: weakref.ref) -> None:
  entry = _STATES.get(first)
  if entry is not None and entry[3] is ref:  # not a later record under the same id
    del _STATES[first]


def state_record(params: dict) -> tuple | None:
  """(layout key, packs' spans) that record_state recorded for exactly these arrays (the
  same objects, under the same names, in the same order), else None. An array reshaped or
  retyped in place (`a.shape = ...`, which numpy 2.5 deprecates, or `a.dtype = ...`) goes
  unseen: the record keeps the shape and dtype it was made with (the same bytes)."""
  values = tuple(params.values())
  entry = _STATES.get(id(values[0])) if values else None
  if entry is None:
    return None
  names, at, rest, ref, key, spans = entry
  if (len(values) != len(names) or ref() is not values[at] or tuple(params) != names
      or not all(map(operator.is_, rest, values[:at] + values[at + 1:]))):
    return None
  return key, spans


def span_of(members) -> np.ndarray | None:
  """The span `register` recorded for exactly these arrays (a sequence of the same
  objects, in order), else None (the caller concatenates). Identity, not addresses: reading
  an array's address costs microseconds in numpy; the first is the record's key (its
  record goes when it is freed)."""
  entry = _PACKS.get(id(members[0]))
  if entry is None or len(entry[1]) != len(members) - 1:
    return None
  return entry[0] if all(map(operator.is_, entry[1], members[1:])) else None
