"""Static rANS, four interleaved states, 16-bit renormalisation: compiled and branch-free.

Symbol i goes through state i % 4, so four independent dependency chains overlap in the
CPU, and renormalisation moves one 16-bit word at most once per symbol, written (or read)
unconditionally and kept (or consumed) by arithmetic on a flag: no data-dependent branch.
About 2-3 ns per symbol each way where a byte-wise single-state coder took 7-10.
States lie in [L, 2**31) with L = 2**15 and 12-bit probabilities, so the reciprocal
division of the encoder is exact (Alverson; as in ryg_rans), one renormalisation step
always suffices, and the decoder's table (one entry per probability position, holding
frequency, offset and output value) stays in L1 cache.

Code layout (uint16 words): the four final states, two words each (high word first,
state 0 first), then the renormalisation words in the order the decoder reads them.
Decoding maps slots back to integers: symbols >= loops.DIRECT carry raw low bits
(loops.symbol_of), kept in a separate LSB-first bit stream in symbol order.
"""

import numba
import numpy as np

from rlax_ps.sync.intrinsics import copy_bytes
from rlax_ps.sync.loops import DIRECT, E_RANGE, E_STATE, E_TRUNCATED, E_ZERO, OK, _put_varint

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
L = 1 << 15
_JIT = dict(nogil=True, cache=True, boundscheck=False)
_U16 = np.uint64(16)
_LOW = np.uint64(0xFFFF)


@numba.njit(**_JIT)
def normalize(counts):
  """Symbol counts (all > 0, at least two) -> frequencies summing to PROB_SCALE, each >= 1;
  integer arithmetic only, so encoder and decoder agree exactly. Raising rare symbols to 1
  is paid for by the largest frequencies (the first of them), an eighth of one at a time."""
  n = np.int64(0)
  for c in counts:
    n += np.int64(c)
  f = np.empty(counts.size, np.int64)
  excess = np.int64(-PROB_SCALE)
  for i in range(counts.size):
    f[i] = max(np.int64(1), (np.int64(counts[i]) * PROB_SCALE) // n)
    excess += f[i]
  while excess > 0:
    i = np.argmax(f)
    d = min(excess, max(np.int64(1), f[i] // 8))
    f[i] -= d
    excess -= d
  f[np.argmax(f)] -= excess
  return f


@numba.njit(**_JIT)
def _tables(freq, start):
  """Per slot: x_max, reciprocal, shift, bias, complement (ryg_rans' RansEncSymbol)."""
  tab = np.zeros((freq.size, 5), np.uint64)
  for s in range(freq.size):
    f = np.uint64(freq[s])
    tab[s, 0] = np.uint64((L >> PROB_BITS) << 16) * f
    tab[s, 4] = np.uint64(PROB_SCALE) - f
    if f < 2:
      tab[s, 1] = np.uint64(0xFFFFFFFF)
      tab[s, 2] = 0
      tab[s, 3] = np.uint64(start[s] + PROB_SCALE - 1)
    else:
      sh = np.uint64(0)
      while f > (np.uint64(1) << sh):
        sh += np.uint64(1)
      tab[s, 1] = ((np.uint64(1) << (sh + np.uint64(31))) + f - np.uint64(1)) // f
      tab[s, 2] = sh - np.uint64(1)
      tab[s, 3] = np.uint64(start[s])
  return tab


@numba.njit(inline="always", **_JIT)
def _put(x, s, xmax, rcp, shift, bias, cmpl, out, o):
  """Encodes slot s into state x; returns (x, o)."""
  b = np.uint64(x >= xmax[s])
  out[o - 1] = np.uint16(x & _LOW)
  o -= np.int64(b)
  x >>= b << np.uint64(4)
  q = ((x * rcp[s]) >> np.uint64(32)) >> shift[s]
  return x + bias[s] + q * cmpl[s], o


@numba.njit(**_JIT)
def _encode_slots(sl, tab):
  """rANS words of the slots sl (table rows of tab), encoded backwards in four states."""
  n = sl.size
  out = np.empty(n + 8, np.uint16)
  xmax, rcp, shift = tab[:, 0].copy(), tab[:, 1].copy(), tab[:, 2].copy()
  bias, cmpl = tab[:, 3].copy(), tab[:, 4].copy()
  o = np.int64(out.size)
  xs = np.full(4, np.uint64(L))
  body = n - n % 4
  for i in range(n - 1, body - 1, -1):
    x, o = _put(xs[i & 3], sl[i], xmax, rcp, shift, bias, cmpl, out, o)
    xs[i & 3] = x
  x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
  for i in range(body - 4, -1, -4):
    x3, o = _put(x3, sl[i + 3], xmax, rcp, shift, bias, cmpl, out, o)
    x2, o = _put(x2, sl[i + 2], xmax, rcp, shift, bias, cmpl, out, o)
    x1, o = _put(x1, sl[i + 1], xmax, rcp, shift, bias, cmpl, out, o)
    x0, o = _put(x0, sl[i], xmax, rcp, shift, bias, cmpl, out, o)
  for x in (x3, x2, x1, x0):
    out[o - 1] = np.uint16(x & _LOW)
    out[o - 2] = np.uint16(x >> _U16)
    o -= 2
  return out[o:]


@numba.njit(**_JIT)
def encode(syms, freq):
  """rANS words of the symbols syms (uint8) under frequencies freq indexed by symbol
  (summing to PROB_SCALE; at least two nonzero)."""
  start = np.cumsum(freq) - freq
  return _encode_slots(syms, _tables(freq, start))


@numba.njit(**_JIT)
def symbol_stream(hist, syms, raw, widths):
  """entropy.py's stream of symbols `syms` (uint8; their counts `hist`, by symbol, and
  their raw low bits: the words `raw`, widths[symbol] bits each), as uint8: the symbol
  table and counts, the rANS words (where two or more symbols occur), the raw bytes."""
  m, raw_bits = 0, np.int64(0)
  for s in range(hist.size):
    m += hist[s] > 0
    raw_bits += hist[s] * widths[s]
  present = np.empty(m, np.int64)
  j = 0
  for s in range(hist.size):
    if hist[s] > 0:
      present[j] = s
      j += 1
  out = np.empty(1 + 11 * m, np.uint8)
  out[0] = m
  p = 1
  for i in range(m):
    out[p] = present[i]
    p += 1
  for i in range(m):
    p = _put_varint(out, p, hist[present[i]])
  if m == 0:
    return out[:p]
  code = np.empty(0, np.uint16)
  if m > 1:
    freq = np.zeros(hist.size, np.int64)
    freq[present] = normalize(hist[present])
    code = encode(syms, freq)
  raw_nbytes = (raw_bits + 7) // 8
  whole = np.empty(p + 20 + 2 * code.size + raw_nbytes, np.uint8)
  whole[:p] = out[:p]
  if m > 1:
    p = _put_varint(whole, p, code.size)
    copy_bytes(whole.ctypes.data + p, code.ctypes.data, 2 * code.size)  # little-endian
    p += 2 * code.size
  p = _put_varint(whole, p, raw_nbytes)
  copy_bytes(whole.ctypes.data + p, raw.ctypes.data, raw_nbytes)
  return whole[:p + raw_nbytes]


@numba.njit(inline="always", **_JIT)
def _get(x, code, pos, last, dtab):
  """One decoding step of state x: returns (slot position, x, pos)."""
  sl = x & np.uint64(PROB_SCALE - 1)
  e = np.uint64(dtab[sl])
  x = (e >> _U16) * (x >> np.uint64(PROB_BITS)) + (e & _LOW)
  b = np.uint64(x < np.uint64(L))
  w = np.uint64(code[min(pos, last)])
  x = (x << (b << np.uint64(4))) | (w & (np.uint64(0) - b))
  return sl, x, pos + np.int64(b)


@numba.njit(**_JIT)
def _decode(code, dtab, vtab, out, slots):
  """out[i] = vtab[probability position of symbol i], slots[i] = that position (uint16),
  from the rANS words;
  returns an error code (every state must end at L having read exactly every word)."""
  n = out.size
  if code.size < 8:
    return E_TRUNCATED
  xs = np.zeros(4, np.uint64)
  for j in range(4):
    xs[j] = (np.uint64(code[2 * j]) << _U16) | np.uint64(code[2 * j + 1])
    if xs[j] < np.uint64(L) or xs[j] >= np.uint64(1 << 31):
      return E_STATE
  x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
  pos, last = np.int64(8), code.size - 1
  body = n - n % 4
  for i in range(0, body, 4):
    s0, x0, pos = _get(x0, code, pos, last, dtab)
    s1, x1, pos = _get(x1, code, pos, last, dtab)
    s2, x2, pos = _get(x2, code, pos, last, dtab)
    s3, x3, pos = _get(x3, code, pos, last, dtab)
    out[i], out[i + 1], out[i + 2], out[i + 3] = vtab[s0], vtab[s1], vtab[s2], vtab[s3]
    slots[i], slots[i + 1], slots[i + 2], slots[i + 3] = s0, s1, s2, s3
  xs[0], xs[1], xs[2], xs[3] = x0, x1, x2, x3
  for i in range(body, n):
    s, x, pos = _get(xs[i & 3], code, pos, last, dtab)
    out[i], slots[i] = vtab[s], s
    xs[i & 3] = x
  for j in range(4):
    if xs[j] != np.uint64(L):
      return E_STATE
  return OK if pos == code.size else E_STATE


@numba.njit(**_JIT)
def _raw_values(slots, wide, raw, raw_bits, limit, unzig, out):
  """Completes out[i] for the symbols with raw bits (wide[slots[i]]: the symbol at that
  probability position when it carries raw bits, else 0)."""
  nw = raw.size
  p = np.int64(0)
  for i in range(slots.size):
    sym = wide[slots[i]]
    if sym:
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
      out[i] = (z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1))) if unzig else z
  return OK if p == raw_bits else E_TRUNCATED


@numba.njit(**_JIT)
def _decode_tables(freq, value, wide, dtab, vtab, wtab):
  """Per probability position p of symbol slot s: dtab[p] = freq[s] << 16 | (p - start of
  s), vtab[p] = value[s], wtab[p] = wide[s]."""
  p = 0
  for s in range(freq.size):
    for j in range(freq[s]):
      dtab[p] = (np.uint32(freq[s]) << np.uint32(16)) | np.uint32(j)
      vtab[p] = value[s]
      wtab[p] = wide[s]
      p += 1


def decode(code, raw, raw_bits, present, freq, n, limit, unzig, out) -> int:
  """Decodes n integers (each < limit) into out; code: rANS words (ignored when only one
  symbol is present), raw: the raw-bit words. unzig: store the wrapping offset of each
  zigzag code (1: codes must be nonzero). Returns an error code."""
  m = present.size
  value = present.astype(np.uint64)
  direct = present < DIRECT
  if np.any(direct & (value >= limit)):
    return E_RANGE
  if unzig == 1 and present[0] == 0:
    return E_ZERO
  if unzig:
    value = (value >> np.uint64(1)) ^ (np.uint64(0) - (value & np.uint64(1)))
  wide = np.where(direct, 0, present).astype(np.int64)
  if m == 1:
    slots = np.zeros(n, np.uint16)
    out[:] = value[0]
    wtab = wide
  else:
    if freq.size != m or int(freq.sum()) != PROB_SCALE:  # normalize guarantees both
      return E_STATE
    dtab = np.empty(PROB_SCALE, np.uint32)
    vtab = np.empty(PROB_SCALE, out.dtype)
    wtab = np.empty(PROB_SCALE, np.int64)
    _decode_tables(freq, value.astype(out.dtype), wide, dtab, vtab, wtab)
    slots = np.empty(n, np.uint16)
    err = _decode(code, dtab, vtab, out, slots)
    if err != OK:
      return err
  if not raw_bits:
    return OK
  return _raw_values(slots, wtab, raw, raw_bits, np.uint64(limit), unzig, out)
