"""Entropy stage: non-negative integers -> (bucket symbol, raw low bits); symbols by rANS.

A value z < 16 is its own symbol. A larger z is coded as its bit length and the two
bits below its leading one (four symbols per octave) plus its remaining low bits raw,
so the alphabet stays small (< 256) for any z < 2**56 while geometric-like and
peaked distributions (gaps between changed elements, ulp offsets) cost within a few
hundredths of a bit of their zeroth-order entropy. Symbols go through a static rANS
coder (rans.py: four interleaved states, 16-bit words, 12-bit probabilities normalized
from the stream's own symbol counts, which are sent in the stream).

Stream layout, for n symbols (n is known to the caller):
  u8 m (distinct symbols; 0 iff n == 0) | m symbol ids (u8) | m counts (varint)
  | [varint nwords | nwords rANS words, uint16 little-endian]   (only when m > 1)
  | varint raw_nbytes | raw low bits of the symbols >= 16, LSB first
or, for short streams where a table costs more than it saves (n <= LITERAL_MAX):
  u8 LITERAL | u8 width | the n values in `width` bits each (bits.pack_fixed), each
  less 1 in a stream of nonzero values (the offsets of changed elements).
"""

import numpy as np

from rlax_ps.sync import loops, rans
from rlax_ps.sync.bits import fixed_nbytes, read_only, unpack_fixed
from rlax_ps.sync.byte_reader import ByteReader
from rlax_ps.sync.errors import CodecError

DIRECT = loops.DIRECT
ALPHABET = loops.ALPHABET
LITERAL = loops.LITERAL
LITERAL_MAX = loops.LITERAL_MAX
_ERRORS = {loops.E_TRUNCATED: "truncated", loops.E_RANGE: "value out of range",
           loops.E_STATE: "rANS stream is corrupted (wrong final state or trailing bytes)",
           loops.E_ZERO: "a changed element has a zero offset"}


def histogram(z: np.ndarray) -> np.ndarray:
  """Symbol counts of the integers z."""
  hist = np.zeros(ALPHABET, np.int64)
  loops.histogram(z, hist)
  return hist


WIDTHS = loops.WIDTHS  # raw bits of each symbol
_NO_CODE = read_only(np.zeros(0, np.uint16))  # the rANS words of a one-symbol table: none


# Estimated stream size of symbols whose information + raw bits are `bits`, with `present`
# distinct symbols (two varints, the rANS flush and rounding, the table's bytes besides);
# compiled, as the compiled section coders cost streams too.
cost_of = loops.cost_of


def cost_bytes(hist: np.ndarray) -> float:
  """Estimated stream size: zeroth-order entropy of the symbols + raw bits + table."""
  return cost_of(*loops.entropy_bits(hist, WIDTHS))


def encode_stream(hist: np.ndarray, z: np.ndarray) -> bytes:
  """Codes the integers z, whose symbol histogram is `hist`."""
  syms, raw = loops.symbols(z, int((hist * WIDTHS).sum()))
  return encode_symbols(hist, syms, raw)


def encode_symbols(hist: np.ndarray, syms: np.ndarray, raw: np.ndarray) -> bytes:
  """Codes a stream given as its symbols (uint8), their histogram and their raw-bit words."""
  return rans.symbol_stream(hist, syms, raw, WIDTHS).tobytes()


def literal_cost(z: np.ndarray, low: int = 0, top: int | None = None) -> float:
  """Bytes of the literal layout of `z` (all >= low; inf when the stream is too long);
  `top`: z's largest value, when the caller knows it."""
  if not 0 < z.size <= LITERAL_MAX:
    return float("inf")
  return 2 + fixed_nbytes(z.size, _literal_width(z, low, top))


def encode_literal(z: np.ndarray, low: int = 0, top: int | None = None) -> bytes:
  """The literal layout of z - low (low = 1 for the nonzero codes of changed elements);
  `top` as for literal_cost."""
  return loops.literal_stream(z, low, int(z.max()) if top is None else top).tobytes()


def _literal_width(z: np.ndarray, low: int, top: int | None) -> int:
  return ((int(z.max()) if top is None else top) - low).bit_length()


def words_of(buf) -> np.ndarray:
  """Bytes as zero-padded little-endian uint64 words, 25 or more zero bytes past the end:
  the decoders' 8-byte window loads, even past a corrupted stream's end, stay inside."""
  words = np.zeros(len(buf) // 8 + 4, np.uint64)
  words.view(np.uint8)[:len(buf)] = np.frombuffer(buf, np.uint8)
  return words


def decode_stream(r: ByteReader, n: int, dtype=np.uint64, limit: int = 1 << 56,
                  unzig: int = 0) -> np.ndarray:
  """The n integers of a stream (each < limit) as `dtype`; unzig=1/2: their wrapping
  offsets instead of zigzag codes (1: zero codes rejected). Validates everything."""
  m = r.u8()
  if m == LITERAL:
    width = r.u8()
    if not 0 < n <= LITERAL_MAX or width > 56:
      raise CodecError(f"{r.what}: literal stream of {n} values, {width} bits each")
    z = unpack_fixed(r.take(fixed_nbytes(n, width)), n, width, r.what)
    out = np.empty(n, dtype)
    top = loops.literal_values(z, unzig, out)
    if top >= limit:
      raise CodecError(f"{r.what}: value {top} out of range (limit {limit})")
    return out
  if (m == 0) != (n == 0):
    raise CodecError(f"{r.what}: symbol table has {m} symbols for {n} values")
  present = np.frombuffer(r.take(m), np.uint8).astype(np.int64)
  if m and (np.any(np.diff(present) <= 0) or present[-1] >= ALPHABET):
    raise CodecError(f"{r.what}: symbol table is not a sorted list of known symbols")
  counts = np.array([r.varint() for _ in range(m)], np.int64)
  if sum(int(c) for c in counts) != n or (m and counts.min() <= 0):
    raise CodecError(f"{r.what}: symbol counts sum to {sum(int(c) for c in counts)}, "
                     f"expected {n}")
  out = np.empty(n, dtype)
  if n == 0:
    return out
  freq = rans.normalize(counts) if m > 1 else np.ones(1, np.int64)
  code = _NO_CODE
  if m > 1:
    nwords = r.varint()
    if nwords > 2 * n + 8:
      raise CodecError(f"{r.what}: {nwords} rANS words for {n} values")
    code = np.frombuffer(r.take(2 * nwords), "<u2")
    code = read_only(code if code.flags.aligned else code.copy())  # one compile of rans
  raw_bits = int((counts * WIDTHS[present]).sum())
  raw_nbytes = r.varint()
  if raw_nbytes != (raw_bits + 7) // 8:
    raise CodecError(f"{r.what}: raw bits hold {raw_nbytes} bytes, expected "
                     f"{(raw_bits + 7) // 8}")
  raw = words_of(r.take(raw_nbytes))
  err = rans.decode(code, raw, raw_bits, present, freq, n, limit, unzig, out)
  if err != loops.OK:
    raise CodecError(f"{r.what}: {_ERRORS.get(err, 'corrupted')}")
  return out
