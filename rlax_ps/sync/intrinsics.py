"""Numba intrinsics the compiled loops need and numba lacks: unaligned 8-byte loads and
stores at a byte address, and 64-lane compares that LLVM lowers to the host's SIMD.

They take addresses, not arrays: numba counts references to an array argument around
every call (an NRT incref/decref pair), which costs in the innermost loops.
Little-endian is native on every numba target, as the codec's LSB-first streams need.
"""

import llvmlite.binding
from llvmlite import ir
from numba.core import config, types
from numba.extending import intrinsic

_U64 = ir.IntType(64)


def _target_features() -> set[str]:
  """The CPU features numba compiles for: NUMBA_CPU_FEATURES, else the host's."""
  flat = config.CPU_FEATURES or llvmlite.binding.get_host_cpu_features().flatten()
  return {f[1:] for f in flat.split(",") if f.startswith("+")}


def has_compress() -> bool:
  """Whether list_u16's compress is one instruction (AVX-512 VBMI2) on the target numba
  compiles for: elsewhere LLVM expands it lane by lane, and listing costs more than it
  saves."""
  return {"avx512vbmi2", "avx512bw", "avx512vl"} <= _target_features()


def has_shuffle() -> bool:
  """Whether the target has SSSE3's byte shuffle (pshufb), with which list_u16_shuffle
  packs lanes through a lookup table, 8 at a time."""
  return "ssse3" in _target_features()


HAS_COMPRESS = has_compress()
HAS_SHUFFLE = has_shuffle()
# How the joint coder finds a block's changes: WALK (a branch per change), or listed
# branch-free by COMPRESS (the AVX-512 VBMI2 instruction) or SHUFFLE (a table of byte
# shuffles: x86 without it).
WALK, COMPRESS, SHUFFLE = 0, 1, 2


@intrinsic
def store_u64(typingctx, address, value):
  """Stores uint64 `value` at byte `address`, unaligned."""
  def codegen(context, builder, signature, args):
    builder.store(args[1], builder.inttoptr(args[0], _U64.as_pointer()), align=1)
    return context.get_dummy_value()
  return types.void(types.int64, types.uint64), codegen


@intrinsic
def load_u64(typingctx, address):
  """The uint64 at byte `address`, unaligned."""
  def codegen(context, builder, signature, args):
    return builder.load(builder.inttoptr(args[0], _U64.as_pointer()), align=1)
  return types.uint64(types.int64), codegen


@intrinsic
def prefetch(typingctx, address):
  """Asks for the 64-byte line at byte `address` in the mid-level cache (prefetcht1): no
  wait, and no fault where nothing is mapped there."""
  def codegen(context, builder, signature, args):
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = _llvm_fn(builder, "llvm.prefetch.p0", ir.VoidType(), [i8p, i32, i32, i32])
    builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0),  # read,
                      ir.Constant(i32, 2), ir.Constant(i32, 1)])  # locality 2, data
    return context.get_dummy_value()
  return types.void(types.int64), codegen


def _lanes(builder, address, lane, n=64):
  """The n lanes of `lane` (an ir.IntType) at byte address `address`, unaligned."""
  return builder.load(builder.inttoptr(address, ir.VectorType(lane, n).as_pointer()),
                      align=1)


def _bitmask(builder, differ):
  """The <64 x i1> `differ` as a uint64, lane j at bit j (x86: a compare and movemask)."""
  return builder.bitcast(differ, _U64)


def _changed(bits: int):
  """The intrinsic changed(old_at, new_at) -> uint64 over 64 lanes of `bits` bits: bit j set
  where lane j of the 64 at byte address old_at differs from new_at's."""
  @intrinsic
  def changed(typingctx, old_at, new_at):
    def codegen(context, builder, signature, args):
      lane = ir.IntType(bits)
      return _bitmask(builder, builder.icmp_unsigned(
          "!=", _lanes(builder, args[0], lane), _lanes(builder, args[1], lane)))
    return types.uint64(types.int64, types.int64), codegen
  return changed


changed_u16 = _changed(16)
changed_u8 = _changed(8)


def _splat(builder, value, vt):
  """`value` (a scalar of vt's lane type) in every lane of vector type vt."""
  one = builder.insert_element(ir.Constant(vt, ir.Undefined), value,
                               ir.Constant(ir.IntType(32), 0))
  return builder.shuffle_vector(one, ir.Constant(vt, ir.Undefined),
                                ir.Constant(ir.VectorType(ir.IntType(32), vt.count),
                                            [0] * vt.count))


def _zigzags(builder, old_at, new_at, lane, n, top=None):
  """(zigzag offsets of new - old (wrapping) over the n lanes of `lane` at byte addresses
  old_at, new_at, the same capped at the scalar `top` (None: no cap))."""
  vt = ir.VectorType(lane, n)
  d = builder.sub(_lanes(builder, new_at, lane, n), _lanes(builder, old_at, lane, n))
  z = builder.xor(builder.shl(d, ir.Constant(vt, [1] * n)),
                  builder.ashr(d, ir.Constant(vt, [lane.width - 1] * n)))
  if top is None:
    return z, z
  cap = _splat(builder, builder.trunc(top, lane), vt)
  return z, builder.select(builder.icmp_unsigned("<", z, cap), z, cap)


@intrinsic
def zigzag_u16(typingctx, old_at, new_at, z_at, top):
  """changed_u16 of the 64 lanes at old_at, new_at, also storing each lane's zigzag offset
  (zigzag of new - old, wrapping) capped at uint16 `top` at z_at (64 uint16): a walk over
  the changes then reads a change's offset with one load instead of two loads and the
  arithmetic, and indexes a table of top + 1 entries with no bound check."""
  def codegen(context, builder, signature, args):
    z, capped = _zigzags(builder, args[0], args[1], ir.IntType(16), 64, args[3])
    builder.store(capped, builder.inttoptr(args[2], capped.type.as_pointer()), align=2)
    return _bitmask(builder, builder.icmp_unsigned("!=", z, ir.Constant(z.type, [0] * 64)))
  return types.uint64(types.int64, types.int64, types.int64, types.int64), codegen


def _llvm_fn(builder, name, ret, params):
  """The LLVM intrinsic `name` of that type, declared in the builder's module once."""
  module = builder.module
  if name in module.globals:
    return module.globals[name]
  return ir.Function(module, ir.FunctionType(ret, params), name)


LIST_LANES = 32  # lanes list_u16 looks at per call


def _compress_table() -> bytes:
  """The byte-shuffle table of list_u16_shuffle: row m (16 bytes) moves the uint16 lanes of
  8 whose bit is set in m to the front, in order."""
  rows = []
  for m in range(256):
    picks = [2 * lane + b for lane in range(8) if m >> lane & 1 for b in range(2)]
    rows.append(bytes(picks + [0x80] * (16 - len(picks))))
  return b"".join(rows)


_TABLE = _compress_table()
_V16 = ir.VectorType(ir.IntType(8), 16)


def _table_row(builder, m):
  """Row m (an i64 below 256) of _compress_table(), from a constant in the function's
  module."""
  name = "rlax_compress_table"
  table = builder.module.globals.get(name)
  if table is None:
    data = _TABLE
    ty = ir.ArrayType(ir.IntType(8), len(data))
    table = ir.GlobalVariable(builder.module, ty, name)
    table.initializer = ir.Constant(ty, bytearray(data))
    table.global_constant = True
    table.linkage = "internal"
  at = builder.add(builder.ptrtoint(table, _U64), builder.shl(m, ir.Constant(_U64, 4)))
  return builder.load(builder.inttoptr(at, _V16.as_pointer()), align=1)


def _pack_front(builder, bits, vectors, width, ats, way):
  """Stores each vector of `vectors` (lanes of `width` bits, as many as `bits` (an integer
  of one bit per lane) has) at its byte address in `ats` with the lanes whose bit is set
  packed to the front, in order; what follows them, up to the vector's size, is undefined.
  way COMPRESS: a SIMD compress (one instruction with AVX-512 VBMI2, else expanded lane by
  lane); SHUFFLE (16-bit lanes): 8 lanes at a time through _compress_table (as COMPRESS
  where the target lacks the shuffle)."""
  n = bits.type.width
  if way != SHUFFLE or not HAS_SHUFFLE:
    mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), n))
    for values, at in zip(vectors, ats):
      vt = values.type
      compress = _llvm_fn(builder, f"llvm.experimental.vector.compress.v{n}i{width}", vt,
                          [vt, mask.type, vt])
      builder.store(builder.call(compress, [values, mask, ir.Constant(vt, ir.Undefined)]),
                    builder.inttoptr(at, vt.as_pointer()), align=1)
    return
  pshufb = _llvm_fn(builder, "llvm.x86.ssse3.pshuf.b.128", _V16, [_V16, _V16])
  ctpop = _llvm_fn(builder, "llvm.ctpop.i64", _U64, [_U64])
  assert width == 16, width
  wide = builder.zext(bits, _U64) if n < 64 else bits
  rows, counts = [], []
  for c in range(n // 8):
    m = builder.and_(builder.lshr(wide, ir.Constant(_U64, 8 * c)), ir.Constant(_U64, 255))
    rows.append(_table_row(builder, m))
    counts.append(builder.shl(builder.call(ctpop, [m]), ir.Constant(_U64, 1)))
  for values, at in zip(vectors, ats):
    for c in range(n // 8):
      part = builder.shuffle_vector(values, ir.Constant(values.type, ir.Undefined),
                                    ir.Constant(ir.VectorType(ir.IntType(32), 8),
                                                list(range(8 * c, 8 * c + 8))))
      builder.store(builder.call(pshufb, [builder.bitcast(part, _V16), rows[c]]),
                    builder.inttoptr(at, _V16.as_pointer()), align=1)
      at = builder.add(at, counts[c])


def _list16(way: int):
  """list_u16 packing lanes the `way` _pack_front takes (COMPRESS or SHUFFLE)."""
  @intrinsic
  def list_u16(typingctx, old_at, new_at, z_at, i_at, first, top):
    """Lists the changes among the LIST_LANES uint16 lanes at byte addresses old_at,
    new_at: their zigzag offsets (of new - old, wrapping) capped at `top` to z_at, their
    lane numbers plus `first` (uint16) to i_at, each packed to the front of the LIST_LANES
    uint16 stored there (_pack_front: no branch per change); returns how many."""
    def codegen(context, builder, signature, args):
      i16, n = ir.IntType(16), LIST_LANES
      vt = ir.VectorType(i16, n)
      z, capped = _zigzags(builder, args[0], args[1], i16, n, args[5])
      bits = builder.bitcast(builder.icmp_unsigned("!=", z, ir.Constant(vt, [0] * n)),
                             ir.IntType(n))
      lanes = builder.add(ir.Constant(vt, list(range(n))),
                          _splat(builder, builder.trunc(args[4], i16), vt))
      _pack_front(builder, bits, (capped, lanes), 16, (args[2], args[3]), way)
      count = builder.call(_llvm_fn(builder, f"llvm.ctpop.i{n}", ir.IntType(n),
                                    [ir.IntType(n)]), [bits])
      return builder.zext(count, _U64)
    return types.int64(types.int64, types.int64, types.int64, types.int64, types.int64,
                       types.int64), codegen
  return list_u16


@intrinsic
def list_u8(typingctx, old_at, new_at, z_at, i_at, first):
  """list_u16 of 64 uint8 lanes (int8 codes) by compress (listing sparser int8 changes
  through byte shuffles cost more than walking them): zigzags (uint8, uncapped: the int8
  code table holds every one) to z_at, lane numbers plus `first` (uint16) to i_at, each
  packed to the front; returns how many."""
  def codegen(context, builder, signature, args):
    i8, i16, n = ir.IntType(8), ir.IntType(16), 64
    vt = ir.VectorType(i8, n)
    z, _ = _zigzags(builder, args[0], args[1], i8, n)
    bits = builder.bitcast(builder.icmp_unsigned("!=", z, ir.Constant(vt, [0] * n)), _U64)
    _pack_front(builder, bits, (z,), 8, (args[2],), COMPRESS)
    half = ir.VectorType(i16, 32)
    ctpop32 = _llvm_fn(builder, "llvm.ctpop.i32", ir.IntType(32), [ir.IntType(32)])
    at = args[3]
    for h in (0, 1):  # the element numbers in two halves of 32 16-bit lanes
      word = builder.trunc(builder.lshr(bits, ir.Constant(_U64, 32 * h)), ir.IntType(32))
      lanes = builder.add(ir.Constant(half, list(range(32 * h, 32 * h + 32))),
                          _splat(builder, builder.trunc(args[4], i16), half))
      _pack_front(builder, word, (lanes,), 16, (at,), COMPRESS)
      at = builder.add(at, builder.shl(builder.zext(builder.call(ctpop32, [word]), _U64),
                                       ir.Constant(_U64, 1)))
    return builder.call(_llvm_fn(builder, "llvm.ctpop.i64", _U64, [_U64]), [bits])
  return types.int64(types.int64, types.int64, types.int64, types.int64,
                     types.int64), codegen


list_u16_compress, list_u16_shuffle = _list16(COMPRESS), _list16(SHUFFLE)


CODE_LANES = 8  # changes code_u16 / code_u8 code per call


def _coder(zbits: int):
  """The intrinsic code(i_at, z_at, ctab_at, k, codes_at, lens_at) over zigzags listed as
  uint`zbits` (code_u16, code_u8)."""
  @intrinsic
  def code(typingctx, i_at, z_at, ctab_at, k, codes_at, lens_at):
    """Codes CODE_LANES listed changes: change j's element number is the uint16 at
    i_at + 2 (j + 1) (the one before it at i_at + 2 j: gaps wrap in 16 bits), its zigzag
    the j-th listed at z_at (within the table); ctab_at: the uint64 code table
    (joint._encode_blocks). Stores its code (Rice gap of k bits, then the value's code from
    the table) as a uint64 at codes_at + 8 j and its length as a uint8 at lens_at + j, 0
    where the change must be coded the slow way (no table entry, or past 56 bits)."""
    def codegen(context, builder, signature, args):
      i16, n = ir.IntType(16), CODE_LANES
      v16, v64 = ir.VectorType(i16, n), ir.VectorType(_U64, n)
      c64 = lambda x: ir.Constant(v64, [x] * n)
      cur = _lanes(builder, builder.add(args[0], ir.Constant(_U64, 2)), i16, n)
      prev = _lanes(builder, args[0], i16, n)
      gap = builder.zext(builder.sub(builder.sub(cur, prev), ir.Constant(v16, [1] * n)), v64)
      z = builder.zext(_lanes(builder, args[1], ir.IntType(zbits), n), v64)
      at = builder.add(_splat(builder, args[2], v64), builder.shl(z, c64(3)))
      ptrs = builder.inttoptr(at, ir.VectorType(_U64.as_pointer(), n))
      gather = _llvm_fn(builder, f"llvm.masked.gather.v{n}i64.v{n}p0", v64,
                        [ptrs.type, ir.IntType(32), ir.VectorType(ir.IntType(1), n), v64])
      e = builder.call(gather, [ptrs, ir.Constant(ir.IntType(32), 8),
                                ir.Constant(ir.VectorType(ir.IntType(1), n), [1] * n),
                                ir.Constant(v64, ir.Undefined)])
      k = _splat(builder, args[3], v64)
      tail = builder.lshr(e, c64(56))
      q = builder.lshr(gap, k)
      kmask = builder.sub(builder.shl(c64(1), k), c64(1))
      v = builder.or_(builder.shl(builder.and_(gap, kmask), c64(1)),
                      builder.and_(e, c64((1 << 56) - 1)))
      code = builder.shl(v, builder.and_(q, c64(63)))
      length = builder.add(q, tail)
      ok = builder.and_(builder.icmp_unsigned("!=", tail, c64(0)),
                        builder.icmp_unsigned("<=", length, c64(56)))
      length = builder.select(ok, length, c64(0))
      builder.store(code, builder.inttoptr(args[4], v64.as_pointer()), align=1)
      builder.store(builder.trunc(length, ir.VectorType(ir.IntType(8), n)),
                    builder.inttoptr(args[5], ir.VectorType(ir.IntType(8), n).as_pointer()),
                    align=1)
      return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, types.uint64, types.int64,
                      types.int64), codegen
  return code


code_u16 = _coder(16)
code_u8 = _coder(8)


# ---- 32-bit lane arithmetic (fingerprints.py) ----------------------------------------------
# numba widens uint32 arithmetic to 64 bits, and LLVM then vectorizes it in 64-bit lanes
# (vpmullq: half the lanes, slower multiplies); these keep it in 32-bit lanes.

_I32 = ir.IntType(32)


def _i32(value: int) -> ir.Constant:
  return ir.Constant(_I32, value)


@intrinsic
def mix32(typingctx, x, k, m_bits, m_index, f1, f2):
  """murmur3's fmix32((x * m_bits) ^ (k * m_index)) in uint32 (x: an unsigned element,
  widened; k: its int64 index, mod 2**32); the constants are compile-time ints."""
  consts = [getattr(t, "literal_value", None) for t in (m_bits, m_index, f1, f2)]
  if None in consts:
    return None

  def codegen(context, builder, signature, args):
    mb, mi, c1, c2 = (_i32(v) for v in consts)
    h = builder.xor(builder.mul(builder.zext(args[0], _I32), mb),
                    builder.mul(builder.trunc(args[1], _I32), mi))
    h = builder.mul(builder.xor(h, builder.lshr(h, _i32(16))), c1)
    h = builder.mul(builder.xor(h, builder.lshr(h, _i32(13))), c2)
    return builder.xor(h, builder.lshr(h, _i32(16)))
  return types.uint32(x, types.int64, m_bits, m_index, f1, f2), codegen


@intrinsic
def add32(typingctx, a, b):
  """a + b mod 2**32."""
  def codegen(context, builder, signature, args):
    return builder.add(args[0], args[1])
  return types.uint32(types.uint32, types.uint32), codegen


@intrinsic
def odd_madd32(typingctx, acc, h, k):
  """acc + h * (2k + 1) mod 2**32 (k: an int64 index, mod 2**32)."""
  def codegen(context, builder, signature, args):
    i = builder.trunc(args[2], _I32)
    return builder.add(args[0], builder.mul(args[1], builder.add(builder.add(i, i), _i32(1))))
  return types.uint32(types.uint32, types.uint32, types.int64), codegen


# ---- C calls by address (integrity.XXH3) ---------------------------------------------------

@intrinsic
def call_hash(typingctx, fn, address, nbytes):
  """fn(address, nbytes) for the C function at address `fn` of type
  uint64 (const void *, size_t): xxh3-64 of nbytes at byte `address` (integrity.XXH3),
  called from compiled loops while the bytes are in cache, with no Python call a tensor."""
  def codegen(context, builder, signature, args):
    i8p = ir.IntType(8).as_pointer()
    fnty = ir.FunctionType(_U64, [i8p, _U64])
    return builder.call(builder.inttoptr(args[0], fnty.as_pointer()),
                        [builder.inttoptr(args[1], i8p), args[2]])
  return types.uint64(types.int64, types.int64, types.int64), codegen


@intrinsic
def copy_bytes(typingctx, dst, src, nbytes):
  """Copies nbytes from byte address src to dst (not overlapping) by LLVM's memcpy: the
  C library's vectorised copy, where a compiled slice assignment copies element by
  element."""
  def codegen(context, builder, signature, args):
    i8p = ir.IntType(8).as_pointer()
    fn = _llvm_fn(builder, "llvm.memcpy.p0.p0.i64", ir.VoidType(),
                  [i8p, i8p, _U64, ir.IntType(1)])
    builder.call(fn, [builder.inttoptr(args[0], i8p), builder.inttoptr(args[1], i8p), args[2],
                      ir.Constant(ir.IntType(1), 0)])
    return context.get_dummy_value()
  return types.void(types.int64, types.int64, types.int64), codegen
