"""Compiled (numba) loops of the codec: the fused change scan, Rice bit streams, scatter.

numpy would need a separate pass (and a temporary array) per step; the scan compares 64
elements at a time into a bit mask (word-parallel, at memory bandwidth) and walks only
the set bits to emit gap, symbol and raw bits of each change, a few ns per change. Every
decoder checks bounds and returns an error code (never reads or writes outside its
arrays), so corrupted input cannot crash it. The rANS coder is in rans.py.

Bit streams are LSB-first in little-endian uint64 words. Symbols: z < 16 is its own
symbol; a larger z is its bit length and the two bits below its leading one (four symbols
per octave) plus its remaining low bits, sent raw.
"""

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros

from rlax_ps.sync import chosen
from rlax_ps.sync.intrinsics import call_hash, changed_u8, changed_u16


DIRECT = 16
ALPHABET = DIRECT + 4 * (56 - 4)  # z < 2**56
# Raw low bits of each symbol (read-only).
WIDTHS = np.where(np.arange(ALPHABET) < DIRECT, 0, (np.arange(ALPHABET) - DIRECT) // 4 + 2)
WIDTHS.flags.writeable = False
_JIT = dict(nogil=True, cache=True, boundscheck=False)
# Bytes of each array that one compiled call scans, codes or applies before the caller
# hashes them, still in cache: larger calls cost fewer Python iterations, and calls larger
# than the L2 cache hash slower.
# A multiple of a joint round (4 blocks of 64K bf16 elements): joint calls take whole rounds.
CALL_BYTES = 1 << 19

OK, E_TRUNCATED, E_RANGE, E_STATE, E_ZERO = range(5)
# Layout constants shared with the modules that define the layouts (tensor_codec, entropy,
# bits), here for the compiled readers.
RICE, RICE_MULTI = 0x80, 0x40  # a sparse section's Rice gap coder byte: flags | k
LITERAL, LITERAL_MAX = 255, 4096  # an entropy stream's literal tag, its longest stream
FIXED_MIN = 64  # values from which fixed-width fields take the byte-plane layout


@numba.njit(inline="always", **_JIT)
def _bitlen(z):
  if z == 0:
    return np.int64(0)
  return np.int64(64) - np.int64(leading_zeros(np.uint64(z)))


@numba.njit(inline="always", **_JIT)
def popcount(x):
  """Set bits of the uint64 x (LLVM emits popcnt)."""
  x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
  x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
  x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
  return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


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

@numba.njit(inline="always", **_JIT)
def _group_mask(aw, bw, g, lane_bits):
  """Bit j set where element j of the g-th group of 64 elements differs (aw, bw: the
  elements as uint64 words of 64 // lane_bits lanes): one SIMD compare (intrinsics.py)."""
  at = np.int64(g) * lane_bits * 8
  if lane_bits == 16:
    return changed_u16(aw.ctypes.data + at, bw.ctypes.data + at)
  return changed_u8(aw.ctypes.data + at, bw.ctypes.data + at)


@numba.njit(inline="always", **_JIT)
def _take(a, b, i, lane_bits):
  """Zigzag code of the wrapping offset b[i] - a[i]."""
  i = np.uint64(i)
  if lane_bits == 16:
    d = np.int32(np.int16(np.int32(b[i]) - np.int32(a[i])))
    z = ((d << 1) ^ (d >> 15)) & 65535
  else:
    d = np.int32(np.int8(np.int32(b[i]) - np.int32(a[i])))
    z = ((d << 1) ^ (d >> 7)) & 255
  return np.uint64(z)


@numba.njit(inline="always", **_JIT)
def _scan_block(aw, bw, a, b, start, st, gaps, syms, raw, hist, lane_bits):
  """Appends the changes of one block (a, b: unsigned bit arrays of one width; aw, bw:
  their first 64-element groups as uint64 words) to gaps (index - previous changed index
  - 1), syms (entropy-stage symbol of the zigzag offset) and raw (its raw low bits,
  LSB first), and counts symbols in hist (4 rows, summed by the caller, so that runs of
  one symbol do not serialise on one counter). st = [pos, prev index, raw bit pos].
  Returns False (nothing done) when gaps may lack room for the block. raw's words past
  the current one are written, never read (only raw[0] must start at 0), so that raw can
  be a reused buffer. lane_bits: 8 *
  a.itemsize, a constant of each compiled specialisation (see scan_block)."""
  if gaps.size - st[0] < a.size or raw.size * 64 - st[2] < a.size * 16:
    return False
  pos, prev, rp = st[0], st[1], st[2]
  groups = aw.size // lane_bits  # 64 elements: 16 words of 4 lanes or 8 words of 8
  for g in range(groups):
    m = _group_mask(aw, bw, g, lane_bits)
    while m:
      i = g * 64 + np.int64(trailing_zeros(m))
      m &= m - np.uint64(1)
      z = _take(a, b, i, lane_bits)
      gaps[pos] = start + i - prev - 1
      prev = start + i
      if z < np.uint64(DIRECT):
        syms[pos] = z
        hist[pos & 3, z] += 1
      else:
        sym, w, extra = symbol_of(z)
        syms[pos] = sym
        hist[pos & 3, sym] += 1
        q, o = rp >> 6, np.uint64(rp & 63)
        raw[q] |= extra << o
        raw[q + 1] = (extra >> np.uint64(1)) >> (np.uint64(63) - o)
        rp += w
      pos += 1
  for i in range(groups * 64, a.size):
    if a[i] != b[i]:
      z = _take(a, b, i, lane_bits)
      gaps[pos] = start + i - prev - 1
      prev = start + i
      sym, w, extra = symbol_of(z)
      syms[pos] = sym
      hist[pos & 3, sym] += 1
      if w:
        q, o = rp >> 6, np.uint64(rp & 63)
        raw[q] |= extra << o
        raw[q + 1] = (extra >> np.uint64(1)) >> (np.uint64(63) - o)
        rp += w
      pos += 1
  st[0], st[1], st[2] = pos, prev, rp
  return True


@numba.njit(**_JIT)
def _scan_block16(aw, bw, a, b, start, st, gaps, syms, raw, hist):
  return _scan_block(aw, bw, a, b, start, st, gaps, syms, raw, hist, 16)


@numba.njit(**_JIT)
def _scan_block8(aw, bw, a, b, start, st, gaps, syms, raw, hist):
  return _scan_block(aw, bw, a, b, start, st, gaps, syms, raw, hist, 8)


_SCANS = {16: _scan_block16, 8: _scan_block8}  # by lane bits
scan_chosen = chosen.by_constant(_SCANS, "scan_chosen")


def scan_block(aw, bw, a, b, start, st, gaps, syms, raw, hist) -> bool:
  """_scan_block compiled for the element width of a (16 or 8 bits)."""
  return _SCANS[8 * a.itemsize](aw, bw, a, b, start, st, gaps, syms, raw, hist)


@numba.njit(inline="always", **_JIT)
def _zigzag_at(old, new, gaps, lane_bits):
  out = np.empty(gaps.size, old.dtype)
  i = np.int64(-1)
  for t in range(gaps.size):
    i += np.int64(gaps[t]) + 1
    out[t] = _take(old, new, i, lane_bits)
  return out


@numba.njit(**_JIT)
def _zigzag_at16(old, new, gaps):
  return _zigzag_at(old, new, gaps, 16)


@numba.njit(**_JIT)
def _zigzag_at8(old, new, gaps):
  return _zigzag_at(old, new, gaps, 8)


def zigzag_at(old: np.ndarray, new: np.ndarray, gaps: np.ndarray) -> np.ndarray:
  """Zigzag codes (old's dtype) of the wrapping offsets new - old at the changes that
  `gaps` (index - previous index - 1, ascending, in bounds) mark: one pass, no index
  array."""
  return (_zigzag_at16 if old.itemsize == 2 else _zigzag_at8)(old, new, gaps)


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
def symbols(z, raw_bits):
  """(entropy-stage symbol of each z as uint8, raw-bit words: the low bits of every
  z >= DIRECT, in order; raw_bits of them in all)."""
  syms = np.empty(z.size, np.uint8)
  raw = np.zeros((raw_bits + 63) // 64 + 1, np.uint64)
  p = np.int64(0)
  for i in range(z.size):
    zi = np.uint64(z[i])
    if zi < np.uint64(DIRECT):
      syms[i] = zi
    else:
      sym, w, extra = symbol_of(zi)
      syms[i] = sym
      q, b = p >> 6, np.uint64(p & 63)
      raw[q] |= extra << b
      raw[q + 1] |= (extra >> np.uint64(1)) >> (np.uint64(63) - b)
      p += w
  return syms, raw


@numba.njit(inline="always", **_JIT)
def hash_parts(fn, at, itemsize, ends, first, last, out):
  """out[j] = xxh3-64 of part j of the array at byte address `at` (parts back to back,
  part j ending at element ends[j]) for j in first..last-1, by the C function at address fn
  (integrity.XXH3): a pack's members hashed right after they were coded, in cache."""
  start = np.int64(0) if first == 0 else np.int64(ends[first - 1])
  for j in range(first, last):
    out[j] = call_hash(fn, at + start * itemsize, (np.int64(ends[j]) - start) * itemsize)
    start = np.int64(ends[j])


@numba.njit(**_JIT)
def hash_all(fn, at, itemsize, ends, out):
  """hash_parts of every part."""
  hash_parts(fn, at, itemsize, ends, 0, ends.size, out)


@numba.njit(inline="always", **_JIT)
def _seal_into(fn, digests, tmp, out, o):
  """integrity.Seal's digest (out[o]: xxh3-64 of the digests as little-endian uint64s) and
  group locators (out[o + 1 + g], all 64 bits: the caller keeps the locator's width) over
  `digests`, by the C function at address fn; returns the position after them."""
  n = digests.size
  out[o] = call_hash(fn, digests.ctypes.data, 8 * n)
  o += 1
  for j in range(_bitlen(n - 1) if n > 1 else 0):
    for side in range(2):
      c = 0
      for i in range(n):
        if (i >> j) & 1 == side:
          tmp[c] = digests[i]
          c += 1
      out[o] = call_hash(fn, tmp.ctypes.data, 8 * c)
      o += 1
  return o


@numba.njit(**_JIT)
def seal_words(fn, digests):
  """_seal_into of one seal, as a new uint64 array."""
  out = np.empty(1 + 2 * 64, np.uint64)
  return out[:_seal_into(fn, digests, np.empty(digests.size, np.uint64), out, 0)]


OVERHEAD = 10  # an entropy stream's bytes besides its rANS and raw bytes (entropy.py)


@numba.njit(**_JIT)
def cost_of(bits, present):
  """Estimated bytes of an entropy-stage stream whose symbols carry `bits` information +
  raw bits, with `present` distinct symbols (the table's bytes)."""
  if present == 0:
    return 1.0
  return bits / 8 + 1 + 4 * present + OVERHEAD


@numba.njit(**_JIT)
def entropy_bits(hist, widths):
  """(zeroth-order information bits of the symbol counts hist + their raw bits
  (widths[symbol] each), number of symbols present)."""
  n = 0
  for c in hist:
    n += c
  bits, present = 0.0, 0
  for s in range(hist.size):
    c = hist[s]
    if c > 0:
      bits += c * np.log2(n / c) + c * widths[s]
      present += 1
  return bits, present


@numba.njit(inline="always", **_JIT)
def best_rice(gaps, count, step, above, kmax):
  """(k, its code's bits) of the Rice parameter whose code of every `step`-th of the first
  `count` gaps is shortest, among k0 - 1 .. k0 + above - 1 (k0: log2 of the mean gap times
  ln 2, the geometric optimum; below kmax)."""
  m, total = (count + step - 1) // step, np.uint64(0)  # an exact sum: gaps < 2^53 in all
  if step == 1:  # unit stride: loops LLVM vectorises
    for i in range(count):
      total += np.uint64(gaps[i])
  else:
    for i in range(0, count, step):
      total += np.uint64(gaps[i])
  k0 = max(0, int(np.log2(np.float64(total) / m * np.log(2) + 1)))
  best_k, best = 0, np.int64(-1)
  for k in range(max(0, k0 - 1), min(kmax, k0 + above)):
    t = np.uint64(0)
    if step == 1:
      for i in range(count):
        t += np.uint64(gaps[i]) >> np.uint64(k)
    else:
      for i in range(0, count, step):
        t += np.uint64(gaps[i]) >> np.uint64(k)
    size = np.int64(t) + m * (k + 1)  # quotients, stops, k low bits each
    if best < 0 or size < best:
      best, best_k = size, k
  return best_k, best


@numba.njit(**_JIT)
def gap_plan(gaps, step, widths):
  """Costs of every `step`-th gap (a sample): (the Rice parameter k among the three
  nearest log2 of the mean gap whose code is shortest, that code's bits, the entropy
  stage's information + raw bits (entropy_bits), symbols present)."""
  best_k, best = best_rice(gaps, gaps.size, step, 2, 56)
  hist = np.zeros(widths.size, np.int64)
  for i in range(0, gaps.size, step):
    s, _, _ = symbol_of(gaps[i])
    hist[s] += 1
  bits, present = entropy_bits(hist, widths)
  return best_k, best, bits, present


@numba.njit(inline="always", **_JIT)
def _sparse_costs(old, new, gaps, hist, step, widths, literal_max, lane_bits):
  z = _zigzag_at(old, new, gaps[:gaps.size if gaps.size <= literal_max else 0], lane_bits)
  top = z.max() if z.size else 0
  vbits, vpresent = entropy_bits(hist, widths)
  k, rice_bits, gbits, gpresent = gap_plan(gaps, step, widths)
  return z, int(top), vbits, vpresent, k, rice_bits, gbits, gpresent


@numba.njit(**_JIT)
def _sparse_costs16(old, new, gaps, hist, step, widths, literal_max):
  return _sparse_costs(old, new, gaps, hist, step, widths, literal_max, 16)


@numba.njit(**_JIT)
def _sparse_costs8(old, new, gaps, hist, step, widths, literal_max):
  return _sparse_costs(old, new, gaps, hist, step, widths, literal_max, 8)


_COSTS = {16: _sparse_costs16, 8: _sparse_costs8}  # by lane bits
costs_chosen = chosen.by_constant(_COSTS, "costs_chosen")


def sparse_costs(old, new, gaps, hist, step, widths, literal_max):
  """What a sparse section's choices need, in one call: (zigzag codes at the changes as
  zigzag_at gives them, or an empty array above literal_max changes; their largest, 0 if
  none; entropy_bits of the value histogram `hist`; gap_plan of the gaps at `step`)."""
  return _COSTS[8 * old.itemsize](old, new, gaps, hist, step, widths, literal_max)


# ---- Rice-coded gaps ---------------------------------------------------------------------

@numba.njit(**_JIT)
def rice_encode(gaps, k):
  """(words, bits, sum of the gaps) of the gaps as q zeros, a one, then k low bits (LSB
  first). A 64-bit accumulator takes each code in one shift-or and spills full words
  without branching on the data (quotients of >= 63 - k zeros take a slow path)."""
  total, gap_sum = np.uint64(0), np.uint64(0)
  for i in range(gaps.size):
    total += np.uint64(gaps[i]) >> np.uint64(k)
    gap_sum += np.uint64(gaps[i])
  nbits = np.int64(total) + gaps.size * (k + 1)
  out = np.zeros(nbits // 64 + 2, np.uint64)
  kk = np.uint64(k)
  mask = (np.uint64(1) << kk) - np.uint64(1)
  lim = np.uint64(63 - k)
  acc, fill, wpos = np.uint64(0), np.uint64(0), np.int64(0)
  for i in range(gaps.size):
    g = np.uint64(gaps[i])
    q = g >> kk
    while q >= lim:  # zeros of a long quotient, lim at a time
      fill += lim
      out[wpos] = acc
      if fill >= np.uint64(64):
        wpos += 1
        acc = np.uint64(0)
        fill -= np.uint64(64)
      q -= lim
    v = (((g & mask) << np.uint64(1)) | np.uint64(1)) << q
    acc |= v << fill
    before = fill
    fill += q + kk + np.uint64(1)
    out[wpos] = acc
    c = fill >> np.uint64(6)
    wpos += np.int64(c)
    acc = (v >> ((np.uint64(64) - before) & np.uint64(63))) if c else acc
    fill &= np.uint64(63)
  out[wpos] = acc
  return out, nbits, gap_sum


@numba.njit(inline="always", **_JIT)
def _put_varint(out, p, x):
  """Writes the LEB128 varint of x >= 0 at out[p]; returns the position after it."""
  x = np.uint64(x)
  while x >= np.uint64(128):
    out[p] = np.uint8((x & np.uint64(127)) | np.uint64(128))
    x >>= np.uint64(7)
    p += 1
  out[p] = np.uint8(x)
  return p + 1


@numba.njit(**_JIT)
def rice_layout(gaps, k, streams, head):
  """The Rice gap layout of tensor_codec (u8 head, `streams` varint byte lengths, streams - 1
  varint indices of the change before each later stream, then the Rice streams of equal
  shares of the gaps, the last taking the rest) as one uint8 array."""
  nnz = gaps.size
  share = nnz // streams
  coded = [rice_encode(gaps[j * share:nnz if j == streams - 1 else (j + 1) * share], k)
           for j in range(streams)]
  total = 0
  for words, nbits, _ in coded:
    total += (nbits + 7) // 8
  out = np.empty(1 + 20 * streams + total, np.uint8)
  out[0] = head
  p = 1
  for words, nbits, _ in coded:
    p = _put_varint(out, p, (nbits + 7) // 8)
  last = np.int64(-1)
  for j in range(streams - 1):
    last += np.int64(coded[j][2]) + share
    p = _put_varint(out, p, last)
  for words, nbits, _ in coded:
    b = words.view(np.uint8)
    for t in range((nbits + 7) // 8):
      out[p] = b[t]
      p += 1
  return out[:p]


@numba.njit(inline="always", **_JIT)
def _peek(words, p):
  """The 64 bits from bit p on (words[p // 64 + 1] must exist)."""
  q, o = np.uint64(p) >> np.uint64(6), np.uint64(p & 63)  # unsigned: no wraparound test
  return (words[q] >> o) | ((words[q + np.uint64(1)] << np.uint64(1)) << (np.uint64(63) - o))


@numba.njit(inline="always", **_JIT)
def unary(words, p, end):
  """(64 bits from the unary code at bit p on, its zeros before the 64-bit window's
  lowest set bit, position of that window, ok): runs of 64 or more zeros move the window;
  ok is False when they pass `end`."""
  w = _peek(words, p)
  quot = np.int64(0)
  while w == 0:  # a quotient of 64 or more zeros
    quot += 64
    p += 64
    if p >= end:
      return w, quot, p, False
    w = _peek(words, p)
  return w, quot, p, True


@numba.njit(inline="always", **_JIT)
def _rice_next(words, p, end, prev, k, qmax):
  """Decodes one gap at bit p (codes end by bit `end`, quotients <= qmax); returns
  (p, index, ok). Indices only grow: the caller checks the last one against the size."""
  w, quot, p, ok = unary(words, p, end)
  if not ok:
    return p, prev, False
  t = np.int64(trailing_zeros(w))
  quot += t
  p += t + 1
  r = (w >> np.uint64(t)) >> np.uint64(1) if t + 1 + k <= 64 else _peek(words, p)
  p += k
  g = (quot << np.uint64(k)) | np.int64(r & ((np.uint64(1) << np.uint64(k)) - np.uint64(1)))
  return p, prev + 1 + g, (p <= end) & (quot <= qmax)


@numba.njit(**_JIT)
def _rice_streams(words, starts, counts, bases, k, size, idx):
  """Four streams in lockstep (four independent dependency chains), then their tails."""
  qmax = size >> k
  c = counts.min()
  o0, o1, o2, o3 = 0, counts[0], counts[0] + counts[1], counts[0] + counts[1] + counts[2]
  p0, p1, p2, p3 = starts[0] * 8, starts[1] * 8, starts[2] * 8, starts[3] * 8
  e0, e1, e2, e3 = starts[1] * 8, starts[2] * 8, starts[3] * 8, starts[4] * 8
  v0, v1, v2, v3 = bases[0], bases[1], bases[2], bases[3]
  for t in range(c):
    p0, v0, k0 = _rice_next(words, p0, e0, v0, k, qmax)
    p1, v1, k1 = _rice_next(words, p1, e1, v1, k, qmax)
    p2, v2, k2 = _rice_next(words, p2, e2, v2, k, qmax)
    p3, v3, k3 = _rice_next(words, p3, e3, v3, k, qmax)
    if not (k0 & k1 & k2 & k3):
      return E_TRUNCATED
    idx[o0 + t], idx[o1 + t], idx[o2 + t], idx[o3 + t] = v0, v1, v2, v3
  ps, vs = np.array([p0, p1, p2, p3]), np.array([v0, v1, v2, v3])
  for j in range(counts.size):
    o = (o0, o1, o2, o3)[j] if counts.size == 4 else 0
    for t in range(c, counts[j]):
      ps[j], vs[j], good = _rice_next(words, ps[j], starts[j + 1] * 8, vs[j], k, qmax)
      if not good:
        return E_TRUNCATED
      idx[o + t] = vs[j]
  for j in range(counts.size):
    if (ps[j] + 7) // 8 != starts[j + 1] or (j + 1 < counts.size and vs[j] != bases[j + 1]):
      return E_TRUNCATED
    if vs[j] >= size:
      return E_RANGE
  return OK


@numba.njit(**_JIT)
def rice_decode(words, starts, counts, bases, k, size, idx):
  """Inverse of rice_encode for S (1 or 4) streams: stream j starts at byte starts[j], ends
  at byte starts[j + 1] (its codes must end in its last byte), holds counts[j] gaps after
  index bases[j] (-1 for the first) and fills idx from sum(counts[:j]) on; every index
  must be < size and stream j must end at bases[j + 1]. words: entropy.words_of the
  bytes. Returns an error code."""
  s = counts.size
  if words.size < starts[s] // 8 + 2:
    return E_TRUNCATED
  if s == 4:
    return _rice_streams(words, starts, counts, bases, k, size, idx)
  qmax = size >> k
  p, prev, end = starts[0] * 8, bases[0], starts[1] * 8
  for t in range(counts[0]):
    p, prev, good = _rice_next(words, p, end, prev, k, qmax)
    if not good:
      return E_TRUNCATED
    idx[t] = prev
  if (p + 7) // 8 != starts[1]:
    return E_TRUNCATED
  return E_RANGE if prev >= size else OK


@numba.njit(**_JIT)
def round_bf16_bits(src, dst):
  """The bf16 bit patterns (uint16, into dst) of float32 bit patterns src (uint32): round
  to nearest even; NaN to the quiet NaN 0x7FC0 with its sign. Bit for bit as ml_dtypes'
  astype over all 2^32 inputs (a slow test checks every one), in one pass."""
  for i in range(src.size):
    x = src[i]
    r = (x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (x & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    q = ((x >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    dst[i] = np.uint16(q if nan else r)


@numba.njit(**_JIT)
def pack_lsb(values, width):
  """The low `width` (<= 56) bits of each value, concatenated LSB first, as
  ceil(n * width / 8) bytes."""
  nbytes = (values.size * width + 7) // 8
  words = np.zeros(nbytes // 8 + 2, np.uint64)
  mask = (np.uint64(1) << np.uint64(width)) - np.uint64(1)
  p = 0
  for i in range(values.size):
    v = np.uint64(values[i]) & mask
    q, b = p >> 6, np.uint64(p & 63)
    words[q] |= v << b
    words[q + 1] |= (v >> np.uint64(1)) >> (np.uint64(63) - b)
    p += width
  return words.view(np.uint8)[:nbytes].copy()


@numba.njit(**_JIT)
def unpack_lsb(buf, n, width):
  """Inverse of pack_lsb: n values of `width` bits from the bytes buf (exactly
  ceil(n * width / 8) of them, checked by the caller)."""
  words = np.zeros(buf.size // 8 + 2, np.uint64)
  words.view(np.uint8)[:buf.size] = buf
  mask = (np.uint64(1) << np.uint64(width)) - np.uint64(1)
  out = np.empty(n, np.uint64)
  p = 0
  for i in range(n):
    q, b = p >> 6, np.uint64(p & 63)
    out[i] = ((words[q] >> b) | ((words[q + 1] << np.uint64(1)) << (np.uint64(63) - b))) & mask
    p += width
  return out


@numba.njit(inline="always", **_JIT)
def _plane(width, shift):
  """(bits, their mask) of the plane at `shift` of pack_planes' `width`-bit layout; the
  planes before it are whole bytes, so it starts at byte m * shift (m: 8-value groups)."""
  w = min(8, width - shift)
  return w, (np.uint64(1) << np.uint64(w)) - np.uint64(1)


@numba.njit(**_JIT)
def pack_planes(values, width, low):
  """bits.pack_fixed's layout of values - low (n >= 8; all >= low, width <= 56 bits): per
  plane of up to 8 bits (shift 0, 8, ...), every 8 values as the plane's w-bit fields of
  one little-endian word, its low w bytes. One pass per plane, no temporaries."""
  n = values.size
  m = (n + 7) // 8
  out = np.empty(m * width, np.uint8)
  for shift in range(0, width, 8):
    w, mask = _plane(width, shift)
    for g in range(m):
      acc = np.uint64(0)
      for j in range(min(8, n - g * 8)):
        v = (np.uint64(values[g * 8 + j]) - np.uint64(low)) >> np.uint64(shift)
        acc |= (v & mask) << np.uint64(j * w)
      for t in range(w):
        out[m * shift + g * w + t] = np.uint8((acc >> np.uint64(8 * t)) & np.uint64(255))
  return out


@numba.njit(**_JIT)
def unpack_planes(raw, n, width):
  """Inverse of pack_planes with low = 0: n uint64 values from exactly m * width bytes
  (m = ceil(n / 8), checked by the caller)."""
  m = (n + 7) // 8
  out = np.zeros(m * 8, np.uint64)
  for shift in range(0, width, 8):
    w, mask = _plane(width, shift)
    for g in range(m):
      acc = np.uint64(0)
      for t in range(w):
        acc |= np.uint64(raw[m * shift + g * w + t]) << np.uint64(8 * t)
      for j in range(8):
        out[g * 8 + j] |= ((acc >> np.uint64(j * w)) & mask) << np.uint64(shift)
  return out[:n]


@numba.njit(**_JIT)
def literal_stream(z, low, top):
  """entropy.py's literal stream of z (all >= low, the largest `top`), as uint8: its tag,
  its width, the values less `low` in that width (bits.pack_fixed's layout)."""
  width = _bitlen(top - low)
  if z.size < FIXED_MIN:
    packed = pack_lsb(z.astype(np.uint64) - np.uint64(low), width)
  else:
    packed = pack_planes(z, width, low)
  out = np.empty(2 + packed.size, np.uint8)
  out[0], out[1] = LITERAL, width
  out[2:] = packed
  return out


@numba.njit(**_JIT)
def literal_values(z, unzig, out):
  """out[i] = z[i] + 1 (unzig = 1: nonzero codes are stored less 1) or z[i], then as a
  wrapping offset when unzig; returns the largest code for the caller's range check."""
  top = np.uint64(0)
  one = np.uint64(1 if unzig == 1 else 0)
  for i in range(z.size):
    v = np.uint64(z[i]) + one
    top = max(top, v)
    if unzig:
      v = (v >> np.uint64(1)) ^ (np.uint64(0) - (v & np.uint64(1)))
    out[i] = v
  return int(top)


@numba.njit(**_JIT)
def varint_bytes(values):
  """The LEB128 varints of non-negative integers, concatenated (uint8)."""
  out = np.empty(10 * values.size, np.uint8)
  p = 0
  for i in range(values.size):
    x = np.uint64(values[i])
    while x >= np.uint64(128):
      out[p] = np.uint8((x & np.uint64(127)) | np.uint64(128))
      x >>= np.uint64(7)
      p += 1
    out[p] = np.uint8(x)
    p += 1
  return out[:p]


@numba.njit(inline="always", **_JIT)
def _get_varint(buf, pos, end):
  """(value, position after it) of the varint at buf[pos]; position -1 when it runs past
  end, -2 when it has 63 bits or more."""
  n, shift = np.uint64(0), np.uint64(0)
  while True:
    if pos >= end:
      return np.int64(0), -1
    b = np.uint64(buf[pos])
    pos += 1
    n |= (b & np.uint64(127)) << shift
    if b < np.uint64(128):
      break
    shift += np.uint64(7)
    if shift > np.uint64(56):
      return np.int64(0), -2
  if n >> np.uint64(63):
    return np.int64(0), -2
  return np.int64(n), pos


@numba.njit(**_JIT)
def read_varints(buf, pos, end, out):
  """Fills out (int64) with the varints of buf from pos (< end); returns the position
  after them, -1 when they run past end, -2 for one of 63 bits or more."""
  for i in range(out.size):
    out[i], pos = _get_varint(buf, pos, end)
    if pos < 0:
      return pos
  return pos


@numba.njit(**_JIT)
def sparse_literal(buf, n, like):
  """Fast path of tensor_codec's sparse section of n elements (the bytes `buf`) in its
  usual layout, Rice gaps and a literal offset stream: (True, flat indices, wrapping
  offsets of like's dtype), or (False, -, -) when the section has another layout or
  anything the general parser would reject (it then runs and names the problem)."""
  fail = False, np.empty(0, np.int64), np.empty(0, like.dtype)
  end = buf.size
  nnz, p = _get_varint(buf, 0, end)
  if p < 0 or not 0 < nnz <= min(n, LITERAL_MAX) or p >= end:
    return fail
  coder = np.int64(buf[p])
  k, streams = coder & 63, 4 if coder & RICE_MULTI else 1
  if not coder & RICE or k > 56 or streams > nnz:
    return fail
  starts = np.zeros(streams + 1, np.int64)
  bases = np.full(streams, -1, np.int64)
  p += 1
  for j in range(streams):
    length, p = _get_varint(buf, p, end)
    if p < 0 or length > end:
      return fail
    starts[j + 1] = starts[j] + length
  for j in range(1, streams):
    bases[j], p = _get_varint(buf, p, end)
    if p < 0:
      return fail
  total = starts[streams]
  if total > end - p:
    return fail
  words = np.zeros(total // 8 + 2, np.uint64)
  words.view(np.uint8)[:total] = buf[p:p + total]
  p += total
  counts = np.full(streams, nnz // streams, np.int64)
  counts[streams - 1] = nnz - (nnz // streams) * (streams - 1)
  idx = np.empty(nnz, np.int64)
  if rice_decode(words, starts, counts, bases, k, n, idx) != OK or end - p < 2:
    return fail
  width = np.int64(buf[p + 1])
  nbytes = (nnz * width + 7) // 8 if nnz < FIXED_MIN else (nnz + 7) // 8 * width
  if buf[p] != LITERAL or width > 56 or end - p - 2 != nbytes:
    return fail
  raw = buf[p + 2:end]
  z = unpack_lsb(raw, nnz, width) if nnz < FIXED_MIN else unpack_planes(raw, nnz, width)
  out = np.empty(nnz, like.dtype)
  if literal_values(z, 1, out) >> (8 * like.itemsize):
    return fail
  return True, idx, out


@numba.njit(**_JIT)
def bitmap(idx, nbytes):
  """np.packbits (MSB first) of the mask with the ascending indices idx set."""
  out = np.zeros(nbytes, np.uint8)
  for i in idx:
    out[i >> 3] |= np.uint8(128 >> (i & 7))
  return out


# ---- apply -------------------------------------------------------------------------------

@numba.njit(**_JIT)
def scatter_add(out, idx, off, lo, hi, start):
  """out[idx[i] - start] += off[i] (wrapping) for i in lo..hi-1; idx[lo:hi] lie in out."""
  for i in range(lo, hi):
    out[idx[i] - start] += off[i]
