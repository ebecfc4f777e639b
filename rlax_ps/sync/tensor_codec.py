"""One tensor's section of an update: find the changed elements, pick the smallest mode, code it.

Modes (chosen per tensor by estimated size, see `encode_section`):
  unchanged  no bytes.
  raw        the target's exact bytes (keyframes; deltas where nothing smaller exists).
  sparse     varint nnz | gap coder (u8) | gaps | offset stream. Gaps between changed flat
             indices (index - previous index - 1) are Rice coded (coder 1: u8 k | varint
             unary_nbytes | unary quotients | fixed k-bit remainders; within ~1% of the
             entropy of i.i.d. positions, and fast) or, when the changes cluster, through
             the entropy stage (coder 0). The offset stream holds the zigzag of each
             element's wrapping offset new_bits - old_bits (entropy.py).
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

from rlax_ps.sync import entropy
from rlax_ps.sync.bits import (fixed_nbytes, pack_fixed, pack_unary, unpack_fixed, unpack_unary,
                               unzigzag,
                               zigzag)
from rlax_ps.sync.byte_reader import ByteReader, u8, varint
from rlax_ps.sync.errors import CodecError

UNCHANGED, RAW, SPARSE, BITMAP, DENSE = range(5)
MODE_NAMES = ("unchanged", "raw", "sparse", "bitmap", "dense")
GAPS_ENTROPY, GAPS_RICE = 0, 1
BLOCK = 1 << 19
_SAMPLE = 1 << 20
_GAP_SAMPLE = 1 << 16
_ZSTD_LEVEL = 3


def _nonzero_words(differs: np.ndarray) -> np.ndarray:
  """flatnonzero of a bool array, skipping all-False groups of 8 when they dominate."""
  n8 = differs.size - differs.size % 8
  words = differs[:n8].view(np.uint64)
  groups = np.flatnonzero(words)
  if groups.size * 2 > words.size:
    return np.flatnonzero(differs)
  p = np.flatnonzero(words[groups].view(np.uint8))
  tail = np.flatnonzero(differs[n8:]) + n8
  return np.concatenate([groups[p // 8] * 8 + p % 8, tail])


def scan_changes(old: np.ndarray, new: np.ndarray):
  """(flat indices int64 ascending where two unsigned bit arrays differ, wrapping offsets
  new - old there, xxh3 of old, xxh3 of new). Compares 64-bit words first."""
  lanes = 8 // old.itemsize
  idx_parts, off_parts = [], []
  differs = np.empty(BLOCK // lanes, bool)
  h_old, h_new = xxhash.xxh3_64(), xxhash.xxh3_64()
  for s in range(0, old.size, BLOCK):
    a, b = old[s:s + BLOCK], new[s:s + BLOCK]
    h_old.update(a)
    h_new.update(b)
    m = a.size - a.size % lanes
    aw, bw = a[:m].view(np.uint64), b[:m].view(np.uint64)
    wi = _nonzero_words(np.not_equal(aw, bw, out=differs[:aw.size]))
    if wi.size:
      ga, gb = aw[wi].view(old.dtype), bw[wi].view(old.dtype)
      p = np.flatnonzero(ga != gb)
      idx_parts.append(wi[p // lanes] * lanes + (p % lanes + s))
      off_parts.append(gb[p] - ga[p])
    ti = np.flatnonzero(a[m:] != b[m:])
    if ti.size:
      idx_parts.append(ti + (s + m))
      off_parts.append(b[m:][ti] - a[m:][ti])
  digests = h_old.intdigest(), h_new.intdigest()
  if not idx_parts:
    return np.zeros(0, np.int64), np.zeros(0, old.dtype), *digests
  return np.concatenate(idx_parts).astype(np.int64, copy=False), np.concatenate(off_parts), *digests


def _gaps(idx: np.ndarray) -> np.ndarray:
  return (np.diff(idx, prepend=-1) - 1).astype(np.uint64)


def _rice_k(gaps: np.ndarray) -> tuple[int, int]:
  """(k, exact size in bytes) of the best Rice parameter near log2 of the mean gap."""
  mean = float(gaps.mean())
  k0 = max(0, int(np.log2(mean * np.log(2) + 1)))
  best = None
  for k in range(max(0, k0 - 1), min(56, k0 + 2)):
    unary_bits = int((gaps >> np.uint64(k)).sum()) + gaps.size
    size = (unary_bits + 7) // 8 + fixed_nbytes(gaps.size, k)
    if best is None or size < best[1]:
      best = (k, size)
  return best


def _encode_rice(gaps: np.ndarray, k: int) -> bytes:
  _, unary = pack_unary(gaps >> np.uint64(k))
  rem = pack_fixed(gaps & np.uint64((1 << k) - 1), k)
  return b"".join([u8(k), varint(len(unary)), unary, rem])


def _sampled_entropy_bytes(z: np.ndarray) -> float:
  """Entropy-stage size of `z` estimated from an evenly spaced sample."""
  step = max(1, z.size // _GAP_SAMPLE)
  return entropy.cost_bytes(np.bincount(entropy.to_symbols(z[::step])[0],
                                        minlength=entropy.ALPHABET)) * step


def _encode_gaps(gaps: np.ndarray) -> tuple[float, callable]:
  """(estimated size, thunk producing the bytes) of the cheaper gap coder."""
  k, rice_size = _rice_k(gaps)
  if _sampled_entropy_bytes(gaps) >= 0.97 * rice_size:
    return rice_size + 2, lambda: u8(GAPS_RICE) + _encode_rice(gaps, k)
  syms = entropy.to_symbols(gaps)
  hist = np.bincount(syms[0], minlength=entropy.ALPHABET)
  return entropy.cost_bytes(hist) + 1, lambda: u8(GAPS_ENTROPY) + entropy.encode_stream(
      hist, entropy.split_symbols(*syms))


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
  idx, off, h_old, h_new = scan_changes(old, new)
  if idx.size == 0:
    return Encoded(UNCHANGED, b"", h_new, h_old)
  z = zigzag(off)
  del off
  vsyms = entropy.to_symbols(z)
  hist_v = np.bincount(vsyms[0], minlength=entropy.ALPHABET)
  cost_v = min(entropy.cost_bytes(hist_v), entropy.literal_cost(z))
  gaps = _gaps(idx)
  gap_cost, gap_bytes = _encode_gaps(gaps)
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
    return Encoded(DENSE, entropy.encode_stream(hist_d, _dense_blocks(idx, z, n)), h_new, h_old)
  if entropy.literal_cost(z) < entropy.cost_bytes(hist_v):
    values = entropy.encode_literal(z)
  else:
    values = entropy.encode_stream(hist_v, entropy.split_symbols(*vsyms))
  if mode == SPARSE:
    return Encoded(SPARSE, b"".join([varint(idx.size), gap_bytes(), values]), h_new, h_old)
  return Encoded(BITMAP, b"".join([varint(len(bitmap)), bitmap, values]), h_new, h_old)


def _dense_blocks(idx, z, n):
  """Offset codes of every element (0 where unchanged) in ANS_BLOCK pieces."""
  bounds = np.searchsorted(idx, np.arange(0, n + entropy.ANS_BLOCK, entropy.ANS_BLOCK))
  for k, s in enumerate(range(0, n, entropy.ANS_BLOCK)):
    full = np.zeros(min(entropy.ANS_BLOCK, n - s), np.uint64)
    lo, hi = bounds[k], bounds[k + 1]
    full[idx[lo:hi] - s] = z[lo:hi]
    yield entropy.to_symbols(full)


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
          blk[...] = old[s:s + BLOCK]
        if self.mode != UNCHANGED and bounds[k] < bounds[k + 1]:
          lo, hi = bounds[k], bounds[k + 1]
          blk[self.indices[lo:hi] - s] += self.offsets[lo:hi]
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
    offsets = _offsets(what, entropy.decode_stream(r, n), udtype)
    r.done()
    return Decoded(DENSE, offsets=offsets)
  if mode == SPARSE:
    nnz = r.varint()
    if not 0 < nnz <= n:
      raise CodecError(f"{what}: {nnz} changed elements declared for a tensor of {n}")
    gaps = _decode_gaps(r, nnz)
    if gaps.max() >= n:
      raise CodecError(f"{what}: gap {int(gaps.max())} exceeds the tensor size {n}")
    idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if idx[-1] >= n:
      raise CodecError(f"{what}: changed index {int(idx[-1])} outside the tensor size {n}")
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
  offsets = _offsets(what, entropy.decode_stream(r, idx.size), udtype)
  r.done()
  if not offsets.all():
    raise CodecError(f"{what}: a changed element has a zero offset")
  return Decoded(mode, indices=idx, offsets=offsets)


def _decode_gaps(r: ByteReader, nnz: int) -> np.ndarray:
  coder = r.u8()
  if coder == GAPS_ENTROPY:
    return _collect(entropy.decode_stream(r, nnz))
  if coder != GAPS_RICE:
    raise CodecError(f"{r.what}: unknown gap coder {coder}")
  k = r.u8()
  if k > 56:
    raise CodecError(f"{r.what}: Rice parameter {k} exceeds 56")
  q = unpack_unary(r.take(r.varint()), nnz, r.what)
  if q.size and int(q.max()) >= 1 << (63 - k):
    raise CodecError(f"{r.what}: Rice quotient {int(q.max())} overflows")
  rem = unpack_fixed(r.take(fixed_nbytes(nnz, k)), nnz, k, r.what)
  return (q.astype(np.uint64) << np.uint64(k)) | rem


def _collect(blocks) -> np.ndarray:
  parts = list(blocks)
  return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def _offsets(what: str, blocks, udtype: np.dtype) -> np.ndarray:
  """Zigzag codes -> wrapping offsets, block by block (bounded temporaries)."""
  limit = 1 << (8 * udtype.itemsize)
  parts = []
  for z in blocks:
    if z.size and int(z.max()) >= limit:
      raise CodecError(f"{what}: offset code {int(z.max())} does not fit {udtype.itemsize} bytes")
    parts.append(unzigzag(z, udtype))
  return np.concatenate(parts) if parts else np.zeros(0, udtype)
