"""Compiled (numba) loops of the int8 quantizer (int8.py): absmax and codes, branch-free.

Absmax works on the weights' bit patterns: |w| is `bits & 0x7f..` and, for finite floats
of one sign, integer order is float order, so an integer max is exact, has no NaN rule
that stops LLVM from vectorising it, and flags NaN and infinity as bits >= the exponent
mask. Codes use the float32-only scheme of `code_f32` (shared with int8_device.py).
"""

import numba
import numpy as np

_JIT = dict(nogil=True, cache=True, boundscheck=False)
_ROUND32 = np.float32(1.5 * 2**23)  # (p + _ROUND32) - _ROUND32: p rounded half to even, |p| < 2**22
_ROUND64 = 1.5 * 2**52
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)


@numba.njit(**_JIT)
def absmax_bits_cols(bits, mask, out):
  """out[c] = max(out[c], max_r bits[r, c] & mask): |x| per column as bits (int view of x)."""
  for r in range(bits.shape[0]):
    for c in range(bits.shape[1]):
      v = bits[r, c] & mask
      out[c] = v if v > out[c] else out[c]


@numba.njit(**_JIT)
def absmax_bits_rows(bits, mask, out):
  """out[r] = max(out[r], max_c bits[r, c] & mask): |x| per row as bits (int view of x)."""
  for r in range(bits.shape[0]):
    m = out[r]
    for c in range(bits.shape[1]):
      v = bits[r, c] & mask
      m = v if v > m else m
    out[r] = m


@numba.njit(inline="always", **_JIT)
def code_f32(w, f, s, inv, half):
  """round_half_even(w / scale) for float32 w and a bf16 scale != 0, in float32 only.

  f = 2**-k puts the scale in [2**-6, 2): s = scale * f, inv = fl(1 / s), half = s / 2 (all
  exact but inv). v = w * f is exact (a power of two; a product that underflows is below
  2**-126 << half and codes 0 either way), so |v| <= 127 s. c = round(v * inv) is within
  0.5 + 2**-15 of v / s (relative error of v * inv <= 2**-23), so one step fixes it:
  * t = c * s is exact: |c| <= 127 (8 bits) times s (8 significant bits), no overflow;
  * r = v - t is exact when |r| <= |v| (r is a multiple of the finer of v's and s's grids
    and below 2**24 of it); otherwise |v| < s / 2 and c = +-1, the true |r| > s / 2 and the
    rounded r keeps |r| >= half (half is a float32, rounding is monotone): the step below
    moves c to 0 whether it sees |r| > half or a tie of the odd c = +-1;
  * |r| > half: c moves one toward v; |r| == half (exact tie): an odd c moves toward v.
  The result is round_half_even(v / s) itself, in [-127, 127] as |v / s| <= 127 (no clip:
  it would cost a fifth of the loop)."""
  v = w * f
  p = v * inv
  c = (p + _ROUND32) - _ROUND32
  r = v - c * s
  h = c * _HALF
  odd = h != (h + _ROUND32) - _ROUND32
  up = (r > half) | ((r == half) & odd)
  down = (r < -half) | ((r == -half) & odd)
  c = c + (_ONE if up else np.float32(0.0)) - (_ONE if down else np.float32(0.0))
  return np.int8(c)


@numba.njit(**_JIT)
def quantize_cols_f32(x, f, s, inv, half, codes):
  """codes[r, c] = code_f32(x[r, c], f[c], s[c], inv[c], half[c]) (float32 x)."""
  for r in range(x.shape[0]):
    for c in range(x.shape[1]):
      codes[r, c] = code_f32(x[r, c], f[c], s[c], inv[c], half[c])


@numba.njit(**_JIT)
def quantize_rows_f32(x, f, s, inv, half, codes):
  """codes[r, c] = code_f32(x[r, c], f[r], s[r], inv[r], half[r]) (float32 x)."""
  for r in range(x.shape[0]):
    fr, sr, ir, hr = f[r], s[r], inv[r], half[r]
    for c in range(x.shape[1]):
      codes[r, c] = code_f32(x[r, c], fr, sr, ir, hr)


@numba.njit(**_JIT)
def quantize_cols_bf16(x, f, s, inv, half, codes):
  """quantize_cols_f32 of bf16 weights given as their uint16 bits (widened a row at a time)."""
  wide = np.empty(x.shape[1], np.uint32)
  w = wide.view(np.float32)
  for r in range(x.shape[0]):
    for c in range(x.shape[1]):
      wide[c] = np.uint32(x[r, c]) << np.uint32(16)
    for c in range(x.shape[1]):
      codes[r, c] = code_f32(w[c], f[c], s[c], inv[c], half[c])


@numba.njit(**_JIT)
def quantize_rows_bf16(x, f, s, inv, half, codes):
  """quantize_rows_f32 of bf16 weights given as their uint16 bits (widened a row at a time)."""
  wide = np.empty(x.shape[1], np.uint32)
  w = wide.view(np.float32)
  for r in range(x.shape[0]):
    fr, sr, ir, hr = f[r], s[r], inv[r], half[r]
    for c in range(x.shape[1]):
      wide[c] = np.uint32(x[r, c]) << np.uint32(16)
    for c in range(x.shape[1]):
      codes[r, c] = code_f32(w[c], fr, sr, ir, hr)


@numba.njit(inline="always", **_JIT)
def _code_f64(w, s):
  q = w / s
  q = -128.0 if q < -128.0 else (128.0 if q > 128.0 else q)
  q = (q + _ROUND64) - _ROUND64
  q = -127.0 if q < -127.0 else (127.0 if q > 127.0 else q)
  return np.int8(q)


@numba.njit(**_JIT)
def quantize_f64(x, scale, per_row, codes):
  """codes = clip(round_half_even(x / scale), -127, 127) for float64 x, dividing in float64;
  scale (> 0) per row when per_row, else per column."""
  for r in range(x.shape[0]):
    for c in range(x.shape[1]):
      codes[r, c] = _code_f64(x[r, c], scale[r] if per_row else scale[c])
