"""Bit-level array helpers: held dtypes, wrapping offsets, zigzag, variable-width packing.

All functions are vectorised numpy and work in bounded temporary memory.
"""

import ml_dtypes
import numpy as np

from rlax_ps.sync import loops
from rlax_ps.sync.errors import CodecError

BF16 = np.dtype(ml_dtypes.bfloat16)
INT8 = np.dtype(np.int8)
# Held dtype -> unsigned integer dtype of the same width (offsets wrap in it).
UINT_OF = {BF16: np.dtype(np.uint16), INT8: np.dtype(np.uint8)}
DTYPE_NAMES = {"bfloat16": BF16, "int8": INT8}
_BLOCK = 1 << 20


def is_float_dtype(dtype) -> bool:
  return dtype == BF16 or np.issubdtype(dtype, np.floating)


def to_bf16(name: str, x) -> np.ndarray:
  """`x` rounded to bf16 (round to nearest even; NaN stays NaN), as a C-contiguous array."""
  a = np.asarray(x)
  if a.dtype == BF16:
    return c_contiguous(a)
  if not is_float_dtype(a.dtype):
    raise CodecError(f"tensor {name!r}: dtype expected a floating type, got {a.dtype}")
  return c_contiguous(a.astype(BF16))


def c_contiguous(a: np.ndarray) -> np.ndarray:
  """`a` itself when C-contiguous, else a C-ordered copy (keeps 0-d arrays 0-d)."""
  return a if a.flags.c_contiguous else a.copy(order="C")


def bit_view(a: np.ndarray) -> np.ndarray:
  """Flat unsigned-integer view of a held (bf16 or int8) array; no copy when contiguous."""
  return c_contiguous(a).reshape(-1).view(UINT_OF[a.dtype])


def zigzag(off: np.ndarray) -> np.ndarray:
  """Wrapping unsigned offsets (8 or 16 bits) -> zigzag codes (uint32): small |offset| first."""
  bits = off.dtype.itemsize * 8
  s = off.view(np.dtype(f"i{off.dtype.itemsize}")).astype(np.int32)
  return ((s << 1) ^ (s >> (bits - 1))).view(np.uint32)


def unzigzag(z: np.ndarray, udtype: np.dtype) -> np.ndarray:
  """Inverse of `zigzag` for codes < 2**16: codes -> wrapping unsigned offsets of `udtype`."""
  z = z.astype(np.int32)
  return ((z >> 1) ^ -(z & 1)).astype(udtype)


def bit_length(z: np.ndarray) -> np.ndarray:
  """Number of significant bits of each unsigned value (< 2**63)."""
  nb = np.frexp(z.astype(np.float64))[1].astype(np.int64)
  # float64 rounding can carry 2**k - 1 up to 2**k above 2**53: step back there.
  over = (nb > 53) & (z < (np.uint64(1) << np.maximum(nb - 1, 0).astype(np.uint64)))
  return nb - over


def pack_varwidth(values: np.ndarray, widths: np.ndarray) -> bytes:
  """Concatenate the low `widths[i]` bits of `values[i]` (widths <= 56), LSB first."""
  n = values.size
  if n == 0:
    return b""
  w = widths.astype(np.int64)
  ends = np.cumsum(w)
  total = int(ends[-1])
  if total == 0:
    return b""
  words = np.zeros(total // 64 + 2, np.uint64)  # zero-width values may start at `total`
  for s in range(0, n, _BLOCK):
    v = values[s:s + _BLOCK].astype(np.uint64)
    wb = w[s:s + _BLOCK]
    start = ends[s:s + _BLOCK] - wb
    q = start >> 6
    r = (start & 63).astype(np.uint64)
    v &= (np.uint64(1) << wb.astype(np.uint64)) - np.uint64(1)
    lo = v << r
    hi = np.where(r == 0, np.uint64(0), v >> ((np.uint64(64) - r) & np.uint64(63)))
    # q is non-decreasing and the bit ranges are disjoint, so a grouped sum is an OR.
    first = np.flatnonzero(np.diff(q, prepend=-1))
    uq = q[first]
    words[uq] += np.add.reduceat(lo, first)
    words[uq + 1] += np.add.reduceat(hi, first)
  return words.astype("<u8").view(np.uint8)[:(total + 7) // 8].tobytes()


def unpack_varwidth(buf, widths: np.ndarray, what: str) -> np.ndarray:
  """Inverse of `pack_varwidth`; `buf` must hold exactly ceil(sum(widths) / 8) bytes."""
  n = widths.size
  w = widths.astype(np.int64)
  ends = np.cumsum(w) if n else np.zeros(0, np.int64)
  total = int(ends[-1]) if n else 0
  if len(buf) != (total + 7) // 8:
    raise CodecError(f"{what}: bit field holds {len(buf)} bytes, expected {(total + 7) // 8}")
  if total == 0:
    return np.zeros(n, np.uint64)
  padded = np.zeros(((len(buf) + 7) // 8 + 2) * 8, np.uint8)  # zero widths may start at the end
  padded[:len(buf)] = np.frombuffer(buf, np.uint8)
  words = padded.view("<u8").astype(np.uint64)
  out = np.empty(n, np.uint64)
  for s in range(0, n, _BLOCK):
    wb = w[s:s + _BLOCK]
    start = ends[s:s + _BLOCK] - wb
    q = start >> 6
    r = (start & 63).astype(np.uint64)
    v = words[q] >> r
    v |= np.where(r == 0, np.uint64(0), words[q + 1] << ((np.uint64(64) - r) & np.uint64(63)))
    out[s:s + _BLOCK] = v & ((np.uint64(1) << wb.astype(np.uint64)) - np.uint64(1))
  return out


_FIXED_MIN = 64


def fixed_nbytes(n: int, width: int) -> int:
  """Bytes `pack_fixed` produces for n values of `width` bits."""
  return (n * width + 7) // 8 if n < _FIXED_MIN else -(-n // 8) * width


def pack_fixed(values: np.ndarray, width: int, low: int = 0) -> bytes:
  """The low `width` bits (<= 56) of every value - low (values >= low), as `fixed_nbytes`
  bytes: byte planes of 8 bits, then one plane of 8 values per `rest` bytes (faster than
  pack_varwidth); short inputs are packed bit-exactly instead."""
  if values.size < _FIXED_MIN:
    return loops.pack_lsb(values.astype(np.uint64) - np.uint64(low), width).tobytes()
  return loops.pack_planes(values, width, low).tobytes()


def unpack_fixed(buf, n: int, width: int, what: str) -> np.ndarray:
  """Inverse of `pack_fixed` (low = 0) as uint64; `buf` must hold exactly
  fixed_nbytes(n, width) bytes."""
  if len(buf) != fixed_nbytes(n, width):
    raise CodecError(f"{what}: fixed-width field holds {len(buf)} bytes, "
                     f"expected {fixed_nbytes(n, width)}")
  raw = np.frombuffer(buf, np.uint8)
  if n < _FIXED_MIN:
    return loops.unpack_lsb(raw, n, width)
  return loops.unpack_planes(raw, n, width)


def pack_unary(q: np.ndarray) -> tuple[int, bytes]:
  """Each value q as q zero bits then a one bit (LSB first): (total bits, bytes)."""
  ends = np.cumsum(q.astype(np.int64) + 1)
  total = int(ends[-1]) if q.size else 0
  bitmap = np.zeros(total, bool)
  bitmap[ends - 1] = True
  return total, np.packbits(bitmap, bitorder="little").tobytes()


def unpack_unary(buf, n: int, what: str) -> np.ndarray:
  """Inverse of `pack_unary` for n values; the bytes must end with the last value's one."""
  ones = np.flatnonzero(np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little"))
  if ones.size != n or (n and ones[-1] // 8 != len(buf) - 1):
    raise CodecError(f"{what}: unary field codes {ones.size} values, expected {n}")
  return np.diff(ones, prepend=-1) - 1
