"""Entropy stage: non-negative integers -> (bucket symbol, raw low bits); symbols by rANS.

A value z < 16 is its own symbol. A larger z is coded as its bit length and the two
bits below its leading one (four symbols per octave) plus its remaining low bits raw,
so the alphabet stays small (< 256) for any z < 2**56 while geometric-like and
peaked distributions (gaps between changed elements, ulp offsets) cost within a few
hundredths of a bit of their zeroth-order entropy. Symbols go through `constriction`'s
rANS coder with the stream's own symbol counts as the model (sent in the stream).

Stream layout, for n symbols (n is known to the caller):
  u8 m (distinct symbols; 0 iff n == 0) | m symbol ids (u8) | m counts (varint)
  then per block of up to ANS_BLOCK symbols:
    [varint nwords | nwords u32 rANS words]   (only when m > 1)
    varint extra_nbytes | extra_nbytes of raw low bits
or, for short streams where a table costs more than it saves (n <= LITERAL_MAX):
  u8 LITERAL | u8 width | the n values in `width` bits each (bits.pack_fixed).
"""

import constriction
import numpy as np

from rlax_ps.sync.bits import (bit_length, fixed_nbytes, pack_fixed, pack_varwidth, unpack_fixed,
                               unpack_varwidth)
from rlax_ps.sync.byte_reader import ByteReader, u8, varint
from rlax_ps.sync.errors import CodecError

DIRECT = 16
ALPHABET = DIRECT + 4 * (56 - 4)
ANS_BLOCK = 1 << 22
LITERAL = 255
LITERAL_MAX = 4096
# Bytes per block besides the rANS words and raw bits: two varints and the rANS flush.
_BLOCK_OVERHEAD = 10


def to_symbols(z: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Integers -> (symbols int32, raw-bit widths of the symbols >= DIRECT, their raw low bits)."""
  big = z >= DIRECT
  sym = np.where(big, 0, z).astype(np.int32)
  if not big.any():
    return sym, np.zeros(0, np.int64), np.zeros(0, np.uint64)
  bi = np.flatnonzero(big)
  zb = z[bi].astype(np.uint64)
  nb = bit_length(zb)
  w = nb - 3
  wu = w.astype(np.uint64)
  top = (zb >> wu) & np.uint64(3)
  sym[bi] = DIRECT + (nb - 5) * 4 + top.astype(np.int64)
  return sym, w, zb & ((np.uint64(1) << wu) - np.uint64(1))


def symbol_width(sym: np.ndarray) -> np.ndarray:
  """Raw-bit width of each symbol."""
  return np.where(sym < DIRECT, 0, (sym - DIRECT) // 4 + 2)


def from_symbols(sym: np.ndarray, extra_of_big) -> np.ndarray:
  """Inverse of `to_symbols`; `extra_of_big(widths)` returns the raw bits of the big symbols."""
  z = sym.astype(np.uint64)
  bi = np.flatnonzero(sym >= DIRECT)
  if bi.size:
    t = sym[bi].astype(np.int64) - DIRECT
    w = t // 4 + 2
    extra = extra_of_big(w)
    z[bi] = ((np.uint64(4) | (t % 4).astype(np.uint64)) << w.astype(np.uint64)) | extra
  else:
    extra_of_big(np.zeros(0, np.int64))
  return z


def cost_bytes(hist: np.ndarray) -> float:
  """Estimated stream size: zeroth-order entropy of the symbols + raw bits + table."""
  n = int(hist.sum())
  if n == 0:
    return 1.0
  c = hist[hist > 0].astype(np.float64)
  info_bits = float((c * np.log2(n / c)).sum())
  widths = symbol_width(np.arange(ALPHABET))
  raw_bits = float((hist * widths).sum())
  nblocks = -(-n // ANS_BLOCK)
  return (info_bits + raw_bits) / 8 + 1 + 4 * c.size + _BLOCK_OVERHEAD * nblocks


def _model(counts: np.ndarray):
  return constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)


def encode_stream(hist: np.ndarray, blocks) -> bytes:
  """Codes `blocks` of (symbols, widths, raw bits) from `to_symbols`, each ANS_BLOCK long
  except the last; `hist` is the histogram of all their symbols."""
  present = np.flatnonzero(hist)
  m = present.size
  out = [u8(m), present.astype(np.uint8).tobytes()]
  out += [varint(int(c)) for c in hist[present]]
  if m == 0:
    return b"".join(out)
  lut = np.full(ALPHABET, -1, np.int32)
  lut[present] = np.arange(m, dtype=np.int32)
  model = _model(hist[present]) if m > 1 else None
  for sym, width, extra in blocks:
    if model is not None:
      coder = constriction.stream.stack.AnsCoder()
      coder.encode_reverse(lut[sym], model)
      words = coder.get_compressed()
      out += [varint(words.size), words.astype("<u4").tobytes()]
    raw = pack_varwidth(extra, width)
    out += [varint(len(raw)), raw]
  return b"".join(out)


def literal_cost(z: np.ndarray) -> float:
  """Bytes of the literal layout of `z` (inf when the stream is too long for it)."""
  if not 0 < z.size <= LITERAL_MAX:
    return float("inf")
  return 2 + fixed_nbytes(z.size, int(bit_length(np.array([z.max()], np.uint64))[0]))


def encode_literal(z: np.ndarray) -> bytes:
  width = int(bit_length(np.array([z.max()], np.uint64))[0])
  return u8(LITERAL) + u8(width) + pack_fixed(z.astype(np.uint64), width)


def decode_stream(r: ByteReader, n: int):
  """Yields the integers of a stream of `n` symbols block by block; validates as it goes."""
  m = r.u8()
  if m == LITERAL:
    width = r.u8()
    if not 0 < n <= LITERAL_MAX or width > 56:
      raise CodecError(f"{r.what}: literal stream of {n} values, {width} bits each")
    yield unpack_fixed(r.take(fixed_nbytes(n, width)), n, width, r.what)
    return
  if (m == 0) != (n == 0):
    raise CodecError(f"{r.what}: symbol table has {m} symbols for {n} values")
  present = np.frombuffer(r.take(m), np.uint8).astype(np.int64)
  if m and (np.any(np.diff(present) <= 0) or present[-1] >= ALPHABET):
    raise CodecError(f"{r.what}: symbol table is not a sorted list of known symbols")
  counts = np.array([r.varint() for _ in range(m)], np.int64)
  if int(counts.sum()) != n or (m and counts.min() <= 0):
    raise CodecError(f"{r.what}: symbol counts sum to {int(counts.sum())}, expected {n}")
  if n == 0:
    return
  model = _model(counts) if m > 1 else None
  seen = np.zeros(m, np.int64)
  for s in range(0, n, ANS_BLOCK):
    size = min(ANS_BLOCK, n - s)
    if model is None:
      idx = np.zeros(size, np.int64)
    else:
      nwords = r.varint()
      words = np.frombuffer(r.take(4 * nwords), "<u4").astype(np.uint32)
      try:
        coder = constriction.stream.stack.AnsCoder(words)
        idx = coder.decode(model, size).astype(np.int64)
        clean = coder.is_empty()
      except (ValueError, RuntimeError, OverflowError) as e:
        raise CodecError(f"{r.what}: rANS stream is corrupted ({e})") from None
      if not clean:
        raise CodecError(f"{r.what}: rANS stream has data left after {size} symbols")
    seen += np.bincount(idx, minlength=m)
    sym = present[idx]
    raw = r.take(r.varint())
    yield from_symbols(sym, lambda w, raw=raw: unpack_varwidth(raw, w, r.what))
  if np.any(seen != counts):
    raise CodecError(f"{r.what}: decoded symbol counts differ from the stream's table")


def split_symbols(sym: np.ndarray, width: np.ndarray, extra: np.ndarray):
  """`to_symbols` output of one stream cut into ANS_BLOCK pieces for `encode_stream`."""
  if sym.size <= ANS_BLOCK:
    yield sym, width, extra
    return
  big_before = np.cumsum(sym >= DIRECT)
  for s in range(0, sym.size, ANS_BLOCK):
    e = min(s + ANS_BLOCK, sym.size)
    lo = int(big_before[s - 1]) if s else 0
    hi = int(big_before[e - 1])
    yield sym[s:e], width[lo:hi], extra[lo:hi]
