"""Device fingerprints: a 64-bit digest of a held tensor that any JAX backend computes where
the weights are, so that a worker on TPU/GPU checks what it holds without pulling it.

The xxh3 checksums of the result seal are sequential byte hashes: checking them on an
accelerator means copying every changed tensor to the host (most of the model, per update).
A fingerprint is instead a sum over elements, one elementwise pass and two integer sums:
  x_i  the element's bit pattern (its held dtype's unsigned width) widened to uint32,
  i    its flat C-order index mod 2**32,
  h_i  = fmix32((x_i * 0x9E3779B1) ^ (i * 0x85EBCA77))   (murmur3's finalizer; all uint32)
  lo   = sum of h_i,  hi = sum of h_i * (2 i + 1)   (mod 2**32)
  fingerprint = lo | hi << 32.
h_i is a bijection of x_i for each i, so any one changed element changes `lo`; changes that
cancel in both sums need colliding 32-bit mixes (2**-32 or less per pair). It guards against
a stale base, a lost scatter or corrupted memory, not against an attacker (the sections'
xxh3 seal guards the bytes on the wire). The sums reduce in any order, across shards too.
This module computes it on the host (numba); device.fingerprint on device, bit for bit.
"""

import numba
import numpy as np

from rlax_ps.sync import parallel
from rlax_ps.sync.bits import UINT_OF
from rlax_ps.sync.intrinsics import add32, mix32, odd_madd32

M_BITS, M_INDEX = 0x9E3779B1, 0x85EBCA77
F1, F2 = 0x85EBCA6B, 0xC2B2AE35


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _sums(bits):
  """(lo, hi) of the module docstring over unsigned bit patterns in C order (32-bit lanes:
  intrinsics.mix32)."""
  lo, hi = np.uint32(0), np.uint32(0)
  for k in range(bits.size):
    h = mix32(bits[k], k, M_BITS, M_INDEX, F1, F2)
    lo = add32(lo, h)
    hi = odd_madd32(hi, h, k)
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
  bits = np.ascontiguousarray(a).reshape(-1).view(UINT_OF[a.dtype])
  return join(*_sums(bits))


def of_state(state: dict, threads: int | None = None) -> dict[str, int]:
  """name -> fingerprint of each held array of `state`, tensors side by side on `threads`
  host threads (None: the host's cores, at most 8)."""
  names = list(state)
  tasks = [(np.asarray(state[n]).size, lambda n=n: fingerprint(state[n])) for n in names]
  return dict(zip(names, parallel.run(tasks, parallel.resolve(threads))))
