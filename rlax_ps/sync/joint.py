"""Mode "joint": the fast sparse layout of large tensors, one pass each way.

Each change is coded as its gap (Rice: q zeros, a one, k low bits) directly followed by
its value (a length-limited Huffman code of the entropy-stage symbol of the zigzag offset,
then the symbol's raw low bits; or an escape code and the zigzag in full), LSB first, in
one bit stream. The code tables come from a sample of the tensor, so the encoder makes
one pass: compare 64 elements at a time, walk the changed ones, emit their codes, and
hash the block while in cache; the decoder decodes and scatters in one pass as well.
Blocks of BLOCK elements go round-robin to STREAMS streams (block b to stream b % 4, gaps
counted in the stream's own element order), so the decoder runs four independent
dependency chains side by side over four neighbouring blocks that sit in cache together.

Section layout: u8 k | u8 m | m u8 symbols (255: escape) | ceil(m / 2) bytes of 4-bit code
lengths | per block varint changes | STREAMS x varint bytes | the streams. Gaps count from
each block's start, so that a round of four blocks decodes without looking ahead.
"""

import numba
import numpy as np
import xxhash
from numba.cpython.unsafe.numbers import trailing_zeros

from rlax_ps.sync import huffman, scratch
from rlax_ps.sync.byte_reader import ByteReader, u8, varint, varints
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.loops import (ALPHABET, DIRECT, E_TRUNCATED, OK, _group_mask, _peek, _take,
                                popcount, scan_block, scan_outputs, unary)

BLOCK = 1 << 16
STREAMS = 4
ESCAPE = 255  # symbol id of the escape code in the section's table
MIN_ELEMENTS = 1 << 20  # smaller tensors take the general layouts
MIN_DENSITY = 0.02  # sparser: the general layouts are as fast (little to walk) and smaller
MAX_K = 28  # value codes (<= 27 bits) shifted past a gap's k + 1 bits fit in 56
_SAMPLE_WINDOWS = 16
_JIT = dict(nogil=True, cache=True, boundscheck=False)
_ZW, _ESC_FLAG = 16, 1 << 21  # decode-table entry: zbase | raw width << 16 | escape flag
WHOLE = 12  # bits of the decoder's whole-code table (4096 uint32: offset, gap, length)


# ---- encoder -----------------------------------------------------------------------------

@numba.njit(inline="always", **_JIT)
def _append(out, wpos, acc, fill, v, nbits):
  """Appends the low nbits (1..64) of v to a stream; returns (wpos, acc, fill)."""
  acc |= v << fill
  before = fill
  fill += nbits
  out[np.uint64(wpos)] = acc
  c = fill >> np.uint64(6)
  wpos += np.int64(c)
  acc = ((v >> np.uint64(1)) >> (np.uint64(63) - before)) if c else acc
  return wpos, acc, fill & np.uint64(63)


@numba.njit(inline="always", **_JIT)
def _encode_blocks(aw, bw, a, b, first, k, ctab, esc, out, st, counts, lane_bits):
  """Codes the changes of the blocks a, b (unsigned bit arrays starting at block `first`,
  aw/bw their 64-element groups as uint64 words) into the streams' word rows of out.
  ctab[z]: the value code of zigzag z shifted past a gap's k + 1 bits (low 56 bits) and
  that length plus k + 1 (top 8 bits), for z below its size; every larger z takes the
  escape code, built from esc = (escape code, its length, the entry's top 8 bits).
  st[j] = (words written, accumulator, bits in it) of stream j is carried across calls;
  counts[b] = the changes of block b, whose gaps count from the block's start.
  lane_bits: 8 * a.itemsize, a constant of each compiled specialisation (encode_blocks16 /
  encode_blocks8)."""
  kk = np.uint64(k)
  kmask = (np.uint64(1) << kk) - np.uint64(1)
  low56 = (np.uint64(1) << np.uint64(56)) - np.uint64(1)
  nblocks = (a.size + BLOCK - 1) // BLOCK
  for bl in range(nblocks):
    j = (first + bl) % STREAMS
    wpos, acc, fill = np.int64(st[j, 0]), st[j, 1], st[j, 2]
    prev, count = np.int64(-1), np.int64(0)
    row = out[j]
    lo = bl * BLOCK
    hi = min(a.size, lo + BLOCK)
    ab, bb = a[lo:hi], b[lo:hi]
    groups = (hi - lo) // 64
    for g in range(groups + 1):
      if g < groups:
        m = _group_mask(aw, bw, lo // 64 + g, lane_bits)
      else:  # the tail of a short last block, element by element
        m = np.uint64(0)
        for t in range(hi - lo - groups * 64):
          m |= np.uint64(ab[groups * 64 + t] != bb[groups * 64 + t]) << np.uint64(t)
      count += np.int64(popcount(m))
      while m:
        i = g * 64 + np.int64(trailing_zeros(m))
        m &= m - np.uint64(1)
        z = _take(ab, bb, i, lane_bits)
        if z < np.uint64(ctab.size):
          e = ctab[z]
        else:  # above every value of the sample: the escape code, then z
          e = (((esc[0] | (z << esc[1])) & low56) << (kk + np.uint64(1))) | esc[2]
        gap = np.uint64(i - prev - 1)
        prev = i
        q = gap >> kk
        v = np.uint64(1) | ((gap & kmask) << np.uint64(1)) | (e & low56)
        tail = e >> np.uint64(56)
        if q + tail <= np.uint64(64):
          wpos, acc, fill = _append(row, wpos, acc, fill, v << q, q + tail)
        else:
          while q:
            zeros = min(q, np.uint64(32))
            wpos, acc, fill = _append(row, wpos, acc, fill, np.uint64(0), zeros)
            q -= zeros
          wpos, acc, fill = _append(row, wpos, acc, fill, v, tail)
    st[j, 0], st[j, 1], st[j, 2] = np.uint64(wpos), acc, fill
    counts[first + bl] = count


@numba.njit(**_JIT)
def encode_blocks16(aw, bw, a, b, first, k, ctab, esc, out, st, counts):
  _encode_blocks(aw, bw, a, b, first, k, ctab, esc, out, st, counts, 16)


@numba.njit(**_JIT)
def encode_blocks8(aw, bw, a, b, first, k, ctab, esc, out, st, counts):
  _encode_blocks(aw, bw, a, b, first, k, ctab, esc, out, st, counts, 8)


# ---- decoder -----------------------------------------------------------------------------

@numba.njit(inline="always", **_JIT)
def _next(words, p, end, prev, k, table, zw):
  """Decodes one change at bit p: returns (p, local index, wrapping offset as uint64 of
  the zigzag, ok). Table entries without a code carry the escape flag and length 0, so
  the common path checks nothing but the stream's end; a corrupted stream decodes to
  in-bounds garbage that the result checksum rejects."""
  w, quot, p, ok = unary(words, p, end)
  if not ok:
    return p, prev, np.uint64(0), False
  t = np.int64(trailing_zeros(w))
  p += t + 1
  x = _peek(words, p)
  r = np.int64(x & ((np.uint64(1) << np.uint64(k)) - np.uint64(1)))
  x >>= np.uint64(k)
  e = np.uint64(table[x & np.uint64((1 << huffman.MAX_LEN) - 1)])
  hl = e >> np.uint64(24)
  x >>= hl
  good = True
  if e & np.uint64(_ESC_FLAG):
    z = x & ((np.uint64(1) << zw) - np.uint64(1))
    p += k + np.int64(hl) + np.int64(zw)
    good = hl != 0
  else:
    rw = (e >> np.uint64(16)) & np.uint64(31)
    z = (e & np.uint64(0xFFFF)) | (x & ((np.uint64(1) << rw) - np.uint64(1)))
    p += k + np.int64(hl) + np.int64(rw)
  quot += t
  off = (z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1)))
  return p, prev + 1 + ((quot << np.uint64(k)) | r), off, good & (p <= end)


@numba.njit(inline="always", **_JIT)
def _decode_one(words, p, end, prev, k, table, zw, whole):
  """Decodes one change of a block (gaps from the block's start): (p, index, wrapping
  offset, ok). Changes whose whole code (gap and value) fits in the next WHOLE bits take
  one lookup in `whole`; the rest go through _next."""
  e = whole[_peek(words, p) & np.uint64((1 << WHOLE) - 1)]
  if e:
    p += np.int64(e >> np.uint32(28))
    prev += 1 + np.int64((e >> np.uint32(16)) & np.uint32(0xFFF))
    return p, prev, np.uint64(e & np.uint32(0xFFFF)), p <= end
  return _next(words, p, end, prev, k, table, zw)


@numba.njit(inline="always", **_JIT)
def _put_full(words, p, end, prev, k, table, zw, out, base, whole):
  """_put for a whole block (BLOCK elements): the index is masked into the block instead
  of checked, and the caller checks the last (largest) index of the block once."""
  p, prev, off, good = _decode_one(words, p, end, prev, k, table, zw, whole)
  out[np.uint64(base + (prev & (BLOCK - 1)))] += off
  return p, prev, good


@numba.njit(inline="always", **_JIT)
def _put(words, p, end, prev, k, table, zw, out, base, size, whole):
  """Decodes one change and adds its offset to out[base + index] (index < size, else not
  ok); returns (p, index, ok)."""
  p, prev, off, good = _decode_one(words, p, end, prev, k, table, zw, whole)
  good = good & (prev < size)
  out[np.uint64(base + min(prev, size - 1))] += off  # unsigned index: no wraparound test
  return p, prev, good


@numba.njit(**_JIT)
def decode_round(words, ends, k, table, whole, out, first, n, counts, ps):
  """Adds the changes of the (up to STREAMS) blocks from block `first` on (counts[b]
  changes in block b, stream b % 4) to out: out[i] += offset (wrapping) at every change.
  ps[j]: stream j's bit position, carried across rounds. Streams run two at a time in
  lockstep (independent dependency chains overlap; four would spill registers). Returns
  an error code."""
  zw = np.uint64(8 * out.itemsize)
  lo = first * BLOCK
  nb = min(STREAMS, (n - lo + BLOCK - 1) // BLOCK)
  c = np.zeros(STREAMS, np.int64)
  size = np.ones(STREAMS, np.int64)
  for j in range(nb):
    c[j] = counts[first + j]
    size[j] = min(BLOCK, n - lo - j * BLOCK)
  good = True
  for h in range(0, nb, 2):  # two streams in lockstep: four would spill registers
    pa, pb, ea, eb = ps[h], ps[h + 1], ends[h], ends[h + 1]
    sa, sb = size[h], size[h + 1]
    ba, bb = lo + h * BLOCK, lo + (h + 1) * BLOCK
    va = vb = np.int64(-1)
    both = min(c[h], c[h + 1])
    if sa == BLOCK and sb == BLOCK:  # every round but the last
      for _ in range(both):
        pa, va, ga = _put_full(words, pa, ea, va, k, table, zw, out, ba, whole)
        pb, vb, gb = _put_full(words, pb, eb, vb, k, table, zw, out, bb, whole)
        if not (ga & gb):
          return E_TRUNCATED
      if max(va, vb) >= BLOCK:  # indices only grow: the last one bounds them all
        return E_TRUNCATED
    else:
      for _ in range(both):
        pa, va, ga = _put(words, pa, ea, va, k, table, zw, out, ba, sa, whole)
        pb, vb, gb = _put(words, pb, eb, vb, k, table, zw, out, bb, sb, whole)
        if not (ga & gb):
          return E_TRUNCATED
    for _ in range(both, c[h]):
      pa, va, ga = _put(words, pa, ea, va, k, table, zw, out, ba, sa, whole)
      good &= ga
    for _ in range(both, c[h + 1]):
      pb, vb, gb = _put(words, pb, eb, vb, k, table, zw, out, bb, sb, whole)
      good &= gb
    ps[h], ps[h + 1] = pa, pb
  return OK if good else E_TRUNCATED


@numba.njit(**_JIT)
def decode_changes(words, ends, k, table, whole, n, counts, ps, indices, offsets):
  """The changes of every block, in order, as flat indices and wrapping offsets (block b
  from stream b % 4, whose bit position ps[b % 4] advances). Returns an error code."""
  zw = np.uint64(8 * offsets.itemsize)
  pos = 0
  for b in range(counts.size):
    j = b % STREAMS
    lo = b * BLOCK
    size = min(BLOCK, n - lo)
    p, prev = ps[j], np.int64(-1)
    for _ in range(counts[b]):
      p, prev, off, good = _decode_one(words, p, ends[j], prev, k, table, zw, whole)
      if not (good and prev < size):
        return E_TRUNCATED
      indices[pos] = lo + prev
      offsets[pos] = off
      pos += 1
    ps[j] = p
  return OK


# ---- tables from a sample ----------------------------------------------------------------

def windows(n: int) -> int:
  """Sample windows of BLOCK elements for a tensor of n >= MIN_ELEMENTS: a sixteenth of
  it, between 2 and _SAMPLE_WINDOWS windows (the tables need a few thousand changes, not
  a pass over much of a mid-sized tensor)."""
  return min(_SAMPLE_WINDOWS, max(2, n // (16 * BLOCK)))


def plan(old: np.ndarray, new: np.ndarray):
  """(k, symbol counts) for a joint section from `windows(n)` evenly spaced windows of
  BLOCK elements, or None when the tensor suits the general layouts better (small, below
  MIN_DENSITY or at 25% or more, or clustered changes that the entropy-coded gaps code
  smaller)."""
  n = new.size
  if n < MIN_ELEMENTS:
    return None
  starts = np.linspace(0, n - BLOCK, windows(n)).astype(np.int64) // 64 * 64
  gaps, syms, raw, hist = scan_outputs("plan", BLOCK * starts.size, np.uint64)
  st = np.zeros(3, np.int64)
  for s in starts:
    a, b = old[s:s + BLOCK], new[s:s + BLOCK]
    st[1] = s - 1  # gaps from the window's start
    scan_block(a.view(np.uint64), b.view(np.uint64), a, b, s, st, gaps, syms, raw, hist)
  nnz = int(st[0])
  if not MIN_DENSITY * starts.size * BLOCK <= nnz <= starts.size * BLOCK // 4:
    return None
  from rlax_ps.sync import entropy, loops  # noqa: PLC0415 (entropy imports this module)
  g = gaps[:nnz]
  mean = float(g.mean())
  k0 = max(0, int(np.log2(mean * np.log(2) + 1)))
  cand = list(range(max(0, k0 - 1), min(MAX_K, k0 + 2) + 1))
  unary = loops.rice_sizes(g, 1, cand[0], cand[-1] + 1)
  sizes = [int(unary[i]) + c * nnz for i, c in enumerate(cand)]
  k = cand[int(np.argmin(sizes))]
  ghist = entropy.histogram(g)
  if entropy.cost_bytes(ghist) * 8 < 0.97 * min(sizes):
    return None
  return k, hist.sum(axis=0)


def tables(counts: np.ndarray, width: int, k: int):
  """(section table bytes, code table by zigzag value, escape) for the symbol counts of a
  sample, with an escape code (then the zigzag in `width` bits) for values the sample
  lacked. Table entries: the value's code bits (Huffman code, then the symbol's raw bits)
  shifted past a gap's k + 1 bits | (their length + k + 1) << 56. The table (a scratch
  buffer, valid until this thread's next call) stops after the bucket of the sample's
  largest symbol (most samples: a few hundred entries, in L1); values beyond take the
  escape, which `esc` = (code, length, entry top bits) builds."""
  present = np.flatnonzero(counts)
  syms = np.append(present, ESCAPE)
  weights = np.append(counts[present], max(1, int(counts.sum()) >> 12))
  lengths = huffman.code_lengths(weights)
  codes = huffman.canonical_codes(lengths)
  hcode = np.zeros(ALPHABET, np.uint64)
  hlen = np.zeros(ALPHABET, np.uint64)
  hcode[present], hlen[present] = codes[:-1], lengths[:-1]
  top = int(present.max())  # the table covers every value up to the sample's largest
  bits = top.bit_length() if top < DIRECT else (top - DIRECT) // 4 + 5
  ctab = scratch.buffer("joint ctab", 1 << max(4, bits), np.uint64)  # until the next call
  _code_table(hcode, hlen, np.uint64(codes[-1]), np.uint64(lengths[-1]), width, k, ctab)
  esc = np.array([codes[-1], lengths[-1], (int(lengths[-1]) + width + k + 1) << 56], np.uint64)
  packed = np.zeros((lengths.size + 1) // 2 * 2, np.uint8)
  packed[:lengths.size] = lengths
  head = [u8(syms.size), syms.astype(np.uint8).tobytes(),
          (packed[0::2] | packed[1::2] << 4).astype(np.uint8).tobytes()]
  return b"".join(head), ctab, esc


@numba.njit(inline="always", **_JIT)
def _code_run(ctab, zlo, count, hc, hl, rw, esc_code, esc_len, width, kk):
  """ctab[zlo + e] for e < count: the values of one symbol (Huffman code hc of length hl,
  then e in rw raw bits), or escapes (the escape code, then z in `width` bits) when hl
  is 0."""
  m56 = np.uint64((1 << 56) - 1)
  if hl > 0:
    top = (hl + np.uint64(rw) + kk) << np.uint64(56)
    for e in range(count):
      ctab[zlo + e] = (((hc | (np.uint64(e) << hl)) & m56) << kk) | top
  else:
    top = (esc_len + np.uint64(width) + kk) << np.uint64(56)
    for e in range(count):
      z = np.uint64(zlo + e)
      ctab[zlo + e] = (((esc_code | (z << esc_len)) & m56) << kk) | top


@numba.njit(**_JIT)
def _code_table(hcode, hlen, esc_code, esc_len, width, k, ctab):
  """ctab[z] for every zigzag value z < ctab.size (see tables); ctab[0] = 0. Filled symbol
  by symbol (loops.symbol_of's buckets: z < DIRECT alone, then four per bit length), each
  bucket a run of consecutive z that differ only in their raw bits."""
  kk = np.uint64(k + 1)
  ctab[0] = 0
  for z in range(1, min(DIRECT, ctab.size)):
    _code_run(ctab, z, 1, hcode[z], hlen[z], 0, esc_code, esc_len, width, kk)
  for nb in range(5, width + 1):
    if 1 << nb > ctab.size:  # the table ends at a bucket boundary
      break
    rw = nb - 3
    for top in range(4):
      sym = DIRECT + (nb - 5) * 4 + top
      _code_run(ctab, (4 | top) << rw, 1 << rw, hcode[sym], hlen[sym], rw, esc_code, esc_len,
                width, kk)


def encode(old: np.ndarray, new: np.ndarray, k: int, counts: np.ndarray,
           hash_old: bool = True):
  """(section bytes, xxh3 of old (None unless hash_old), xxh3 of new) of the joint section
  from old to new."""
  n = new.size
  table, ctab, esc = tables(counts, 8 * new.itemsize, k)
  encode_blocks = encode_blocks16 if new.itemsize == 2 else encode_blocks8
  nnz_est = int(counts.sum()) * n // (BLOCK * windows(n)) + 1
  bits = (k + 6) * nnz_est + n // (1 << k) + 1
  # Every word of a stream is assigned before it is read, so the rows need no zeroing.
  width = bits // 64 // STREAMS + 2 * BLOCK
  out = scratch.buffer("joint streams", STREAMS * width, np.uint64).reshape(STREAMS, width)
  st = np.zeros((STREAMS, 3), np.uint64)
  counts = np.zeros((n + BLOCK - 1) // BLOCK, np.int64)
  h_old, h_new = xxhash.xxh3_64(), xxhash.xxh3_64()
  step = STREAMS * BLOCK
  for s in range(0, n, step):
    if int(st[:, 0].max()) + BLOCK + 2 > out.shape[1]:  # a block: at most 64 bits an element
      grown = np.empty((STREAMS, 2 * out.shape[1]), np.uint64)
      grown[:, :out.shape[1]] = out
      out = grown
    a, b = old[s:s + step], new[s:s + step]
    m = a.size - a.size % 64
    encode_blocks(a[:m].view(np.uint64), b[:m].view(np.uint64), a, b, s // BLOCK, k, ctab,
                  esc, out, st, counts)
    if hash_old:
      h_old.update(a)
    h_new.update(b)
  parts, lengths = [], []
  for j in range(STREAMS):
    wpos, acc, fill = int(st[j, 0]), st[j, 1], int(st[j, 2])
    out[j, wpos] = acc
    nbytes = (wpos * 64 + fill + 7) // 8
    parts.append(out[j].view(np.uint8)[:nbytes])
    lengths.append(varint(nbytes))
  return (b"".join([u8(k), table, varints(counts)] + lengths + parts),
          h_old.intdigest() if hash_old else None, h_new.intdigest())


# ---- decoding ----------------------------------------------------------------------------

def whole_codes(k: int, table: np.ndarray, width: int) -> np.ndarray:
  """For every WHOLE-bit window that starts with a complete change code (Rice gap, then a
  Huffman value with its raw bits, no escape): wrapping offset | gap << 16 | code length
  << 28 (uint32); 0 elsewhere."""
  out = np.zeros(1 << WHOLE, np.uint32)
  _whole_codes(k, table, width, out)
  return out


@numba.njit(**_JIT)
def _whole_codes(k, table, width, out):
  kk = np.uint64(k)
  for x in range(1, out.size):
    xu = np.uint64(x)
    t = np.uint64(trailing_zeros(xu))  # the gap's quotient: zeros before its stop bit
    head = t + np.uint64(1) + kk  # the gap's bits
    y = xu >> min(head, np.uint64(63))
    e = np.uint64(table[y & np.uint64((1 << huffman.MAX_LEN) - 1)])
    hl, rw = e >> np.uint64(24), (e >> np.uint64(16)) & np.uint64(31)
    total = head + hl + rw
    if e & np.uint64(_ESC_FLAG) or total > np.uint64(WHOLE):
      continue
    z = (e & np.uint64(0xFFFF)) | ((y >> hl) & ((np.uint64(1) << rw) - np.uint64(1)))
    off = ((z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1)))) & (
        (np.uint64(1) << np.uint64(width)) - np.uint64(1))
    gap = (t << kk) | ((xu >> (t + np.uint64(1))) & ((np.uint64(1) << kk) - np.uint64(1)))
    out[x] = np.uint32(off | (gap << np.uint64(16)) | (total << np.uint64(28)))


@numba.njit(**_JIT)
def _read_table(syms, packed, width, lengths, entries):
  """Code lengths (4 bits each in packed) and decode entries (zbase | raw width << 16, or
  the escape flag) of the table's symbols; returns 0, or 1 when the symbols are not
  ascending nonzero known ones (the escape, 255, last), 2 when a value is wider than
  `width` bits."""
  m = syms.size
  if m == 0:
    return 1
  for i in range(m):
    lengths[i] = (packed[i >> 1] >> (4 * (i & 1))) & 15
    s = syms[i]
    if (i and s <= syms[i - 1]) or s == 0:
      return 1
    if s == ESCAPE:
      entries[i] = _ESC_FLAG
      continue
    if s >= ALPHABET:
      return 1
    if s < DIRECT:
      entries[i] = s
      continue
    wide = s - DIRECT
    rw = wide // 4 + 2
    zbase = (4 | wide % 4) << rw
    if (zbase | ((1 << rw) - 1)) >> width:
      return 2
    entries[i] = zbase | (rw << 16)
  return 0


class Section:
  """A parsed joint section: its code table and the four streams."""

  def __init__(self, r: ByteReader, n: int, udtype: np.dtype):
    from rlax_ps.sync import entropy  # noqa: PLC0415 (entropy imports this module)
    self.n, self.udtype, self.what = n, udtype, r.what
    self.k = r.u8()
    if self.k > MAX_K:
      raise CodecError(f"{r.what}: Rice parameter {self.k} exceeds {MAX_K}")
    m = r.u8()
    syms = np.frombuffer(r.take(m), np.uint8).astype(np.int64)
    packed = np.frombuffer(r.take((m + 1) // 2), np.uint8)
    lengths = np.empty(m, np.int64)
    entries = np.empty(m, np.int64)
    err = _read_table(syms, packed, 8 * udtype.itemsize, lengths, entries)
    if err == 1:
      raise CodecError(f"{r.what}: joint code table is not a sorted list of nonzero symbols")
    if err == 2:
      raise CodecError(f"{r.what}: joint code table holds values wider than the tensor's")
    try:
      codes = huffman.canonical_codes(lengths)
    except ValueError as e:
      raise CodecError(f"{r.what}: joint code table: {e}") from None
    self.table = huffman.decode_table(lengths, codes, entries)
    self.table[self.table == 0] = _ESC_FLAG  # no code here: the checked path, length 0
    self.whole = whole_codes(self.k, self.table, 8 * udtype.itemsize)
    nblocks = (n + BLOCK - 1) // BLOCK
    self.counts = r.varints(nblocks)
    sizes = np.minimum(BLOCK, n - np.arange(nblocks) * BLOCK)
    if np.any(self.counts > sizes) or self.counts.sum() == 0:
      raise CodecError(f"{r.what}: joint block change counts exceed their blocks or are all 0")
    nbytes = [r.varint() for _ in range(STREAMS)]
    buf = r.take(sum(nbytes))
    r.done()
    self.words = entropy.words_of(buf)
    self.starts = np.cumsum([0] + nbytes) * 8
    self.nnz = int(self.counts.sum())

  def apply(self, old: np.ndarray, out: np.ndarray, hasher) -> None:
    """Writes old + changes into out (which may be old itself), round by round, hashing
    each round's blocks while in cache."""
    ps = self.starts[:STREAMS].copy()
    ends = self.starts[1:]
    copy = out is not old
    step = STREAMS * BLOCK
    for s in range(0, self.n, step):
      if copy:
        np.copyto(out[s:s + step], old[s:s + step])
      if decode_round(self.words, ends, self.k, self.table, self.whole, out, s // BLOCK,
                      self.n, self.counts, ps) != OK:
        raise CodecError(f"{self.what}: joint streams are truncated or corrupted, or a "
                         f"change lies outside its block")
      hasher.update(out[s:s + step])
    if np.any((ps + 7) // 8 * 8 != ends):
      raise CodecError(f"{self.what}: a joint stream does not end where its length says")

  def changes(self) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, wrapping offsets) of the changes, in order, without a full-size
    buffer (for an on-device scatter)."""
    indices = np.empty(self.nnz, np.int64)
    offsets = np.empty(self.nnz, self.udtype)
    ps = self.starts[:STREAMS].copy()
    if decode_changes(self.words, self.starts[1:], self.k, self.table, self.whole, self.n,
                      self.counts, ps, indices, offsets) != OK:
      raise CodecError(f"{self.what}: joint streams are truncated or corrupted, or a "
                       f"change lies outside its block")
    if np.any((ps + 7) // 8 * 8 != self.starts[1:]):
      raise CodecError(f"{self.what}: a joint stream does not end where its length says")
    return indices, offsets
