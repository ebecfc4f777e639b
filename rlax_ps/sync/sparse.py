"""Changed elements of a held tensor and their sparse section: gaps and wrapping offsets.

A change is a flat index and the offset new_bits - old_bits, wrapping in the held dtype's
unsigned width, so that it applies without the base on the host. Section layout
(FORMAT.md): varint nnz | varint gap stream bytes | gap stream | offset stream, each an
entropy.py stream; the gaps are index - previous index - 1 (from -1), the offsets zigzag
coded as signed integers of the held width.
"""

import numba
import numpy as np

from rlax_ps.sync import entropy
from rlax_ps.sync.byte_reader import ByteReader, varint
from rlax_ps.sync.errors import CodecError

_JIT = dict(nogil=True, cache=True, boundscheck=False)


@numba.njit(**_JIT)
def _count(a, b):
  n = 0
  for i in range(a.size):
    n += a[i] != b[i]
  return n


@numba.njit(**_JIT)
def _collect_dense(a, b, idx, off):
  """Writes every element's index and offset, advancing past the changed ones only
  (branch-free, for dense changes); idx and off hold one slot more than the count."""
  k = 0
  for i in range(a.size):
    idx[k] = i
    off[k] = b[i] - a[i]
    k += a[i] != b[i]


@numba.njit(**_JIT)
def _collect_sparse(a, b, aw, bw, lanes, idx, off):
  """As _collect_dense, comparing 64-bit words first (aw, bw: the leading elements of a
  and b viewed as uint64, `lanes` each) and entering only the words that differ."""
  k = 0
  for w in range(aw.size):
    if aw[w] != bw[w]:
      for i in range(w * lanes, w * lanes + lanes):
        idx[k] = i
        off[k] = b[i] - a[i]
        k += a[i] != b[i]
  for i in range(aw.size * lanes, a.size):
    idx[k] = i
    off[k] = b[i] - a[i]
    k += a[i] != b[i]


@numba.njit(**_JIT)
def _add_at(bits, idx, off):
  for k in range(idx.size):
    bits[idx[k]] += off[k]


def changes(old_bits: np.ndarray, new_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(flat int64 indices, wrapping offsets) of the elements whose bits differ (flat
  unsigned views of one dtype and size)."""
  n = _count(old_bits, new_bits)
  idx = np.empty(n + 1, np.int64)
  off = np.empty(n + 1, new_bits.dtype)
  if n * 25 > old_bits.size:  # over 4% changed: most words hold a change
    _collect_dense(old_bits, new_bits, idx, off)
  else:
    lanes = 8 // old_bits.itemsize
    m = old_bits.size - old_bits.size % lanes
    words = [x[:m].view(np.uint64) for x in (old_bits, new_bits)]
    _collect_sparse(old_bits, new_bits, *words, lanes, idx, off)
  return idx[:n], off[:n]


def add_at(bits: np.ndarray, idx: np.ndarray, off: np.ndarray) -> None:
  """bits[idx] += off, wrapping (idx distinct)."""
  _add_at(bits, idx, off.astype(bits.dtype, copy=False))


def encode(idx: np.ndarray, off: np.ndarray) -> bytes:
  """The sparse section of changes (idx sorted ascending, at least one)."""
  gaps = np.diff(idx, prepend=-1) - 1
  signed = off.view(np.dtype(f"i{off.itemsize}")).astype(np.int64)
  zigzag = ((signed << 1) ^ (signed >> 63)).view(np.uint64)
  gap_stream = entropy.encode(gaps.view(np.uint64))
  return b"".join([varint(idx.size), varint(len(gap_stream)), gap_stream,
                   entropy.encode(zigzag)])


def decode(section, size: int, udtype: np.dtype, what: str) -> tuple[np.ndarray, np.ndarray]:
  """(indices, offsets) of a sparse section over `size` elements; CodecError naming `what`."""
  r = ByteReader(section, what)
  nnz = r.varint()
  if not 1 <= nnz <= size:
    raise CodecError(f"{what}: {nnz} changes in a tensor of {size} elements")
  gap_end = r.varint() + r.pos
  if gap_end > r.end:
    raise CodecError(f"{what}: truncated: the gap stream runs past the section")
  idx = np.empty(nnz, np.int64)
  entropy.decode(ByteReader(r.buf, what + " gaps", r.pos, gap_end), nnz, size - 1, 1, idx)
  off = np.empty(nnz, udtype)
  entropy.decode(ByteReader(r.buf, what + " offsets", gap_end), nnz,
                 (1 << (8 * udtype.itemsize)) - 1, 2, off)
  return idx, off
