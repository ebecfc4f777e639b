"""Checksums and whole-update seals: one 64-bit digest over many per-item digests, plus a
few short group locators that still name the item that differs.

Items are numbered 0..n-1 in header order. For each bit j < ceil(log2 n) there are two
groups: the items whose index has bit j clear, and those with it set; each group's locator
is the low bits of the combined digest of its members. Once the 64-bit digest has detected
a mismatch, an item is a suspect when every group holding it mismatches: one bad item is
then the only suspect, several bad items are all among the suspects, and a colliding
locator leaves the bad item out rather than accusing a good one. 2 ceil(log2 n) one-byte
locators cost less than a checksum per item once n exceeds a handful.
"""

import functools
import typing

import numpy as np
import xxhash

from rlax_ps.sync.errors import CodecError

LOCATOR_BITS = 8


def checksum(array) -> int:
  """xxh3-64 of the array's exact bytes (C order, little-endian held dtype)."""
  a = np.asarray(array)
  if not (a.ndim and a.flags.c_contiguous):
    a = np.ascontiguousarray(a).reshape(-1)
  return xxhash.xxh3_64_intdigest(a.view(np.uint8))


def combine(digests) -> int:
  """xxh3-64 of the per-item digests as little-endian u64s, in order."""
  return xxhash.xxh3_64_intdigest(np.array([int(d) for d in digests], "<u8"))


def state_digest(checksums) -> int:
  """One digest of a whole held state from its per-tensor checksums (name -> checksum, e.g.
  `Update.checksums`), in name order: equal digests, equal states."""
  return combine([int(checksums[name]) for name in sorted(checksums)])


def _index_bits(n: int) -> int:
  return (n - 1).bit_length() if n > 1 else 0


def group_count(n: int) -> int:
  """Number of locators of a seal over n items."""
  return 2 * _index_bits(n)


@functools.lru_cache(maxsize=64)
def _groups(n: int) -> tuple:
  """(bit, side, member indices) of every group over n items, in locator order."""
  items = np.arange(n)
  return tuple((j, side, items[(items >> j) & 1 == side])
               for j in range(_index_bits(n)) for side in (0, 1))


class Seal(typing.NamedTuple):
  """A 64-bit digest over n per-item digests and the group locators (`bits` wide each)."""
  digest: int
  locators: tuple[int, ...]
  bits: int = LOCATOR_BITS

  @classmethod
  def of(cls, digests, bits: int = LOCATOR_BITS) -> "Seal":
    d = np.array([int(x) for x in digests], "<u8")
    mask = (1 << bits) - 1
    return cls(xxhash.xxh3_64_intdigest(d), tuple(
        xxhash.xxh3_64_intdigest(d[g]) & mask for _, _, g in _groups(d.size)), bits)

  def matches(self, digests) -> bool:
    return combine(digests) == self.digest

  def suspects(self, digests) -> list[int]:
    """Indices of the items that may differ, given that the 64-bit digest mismatches."""
    d = np.array([int(x) for x in digests], "<u8")
    mask, n = (1 << self.bits) - 1, d.size
    bad = {(j, side) for (j, side, g), want in zip(_groups(n), self.locators)
           if xxhash.xxh3_64_intdigest(d[g]) & mask != want}
    return [i for i in range(n) if all((j, (i >> j) & 1) in bad for j in range(_index_bits(n)))]


def _listing(names, limit: int = 8) -> str:
  shown = ", ".join(repr(n) for n in names[:limit])
  return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_seal(seal: Seal, digests, names, problem: str, what: str = "checksum") -> None:
  """Raises CodecError stating `problem`, naming the tensor (or the suspects) the seal's
  locators point at, unless `digests` (one per name, in header order) match `seal`."""
  if seal.matches(digests):
    return
  digests = [int(d) for d in digests]
  suspects = seal.suspects(digests)
  if len(suspects) == 1:
    i = suspects[0]
    raise CodecError(f"tensor {names[i]!r}: {problem} (its {what} {digests[i]:016x} is not "
                     f"the one the update's seal records)")
  if suspects:
    raise CodecError(f"{problem} in one or more of {len(suspects)} suspect tensors (the "
                     f"locators cannot tell which): {_listing([names[i] for i in suspects])}")
  raise CodecError(f"{problem}: the combined {what} of the {len(names)} tensors does not match "
                   f"the update's seal, yet no locator mismatches (a locator collision); any "
                   f"of them may differ: {_listing(list(names))}")
