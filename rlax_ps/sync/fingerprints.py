"""Device fingerprints: a 64-bit digest of a held tensor that any JAX backend computes where
the weights are, so that a worker on TPU/GPU checks what it holds without pulling it.

The xxh3 checksums of the result seal are sequential byte hashes: checking them on an
accelerator means copying every changed tensor to the host. A fingerprint is a sum over
elements instead, one elementwise pass and two integer sums (all uint32, wrapping):
  x_i  the element's bit pattern (its held dtype's unsigned width) widened to uint32,
  i    its flat C-order index mod 2**32,
  h_i  = fmix32((x_i * 0x9E3779B1) ^ (i * 0x85EBCA77))   (murmur3's finalizer)
  lo   = sum of h_i,  hi = sum of h_i * (2 i + 1)
  fingerprint = lo | hi << 32.
h_i is a bijection of x_i for each i, so any one changed element changes `lo`. It guards
against a stale base, a lost scatter or corrupted memory, not against an attacker (the
sections' xxh3 seal guards the bytes on the wire). The sums reduce in any order, across
shards too. This module computes it on the host; device.fingerprint on device, bit for bit.
"""

import numba
import numpy as np

from rlax_ps.sync import parallel
from rlax_ps.sync.bits import UINT_OF

M_BITS, M_INDEX = 0x9E3779B1, 0x85EBCA77
F1, F2 = 0x85EBCA6B, 0xC2B2AE35
_M32 = np.uint64(0xFFFFFFFF)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _sums(bits):
  """(lo, hi) of the module docstring over unsigned bit patterns in C order (uint64
  arithmetic masked to 32 bits)."""
  lo, hi = np.uint64(0), np.uint64(0)
  for k in range(bits.size):
    i = np.uint64(k) & _M32
    h = ((np.uint64(bits[k]) * np.uint64(M_BITS)) ^ (i * np.uint64(M_INDEX))) & _M32
    h = ((h ^ (h >> np.uint64(16))) * np.uint64(F1)) & _M32
    h = ((h ^ (h >> np.uint64(13))) * np.uint64(F2)) & _M32
    h ^= h >> np.uint64(16)
    lo = (lo + h) & _M32
    hi = (hi + h * ((i + i + np.uint64(1)) & _M32)) & _M32
  return lo, hi


def join(lo, hi) -> int:
  """The fingerprint of its two 32-bit sums."""
  return int(lo) | int(hi) << 32


def fingerprint(array) -> int:
  """The fingerprint of a held array (bf16 or int8; numpy, or anything np.asarray takes)."""
  a = np.asarray(array)
  if a.dtype not in UINT_OF:
    raise ValueError(f"fingerprint: expected a held dtype ({', '.join(map(str, UINT_OF))}), "
                     f"got {a.dtype}")
  return join(*_sums(np.ascontiguousarray(a).reshape(-1).view(UINT_OF[a.dtype])))


def of_state(state: dict, threads: int | None = None) -> dict[str, int]:
  """name -> fingerprint of each held array of `state`, tensors side by side on `threads`
  host threads (None: the host's cores, at most 8)."""
  names = list(state)
  tasks = [(np.asarray(state[n]).size, lambda n=n: fingerprint(state[n])) for n in names]
  return dict(zip(names, parallel.run(tasks, parallel.resolve(threads))))
