"""One tensor's section of an update: find the changed elements, pick the smallest mode, code it.

Modes (chosen per tensor by estimated size, see `encode_section`):
  unchanged  no bytes.
  raw        the target's exact bytes (keyframes; deltas where nothing smaller exists).
  sparse     varint nnz | gap stream | offset stream: gaps between changed flat indices
             (index - previous index - 1) and the zigzag of each element's wrapping
             offset new_bits - old_bits, both through the entropy stage (entropy.py).
  bitmap     varint zlen | zstd(np.packbits(changed mask)) | offset stream; picked when
             the changes cluster so much that the bitmap compresses below the gaps.
  dense      one offset stream over every element (zero offsets included); picked at
             high density, where it reaches the zeroth-order entropy of the offsets.
Bit patterns are handled as unsigned integers of the held dtype's width, so any bf16
pattern (NaN payloads, inf, -0.0, subnormals) and any int8 code round-trips exactly.
"""

import dataclasses

import numpy as np
import zstandard

from rlax_ps.sync import entropy
from rlax_ps.sync.bits import unzigzag, zigzag
from rlax_ps.sync.byte_reader import ByteReader, varint
from rlax_ps.sync.errors import CodecError

UNCHANGED, RAW, SPARSE, BITMAP, DENSE = range(5)
MODE_NAMES = ("unchanged", "raw", "sparse", "bitmap", "dense")
SCAN_BLOCK = 1 << 19
_SAMPLE = 1 << 20
_ZSTD_LEVEL = 3


def scan_changes(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Flat indices (int64, ascending) where two unsigned bit arrays differ, and the wrapping
  offsets new - old there. Compares 64-bit words first, block by block."""
  lanes = 8 // old.itemsize
  idx_parts, off_parts = [], []
  differs = np.empty(SCAN_BLOCK // lanes, bool)
  for s in range(0, old.size, SCAN_BLOCK):
    a, b = old[s:s + SCAN_BLOCK], new[s:s + SCAN_BLOCK]
    m = a.size - a.size % lanes
    aw, bw = a[:m].view(np.uint64), b[:m].view(np.uint64)
    wi = np.flatnonzero(np.not_equal(aw, bw, out=differs[:aw.size]))
    if wi.size:
      ga, gb = aw[wi].view(old.dtype), bw[wi].view(old.dtype)
      p = np.flatnonzero(ga != gb)
      idx_parts.append(wi[p // lanes] * lanes + (p % lanes + s))
      off_parts.append(gb[p] - ga[p])
    ti = np.flatnonzero(a[m:] != b[m:])
    if ti.size:
      idx_parts.append(ti + (s + m))
      off_parts.append(b[m:][ti] - a[m:][ti])
  if not idx_parts:
    return np.zeros(0, np.int64), np.zeros(0, old.dtype)
  return np.concatenate(idx_parts).astype(np.int64), np.concatenate(off_parts)


def _gaps(idx: np.ndarray) -> np.ndarray:
  return (np.diff(idx, prepend=-1) - 1).astype(np.uint64)


def _bitmap_bytes(idx: np.ndarray, n: int) -> bytes:
  mask = np.zeros(n, bool)
  mask[idx] = True
  return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(np.packbits(mask).tobytes())


def _bitmap_wins(idx: np.ndarray, n: int) -> bool:
  """Whether a zstd bitmap beats gap coding on the first _SAMPLE elements (cheap probe)."""
  head = idx[:np.searchsorted(idx, min(n, _SAMPLE))]
  if head.size < 64:
    return False
  return len(_bitmap_bytes(head, min(n, _SAMPLE))) < 0.9 * entropy.cost_bytes(
      entropy.histogram(_gaps(head)))


def encode_section(old: np.ndarray | None, new: np.ndarray) -> tuple[int, bytes]:
  """(mode, section bytes) taking unsigned bit array `old` (None: keyframe) to `new`."""
  n = new.size
  if old is None:
    return RAW, new.tobytes()
  idx, off = scan_changes(old, new)
  if idx.size == 0:
    return UNCHANGED, b""
  z = zigzag(off)
  del off
  hist_v = entropy.histogram(z)
  cost_v = entropy.cost_bytes(hist_v)
  gaps = _gaps(idx)
  hist_g = entropy.histogram(gaps)
  costs = {RAW: new.nbytes, SPARSE: entropy.cost_bytes(hist_g) + cost_v + 9}
  if idx.size * 4 > n:
    hist_d = hist_v.copy()
    hist_d[0] += n - idx.size
    costs[DENSE] = entropy.cost_bytes(hist_d)
  bitmap = None
  if _bitmap_wins(idx, n):
    bitmap = _bitmap_bytes(idx, n)
    costs[BITMAP] = len(bitmap) + cost_v + 9
  mode = min(costs, key=costs.get)
  if mode == RAW:
    return RAW, new.tobytes()
  values = entropy.encode_stream(hist_v, entropy.symbol_blocks(z))
  if mode == SPARSE:
    gap_stream = entropy.encode_stream(hist_g, entropy.symbol_blocks(gaps))
    return SPARSE, b"".join([varint(idx.size), gap_stream, values])
  if mode == BITMAP:
    return BITMAP, b"".join([varint(len(bitmap)), bitmap, values])
  return DENSE, entropy.encode_stream(hist_d, _dense_blocks(idx, z, n))


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
    gaps = _collect(entropy.decode_stream(r, nnz))
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
