"""Whole-update seals: one 64-bit digest over many per-item digests, plus a few short group
locators that still name the item that differs.

Items are numbered 0..n-1 in header order. For each bit j < ceil(log2 n) there are two
groups: the items whose index has bit j clear, and those with it set; each group's locator
is the low bits of the combined digest of its members. After the 64-bit digest has detected
a mismatch, an item is a suspect when every group holding it mismatches: one bad item is
then the only suspect (any other item sits in some group without it), several bad items
are all among the suspects, and a colliding locator leaves the bad item out rather than
accusing a good one. 2 * ceil(log2 n) locators cost less than a checksum per item once
n exceeds a handful, which is what keeps a small update's header small.
"""

import ctypes
import functools
import typing

import numpy as np
import xxhash

from rlax_ps.sync import loops


def checksum(array) -> int:
  """xxh3-64 of the array's exact bytes (C order, little-endian held dtype)."""
  if isinstance(array, np.ndarray) and array.ndim and array.flags.c_contiguous:
    return xxhash.xxh3_64_intdigest(array)  # its buffer: no byte view to make
  return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _xxh3_address() -> int:
  """The address of the xxhash package's own XXH3-64 C function (the runtime-dispatched
  SIMD one where it has it), for compiled loops that hash while the bytes are in cache
  (intrinsics.call_hash); 0 where it cannot be found or does not give checksum()'s
  digests (the callers then hash from Python)."""
  from xxhash import _xxhash  # noqa: PLC0415 (the extension module that holds the symbols)
  try:
    lib = ctypes.CDLL(_xxhash.__file__)
  except OSError:
    return 0
  probe = np.arange(4099, dtype=np.uint16).view(np.uint8)  # short and long input paths
  for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
    fn = getattr(lib, name, None)
    if fn is None:
      continue
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    if all(fn(probe.ctypes.data, n) == xxhash.xxh3_64_intdigest(probe[:n])
           for n in (0, 3, 17, 129, 240, 241, probe.size)):
      return ctypes.cast(fn, ctypes.c_void_p).value
  return 0


XXH3 = _xxh3_address()


def combine(digests) -> int:
  """xxh3-64 of the per-item digests as little-endian u64s, in order."""
  return xxhash.xxh3_64_intdigest(np.ascontiguousarray(digests, dtype="<u8"))  # no copy of u64s


def state_digest(checksums) -> int:
  """One digest of a whole held state from its per-tensor checksums (a Mapping name ->
  checksum, e.g. `Update.checksums`), in name order: equal digests, equal states."""
  return combine([int(checksums[name]) for name in sorted(checksums)])


def _index_bits(n: int) -> int:
  return (n - 1).bit_length() if n > 1 else 0


def group_count(n: int) -> int:
  """Number of locators of a seal over n items."""
  return 2 * _index_bits(n)


def _groups(n: int):
  """(bit, side, members) of every group over n items, in locator order."""
  for j in range(_index_bits(n)):
    for side in (0, 1):
      yield j, side, [i for i in range(n) if (i >> j) & 1 == side]


@functools.lru_cache(maxsize=64)
def _group_indices(n: int) -> list[np.ndarray]:
  """The members of each group of _groups(n) as index arrays (the same for every update of
  a model, hence cached)."""
  return [np.array(g, np.int64) for _, _, g in _groups(n)]


class Seal(typing.NamedTuple):
  """A 64-bit digest over n per-item digests and the group locators (`bits` wide each)
  (a tuple: every update makes a few)."""
  digest: int
  locators: tuple[int, ...]
  bits: int

  @classmethod
  def of(cls, digests, bits: int) -> "Seal":
    d = np.array([int(x) for x in digests], "<u8")  # combine's bytes: the array's buffer
    mask = (1 << bits) - 1
    if XXH3:
      words = loops.seal_words(XXH3, d).tolist()
      return cls(words[0], tuple(w & mask for w in words[1:]), bits)
    return cls(xxhash.xxh3_64_intdigest(d), tuple(
        xxhash.xxh3_64_intdigest(d[g]) & mask for g in _group_indices(d.size)), bits)

  def matches(self, digests) -> bool:
    return combine(digests) == self.digest

  def suspects(self, digests) -> list[int]:
    """Indices of the items that may differ, given that the 64-bit digest mismatches."""
    digests = [int(d) for d in digests]
    n, mask = len(digests), (1 << self.bits) - 1
    bad = {(j, side) for (j, side, g), want in zip(_groups(n), self.locators)
           if combine([digests[i] for i in g]) & mask != want}
    return [i for i in range(n) if all((j, (i >> j) & 1) in bad for j in range(_index_bits(n)))]
