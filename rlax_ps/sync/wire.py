"""Update messages: binary layout, header parsing, per-tensor changes, chunked transport.

Message layout (little-endian):
  prefix   b"RLXW" | u16 wire version (2) | u8 header codec (0 raw, 1 zstd: tensor names
           repeat a lot) | u32 stored header_len | u32 crc32(stored header)
  header   u8 fmt (0 bf16, 1 int8) | u8 is_keyframe | varint version | varint base_version
           (0 for a keyframe) | varint tensor count, then column by column (so that zstd
           finds the repeats): per tensor varint bytes shared with the previous name
           | varint rest_len | the rest of the utf-8 name; per tensor u8 dtype
           (0 bf16, 1 int8) | u8 section codec version (2) | u8 mode | u8 ndim; per tensor
           varint dims[ndim] | varint section_len; per tensor u64 checksum [| u32
           base_checksum: deltas, mode other than unchanged, whose base checksum is the
           checksum's low half]; per non-empty section u8 low byte of xxh3(section) (only
           locates damage); u64 xxh3 of all the sections (the body digest).
  body     the sections, in header order (tensor_codec.py).
Version 1 (constriction rANS, row-wise header) is rejected with a CodecError.
Chunk layout: b"RLXC" | u32 index | u32 count | u64 message length | u64 xxh3(message)
  | u32 data length | data.
"""

import dataclasses
import struct
import zlib

import numpy as np
import xxhash
import zstandard

from rlax_ps.sync import tensor_codec
from rlax_ps.sync.bits import BF16, INT8, UINT_OF, bit_view
from rlax_ps.sync.byte_reader import ByteReader, u8, u32, u64, varint
from rlax_ps.sync.errors import CodecError

MAGIC = b"RLXW"
WIRE_VERSION = 2
SECTION_CODEC_VERSION = 2
FORMATS = ("bf16", "int8")
_DTYPES = (BF16, INT8)
_PREFIX = struct.Struct("<4sHBII")
_MAX_HEADER = 1 << 26
_CHUNK = struct.Struct("<4sIIQQI")
CHUNK_MAGIC = b"RLXC"
CHUNK_OVERHEAD = _CHUNK.size
MAX_ELEMENTS = 1 << 40


def checksum(array) -> int:
  """xxh3-64 of the array's exact bytes (C order, little-endian held dtype)."""
  return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _digest(buf) -> int:
  return xxhash.xxh3_64_intdigest(buf)


def _section_digest(buf) -> int:
  """8 bits per section only locate damage that the 64-bit body digest has detected."""
  return xxhash.xxh3_64_intdigest(buf) & 0xFF


def base_checksum(array) -> int:
  """What an update records of a delta's base tensor: the low 32 bits of its checksum.
  It only tells a wrong base apart from a corrupted update (and stops an in-place apply
  before it writes); the 64-bit checksum of the result still guards every tensor."""
  return checksum(array) & 0xFFFFFFFF


_EMPTY_DIGEST = _section_digest(b"")


@dataclasses.dataclass(frozen=True)
class TensorMeta:
  """One tensor of an update: what it must produce and where its section lies."""
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  checksum: int
  base_checksum: int | None
  mode: str
  nbytes: int
  offset: int
  digest: int

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class UpdateHeader:
  """Everything about an update except its payload; `read_header` parses it cheaply."""
  version: int
  base_version: int | None
  fmt: str
  tensors: dict[str, TensorMeta]
  nbytes: int
  body_digest: int = 0  # xxh3-64 of all the sections, in order

  @property
  def is_keyframe(self) -> bool:
    return self.base_version is None


@dataclasses.dataclass(frozen=True)
class TensorChanges:
  """What one tensor of an update changes, for in-place application (e.g. on device).

  kind: "unchanged"; "sparse" (flat `indices`, wrapping bit `offsets` there, and the new
  `values` in the held dtype when a base was given); "dense" (`offsets` for every element,
  and the new `array` when a base was given); "replace" (the new `array`).
  Offsets are unsigned integers of the held dtype's width: new_bits = old_bits + offset
  (mod 2**width), so the update can be applied without the base on the host.
  """
  name: str
  kind: str
  shape: tuple[int, ...]
  dtype: np.dtype
  indices: np.ndarray | None = None
  offsets: np.ndarray | None = None
  values: np.ndarray | None = None
  array: np.ndarray | None = None


def _shared_prefix(a: bytes, b: bytes) -> int:
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def build(fmt: str, version: int, base_version: int | None, entries) -> "Update":
  """Assembles a message; `entries` are (name, shape, dtype, checksum, base_checksum, mode,
  section) tuples."""
  keyframe = base_version is None
  sections = [memoryview(e[6]).cast("B") for e in entries]
  head = [u8(FORMATS.index(fmt)), u8(keyframe), varint(version),
          varint(0 if keyframe else base_version), varint(len(entries))]
  prev = b""
  for name, *_ in entries:
    nb = name.encode()
    shared = _shared_prefix(prev, nb)
    head += [varint(shared), varint(len(nb) - shared), nb[shared:]]
    prev = nb
  for (_, shape, dtype, _, _, mode, _) in entries:
    head += [u8(_DTYPES.index(dtype)), u8(SECTION_CODEC_VERSION), u8(mode), u8(len(shape))]
  for (_, shape, *_), sec in zip(entries, sections):
    head += [varint(d) for d in shape] + [varint(sec.nbytes)]
  for (_, _, _, csum, bcsum, mode, _) in entries:
    head.append(u64(csum))
    if not keyframe and mode != tensor_codec.UNCHANGED:
      head.append(u32(bcsum & 0xFFFFFFFF))
  head += [u8(_section_digest(sec)) for sec in sections if sec.nbytes]
  body = xxhash.xxh3_64()
  for sec in sections:
    body.update(sec)
  head.append(u64(body.intdigest()))
  header = b"".join(head)
  packed = zstandard.ZstdCompressor(level=19 if len(header) < 1 << 16 else 9).compress(header)
  codec = int(len(packed) < len(header))
  header = packed if codec else header
  prefix = _PREFIX.pack(MAGIC, WIRE_VERSION, codec, len(header), zlib.crc32(header))
  data = b"".join([prefix, header] + sections)
  return Update(data, read_header(data))


def read_header(b) -> UpdateHeader:
  """Parses and validates the header of a message without touching the payloads."""
  buf = memoryview(b).cast("B")
  if buf.nbytes < _PREFIX.size:
    raise CodecError(f"update header: truncated: {buf.nbytes} bytes, prefix needs {_PREFIX.size}")
  magic, wire, codec, hlen, hcrc = _PREFIX.unpack(buf[:_PREFIX.size])
  if magic != MAGIC:
    raise CodecError(f"update header: magic expected {MAGIC!r}, got {bytes(magic)!r}")
  if wire != WIRE_VERSION:
    raise CodecError(f"update header: unknown wire format version {wire} (expected {WIRE_VERSION})")
  if _PREFIX.size + hlen > buf.nbytes:
    raise CodecError(
        f"update header: truncated: header needs {hlen} bytes, {buf.nbytes - _PREFIX.size} left")
  header = buf[_PREFIX.size:_PREFIX.size + hlen]
  if zlib.crc32(header) != hcrc:
    raise CodecError("update header: corrupted (crc32 mismatch)")
  if codec > 1:
    raise CodecError(f"update header: unknown header codec {codec}")
  if codec == 1:
    try:
      header = zstandard.ZstdDecompressor().decompress(header, max_output_size=_MAX_HEADER)
    except zstandard.ZstdError as e:
      raise CodecError(f"update header: corrupted ({e})") from None
  r = ByteReader(header, "update header")
  fmt_code, keyframe = r.u8(), r.u8()
  version, base_version = r.varint(), r.varint()
  if fmt_code >= len(FORMATS):
    raise CodecError(f"update header: unknown fmt code {fmt_code}")
  if keyframe not in (0, 1) or (keyframe == 1 and base_version != 0):
    raise CodecError(f"update header: is_keyframe {keyframe} disagrees with base_version "
                     f"{base_version}")
  if not keyframe and not base_version < version:
    raise CodecError(f"update header: versions must satisfy 0 <= base < version, got "
                     f"base {base_version}, version {version}")
  count = r.varint()
  if count > len(header):
    raise CodecError(f"update header: {count} tensors declared in {len(header)} bytes")
  names, prev = [], b""
  for _ in range(count):
    shared = r.varint()
    if shared > len(prev):
      raise CodecError(f"update header: name shares {shared} bytes with a {len(prev)}-byte name")
    prev = prev[:shared] + bytes(r.take(r.varint()))
    try:
      names.append(prev.decode())
    except UnicodeDecodeError:
      raise CodecError("update header: tensor name is not utf-8") from None
  codes = [(r.u8(), r.u8(), r.u8(), r.u8()) for _ in range(count)]
  shapes, lengths = [], []
  for _, _, _, ndim in codes:
    shapes.append(tuple(r.varint() for _ in range(ndim)))
    lengths.append(r.varint())
  sums = []
  for _, _, mode, _ in codes:
    csum = r.u64()
    sums.append((csum, None if keyframe else r.u32() if mode != tensor_codec.UNCHANGED
                 else csum & 0xFFFFFFFF))
  digests = [r.u8() if nbytes else _EMPTY_DIGEST for nbytes in lengths]
  body_digest = r.u64()
  r.done()
  tensors = {}
  offset = _PREFIX.size + hlen
  for name, (dtype_code, codec, mode, _), shape, nbytes, (csum, bcsum), digest in zip(
      names, codes, shapes, lengths, sums, digests):
    what = f"tensor {name!r}"
    if name in tensors:
      raise CodecError(f"{what}: appears twice in the update")
    if codec != SECTION_CODEC_VERSION:
      raise CodecError(f"{what}: unknown section format version {codec} "
                       f"(expected {SECTION_CODEC_VERSION})")
    if dtype_code >= len(_DTYPES) or mode >= len(tensor_codec.MODE_NAMES):
      raise CodecError(f"{what}: unknown dtype code {dtype_code} or mode {mode}")
    dtype = _DTYPES[dtype_code]
    size = int(np.prod(shape, dtype=object)) if shape else 1
    if size > MAX_ELEMENTS:
      raise CodecError(f"{what}: shape {shape} exceeds {MAX_ELEMENTS} elements")
    if keyframe and mode != tensor_codec.RAW:
      raise CodecError(f"{what}: keyframe sections must be raw, got "
                       f"{tensor_codec.MODE_NAMES[mode]}")
    if mode == tensor_codec.RAW and nbytes != size * dtype.itemsize:
      raise CodecError(f"{what}: raw section of {nbytes} bytes, expected {size * dtype.itemsize}")
    if offset + nbytes > buf.nbytes:
      raise CodecError(f"{what}: truncated: section needs {nbytes} bytes at offset {offset}, "
                       f"message has {buf.nbytes}")
    tensors[name] = TensorMeta(name, shape, dtype, csum, bcsum,
                               tensor_codec.MODE_NAMES[mode], nbytes, offset, digest)
    offset += nbytes
  if offset != buf.nbytes:
    raise CodecError(f"update: {buf.nbytes - offset} unexpected trailing bytes after the "
                     f"last section")
  return UpdateHeader(version, None if keyframe else base_version, FORMATS[fmt_code], tensors,
                      buf.nbytes, body_digest)


class Update:
  """One published version: a keyframe or a delta against `base_version`, as a message."""

  def __init__(self, data, header: UpdateHeader):
    self._data = data
    self.header = header

  version = property(lambda self: self.header.version)
  base_version = property(lambda self: self.header.base_version)
  fmt = property(lambda self: self.header.fmt)
  is_keyframe = property(lambda self: self.header.is_keyframe)
  tensors = property(lambda self: self.header.tensors)
  nbytes = property(lambda self: self.header.nbytes)

  def __repr__(self):
    kind = "keyframe" if self.is_keyframe else f"delta from {self.base_version}"
    return (f"Update(version={self.version}, {kind}, fmt={self.fmt}, "
            f"{len(self.tensors)} tensors, {self.nbytes} bytes)")

  def to_bytes(self) -> bytes:
    return bytes(self._data)

  @classmethod
  def from_bytes(cls, b) -> "Update":
    """Parses a message and checks every section's digest; raises CodecError."""
    data = bytes(b)
    header = read_header(data)
    view = memoryview(data)
    body = min((m.offset for m in header.tensors.values()), default=len(data))
    if _digest(view[body:]) != header.body_digest:
      for meta in header.tensors.values():
        if _section_digest(view[meta.offset:meta.offset + meta.nbytes]) != meta.digest:
          raise CodecError(f"tensor {meta.name!r}: section corrupted (digest mismatch)")
      raise CodecError("update body corrupted (digest mismatch)")
    return cls(data, header)

  def meta(self, name: str) -> TensorMeta:
    if name not in self.tensors:
      raise CodecError(f"tensor {name!r}: not in this update (it has {len(self.tensors)} tensors)")
    return self.tensors[name]

  def decoded(self, name: str) -> tensor_codec.Decoded:
    """The validated, decoded section of one tensor."""
    meta = self.meta(name)
    section = memoryview(self._data)[meta.offset:meta.offset + meta.nbytes]
    return tensor_codec.decode_section(
        f"tensor {name!r}", tensor_codec.MODE_NAMES.index(meta.mode), section, meta.size,
        UINT_OF[meta.dtype])

  def check_base(self, name: str, base) -> np.ndarray:
    """`base` as a held array, after checking its shape and dtype against the update."""
    meta = self.meta(name)
    arr = np.asarray(base)
    if arr.shape != meta.shape:
      raise CodecError(f"tensor {name!r}: shape expected {meta.shape}, got {arr.shape}")
    if arr.dtype != meta.dtype:
      raise CodecError(f"tensor {name!r}: dtype expected {meta.dtype}, got {arr.dtype}")
    return arr

  def changes(self, name: str, base_array=None) -> TensorChanges:
    """Decoded changes of one tensor; with `base_array`, also the new values or array."""
    meta = self.meta(name)
    dec = self.decoded(name)
    old = None
    if base_array is not None and dec.mode != tensor_codec.RAW:
      old = bit_view(self.check_base(name, base_array))
    common = dict(name=name, shape=meta.shape, dtype=meta.dtype)
    if dec.mode == tensor_codec.UNCHANGED:
      return TensorChanges(kind="unchanged", **common)
    if dec.mode == tensor_codec.RAW:
      array = dec.replacement.astype(dec.replacement.dtype.newbyteorder("="))
      return TensorChanges(kind="replace", array=array.view(meta.dtype).reshape(meta.shape),
                           **common)
    if dec.mode == tensor_codec.DENSE:
      array = None if old is None else (old + dec.offsets).view(meta.dtype).reshape(meta.shape)
      return TensorChanges(kind="dense", offsets=dec.offsets, array=array, **common)
    values = None if old is None else (old[dec.indices] + dec.offsets).view(meta.dtype)
    return TensorChanges(kind="sparse", indices=dec.indices, offsets=dec.offsets, values=values,
                         **common)

  def verify(self, name: str, array) -> None:
    """Raises CodecError unless `array` is exactly what this update makes of tensor `name`."""
    meta = self.meta(name)
    arr = np.asarray(array)
    if arr.shape != meta.shape or arr.dtype != meta.dtype:
      raise CodecError(f"tensor {name!r}: expected {meta.dtype}{list(meta.shape)}, "
                       f"got {arr.dtype}{list(arr.shape)}")
    got = checksum(arr)
    if got != meta.checksum:
      raise CodecError(f"tensor {name!r}: checksum expected {meta.checksum:016x}, got {got:016x}")

  def chunks(self, max_bytes: int):
    """Yields the message as chunks of at most `max_bytes` bytes each (header included)."""
    room = max_bytes - CHUNK_OVERHEAD
    if room < 1:
      raise ValueError(f"max_bytes must exceed the chunk header of {CHUNK_OVERHEAD} bytes, "
                       f"got {max_bytes}")
    view = memoryview(self._data).cast("B")
    total = view.nbytes
    count = max(1, -(-total // room))
    digest = _digest(view)
    for i in range(count):
      part = view[i * room:(i + 1) * room]
      yield _CHUNK.pack(CHUNK_MAGIC, i, count, total, digest, part.nbytes) + part


class Reassembler:
  """Rebuilds an Update from its chunks, fed in order; rejects anything else with CodecError."""

  def __init__(self, max_chunk_bytes: int | None = None, max_total_bytes: int | None = None):
    self.max_chunk_bytes = max_chunk_bytes
    self.max_total_bytes = max_total_bytes
    self._parts: list[bytes] = []
    self._received = 0
    self._first = None
    self.update: Update | None = None

  @property
  def complete(self) -> bool:
    return self.update is not None

  def feed(self, chunk) -> Update | None:
    """Adds the next chunk; returns the Update once the last chunk is in, else None."""
    chunk = memoryview(chunk).cast("B")
    if self.update is not None:
      raise CodecError("chunk after the update was complete (duplicate or extra chunk)")
    if self.max_chunk_bytes is not None and chunk.nbytes > self.max_chunk_bytes:
      raise CodecError(f"chunk oversized: {chunk.nbytes} bytes, limit {self.max_chunk_bytes}")
    if chunk.nbytes < CHUNK_OVERHEAD:
      raise CodecError(f"chunk truncated: {chunk.nbytes} bytes, header needs {CHUNK_OVERHEAD}")
    magic, index, count, total, digest, size = _CHUNK.unpack(chunk[:CHUNK_OVERHEAD])
    if magic != CHUNK_MAGIC:
      raise CodecError(f"chunk magic expected {CHUNK_MAGIC!r}, got {bytes(magic)!r}")
    if size != chunk.nbytes - CHUNK_OVERHEAD:
      raise CodecError(f"chunk {index} truncated: declares {size} data bytes, "
                       f"holds {chunk.nbytes - CHUNK_OVERHEAD}")
    expected = len(self._parts)
    if self._first is None:
      if self.max_total_bytes is not None and total > self.max_total_bytes:
        raise CodecError(f"update oversized: {total} bytes, limit {self.max_total_bytes}")
      if count < 1 or count > total + 1:
        raise CodecError(f"chunk count {count} impossible for {total} bytes")
      self._first = (count, total, digest)
    elif (count, total, digest) != self._first:
      raise CodecError(f"chunk {index} belongs to another update (count/length/digest differ)")
    if index != expected:
      kind = "duplicate" if index < expected else "out-of-order"
      raise CodecError(f"{kind} chunk: expected index {expected}, got {index}")
    if self._received + size > total:
      raise CodecError(f"chunk {index} oversized: {self._received + size} bytes exceed the "
                       f"declared {total}")
    self._parts.append(bytes(chunk[CHUNK_OVERHEAD:]))
    self._received += size
    if index + 1 < count:
      return None
    if self._received != total:
      raise CodecError(f"update truncated: {self._received} of {total} bytes in {count} chunks")
    data = b"".join(self._parts)
    self._parts = []
    if _digest(data) != digest:
      raise CodecError("update corrupted: reassembled bytes do not match the chunk digest")
    self.update = Update.from_bytes(data)
    return self.update

  def finish(self) -> Update:
    """The reassembled Update; CodecError when chunks are missing."""
    if self.update is None:
      want = self._first[0] if self._first else "?"
      raise CodecError(f"update truncated: {len(self._parts)} of {want} chunks received")
    return self.update
