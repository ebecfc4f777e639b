"""Update messages: the binary layout (FORMAT.md), header parsing, per-tensor changes.

A message is a prefix, a header (versions, format, the layout: every tensor's name, shape
and dtype, or for a delta the digest of its base's layout; each tensor's mode and section
length; the seals; the publishing model's config fields, where given) and the sections.
Tensor modes: "unchanged" (no section), "raw" (the new held bytes), "sparse" (sparse.py)
and "packed" (a small tensor whose changes are coded with the other packed tensors of its
dtype in one sparse section over their concatenated elements, in name order: a pack).
"""

import dataclasses
import functools
import json
import math
import struct
import threading
import typing
import zlib

import numpy as np
import xxhash
import zstandard

from rlax_ps.sync import sparse
from rlax_ps.sync.bits import BF16, INT8, UINT_OF, bit_view
from rlax_ps.sync.byte_reader import ByteReader, varint
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.integrity import Seal, check_seal, checksum, group_count

MAGIC = b"RLXW"
WIRE_VERSION = 4
FORMATS = ("bf16", "int8")
DTYPES = (BF16, INT8)
MODES = ("unchanged", "raw", "sparse", "packed")
UNCHANGED, RAW, SPARSE, PACKED = range(4)
KEYFRAME, FINGERPRINTED, MODEL = 1, 2, 4  # flag bits
MAX_ELEMENTS = 1 << 40
MAX_NDIM = 16
_PREFIX = struct.Struct("<4sHII")  # magic | wire version | header length | crc32(header)
MAX_HEADER = 1 << 26  # bytes of a decompressed header


class _Zstd(threading.local):
  """Per-thread zstd (de)compressors of the header: magicless frames, no checksum (the
  prefix's crc32 covers them)."""

  def compressor(self) -> zstandard.ZstdCompressor:
    if not hasattr(self, "c"):
      self.c = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters
                                        .from_level(19, format=zstandard.FORMAT_ZSTD1_MAGICLESS,
                                                    write_checksum=False, write_dict_id=False))
    return self.c

  def decompressor(self) -> zstandard.ZstdDecompressor:
    if not hasattr(self, "d"):
      self.d = zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS)
    return self.d


_ZSTD = _Zstd()


class TensorMeta(typing.NamedTuple):
  """One tensor of an update: what it must produce and where its section lies (offset
  and nbytes in the message; a packed tensor's are those of its span in the pack's
  elements: `offset` its first element there, nbytes 0)."""
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  mode: str
  nbytes: int
  offset: int
  size: int


class UpdateHeader(typing.NamedTuple):
  """Everything about an update except its payload (read_header parses it cheaply).
  `tensors` is None for a delta not yet bound to its base's layout (Update.bind)."""
  version: int
  base_version: int | None
  fmt: str
  tensors: dict[str, TensorMeta]
  nbytes: int
  results: Seal  # over every tensor's result checksum, in header order
  bases: Seal | None  # over every base tensor's checksum (None for a keyframe)
  sections: Seal  # over the xxh3-64 of the non-empty sections, in body order
  fingerprints: Seal | None  # over every result's device fingerprint, where given
  packs: dict  # held dtype -> (offset, nbytes) of its pack section
  layout: int | None  # a delta's layout digest (layout_digest of its base's layout)
  spans: tuple  # (mode code, offset, nbytes) of each tensor's section, in name order
  # The publishing model's config fields (ModelConfig.forward_fields), where it gave them.
  model: dict | None = None

  @property
  def is_keyframe(self) -> bool:
    return self.base_version is None


@dataclasses.dataclass(frozen=True)
class TensorChanges:
  """What one tensor of an update changes, for in-place application (e.g. on device).

  kind: "unchanged"; "sparse" (flat `indices`, wrapping bit `offsets` there: new_bits =
  old_bits + offset mod 2**width, and the new `values` in the held dtype when a base was
  given); "replace" (the new `array`)."""
  name: str
  kind: str
  shape: tuple[int, ...]
  dtype: np.dtype
  indices: np.ndarray | None = None
  offsets: np.ndarray | None = None
  values: np.ndarray | None = None
  array: np.ndarray | None = None


def _seal_bytes(seal: Seal) -> bytes:
  return struct.pack("<Q", seal.digest) + bytes(seal.locators)


def _layout_rows(layout) -> list[bytes]:
  """Per tensor of a layout: its name (sharing a prefix with the previous one), dtype,
  ndim and dims, as a keyframe's header writes them."""
  rows, prev = [], b""
  for name, shape, dtype in layout:
    nb = name.encode()
    shared = next((i for i, (x, y) in enumerate(zip(prev, nb)) if x != y), min(len(prev), len(nb)))
    rows.append(b"".join([varint(shared), varint(len(nb) - shared), nb[shared:],
                          bytes([DTYPES.index(dtype), len(shape)]), *map(varint, shape)]))
    prev = nb
  return rows


def layout_of(spec) -> tuple:
  """((name, shape, dtype), ...) in name order of a held state (name -> array or anything
  with .shape and .dtype, or name -> (shape, dtype)) or of an Update or its header;
  CodecError naming a tensor whose dtype is not a held one."""
  if isinstance(spec, (Update, UpdateHeader)):
    return tuple((m.name, m.shape, m.dtype) for m in spec.tensors.values())
  out = []
  for name in sorted(spec):
    value = spec[name]
    shape, dtype = (value.shape, value.dtype) if hasattr(value, "dtype") else value
    try:
      dtype = np.dtype(dtype)
    except TypeError:
      dtype = None
    if dtype not in DTYPES:
      raise CodecError(f"tensor {name!r}: dtype expected bfloat16 or int8, got {dtype}")
    out.append((name, tuple(int(d) for d in shape), dtype))
  return tuple(out)


@functools.lru_cache(maxsize=16)
def layout_digest(layout: tuple) -> int:
  """xxh3-64 of a layout's rows: what a delta names its tensors by (the same for every
  update of a model, hence cached)."""
  return xxhash.xxh3_64_intdigest(b"".join(_layout_rows(layout)))


def model_json(model) -> bytes:
  """The header's bytes of `model` (a dict of config field -> JSON value): compact JSON
  with sorted keys; ValueError naming `model` for anything else."""
  if not isinstance(model, dict) or not all(isinstance(k, str) for k in model):
    raise ValueError(f"model: expected a dict of field name -> value, got {model!r:.80}")
  try:
    return json.dumps(model, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
  except (TypeError, ValueError) as e:
    raise ValueError(f"model: expected JSON values (numbers, strings, lists, dicts, None): "
                     f"{e}") from None


def _read_model(r: ByteReader) -> dict:
  try:
    model = json.loads(bytes(r.take(r.varint())))
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise CodecError(f"update header: model fields: not JSON ({e})") from None
  if not isinstance(model, dict):
    raise CodecError(f"update header: model fields: expected a JSON object, got "
                     f"{type(model).__name__}")
  return model


def message_parts(fmt: str, version: int, base_version: int | None, metas: list,
                  sections: list, packs: dict, checksums: list, base_checksums: list | None,
                  fingerprints: list | None, model: dict | None = None) -> list:
  """The message of `metas` ((name, shape, dtype, mode code) each, name order), their
  `sections` (bytes-likes; b"" where none), the pack sections (dtype -> bytes) and the
  per-tensor digests the seals cover, as a list of buffers: the prefix and header, then the
  sections as given (views stay views). A keyframe writes its layout; a delta, the
  layout's digest. `model`: the publishing model's config fields, carried in the header."""
  keyframe = base_version is None
  layout = tuple((name, tuple(shape), np.dtype(dtype)) for name, shape, dtype, _ in metas)
  sections = [s if isinstance(s, bytes) else memoryview(s).cast("B") for s in sections]
  head = [bytes([FORMATS.index(fmt), (KEYFRAME if keyframe else 0)
                 | (0 if fingerprints is None else FINGERPRINTED)
                 | (0 if model is None else MODEL)]), varint(version)]
  if keyframe:
    head += [varint(len(metas)), *_layout_rows(layout)]
  else:
    head += [varint(base_version), struct.pack("<Q", layout_digest(layout)), varint(len(metas)),
             bytes(m[3] for m in metas)]
  head += [varint(len(section)) for (*_, mode), section in zip(metas, sections)
           if mode in (RAW, SPARSE)]
  body = [s for s in sections if s] + [packs[d] for d in DTYPES if d in packs]
  if not keyframe:
    head += [varint(len(packs.get(d, b""))) for d in DTYPES]
  head.append(_seal_bytes(Seal.of(checksums)))
  if not keyframe:
    head.append(_seal_bytes(Seal.of(base_checksums)))
  head.append(_seal_bytes(Seal.of(xxhash.xxh3_64_intdigest(s) for s in body)))
  if fingerprints is not None:
    head.append(_seal_bytes(Seal.of(fingerprints)))
  if model is not None:
    fields = model_json(model)
    head += [varint(len(fields)), fields]
  header = _ZSTD.compressor().compress(b"".join(head))
  return [_PREFIX.pack(MAGIC, WIRE_VERSION, len(header), zlib.crc32(header)) + header, *body]


def build(fmt: str, version: int, base_version: int | None, metas: list, sections: list,
          packs: dict, checksums: list, base_checksums: list | None,
          fingerprints: list | None, model: dict | None = None) -> "Update":
  """The Update of message_parts' message, knowing its checksums (and fingerprints)."""
  data = b"".join(message_parts(fmt, version, base_version, metas, sections, packs, checksums,
                                base_checksums, fingerprints, model))
  header = read_header(data)
  if base_version is not None:
    header = bind(header, tuple((name, tuple(shape), np.dtype(dtype))
                                for name, shape, dtype, _ in metas))
  update = Update(data, header)
  names = [m[0] for m in metas]
  update.checksums = dict(zip(names, map(int, checksums)))
  if base_checksums is not None:
    update.base_checksums = dict(zip(names, map(int, base_checksums)))
  if fingerprints is not None:
    update.fingerprints = dict(zip(names, map(int, fingerprints)))
  return update


def _read_seal(r: ByteReader, n: int) -> Seal:
  return Seal(r.u64(), tuple(r.take(group_count(n))))


PREFIX_BYTES = _PREFIX.size


def header_nbytes(prefix) -> int:
  """Bytes of a message's prefix and header, from its first PREFIX_BYTES bytes."""
  return _PREFIX.size + _prefix(memoryview(prefix).cast("B"))[0]


def _prefix(buf: memoryview) -> tuple[int, int]:
  """(header length, header crc32) of a message's prefix, checked."""
  if buf.nbytes < _PREFIX.size:
    raise CodecError(f"update header: truncated: {buf.nbytes} bytes, the prefix needs "
                     f"{_PREFIX.size}")
  magic, wire, hlen, crc = _PREFIX.unpack(buf[:_PREFIX.size])
  if magic != MAGIC:
    raise CodecError(f"update header: magic expected {MAGIC!r}, got {bytes(magic)!r}")
  if wire != WIRE_VERSION:
    raise CodecError(f"update header: wire format version {wire} is not supported: this "
                     f"reader reads version {WIRE_VERSION} only (republish with the same "
                     f"rlax-ps version on both sides)")
  return hlen, crc


def read_header(b, layout=None, *, nbytes: int | None = None) -> UpdateHeader:
  """Parses and validates the header of a message (any buffer) without reading the
  sections; CodecError naming the tensor or field at fault. A delta names its tensors by
  its base's layout: given `layout` (anything layout_of takes), `tensors` is filled in,
  else it is None until Update.bind. `nbytes`: the message's length, where `b` holds only
  its first header_nbytes bytes (a stored message read a part at a time)."""
  buf = memoryview(b).cast("B")
  hlen, crc = _prefix(buf)
  total = buf.nbytes if nbytes is None else nbytes
  if _PREFIX.size + hlen > buf.nbytes:
    raise CodecError(f"update header: truncated: the header needs {hlen} bytes, "
                     f"{buf.nbytes - _PREFIX.size} left")
  body_start = _PREFIX.size + hlen
  if zlib.crc32(buf[_PREFIX.size:body_start]) != crc:
    raise CodecError("update header: corrupted (crc32 mismatch)")
  try:  # (decompress ignores max_output_size where the frame states its size: bounded here)
    declared = zstandard.get_frame_parameters(
        buf[_PREFIX.size:body_start], format=zstandard.FORMAT_ZSTD1_MAGICLESS).content_size
    if declared > MAX_HEADER and declared != zstandard.CONTENTSIZE_UNKNOWN:
      raise CodecError(f"update header: {declared} bytes decompressed, at most {MAX_HEADER}")
    fields = _ZSTD.decompressor().decompress(buf[_PREFIX.size:body_start],
                                             max_output_size=MAX_HEADER)
  except zstandard.ZstdError as e:
    raise CodecError(f"update header: corrupted ({e})") from None
  if len(fields) > MAX_HEADER:
    raise CodecError(f"update header: {len(fields)} bytes decompressed, at most {MAX_HEADER}")
  r = ByteReader(fields, "update header")
  fmt_code, flags = r.u8(), r.u8()
  if fmt_code >= len(FORMATS):
    raise CodecError(f"update header: unknown fmt code {fmt_code}")
  if flags & ~(KEYFRAME | FINGERPRINTED | MODEL):
    raise CodecError(f"update header: unknown flags {flags:#04x}")
  keyframe = bool(flags & KEYFRAME)
  version = r.varint()
  if version >= 1 << 63:  # (versions travel as int64 in every RPC)
    raise CodecError(f"update header: version {version} is past int64")
  base_version = digest = None
  if not keyframe:
    base_version, digest = r.varint(), r.u64()
    if not base_version < version:
      raise CodecError(f"update header: versions must satisfy 0 <= base < version, got base "
                       f"{base_version}, version {version}")
  count = r.varint()
  if count > len(fields):
    raise CodecError(f"update header: {count} tensors declared in {len(fields)} bytes")
  own = _read_layout(r, count) if keyframe else None
  modes = [RAW] * count if keyframe else list(r.take(count))
  if any(m >= len(MODES) for m in modes):
    raise CodecError(f"update header: unknown mode {max(modes)}")
  lengths = [r.varint() if m in (RAW, SPARSE) else 0 for m in modes]
  pack_len = {} if keyframe else {d: r.varint() for d in DTYPES}
  results = _read_seal(r, count)
  bases = None if keyframe else _read_seal(r, count)
  filled = sum(1 for n in lengths if n) + sum(1 for n in pack_len.values() if n)
  sections = _read_seal(r, filled)
  printed = _read_seal(r, count) if flags & FINGERPRINTED else None
  model = _read_model(r) if flags & MODEL else None
  r.done()
  spans, offset = [], body_start
  for mode, nbytes in zip(modes, lengths):
    if mode == SPARSE and not nbytes:
      raise CodecError(f"update header: tensor #{len(spans)}: empty sparse section")
    spans.append((mode, offset, nbytes))
    offset += nbytes
  packs = {}
  for dtype, n in pack_len.items():
    if n:
      packs[dtype] = (offset, n)
      offset += n
  if offset != total:
    kind = "truncated" if offset > total else "trailing bytes"
    raise CodecError(f"update: {kind}: the sections end at byte {offset}, the message has "
                     f"{total}")
  header = UpdateHeader(version, base_version, FORMATS[fmt_code], None, total, results,
                        bases, sections, printed, packs, digest, tuple(spans), model)
  if own is not None or layout is not None:
    header = bind(header, own if own is not None else layout_of(layout))
  return header


def _read_layout(r: ByteReader, count: int) -> tuple:
  layout, prev = [], b""
  for _ in range(count):
    shared = r.varint()
    if shared > len(prev):
      raise CodecError(f"update header: a name shares {shared} bytes with a {len(prev)}-byte one")
    prev = prev[:shared] + bytes(r.take(r.varint()))
    try:
      name = prev.decode()
    except UnicodeDecodeError:
      raise CodecError("update header: a tensor name is not utf-8") from None
    dtype_code, ndim = r.u8(), r.u8()
    if dtype_code >= len(DTYPES) or ndim > MAX_NDIM:
      raise CodecError(f"tensor {name!r}: unknown dtype code {dtype_code} or ndim {ndim}")
    shape = tuple(r.varint() for _ in range(ndim))
    if any(d > MAX_ELEMENTS for d in shape):  # (a 0 elsewhere hides it from the product)
      raise CodecError(f"tensor {name!r}: shape {shape} has a dimension over {MAX_ELEMENTS}")
    layout.append((name, shape, DTYPES[dtype_code]))
  return tuple(layout)


def bind(header: UpdateHeader, layout: tuple) -> UpdateHeader:
  """`header` with its tensors named by `layout` ((name, shape, dtype) in name order): a
  keyframe's own, or the base's of a delta, which must be the one it was made against."""
  if header.layout is not None and layout_digest(layout) != header.layout:
    raise CodecError(f"update {header.version}: made for other tensors: the base's names, "
                     f"shapes or dtypes differ from those of the state it was encoded against")
  if len(layout) != len(header.spans):
    raise CodecError(f"update {header.version}: {len(header.spans)} tensors, the layout has "
                     f"{len(layout)}")
  tensors, pack_at = {}, {d: 0 for d in DTYPES}
  for (name, shape, dtype), (mode, offset, nbytes) in zip(layout, header.spans):
    what, size = f"tensor {name!r}", math.prod(shape)
    if name in tensors:
      raise CodecError(f"{what}: appears twice in the update")
    if size > MAX_ELEMENTS:
      raise CodecError(f"{what}: shape {shape} exceeds {MAX_ELEMENTS} elements")
    if mode == RAW and nbytes != size * dtype.itemsize:
      raise CodecError(f"{what}: raw section of {nbytes} bytes, expected {size * dtype.itemsize}")
    if mode == PACKED:
      if dtype not in header.packs:
        raise CodecError(f"{what}: packed, but the update has no {dtype} pack")
      offset, nbytes = pack_at[dtype], 0
      pack_at[dtype] += size
    tensors[name] = TensorMeta(name, shape, dtype, MODES[mode], nbytes, offset, size)
  for dtype in header.packs:
    if not pack_at[dtype]:
      raise CodecError(f"update {header.version}: a {dtype} pack with no packed tensor")
  return header._replace(tensors=tensors)


def check_names(what: str, got, want) -> None:
  """CodecError naming the first tensor of `want` missing from `got`, or extra in it."""
  missing = [n for n in want if n not in got]
  extra = [n for n in got if n not in want]
  if missing:
    raise CodecError(f"tensor {missing[0]!r}: missing from the {what} "
                     f"({len(missing)} missing in all)")
  if extra:
    raise CodecError(f"tensor {extra[0]!r}: in the {what} but not in the update "
                     f"({len(extra)} extra in all)")


class Update:
  """One published version: a keyframe or a delta against `base_version`, as a message."""

  def __init__(self, data, header: UpdateHeader):
    self._data = data
    self.header = header
    self._packs: dict = {}  # dtype -> its pack's decoded (indices, offsets)
    # name -> checksum of each tensor the update makes, where known: set by the encoder (a
    # publisher passes them as the next encode's base_checksums); None once parsed.
    self.checksums: dict[str, int] | None = None
    self.base_checksums: dict[str, int] | None = None  # likewise, of a delta's base
    # name -> device fingerprint of each result, where the encoder was given them
    self.fingerprints: dict[str, int] | None = None

  version = property(lambda self: self.header.version)
  base_version = property(lambda self: self.header.base_version)
  fmt = property(lambda self: self.header.fmt)
  is_keyframe = property(lambda self: self.header.is_keyframe)
  nbytes = property(lambda self: self.header.nbytes)
  fingerprinted = property(lambda self: self.header.fingerprints is not None)
  model = property(lambda self: self.header.model)  # the publisher's model fields, or None

  @property
  def tensors(self) -> dict[str, TensorMeta]:
    if self.header.tensors is None:
      raise CodecError(f"update {self.version}: a delta names its tensors by its base's "
                       f"layout: bind it first (update.bind(base))")
    return self.header.tensors

  def bind(self, layout) -> "Update":
    """Names a delta's tensors by `layout` (its base: a held state, an Update or
    (shape, dtype) pairs by name); CodecError unless it is the layout the delta was made
    against. Returns the update."""
    layout = layout_of(layout)
    if self.header.tensors is None or (self.header.layout is not None
                                       and layout_digest(layout) != self.header.layout):
      self.header = bind(self.header, layout)  # raises on a mismatch
    return self

  def __repr__(self):
    kind = "keyframe" if self.is_keyframe else f"delta from {self.base_version}"
    return (f"Update(version={self.version}, {kind}, fmt={self.fmt}, "
            f"{len(self.header.spans)} tensors, {self.nbytes} bytes)")

  def to_bytes(self) -> bytes:
    return bytes(self._data)

  def to_view(self):
    """The message's bytes without a copy (valid while the update lives)."""
    return self._data

  @classmethod
  def from_bytes(cls, b, layout=None) -> "Update":
    """Parses a message and checks its sections against the section seal (CodecError);
    `layout` as read_header takes it. bytes and a bytearray (a pull's) are kept, not
    copied: a keyframe pulled is held once, not twice; other buffers are copied."""
    data = b if isinstance(b, (bytes, bytearray)) else bytes(b)
    header = read_header(data, layout)
    names = (list(header.tensors) if header.tensors is not None
             else [f"#{i}" for i in range(len(header.spans))])
    spans = [(name, at, n) for name, (_, at, n) in zip(names, header.spans) if n]
    spans += [(f"{d} pack", at, n) for d, (at, n) in header.packs.items()]
    view = memoryview(data)
    check_seal(header.sections, [xxhash.xxh3_64_intdigest(view[a:a + n]) for _, a, n in spans],
               [name for name, _, _ in spans], "section corrupted", "section digest")
    return cls(data, header)

  def meta(self, name: str) -> TensorMeta:
    if name not in self.tensors:
      raise CodecError(f"tensor {name!r}: not in this update (it has {len(self.tensors)} tensors)")
    return self.tensors[name]

  def _section(self, offset: int, nbytes: int) -> memoryview:
    return memoryview(self._data).cast("B")[offset:offset + nbytes]

  def _pack(self, dtype) -> tuple[np.ndarray, np.ndarray]:
    if dtype not in self._packs:
      size = sum(m.size for m in self.tensors.values() if m.mode == "packed" and m.dtype == dtype)
      self._packs[dtype] = sparse.decode(self._section(*self.header.packs[dtype]), size,
                                         UINT_OF[dtype], f"the {dtype} pack")
    return self._packs[dtype]

  def sparse_changes(self, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, wrapping offsets) of a sparse or packed tensor's changes."""
    meta = self.meta(name)
    if meta.mode == "sparse":
      return sparse.decode(self._section(meta.offset, meta.nbytes), meta.size,
                           UINT_OF[meta.dtype], f"tensor {name!r}")
    idx, off = self._pack(meta.dtype)
    a, b = np.searchsorted(idx, [meta.offset, meta.offset + meta.size])
    return idx[a:b] - meta.offset, off[a:b]

  def raw(self, name: str) -> np.ndarray:
    """A raw tensor's new array: a read-only view of the message's bytes."""
    meta = self.meta(name)
    view = np.frombuffer(self._section(meta.offset, meta.nbytes), meta.dtype)
    view.flags.writeable = False  # (also over a kept bytearray, which others may read)
    return view.reshape(meta.shape)

  def changes(self, name: str, base_array=None) -> TensorChanges:
    """Decoded changes of one tensor; with `base_array`, also the new values."""
    meta = self.meta(name)
    common = dict(name=name, shape=meta.shape, dtype=meta.dtype)
    if meta.mode == "raw":
      return TensorChanges(kind="replace", array=self.raw(name), **common)
    if meta.mode == "unchanged":
      return TensorChanges(kind="unchanged", **common)
    idx, off = self.sparse_changes(name)
    if not idx.size:
      return TensorChanges(kind="unchanged", **common)
    values = None
    if base_array is not None:
      old = np.asarray(base_array)
      if old.shape != meta.shape or old.dtype != meta.dtype:
        raise CodecError(f"tensor {name!r}: base expected {meta.dtype}{list(meta.shape)}, "
                         f"got {old.dtype}{list(old.shape)}")
      values = (bit_view(old)[idx] + off).view(meta.dtype)
    return TensorChanges(kind="sparse", indices=idx, offsets=off, values=values, **common)

  def verify_all(self, arrays_or_digests) -> None:
    """CodecError, naming the tensor where the seal can, unless the given held state is
    exactly what this update makes: name -> array (checked for shape and dtype, then
    hashed) or name -> its `checksum`, for every tensor of the update."""
    check_names("verified state", arrays_or_digests, self.tensors)
    digests = []
    for name, meta in self.tensors.items():
      value = arrays_or_digests[name]
      if isinstance(value, (int, np.integer)):
        digests.append(int(value))
        continue
      arr = np.asarray(value)
      if arr.shape != meta.shape or arr.dtype != meta.dtype:
        raise CodecError(f"tensor {name!r}: expected {meta.dtype}{list(meta.shape)}, "
                         f"got {arr.dtype}{list(arr.shape)}")
      digests.append(checksum(arr))
    self.check_results(digests)

  def check_results(self, digests) -> None:
    """CodecError naming the tensor unless the results' checksums (header order) match."""
    check_seal(self.header.results, digests, list(self.tensors),
               "corrupted: result checksum mismatch")

  def check_bases(self, digests) -> None:
    """CodecError naming the tensor unless the base tensors' checksums (header order) are
    those this delta was made against."""
    check_seal(self.header.bases, digests, list(self.tensors),
               f"wrong base: not the weights of version {self.base_version} this update was "
               f"made against")

  def check_fingerprints(self, fingerprints: dict) -> None:
    """CodecError naming the tensor unless `fingerprints` (name -> device fingerprint of
    every held result) match the update's fingerprint seal."""
    if self.header.fingerprints is None:
      raise CodecError(f"update {self.version}: carries no fingerprint seal (its publisher "
                       f"gave no fingerprints): check its results' checksums instead")
    check_names("fingerprinted state", fingerprints, self.tensors)
    check_seal(self.header.fingerprints, [int(fingerprints[n]) for n in self.tensors],
               list(self.tensors), "corrupted: result fingerprint mismatch", "fingerprint")
