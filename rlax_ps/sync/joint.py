"""Mode "joint": the fast sparse layout of tensors of 64K+ elements, one pass each way.

Each change is coded as its gap (Rice: q zeros, a one, k low bits) directly followed by
its value (a length-limited Huffman code of the entropy-stage symbol of the zigzag offset,
then the symbol's raw low bits; or an escape code and the zigzag in full), LSB first, in
one bit stream. The code tables come from a sample of the tensor (about 1/32 of it, in
windows of 4096 elements), so the encoder makes one pass: compare 64 elements at a time,
walk the changed ones (or list them without a branch per change: a SIMD compress where
the CPU has one, byte shuffles on other x86), emit their codes, and hash the block while
in cache; the decoder decodes and scatters in one pass as well.
Blocks of BLOCK elements go round-robin to STREAMS streams (block b to stream b % 4, gaps
counted in the stream's own element order), so the decoder runs four independent
dependency chains side by side over four neighbouring blocks that sit in cache together.

Two value code sets come from the sample: the open one codes its symbols and an escape,
the closed one its symbols alone, one code shorter (where two values dominate, as +-1 in
int8 codes, the escape would cost half a bit per change; a section has a closed set only
where it saves CLOSED_GAIN of the bits). A block takes the closed set unless it holds a
value the sample lacked; then it is coded again with the open set.

Section layout: u8 k | u8 m | m u8 symbols (the last, 255, is the escape) | u8 closed
set (0 or 1) | ceil(m / 2) bytes of 4-bit code lengths of the open set | floor(m / 2)
bytes of those of the closed set (the first m - 1 symbols), if any | per block varint
2 * changes + (1 if coded with the open set) | STREAMS x varint bytes | the streams. Gaps
count from each block's start, so that a round of four blocks decodes without looking
ahead.
"""

import functools
import threading

import numba
import numpy as np
import xxhash
from numba.cpython.unsafe.numbers import trailing_zeros

from rlax_ps.sync import chosen, entropy, huffman, scratch
from rlax_ps.sync.byte_reader import ByteReader, u8, varint, varints
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.intrinsics import (CODE_LANES, COMPRESS, HAS_COMPRESS, HAS_SHUFFLE,
                                     LIST_LANES, SHUFFLE, WALK, code_u8, code_u16, copy_bytes,
                                     list_u8, list_u16_compress, list_u16_shuffle, load_u64,
                                     prefetch, store_u64, zigzag_u16)
from rlax_ps.sync.loops import (ALPHABET, CALL_BYTES, DIRECT, E_TRUNCATED, OK, _bitlen,
                                _get_varint, _group_mask, _put_varint, _take, best_rice,
                                cost_of, entropy_bits, hash_parts, popcount, symbol_of)

BLOCK = 1 << 16
STREAMS = 4
ESCAPE = 255  # symbol id of the escape code in the section's table
LIST = 1 << 11  # elements listed, then coded, at a time (_code_block_listed; in L1)
MIN_ELEMENTS = 1 << 16  # smaller tensors take the general layouts
MIN_DENSITY = 0.02  # sparser bf16: the general layouts are as fast (little to walk) and
# smaller (their rANS values beat Huffman codes)
MIN_DENSITY_INT8 = 0.005  # int8 codes (+-1: 1 bit either way) gain from sparser still
MAX_K = 28  # value codes (<= 27 bits) shifted past a gap's k + 1 bits fit in 56
SAMPLE_WINDOW = 1 << 12  # elements per window of the plan's sample
_SAMPLE_SHARE = 32  # the sample is about 1/32 of the tensor, in 4..128 windows
_PROBE_EVERY = 4  # plan looks at every 4th window first, and stops below half the least density
CTAB_MAX = 1 << 10  # value codes looked up by zigzag value (8 KB, in L1); larger values
# (sign crossings, rare large steps) are coded from their symbol
_JIT = dict(nogil=True, cache=True, boundscheck=False)
_WIDTHS = entropy.WIDTHS  # raw bits of each symbol
_ZW, _ESC_FLAG = 16, 1 << 21  # decode-table entry: zbase | raw width << 16 | escape flag
# Four streams decoded in lockstep (else two): with 16 registers four chains spill some, so
# only wide cores (the hosts with AVX-512 VBMI2) take four.
QUAD = HAS_COMPRESS
# How encode and plan find a tensor's changes by default, by lane bits: listed by the SIMD
# compress where the host has it; else bf16 listed by byte shuffles where x86 has them,
# and int8 codes (sparser, so listing them costs more than it saves) walked.
LISTING = {16: COMPRESS if HAS_COMPRESS else SHUFFLE if HAS_SHUFFLE else WALK,
           8: COMPRESS if HAS_COMPRESS else WALK}
WAYS = {16: (WALK, COMPRESS, SHUFFLE), 8: (WALK, COMPRESS)}  # by lane bits
WHOLE = 12  # bits of the decoder's whole-code table (4096 uint32: offset, gap, length)
GROUP = 4  # changes a stream decodes from one 57-bit window in the four-stream loop
PREFETCH_LINES = 4  # lines of the next stretch's base asked for per group of the four-stream
# loop: a dense stretch asks for all of it, so that its copy reads from cache; sparser
# stretches get part of it
assert GROUP * WHOLE <= 57
CLOSED_GAIN = 0.01  # a section has a closed code set where it saves this share of the bits


# ---- encoder -----------------------------------------------------------------------------

@numba.njit(inline="always", **_JIT)
def _append(out, pos, acc, fill, v, nbits):
  """Appends the low nbits of v (clean above them; fill + nbits <= 63: nbits <= 56) to a
  byte stream at address `out` whose pos bytes are final and whose next fill (< 8) bits
  wait in acc: stores acc's 8 bytes at pos (no load), then moves past the bytes it
  completed. Returns (pos, acc, fill)."""
  acc |= v << fill
  fill += nbits
  store_u64(out + pos, acc)
  done = fill >> np.uint64(3)
  return pos + np.int64(done), acc >> (done << np.uint64(3)), fill & np.uint64(7)


@numba.njit(inline="always", **_JIT)
def value_entry(z, symtab, esc, kk):
  """The code-table entry of zigzag value z (see _encode_blocks) with kk = k + 1: its
  symbol's Huffman code (symtab[sym]: code | length << 56; 0 when the sample lacks the
  symbol) then its raw bits, or the escape code then z in full (esc = (escape code, its
  length, the entry's top 8 bits)), shifted past a gap's k + 1 bits, with bit 0 (the
  gap's stop bit) set."""
  low56 = (np.uint64(1) << np.uint64(56)) - np.uint64(1)
  sym, rw, extra = symbol_of(z)
  c = symtab[sym]
  if c:
    hl = c >> np.uint64(56)
    return ((((c & low56) | (extra << hl)) & low56) << kk) | (
        (hl + np.uint64(rw) + kk) << np.uint64(56)) | np.uint64(1)
  return (((esc[0] | (z << esc[1])) & low56) << kk) | esc[2] | np.uint64(1)


@numba.njit(**_JIT)
def value_entries(z, symtab, esc, k):
  """value_entry of every zigzag value in z (tests and tools; the encoder inlines it)."""
  out = np.empty(z.size, np.uint64)
  for i in range(z.size):
    out[i] = value_entry(z[i], symtab, esc, np.uint64(k + 1))
  return out


@numba.njit(inline="always", **_JIT)
def _changed_groups(ab, bb, ahead, masks, starts):
  """The 64-element groups of one int8 block (ab, bb: its elements; ahead: the masks of
  its whole groups, made ahead by _encode_blocks) that hold changes: masks[:c] and starts[:c] (the group's
  first element in the block); returns c. A group's slot is always written and kept only
  if its mask is nonzero: at 0.5-3% changed (int8 codes), whether a group is empty is a
  coin flip that a branch would mispredict."""
  groups = ab.size // 64
  c = np.int64(0)
  for g in range(groups):
    masks[c] = ahead[g]
    starts[c] = g * 64
    c += np.int64(ahead[g] != np.uint64(0))
  if ab.size > groups * 64:  # the tail of a short last block, element by element
    m = np.uint64(0)
    for t in range(ab.size - groups * 64):
      m |= np.uint64(ab[groups * 64 + t] != bb[groups * 64 + t]) << np.uint64(t)
    masks[c] = m
    starts[c] = groups * 64
    c += np.int64(m != np.uint64(0))
  return c


@numba.njit(inline="always", **_JIT)
def _code_block(ab, bb, ahead, k, ctab, symtab, esc, stream, pos, acc, fill, lane_bits,
                masks, starts, zbuf):
  """Codes the changes of one block (ab, bb: its elements; ahead: int8 blocks' group masks,
  made ahead) with one code set (see _encode_blocks) into the stream at address `stream`
  (_append's pos, acc, fill); returns (pos, acc, fill, changes, ok).
  Not ok: a value has no code in the set (the closed set lacks the escape). int8 blocks
  walk only their changed groups (_changed_groups, into masks and starts); bf16 blocks
  (denser) every group, each group's mask and zigzags made on the way (zigzag_u16, into
  zbuf: 64 uint16)."""
  kk = np.uint64(k)
  kmask = (np.uint64(1) << kk) - np.uint64(1)
  low56 = (np.uint64(1) << np.uint64(56)) - np.uint64(1)
  prev, count = np.int64(-1), np.int64(0)
  wp = stream + pos  # the write address: one register less than stream and pos
  groups = ab.size // 64
  if lane_bits == 8:
    walk = _changed_groups(ab, bb, ahead, masks, starts)
  else:
    walk = groups + 1
    pa, pb, pz = ab.ctypes.data, bb.ctypes.data, zbuf.ctypes.data
  for g in range(walk):
    if lane_bits == 8:
      m, at = masks[g], starts[g]
    elif g < groups:
      m, at = zigzag_u16(pa + 128 * g, pb + 128 * g, pz, CTAB_MAX), g * 64
    else:  # the tail of a short last block, element by element
      m, at = np.uint64(0), g * 64
      for t in range(ab.size - groups * 64):
        z = _take(ab, bb, at + t, 16)
        zbuf[t] = np.uint16(min(z, np.uint64(CTAB_MAX)))
        m |= np.uint64(z != 0) << np.uint64(t)
    count += np.int64(popcount(m))
    last = prev - at  # the previous change, counted from this group's start
    while m:
      t = np.int64(trailing_zeros(m))
      m &= m - np.uint64(1)
      # ctab holds every int8 z; bf16 z are capped at CTAB_MAX, whose entry is 0
      e = ctab[_take(ab, bb, at + t, 8) if lane_bits == 8 else np.uint64(zbuf[t])]
      tail = e >> np.uint64(56)
      if tail == 0:  # no code, or a bf16 z past the table: from the symbol
        e = value_entry(_take(ab, bb, at + t, lane_bits), symtab, esc, kk + np.uint64(1))
        tail = e >> np.uint64(56)
        if tail == 0:
          return wp - stream, acc, fill, count, False
      gap = np.uint64(t - last - 1)
      last = t
      q = gap >> kk
      v = ((gap & kmask) << np.uint64(1)) | (e & low56)  # e holds the stop bit
      if q + tail <= np.uint64(56):  # the most bits _append takes
        wp, acc, fill = _append(0, wp, acc, fill, v << q, q + tail)
      else:
        while q:
          zeros = min(q, np.uint64(32))
          wp, acc, fill = _append(0, wp, acc, fill, np.uint64(0), zeros)
          q -= zeros
        wp, acc, fill = _append(0, wp, acc, fill, v, tail)
    prev = at + last
  return wp - stream, acc, fill, count, True


@numba.njit(inline="always", **_JIT)
def _code_block_listed(ab, bb, k, ctab, symtab, esc, stream, pos, acc, fill, idx, zs16, zs8,
                       codes, lens, lane_bits, listed):
  """_code_block, LIST elements at a time and branch-free but for the appends: list the
  changes (list_u16 of the way `listed` (COMPRESS or SHUFFLE) / list_u8: element numbers
  into idx[1:], zigzags into zs16 (capped at CTAB_MAX) / zs8), make their codes and lengths
  8 at a time (code_u16 / code_u8; SHUFFLE: each in the append loop), then append them; a
  change of length 0 takes value_entry (or escapes its gap)."""
  kk = np.uint64(k)
  kmask = (np.uint64(1) << kk) - np.uint64(1)
  low56 = (np.uint64(1) << np.uint64(56)) - np.uint64(1)
  wp = stream + pos
  count = np.int64(0)
  idx[0] = np.uint16(65535)  # the change "before" the block: gaps wrap in 16 bits
  whole = ab.size - ab.size % 64
  pa, pb, tp = ab.ctypes.data, bb.ctypes.data, ctab.ctypes.data
  ip, cp, lp = idx.ctypes.data, codes.ctypes.data, lens.ctypes.data
  zp = zs16.ctypes.data if lane_bits == 16 else zs8.ctypes.data
  zb = lane_bits // 8  # bytes of a listed zigzag
  for lo in range(0, max(whole, 1), LIST):
    hi = min(lo + LIST, whole)
    n = np.int64(0)
    if lane_bits == 16:
      for h in range(lo, hi, LIST_LANES):
        if listed == SHUFFLE:
          n += list_u16_shuffle(pa + 2 * h, pb + 2 * h, zp + 2 * n, ip + 2 + 2 * n, h,
                                CTAB_MAX)
        else:
          n += list_u16_compress(pa + 2 * h, pb + 2 * h, zp + 2 * n, ip + 2 + 2 * n, h,
                                 CTAB_MAX)
    else:
      for h in range(lo, hi, 64):
        n += list_u8(pa + h, pb + h, zp + n, ip + 2 + 2 * n, h)
    if hi == whole:  # the tail of a short last block, element by element
      for t in range(whole, ab.size):
        z = _take(ab, bb, t, lane_bits)
        if z:
          if lane_bits == 16:
            zs16[n] = np.uint16(min(z, np.uint64(CTAB_MAX)))
          else:
            zs8[n] = np.uint8(z)
          n += 1
          idx[n] = np.uint16(t)
    if listed != SHUFFLE:
      for i in range(0, n, CODE_LANES):
        if lane_bits == 16:
          code_u16(ip + 2 * i, zp + zb * i, tp, kk, cp + 8 * i, lp + i)
        else:
          code_u8(ip + 2 * i, zp + zb * i, tp, kk, cp + 8 * i, lp + i)
    for i in range(n):
      if listed == SHUFFLE:  # (bf16) coded here: without AVX-512 a gather is scalar loads
        e = ctab[np.uint64(zs16[i])]
        gap = np.uint64((np.int64(idx[i + 1]) - np.int64(idx[i]) - 1) & 65535)
        q, tail = gap >> kk, e >> np.uint64(56)
        if tail != 0 and q + tail <= np.uint64(56):
          v = ((gap & kmask) << np.uint64(1)) | (e & low56)
          wp, acc, fill = _append(0, wp, acc, fill, v << q, q + tail)
          continue
      else:
        ln = np.uint64(lens[i])
        if ln:
          wp, acc, fill = _append(0, wp, acc, fill, codes[i], ln)
          continue
      t = np.int64(idx[i + 1])
      e = value_entry(_take(ab, bb, t, lane_bits), symtab, esc, kk + np.uint64(1))
      tail = e >> np.uint64(56)
      if tail == 0:
        return wp - stream, acc, fill, count, False
      # as in _code_block's walk (inlined: a shared helper slows the walk)
      gap = np.uint64((t - np.int64(idx[i]) - 1) & 65535)
      q = gap >> kk
      v = ((gap & kmask) << np.uint64(1)) | (e & low56)
      if q + tail <= np.uint64(56):
        wp, acc, fill = _append(0, wp, acc, fill, v << q, q + tail)
      else:
        while q:
          zeros = min(q, np.uint64(32))
          wp, acc, fill = _append(0, wp, acc, fill, np.uint64(0), zeros)
          q -= zeros
        wp, acc, fill = _append(0, wp, acc, fill, v, tail)
    count += n
    idx[0] = idx[n]
  return wp - stream, acc, fill, count, True


@numba.njit(inline="always", **_JIT)
def _encode_blocks(aw, bw, a, b, first, k, ctabs, symtabs, escs, first_set, out, st, counts,
                   lane_bits, listed):
  """Codes the changes of the blocks a, b (unsigned bit arrays starting at block `first`,
  aw/bw their 64-element groups as uint64 words) into the streams' byte rows of out
  (uint8, one row per stream).
  Code set s (0: closed, 1: open) is (ctabs[s], symtabs[s], escs[s]) from tables(); its
  ctab[z] is the value code of zigzag z shifted past a gap's k + 1 bits (low 56 bits) and
  that length plus k + 1 (top 8 bits; 0: no code, or past the table's reach: such changes
  take value_entry; bf16 z are capped at CTAB_MAX, whose entry is 0).
  A block takes the closed set (the sample's values only: no escape code to pay for), or,
  coded again, the open one when it holds a value the closed set lacks; first_set = 1
  where the section has no closed set.
  st[j] = (bytes written, accumulator, bits in it: _append) of stream j is carried across
  calls;
  counts[b] = 2 * (changes of block b, whose gaps count from its start) + (1 if it took
  the open set). Returns the most words any stream reaches (the caller grows out before
  another call could overrun it). lane_bits: 8 * a.itemsize, and listed (WALK: blocks coded
  by _code_block; COMPRESS or SHUFFLE: by _code_block_listed, listing that way): constants
  of each compiled specialisation (_ENCODERS)."""
  nblocks = (a.size + BLOCK - 1) // BLOCK
  masks = np.empty(BLOCK // 64 + 1, np.uint64)  # int8 blocks' changed groups
  starts = np.empty(BLOCK // 64 + 1, np.int64)
  ahead = np.empty(BLOCK // 64, np.uint64)  # int8 blocks' group masks
  zbuf = np.empty(64, np.uint16)  # bf16 groups' zigzags
  # lists (_code_block_listed): a list holds up to LIST + 63 changes (a short last block's
  # tail joins its last LIST; a list_u16 / list_u8 call stores up to 64 entries from the
  # end, within LIST) and code_u16 / code_u8 take whole CODE_LANES past the end; zs16 only
  # ever holds capped zigzags (int8 tables hold every one), so every gather is in ctab
  room = LIST + 64 + max(LIST_LANES, CODE_LANES)
  idx = np.empty(room + 1, np.uint16)
  zs16 = np.zeros(room, np.uint16)
  zs8 = np.zeros(room, np.uint8)
  codes = np.empty(room, np.uint64)
  lens = np.empty(room, np.uint8)
  for bl in range(nblocks):
    j = (first + bl) % STREAMS
    pos, acc, fill = np.int64(st[j, 0]), st[j, 1], st[j, 2]
    lo = bl * BLOCK
    hi = min(a.size, lo + BLOCK)
    ab, bb = a[lo:hi], b[lo:hi]
    flag = first_set
    if lane_bits == 8 and not listed:  # the masks first, in a loop of SIMD compares alone
      for g in range((hi - lo) // 64):
        ahead[g] = _group_mask(aw, bw, lo // 64 + g, 8)
    if listed:
      w, c, f, count, ok = _code_block_listed(ab, bb, k, ctabs[flag], symtabs[flag],
                                              escs[flag], out[j].ctypes.data, pos, acc, fill,
                                              idx, zs16, zs8, codes, lens, lane_bits, listed)
    else:
      w, c, f, count, ok = _code_block(ab, bb, ahead, k, ctabs[flag], symtabs[flag],
                                       escs[flag], out[j].ctypes.data, pos, acc, fill,
                                       lane_bits, masks, starts, zbuf)
    if not ok:
      flag = 1
      if listed:
        w, c, f, count, ok = _code_block_listed(ab, bb, k, ctabs[1], symtabs[1], escs[1],
                                                out[j].ctypes.data, pos, acc, fill, idx,
                                                zs16, zs8, codes, lens, lane_bits, listed)
      else:
        w, c, f, count, ok = _code_block(ab, bb, ahead, k, ctabs[1], symtabs[1], escs[1],
                                         out[j].ctypes.data, pos, acc, fill, lane_bits,
                                         masks, starts, zbuf)
    st[j, 0], st[j, 1], st[j, 2] = np.uint64(w), c, f
    counts[first + bl] = 2 * count + flag
  return int(st[:, 0].max()) // 8 + 1


def _encode_blocks_for(lane_bits: int, listed: int):
  """_encode_blocks compiled for one lane width and way of listing changes."""
  @numba.njit(**_JIT)
  def encode_blocks(aw, bw, a, b, first, k, ctabs, symtabs, escs, first_set, out, st, counts):
    return _encode_blocks(aw, bw, a, b, first, k, ctabs, symtabs, escs, first_set, out, st,
                          counts, lane_bits, listed)
  return encode_blocks


# (lane bits, way of listing: WALK, COMPRESS or SHUFFLE) -> _encode_blocks compiled for them
_ENCODERS = {(bits, way): _encode_blocks_for(bits, way) for bits in (16, 8)
             for way in WAYS[bits]}
encode_blocks_chosen = chosen.by_constant(_ENCODERS, "encode_blocks_chosen")


# ---- decoder -----------------------------------------------------------------------------

@numba.njit(inline="always", **_JIT)
def _window(at, p):
  """The bits of a stream at address `at` from bit p on: 57 or more of them (an 8-byte load
  at p's byte; the top p % 8 bits are zero). The stream keeps 8 bytes past its end."""
  return load_u64(at + (p >> 3)) >> np.uint64(p & 7)


@numba.njit(inline="always", **_JIT)
def _next(at, p, end, prev, k, table, zw):
  """Decodes one change at bit p of the stream at address `at`: returns (p, local index,
  wrapping offset as uint64 of the zigzag, ok). A change's bits after its gap's unary part
  (k <= 28, a Huffman code of at most 11, 16 raw) fit one 57-bit window. Table entries
  without a code carry the escape flag and length 0, so the common path checks nothing but
  the stream's end; a corrupted stream decodes to in-bounds garbage that the result
  checksum rejects."""
  w = _window(at, p)
  quot = np.int64(0)
  while w == 0:  # a quotient of 57 or more zeros: move past 56
    quot += 56
    p += 56
    if p >= end:
      return p, prev, np.uint64(0), False
    w = _window(at, p)
  t = np.int64(trailing_zeros(w))
  p += t + 1
  x = _window(at, p)
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
def _decode_one(at, p, end, prev, k, table, zw, whole):
  """Decodes one change of a block (gaps from the block's start): (p, index, wrapping
  offset, ok). Changes whose whole code (gap and value) fits in the next WHOLE bits take
  one lookup in `whole`; the rest go through _next."""
  e = whole[_window(at, p) & np.uint64((1 << WHOLE) - 1)]
  if e:
    p += np.int64(e >> np.uint32(28))
    prev += 1 + np.int64((e >> np.uint32(16)) & np.uint32(0xFFF))
    return p, prev, np.uint64(e & np.uint32(0xFFFF)), p <= end
  return _next(at, p, end, prev, k, table, zw)


@numba.njit(inline="always", **_JIT)
def _put_full(at, p, end, prev, k, table, zw, out, base, whole):
  """_put for a whole block (BLOCK elements): the index is masked into the block instead
  of checked, and the caller checks the last (largest) index of the block once."""
  p, prev, off, good = _decode_one(at, p, end, prev, k, table, zw, whole)
  out[np.uint64(base + (prev & (BLOCK - 1)))] += off
  return p, prev, good


@numba.njit(inline="always", **_JIT)
def _decode_held(at, bits, p, end, prev, k, table, zw, whole):
  """_decode_one from `bits`, the stream's bits from p on (GROUP * WHOLE or more of them
  when a window was loaded at most GROUP - 1 whole codes ago): (bits, p, index, offset).
  A whole code costs a lookup and a shift (no load on the chain); the rest take _next and
  load a new window. A change _next rejects sets p to end + 1: the caller's end check
  fails."""
  e = whole[bits & np.uint64((1 << WHOLE) - 1)]
  if e:
    n = e >> np.uint32(28)
    return (bits >> np.uint64(n), p + np.int64(n),
            prev + 1 + np.int64((e >> np.uint32(16)) & np.uint32(0xFFF)),
            np.uint64(e & np.uint32(0xFFFF)))
  p, prev, off, good = _next(at, p, end, prev, k, table, zw)
  if not good:
    p = end + 1
  return _window(at, p), p, prev, off


@numba.njit(inline="always", **_JIT)
def _put(at, p, end, prev, k, table, zw, out, base, size, whole):
  """Decodes one change and adds its offset to out[base + index] (index < size, else not
  ok); returns (p, index, ok)."""
  p, prev, off, good = _decode_one(at, p, end, prev, k, table, zw, whole)
  good = good & (prev < size)
  out[np.uint64(base + min(prev, size - 1))] += off  # unsigned index: no wraparound test
  return p, prev, good


@numba.njit(inline="always", **_JIT)
def _decode_round(words, ends, k, tables, wholes, out, first, n, counts, sets, ps, quad,
                  ahead):
  """Adds the changes of the (up to STREAMS) blocks from block `first` on (counts[b]
  changes in block b, stream b % 4, decoded with code set sets[b]: row 0 (closed) or 1
  (open) of tables and wholes) to out: out[i] += offset (wrapping) at every change.
  ps[j]: stream j's bit position, carried across rounds. Streams run in lockstep, so that
  their independent dependency chains overlap: all four while every one has a change
  left in a whole block (where `quad`), then two at a time. While all four run (or,
  without `quad`, two), the lines from address ahead[0] to ahead[1] are prefetched,
  PREFETCH_LINES a group of four streams (half that of two), ahead[0] advancing. Returns an
  error code."""
  zw = np.uint64(8 * out.itemsize)
  at = np.int64(words.ctypes.data)  # _decode_one's 8-byte loads
  lo = first * BLOCK
  nb = min(STREAMS, (n - lo + BLOCK - 1) // BLOCK)
  c = np.zeros(STREAMS, np.int64)
  size = np.ones(STREAMS, np.int64)
  for j in range(nb):
    c[j] = counts[first + j]
    size[j] = min(BLOCK, n - lo - j * BLOCK)
  good = True
  v = np.full(STREAMS, -1, np.int64)  # each stream's last index
  if quad and nb == STREAMS and size[STREAMS - 1] == BLOCK:  # four whole blocks
    # GROUP changes of each stream from one window load: a change's chain is a lookup
    # and a shift, and one end check per group stands for the GROUP (positions only grow).
    p0, p1, p2, p3 = ps[0], ps[1], ps[2], ps[3]
    v0 = v1 = v2 = v3 = np.int64(-1)
    f0, f1, f2, f3 = sets[first], sets[first + 1], sets[first + 2], sets[first + 3]
    t0, t1, t2, t3 = tables[f0], tables[f1], tables[f2], tables[f3]
    w0, w1, w2, w3 = wholes[f0], wholes[f1], wholes[f2], wholes[f3]
    e0, e1, e2, e3 = ends[0], ends[1], ends[2], ends[3]
    m = min(min(c[0], c[1]), min(c[2], c[3])) // GROUP
    pf, pf_end = ahead[0], ahead[1]
    for _ in range(m):
      b0, b1, b2, b3 = _window(at, p0), _window(at, p1), _window(at, p2), _window(at, p3)
      for _ in range(GROUP):  # indices masked into their blocks: checked once, later
        b0, p0, v0, o0 = _decode_held(at, b0, p0, e0, v0, k, t0, zw, w0)
        b1, p1, v1, o1 = _decode_held(at, b1, p1, e1, v1, k, t1, zw, w1)
        b2, p2, v2, o2 = _decode_held(at, b2, p2, e2, v2, k, t2, zw, w2)
        b3, p3, v3, o3 = _decode_held(at, b3, p3, e3, v3, k, t3, zw, w3)
        out[np.uint64(lo + (v0 & (BLOCK - 1)))] += o0
        out[np.uint64(lo + BLOCK + (v1 & (BLOCK - 1)))] += o1
        out[np.uint64(lo + 2 * BLOCK + (v2 & (BLOCK - 1)))] += o2
        out[np.uint64(lo + 3 * BLOCK + (v3 & (BLOCK - 1)))] += o3
      for j in range(PREFETCH_LINES):  # unrolled; past pf_end: the last line again
        prefetch(pf + 64 * j)
      pf = min(pf + 64 * PREFETCH_LINES, pf_end)
      if not ((p0 <= e0) & (p1 <= e1) & (p2 <= e2) & (p3 <= e3)):
        return E_TRUNCATED
    ahead[0] = pf
    ps[0], ps[1], ps[2], ps[3] = p0, p1, p2, p3
    v[0], v[1], v[2], v[3] = v0, v1, v2, v3
    for j in range(STREAMS):
      c[j] -= GROUP * m
  pf, pf_end = ahead[0], ahead[1]
  for h in range(0, nb, 2):  # two streams in lockstep
    pa, pb, ea, eb = ps[h], ps[h + 1], ends[h], ends[h + 1]
    sa, sb = size[h], size[h + 1]
    fa, fb = sets[first + h], sets[min(first + h + 1, sets.size - 1)]
    ta, wa, tb, wb = tables[fa], wholes[fa], tables[fb], wholes[fb]
    ba, bb = lo + h * BLOCK, lo + (h + 1) * BLOCK
    va, vb = v[h], v[h + 1]
    both = min(c[h], c[h + 1])
    if sa == BLOCK and sb == BLOCK:  # every round but the last
      for _ in range(both // GROUP):  # as the four-stream loop does
        xa, xb = _window(at, pa), _window(at, pb)
        for _ in range(GROUP):
          xa, pa, va, oa = _decode_held(at, xa, pa, ea, va, k, ta, zw, wa)
          xb, pb, vb, ob = _decode_held(at, xb, pb, eb, vb, k, tb, zw, wb)
          out[np.uint64(ba + (va & (BLOCK - 1)))] += oa
          out[np.uint64(bb + (vb & (BLOCK - 1)))] += ob
        if not quad:  # the main loop there (with quad, the tails of rounds)
          for j in range(PREFETCH_LINES // 2):
            prefetch(pf + 64 * j)
          pf = min(pf + 64 * (PREFETCH_LINES // 2), pf_end)
        if not ((pa <= ea) & (pb <= eb)):
          return E_TRUNCATED
      for _ in range(both % GROUP):
        pa, va, ga = _put_full(at, pa, ea, va, k, ta, zw, out, ba, wa)
        pb, vb, gb = _put_full(at, pb, eb, vb, k, tb, zw, out, bb, wb)
        if not (ga & gb):
          return E_TRUNCATED
      if max(va, vb) >= BLOCK:  # indices only grow: the last one bounds them all
        return E_TRUNCATED
    else:
      for _ in range(both):
        pa, va, ga = _put(at, pa, ea, va, k, ta, zw, out, ba, sa, wa)
        pb, vb, gb = _put(at, pb, eb, vb, k, tb, zw, out, bb, sb, wb)
        if not (ga & gb):
          return E_TRUNCATED
    for _ in range(both, c[h]):
      pa, va, ga = _put(at, pa, ea, va, k, ta, zw, out, ba, sa, wa)
      good &= ga
    for _ in range(both, c[h + 1]):
      pb, vb, gb = _put(at, pb, eb, vb, k, tb, zw, out, bb, sb, wb)
      good &= gb
    ps[h], ps[h + 1] = pa, pb
  if not quad:
    ahead[0] = pf
  return OK if good else E_TRUNCATED


@numba.njit(inline="always", **_JIT)
def next_stretch(first, stop, n):
  """(start, end) of the elements Section.apply copies in after the stretch of blocks
  first..stop - 1 of n elements: the next stretch of as many blocks, cut at n."""
  lo = min(stop * BLOCK, n)
  return lo, min(lo + (stop - first) * BLOCK, n)


def _decode_rounds_for(quad: bool):
  """_decode_rounds compiled for one value of quad (a constant there, so that a
  four-stream host's two-stream loop has no prefetch branch)."""
  @numba.njit(**_JIT)
  def decode(words, ends, k, tables, wholes, out, first, stop, n, counts, sets, ps, base):
    return _decode_rounds(words, ends, k, tables, wholes, out, first, stop, n, counts, sets,
                          ps, quad, base)
  return decode


@numba.njit(inline="always", **_JIT)
def _decode_rounds(words, ends, k, tables, wholes, out, first, stop, n, counts, sets, ps,
                   quad, base):
  """_decode_round for the rounds of blocks first, first + STREAMS, ... below stop: one
  call per stretch that the caller copies in before and hashes after, while in cache.
  quad: see QUAD (a constant of each compiled specialisation, _ROUND_DECODERS). base: the
  array the caller copies the next stretch from (empty: none), prefetched while the
  decoder works so that the copy finds it in cache. Returns an error code."""
  lo, hi = next_stretch(first, stop, base.size)
  at, size = np.int64(base.ctypes.data), base.itemsize
  pf = np.array([at + size * lo, at + size * hi])
  for b in range(first, min(stop, (n + BLOCK - 1) // BLOCK), STREAMS):
    err = _decode_round(words, ends, k, tables, wholes, out, b, n, counts, sets, ps, quad,
                        pf)
    if err != OK:
      return err
  return OK


_ROUND_DECODERS = {quad: _decode_rounds_for(quad) for quad in (False, True)}
decode_rounds_chosen = chosen.by_constant(_ROUND_DECODERS, "decode_rounds_chosen")


@numba.njit(**_JIT)
def decode_changes(words, ends, k, tables, wholes, n, counts, sets, ps, indices, offsets):
  """The changes of every block, in order, as flat indices and wrapping offsets from
  indices[0] / offsets[0] on (block b from stream b % 4, whose bit position ps[b % 4]
  advances, with code set sets[b]). Each round's blocks decode two at a time in lockstep
  while both are whole and have changes left (GROUP a stream from one window, as apply's
  _decode_round), each block's changes written where the counts put them, then the rest
  block by block. Returns an error code."""
  zw = np.uint64(8 * offsets.itemsize)
  at = np.int64(words.ctypes.data)
  pos = 0
  for first in range(0, counts.size, STREAMS):
    nb = min(STREAMS, counts.size - first)
    for h in range(0, nb, 2):
      ba, bb = first + h, first + h + 1
      va = vb = np.int64(-1)
      done = 0
      if bb < counts.size and n - ba * BLOCK >= 2 * BLOCK:  # two whole blocks
        ob = pos + counts[ba]
        pa, pb, ea, eb = ps[h], ps[h + 1], ends[h], ends[h + 1]
        ta, wa = tables[sets[ba]], wholes[sets[ba]]
        tb, wb = tables[sets[bb]], wholes[sets[bb]]
        la, lb = ba * BLOCK, bb * BLOCK
        m = min(counts[ba], counts[bb]) // GROUP
        idx_a, off_a, idx_b, off_b = indices[pos:], offsets[pos:], indices[ob:], offsets[ob:]
        for g in range(m):
          xa, xb = _window(at, pa), _window(at, pb)
          for r in range(GROUP):
            xa, pa, va, fa = _decode_held(at, xa, pa, ea, va, k, ta, zw, wa)
            xb, pb, vb, fb = _decode_held(at, xb, pb, eb, vb, k, tb, zw, wb)
            i = g * GROUP + r
            idx_a[i], off_a[i] = la + va, fa  # va < BLOCK checked once, after the block
            idx_b[i], off_b[i] = lb + vb, fb
          if not ((pa <= ea) & (pb <= eb)):
            return E_TRUNCATED
        ps[h], ps[h + 1] = pa, pb
        done = GROUP * m
      for j in range(h, min(h + 2, nb)):
        b = first + j
        size = min(BLOCK, n - b * BLOCK)
        p, prev = ps[j], va if j == h else vb
        table, whole = tables[sets[b]], wholes[sets[b]]
        o = pos + done
        for _ in range(done, counts[b]):
          p, prev, off, good = _decode_one(at, p, ends[j], prev, k, table, zw, whole)
          if not (good and prev < size):
            return E_TRUNCATED
          indices[o], offsets[o] = b * BLOCK + prev, off
          o += 1
        if prev >= size:  # indices only grow: the last one bounds the block's
          return E_TRUNCATED
        ps[j] = p
        pos += counts[b]
  return OK


# ---- tables from a sample ----------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def sample_starts(n: int) -> np.ndarray:
  """Starts of the plan's sample windows (SAMPLE_WINDOW elements each, evenly spaced, 64
  aligned) in a tensor of n >= MIN_ELEMENTS: about 1/32 of it, in 4 to 128 windows (the
  tables need a few thousand changes, not a pass over much of the tensor). Read-only."""
  count = min(128, max(4, n // (_SAMPLE_SHARE * SAMPLE_WINDOW)))
  starts = np.linspace(0, n - SAMPLE_WINDOW, count).astype(np.int64) // 64 * 64
  starts.flags.writeable = False
  return starts


@functools.lru_cache(maxsize=4096)
def _probe_split(n: int) -> tuple[np.ndarray, np.ndarray]:
  """sample_starts(n) as (every _PROBE_EVERY-th window, the others), read-only."""
  starts = sample_starts(n)
  probe = np.arange(starts.size) % _PROBE_EVERY == 0
  split = starts[probe], starts[~probe]
  for part in split:
    part.flags.writeable = False
  return split


@numba.njit(inline="always", **_JIT)
def _walk_windows(aw, bw, a, b, starts, gaps, nnz, vhist, ghist, lane_bits):
  """Walks the changes of the windows at `starts`: their gaps (from each window's start)
  into gaps from gaps[nnz] on (nnz: changes that earlier windows put there), the symbol
  counts of their zigzag values into vhist and of their gaps into ghist. Returns the
  changes so far."""
  for s in starts:
    prev = s - 1
    for g in range(s // 64, (s + SAMPLE_WINDOW) // 64):
      m = _group_mask(aw, bw, g, lane_bits)
      while m:
        i = g * 64 + np.int64(trailing_zeros(m))
        m &= m - np.uint64(1)
        sym, _, _ = symbol_of(_take(a, b, i, lane_bits))
        vhist[sym] += 1
        gap = i - prev - 1
        prev = i
        gaps[nnz] = gap
        gsym, _, _ = symbol_of(gap)
        ghist[gsym] += 1
        nnz += 1
  return nnz


@numba.njit(inline="always", **_JIT)
def _walk_windows_listed(a, b, starts, gaps, nnz, vhist, ghist, lane_bits, lists, listed):
  """_walk_windows (the same gaps and counts) from lists of each window's changes made by
  list_u16 of the way `listed` (COMPRESS or SHUFFLE) / list_u8 (no branch per change);
  lists: (element numbers, zigzags) buffers of SAMPLE_WINDOW + 64 lanes."""
  idx, zs = lists
  lanes = LIST_LANES if lane_bits == 16 else 64
  for s in starts:
    n = 0
    for h in range(0, SAMPLE_WINDOW, lanes):
      at = (s + h) * (lane_bits // 8)
      pa, pb, pz, pi = a.ctypes.data + at, b.ctypes.data + at, zs.ctypes.data, idx.ctypes.data
      if lane_bits == 16 and listed == SHUFFLE:
        n += list_u16_shuffle(pa, pb, pz + 2 * n, pi + 2 * n, h, 0xFFFF)
      elif lane_bits == 16:
        n += list_u16_compress(pa, pb, pz + 2 * n, pi + 2 * n, h, 0xFFFF)
      else:
        n += list_u8(pa, pb, pz + n, pi + 2 * n, h)
    prev = np.int64(-1)
    for j in range(n):
      vhist[symbol_of(zs[j])[0]] += 1
      i = np.int64(idx[j])
      gaps[nnz] = i - prev - 1
      ghist[symbol_of(i - prev - 1)[0]] += 1
      prev = i
      nnz += 1
  return nnz


@numba.njit(inline="always", **_JIT)
def _walk(aw, bw, a, b, starts, gaps, nnz, vhist, ghist, lane_bits, listed):
  """_walk_windows_listed where `listed` (COMPRESS or SHUFFLE), else _walk_windows."""
  if listed:
    lists = (np.empty(SAMPLE_WINDOW + 64, np.uint16),
             np.empty(SAMPLE_WINDOW + 64, np.uint16 if lane_bits == 16 else np.uint8))
    return _walk_windows_listed(a, b, starts, gaps, nnz, vhist, ghist, lane_bits, lists,
                                listed)
  return _walk_windows(aw, bw, a, b, starts, gaps, nnz, vhist, ghist, lane_bits)


@numba.njit(inline="always", **_JIT)
def _sample(aw, bw, a, b, probe, rest, gaps, vhist, ghist, widths, least, lane_bits, listed):
  """_walk_windows over the probe windows, then, unless they hold fewer than `least`
  changes (sparser tensors stop there), over the rest: one compiled call (a call costs
  tens of microseconds when the caches are cold). Returns (changes, whether the rest was
  walked, the Rice parameter among those near log2 of the mean gap whose code is
  shortest, its bits, the entropy stage's bits for the gaps (loops.entropy_bits), their
  symbols present): sums, whatever the windows' order."""
  nnz = _walk(aw, bw, a, b, probe, gaps, 0, vhist, ghist, lane_bits, listed)
  if nnz < least:
    return nnz, False, 0, 0, 0.0, 0
  nnz = _walk(aw, bw, a, b, rest, gaps, nnz, vhist, ghist, lane_bits, listed)
  if nnz == 0:
    return 0, True, 0, 0, 0.0, 0
  best_k, best = best_rice(gaps, nnz, 1, 3, MAX_K + 1)
  bits, present = entropy_bits(ghist, widths)
  return nnz, True, best_k, best, bits, present


def _sample_for(lane_bits: int, listed: int):
  """_sample compiled for one lane width and way of walking (one numba specialisation
  each)."""
  @numba.njit(**_JIT)
  def sample(aw, bw, a, b, probe, rest, gaps, vhist, ghist, widths, least):
    return _sample(aw, bw, a, b, probe, rest, gaps, vhist, ghist, widths, least, lane_bits,
                   listed)
  return sample


_SAMPLERS = {(bits, way): _sample_for(bits, way) for bits in (16, 8)
             for way in WAYS[bits]}
sample_chosen = chosen.by_constant(_SAMPLERS, "sample_chosen")


def plan(old: np.ndarray, new: np.ndarray, listed: int | None = None):
  """(k, symbol counts, their Rice gap bits, changes) for a joint section from the windows at
  sample_starts(n), or None when the tensor suits the general layouts better (small,
  below MIN_DENSITY (bf16) or MIN_DENSITY_INT8, at 25% or more, or clustered changes
  that the entropy-coded gaps code smaller). listed: how the windows' changes are found,
  as encode's (WALK or False, COMPRESS or True, SHUFFLE (bf16); None: LISTING's); the plan
  is the same."""
  n = new.size
  if n < MIN_ELEMENTS:
    return None
  starts = sample_starts(n)
  gaps = scratch.buffer("plan", SAMPLE_WINDOW * starts.size, np.uint64)
  m = n - n % 64
  sample = _SAMPLERS[8 * new.itemsize, LISTING[8 * new.itemsize] if listed is None
                     else int(listed)]
  least = MIN_DENSITY if new.itemsize == 2 else MIN_DENSITY_INT8
  words = old[:m].view(np.uint64), new[:m].view(np.uint64), old, new
  vhist = np.zeros(ALPHABET, np.int64)
  ghist = np.zeros(ALPHABET, np.int64)
  # A quarter of the windows first: far sparser tensors (most at low learning rates) stop
  # there, as the whole sample would decide for them; the others add the rest.
  probe, rest = _probe_split(n)
  nnz, walked, k, rice_bits, gap_bits, present = sample(
      *words, probe, rest, gaps, vhist, ghist, entropy.WIDTHS,
      least * probe.size * SAMPLE_WINDOW / 2)
  if not _planned(walked, nnz, starts.size, least, rice_bits, gap_bits, present):
    return None
  return k, vhist, rice_bits, nnz


@numba.njit(inline="always", **_JIT)
def _planned(walked, nnz, windows, least, rice_bits, gap_bits, present):
  """Whether a sample (_sample's results over `windows` windows) makes a joint section:
  walked whole, between `least` and 25% changed, and the gaps not clustered (the entropy
  stage would code them 3% or more below Rice)."""
  if not walked:
    return False
  if not least * windows * SAMPLE_WINDOW <= nnz <= windows * SAMPLE_WINDOW // 4:
    return False
  return not cost_of(gap_bits, present) * 8 < 0.97 * rice_bits


@numba.njit(inline="always", **_JIT)
def _fill_codes(syms, lengths, codes, n, width, k, ctab, symtab, esc, size, escape_code):
  """Fills one code set from the first n symbols' lengths and codes, with the escape code
  (codes[n]) when escape_code, else none (esc zero: value_entry gives length 0)."""
  for i in range(n):
    symtab[syms[i]] = codes[i] | (np.uint64(lengths[i]) << np.uint64(56))
  if escape_code:
    esc[0], esc[1] = codes[n], np.uint64(lengths[n])
    esc[2] = np.uint64(lengths[n] + width + k + 1) << np.uint64(56)
  kk = np.uint64(k + 1)
  ctab[0] = 0
  for z in range(1, size):
    ctab[z] = value_entry(np.uint64(z), symtab, esc, kk)


@numba.njit(**_JIT)
def _tables(counts, width, k, gap_bits, min_gain, ctabs, symtabs, escs, head):
  """Fills the encoder's closed (row 0) and open (row 1) code sets (see tables; symtabs
  and escs zeroed by the caller) from the sample's symbol counts, and the section's table
  bytes in head; the closed set only when it saves min_gain of the sample's bits
  (gap_bits: their gaps' bits). Returns (ctab size, bytes of head, closed set made)."""
  m, total, top = 0, 0, 0
  for s in range(counts.size):
    if counts[s] > 0:
      m += 1
      total += counts[s]
      top = s
  syms = np.empty(m + 1, np.int64)
  weights = np.empty(m + 1, np.int64)
  j = 0
  for s in range(counts.size):
    if counts[s] > 0:
      syms[j], weights[j] = s, counts[s]
      j += 1
  syms[m], weights[m] = ESCAPE, max(1, total >> 12)
  # the tables end after the bucket of the sample's largest symbol
  bits = _bitlen(top) if top < DIRECT else (top - DIRECT) // 4 + 5
  # int8: every z (the encoder then looks up without a bound check)
  size = 1 << width if width == 8 else min(1 << max(4, bits), CTAB_MAX)
  closed = huffman.limited_lengths(weights[:m])
  opened = huffman.limited_lengths(weights)
  total, saved = float(gap_bits), 0.0
  for i in range(m):
    total += weights[i] * (opened[i] + _WIDTHS[syms[i]])
    saved += weights[i] * (opened[i] - closed[i])
  use_closed = saved >= min_gain * total
  if use_closed:
    _fill_codes(syms, closed, huffman.canonical(closed), m, width, k, ctabs[0], symtabs[0],
                escs[0], size, False)
  _fill_codes(syms, opened, huffman.canonical(opened), m, width, k, ctabs[1], symtabs[1],
              escs[1], size, True)
  head[0] = m + 1
  for i in range(m + 1):
    head[1 + i] = syms[i]
  head[m + 2] = use_closed
  p = m + 3
  for lengths, count in ((opened, m + 1), (closed, m if use_closed else 0)):
    for i in range(0, count, 2):
      hi = lengths[i + 1] if i + 1 < count else 0
      head[p] = lengths[i] | (hi << 4)
      p += 1
  return size, p, use_closed


def tables(counts: np.ndarray, width: int, k: int, gap_bits: int = 0,
           min_gain: float = CLOSED_GAIN):
  """(section table bytes, (ctabs, symtabs, escs), closed set made) for the symbol counts
  of a sample: row 0 of each is the closed code set (made only where it saves min_gain of
  the sample's bits, gap_bits for its gaps included), row 1 the open one. A code set is
  (ctab, symtab, esc): ctab[z] (every z of an int8 section; for bf16 CTAB_MAX + 1 entries,
  those past the bucket of the sample's largest symbol 0) is value z's entry: its code bits
  (Huffman code, then the symbol's raw bits) shifted past a gap's k + 1 bits | (their
  length + k + 1) << 56; symtab[symbol] = Huffman code | length << 56 (0: not coded) and
  esc = (escape code, its length, entry top bits) give the entry of larger z
  (value_entry). The open set adds an escape code (then the zigzag in `width` bits) for
  values whose symbol the sample lacked; the closed set codes the sample's symbols alone,
  one code shorter (entries of other values have length 0)."""
  head, nbytes, codes, use_closed = _code_sets(counts, width, k, gap_bits, min_gain)
  return head[:nbytes].tobytes(), codes, use_closed


@numba.njit(**_JIT)
def _code_sets(counts, width, k, gap_bits, min_gain):
  """tables() but for its first result: (the table bytes' buffer, their count, (ctabs,
  symtabs, escs), closed set made)."""
  ctabs = np.zeros((2, CTAB_MAX + 1), np.uint64)  # bf16: entry CTAB_MAX stays 0
  symtabs = np.zeros((2, ALPHABET), np.uint64)
  escs = np.zeros((2, 3), np.uint64)
  head = np.empty(3 + 256 + 2 * 129, np.uint8)
  size, nbytes, use_closed = _tables(counts, width, k, gap_bits, min_gain, ctabs, symtabs,
                                     escs, head)
  if width == 8:  # every z
    ctabs = np.ascontiguousarray(ctabs[:, :size])
  return head, nbytes, (ctabs, symtabs, escs), use_closed


def encode(old: np.ndarray, new: np.ndarray, k: int, counts: np.ndarray, gap_bits: int = 0,
           sampled: int | None = None, hash_old: bool = True, hash_new: bool = True,
           listed: int | None = None):
  """(section bytes, xxh3 of old, xxh3 of new (each None unless hash_old / hash_new)) of
  the joint section from old to new, with plan()'s k, counts (of the sample's symbols),
  gap bits and changes in the sample (None: the counts' sum). listed: blocks coded from
  lists of their changes (_code_block_listed), made by a SIMD compress (COMPRESS or True:
  faster than the walk (bf16) with AVX-512 VBMI2, slower without) or by byte
  shuffles (SHUFFLE, bf16 only: x86 without it), or by the group walk (_code_block; WALK or
  False); None: LISTING's, the host's fastest (WAYS: those of each lane width). The bytes
  are the same."""
  n = new.size
  table, codes, use_closed = tables(counts, 8 * new.itemsize, k, gap_bits)
  encode_blocks = _ENCODERS[8 * new.itemsize, LISTING[8 * new.itemsize] if listed is None
                            else int(listed)]
  sampled = int(counts.sum()) if sampled is None else sampled
  nnz_est = sampled * n // (SAMPLE_WINDOW * sample_starts(n).size) + 1
  bits = (k + 6) * nnz_est + n // (1 << k) + 1
  # Every byte of a stream is stored before it is read, so the rows need no zeroing; rows
  # keep room past the most words a call can write for _append's 8-byte stores.
  step, top = CALL_BYTES // new.itemsize, 0  # whole rounds of STREAMS blocks
  width = bits // 64 // STREAMS + step // STREAMS + 2
  out = scratch.buffer("joint streams", STREAMS * width, np.uint64).reshape(STREAMS, width)
  st = np.zeros((STREAMS, 3), np.uint64)
  counts = np.zeros((n + BLOCK - 1) // BLOCK, np.int64)
  h_old, h_new = xxhash.xxh3_64(), xxhash.xxh3_64()
  for s in range(0, n, step):
    out = with_room(out, top, step)
    a, b = old[s:s + step], new[s:s + step]
    m = a.size - a.size % 64
    top = encode_blocks(a[:m].view(np.uint64), b[:m].view(np.uint64), a, b, s // BLOCK, k,
                        *codes, 0 if use_closed else 1, out, st, counts)
    if hash_old:
      h_old.update(a)
    if hash_new:
      h_new.update(b)
  parts, lengths = [], []
  for j in range(STREAMS):
    nbytes = int(st[j, 0]) + (int(st[j, 2]) + 7) // 8  # the pending bits are stored
    parts.append(out[j].view(np.uint8)[:nbytes])
    lengths.append(varint(nbytes))
  return (b"".join([u8(k), table, varints(counts)] + lengths + parts),
          h_old.intdigest() if hash_old else None, h_new.intdigest() if hash_new else None)


def stream_room(n: int, itemsize: int) -> int:
  """uint64 words of stream rows that a joint section of n elements of `itemsize` bytes
  needs at most (a planned section is at most 25% changed: _planned), for _code_pack's
  scratch buffer."""
  step = CALL_BYTES // itemsize
  bits = (MAX_K + 6) * (n // 4 + 1) + n + 1
  return STREAMS * (bits // 64 // STREAMS + step // STREAMS + 2)


@numba.njit(inline="always", **_JIT)
def with_room(out, top, step):
  """The streams' rows `out`, or a copy twice as wide where a call of `step` elements from
  word `top` might not fit (at most 64 bits an element)."""
  if top + step // STREAMS + 2 <= out.shape[1]:
    return out
  grown = np.empty((STREAMS, 2 * out.shape[1]), np.uint64)
  grown[:, :out.shape[1]] = out
  return grown


@numba.njit(inline="always", **_JIT)
def _code_pack(old, new, probe, rest, windows, gaps, room, section, ends, hash_old, fn,
               lane_bits, listed):
  """plan() then encode() of a pack (its members' unsigned bits back to back in old and
  new; member j ends at element ends[j]; n >= MIN_ELEMENTS), inlined in pack_coder's one
  compiled call (a call costs tens of microseconds when the caches are cold, several of
  them most of a small model's encode); the sampler and block coder are linked as
  compiled (chosen.by_constant), not inlined again.
  Returns (planned and smaller than the raw bytes, the section's bytes, the array holding
  them: `section` where they fit, else a new one, digests): where planned, digests[0] (and
  digests[1] when hash_old) are the members' new (old) xxh3 by the C function at address
  fn (0: none hashed), each made right after its elements were coded. room: scratch for
  the streams' rows (stream_room words; more are made where it is short)."""
  n = new.size
  digests = np.zeros((2, ends.size), np.uint64)
  m = n - n % 64
  aw, bw = old[:m].view(np.uint64), new[:m].view(np.uint64)
  least = MIN_DENSITY if lane_bits == 16 else MIN_DENSITY_INT8
  vhist = np.zeros(ALPHABET, np.int64)
  ghist = np.zeros(ALPHABET, np.int64)
  nnz, walked, k, rice_bits, gap_bits, present = sample_chosen((lane_bits, listed), (
      aw, bw, old, new, probe, rest, gaps, vhist, ghist, _WIDTHS, least * probe.size *
      SAMPLE_WINDOW / 2))
  if not _planned(walked, nnz, windows, least, rice_bits, gap_bits, present):
    return False, 0, section, digests
  head, hbytes, codes, use_closed = _code_sets(vhist, lane_bits, k, rice_bits, CLOSED_GAIN)
  ctabs, symtabs, escs = codes
  nnz_est = nnz * n // (SAMPLE_WINDOW * windows) + 1
  bits = (k + 6) * nnz_est + n // (1 << k) + 1
  step = CALL_BYTES // (lane_bits // 8)  # whole rounds of STREAMS blocks
  width = bits // 64 // STREAMS + step // STREAMS + 2
  if room.size < STREAMS * width:
    room = np.empty(STREAMS * width, np.uint64)
  out = room[:STREAMS * width].reshape((STREAMS, width))
  st = np.zeros((STREAMS, 3), np.uint64)
  counts = np.zeros((n + BLOCK - 1) // BLOCK, np.int64)
  top, hashed, itemsize = 0, 0, lane_bits // 8
  at_old, at_new = old.ctypes.data, new.ctypes.data
  for s in range(0, n, step):
    out = with_room(out, top, step)
    a, b = old[s:s + step], new[s:s + step]
    mm = a.size - a.size % 64
    top = encode_blocks_chosen((lane_bits, listed), (
        a[:mm].view(np.uint64), b[:mm].view(np.uint64), a, b, s // BLOCK, k, ctabs, symtabs,
        escs, 0 if use_closed else 1, out, st, counts))
    done = hashed
    while done < ends.size and ends[done] <= s + step:
      done += 1
    if fn:
      hash_parts(fn, at_new, itemsize, ends, hashed, done, digests[0])
      if hash_old:
        hash_parts(fn, at_old, itemsize, ends, hashed, done, digests[1])
    hashed = done
  if fn:  # members of no elements at the end
    hash_parts(fn, at_new, itemsize, ends, hashed, ends.size, digests[0])
    if hash_old:
      hash_parts(fn, at_old, itemsize, ends, hashed, ends.size, digests[1])
  total = 1 + hbytes + 10 * (counts.size + STREAMS)
  for j in range(STREAMS):
    total += np.int64(st[j, 0]) + (np.int64(st[j, 2]) + 7) // 8
  if section.size < total:
    section = np.empty(total, np.uint8)
  section[0] = k
  copy_bytes(section.ctypes.data + 1, head.ctypes.data, hbytes)
  p = 1 + hbytes
  for c in counts:
    p = _put_varint(section, p, c)
  for j in range(STREAMS):
    p = _put_varint(section, p, np.int64(st[j, 0]) + (np.int64(st[j, 2]) + 7) // 8)
  for j in range(STREAMS):
    nb = np.int64(st[j, 0]) + (np.int64(st[j, 2]) + 7) // 8  # the pending bits are stored
    copy_bytes(section.ctypes.data + p, out[j].ctypes.data, nb)
    p += nb
  return p < n * itemsize, p, section, digests


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
  """whole_codes into out, gap by gap: the windows that start with one gap's code (t zeros,
  a one, its k low bits r) are every 2**(t + 1 + k)-th one, and their bits after the gap
  (y) start a value code whose offset and length depend on y alone (values[y])."""
  for x in range(0, out.size, 1 << max(WHOLE - k, 0)):  # no whole gap code in the window
    out[x] = 0
  if k >= WHOLE:
    return
  values = np.empty(1 << (WHOLE - 1 - k), np.uint32)  # offset | length << 28 (15: none)
  mask = np.uint32((1 << width) - 1)
  for y in range(values.size):
    e = table[y]
    hl, rw = e >> np.uint32(24), (e >> np.uint32(16)) & np.uint32(31)
    z = (e & np.uint32(0xFFFF)) | ((np.uint32(y) >> hl) & ((np.uint32(1) << rw) - np.uint32(1)))
    off = ((z >> np.uint32(1)) ^ (np.uint32(0) - (z & np.uint32(1)))) & mask
    good = ((e & np.uint32(_ESC_FLAG)) == 0) & (hl + rw < np.uint32(WHOLE))
    values[y] = off | ((hl + rw if good else np.uint32(15)) << np.uint32(28))
  for t in range(WHOLE - k):
    head = t + 1 + k
    room = np.uint32(WHOLE - head)  # bits left for the value code
    for r in range(1 << k):
      x0 = (1 << t) | (r << (t + 1))
      add = np.uint32((((t << k) | r) << 16) | (head << 28))
      for y in range(1 << (WHOLE - head)):
        v = values[y]
        out[x0 | (y << head)] = v + add if v >> np.uint32(28) <= room else np.uint32(0)


@numba.njit(**_JIT)
def _decoder_tables(syms, packed, width, k, table, whole):
  """The decoder's tables from a section's code table (its symbols, their 4-bit code
  lengths packed two a byte): the Huffman decode table (zeroed by the caller; entries
  without a code get the escape flag and length 0: the checked path) and the whole-code
  table (whole_codes). Returns 0, or _read_table's error, or 3 when the lengths are no
  prefix code."""
  m = syms.size
  lengths = np.empty(m, np.int64)
  entries = np.empty(m, np.int64)
  err = _read_table(syms, packed, width, lengths, entries)
  if err:
    return err
  if not huffman.prefix_free(lengths):
    return 3
  huffman.fill_table(table, lengths, huffman.canonical(lengths).astype(np.int64), entries)
  for i in range(table.size):
    if table[i] == 0:
      table[i] = _ESC_FLAG
  _whole_codes(k, table, width, whole)
  return 0


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


@numba.njit(**_JIT)
def _block_counts(coded, n, counts, sets):
  """Splits the blocks' varints (2 * changes + set) into counts and sets; returns (total
  changes, whether every count fits its block, how many blocks take the open set)."""
  fits, opened = True, 0
  for b in range(coded.size):
    counts[b], sets[b] = coded[b] >> 1, coded[b] & 1
    fits &= counts[b] <= min(BLOCK, n - b * BLOCK)
    opened += sets[b]
  return counts.sum(), fits, opened


@numba.njit(**_JIT)
def _parse(buf, n):
  """One compiled pass over a joint section's bytes (all but its code tables' build):
  (ok, k, m, closed flag, table end, changes, blocks on the open set, counts, sets, stream
  starts in bits, where the streams start). Not ok: anything Section's general reader
  would reject; it then runs and names the problem."""
  nblocks = (n + BLOCK - 1) // BLOCK
  counts, sets = np.empty(nblocks, np.int64), np.empty(nblocks, np.int64)
  starts = np.zeros(STREAMS + 1, np.int64)
  end = buf.size
  if end < 2:
    return False, 0, 0, 0, 0, 0, 0, counts, sets, starts, 0
  k, m = np.int64(buf[0]), np.int64(buf[1])
  p = 2 + m + 1 + (m + 1) // 2
  if k > MAX_K or m < 2 or p > end or buf[1 + m] != ESCAPE or buf[2 + m] > 1:
    return False, 0, 0, 0, 0, 0, 0, counts, sets, starts, 0
  use_closed = np.int64(buf[2 + m])
  p += m // 2 if use_closed else 0
  table_end, nnz, fits, opened = p, 0, True, 0
  for b in range(nblocks):
    v, p = _get_varint(buf, p, end)
    if p < 0:
      return False, 0, 0, 0, 0, 0, 0, counts, sets, starts, 0
    counts[b], sets[b] = v >> 1, v & 1
    fits &= counts[b] <= min(BLOCK, n - b * BLOCK)
    opened += sets[b]
    nnz += counts[b]
  if not fits or nnz == 0 or (not use_closed and opened != nblocks):
    return False, 0, 0, 0, 0, 0, 0, counts, sets, starts, 0
  for j in range(STREAMS):
    length, p = _get_varint(buf, p, end)
    if p < 0 or length > end:
      return False, 0, 0, 0, 0, 0, 0, counts, sets, starts, 0
    starts[j + 1] = starts[j] + length
  if starts[STREAMS] != end - p:  # the streams fill the rest exactly
    return False, 0, 0, 0, 0, 0, 0, counts, sets, starts, 0
  return True, k, m, use_closed, table_end, nnz, opened, counts, sets, starts * 8, p


def parse_general(r: ByteReader, n: int) -> tuple:
  """_parse's result read field by field from r (at the section's start, to its end),
  raising the CodecError that names what is wrong (_parse only says that something is)."""
  start = r.pos
  k = r.u8()
  if k > MAX_K:
    raise CodecError(f"{r.what}: Rice parameter {k} exceeds {MAX_K}")
  m = r.u8()
  syms = np.frombuffer(r.take(m), np.uint8)
  use_closed = r.u8()
  r.take((m + 1) // 2 + (m // 2 if use_closed else 0))
  if m < 2 or syms[-1] != ESCAPE or use_closed > 1:
    raise CodecError(f"{r.what}: joint code table lacks values or its escape code, or "
                     f"has an unknown closed-set flag {use_closed}")
  table_end = r.pos - start
  nblocks = (n + BLOCK - 1) // BLOCK
  counts, sets = np.empty(nblocks, np.int64), np.empty(nblocks, np.int64)
  nnz, fits, n_open = _block_counts(r.varints(nblocks), n, counts, sets)
  if not fits or nnz == 0:
    raise CodecError(f"{r.what}: joint block change counts exceed their blocks or are all 0")
  if not use_closed and n_open != nblocks:
    raise CodecError(f"{r.what}: joint blocks name a closed code set the section lacks")
  starts = np.zeros(STREAMS + 1, np.int64)
  np.cumsum(r.varints(STREAMS), out=starts[1:])
  streams_at = r.pos - start
  r.take(int(starts[-1]))
  r.done()
  return (True, k, m, use_closed, table_end, int(nnz), int(n_open), counts, sets, starts * 8,
          streams_at)


# Decoder tables by (k, width, the section's table bytes, open set built): sections with the
# same code table (most int8 sections of an update: a few tables among 44 on the 38M model)
# share one build. Oldest out first; a few MB at most.
_DECODER_TABLES: dict = {}
_DECODER_TABLES_MAX = 64
_DECODER_TABLES_LOCK = threading.Lock()


@numba.njit(**_JIT)
def _streams_end(ps, ends):
  """Whether every stream's bit position ps[j], rounded up to a byte, is its end ends[j]
  (in bits): one compiled call (four numpy ones cost as much as a small section's decode)."""
  for j in range(ps.size):
    if (ps[j] + 7) // 8 * 8 != ends[j]:
      return False
  return True


@numba.njit(inline="always", **_JIT)
def _apply_pack(buf, n, base, out, ends, fn, quad):
  """Section(...).apply(base, out, None) of the joint section `buf` over a pack of n
  elements (base, out: its members' unsigned bits back to back, out may be base itself;
  member j ends at element ends[j]), parse and code tables included, inlined in
  pack_coder's one compiled call (cold caches make each call cost tens of microseconds;
  the round decoder is linked as compiled, chosen.by_constant):
  (error code, the members' xxh3 by the C function at address fn, each made right after
  its elements were decoded, while in cache; 0: none). Not OK: the caller reads the
  section again through Section, which names the problem."""
  digests = np.zeros(ends.size, np.uint64)
  ok, k, m, use_closed, table_end, _, n_open, counts, sets, starts, streams_at = _parse(buf, n)
  if not ok:
    return E_TRUNCATED, digests
  width = 8 * out.itemsize
  words = np.zeros((buf.size - streams_at) // 8 + 4, np.uint64)  # entropy.words_of
  copy_bytes(words.ctypes.data, buf.ctypes.data + streams_at, buf.size - streams_at)
  tables = np.zeros((2, 1 << huffman.MAX_LEN), np.uint32)
  wholes = np.zeros((2, 1 << WHOLE), np.uint32)
  syms = buf[2:2 + m].astype(np.int64)
  half = 3 + m + (m + 1) // 2
  if use_closed and _decoder_tables(syms[:-1], buf[half:table_end], width, k, tables[0],
                                    wholes[0]):
    return E_TRUNCATED, digests
  if n_open and _decoder_tables(syms, buf[3 + m:half], width, k, tables[1], wholes[1]):
    return E_TRUNCATED, digests
  ps = starts[:STREAMS].copy()
  bit_ends = starts[1:]
  copy = out.ctypes.data != base.ctypes.data
  step = CALL_BYTES // out.itemsize  # whole rounds of STREAMS blocks
  ahead = base if copy else base[:0]
  hashed, at, size = 0, out.ctypes.data, out.itemsize
  for s in range(0, n, step):
    if copy:
      copy_bytes(at + s * size, base.ctypes.data + s * size, (min(n, s + step) - s) * size)
    err = decode_rounds_chosen(quad, (words, bit_ends, k, tables, wholes, out, s // BLOCK,
                                      (s + step) // BLOCK, n, counts, sets, ps, ahead))
    if err != OK:
      return err, digests
    done = hashed
    while done < ends.size and ends[done] <= s + step:
      done += 1
    if fn:
      hash_parts(fn, at, out.itemsize, ends, hashed, done, digests)
    hashed = done
  if fn:  # members of no elements at the end
    hash_parts(fn, at, out.itemsize, ends, hashed, ends.size, digests)
  for j in range(STREAMS):  # _streams_end
    if (ps[j] + 7) // 8 * 8 != bit_ends[j]:
      return E_TRUNCATED, digests
  return OK, digests


def forget_tables() -> None:
  """Empties the decoder-table cache (benchmarks time the parse of tables not seen yet)."""
  with _DECODER_TABLES_LOCK:
    _DECODER_TABLES.clear()


class Section:
  """A parsed joint section: its code tables and the four streams."""

  def __init__(self, r: ByteReader, n: int, udtype: np.dtype):
    self.n, self.udtype, self.what = n, udtype, r.what
    buf = np.frombuffer(r.buf, np.uint8)[r.pos:r.end]
    parsed = _parse(buf, n)  # one compiled call; the general reader names any problem
    (_, self.k, m, use_closed, table_end, self.nnz, n_open, self.counts, self.sets,
     self.starts, streams_at) = parsed if parsed[0] else parse_general(r, n)
    r.pos = r.end
    self.words = entropy.words_of(buf[streams_at:])
    self.tables, self.wholes = self._code_tables(buf[:table_end], m, use_closed, n_open)

  def _code_tables(self, head, m, use_closed, n_open):
    """(Huffman decode tables, whole-code tables) of the closed set (row 0, if any) and of
    the open one (row 1, only where a block takes it), from the section's table fields
    (head: its bytes up to their end): from the cache when these fields were seen, else
    built and kept."""
    width = 8 * self.udtype.itemsize
    key = (self.k, width, head[1:].tobytes(), n_open > 0)
    built = _DECODER_TABLES.get(key)
    if built is None:
      syms = head[2:2 + m].astype(np.int64)
      opened, closed = head[3 + m:3 + m + (m + 1) // 2], head[3 + m + (m + 1) // 2:]
      built = (np.zeros((2, 1 << huffman.MAX_LEN), np.uint32),
               np.zeros((2, 1 << WHOLE), np.uint32))
      if use_closed:
        self._check_table(_decoder_tables(syms[:-1], closed, width, self.k, built[0][0],
                                          built[1][0]))
      if n_open:  # the open set only where a block needs it
        self._check_table(_decoder_tables(syms, opened, width, self.k, built[0][1],
                                          built[1][1]))
      with _DECODER_TABLES_LOCK:  # apply's pool threads parse sections side by side
        if len(_DECODER_TABLES) >= _DECODER_TABLES_MAX:
          _DECODER_TABLES.pop(next(iter(_DECODER_TABLES)))
        _DECODER_TABLES[key] = built
    return built  # shared between sections: never written after this

  def _check_table(self, err: int) -> None:
    """Raises the CodecError of a _decoder_tables error code (0: none)."""
    if err == 1:
      raise CodecError(f"{self.what}: joint code table is not a sorted list of nonzero "
                       f"symbols")
    if err == 2:
      raise CodecError(f"{self.what}: joint code table holds values wider than the tensor's")
    if err == 3:
      raise CodecError(f"{self.what}: joint code table: code lengths are not a prefix code")

  def apply(self, old: np.ndarray, out: np.ndarray, hasher) -> None:
    """Writes old + changes into out (which may be old itself), CALL_BYTES at a time:
    copied, decoded in one compiled call, hashed while in cache (unless hasher is None)."""
    ps = self.starts[:STREAMS].copy()
    ends = self.starts[1:]
    copy = out is not old
    step = CALL_BYTES // old.itemsize  # whole rounds of STREAMS blocks
    base = old if copy else old[:0]
    decode = _ROUND_DECODERS[bool(QUAD)]
    for s in range(0, self.n, step):
      if copy:
        np.copyto(out[s:s + step], old[s:s + step])
      if decode(self.words, ends, self.k, self.tables, self.wholes, out, s // BLOCK,
                (s + step) // BLOCK, self.n, self.counts, self.sets, ps, base) != OK:
        raise CodecError(f"{self.what}: joint streams are truncated or corrupted, or a "
                         f"change lies outside its block")
      if hasher is not None:
        hasher.update(out[s:s + step])
    if not _streams_end(ps, ends):
      raise CodecError(f"{self.what}: a joint stream does not end where its length says")

  def changes(self, indices: np.ndarray | None = None,
              offsets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, wrapping offsets) of the changes, in order, without a full-size
    buffer (for an on-device scatter): written into the first nnz entries of `indices`
    (int32 or int64) and `offsets` (of the section's unsigned dtype) where given (both or
    neither; at least nnz long), else into new arrays (int64 indices)."""
    if indices is None:
      indices = np.empty(self.nnz, np.int64)
      offsets = np.empty(self.nnz, self.udtype)
    elif min(indices.size, offsets.size) < self.nnz:
      raise ValueError(f"{self.what}: {self.nnz} changes do not fit arrays of "
                       f"{min(indices.size, offsets.size)}")
    ps = self.starts[:STREAMS].copy()
    if decode_changes(self.words, self.starts[1:], self.k, self.tables, self.wholes, self.n,
                      self.counts, self.sets, ps, indices, offsets) != OK:
      raise CodecError(f"{self.what}: joint streams are truncated or corrupted, or a "
                       f"change lies outside its block")
    if not _streams_end(ps, self.starts[1:]):
      raise CodecError(f"{self.what}: a joint stream does not end where its length says")
    return indices, offsets
