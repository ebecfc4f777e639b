"""Compiled (numba) loops of the codec: the fused change scan, bit streams, rANS, scatter.

numpy would need a separate pass (and a temporary array) per step; these loops do the
compare, compaction, zigzag, gap/Rice coding, rANS and scatter of each element in one go
at a few ns per changed element. Every decoder checks bounds and returns an error code
(never reads or writes outside its arrays), so corrupted input cannot crash it.

Bit streams are LSB-first in little-endian uint64 words. rANS: 32-bit state, byte output,
L = 2**23, PROB_BITS = 15 (ryg_rans "rans_byte" with reciprocal-multiply encoding).
Symbols: z < 16 is its own symbol; a larger z is its bit length and the two bits below
its leading one (four symbols per octave) plus its remaining low bits, sent raw.
"""

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

DIRECT = 16
ALPHABET = DIRECT + 4 * (56 - 4)  # z < 2**56
PROB_BITS = 15
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 23
_JIT = dict(nogil=True, cache=True, boundscheck=False)

OK, E_TRUNCATED, E_RANGE, E_STATE, E_COUNTS, E_ZERO = range(6)


@numba.njit(inline="always", **_JIT)
def _bitlen(z):
  if z == 0:
    return np.int64(0)
  return np.int64(64) - np.int64(leading_zeros(np.uint64(z)))


@numba.njit(inline="always", **_JIT)
def symbol_of(z):
  """(symbol, raw width, raw bits) of an integer z >= 0."""
  z = np.uint64(z)
  if z < np.uint64(DIRECT):
    return np.int64(z), np.int64(0), np.uint64(0)
  nb = _bitlen(z)
  w = nb - 3
  top = np.int64((z >> np.uint64(w)) & np.uint64(3))
  return DIRECT + (nb - 5) * 4 + top, w, z & ((np.uint64(1) << np.uint64(w)) - np.uint64(1))


# ---- change scan -------------------------------------------------------------------------

@numba.njit(**_JIT)
def scan_block16(aw, bw, a, b, start, idx, zz, pos, dense):
  """For 16-bit elements: appends the flat indices (start + i) where a != b and the zigzag
  of the wrapping offset b - a there to idx / zz from `pos`; aw, bw are a, b as uint64
  words over a prefix. dense: one branch-free loop over every element (faster when most
  words differ); else equal words are skipped. Returns the new pos, or -1 when idx may
  lack room."""
  room = idx.size - pos  # branch-free stores may write one entry past the last change
  if a.size >= room:
    if dense:
      return -1
    need = a.size - aw.size * 4
    for j in range(aw.size):
      need += np.int64(aw[j] != bw[j]) * 4
    if need >= room:
      return -1
  if dense:
    return _scan_all16(a, b, start, idx, zz, pos)
  for j in range(aw.size):
    if aw[j] != bw[j]:
      pos = _scan_all16(a[j * 4:(j + 1) * 4], b[j * 4:(j + 1) * 4], start + j * 4,
                         idx, zz, pos)
  return _scan_all16(a[aw.size * 4:], b[aw.size * 4:], start + aw.size * 4, idx, zz, pos)


@numba.njit(inline="always", **_JIT)
def _scan_all16(a, b, start, idx, zz, pos):
  for i in range(a.size):
    ai, bi = np.int32(a[i]), np.int32(b[i])
    d = np.int32(np.int16(bi - ai))
    zz[pos] = ((d << 1) ^ (d >> 15)) & 65535
    idx[pos] = start + i
    pos += np.int64(ai != bi)
  return pos


@numba.njit(**_JIT)
def scan_block8(aw, bw, a, b, start, idx, zz, pos, dense):
  """For 8-bit elements: appends the flat indices (start + i) where a != b and the zigzag
  of the wrapping offset b - a there to idx / zz from `pos`; aw, bw are a, b as uint64
  words over a prefix. dense: one branch-free loop over every element (faster when most
  words differ); else equal words are skipped. Returns the new pos, or -1 when idx may
  lack room."""
  room = idx.size - pos  # branch-free stores may write one entry past the last change
  if a.size >= room:
    if dense:
      return -1
    need = a.size - aw.size * 8
    for j in range(aw.size):
      need += np.int64(aw[j] != bw[j]) * 8
    if need >= room:
      return -1
  if dense:
    return _scan_all8(a, b, start, idx, zz, pos)
  for j in range(aw.size):
    if aw[j] != bw[j]:
      pos = _scan_all8(a[j * 8:(j + 1) * 8], b[j * 8:(j + 1) * 8], start + j * 8,
                         idx, zz, pos)
  return _scan_all8(a[aw.size * 8:], b[aw.size * 8:], start + aw.size * 8, idx, zz, pos)


@numba.njit(inline="always", **_JIT)
def _scan_all8(a, b, start, idx, zz, pos):
  for i in range(a.size):
    ai, bi = np.int32(a[i]), np.int32(b[i])
    d = np.int32(np.int8(bi - ai))
    zz[pos] = ((d << 1) ^ (d >> 7)) & 255
    idx[pos] = start + i
    pos += np.int64(ai != bi)
  return pos


# ---- histograms and costs ----------------------------------------------------------------

@numba.njit(**_JIT)
def histogram(z, hist):
  """Adds the symbol counts of z to hist; returns the raw bits they need."""
  raw = np.int64(0)
  for i in range(z.size):
    s, w, _ = symbol_of(z[i])
    hist[s] += 1
    raw += w
  return raw


@numba.njit(**_JIT)
def gap_histogram(idx, step, hist):
  """Symbol counts of every `step`-th gap (idx[i] - idx[i-1] - 1, idx[-1] = -1)."""
  for i in range(0, idx.size, step):
    prev = idx[i - 1] if i else -1
    s, _, _ = symbol_of(idx[i] - prev - 1)
    hist[s] += 1


@numba.njit(**_JIT)
def rice_sizes(idx, k0, k1):
  """Unary bits of the gaps of idx for Rice parameters k0..k1-1 (quotients + stops)."""
  out = np.zeros(k1 - k0, np.int64)
  prev = np.int64(-1)
  for i in range(idx.size):
    g = np.uint64(idx[i] - prev - 1)
    prev = idx[i]
    for k in range(k0, k1):
      out[k - k0] += np.int64(g >> np.uint64(k)) + 1
  return out


# ---- Rice-coded gaps ---------------------------------------------------------------------

@numba.njit(**_JIT)
def rice_encode(idx, k, nbits):
  """Gaps of idx as q zeros, a one, then k low bits (LSB first), in ceil(nbits/64)+1 words."""
  out = np.zeros((nbits + 63) // 64 + 1, np.uint64)
  p = np.int64(0)
  prev = np.int64(-1)
  mask = (np.uint64(1) << np.uint64(k)) - np.uint64(1)
  for i in range(idx.size):
    g = np.uint64(idx[i] - prev - 1)
    prev = idx[i]
    p += np.int64(g >> np.uint64(k))
    out[p >> 6] |= np.uint64(1) << np.uint64(p & 63)
    p += 1
    if k:
      r = g & mask
      q, o = p >> 6, np.uint64(p & 63)
      out[q] |= r << o
      out[q + 1] |= (r >> np.uint64(1)) >> (np.uint64(63) - o)
      p += k
  return out


@numba.njit(**_JIT)
def rice_decode(words, nbytes, k, n, size, idx):
  """Inverse of rice_encode into idx (n entries): indices must be < size and the codes must
  end within the last of the nbytes bytes. Returns an error code."""
  nbits = nbytes * 8
  p = np.int64(0)
  prev = np.int64(-1)
  nw = words.size
  qmax = np.uint64(size) >> np.uint64(k)
  kmask = (np.uint64(1) << np.uint64(k)) - np.uint64(1)
  for i in range(n):
    begin = p
    while True:
      q = p >> 6
      if q >= nw or p >= nbits:
        return E_TRUNCATED
      w = words[q] >> np.uint64(p & 63)
      if w:
        p += np.int64(trailing_zeros(w))
        break
      p = (q + 1) << 6
    if p >= nbits:
      return E_TRUNCATED
    quot = np.uint64(p - begin)
    if quot > qmax:
      return E_RANGE
    p += 1
    g = quot << np.uint64(k)
    if k:
      if p + k > nbits:
        return E_TRUNCATED
      q, o = p >> 6, np.uint64(p & 63)
      r = words[q] >> o
      if q + 1 < nw:
        r |= (words[q + 1] << np.uint64(1)) << (np.uint64(63) - o)
      g |= r & kmask
      p += k
    if g >= np.uint64(size) or prev + 1 + np.int64(g) >= size:
      return E_RANGE
    prev = prev + 1 + np.int64(g)
    idx[i] = prev
  if (p + 7) // 8 != nbytes:
    return E_TRUNCATED
  return OK


# ---- rANS --------------------------------------------------------------------------------

def normalize(counts: np.ndarray) -> np.ndarray:
  """Symbol counts (all > 0, at least two) -> frequencies summing to PROB_SCALE, each >= 1;
  integer arithmetic only, so encoder and decoder agree exactly."""
  n = int(counts.sum())
  f = np.maximum(1, (counts.astype(np.int64) * PROB_SCALE) // n)
  f[int(np.argmax(f))] += PROB_SCALE - int(f.sum())
  return f


@numba.njit(**_JIT)
def stream_encode(z, lut, freq, start, raw_bits, use_rans):
  """(rANS bytes, raw-bit words) of the symbols of z (lut: symbol -> slot in freq/start).
  The rANS bytes come out in decoding order; raw bits in forward order."""
  n = z.size
  raw = np.zeros((raw_bits + 63) // 64 + 1, np.uint64)
  out = np.empty(2 * n + 8 if use_rans else 0, np.uint8)
  m = freq.size
  rcp = np.zeros(m, np.uint64)
  shift = np.zeros(m, np.uint64)
  bias = np.zeros(m, np.uint64)
  cmpl = np.zeros(m, np.uint64)
  xmax = np.zeros(m, np.uint64)
  for s in range(m):
    f = np.uint64(freq[s])
    xmax[s] = np.uint64(((RANS_L >> PROB_BITS) << 8)) * f
    cmpl[s] = np.uint64(PROB_SCALE) - f
    if f < 2:
      rcp[s] = np.uint64(0xFFFFFFFF)
      shift[s] = 0
      bias[s] = np.uint64(start[s] + PROB_SCALE - 1)
    else:
      sh = np.uint64(0)
      while f > (np.uint64(1) << sh):
        sh += np.uint64(1)
      rcp[s] = ((np.uint64(1) << (sh + np.uint64(31))) + f - np.uint64(1)) // f
      shift[s] = sh - np.uint64(1)
      bias[s] = np.uint64(start[s])
  x = np.uint64(RANS_L)
  o = np.int64(out.size)
  p = np.int64(raw_bits)
  for i in range(n - 1, -1, -1):
    sym, w, extra = symbol_of(z[i])
    if w:
      p -= w
      q, b = p >> 6, np.uint64(p & 63)
      raw[q] |= extra << b
      raw[q + 1] |= (extra >> np.uint64(1)) >> (np.uint64(63) - b)
    if use_rans:
      s = lut[sym]
      while x >= xmax[s]:
        o -= 1
        out[o] = np.uint8(x & np.uint64(0xFF))
        x >>= np.uint64(8)
      qq = ((x * rcp[s]) >> np.uint64(32)) >> shift[s]
      x = x + bias[s] + qq * cmpl[s]
  if use_rans:
    for _ in range(4):
      o -= 1
      out[o] = np.uint8(x & np.uint64(0xFF))
      x >>= np.uint64(8)
  return out[o:], raw


@numba.njit(**_JIT)
def stream_decode(code, raw, raw_bits, present, freq, start, n, limit, unzig, out, seen):
  """Decodes n integers (each < limit) into out; code: rANS bytes (empty when only one
  symbol is present), raw: the raw-bit words. seen counts each slot. unzig: store the
  wrapping offset of each zigzag code (1: codes must be nonzero). Returns an error code;
  the rANS stream must end in its initial state having read exactly every byte."""
  m = present.size
  slot_of = np.zeros(PROB_SCALE, np.uint8)
  for s in range(m):
    for t in range(start[s], start[s] + freq[s]):
      slot_of[t] = s
  use_rans = m > 1
  pos = np.int64(0)
  x = np.uint64(0)
  if use_rans:
    if code.size < 4:
      return E_TRUNCATED
    for _ in range(4):
      x = (x << np.uint64(8)) | np.uint64(code[pos])
      pos += 1
  p = np.int64(0)
  nw = raw.size
  mask = np.uint64(PROB_SCALE - 1)
  for i in range(n):
    s = 0
    if use_rans:
      slot = x & mask
      s = slot_of[slot]
      x = np.uint64(freq[s]) * (x >> np.uint64(PROB_BITS)) + slot - np.uint64(start[s])
      while x < np.uint64(RANS_L):
        if pos >= code.size:
          return E_TRUNCATED
        x = (x << np.uint64(8)) | np.uint64(code[pos])
        pos += 1
    seen[s] += 1
    sym = present[s]
    if sym < DIRECT:
      z = np.uint64(sym)
    else:
      t = sym - DIRECT
      w = t // 4 + 2
      if p + w > raw_bits:
        return E_TRUNCATED
      q, b = p >> 6, np.uint64(p & 63)
      r = raw[q] >> b
      if q + 1 < nw:
        r |= (raw[q + 1] << np.uint64(1)) << (np.uint64(63) - b)
      r &= (np.uint64(1) << np.uint64(w)) - np.uint64(1)
      p += w
      z = ((np.uint64(4) | np.uint64(t % 4)) << np.uint64(w)) | r
    if z >= limit:
      return E_RANGE
    if unzig:
      if unzig == 1 and z == 0:
        return E_ZERO
      out[i] = (z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1)))
    else:
      out[i] = z
  if use_rans and (x != np.uint64(RANS_L) or pos != code.size):
    return E_STATE
  if p != raw_bits:
    return E_TRUNCATED
  return OK


@numba.njit(**_JIT)
def scatter_add(out, idx, off, lo, hi, start):
  """out[idx[i] - start] += off[i] (wrapping) for i in lo..hi-1; idx[lo:hi] lie in out."""
  for i in range(lo, hi):
    out[idx[i] - start] += off[i]


# ---- int8 quantizer ----------------------------------------------------------------------

@numba.njit(**_JIT)
def absmax_rows(x, out):
  """out[r] = max |x[r, :]| in float64; returns False when x has a NaN or infinity."""
  bad = 0.0
  for r in range(x.shape[0]):
    m = 0.0
    for c in range(x.shape[1]):
      v = np.float64(x[r, c])
      bad += v - v
      a = abs(v)
      m = a if a > m else m
    out[r] = m
  return bad == 0.0


@numba.njit(**_JIT)
def absmax_cols(x, out, bad):
  """out[c] = max(out[c], max |x[:, c]|) (exact, in x's dtype); bad[c] turns NaN when
  column c holds a NaN or infinity (per-column accumulators keep the loop vectorisable)."""
  for r in range(x.shape[0]):
    for c in range(x.shape[1]):
      v = x[r, c]
      bad[c] += v - v
      a = abs(v)
      out[c] = a if a > out[c] else out[c]


_ROUND = 6755399441055744.0  # 1.5 * 2**52: (q + _ROUND) - _ROUND rounds half to even


@numba.njit(inline="always", **_JIT)
def _code(v, s):
  q = v / s
  q = -128.0 if q < -128.0 else (128.0 if q > 128.0 else q)
  q = (q + _ROUND) - _ROUND
  q = -127.0 if q < -127.0 else (127.0 if q > 127.0 else q)
  return np.int8(q)


@numba.njit(inline="always", **_JIT)
def _code_f32(v, s, inv):
  """_code(v, s) for float32 v and bf16 s without a division: v has 24 significant bits and
  every rounding boundary (k + 1/2) * s only 16, so a nonzero |v - boundary| is at least
  |v / s| * 2**-24 relative, far above the error of v * fl(1/s); exact ties (v - c*s = s/2,
  computed exactly) are sent to the even code."""
  q = v * inv
  q = -128.0 if q < -128.0 else (128.0 if q > 128.0 else q)
  c = (q + _ROUND) - _ROUND
  r = v - c * s
  tie = 2.0 * abs(r) == s
  odd = (c * 0.5) != ((c * 0.5 + _ROUND) - _ROUND)
  c = c + ((1.0 if r > 0 else -1.0) if (tie and odd) else 0.0)
  c = -127.0 if c < -127.0 else (127.0 if c > 127.0 else c)
  return np.int8(c)


@numba.njit(**_JIT)
def quantize_cols_f32(x, scale, inv, codes):
  """quantize_cols for float32 x (bit-identical, no division; see _code_f32)."""
  for r in range(x.shape[0]):
    for c in range(x.shape[1]):
      codes[r, c] = _code_f32(np.float64(x[r, c]), scale[c], inv[c])


@numba.njit(**_JIT)
def quantize_cols(x, scale, codes):
  """codes = clip(round_half_even(x / scale[col]), -127, 127) in float64 (scale > 0)."""
  for r in range(x.shape[0]):
    for c in range(x.shape[1]):
      codes[r, c] = _code(np.float64(x[r, c]), scale[c])


@numba.njit(**_JIT)
def quantize_rows(x, scale, codes):
  """codes = clip(round_half_even(x / scale[row]), -127, 127) in float64 (scale > 0)."""
  for r in range(x.shape[0]):
    s = scale[r]
    for c in range(x.shape[1]):
      codes[r, c] = _code(np.float64(x[r, c]), s)
