"""A pack's section (packs.py) coded and applied in one compiled call each way.

A small model is one or two packs: its update is a pack's section or two, and every numba
call, numpy call and Python step of a section's general path (tensor_codec.py) costs tens
of microseconds when the caches are cold (as after a trainer step), which is most of such
an update. Here one call plans the joint layout (joint.py) and codes it, or scans the pack
and codes the sparse layout (Rice gaps, then literal or rANS values: tensor_codec's
choices, made the same way), and hashes each member while it is in cache; apply copies,
decodes and hashes in one call likewise. The layouts these calls do not make (entropy-coded
gaps of clustered changes, bitmaps, dense offsets) and inputs they reject go to the
general path, which makes the same bytes and names any problem.

Only the few lines that join the kernels are inlined; the kernels themselves (scans,
samplers, block coders and decoders) are linked as the general path compiled them
(chosen.by_constant). Inlining them too made numba spend minutes typing each of these
functions, on every fresh machine.
"""

import functools
import typing

import numba
import numpy as np

from rlax_ps.sync import chosen, fields, joint, loops, rans, scratch
from rlax_ps.sync.bits import read_only
from rlax_ps.sync.intrinsics import call_hash, copy_bytes
from rlax_ps.sync.loops import (CALL_BYTES, FIXED_MIN, LITERAL_MAX, OK, RICE, RICE_MULTI,
                                WIDTHS, _bitlen, _put_varint, costs_chosen, scan_chosen,
                                cost_of, entropy_bits, hash_parts, literal_stream, rice_layout,
                                scatter_add, sparse_literal)

# Section modes (tensor_codec's numbers), and GENERAL: the general path must code it.
UNCHANGED, RAW, SPARSE, JOINT, PACKED, GENERAL = 0, 1, 2, 5, 6, -1
GAP_SAMPLE = 1 << 13  # tensor_codec._GAP_SAMPLE: gaps the coder choice is costed on
RICE_STREAMS, RICE_SPLIT = 4, 1 << 12  # tensor_codec's: four Rice streams from 4096 gaps
SCAN_MAX = 1 << 22  # larger packs scan in the general path (its outputs sized by estimate)
_JIT = dict(nogil=True, cache=True, boundscheck=False)


@numba.njit(inline="always", **_JIT)
def _code_sparse(old, new, ends, hash_old, fn, gaps, syms, raw, section, digests, lane_bits):
  """tensor_codec.encode_section's scan path for a pack: (mode, bytes, the array holding
  them): UNCHANGED, RAW (no layout smaller), SPARSE (written to `section`, or to a new
  array where it does not fit), or GENERAL where the general path chooses another layout
  (clustered gaps, bitmap or dense offsets). The scan's outputs go to gaps, syms, raw
  (scratch of n + one block each, raw a quarter of that); members are hashed into digests
  block by block, right after their scan."""
  n = new.size
  itemsize = lane_bits // 8
  block = max(1, min(n, CALL_BYTES // itemsize))
  hist = np.zeros((4, loops.ALPHABET), np.int64)
  st = np.array([0, -1, 0], np.int64)
  raw[0] = 0
  hashed = 0
  for s in range(0, n, block):
    a, b = old[s:s + block], new[s:s + block]
    m = a.size - a.size % 64
    scan_chosen(lane_bits, (a[:m].view(np.uint64), b[:m].view(np.uint64), a, b, s, st, gaps,
                            syms, raw, hist))  # room for every element: never refuses
    done = hashed
    while done < ends.size and ends[done] <= s + block:
      done += 1
    if fn:
      hash_parts(fn, new.ctypes.data, itemsize, ends, hashed, done, digests[0])
      if hash_old:
        hash_parts(fn, old.ctypes.data, itemsize, ends, hashed, done, digests[1])
    hashed = done
  if fn:  # members of no elements past the last block (or in a pack of none)
    hash_parts(fn, new.ctypes.data, itemsize, ends, hashed, ends.size, digests[0])
    if hash_old:
      hash_parts(fn, old.ctypes.data, itemsize, ends, hashed, ends.size, digests[1])
  nnz = st[0]
  if nnz == 0:
    return UNCHANGED, 0, section
  counts = hist.sum(axis=0)
  step = max(1, nnz // GAP_SAMPLE)
  z, top, vbits, vpresent, k, rice_bits, gbits, gpresent = costs_chosen(lane_bits, (
      old, new, gaps[:nnz], counts, step, WIDTHS, LITERAL_MAX))
  cost_sym = cost_of(vbits, vpresent)
  cost_v = cost_sym
  if z.size:  # entropy.literal_cost
    width = _bitlen(top - 1)
    nbytes = (z.size * width + 7) // 8 if z.size < FIXED_MIN else (z.size + 7) // 8 * width
    cost_v = min(cost_v, 2.0 + nbytes)
  rice_cost = rice_bits * step / 8 + 3
  if cost_of(gbits, gpresent) * step < 0.97 * rice_cost:  # clustered: the general path's
    return GENERAL, 0, section
  sparse_cost = rice_cost + cost_v + 9
  raw_cost = n * itemsize
  if nnz * 4 > n:  # dense offsets may win (the general path codes them)
    dense = counts.copy()
    dense[0] += n - nnz
    bits, present = entropy_bits(dense, WIDTHS)
    if cost_of(bits, present) < min(raw_cost, sparse_cost):
      return GENERAL, 0, section
  if raw_cost <= sparse_cost:
    return RAW, 0, section
  streams = RICE_STREAMS if nnz >= RICE_SPLIT else 1
  gap_bytes = rice_layout(gaps[:nnz], k, streams, RICE | (RICE_MULTI if streams > 1 else 0) | k)
  if cost_v < cost_sym:
    values = literal_stream(z, 1, top)
  else:
    values = rans.symbol_stream(counts, syms[:nnz], raw, WIDTHS)
  total = 10 + gap_bytes.size + values.size
  if section.size < total:
    section = np.empty(total, np.uint8)
  p = _put_varint(section, 0, nnz)
  copy_bytes(section.ctypes.data + p, gap_bytes.ctypes.data, gap_bytes.size)
  p += gap_bytes.size
  copy_bytes(section.ctypes.data + p, values.ctypes.data, values.size)
  return SPARSE, p + values.size, section


@numba.njit(inline="always", **_JIT)
def _code(old, new, probe, rest, windows, plan_gaps, room, section, ends, hash_old, fn, gaps,
          syms, raw, lane_bits, listed):
  """(mode, section bytes, the array holding them, the members' digests: rows new, old) of
  a pack: joint where joint._code_pack plans and codes it, else _code_sparse."""
  if windows:  # joint.MIN_ELEMENTS or more
    planned, nbytes, section, digests = joint._code_pack(
        old, new, probe, rest, windows, plan_gaps, room, section, ends, hash_old, fn,
        lane_bits, listed)
    if planned:
      return JOINT, nbytes, section, digests
  else:
    digests = np.zeros((2, ends.size), np.uint64)
  mode, nbytes, section = _code_sparse(old, new, ends, hash_old, fn, gaps, syms, raw, section,
                                       digests, lane_bits)
  return mode, nbytes, section, digests


def _coder_for(lane_bits: int, listed: int):
  """_code compiled for one lane width and way of listing changes (joint.WAYS)."""
  @numba.njit(**_JIT)
  def code(old, new, probe, rest, windows, plan_gaps, room, section, ends, hash_old, fn, gaps,
           syms, raw):
    return _code(old, new, probe, rest, windows, plan_gaps, room, section, ends, hash_old, fn,
                 gaps, syms, raw, lane_bits, listed)
  return code


_CODERS = {(bits, way): _coder_for(bits, way) for bits in (16, 8) for way in joint.WAYS[bits]}
coder_chosen = chosen.by_constant(_CODERS, "coder_chosen")


def encode(old: np.ndarray, new: np.ndarray, ends: np.ndarray, hash_old: bool, fn: int,
           listed: int | None = None):
  """(mode, section (a uint8 array: this thread's scratch, one a lane width, valid until its
  next pack of that width), the members' xxh3 (uint64 rows: new, old where hash_old)) of a
  pack (old, new: its members' unsigned bits back to back; member j ends at element
  ends[j]), hashed by the C function at address fn (integrity.XXH3), in one compiled call;
  None where the general path must code it (the digests are then not made). mode: UNCHANGED,
  RAW (nothing smaller), SPARSE or JOINT, as tensor_codec.encode_section chooses. listed:
  as for joint.encode."""
  n = new.size
  if n > SCAN_MAX:
    return None
  width = 8 * new.itemsize
  code = _CODERS[width, joint.LISTING[width] if listed is None else int(listed)]
  args = _arguments(old, new, ends)
  mode, nbytes, section, digests = code(*args[:9], hash_old, fn, *args[9:])
  if mode == GENERAL:
    return None
  return mode, section[:nbytes], digests


def _arguments(old: np.ndarray, new: np.ndarray, ends: np.ndarray) -> tuple:
  """A pack's coder's arguments but hash_old and fn: (old, new, the plan's probe windows,
  its other windows, how many in all, then this thread's scratch: plan gaps, stream room,
  section, gaps, symbols, raw words; ends between section and gaps)."""
  probe, rest, windows, specs = _plan_of(new.size, new.itemsize)
  plan, room, section, gaps, syms, raw = scratch.buffers(f"pack {8 * new.itemsize}", specs)
  return old, new, probe, rest, windows, plan, room, section, read_only(ends), gaps, syms, raw


@functools.lru_cache(maxsize=64)
def _plan_of(n: int, itemsize: int) -> tuple:
  """(the plan's probe windows, its other windows, how many in all (joint._probe_split;
  none below joint.MIN_ELEMENTS), the (size, dtype) of each scratch buffer the call takes)
  of a pack of n elements of `itemsize` bytes."""
  windows = joint.sample_starts(n).size if n >= joint.MIN_ELEMENTS else 0
  cap = n + max(1, min(n, CALL_BYTES // itemsize))  # the scan's: every element, a block
  specs = ((joint.SAMPLE_WINDOW * max(windows, 1), np.uint64),
           (joint.stream_room(n, itemsize) if windows else 1, np.uint64),
           (n * itemsize, np.uint8), (cap, np.uint32), (cap, np.uint8),
           (cap // 4 + 2, np.uint64))
  return (*(joint._probe_split(n) if windows else (_NONE, _NONE)), windows, specs)


_NONE = np.zeros(0, np.int64)
_NONE.flags.writeable = False


@numba.njit(inline="always", **_JIT)
def _apply_sparse(buf, n, base, out, ends, fn, like):
  """The sparse section `buf` (tensor_codec's usual layout: Rice gaps, literal offsets:
  loops.sparse_literal) applied to a pack of n elements as joint._apply_pack does:
  (error code, the members' xxh3); not OK: another layout or anything the general reader
  rejects (the caller then reads it there)."""
  digests = np.zeros(ends.size, np.uint64)
  ok, idx, offsets = sparse_literal(buf, n, like)
  if not ok:
    return loops.E_TRUNCATED, digests
  size = out.itemsize
  if out.ctypes.data != base.ctypes.data:
    copy_bytes(out.ctypes.data, base.ctypes.data, n * size)
  scatter_add(out, idx, offsets, 0, idx.size, 0)
  if fn:
    hash_parts(fn, out.ctypes.data, size, ends, 0, ends.size, digests)
  return OK, digests


def _applier_for(quad: bool):
  """The compiled apply of a pack's joint or sparse section (joint.QUAD: quad)."""
  @numba.njit(**_JIT)
  def apply_pack(mode, buf, n, base, out, ends, fn):
    if mode == JOINT:
      return joint._apply_pack(buf, n, base, out, ends, fn, quad)
    return _apply_sparse(buf, n, base, out, ends, fn, base[:0])
  return apply_pack


_APPLIERS = {quad: _applier_for(quad) for quad in (False, True)}


def apply(mode: int, section, base: np.ndarray, out: np.ndarray, ends: np.ndarray,
          fn: int) -> np.ndarray | None:
  """A pack's JOINT or SPARSE section (bytes-like) applied in one compiled call to the
  pack's members' unsigned bits back to back (base, into out, which may be base; member j
  ending at element ends[j]): the members' xxh3 (uint64) by the C function at address fn,
  or None where the section is not in a layout the call reads (sparse: Rice gaps and
  literal offsets) or fails there (the caller then takes the general path, which names the
  problem)."""
  if mode not in (JOINT, SPARSE):
    return None
  err, digests = _APPLIERS[bool(joint.QUAD)](mode, np.frombuffer(section, np.uint8),
                                             out.size, base, out, read_only(ends), fn)
  return digests if err == OK else None


# ---- a whole update of packs in one call ---------------------------------------------------

@numba.njit(inline="always", **_JIT)
def _columns(mode, nbytes, digests, k, hash_old, modes, lengths, sums, bases, at):
  """A coded pack's members' columns (listing order, from position `at`): the head's mode
  and section length, PACKED and none for the rest (all UNCHANGED where it is), their
  checksums and, where hash_old, their bases'."""
  for j in range(k):
    modes[at + j] = mode if j == 0 or mode == UNCHANGED else PACKED
    lengths[at + j] = nbytes if j == 0 else 0
    sums[at + j] = digests[0, j]
    if hash_old:
      bases[at + j] = digests[1, j]


@numba.njit(inline="always", **_JIT)
def _code_update(fn, hash_old, p0, p1, two, perm, fixed, codes, dims, fmt, flags, version,
                 base_version, base_sums, printed, width, bits0, listed0, bits1, listed1):
  """The packs p0 and (where `two`) p1 coded (_code) and the message's meta and seals
  written (fields.fields), in one call: a small model's whole update. p: (old, new, probe,
  rest, windows, plan, room, section, ends, gaps, syms, raw) of encode()'s scratch; perm:
  the listing position (p0's members, then p1's) of each tensor in header order;
  base_sums: the bases' checksums in header order where not hash_old; printed: the
  fingerprints in header order (empty: none). Returns (False, ...) where a pack takes the
  general path or has nothing to share; else (True, fields' out, meta end, seals end,
  seal ends, columns: modes | section lengths | checksums in header order (uint64), p0's
  section, p1's section (empty where one), both heads' modes)."""
  n = perm.size
  mode0, nb0, sec0, dig0 = coder_chosen((bits0, listed0), (
      p0[0], p0[1], p0[2], p0[3], p0[4], p0[5], p0[6], p0[7], p0[8], hash_old, fn, p0[9],
      p0[10], p0[11]))
  mode1, nb1, sec1, dig1 = mode0, 0, sec0[:0], dig0[:, :0]
  if two:
    mode1, nb1, sec1, dig1 = coder_chosen((bits1, listed1), (
        p1[0], p1[1], p1[2], p1[3], p1[4], p1[5], p1[6], p1[7], p1[8], hash_old, fn, p1[9],
        p1[10], p1[11]))
  if mode0 == GENERAL or mode0 == RAW or mode1 == GENERAL or mode1 == RAW:
    return (False, sec0, 0, 0, (0, 0, 0, 0), dig0[0], sec0, sec1, mode0, mode1)
  k0 = p0[8].size
  lm, ll = np.empty(n, np.int64), np.empty(n, np.int64)
  ls, lb = np.empty(n, np.uint64), np.empty(n, np.uint64)
  _columns(mode0, nb0, dig0, k0, hash_old, lm, ll, ls, lb, 0)
  if two:
    _columns(mode1, nb1, dig1, n - k0, hash_old, lm, ll, ls, lb, k0)
  modes = np.empty(n, np.uint8)
  lengths = np.empty(n, np.int64)
  cols = np.empty(3 * n, np.uint64)
  digests = np.empty(3 * n + 2 + printed.size, np.uint64)  # results | bases | sections | fp
  s = 0
  for i in range(n):
    j = perm[i]
    modes[i], lengths[i] = lm[j], ll[j]
    cols[i], cols[n + i], cols[2 * n + i] = lm[j], ll[j], ls[j]
    digests[i] = ls[j]
    digests[n + i] = lb[j] if hash_old else base_sums[i]
    if ll[j]:  # a head's section, in header order
      head = sec0 if j == 0 else sec1
      digests[2 * n + s] = call_hash(fn, head.ctypes.data, ll[j])
      s += 1
  digests[2 * n + s:2 * n + s + printed.size] = printed
  counts = (n, n, s, printed.size if printed.size else -1)
  out, meta_end, sealed_end, ends = fields.fields(
      fn, fmt, flags, version, base_version, fixed, codes, modes, dims, lengths,
      digests[:2 * n + s + printed.size], counts, width)
  return (True, out, meta_end, sealed_end, ends, cols, sec0[:nb0], sec1[:nb1], mode0, mode1)


def encode_update(packs_bits: list, frame: "Frame", hash_old: bool, fn: int, fmt: int,
                  flags: int, version: int, base_version: int, base_sums: np.ndarray,
                  printed: np.ndarray, width: int):
  """A delta of one or two packs and nothing else (packs_bits: (old, new) of each, their
  members' unsigned bits back to back; frame: the layout's update_frame) in one compiled
  call: the packs coded (encode()'s choices and bytes) and the message's meta and seals
  written (fields.fields); see _code_update for the rest. None where a pack takes the
  general path or has nothing to share (its members are then coded alone)."""
  code = _UPDATE_CODERS.get(frame.key)
  if code is None:
    code = _UPDATE_CODERS[frame.key] = _update_coder_for(*frame.key)
  (old0, new0), (old1, new1) = packs_bits[0], packs_bits[-1]
  done = code(fn, hash_old, old0, new0, old1, new1, frame.consts,
              scratch.raw("update frame", frame.scratch_bytes), fmt, flags,
              version, base_version, base_sums, printed, width)
  return done if done[0] else None


class Frame(typing.NamedTuple):
  """What encode_update's call takes of a layout beyond the packs' bits: one read-only
  uint8 array (consts: a table of where each piece lies, then the pieces) and the size of
  the per-thread scratch its pieces are cut from. One array each way, where two dozen
  separate arrays cost tens of microseconds to pass when the caches are cold."""
  key: tuple  # (lane bits of each pack (0: none), their ways): the compiled coder's
  consts: np.ndarray
  scratch_bytes: int


_PIECES = 10  # consts' pieces: probe, rest, ends of pack 0, the same of pack 1, perm,
# fixed, codes, dims
_SCRATCH = 6  # scratch pieces a pack: plan gaps, stream room, section, gaps, syms, raw
_TABLE = 2 * (_PIECES + 2 * _SCRATCH) + 2  # (byte offset, bytes) of each, 2 window counts
_TABLE_BYTES = -(-8 * _TABLE // 64) * 64


def update_frame(packs: list, perm: np.ndarray, columns: tuple) -> Frame:
  """encode_update's Frame of a layout whose packs are `packs` ((elements, itemsize,
  member ends) of each, one or two), with perm and columns (fixed, codes, dims) as
  _code_update takes them. A lone pack is both pack 0 and pack 1 (one scratch)."""
  bits = tuple(8 * itemsize for _, itemsize, _ in packs) + (0,) * (2 - len(packs))
  key = (*bits, joint.LISTING[bits[0]], joint.LISTING[bits[1] or 8])
  table = np.zeros(_TABLE, np.int64)
  pieces, at = [], 0
  for j, (n, itemsize, ends) in enumerate(packs):
    probe, rest, windows, specs = _plan_of(n, itemsize)
    pieces += [probe, rest, np.asarray(ends, np.int64)]
    table[_TABLE - 2 + j] = windows
    for i, (size, dtype) in enumerate(specs):
      nbytes = size * np.dtype(dtype).itemsize
      table[2 * (_PIECES + _SCRATCH * j + i):][:2] = at, nbytes
      at += -(-nbytes // 64) * 64
  if len(packs) == 1:
    pieces *= 2
    table[2 * (_PIECES + _SCRATCH):][:2 * _SCRATCH] = table[2 * _PIECES:][:2 * _SCRATCH]
    table[_TABLE - 1] = table[_TABLE - 2]
  pieces += [np.asarray(perm, np.int64), *columns]
  body, pos = [], _TABLE_BYTES
  for i, piece in enumerate(pieces):
    raw = np.ascontiguousarray(piece).view(np.uint8).reshape(-1)
    table[2 * i:2 * i + 2] = pos, raw.size
    body.append(np.pad(raw, (0, -raw.size % 64)))
    pos += body[-1].size
  head = np.zeros(_TABLE_BYTES, np.uint8)
  head[:8 * _TABLE] = table.view(np.uint8)
  return Frame(key, read_only(np.concatenate([head, *body])), max(at, 1))


@numba.njit(inline="always", **_JIT)
def _piece(at, table, i):
  """Entry i of the frame table (consts' pieces, then the scratch's) as bytes of `at`."""
  return at[table[2 * i]:table[2 * i] + table[2 * i + 1]]


@numba.njit(inline="always", **_JIT)
def _pack_args(consts, table, scr, j, old, new):
  """Pack j's (old, new, probe, rest, windows, plan, room, section, ends, gaps, syms, raw),
  _code's arguments, from the frame (consts, its table) and the scratch scr."""
  s = _PIECES + _SCRATCH * j
  return (old, new, _piece(consts, table, 3 * j).view(np.int64),
          _piece(consts, table, 3 * j + 1).view(np.int64), table[_TABLE - 2 + j],
          _piece(scr, table, s).view(np.uint64), _piece(scr, table, s + 1).view(np.uint64),
          _piece(scr, table, s + 2), _piece(consts, table, 3 * j + 2).view(np.int64),
          _piece(scr, table, s + 3).view(np.uint32), _piece(scr, table, s + 4),
          _piece(scr, table, s + 5).view(np.uint64))


def _update_coder_for(bits0: int, bits1: int, listed0: int, listed1: int):
  """_code_update compiled for packs of bits0 and bits1 (0: one pack) lane bits, listed
  the ways listed0 and listed1 (joint.WAYS), taking its layout's Frame."""
  two = bool(bits1)

  @numba.njit(**_JIT)
  def code_update(fn, hash_old, old0, new0, old1, new1, consts, scr, fmt, flags, version,
                  base_version, base_sums, printed, width):
    table = consts[:8 * _TABLE].view(np.int64)
    perm = _piece(consts, table, 6).view(np.int64)
    return _code_update(fn, hash_old, _pack_args(consts, table, scr, 0, old0, new0),
                        _pack_args(consts, table, scr, 1, old1, new1), two, perm,
                        _piece(consts, table, 7),
                        _piece(consts, table, 8).reshape((perm.size, 4)),
                        _piece(consts, table, 9), fmt, flags, version, base_version,
                        base_sums, printed, width, bits0, listed0, bits1 or 8, listed1)
  return code_update


_UPDATE_CODERS: dict = {}  # (lane bits of each pack (0: none), their ways) -> coder
