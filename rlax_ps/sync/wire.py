"""Update messages: binary layout, header parsing, per-tensor changes, chunked transport.

Message layout (little-endian):
  prefix   b"RLXW" | u16 wire version (3) | u8 meta codec (0 raw, 1 zstd) | u32 header_len
           | u32 crc32(header)
  header   varint stored_len | meta, stored by its codec | seals
  meta     u8 fmt (0 bf16, 1 int8) | u8 flags (bit 0: keyframe; bit 1: the fingerprint seal
           follows the others) | varint version | varint base_version
           (0 for a keyframe) | varint tensor count, then column by column (so that zstd
           finds the repeats): per tensor varint bytes shared with the previous name
           | varint rest_len | the rest of the utf-8 name; per tensor u8 dtype
           (0 bf16, 1 int8) | u8 section codec version (2) | u8 mode | u8 ndim; per tensor
           varint dims[ndim]; per tensor varint section_len. zstd: a magicless frame from
           the built-in name dictionary (_NAME_DICT), written where the meta is at least
           1/RAW_META_SHARE of the sections' bytes (else raw: see RAW_META_SHARE).
  seals    integrity.py, each a u64 digest over per-item xxh3-64 digests | 2*ceil(log2 n)
           u8 group locators: results (every tensor the update makes) | bases (deltas
           only: every base tensor) | sections (the non-empty sections' bytes)
           | fingerprints (flag bit 1 only: every result's device fingerprint,
           fingerprints.py).
  body     the sections, in header order (tensor_codec.py).
The seals replace version 2's per-tensor u64 result and u32 base checksums: a few dozen
bytes whatever the tensor count, 64 bits of detection each, and a mismatch still names its
tensor. Versions 1 and 2 are rejected with a CodecError. Flag bit 1 came later within
version 3: a reader without it rejects such a header (bad keyframe flag), loses nothing.
Chunk layout: b"RLXC" | u32 index | u32 count | u64 message length | u64 xxh3(message)
  | u32 data length | data.
"""

import collections.abc
import dataclasses
import functools
import itertools
import math
import operator
import struct
import threading
import typing
import zlib

import numpy as np
import xxhash
import zstandard

from rlax_ps.sync import fields, packs, tensor_codec
from rlax_ps.sync.bits import BF16, INT8, UINT_OF, bit_view, read_only
from rlax_ps.sync.byte_reader import ByteReader, varint
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.integrity import XXH3, Seal, checksum, combine, group_count

MAGIC = b"RLXW"
WIRE_VERSION = 3
SECTION_CODEC_VERSION = 3
FORMATS = ("bf16", "int8")
_DTYPES = (BF16, INT8)
_PREFIX = struct.Struct("<4sHBII")
_MAX_HEADER = 1 << 26
_CHUNK = struct.Struct("<4sIIQQI")
CHUNK_MAGIC = b"RLXC"
CHUNK_OVERHEAD = _CHUNK.size
MAX_ELEMENTS = 1 << 40
KEYFRAME, FINGERPRINTED = 1, 2  # the meta's flag bits
# Locator width: a collision only blurs which tensor an error names (the error then lists
# the suspects); detection rests on the 64-bit digests.
LOCATOR_BITS = 8


def _digest(buf) -> int:
  return xxhash.xxh3_64_intdigest(buf)


class _MetaFields(typing.NamedTuple):
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  mode: str
  nbytes: int
  offset: int
  size: int


_LAYOUT_FIELDS = operator.itemgetter(0, 1, 2)  # a TensorMeta's (name, shape, dtype)
_FIRST = operator.itemgetter(0)


class TensorMeta(_MetaFields):
  """One tensor of an update: what it must produce (name, shape, dtype, its elements:
  size) and where its section lies (mode, nbytes, offset). A tuple: messages make one per
  tensor."""

  __slots__ = ()

  def __new__(cls, name: str, shape: tuple, dtype: np.dtype, mode: str, nbytes: int = 0,
              offset: int = 0, size: int | None = None) -> "TensorMeta":
    return tuple.__new__(cls, (name, shape, dtype, mode, nbytes, offset,
                               math.prod(shape) if size is None else size))


class UpdateHeader(typing.NamedTuple):
  """Everything about an update except its payload; `read_header` parses it cheaply (a
  tuple: every message makes one)."""
  version: int
  base_version: int | None
  fmt: str
  tensors: dict[str, TensorMeta]
  nbytes: int
  results: Seal  # over every tensor's result checksum, in header order
  bases: Seal | None  # over every base tensor's checksum (None for a keyframe)
  sections: Seal  # over the non-empty sections' xxh3-64, in header order
  # over every tensor's result fingerprint (fingerprints.py), in header order; None when
  # the publisher gave none (workers then check the results seal)
  fingerprints: Seal | None = None
  # (name, shape, dtype) of each tensor, in header order (Update.layout), made with the
  # metas (an encoder's is its layout's own key object); () where not given: read from the
  # metas. Derived from `tensors`: a header _replace'd with other tensors passes layout=().
  layout: tuple = ()

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


def _names_column(names) -> list[bytes]:
  """Per name: varint bytes shared with the previous name | varint rest_len | the rest."""
  out, prev = [], b""
  for name in names:
    nb = name.encode()
    shared = _shared_prefix(prev, nb)
    out += [varint(shared), varint(len(nb) - shared), nb[shared:]]
    prev = nb
  return out


# The header's zstd frames start from a raw-content dictionary: the names columns of this
# project's models (rlax_ps.models, one layer, untied head) held as bf16 and as int8, with
# and without q/k/v biases, so that a small model's names cost ~20 bytes instead of ~100-170;
# other names compress as they would without it. Frames are magicless and carry no size,
# dictionary id or checksum (the prefix's crc32 covers them). Changing the dictionary changes
# the wire format.
_LAYER_NAMES = ["embed.embedding", "layers.0.attn.k_proj.bias", "layers.0.attn.k_proj.kernel",
                "layers.0.attn.o_proj.kernel", "layers.0.attn.q_proj.bias",
                "layers.0.attn.q_proj.kernel", "layers.0.attn.v_proj.bias",
                "layers.0.attn.v_proj.kernel", "layers.0.input_norm.scale",
                "layers.0.mlp.down_proj.kernel", "layers.0.mlp.gate_proj.kernel",
                "layers.0.mlp.up_proj.kernel", "layers.0.post_attn_norm.scale",
                "lm_head.kernel", "norm.scale"]


def _held_names(bias: bool, int8: bool) -> list[str]:
  names = [n for n in _LAYER_NAMES if bias or not n.endswith(".bias")]
  scaled = [n + ".scale" for n in names if int8 and n.endswith(("kernel", "embedding"))]
  return sorted(names + scaled)


_NAME_DICT = zstandard.ZstdCompressionDict(
    b"".join(b"".join(_names_column(_held_names(bias, int8)))
             for bias in (True, False) for int8 in (False, True)),
    dict_type=zstandard.DICT_TYPE_RAWCONTENT)
_ZSTD_FORMAT = zstandard.FORMAT_ZSTD1_MAGICLESS


_LOCAL = threading.local()  # zstd (de)compressors with the dictionary loaded, per thread


# A meta under 1/RAW_META_SHARE of its sections' bytes is stored raw: zstd of a few hundred
# bytes costs 35-40 us once the trainer's step has evicted its code and tables (as long as
# a small model's packs take to code), to save at most the meta's own bytes, a percent or
# two of such a message (a larger share of a smaller one, which is compressed).
RAW_META_SHARE = 64


def _compressor(nbytes: int) -> zstandard.ZstdCompressor:
  """Level 9 (19 gains ~10 bytes on a small model's header at three times the time);
  loading the dictionary costs more than compressing a header, so each thread keeps its
  (de)compressors."""
  level = 9 if nbytes < 1 << 16 else 6
  cache = _LOCAL.__dict__.setdefault("compressors", {})
  if level not in cache:
    params = zstandard.ZstdCompressionParameters.from_level(
        level, format=_ZSTD_FORMAT, write_content_size=False, write_dict_id=False,
        write_checksum=False)
    cache[level] = zstandard.ZstdCompressor(compression_params=params, dict_data=_NAME_DICT)
  return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
  if not hasattr(_LOCAL, "decompressor"):
    _LOCAL.decompressor = zstandard.ZstdDecompressor(dict_data=_NAME_DICT, format=_ZSTD_FORMAT)
  return _LOCAL.decompressor


def build(fmt: str, version: int, base_version: int | None, entries,
          packed: dict | None = None) -> "Update":
  """Assembles a message; `entries` are (name, shape, dtype, checksum, base_checksum, mode,
  section) tuples: `checksum` is the xxh3-64 of the tensor the update makes, `base_checksum`
  that of its base (None for a keyframe). `packed`: the packs (head -> members) the
  encoder made, if known (else read from the modes, as a parsed message's are)."""
  layout = tuple((name, tuple(shape), np.dtype(dtype)) for name, shape, dtype, *_ in entries)
  return build_columns(fmt, version, base_version, layout, [e[3] for e in entries],
                       [e[4] for e in entries], [e[5] for e in entries],
                       [e[6] for e in entries], packed)


def build_columns(fmt: str, version: int, base_version: int | None, layout: tuple,
                  checksums: list, base_checksums: list, modes: list, sections: list,
                  packed: dict | None = None, fingerprints: list | None = None) -> "Update":
  """build() from columns: layout ((name, shape tuple, np.dtype) per tensor), then per
  tensor its checksum, base checksum, mode code and section; `fingerprints`: per tensor
  the device fingerprint of its result, sealed too when given. The meta bytes and the
  seals (from the digests) are made in one compiled call."""
  keyframe = base_version is None
  filled = [_digest(sec) for sec in sections if len(sec)]  # the non-empty sections'
  digests = [*checksums, *([] if keyframe else base_checksums), *filled,
             *([] if fingerprints is None else fingerprints)]
  counts = (len(checksums), -1 if keyframe else len(checksums), len(filled),
            -1 if fingerprints is None else len(checksums))
  update = _assemble(fmt, version, base_version, layout, np.array(modes, np.uint8),
                     (np.array(digests, np.uint64), counts), sections, packed)
  update.checksums = Checksums(tuple(map(_FIRST, layout)), np.array(checksums, np.uint64))
  if fingerprints is not None:
    update.fingerprints = dict(zip(map(_FIRST, layout), map(int, fingerprints)))
  return update


def section_seal(sections) -> Seal:
  """The seal over the xxh3-64 of the non-empty sections, in order."""
  return Seal.of([_digest(sec) for sec in sections if memoryview(sec).nbytes], LOCATOR_BITS)


def _read_seal(r: ByteReader, n: int, bits: int) -> Seal:
  digest = r.u64()
  width = bits // 8
  return Seal(digest, tuple(int.from_bytes(r.take(width), "little")
                            for _ in range(group_count(n))), bits)


_MODE_CODES = {name: code for code, name in enumerate(tensor_codec.MODE_NAMES)}


class _Columns(typing.NamedTuple):
  """The header columns that depend only on the tensors' names, shapes and dtypes (the same
  for every update of a model, hence cached)."""
  fixed: np.ndarray  # varint tensor count | the names column (uint8)
  codes: np.ndarray  # per tensor (dtype, section codec, mode 0, ndim), (count, 4) uint8
  dims: np.ndarray  # the dims column (uint8)
  names: tuple
  shapes: tuple  # int tuples
  dtypes: tuple
  sizes: tuple
  layout: tuple  # as given: (name, shape, dtype) per tensor


@functools.lru_cache(maxsize=32)
def layout_columns(layout: tuple, codec: int) -> _Columns:
  """_Columns of `layout` ((name, shape, dtype) per tensor), writing section codec version
  `codec`; CodecError when a name appears twice."""
  names = tuple(name for name, _, _ in layout)
  if len(set(names)) != len(names):
    twice = next(n for i, n in enumerate(names) if n in names[:i])
    raise CodecError(f"tensor {twice!r}: appears twice in the update")
  shapes = tuple(tuple(int(d) for d in shape) for _, shape, _ in layout)
  codes = np.array([(_DTYPES.index(dtype), codec, 0, len(shape))
                    for (_, _, dtype), shape in zip(layout, shapes)], np.uint8).reshape(-1, 4)
  as_array = lambda b: read_only(np.frombuffer(b, np.uint8).copy())  # noqa: E731
  return _Columns(as_array(varint(len(layout)) + b"".join(_names_column(names))),
                  read_only(codes),
                  as_array(b"".join(varint(d) for shape in shapes for d in shape)), names,
                  shapes, tuple(dtype for _, _, dtype in layout),
                  tuple(math.prod(shape) for shape in shapes), layout)


def assemble(header: UpdateHeader, sections) -> "Update":
  """The message of `header` (versions, fmt, its tensors' names, shapes, dtypes and modes,
  its seals, all written as given) over `sections` (bytes-likes in header order); the
  metas' lengths and offsets and the header's nbytes come from `sections`."""
  metas = list(header.tensors.values())
  if len(sections) != len(metas):
    raise ValueError(f"sections: expected {len(metas)}, got {len(sections)}")
  seals = [header.results, header.bases, header.sections, header.fingerprints]
  words = [w for seal in seals if seal is not None for w in (seal.digest, *seal.locators)]
  counts = tuple(-1 if seal is None else 1 + len(seal.locators) for seal in seals)
  return _assemble(header.fmt, header.version, header.base_version,
                   tuple((meta.name, tuple(meta.shape), meta.dtype) for meta in metas),
                   np.array([_MODE_CODES[meta.mode] for meta in metas], np.uint8),
                   (np.array(words, np.uint64), counts), sections, None, sealed=True)


def _assemble(fmt: str, version: int, base_version: int | None, layout: tuple,
              modes: np.ndarray, seals: tuple, sections, packed: dict | None,
              sealed: bool = False) -> "Update":
  """The message (see assemble) of the tensors of `layout` ((name, shape, dtype) each) in
  `modes` (uint8 mode codes), with seals over `sections`: seals = (digests, counts): the
  results', bases' (count -1 for a keyframe), sections' and fingerprints' (-1: none)
  digests back to back, sealed here; or, with `sealed`, each seal's words (digest, then
  locators) as given."""
  sections = [sec if type(sec) is bytes else memoryview(sec).cast("B") for sec in sections]
  keyframe = base_version is None
  lay = layout_columns(layout, SECTION_CODEC_VERSION)
  digests, counts = seals
  flags = (KEYFRAME if keyframe else 0) | (0 if counts[3] < 0 else FINGERPRINTED)
  fn = 0 if sealed else XXH3
  if not sealed and not fn:  # no compiled xxh3: the seals from Python, as words
    at, words = 0, []
    for c in counts:
      if c >= 0:
        seal = Seal.of(digests[at:at + c], LOCATOR_BITS)
        words += [seal.digest, *seal.locators]
        at += c
    counts = tuple(c if c < 0 else 1 + group_count(c) for c in counts)
    digests = np.array(words, np.uint64)
  lengths = np.array([len(sec) for sec in sections], np.int64)
  out, meta_end, sealed_end, ends = fields.fields(
      fn, FORMATS.index(fmt), flags, version, 0 if keyframe else base_version, lay.fixed,
      lay.codes, modes, lay.dims, lengths, digests, counts, LOCATOR_BITS // 8)
  return finish(fmt, version, base_version, lay, modes, lengths, out, meta_end, sealed_end,
                ends, sections, packed)


def finish(fmt: str, version: int, base_version: int | None, lay: "_Columns",
           modes: np.ndarray, lengths: np.ndarray, out: np.ndarray, meta_end: int,
           sealed_end: int, ends: tuple, sections: list, packed: dict | None) -> "Update":
  """The message from what fields.fields made (out: the seals' words, the meta bytes, the
  seals' bytes; where each ends) and the sections (bytes-likes, header order): the meta
  compressed, the prefix and its crc32, the bytes joined; the header made when first asked
  for."""
  words_end = 8 * ends[3]
  meta_len = meta_end - words_end
  codec = 0  # under 1/RAW_META_SHARE of the message: kept raw
  if meta_len * RAW_META_SHARE >= sum(map(len, sections)):
    packed_meta = _compressor(meta_len).compress(out[words_end:meta_end])
    codec = int(len(packed_meta) < meta_len)
  # the header's pieces (a raw meta and the seals after it in `out` are one), its crc32
  # chained over them: joined once, with the sections
  region = ([varint(meta_len), memoryview(out)[words_end:sealed_end]] if codec == 0 else
            [varint(len(packed_meta)), packed_meta, out[meta_end:sealed_end]])
  crc, header_len = 0, 0
  for piece in region:
    crc, header_len = zlib.crc32(piece, crc), header_len + len(piece)
  prefix = _PREFIX.pack(MAGIC, WIRE_VERSION, codec, header_len, crc)
  data = b"".join([prefix, *region, *sections])
  start = len(prefix) + header_len

  def header() -> UpdateHeader:
    """The header as read_header parses it (made when first asked for: a publisher sends
    the bytes and may never look at it)."""
    flat, made, at = out[:words_end].view(np.uint64).tolist(), [], 0
    for end in ends:
      made.append(None if at == end else Seal(flat[at], tuple(flat[at + 1:end]),
                                              LOCATOR_BITS))
      at = end
    sizes = lengths.tolist()  # the metas by C-level iteration alone
    tensors = dict(zip(lay.names, map(TensorMeta._make, zip(
        lay.names, lay.shapes, lay.dtypes, map(tensor_codec.MODE_NAMES.__getitem__,
                                               modes.tolist()),
        sizes, itertools.accumulate(sizes, initial=start), lay.sizes))))
    return UpdateHeader(version, base_version, fmt, tensors, len(data), *made, lay.layout)
  return Update(data, header, packed)


def read_header(b) -> UpdateHeader:
  """Parses and validates the header of a message without touching the payloads."""
  return _parse_header(b)[0]


def _parse_header(b) -> tuple[UpdateHeader, dict[str, list[str]]]:
  """read_header, and the packs (packs.read_packs) its validation found."""
  buf = memoryview(b).cast("B")
  if buf.nbytes < _PREFIX.size:
    raise CodecError(f"update header: truncated: {buf.nbytes} bytes, prefix needs {_PREFIX.size}")
  magic, wire, codec, hlen, hcrc = _PREFIX.unpack(buf[:_PREFIX.size])
  if magic != MAGIC:
    raise CodecError(f"update header: magic expected {MAGIC!r}, got {bytes(magic)!r}")
  if wire != WIRE_VERSION:
    raise CodecError(f"update header: unknown wire format version {wire} (expected "
                     f"{WIRE_VERSION}; version 2 carried per-tensor checksums, 1 rANS sections)")
  if _PREFIX.size + hlen > buf.nbytes:
    raise CodecError(
        f"update header: truncated: header needs {hlen} bytes, {buf.nbytes - _PREFIX.size} left")
  region = ByteReader(buf[_PREFIX.size:_PREFIX.size + hlen], "update header")
  if zlib.crc32(region.buf) != hcrc:
    raise CodecError("update header: corrupted (crc32 mismatch)")
  if codec > 1:
    raise CodecError(f"update header: unknown header codec {codec}")
  header = region.take(region.varint())
  if codec == 1:
    try:
      header = _decompressor().decompress(
          header, max_output_size=_MAX_HEADER)
    except zstandard.ZstdError as e:
      raise CodecError(f"update header: corrupted ({e})") from None
  r = ByteReader(header, "update header")
  fmt_code, flags = r.u8(), r.u8()
  keyframe = flags & KEYFRAME
  version, base_version = r.varint(), r.varint()
  if fmt_code >= len(FORMATS):
    raise CodecError(f"update header: unknown fmt code {fmt_code}")
  if flags & ~(KEYFRAME | FINGERPRINTED):
    raise CodecError(f"update header: unknown flags {flags:#04x} (a newer writer?)")
  if keyframe and base_version != 0:
    raise CodecError(f"update header: keyframe flag disagrees with base_version {base_version}")
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
  codes = np.frombuffer(r.take(4 * count), np.uint8).reshape(count, 4).tolist()
  shapes = [tuple(r.varint_list(ndim)) for _, _, _, ndim in codes]
  lengths = r.varint_list(count)
  r.done()
  results = _read_seal(region, count, LOCATOR_BITS)
  bases = None if keyframe else _read_seal(region, count, LOCATOR_BITS)
  sections = _read_seal(region, sum(1 for n in lengths if n), LOCATOR_BITS)
  printed = _read_seal(region, count, LOCATOR_BITS) if flags & FINGERPRINTED else None
  region.done()
  tensors, layout = {}, []
  offset = _PREFIX.size + hlen
  for name, (dtype_code, codec, mode, _), shape, nbytes in zip(names, codes, shapes, lengths):
    what = f"tensor {name!r}"
    if name in tensors:
      raise CodecError(f"{what}: appears twice in the update")
    if codec != SECTION_CODEC_VERSION:
      raise CodecError(f"{what}: unknown section format version {codec} "
                       f"(expected {SECTION_CODEC_VERSION})")
    if dtype_code >= len(_DTYPES) or mode >= len(tensor_codec.MODE_NAMES):
      raise CodecError(f"{what}: unknown dtype code {dtype_code} or mode {mode}")
    dtype = _DTYPES[dtype_code]
    size = math.prod(shape)
    if size > MAX_ELEMENTS:
      raise CodecError(f"{what}: shape {shape} exceeds {MAX_ELEMENTS} elements")
    if keyframe and mode != tensor_codec.RAW:
      raise CodecError(f"{what}: keyframe sections must be raw, got "
                       f"{tensor_codec.MODE_NAMES[mode]}")
    if mode == tensor_codec.UNCHANGED and nbytes:
      raise CodecError(f"{what}: unchanged section of {nbytes} bytes, expected none")
    if mode == tensor_codec.RAW and nbytes != size * dtype.itemsize:
      raise CodecError(f"{what}: raw section of {nbytes} bytes, expected {size * dtype.itemsize}")
    if offset + nbytes > buf.nbytes:
      raise CodecError(f"{what}: truncated: section needs {nbytes} bytes at offset {offset}, "
                       f"message has {buf.nbytes}")
    tensors[name] = TensorMeta(name, shape, dtype, tensor_codec.MODE_NAMES[mode], nbytes,
                                    offset)
    layout.append((name, shape, dtype))
    offset += nbytes
  if offset != buf.nbytes:
    raise CodecError(f"update: {buf.nbytes - offset} unexpected trailing bytes after the "
                     f"last section")
  found = packs.read_packs(tensors)
  return UpdateHeader(version, None if keyframe else base_version, FORMATS[fmt_code], tensors,
                      buf.nbytes, results, bases, sections, printed, tuple(layout)), found


def check_names(what: str, got, want) -> None:
  """CodecError naming the first tensor of `want` missing from `got`, or extra in it."""
  if isinstance(got, dict) and isinstance(want, dict) and got.keys() == want.keys():
    return
  missing = [n for n in want if n not in got]
  extra = [n for n in got if n not in want]
  if missing:
    raise CodecError(f"tensor {missing[0]!r}: missing from the {what} "
                     f"({len(missing)} missing in all)")
  if extra:
    raise CodecError(f"tensor {extra[0]!r}: in the {what} but not in the update "
                     f"({len(extra)} extra in all)")


def _listing(names, limit: int = 8) -> str:
  shown = ", ".join(repr(n) for n in names[:limit])
  return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_seal(seal: Seal, digests, names, problem: str, what: str = "checksum") -> None:
  """Raises CodecError stating `problem`, naming the tensor (or the suspects) the seal's
  locators point at, unless `digests` (one per name, in header order) match `seal`."""
  if seal.matches(digests):
    return
  suspects = seal.suspects(digests)
  if len(suspects) == 1:
    i = suspects[0]
    raise CodecError(f"tensor {names[i]!r}: {problem} (its {what} {digests[i]:016x} is not "
                     f"the one the update's seal records)")
  if suspects:
    raise CodecError(f"{problem} in one or more of {len(suspects)} suspect tensors (the "
                     f"locators cannot tell which): {_listing([names[i] for i in suspects])}")
  raise CodecError(f"{problem}: the combined {what} of the {len(names)} tensors is "
                   f"{combine(digests):016x}, the update expects {seal.digest:016x}, yet no "
                   f"locator mismatches (a locator collision); any of them may differ: "
                   f"{_listing(list(names))}")


class Checksums(collections.abc.Mapping):
  """name -> xxh3-64 of each tensor an update makes, as its encoder recorded them: a
  uint64 column in header order (`column`, read-only; `names`), made a dict only when
  looked into. encode takes it back as base_checksums and reads the column as it is: a
  publisher's next delta builds no dict and no array of them."""

  __slots__ = ("names", "_column", "_view", "_by_name")

  def __init__(self, names: tuple, column: np.ndarray):
    if len(names) != column.size:
      raise ValueError(f"checksums: {len(names)} names for {column.size} values")
    self.names, self._column, self._view, self._by_name = names, column, None, None

  @property
  def column(self) -> np.ndarray:
    """The checksums in header order (read-only: the view is made when first asked for,
    as a numpy flag costs microseconds on a publisher's path when the caches are cold)."""
    if self._view is None:
      self._view = read_only(self._column)
    return self._view

  def _dict(self) -> dict[str, int]:
    if self._by_name is None:
      self._by_name = dict(zip(self.names, self._column.tolist()))
    return self._by_name

  def __getitem__(self, name: str) -> int:
    return self._dict()[name]

  def __iter__(self):
    return iter(self.names)

  def __len__(self) -> int:
    return len(self.names)

  def __repr__(self):
    return f"Checksums({self._dict()!r})"


class Update:
  """One published version: a keyframe or a delta against `base_version`, as a message."""

  def __init__(self, data, header, _packs: dict | None = None):
    """header: the UpdateHeader of `data`, or a function making it (encode's: made when
    first asked for)."""
    self._data = data
    self._header = header
    # head -> members; `_packs`: what parsing `header` found already
    self._packs = _packs
    if type(header) is UpdateHeader:  # else when first asked for
      self._pack_of = self._members_to_heads()
    self._decoded_packs = {}
    self._pack_changes = {}  # head -> its pack's (indices, offsets), for changes()
    # name -> checksum of the tensor the update makes, where known: set by the encoder
    # (a publisher passes them as the next encode's base_checksums); None once parsed,
    # since the header holds only the seal over them.
    self.checksums: Checksums | None = None
    # name -> device fingerprint of each result, where the encoder was given them
    self.fingerprints: dict[str, int] | None = None

  @property
  def header(self) -> UpdateHeader:
    header = self._header
    if type(header) is not UpdateHeader:
      header = self._header = header()
    return header

  @functools.cached_property
  def _pack_of(self) -> dict[str, str]:
    """member -> the head of its pack."""
    return self._members_to_heads()

  def _members_to_heads(self) -> dict[str, str]:
    return {n: head for head, names in self.packs().items() for n in names}

  def pack(self, name: str) -> list[str] | None:
    """The members (head first) of the pack that codes `name`, or None."""
    head = self._pack_of.get(name)
    return None if head is None else self._packs[head]

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

  def to_view(self):
    """The message's bytes without a copy (bytes-like; valid while the update lives)."""
    return self._data

  @classmethod
  def from_bytes(cls, b) -> "Update":
    """Parses a message and checks its sections against the section seal; raises CodecError."""
    data = bytes(b)
    header, found = _parse_header(data)
    view = memoryview(data)
    filled = [m for m in header.tensors.values() if m.nbytes]
    check_seal(header.sections, [_digest(view[m.offset:m.offset + m.nbytes]) for m in filled],
               [m.name for m in filled], "section corrupted", "section digest")
    return cls(data, header, found)

  def meta(self, name: str) -> TensorMeta:
    if name not in self.tensors:
      raise CodecError(f"tensor {name!r}: not in this update (it has {len(self.tensors)} tensors)")
    return self.tensors[name]

  def decoded(self, name: str) -> tensor_codec.Decoded:
    """The validated, decoded section of one tensor, or of the pack that codes it (over
    the pack's concatenated elements; kept for the pack's other members)."""
    meta = self.meta(name)
    names = self.pack(name)
    if names is not None:
      if names[0] not in self._decoded_packs:
        head = self.tensors[names[0]]
        section = memoryview(self._data)[head.offset:head.offset + head.nbytes]
        self._decoded_packs[names[0]] = tensor_codec.decode_section(
            f"tensor {names[0]!r} (pack of {len(names)})",
            tensor_codec.MODE_NAMES.index(head.mode), section,
            sum(self.tensors[n].size for n in names), UINT_OF[meta.dtype])
      return self._decoded_packs[names[0]]
    section = memoryview(self._data)[meta.offset:meta.offset + meta.nbytes]
    return tensor_codec.decode_section(
        f"tensor {name!r}", tensor_codec.MODE_NAMES.index(meta.mode), section, meta.size,
        UINT_OF[meta.dtype])

  @property
  def layout(self) -> tuple:
    """(name, shape, dtype) of each tensor, in header order (as encode keys a held state)."""
    return self.header.layout or tuple(map(_LAYOUT_FIELDS, self.tensors.values()))

  def packs(self) -> dict[str, list[str]]:
    """Pack head -> its members (head first), for every pack of the update."""
    if self._packs is None:
      self._packs = packs.read_packs(self.header.tensors)
    return self._packs

  def span(self, name: str) -> tuple[int, int] | None:
    """(start, end) of a pack member's elements in its pack, or None."""
    names = self.pack(name)
    if names is None:
      return None
    start = packs.starts([self.tensors[n].size for n in names])[names.index(name)]
    return start, start + self.tensors[name].size

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
    span = self.span(name)
    lo, hi = span or (0, meta.size)
    old = None
    if base_array is not None and dec.mode != tensor_codec.RAW:
      old = bit_view(self.check_base(name, base_array))
    common = dict(name=name, shape=meta.shape, dtype=meta.dtype)
    if dec.mode == tensor_codec.UNCHANGED:
      return TensorChanges(kind="unchanged", **common)
    if dec.mode == tensor_codec.RAW:
      array = dec.replacement[lo:hi].astype(dec.replacement.dtype.newbyteorder("="))
      return TensorChanges(kind="replace", array=array.view(meta.dtype).reshape(meta.shape),
                           **common)
    if dec.mode == tensor_codec.DENSE:
      offsets = dec.offsets[lo:hi]
      array = None if old is None else (old + offsets).view(meta.dtype).reshape(meta.shape)
      return TensorChanges(kind="dense", offsets=offsets, array=array, **common)
    if span is None:
      indices, offsets = dec.sparse()
    else:  # a pack's changes are decoded once for all its members
      head = self._pack_of[name]
      if head not in self._pack_changes:
        self._pack_changes[head] = dec.sparse()
      indices, offsets = self._pack_changes[head]
      a, b = np.searchsorted(indices, [lo, hi])
      indices, offsets = indices[a:b] - lo, offsets[a:b]
      if indices.size == 0:
        return TensorChanges(kind="unchanged", **common)
    values = None if old is None else (old[indices] + offsets).view(meta.dtype)
    return TensorChanges(kind="sparse", indices=indices, offsets=offsets, values=values,
                         **common)

  def verify_all(self, arrays_or_digests) -> None:
    """Raises CodecError, naming the tensor where the seal can, unless the given held state
    is exactly what this update makes. Takes name -> array (checked for shape and dtype,
    then hashed) or name -> its `checksum` (e.g. kept from an earlier update), for every
    tensor of the update."""
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

  @property
  def fingerprinted(self) -> bool:
    """Whether the update seals its results' device fingerprints (check_fingerprints)."""
    return self.header.fingerprints is not None

  def check_fingerprints(self, fingerprints: dict) -> None:
    """CodecError naming the tensor unless `fingerprints` (name -> device fingerprint of
    each held result, every tensor of the update) match the update's fingerprint seal; a
    worker checks weights on device this way (rlax_ps.sync.device.fingerprints_of)."""
    if self.header.fingerprints is None:
      raise CodecError(f"update {self.version}: carries no fingerprint seal (its publisher "
                       f"gave no fingerprints): check its results' checksums instead")
    check_names("fingerprinted state", fingerprints, self.tensors)
    check_seal(self.header.fingerprints, [int(fingerprints[n]) for n in self.tensors],
               list(self.tensors), "corrupted: result fingerprint mismatch", "fingerprint")

  def check_bases(self, digests) -> None:
    """CodecError naming the tensor unless the base tensors' checksums (header order) are
    those this delta was made against."""
    check_seal(self.header.bases, digests, list(self.tensors),
               f"wrong base: not the weights of version {self.base_version} this update was "
               f"made against")

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
