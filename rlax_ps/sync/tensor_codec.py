"""One tensor's section of an update: find the changed elements, pick the smallest mode, code it.

Modes (chosen per tensor by estimated size, see `encode_section`):
  unchanged  no bytes.
  raw        the target's exact bytes (keyframes; deltas where nothing smaller exists).
  sparse     varint nnz | gaps | offset stream. Gaps between changed flat indices (index -
             previous index - 1) are Rice coded (u8 0x80 | k, varint nbytes, then per gap
             q zero bits, a one, k low bits, LSB first; within ~1% of the entropy of
             i.i.d. positions, and fast) or, when the changes cluster, through the
             entropy stage (u8 0, then a stream). The offset stream holds the zigzag of
             each element's wrapping offset new_bits - old_bits (entropy.py).
  bitmap     varint zlen | zstd(np.packbits(changed mask)) | offset stream; picked when
             the changes follow a pattern that a bitmap compresses below the gaps.
  dense      one offset stream over every element (zero offsets included); picked at
             high density, where it reaches the zeroth-order entropy of the offsets.
Bit patterns are handled as unsigned integers of the held dtype's width, so any bf16
pattern (NaN payloads, inf, -0.0, subnormals) and any int8 code round-trips exactly.
Scans and applies go block by block so that compare, copy, scatter and checksum of a
block happen while it is in cache.
"""

import dataclasses

import numpy as np
import xxhash
import zstandard

from rlax_ps.sync import entropy, loops
from rlax_ps.sync.byte_reader import ByteReader, u8, varint
from rlax_ps.sync.errors import CodecError

UNCHANGED, RAW, SPARSE, BITMAP, DENSE = range(5)
MODE_NAMES = ("unchanged", "raw", "sparse", "bitmap", "dense")
GAPS_ENTROPY, GAPS_RICE = 0, 0x80  # Rice: 0x80 | k in one byte
BLOCK = 1 << 16
_SAMPLE = 1 << 20
_GAP_SAMPLE = 1 << 16
_DENSITY_SAMPLE = 1 << 14
_ZSTD_LEVEL = 3


def _estimate_density(old: np.ndarray, new: np.ndarray) -> float:
  """Fraction of differing elements in an evenly spaced sample of 64-bit words."""
  m = old.size - old.size % (8 // old.itemsize)
  if m == 0:
    return 1.0
  ow, nw = old[:m].view(np.uint64), new[:m].view(np.uint64)
  step = max(1, ow.size // _DENSITY_SAMPLE)
  return float((ow[::step] != nw[::step]).mean())


def scan_changes(old: np.ndarray, new: np.ndarray):
  """(flat indices int64 ascending where two unsigned bit arrays differ, zigzag codes of the
  wrapping offsets new - old there (old's dtype), xxh3 of old, xxh3 of new). One compiled
  pass per cache-sized block compares 64-bit words and compacts; the block is then hashed
  while still in cache."""
  n = old.size
  lanes = 8 // old.itemsize
  scan = loops.scan_block16 if old.itemsize == 2 else loops.scan_block8
  words_differ = _estimate_density(old, new)
  dense = words_differ > 0.2  # branch per word mispredicted: do every lane branch-free
  cap = min(n + 8, int(n * words_differ * 1.1) + 2 * BLOCK)  # +8: branch-free overrun
  idx, zz = np.empty(cap, np.int64), np.empty(cap, old.dtype)
  h_old, h_new = xxhash.xxh3_64(), xxhash.xxh3_64()
  pos = 0
  for s in range(0, n, BLOCK):
    a, b = old[s:s + BLOCK], new[s:s + BLOCK]
    m = a.size - a.size % lanes
    aw, bw = a[:m].view(np.uint64), b[:m].view(np.uint64)
    while (end := scan(aw, bw, a, b, s, idx, zz, pos, dense)) < 0:
      cap = min(n + 8, max(2 * cap, pos + 2 * BLOCK))
      idx, zz = np.resize(idx, cap), np.resize(zz, cap)
    pos = end
    h_old.update(a)
    h_new.update(b)
  return idx[:pos], zz[:pos], h_old.intdigest(), h_new.intdigest()


def _rice(idx: np.ndarray) -> tuple[int, int]:
  """(k, exact size in bytes of the Rice bits) of the best Rice parameter near log2 of the
  mean gap."""
  nnz = idx.size
  mean = (int(idx[-1]) + 1 - nnz) / nnz
  k0 = max(0, int(np.log2(mean * np.log(2) + 1)))
  lo, hi = max(0, k0 - 1), min(56, k0 + 2)
  unary = loops.rice_sizes(idx, lo, hi)
  sizes = [(int(unary[k - lo]) + k * nnz + 7) // 8 for k in range(lo, hi)]
  best = int(np.argmin(sizes))
  return lo + best, sizes[best]


def _encode_rice(idx: np.ndarray, k: int, nbytes: int) -> bytes:
  words = loops.rice_encode(idx, k, nbytes * 8)
  return b"".join([u8(GAPS_RICE | k), varint(nbytes), words.view(np.uint8)[:nbytes]])


def _sampled_entropy_bytes(idx: np.ndarray) -> float:
  """Entropy-stage size of the gaps of `idx` estimated from an evenly spaced sample."""
  step = max(1, idx.size // _GAP_SAMPLE)
  hist = np.zeros(entropy.ALPHABET, np.int64)
  loops.gap_histogram(idx, step, hist)
  return entropy.cost_bytes(hist) * step


def _encode_gaps(idx: np.ndarray) -> tuple[float, callable]:
  """(estimated size, thunk producing the bytes) of the cheaper gap coder."""
  k, rice_size = _rice(idx)
  if _sampled_entropy_bytes(idx) >= 0.97 * rice_size:
    return rice_size + 3, lambda: _encode_rice(idx, k, rice_size)
  gaps = (np.diff(idx, prepend=-1) - 1).astype(np.uint64)
  hist = entropy.histogram(gaps)
  return entropy.cost_bytes(hist) + 1, lambda: u8(GAPS_ENTROPY) + entropy.encode_stream(
      hist, gaps)


def _bitmap_bytes(idx: np.ndarray, n: int) -> bytes:
  mask = np.zeros(n, bool)
  mask[idx] = True
  return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(np.packbits(mask).tobytes())


def _bitmap_wins(idx: np.ndarray, n: int, gap_cost: float) -> bool:
  """Whether a zstd bitmap beats the gaps on the first _SAMPLE elements (a cheap probe)."""
  cut = np.searchsorted(idx, min(n, _SAMPLE))
  if cut < 64:
    return False
  return len(_bitmap_bytes(idx[:cut], min(n, _SAMPLE))) < 0.9 * gap_cost * cut / idx.size


@dataclasses.dataclass(frozen=True)
class Encoded:
  mode: int
  section: object  # bytes-like
  checksum: int
  base_checksum: int | None


def encode_section(old: np.ndarray | None, new: np.ndarray) -> Encoded:
  """The section taking unsigned bit array `old` (None: keyframe) to `new`."""
  n = new.size
  if old is None:
    return Encoded(RAW, new, xxhash.xxh3_64_intdigest(new), None)
  idx, z, h_old, h_new = scan_changes(old, new)
  if idx.size == 0:
    return Encoded(UNCHANGED, b"", h_new, h_old)
  hist_v = entropy.histogram(z)
  cost_v = min(entropy.cost_bytes(hist_v), entropy.literal_cost(z))
  gap_cost, gap_bytes = _encode_gaps(idx)
  costs = {RAW: new.nbytes, SPARSE: gap_cost + cost_v + 9}
  if idx.size * 4 > n:
    hist_d = hist_v.copy()
    hist_d[0] += n - idx.size
    costs[DENSE] = entropy.cost_bytes(hist_d)
  bitmap = None
  if _bitmap_wins(idx, n, gap_cost):
    bitmap = _bitmap_bytes(idx, n)
    costs[BITMAP] = len(bitmap) + cost_v + 9
  mode = min(costs, key=costs.get)
  if mode == RAW:
    return Encoded(RAW, new, h_new, h_old)
  if mode == DENSE:
    full = np.zeros(n, z.dtype)
    full[idx] = z
    return Encoded(DENSE, entropy.encode_stream(hist_d, full), h_new, h_old)
  if entropy.literal_cost(z) < entropy.cost_bytes(hist_v):
    values = entropy.encode_literal(z)
  else:
    values = entropy.encode_stream(hist_v, z)
  if mode == SPARSE:
    return Encoded(SPARSE, b"".join([varint(idx.size), gap_bytes(), values]), h_new, h_old)
  return Encoded(BITMAP, b"".join([varint(len(bitmap)), bitmap, values]), h_new, h_old)


@dataclasses.dataclass(frozen=True)
class Decoded:
  """A decoded section as unsigned bit arrays: sparse (indices, offsets), dense offsets over
  every element, or the full replacement bits."""
  mode: int
  indices: np.ndarray | None = None
  offsets: np.ndarray | None = None
  replacement: np.ndarray | None = None

  def apply(self, old: np.ndarray | None, udtype: np.dtype, inplace: bool = False
            ) -> tuple[np.ndarray, int]:
    """(new bit array, its xxh3) from `old`, written into `old` itself when `inplace`;
    copy, scatter and hash run block by block."""
    if self.mode == RAW:
      if inplace:
        old[...] = self.replacement
        return old, xxhash.xxh3_64_intdigest(old)
      out = self.replacement.astype(udtype)
      return out, xxhash.xxh3_64_intdigest(out)
    out = old if inplace else np.empty_like(old)
    h = xxhash.xxh3_64()
    if self.mode == SPARSE or self.mode == BITMAP:
      bounds = np.searchsorted(self.indices, np.arange(0, old.size + BLOCK, BLOCK))
    for k, s in enumerate(range(0, old.size, BLOCK)):
      blk = out[s:s + BLOCK]
      if self.mode == DENSE:
        np.add(old[s:s + BLOCK], self.offsets[s:s + BLOCK], out=blk)
      else:
        if not inplace:
          np.copyto(blk, old[s:s + BLOCK])
        if self.mode != UNCHANGED and bounds[k] < bounds[k + 1]:
          loops.scatter_add(blk, self.indices, self.offsets, bounds[k], bounds[k + 1], s)
      h.update(blk)
    return out, h.intdigest()


def decode_section(what: str, mode: int, section, n: int, udtype: np.dtype) -> Decoded:
  """Parses and validates one section holding `n` elements of unsigned type `udtype`."""
  r = ByteReader(section, what)
  if mode == UNCHANGED:
    r.done()
    return Decoded(UNCHANGED)
  if mode == RAW:
    if len(section) != n * udtype.itemsize:
      raise CodecError(
          f"{what}: raw section holds {len(section)} bytes, expected {n * udtype.itemsize}")
    return Decoded(RAW, replacement=np.frombuffer(section, udtype.newbyteorder("<")))
  if mode == DENSE:
    offsets = _offsets(r, n, udtype, nonzero=False)
    r.done()
    return Decoded(DENSE, offsets=offsets)
  if mode == SPARSE:
    nnz = r.varint()
    if not 0 < nnz <= n:
      raise CodecError(f"{what}: {nnz} changed elements declared for a tensor of {n}")
    idx = _decode_gaps(r, nnz, n)
  elif mode == BITMAP:
    zbytes = r.take(r.varint())
    try:
      packed = zstandard.ZstdDecompressor().decompress(
          zbytes, max_output_size=(n + 7) // 8)
    except zstandard.ZstdError as e:
      raise CodecError(f"{what}: bitmap is corrupted ({e})") from None
    if len(packed) != (n + 7) // 8:
      raise CodecError(f"{what}: bitmap holds {len(packed)} bytes, expected {(n + 7) // 8}")
    idx = np.flatnonzero(np.unpackbits(np.frombuffer(packed, np.uint8), count=n))
    if idx.size == 0:
      raise CodecError(f"{what}: bitmap marks no changed element")
  else:
    raise CodecError(f"{what}: unknown section mode {mode}")
  offsets = _offsets(r, idx.size, udtype, nonzero=True)
  r.done()
  return Decoded(mode, indices=idx, offsets=offsets)


def _decode_gaps(r: ByteReader, nnz: int, n: int) -> np.ndarray:
  """Flat indices (ascending, < n) of the nnz changed elements."""
  coder = r.u8()
  if coder == GAPS_ENTROPY:
    gaps = entropy.decode_stream(r, nnz, np.int64, limit=n)
    idx = np.cumsum(gaps + 1) - 1
    if idx[-1] >= n:
      raise CodecError(f"{r.what}: changed index {int(idx[-1])} outside the tensor size {n}")
    return idx
  if not coder & GAPS_RICE:
    raise CodecError(f"{r.what}: unknown gap coder {coder}")
  k = coder & ~GAPS_RICE
  if k > 56:
    raise CodecError(f"{r.what}: Rice parameter {k} exceeds 56")
  nbytes = r.varint()
  buf = r.take(nbytes)
  idx = np.empty(nnz, np.int64)
  err = loops.rice_decode(entropy.words_of(buf), nbytes, k, nnz, n, idx)
  if err == loops.E_RANGE:
    raise CodecError(f"{r.what}: a changed index lies outside the tensor size {n}")
  if err != loops.OK:
    raise CodecError(f"{r.what}: Rice-coded gaps are truncated or have trailing bytes")
  return idx


def _offsets(r: ByteReader, n: int, udtype: np.dtype, nonzero: bool) -> np.ndarray:
  """Wrapping offsets of n elements from a stream of their zigzag codes."""
  return entropy.decode_stream(r, n, udtype, limit=1 << (8 * udtype.itemsize),
                               unzig=1 if nonzero else 2)
