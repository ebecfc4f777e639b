"""One tensor's section of an update: find the changed elements, pick the smallest mode, code it.

Modes (chosen per tensor by estimated size, see `encode_section`):
  unchanged  no bytes.
  raw        the target's exact bytes (keyframes; deltas where nothing smaller exists).
  sparse     varint nnz | gaps | offset stream. Gaps between changed flat indices (index -
             previous index - 1) are Rice coded (per gap q zero bits, a one, k low
             bits, LSB first, in one or four streams: `_rice_bytes`; within ~1% of the
             entropy of i.i.d. positions, and fast) or, when the changes cluster,
             through the entropy stage (u8 0, then a stream). The offset stream holds the zigzag of
             each element's wrapping offset new_bits - old_bits (entropy.py).
  bitmap     varint zlen | zstd(np.packbits(changed mask)) | offset stream; picked when
             the changes follow a pattern that a bitmap compresses below the gaps.
  dense      one offset stream over every element (zero offsets included); picked at
             high density, where it reaches the zeroth-order entropy of the offsets.
  joint      64K+ elements with scattered changes at 2-25%: gaps and values in one
             Rice + Huffman bit stream per stream of blocks, coded and applied in one
             pass each way (joint.py); the layouts above are the general path.
  packed     no bytes: the tensor is coded in its pack's section (packs.py).
Bit patterns are handled as unsigned integers of the held dtype's width, so any bf16
pattern (NaN payloads, inf, -0.0, subnormals) and any int8 code round-trips exactly.
Scans and applies go block by block so that compare, copy, scatter and checksum of a
block happen while it is in cache.
"""

import dataclasses
import threading
import typing

import numpy as np
import xxhash
import zstandard

from rlax_ps.sync import entropy, joint, loops, pack_coder, scratch
from rlax_ps.sync.byte_reader import ByteReader, u8, varint
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.integrity import XXH3, checksum

UNCHANGED, RAW, SPARSE, BITMAP, DENSE, JOINT, PACKED = range(7)
MODE_NAMES = ("unchanged", "raw", "sparse", "bitmap", "dense", "joint", "packed")
GAPS_ENTROPY, GAPS_RICE = 0, loops.RICE  # Rice: 0x80 | streams flag | k in one byte
_RICE_MULTI = loops.RICE_MULTI
_SAMPLE = 1 << 15  # elements the bitmap probe codes
_GAP_SAMPLE = 1 << 13  # gaps the coder choice is costed on
_DENSITY_SAMPLE = 1 << 14
_ZSTD_LEVEL = 3
_RICE_STREAMS, _RICE_SPLIT = 4, 1 << 12
_ESTIMATE_ABOVE = 1 << 22  # smaller scans size their outputs for every element (np.empty
# pages that are never written cost nothing), larger ones from a sampled density
_LOCAL = threading.local()
# An empty array of each held unsigned type: compiled readers take their output dtype from it.
_LIKE = {np.dtype(d): np.empty(0, d) for d in (np.uint8, np.uint16)}


def _estimate_density(old: np.ndarray, new: np.ndarray) -> float:
  """Fraction of differing elements in an evenly spaced sample of 64-bit words."""
  m = old.size - old.size % (8 // old.itemsize)
  if m == 0:
    return 1.0
  ow, nw = old[:m].view(np.uint64), new[:m].view(np.uint64)
  step = max(1, ow.size // _DENSITY_SAMPLE)
  return float((ow[::step] != nw[::step]).mean())


@dataclasses.dataclass(frozen=True)
class Changes:
  """What differs between two unsigned bit arrays: per change (ascending) its gap (index -
  previous changed index - 1) and the entropy-stage symbol of the zigzag of its wrapping
  offset new - old, with the symbols' raw-bit words and histogram; xxh3 of both arrays."""
  gaps: np.ndarray
  syms: np.ndarray
  raw: np.ndarray
  hist: np.ndarray
  h_old: int | None  # None when the scan was asked not to hash
  h_new: int | None

  @property
  def nnz(self) -> int:
    return self.gaps.size

  def indices(self, count: int | None = None) -> np.ndarray:
    """Flat indices of the first `count` (all) changes."""
    return np.cumsum(self.gaps[:count].astype(np.int64) + 1) - 1


def scan_changes(old: np.ndarray, new: np.ndarray,
                 hashed: tuple[bool, bool] = (True, True)) -> Changes:
  """One compiled pass per cache-sized block compares 64 elements at a time and walks the
  changed ones; the block of old (new) is then hashed, unless hashed[0] ([1]) is False,
  while still in cache. The outputs live in scratch buffers that this thread's next scan
  overwrites."""
  n = old.size
  block = max(1, min(n, loops.CALL_BYTES // old.itemsize))
  if n <= _ESTIMATE_ABOVE:
    cap = n + block
  else:
    lanes = 8 // old.itemsize
    density = 1 - (1 - _estimate_density(old, new)) ** (1 / lanes)  # elements from words
    cap = min(n, int(n * density * 1.1)) + block
  gaps, syms, raw, hist = _scan_outputs(cap, np.dtype(np.uint32 if n < 1 << 32 else np.uint64))
  st = np.array([0, -1, 0], np.int64)
  h_old, h_new = xxhash.xxh3_64(), xxhash.xxh3_64()
  for s in range(0, n, block):
    a, b = old[s:s + block], new[s:s + block]
    m = a.size - a.size % 64
    aw, bw = a[:m].view(np.uint64), b[:m].view(np.uint64)
    while not loops.scan_block(aw, bw, a, b, s, st, gaps, syms, raw, hist):
      cap = min(n, 2 * cap) + block
      gaps, syms = np.resize(gaps, cap), np.resize(syms, cap)
      raw = np.concatenate([raw, np.zeros(cap // 4 + 2 - raw.size, np.uint64)])
    if hashed[0]:
      h_old.update(a)
    if hashed[1]:
      h_new.update(b)
  pos = int(st[0])
  return Changes(gaps[:pos], syms[:pos], raw, hist.sum(axis=0),
                 h_old.intdigest() if hashed[0] else None,
                 h_new.intdigest() if hashed[1] else None)


def _scan_outputs(cap: int, gap_dtype) -> tuple[np.ndarray, ...]:
  """(gaps, syms, raw, hist) for scans of up to `cap` changes, the first three in this
  thread's scratch buffers (reused, not zeroed: raw needs only raw[0] = 0, see
  loops._scan_block; at most 16 raw bits a change)."""
  raw = scratch.buffer("scan raw", cap // 4 + 2, np.uint64)
  raw[0] = 0
  gaps = scratch.buffer("scan gaps", cap, gap_dtype)
  return gaps, scratch.buffer("scan syms", cap, np.uint8), raw, np.zeros((4, entropy.ALPHABET),
                                                                        np.int64)


def _rice_bytes(gaps: np.ndarray, k: int) -> np.ndarray:
  """Rice layout: u8 0x80 | 0x40 (S = 4 streams, else 1) | k, S varint byte lengths, S - 1
  varint indices of the change before each later stream, the streams (S = 4 for long
  streams, whose decoder then runs four independent chains)."""
  s = _RICE_STREAMS if gaps.size >= _RICE_SPLIT else 1
  return loops.rice_layout(gaps, k, s, GAPS_RICE | (_RICE_MULTI if s > 1 else 0) | k)


def _encode_gaps(gaps: np.ndarray, plan: tuple) -> tuple[float, callable, bool]:
  """(estimated size, thunk producing the bytes, whether the gaps cluster) of the cheaper
  gap coder: Rice with the best parameter near log2 of the mean gap, or the entropy stage
  (the gaps cluster: it codes them 3% or more below Rice), both costed exactly on an
  evenly spaced sample of the gaps (`plan`: loops.gap_plan of it, at gap_step(gaps))."""
  step = gap_step(gaps)
  k, rice_bits, entropy_bits, present = plan
  rice_cost = rice_bits * step / 8 + 3
  if entropy.cost_of(entropy_bits, present) * step >= 0.97 * rice_cost:
    return rice_cost, lambda: _rice_bytes(gaps, k), False
  wide = gaps.astype(np.uint64)
  hist = entropy.histogram(wide)
  return entropy.cost_bytes(hist) + 1, lambda: u8(GAPS_ENTROPY) + entropy.encode_stream(
      hist, wide), True


def gap_step(gaps: np.ndarray) -> int:
  """Every how many gaps the coder choice samples (about _GAP_SAMPLE of them)."""
  return max(1, gaps.size // _GAP_SAMPLE)


def _bitmap_bytes(idx: np.ndarray, n: int) -> bytes:
  """zstd of the changed-element mask as np.packbits lays it out (MSB first)."""
  if not hasattr(_LOCAL, "bitmap_zstd"):
    _LOCAL.bitmap_zstd = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
  return _LOCAL.bitmap_zstd.compress(loops.bitmap(idx, (n + 7) // 8))


def _bitmap_estimate(ch: Changes, n: int, gap_cost: float) -> float | None:
  """Size of a zstd bitmap extrapolated from the first _SAMPLE elements (a cheap probe),
  when it beats the gaps there; else None."""
  expected = ch.nnz * min(n, _SAMPLE) // n  # changes among the first _SAMPLE elements
  head = ch.indices(min(ch.nnz, 2 * expected + 64))
  cut = int(np.searchsorted(head, min(n, _SAMPLE)))
  if cut < 64:
    return None
  probe = len(_bitmap_bytes(head[:cut], min(n, _SAMPLE)))
  if probe >= 0.9 * gap_cost * cut / ch.nnz:
    return None
  return probe * n / min(n, _SAMPLE)


class Encoded(typing.NamedTuple):
  """One tensor's coded section and checksums (a tuple: an encode makes one per tensor)."""
  mode: int
  section: object  # bytes-like
  checksum: int | None  # None when not hashed (a pack's section)
  base_checksum: int | None


def encode_pack(old: np.ndarray, new: np.ndarray, ends: np.ndarray,
                hash_old: bool) -> tuple | None:
  """(mode, section, the members' xxh3, their bases' xxh3 (None unless hash_old)) of a
  pack (packs.py) from its members' unsigned bits back to back (member j ending at element
  ends[j]): mode UNCHANGED (no bytes) when no member changed (each is then unchanged, no
  pack made); None when nothing is smaller than its raw bytes (its members are then coded
  alone). Joint and sparse packs are coded and hashed in one compiled call (pack_coder)."""
  if XXH3:
    coded = pack_coder.encode(old, new, ends, hash_old, XXH3)
    if coded is not None:
      mode, section, digests = coded
      if mode == RAW:
        return None
      return mode, section, digests[0].tolist(), digests[1].tolist() if hash_old else None
  enc = encode_section(old, new, hashed=(False, False))
  if enc.mode == RAW:
    return None
  sums = hash_parts(new, ends)
  return enc.mode, enc.section, sums, hash_parts(old, ends) if hash_old else None


def hash_parts(bits: np.ndarray, ends: np.ndarray) -> list[int]:
  """The xxh3 of each part of the flat array `bits` (part j ending at element ends[j]),
  in one compiled call where XXH3 is found."""
  if not XXH3:
    return [checksum(bits[a:b]) for a, b in zip([0, *ends[:-1].tolist()], ends.tolist())]
  out = np.empty(ends.size, np.uint64)
  loops.hash_all(XXH3, bits.ctypes.data, bits.itemsize, ends, out)
  return out.tolist()


def encode_section(old: np.ndarray | None, new: np.ndarray,
                   hashed: tuple[bool, bool] = (True, True)) -> Encoded:
  """The section taking unsigned bit array `old` (None: keyframe) to `new`; with not
  hashed[0] (hashed[1]), its base (result) checksum is None: a pack's members are hashed
  one by one, and a publisher may already know its base's checksums."""
  n = new.size
  if old is None:
    return Encoded(RAW, new, xxhash.xxh3_64_intdigest(new), None)
  planned = joint.plan(old, new)
  if planned is not None:
    coded = joint.encode(old, new, *planned, hash_old=hashed[0], hash_new=hashed[1])
    if len(coded[0]) < new.nbytes:
      return Encoded(JOINT, coded[0], coded[2], coded[1])
  ch = scan_changes(old, new, hashed)  # nothing of ch outlives this call
  if ch.nnz == 0:
    return Encoded(UNCHANGED, b"", ch.h_new, ch.h_old)
  z, top, *costs = loops.sparse_costs(old, new, ch.gaps, ch.hist, gap_step(ch.gaps),
                                      entropy.WIDTHS, entropy.LITERAL_MAX)
  cost_v = cost_sym = entropy.cost_of(*costs[:2])
  if z.size:
    cost_v = min(cost_v, entropy.literal_cost(z, 1, top))
  gap_cost, gap_bytes, clustered = _encode_gaps(ch.gaps, costs[2:])
  costs = {RAW: new.nbytes, SPARSE: gap_cost + cost_v + 9}
  if ch.nnz * 4 > n:
    hist_d = ch.hist.copy()
    hist_d[0] += n - ch.nnz
    costs[DENSE] = entropy.cost_bytes(hist_d)  # above 25%: fewer symbols than gaps + values
  # A bitmap beats the gaps only where changes cluster (runs, rows, strides), which the
  # entropy-coded gaps show first; scattered changes skip its probe.
  bitmap_cost = _bitmap_estimate(ch, n, gap_cost) if clustered else None
  if bitmap_cost is not None:
    costs[BITMAP] = bitmap_cost + cost_v + 9
  mode = min(costs, key=costs.get)
  if mode == BITMAP:  # the probe's estimate won: code the whole bitmap, keep it if smaller
    bitmap = _bitmap_bytes(ch.indices(), n)
    costs[BITMAP] = len(bitmap) + cost_v + 9
    mode = min(costs, key=costs.get)
  if mode == RAW:
    return Encoded(RAW, new, ch.h_new, ch.h_old)
  if mode == DENSE:
    full = np.zeros(n, old.dtype)
    idx = ch.indices()
    full[idx] = loops.zigzag_at(old, new, ch.gaps)
    return Encoded(DENSE, entropy.encode_stream(hist_d, full), ch.h_new, ch.h_old)
  if cost_v < cost_sym:
    values = entropy.encode_literal(z, 1, top)
  else:
    values = entropy.encode_symbols(ch.hist, ch.syms, ch.raw)
  if mode == SPARSE:
    return Encoded(SPARSE, b"".join([varint(ch.nnz), gap_bytes(), values]), ch.h_new, ch.h_old)
  return Encoded(BITMAP, b"".join([varint(len(bitmap)), bitmap, values]), ch.h_new, ch.h_old)


@dataclasses.dataclass(frozen=True)
class Decoded:
  """A decoded section as unsigned bit arrays: sparse (indices, offsets), dense offsets over
  every element, or the full replacement bits."""
  mode: int
  indices: np.ndarray | None = None
  offsets: np.ndarray | None = None
  replacement: np.ndarray | None = None
  streams: joint.Section | None = None

  def sparse(self) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, wrapping offsets) of a sparse, bitmap or joint section."""
    if self.mode != JOINT:
      return self.indices, self.offsets
    return self.streams.changes()

  @property
  def nnz(self) -> int:
    """Changes of a sparse, bitmap or joint section."""
    return self.streams.nnz if self.mode == JOINT else self.indices.size

  def sparse_into(self, indices: np.ndarray, offsets: np.ndarray) -> None:
    """sparse() written into the first nnz entries of `indices` (int32 or int64) and
    `offsets` (at least nnz long each): a joint section decodes straight into them."""
    if self.mode == JOINT:
      self.streams.changes(indices, offsets)  # checks the arrays' size itself
    elif min(indices.size, offsets.size) < self.nnz:
      raise ValueError(f"{self.nnz} changes do not fit arrays of "
                       f"{min(indices.size, offsets.size)}")
    else:
      indices[:self.nnz], offsets[:self.nnz] = self.indices, self.offsets

  def apply(self, old: np.ndarray | None, udtype: np.dtype, inplace: bool = False,
            out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(new bit array, its xxh3) from `old`, written into `old` itself when `inplace`,
    else into `out` (flat, of udtype; a new array when None); copy, scatter and hash run
    block by block."""
    if inplace:
      out = old
    if self.mode == RAW:
      if out is None:
        out = self.replacement.astype(udtype)
      else:
        out[...] = self.replacement
      return out, xxhash.xxh3_64_intdigest(out)
    if out is None:
      out = np.empty_like(old)
    h = xxhash.xxh3_64()
    if self.mode == JOINT:
      self.streams.apply(old, out, h)
      return out, h.intdigest()
    block = max(1, min(old.size, loops.CALL_BYTES // old.itemsize))
    if self.mode == SPARSE or self.mode == BITMAP:
      bounds = np.searchsorted(self.indices, np.arange(0, old.size + block, block))
    for k, s in enumerate(range(0, old.size, block)):
      blk = out[s:s + block]
      if self.mode == DENSE:
        np.add(old[s:s + block], self.offsets[s:s + block], out=blk)
      else:
        if not inplace:
          np.copyto(blk, old[s:s + block])
        if self.mode != UNCHANGED and bounds[k] < bounds[k + 1]:
          loops.scatter_add(blk, self.indices, self.offsets, bounds[k], bounds[k + 1], s)
      h.update(blk)
    return out, h.intdigest()

  def add_to(self, bits: np.ndarray) -> None:
    """Applies the section in place to `bits` (its whole base as one flat unsigned array,
    e.g. a pack's members concatenated), unhashed: a pack's members are hashed one by one."""
    if self.mode == JOINT:
      self.streams.apply(bits, bits, None)
    elif self.mode == SPARSE or self.mode == BITMAP:
      loops.scatter_add(bits, self.indices, self.offsets, 0, self.indices.size, 0)
    else:
      self.apply_parts([bits], [0])

  def apply_parts(self, parts: list[np.ndarray], starts: list[int]) -> None:
    """Applies the section, in place, to the consecutive parts (flat unsigned bit arrays
    starting at `starts` of the section's elements) that together hold its base: a pack's
    members, with no concatenation."""
    if self.mode == UNCHANGED:
      return
    if self.mode == RAW or self.mode == DENSE:
      full = self.replacement if self.mode == RAW else self.offsets
      for part, s in zip(parts, starts):
        if self.mode == RAW:
          part[...] = full[s:s + part.size]
        else:
          np.add(part, full[s:s + part.size], out=part)
      return
    idx, off = self.sparse()
    cuts = np.searchsorted(idx, starts + [starts[-1] + parts[-1].size]).tolist()
    for i, (part, s) in enumerate(zip(parts, starts)):
      if cuts[i] < cuts[i + 1]:
        loops.scatter_add(part, idx, off, cuts[i], cuts[i + 1], s)


def decode_section(what: str, mode: int, section, n: int, udtype: np.dtype,
                   fast: bool = True) -> Decoded:
  """Parses and validates one section holding `n` elements of unsigned type `udtype`.
  Sparse sections in the usual layout take one compiled call (loops.sparse_literal) unless
  not `fast`; any other, or any problem, goes through the general reader below, which
  names the problem."""
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
  if mode == JOINT:
    return Decoded(JOINT, streams=joint.Section(r, n, udtype))
  if mode == SPARSE:
    if fast:
      ok, idx, offsets = loops.sparse_literal(np.frombuffer(section, np.uint8), n,
                                              _LIKE[udtype])
      if ok:
        return Decoded(SPARSE, indices=idx, offsets=offsets)
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
  k = coder & 63
  if k > 56:
    raise CodecError(f"{r.what}: Rice parameter {k} exceeds 56")
  streams = _RICE_STREAMS if coder & _RICE_MULTI else 1
  if streams > nnz:
    raise CodecError(f"{r.what}: {streams} Rice streams for {nnz} changes")
  lengths = r.varints(streams).tolist()
  bases = [-1] + r.varints(streams - 1).tolist()
  buf = r.take(sum(lengths))
  counts = [nnz // streams] * (streams - 1) + [nnz - (nnz // streams) * (streams - 1)]
  idx = np.empty(nnz, np.int64)
  err = loops.rice_decode(entropy.words_of(buf), np.cumsum([0] + lengths), np.array(counts),
                          np.array(bases, np.int64), k, n, idx)
  if err == loops.E_RANGE:
    raise CodecError(f"{r.what}: a changed index lies outside the tensor size {n}")
  if err != loops.OK:
    raise CodecError(f"{r.what}: Rice-coded gaps are truncated, inconsistent or have "
                     f"trailing bytes")
  return idx


def _offsets(r: ByteReader, n: int, udtype: np.dtype, nonzero: bool) -> np.ndarray:
  """Wrapping offsets of n elements from a stream of their zigzag codes."""
  return entropy.decode_stream(r, n, udtype, limit=1 << (8 * udtype.itemsize),
                               unzig=1 if nonzero else 2)
