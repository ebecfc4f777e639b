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
def _collect(a, b, aw, bw, lanes, start, stop, dense, idx, off):
  """Index and offset of each changed element in [start, stop) (start a multiple of 8
  words), written to idx and off (one slot more than stop - start); returns the count.
  Sparse: blocks of 8 64-bit words (aw, bw: a and b viewed as words) are OR-reduced and
  skipped when equal, and only the words that differ entered. Dense: every element is
  written, the changed ones kept (branch-free)."""
  k, tail = 0, start
  if not dense:
    tail = min(stop, aw.size * lanes)
    tail -= (tail - start) % (8 * lanes)
    for w0 in range(start // lanes, tail // lanes, 8):
      d = np.uint64(0)
      for j in range(8):
        d |= aw[w0 + j] ^ bw[w0 + j]
      if d == 0:
        continue
      for w in range(w0, w0 + 8):
        if aw[w] != bw[w]:
          for i in range(w * lanes, w * lanes + lanes):
            idx[k] = i
            off[k] = b[i] - a[i]
            k += a[i] != b[i]
  for i in range(tail, stop):
    idx[k] = i
    off[k] = b[i] - a[i]
    k += a[i] != b[i]
  return k


@numba.njit(**_JIT)
def _add_at(bits, idx, off):
  for k in range(idx.size):
    bits[idx[k]] += off[k]


_SEGMENT = 1 << 20  # elements scanned per call: the output buffers' size


def changes(old_bits: np.ndarray, new_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(flat int64 indices, wrapping offsets) of the elements whose bits differ (flat
  unsigned views of one dtype and size), in one pass: segment by segment into reused
  buffers, each segment scanned the way the previous one's density favours."""
  lanes = 8 // old_bits.itemsize
  covered = old_bits.size - old_bits.size % lanes
  aw, bw = (x[:covered].view(np.uint64) for x in (old_bits, new_bits))
  idx_buf = np.empty(min(_SEGMENT, old_bits.size) + 1, np.int64)
  off_buf = np.empty(idx_buf.size, new_bits.dtype)
  parts, dense = [], False
  for start in range(0, old_bits.size, _SEGMENT):
    stop = min(start + _SEGMENT, old_bits.size)
    k = _collect(old_bits, new_bits, aw, bw, lanes, start, stop, dense, idx_buf, off_buf)
    parts.append((idx_buf[:k].copy(), off_buf[:k].copy()))
    dense = k * 25 > stop - start  # over 4% changed: most words hold a change
  if len(parts) == 1:
    return parts[0]
  return (np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.int64),
          np.concatenate([p[1] for p in parts]) if parts else np.empty(0, new_bits.dtype))


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
