"""A message's meta bytes and seals (wire.py's layout), written by compiled code.

The meta and the seals (integrity.py: digests and group locators by the xxh3 C function)
of a message are a few dozen Python steps each way; cold, as after a trainer step, every
step costs microseconds. Here they are one compiled function, called where a pack's
coder makes the whole message of a small model in one call (pack_coder.encode_update).
"""

import numba
import numpy as np

from rlax_ps.sync.intrinsics import copy_bytes
from rlax_ps.sync.loops import _put_varint, _seal_into

_JIT = dict(nogil=True, cache=True, boundscheck=False)


@numba.njit(**_JIT)
def fields(fn, fmt, flags, version, base_version, fixed, codes, modes, dims, lengths,
           digests, counts, width):
  """The seals' words, then the meta bytes and the seals' bytes of a message (wire.py's
  layout) in one uint8 array, and where each of the three and each seal's words
  end, in one compiled call rather than a few dozen Python steps: meta from the layout's
  columns (fixed, codes, dims), the mode codes and the section lengths; seal s (results,
  bases, sections, fingerprints; counts[s] < 0: absent) over the next counts[s] digests
  (its digest, then its locators, each `width` bytes) by the C function at address fn, or,
  where fn is 0, the next counts[s] of `digests` as its words, as given."""
  n = modes.size
  words = np.empty(4 * (1 + 2 * 64), np.uint64) if fn else digests
  tmp = np.empty(max(1, digests.size), np.uint64)
  mask = (np.uint64(1) << np.uint64(8 * width)) - np.uint64(1)
  ends = np.zeros(len(counts), np.int64)  # of each seal's words
  w, at = 0, 0
  for s in range(len(counts)):
    if counts[s] >= 0:
      if fn:
        w0 = w
        w = _seal_into(fn, digests[at:at + counts[s]], tmp, words, w)
        for g in range(w0 + 1, w):
          words[g] &= mask
      else:
        w += counts[s]
      at += counts[s]
    ends[s] = w
  out = np.empty(8 * w + 2 + 20 + fixed.size + 4 * n + dims.size + 10 * n + 8 * w, np.uint8)
  copy_bytes(out.ctypes.data, words.ctypes.data, 8 * w)
  p = 8 * w
  out[p], out[p + 1] = fmt, flags
  p = _put_varint(out, p + 2, version)
  p = _put_varint(out, p, base_version)
  copy_bytes(out.ctypes.data + p, fixed.ctypes.data, fixed.size)
  p += fixed.size
  for i in range(n):
    for b in range(4):
      out[p + 4 * i + b] = codes[i, b]
    out[p + 4 * i + 2] = modes[i]
  p += 4 * n
  copy_bytes(out.ctypes.data + p, dims.ctypes.data, dims.size)
  p += dims.size
  for i in range(n):
    p = _put_varint(out, p, lengths[i])
  meta_end, g = p, 0
  for s in range(len(counts)):
    first = g
    while g < ends[s]:
      for b in range(8 if g == first else width):  # the digest, then the locators
        out[p] = np.uint8((words[g] >> np.uint64(8 * b)) & np.uint64(255))
        p += 1
      g += 1
  return out, meta_end, p, (ends[0], ends[1], ends[2], ends[3])
