"""Bit-level array helpers: held dtypes, unsigned bit views, fixed-width packing."""

import ml_dtypes
import numpy as np

from rlax_ps.sync import loops
from rlax_ps.sync.errors import CodecError

BF16 = np.dtype(ml_dtypes.bfloat16)
INT8 = np.dtype(np.int8)
# Held dtype -> unsigned integer dtype of the same width (offsets wrap in it).
UINT_OF = {BF16: np.dtype(np.uint16), INT8: np.dtype(np.uint8)}
DTYPE_NAMES = {"bfloat16": BF16, "int8": INT8}


def read_only(a: np.ndarray) -> np.ndarray:
  """a, or a read-only view of it. Arrays handed to compiled code are kept in one form:
  numba compiles once per signature, and read-only is part of it."""
  if a.flags.writeable:
    a = a.view()
    a.flags.writeable = False
  return a


def is_float_dtype(dtype) -> bool:
  return dtype == BF16 or np.issubdtype(dtype, np.floating)


def to_bf16(name: str, x) -> np.ndarray:
  """`x` rounded to bf16 (round to nearest even; NaN stays NaN), as a C-contiguous array."""
  a = np.asarray(x)
  if a.dtype == BF16:
    return c_contiguous(a)
  if not is_float_dtype(a.dtype):
    raise CodecError(f"tensor {name!r}: dtype expected a floating type, got {a.dtype}")
  out = np.empty(a.shape, BF16)
  round_into(out, a)
  return out


def round_into(out: np.ndarray, a: np.ndarray) -> None:
  """out[...] = float array `a` rounded to bf16 (round to nearest even, as astype; `out`:
  C-contiguous bf16 of a's shape). float32 takes one compiled pass (loops.round_bf16_bits:
  a fifth less time than numpy's cast through ml_dtypes), other floats numpy's cast."""
  if a.dtype == np.float32 and a.flags.c_contiguous:
    loops.round_bf16_bits(a.reshape(-1).view(np.uint32), out.reshape(-1).view(np.uint16))
  else:
    out[...] = a


def c_contiguous(a: np.ndarray) -> np.ndarray:
  """`a` itself when C-contiguous, else a C-ordered copy (keeps 0-d arrays 0-d)."""
  return a if a.flags.c_contiguous else a.copy(order="C")


def bit_view(a: np.ndarray) -> np.ndarray:
  """Flat unsigned-integer view of a held (bf16 or int8) array; no copy when contiguous."""
  return c_contiguous(a).reshape(-1).view(UINT_OF[a.dtype])


_FIXED_MIN = loops.FIXED_MIN


def fixed_nbytes(n: int, width: int) -> int:
  """Bytes `pack_fixed` produces for n values of `width` bits."""
  return (n * width + 7) // 8 if n < _FIXED_MIN else -(-n // 8) * width


def pack_fixed(values: np.ndarray, width: int, low: int = 0) -> bytes:
  """The low `width` bits (<= 56) of every value - low (values >= low), as `fixed_nbytes`
  bytes: byte planes of 8 bits, then one plane of 8 values per `rest` bytes; short inputs
  are packed bit-exactly instead."""
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
