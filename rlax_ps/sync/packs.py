"""Packs: the small tensors of a delta coded as one section per held dtype.

A model has many small tensors (norm scales, biases, int8 scales; in small models every
tensor) whose own sections would each pay a header of a few bytes and a Python-level
call. In a delta, all tensors below PACK_BELOW elements of one dtype form a pack when any
of them changed: their bits are concatenated in header order and coded as one section,
stored with the first of them (the head, whose mode is the section's); the others have
mode "packed" and no bytes. The sum of the per-tensor information bounds rises by under
1% for real updates, while the per-section bytes and calls fall to one per pack.
"""

import itertools

import numpy as np

from rlax_ps.sync.errors import CodecError

PACK_BELOW = 1 << 16
PACKED = "packed"


def members_by_dtype(sizes: dict, dtypes: dict) -> dict:
  """dtype -> the names (in order) of the tensors below PACK_BELOW elements of it, where
  there are at least two."""
  groups = {}
  for name, size in sizes.items():
    if size < PACK_BELOW:
      d = dtypes[name]
      groups.setdefault(d if isinstance(d, np.dtype) else np.dtype(d), []).append(name)
  return {d: names for d, names in groups.items() if len(names) > 1}


def read_packs(metas: dict) -> dict[str, list[str]]:
  """head name -> member names (head first) of each pack of a parsed header; raises
  CodecError when the modes do not describe packs (a "packed" tensor outside a pack, a
  pack member that is not "packed", a head without a coded section: raw and unchanged
  packs are never made)."""
  groups = members_by_dtype({n: m.size for n, m in metas.items()},
                            {n: m.dtype for n, m in metas.items()})
  packs, members = {}, set()
  for names in groups.values():
    if not any(metas[n].mode == PACKED for n in names):
      continue
    head, rest = names[0], names[1:]
    if metas[head].mode in (PACKED, "unchanged", "raw") or not metas[head].nbytes:
      raise CodecError(f"tensor {head!r}: heads a pack but its mode is {metas[head].mode}")
    for n in rest:
      if metas[n].mode != PACKED or metas[n].nbytes:
        raise CodecError(f"tensor {n!r}: belongs to the pack of {head!r} but its mode is "
                         f"{metas[n].mode} with {metas[n].nbytes} bytes")
    packs[head] = names
    members.update(names)
  for n, m in metas.items():
    if m.mode == PACKED and n not in members:
      raise CodecError(f"tensor {n!r}: mode packed outside any pack")
  return packs


def starts(sizes: list[int]) -> list[int]:
  """Where each member starts in the pack's concatenated elements."""
  return [0, *itertools.accumulate(sizes[:-1])]
