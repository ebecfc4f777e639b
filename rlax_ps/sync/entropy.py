"""Entropy coding of non-negative integers: bucket symbols in one static rANS stream, plus
the raw low bits of the larger values.

A value below DIRECT is its own symbol. A larger value of bit length b (6 <= b <= 52) is
symbol DIRECT + 4 (b - 6) + (its two bits below the leading one), followed by its b - 3
low bits, raw: buckets a quarter of an octave wide, inside which the value is taken as
uniform. Small values (offsets of a few ulps, gaps at high density) cost their entropy;
large ones (gaps at low density) cost within a fraction of a percent of it.

Stream layout (FORMAT.md): u8 scale | varint alphabet size S (the largest symbol + 1) | the S
frequencies (summing to 2**scale), each a varint, a run of zeros as 0 and varint run - 1 | varint rANS byte count | rANS bytes (16-bit words, little-endian,
the first two holding the final state) | the raw bits, LSB first, in value order, up to
the end of the caller's field. The rANS state lies in [2**15, 2**31), renormalised 16 bits at a time;
a decoder that does not end on the initial state, or reads past its words, rejects the
stream.
"""

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros

from rlax_ps.sync.byte_reader import ByteReader, varint
from rlax_ps.sync.errors import CodecError

DIRECT = 32
MAX_BITS = 52
ALPHABET = DIRECT + 4 * (MAX_BITS - 5)
MAX_SCALE = 14
_L = 1 << 15  # the rANS state stays in [_L, 2**31)
_JIT = dict(nogil=True, cache=True, boundscheck=False)


@numba.njit(**_JIT)
def _symbols(values, syms, counts):
  """Each value's symbol, and the symbol counts; returns the total raw bits."""
  total = 0
  for i in range(values.size):
    z = values[i]
    if z < np.uint64(DIRECT):
      s = np.int64(z)
    else:
      w = 61 - np.int64(leading_zeros(z))  # bit length - 3
      s = DIRECT + 4 * (w - 3) + np.int64((z >> np.uint64(w)) & np.uint64(3))
      total += w
    syms[i] = s
    counts[s] += 1
  return total


@numba.njit(**_JIT)
def _raw_bits(values, raw):
  """The raw low bits of the values of DIRECT or more, packed LSB first."""
  acc, fill, p = np.uint64(0), np.uint64(0), 0
  for i in range(values.size):
    z = values[i]
    if z < np.uint64(DIRECT):
      continue
    w = np.uint64(61 - leading_zeros(z))
    acc |= (z & ((np.uint64(1) << w) - np.uint64(1))) << fill
    fill += w
    while fill >= np.uint64(8):
      raw[p] = acc & np.uint64(0xFF)
      p += 1
      acc >>= np.uint64(8)
      fill -= np.uint64(8)
  if fill:
    raw[p] = acc


@numba.njit(**_JIT)
def _encode(syms, x_max, rcp, shift, bias, cmpl, words):
  """rANS words of `syms`, written at the end of `words`; returns where they start.
  x // freq is a multiply by a reciprocal (exact for x < 2**31, the state's range)."""
  x = np.uint64(_L)
  o = words.size
  for i in range(syms.size - 1, -1, -1):
    s = syms[i]
    if x >= x_max[s]:
      o -= 1
      words[o] = x & np.uint64(0xFFFF)
      x >>= np.uint64(16)
    q = ((x * rcp[s]) >> np.uint64(32)) >> shift[s]
    x = x + bias[s] + q * cmpl[s]
  words[o - 2] = x & np.uint64(0xFFFF)
  words[o - 1] = x >> np.uint64(16)
  return o - 2


@numba.njit(**_JIT)
def _decode(words, raw, n, freq, start, slot_sym, scale, limit, mode, out):
  """Decodes n values into `out`; mode 0 plain, 1 running positions (each value is a gap:
  out = previous + value + 1, from -1), 2 zigzag-decoded. Returns 0, or a negative error:
  -1 rANS words overrun, -2 bad final state or words left, -3 raw bits overrun,
  -4 a value (or a position) above `limit`."""
  if words.size < 2:
    return -1
  x = np.uint32(words[0]) | (np.uint32(words[1]) << np.uint32(16))
  p = 2
  mask = np.uint32((1 << scale) - 1)
  acc, fill, q = np.uint64(0), 0, 0
  pos = np.int64(-1)
  for i in range(n):
    slot = x & mask
    s = slot_sym[slot]
    x = np.uint32(freq[s] * (x >> np.uint32(scale)) + slot - start[s])
    if x < _L:
      if p >= words.size:
        return -1
      x = (x << np.uint32(16)) | np.uint32(words[p])
      p += 1
    if s < DIRECT:
      z = np.uint64(s)
    else:
      w = (s - DIRECT) // 4 + 3
      while fill < w:
        if q >= raw.size:
          return -3
        acc |= np.uint64(raw[q]) << np.uint64(fill)
        q += 1
        fill += 8
      low = acc & ((np.uint64(1) << np.uint64(w)) - np.uint64(1))
      acc = acc >> np.uint64(w) if w < 64 else np.uint64(0)
      fill -= w
      z = ((np.uint64(4) | np.uint64((s - DIRECT) & 3)) << np.uint64(w)) | low
    if z > limit:
      return -4
    if mode == 1:
      pos += np.int64(z) + 1
      if np.uint64(pos) > limit:
        return -4
      out[i] = pos
    elif mode == 2:
      out[i] = (z >> np.uint64(1)) ^ (np.uint64(0) - (z & np.uint64(1)))
    else:
      out[i] = z
  if x != _L or p != words.size:
    return -2
  return 0


def _normalize(counts: np.ndarray, scale: int) -> np.ndarray:
  """Frequencies summing to 2**scale, at least 1 for every symbol that occurs."""
  total = int(counts.sum())
  freq = np.where(counts > 0, np.maximum(1, np.round(counts * ((1 << scale) / total))), 0)
  freq = freq.astype(np.int64)
  order = np.argsort(-freq, kind="stable")
  diff = (1 << scale) - int(freq.sum())
  while diff:
    for s in order:
      if diff == 0 or freq[s] == 0:
        break
      step = 1 if diff > 0 else -1
      if freq[s] + step >= 1:
        freq[s] += step
        diff -= step
  return freq


def _tables(freq: np.ndarray, scale: int) -> tuple:
  """Per symbol: the renormalisation bound, reciprocal, shift, bias and 2**scale - freq of
  the encoder (a symbol of frequency 1 takes q = x - 1 and a bias that makes up for it)."""
  start = np.concatenate([[0], np.cumsum(freq)[:-1]])
  shift = np.array([max(0, int(f - 1).bit_length()) for f in freq], np.int64)
  rcp = np.where(freq > 1, ((1 << (shift + 31)) + freq - 1) // np.maximum(freq, 1), 0xFFFFFFFF)
  bias = np.where(freq > 1, start, start + (1 << scale) - 1)
  return tuple(np.asarray(t, np.uint64) for t in (
      ((_L >> scale) << 16) * freq, rcp, np.maximum(shift - 1, 0), bias, (1 << scale) - freq))


def encode(values: np.ndarray) -> bytes:
  """The stream of `values` (non-negative integers below 2**MAX_BITS); the count is not
  stored: the caller's field holds it."""
  n = values.size
  values = np.ascontiguousarray(values, np.uint64)
  if not n or values.max() >> np.uint64(MAX_BITS):
    raise ValueError(f"entropy.encode: expected 1 or more values below 2**{MAX_BITS}")
  syms = np.empty(n, np.uint8)
  counts = np.zeros(ALPHABET, np.int64)
  raw = np.zeros((_symbols(values, syms, counts) + 7) // 8, np.uint8)
  _raw_bits(values, raw)
  counts = counts[:int(np.flatnonzero(counts)[-1]) + 1]
  scale = min(MAX_SCALE, max(8, n.bit_length() + 1))
  freq = _normalize(counts, scale)
  words = np.empty(n + 2, np.uint16)
  o = _encode(syms, *_tables(freq, scale), words)
  table, i = [], 0
  while i < freq.size:  # a zero run is 0 and its length - 1
    run = int(np.argmax(freq[i:] > 0)) if freq[i] == 0 else 0
    table.append(varint(int(freq[i])) if run == 0 else b"\0" + varint(run - 1))
    i += max(run, 1)
  coded = words[o:].astype("<u2").tobytes()
  return b"".join([bytes([scale]), varint(freq.size), *table, varint(len(coded)), coded,
                   raw.tobytes()])


@numba.njit(**_JIT)
def _varint_at(buf, pos, end):
  """(value, position after it) of the LEB128 varint at buf[pos:end]; position -1 when it
  is truncated, -2 when it runs over 64 bits."""
  v, shift = np.uint64(0), 0
  while True:
    if pos >= end:
      return v, -1
    b = buf[pos]
    pos += 1
    v |= np.uint64(b & 0x7F) << np.uint64(shift)
    if not b & 0x80:
      return v, pos
    shift += 7
    if shift > 63:
      return v, -2


@numba.njit(**_JIT)
def _decode_stream(buf, pos, end, n, limit, mode, out):
  """The whole of decode() (header, table, rANS words and raw bits of buf[pos:end]) in
  one compiled call, so that a tensor's streams cost no per-stream Python. Returns
  (error, detail): error 0, or one of _ERRORS' keys with the value it names."""
  if pos >= end:
    return 1, 0
  scale = np.int64(buf[pos])
  pos += 1
  if scale < 1 or scale > MAX_SCALE:
    return 2, scale
  v, pos = _varint_at(buf, pos, end)
  if pos < 0:
    return 3 - pos, 0  # 4 truncated, 5 over 64 bits
  count = np.int64(v)
  if count < 1 or count > ALPHABET:
    return 6, count
  freq = np.zeros(ALPHABET, np.uint32)
  s, run, total = 0, False, 0
  while s < count:  # the frequency table: varints, a zero run as 0 and its length - 1
    v, pos = _varint_at(buf, pos, end)
    if pos < 0:
      return 3 - pos, 0
    if run:
      if v >= np.uint64(count - s):
        return 7, count
      s += np.int64(v) + 1
      run = False
    elif v:
      if v > np.uint64(1 << MAX_SCALE):
        return 8, np.int64(v)
      freq[s] = np.uint32(v)
      total += np.int64(v)
      s += 1
    else:
      run = True
  if total != 1 << scale:
    return 8, total
  start = np.zeros(ALPHABET, np.uint32)
  slot_sym = np.empty(1 << scale, np.uint8)
  acc = 0
  for k in range(ALPHABET):
    start[k] = acc
    for j in range(acc, acc + np.int64(freq[k])):
      slot_sym[j] = k
    acc += np.int64(freq[k])
  v, pos = _varint_at(buf, pos, end)
  if pos < 0:
    return 3 - pos, 0
  nbytes = np.int64(v)
  if nbytes > end - pos:
    return 9, nbytes
  if nbytes % 2:
    return 10, nbytes
  words = buf[pos:pos + nbytes].view(np.uint16)
  err = _decode(words, buf[pos + nbytes:end], n, freq, start, slot_sym, scale, limit, mode,
                out)
  return (0, 0) if err == 0 else (10 - err, 0)


_ERRORS = {  # _decode_stream's errors, with the detail it returns
    1: "truncated: no entropy table scale",
    2: f"entropy table scale {{}} outside [1, {MAX_SCALE}]",
    4: "truncated entropy stream header",
    5: "varint longer than 64 bits in the entropy stream header",
    6: f"entropy table of {{}} symbols (at most {ALPHABET})",
    7: "entropy table's zero run passes its {} symbols",
    8: "entropy table's frequencies sum to {}, expected {}",
    9: "truncated: a rANS stream of {} bytes runs past the stream",
    10: "rANS stream of an odd byte count {}",
    11: "corrupted entropy stream: rANS words run out",
    12: "corrupted entropy stream: rANS stream does not end where it began",
    13: "corrupted entropy stream: raw bits run out",
    14: "corrupted entropy stream: a value exceeds its limit {}",
}


def decode(r: ByteReader, n: int, limit: int, mode: int, out: np.ndarray) -> None:
  """Decodes n values from `r` (up to its end) into `out` (see _decode for `mode`);
  CodecError naming r.what when the stream is malformed or a value exceeds `limit`."""
  buf = np.frombuffer(r.buf, np.uint8)
  err, detail = _decode_stream(buf, r.pos, r.end, n, np.uint64(limit), mode, out)
  if err:
    scale = buf[r.pos] if r.pos < r.end else 0
    args = {8: (detail, 1 << int(scale)), 14: (limit,)}.get(err, (detail,))
    raise CodecError(f"{r.what}: " + _ERRORS[err].format(*args))
  r.pos = r.end
