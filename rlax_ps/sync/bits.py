"""Held dtypes and their unsigned bit views."""

import ml_dtypes
import numpy as np

from rlax_ps.sync.errors import CodecError

BF16 = np.dtype(ml_dtypes.bfloat16)
INT8 = np.dtype(np.int8)
# Held dtype -> unsigned integer dtype of the same width (offsets wrap in it).
UINT_OF = {BF16: np.dtype(np.uint16), INT8: np.dtype(np.uint8)}


def is_float_dtype(dtype) -> bool:
  return dtype == BF16 or np.issubdtype(dtype, np.floating)


def c_contiguous(a: np.ndarray) -> np.ndarray:
  """`a` itself when C-contiguous, else a C-ordered copy."""
  return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def to_bf16(name: str, x) -> np.ndarray:
  """`x` rounded to bf16 (round to nearest even, as ml_dtypes casts), C-contiguous."""
  a = np.asarray(x)
  if a.dtype == BF16:
    return c_contiguous(a)
  if not is_float_dtype(a.dtype):
    raise CodecError(f"tensor {name!r}: dtype expected a floating type, got {a.dtype}")
  return a.astype(BF16, order="C")  # (ascontiguousarray made a scalar 1-d)


def bit_view(a: np.ndarray) -> np.ndarray:
  """Flat unsigned-integer view of a held (bf16 or int8) array; no copy when contiguous."""
  return c_contiguous(np.asarray(a)).reshape(-1).view(UINT_OF[np.asarray(a).dtype])
