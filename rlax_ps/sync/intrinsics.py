"""Numba intrinsics the compiled loops need and numba lacks: unaligned 8-byte loads and
stores at a byte address, and 64-lane compares that LLVM lowers to the host's SIMD.

They take addresses, not arrays: numba counts references to an array argument around
every call (an NRT incref/decref pair: +21% in the joint encoder until taken out).
Little-endian is native on every numba target, as the codec's LSB-first streams need.
"""

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

_U64 = ir.IntType(64)


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


def _lanes(builder, address, lane):
  """The 64 lanes of `lane` (an ir.IntType) at byte address `address`, unaligned."""
  return builder.load(builder.inttoptr(address, ir.VectorType(lane, 64).as_pointer()),
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


@intrinsic
def zigzag_u16(typingctx, old_at, new_at, z_at, top):
  """changed_u16 of the 64 lanes at old_at, new_at, also storing each lane's zigzag offset
  (zigzag of new - old, wrapping) capped at uint16 `top` at z_at (64 uint16): a walk over
  the changes then reads a change's offset with one load instead of two loads and the
  arithmetic, and indexes a table of top + 1 entries with no bound check."""
  def codegen(context, builder, signature, args):
    lane = ir.IntType(16)
    vt = ir.VectorType(lane, 64)
    d = builder.sub(_lanes(builder, args[1], lane), _lanes(builder, args[0], lane))
    z = builder.xor(builder.shl(d, ir.Constant(vt, [1] * 64)),
                    builder.ashr(d, ir.Constant(vt, [15] * 64)))
    cap = builder.insert_element(ir.Constant(vt, ir.Undefined), builder.trunc(args[3], lane),
                                 ir.Constant(ir.IntType(32), 0))
    cap = builder.shuffle_vector(cap, ir.Constant(vt, ir.Undefined),
                                 ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64))
    capped = builder.select(builder.icmp_unsigned("<", z, cap), z, cap)
    builder.store(capped, builder.inttoptr(args[2], vt.as_pointer()), align=2)
    return _bitmask(builder, builder.icmp_unsigned("!=", z, ir.Constant(vt, [0] * 64)))
  return types.uint64(types.int64, types.int64, types.int64, types.int64), codegen
