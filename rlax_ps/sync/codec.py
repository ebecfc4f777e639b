"""encode / apply over flat dicts of name -> array, in the bf16 or int8 format."""

import collections.abc
import functools
import itertools
import math
import operator
import typing

import numpy as np

from rlax_ps.sync import arena, int8, pack_coder, packs, parallel, scratch, tensor_codec
from rlax_ps.sync.bits import (BF16, UINT_OF, bit_view, is_float_dtype, read_only, round_into,
                             to_bf16)
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.fingerprints import of_state as host_fingerprints
from rlax_ps.sync.integrity import XXH3, checksum
from rlax_ps.sync.wire import (FINGERPRINTED, FORMATS, LOCATOR_BITS, SECTION_CODEC_VERSION,
                               Checksums, Update, layout_columns, build_columns, check_names,
                               finish)


def held_state(params: dict, fmt: str) -> dict[str, np.ndarray]:
  """What a worker holds for `params` in `fmt`: bf16 arrays, or the int8 layout of int8.py.

  Accepts float weights (rounded or quantized here, into one buffer whose packs lie back
  to back: arena.py) or an already-held state (its arrays as they are, in a new dict)."""
  held = _held(params, fmt)[0]
  return dict(held) if held is params else held


def spare_state(held: dict) -> dict[str, np.ndarray]:
  """A new held state of `held`'s names, shapes and dtypes, in one arena of its own and
  zero-filled (its pages touched once): the other half of a double buffer, for
  apply(..., out=spare). As a state made here, a small model's apply decodes straight
  into it (arena.py's record)."""
  arrays = {name: np.asarray(a) for name, a in held.items()}
  spare = arena.held_arena({n: a.shape for n, a in arrays.items()},
                           {n: a.dtype for n, a in arrays.items()})
  for a in spare.values():
    a.fill(0)
  return spare


def _held(params: dict, fmt: str, contiguous: bool = True,
          like: tuple | None = None) -> tuple[dict[str, np.ndarray], tuple, tuple | None]:
  """(held_state(params, fmt), its layout key: (name, shape, dtype) per tensor, its packs'
  spans where arena.py recorded the state whole, else None). A held state's checks depend
  on that key alone, and are made once per key. Not `contiguous`: held bf16 arrays may be
  strided views (encode reads their bits through bit_view). like: the key of a state just
  held (a target's, for its base): where params' key equals it, that key is returned and
  its checks are not looked up again."""
  recorded = arena.state_record(params) if type(params) is dict else None
  if recorded is not None:  # a state made here, as it was made: no array is read
    arrays, (key, spans) = params, recorded
  else:
    spans = None
    if set(map(type, params.values())) == _NUMPY and type(params) is dict:
      arrays = params  # already numpy: no new dict
    else:
      arrays = {name: np.asarray(x) for name, x in params.items()}
    key = tuple(zip(arrays, map(_SHAPE, arrays.values()), map(_DTYPE, arrays.values())))
  if key is like or key == like:
    key = like
  kind = _held_kind(key, fmt)
  if kind == "float":
    if fmt == "int8":
      held = int8.quantize_params(arrays)
    else:
      held = arena.held_arena({name: a.shape for name, a in arrays.items()},
                              dict.fromkeys(arrays, BF16))
      for name, a in arrays.items():
        round_into(held[name], a)
    return (held, *arena.state_record(held))
  if fmt == "int8" or (kind == "bf16" and (
      spans is not None or not contiguous or all([a.flags.c_contiguous
                                                  for a in arrays.values()]))):
    return arrays, key, spans
  held = {name: to_bf16(name, a) for name, a in arrays.items()}  # partly float: rounded
  return held, tuple((n, a.shape, a.dtype) for n, a in held.items()), None


_NUMPY = {np.ndarray}
_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")  # of an array
_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")
_ARRAYS, _SUMS = operator.itemgetter(0), operator.itemgetter(1)  # of a task's columns


def _last_cached(fn):
  """fn (lru-cached) that first compares its arguments with the last call's: a model's
  layout key repeats from update to update, and equal tuples of the same names, shape ints
  and dtype objects compare faster than a tuple of tens of tensors hashes."""
  cached = functools.lru_cache(maxsize=64)(fn)
  last = [((), None)]  # (args, result) of the last call, replaced whole (threads)

  def call(*args):
    seen, result = last[0]
    if seen == args:
      return result
    result = cached(*args)
    last[0] = args, result
    return result
  call.cache_clear = cached.cache_clear
  return functools.wraps(fn)(call)


@_last_cached
def _held_kind(key: tuple, fmt: str) -> str:
  """Whether a state of layout key `key` is "float" (weights to round or quantize), "bf16"
  (bf16 weights only: held as they are) or "held" (int8, or partly bf16: the rest is
  rounded), after checking what that key decides (dtypes, int8 scales' names and shapes)."""
  if fmt == "bf16":
    if all(d == BF16 for _, _, d in key):
      return "bf16"
    if any(d == BF16 for _, _, d in key):  # partly held: the float ones are rounded
      return "held"
  elif any(d == int8.INT8 for _, _, d in key):
    int8.check_layout({n: (shape, d) for n, shape, d in key})
    return "held"
  for name, _, d in key:
    if not is_float_dtype(d):
      raise CodecError(f"tensor {name!r}: dtype expected a floating type, got {d}")
  return "float"


def encode(base, target, fmt: str = "bf16", *, version: int,
           base_version: int | None = None, base_checksums: dict | None = None,
           fingerprints: dict | bool | None = None, threads: int | None = None) -> Update:
  """The update taking `base` (None: a keyframe) to `target`, recorded as `version`.

  `target` holds float weights (numpy or jax; int8 also accepts a held state); `base`
  likewise (float weights are rounded/quantized deterministically, exactly as `target`
  was at its version). `base_version` defaults to version - 1 for a delta.
  `base_checksums`: name -> checksum of each base tensor as the update that made the base
  recorded it (`Update.checksums` of the publisher's previous update); the base is then not
  hashed again (a pass over it saved). They are trusted into the base seal: wrong ones
  make in-place applies (which check the base first) fail with a wrong-base CodecError;
  copying applies check their results only. Neither ever yields wrong weights.
  `fingerprints`: seal the results' device fingerprints too (fingerprints.py), so that
  workers on accelerators check their weights without pulling them: name -> fingerprint
  of every target tensor as held (rlax_ps.sync.device.fingerprints_of of the held state on
  the publisher's devices: no host pass), or True to compute them here (one more pass
  over the target); None (default): no fingerprint seal (a few bytes less).
  `threads`: tensors coded side by side (parallel.py; None: the host's cores, at most 8);
  the bytes do not depend on it."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt expected one of {FORMATS}, got {fmt!r}")
  threads = parallel.resolve(threads)
  if base is None:
    if base_version is not None:
      raise ValueError(f"base_version must be None for a keyframe, got {base_version}")
  elif base_version is None:
    base_version = version - 1
  if version < 0 or (base_version is not None and not 0 <= base_version < version):
    raise ValueError(f"versions must satisfy 0 <= base_version < version, got "
                     f"base_version={base_version}, version={version}")
  if base_checksums is not None and base is None:
    raise ValueError("base_checksums given for a keyframe (base is None)")
  if not len(target):
    raise ValueError("target: expected at least one tensor, got none")
  new_state, new_key, new_spans = _held(target, fmt, contiguous=False)
  old_state = old_spans = None
  lay = _layout(new_key)
  if base is not None:
    old_state, old_key, old_spans = _held(base, fmt, contiguous=False, like=new_key)
    if old_key is not new_key:  # (the same key: the same names, shapes and dtypes)
      check_names("base", old_state, new_state)
      for name, new in new_state.items():
        old = old_state[name]
        if old.shape != new.shape or old.dtype != new.dtype:
          raise CodecError(f"tensor {name!r}: base is {old.dtype}{list(old.shape)}, target "
                           f"is {new.dtype}{list(new.shape)}")
  known = base_checksums is not None
  base_sums = _base_column(base_checksums, lay) if known else None
  printed = _fingerprints_of(fingerprints, new_state, threads)
  if old_state is not None and lay.packed and XXH3:  # a small model: one compiled call
    update = _encode_packed(old_state, new_state, lay, fmt, version, base_version,
                            base_sums, printed, None if old_spans is None or new_spans is None
                            else (old_spans, new_spans))
    if update is not None:
      return update
  pack_list = () if old_state is None else lay.pack_list
  tasks = [(size, functools.partial(_encode_pack, old_state, new_state, members, ends,
                                    not known)) for members, ends, size in pack_list]
  alone = lay.names if old_state is None else lay.alone
  for name in alone:
    old = None if old_state is None else bit_view(old_state[name])
    tasks.append((new_state[name].size, functools.partial(
        _encode_alone, old, bit_view(new_state[name]), not known)))
  # every task's columns (modes, sections, checksums, base checksums), joined in the order
  # of the tasks (the packs' members, then the rest), then put in header order by a gather
  results = parallel.run(tasks, threads)
  made = {}
  for i, ((members, _, _), done) in enumerate(zip(pack_list, results)):
    if done is None:  # a pack with nothing to share: its members are coded alone
      results[i] = _joined([_encode_alone(bit_view(old_state[n]), bit_view(new_state[n]),
                                          not known) for n in members])
    elif done[0][0] != tensor_codec.UNCHANGED:
      made[members[0]] = members
  modes, sections, sums, base_sum_list = _joined(results) if old_state is None else map(
      lay.order, _joined(results))
  return build_columns(fmt, version, base_version, lay.layout, sums,
                       base_sums.tolist() if known else base_sum_list,
                       modes, sections, made,
                       None if printed is None else [printed[name] for name in lay.names])


def _encode_packed(old_state: dict, new_state: dict, lay: "_Layout", fmt: str, version: int,
                   base_version: int, base_sums: np.ndarray | None,
                   printed: dict | None, spans: tuple | None = None) -> Update | None:
  """The delta of a state whose every tensor is in one of at most two packs (a small
  model's) in one compiled call (pack_coder.encode_update: the packs coded as encode codes
  them, the meta and seals written): the same message as the general path, which takes
  over (None) where a pack does not code there or has nothing to share. spans: (old, new)
  packs' spans, where arena.py recorded both states whole."""
  packs_bits = list(zip(*spans)) if spans else [
      (_pack_bits(take(old_state), "pack old", i), _pack_bits(take(new_state), "pack new", i))
      for i, take in enumerate(lay.takes)]
  names = lay.names
  done = pack_coder.encode_update(
      packs_bits, lay.frame, base_sums is None, XXH3, FORMATS.index(fmt),
      0 if printed is None else FINGERPRINTED, version, base_version,
      _NO_SUMS if base_sums is None else base_sums,
      _EMPTY if printed is None else read_only(np.array(
          list(map(printed.__getitem__, names)), np.uint64)), LOCATOR_BITS // 8)
  if done is None:
    return None
  _, out, meta_end, sealed_end, ends, cols, first, second, *heads = done
  n = len(names)
  made = {}
  for (members, _, _), mode in zip(lay.pack_list, heads):  # (no comprehension's frame)
    if mode != tensor_codec.UNCHANGED:
      made[members[0]] = members
  update = finish(fmt, version, base_version, lay.columns, cols[:n], cols[n:2 * n], out,
                  meta_end, sealed_end, ends,
                  [first, second] if lay.heads_in_order else [second, first], made)
  update.checksums = Checksums(names, cols[2 * n:])
  if printed is not None:
    update.fingerprints = {name: printed[name] for name in names}
  return update


_EMPTY = read_only(np.zeros(0, np.uint64))  # read-only, as the fingerprints it stands in for
_NO_SUMS = np.zeros(0, np.uint64)  # writable, as the base checksum columns it stands in for


def _base_column(given, lay: "_Layout") -> np.ndarray:
  """encode's base_checksums as a uint64 column in header order (read by compiled code,
  never written): an encoder's Checksums of the same names as it is, else looked up name
  by name (CodecError naming a missing or extra tensor, or a value that is not an int in
  [0, 2**64))."""
  if type(given) is Checksums and (given.names is lay.names or given.names == lay.names):
    return given._column
  if not isinstance(given, collections.abc.Mapping):
    raise ValueError(f"base_checksums: expected a mapping of name -> checksum, got "
                     f"{type(given).__name__}")
  check_names("base_checksums", given, lay.sizes)
  return np.array(_u64s("base checksum", lay.names, map(given.__getitem__, lay.names)),
                  np.uint64)


def _u64s(what: str, names, values) -> list[int]:
  """values (one a name) as ints, after checking each is an int in [0, 2**64)
  (CodecError naming the tensor and `what` it is)."""
  out = []
  for name, value in zip(names, values):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
        0 <= int(value) < 1 << 64):
      raise CodecError(f"tensor {name!r}: {what} expected an int in [0, 2**64), "
                       f"got {value!r}")
    out.append(int(value))
  return out


def _joined(columns: list) -> tuple:
  """Column sets (modes, sections, checksums, base checksums) joined end to end."""
  return tuple(map(list, map(itertools.chain.from_iterable, zip(*columns))))


def _encode_alone(old: np.ndarray | None, new: np.ndarray, hash_old: bool) -> tuple:
  """A tensor coded alone (tensor_codec.encode_section) as one-tensor columns: ([mode],
  [section], [checksum], [base checksum or None])."""
  enc = tensor_codec.encode_section(old, new, (hash_old, True))
  return [enc.mode], [enc.section], [enc.checksum], [enc.base_checksum]


def _fingerprints_of(given, state: dict, threads: int) -> dict | None:
  """encode's `fingerprints` argument as name -> int for every tensor of the held `state`
  (None: no seal), after checking a given dict's names and values."""
  if given is None or given is False:
    return None
  if given is True:
    return host_fingerprints(state, threads)
  if not isinstance(given, dict):
    raise ValueError(f"fingerprints: expected a dict, True or None, got {type(given).__name__}")
  check_names("fingerprints", given, state)
  return dict(zip(given, _u64s("fingerprint", given, given.values())))


class _Layout(typing.NamedTuple):
  """What encode and apply need of a held state's names, shapes and dtypes alone (the same
  for every update of a model, hence cached)."""
  key: tuple  # (name, shape, dtype) of each tensor, as the state listed them
  layout: tuple  # the same with np.dtype dtypes and int shapes: the header's
  names: tuple
  sizes: dict  # name -> elements
  dtypes: dict  # name -> dtype
  groups: dict  # dtype -> pack members (packs.members_by_dtype)
  pack_list: tuple  # per pack: (members, where each ends in it (int64, read-only), elements)
  ends_of: dict  # pack head -> where each member ends in it
  alone: tuple  # the tensors of no pack
  order: callable  # header order of a delta's columns, listed packs' members then alone
  packed: bool  # every tensor in one of at most two packs (encode's one compiled call)
  perm: np.ndarray  # each tensor's listing position (packs' members then alone), read-only
  heads_in_order: bool  # the first pack's head precedes the second's in header order
  columns: tuple  # wire's header columns of the layout
  shape_dtypes: list  # (shape, dtype) of each tensor, header order (apply's base check)
  cuts: tuple  # per pack: (arena.offsets of its members, their shapes, their dtype)
  frame: pack_coder.Frame | None  # where packed: what encode's one call takes of it
  takes: tuple  # per pack: state -> its members' arrays, in order (one C-level lookup)
  pieces: tuple  # per pack: (elements, dtype), as arena.spans takes them
  anchor: int  # where a state's record hangs (arena.anchor_of)


@_last_cached
def _layout(key: tuple) -> _Layout:
  key = arena.interned(key)
  sizes = {n: math.prod(shape) for n, shape, _ in key}
  dtypes = {n: d for n, _, d in key}
  groups = packs.members_by_dtype(sizes, dtypes)
  packed = {n for members in groups.values() for n in members}
  ends = tuple(read_only(np.cumsum([sizes[n] for n in m], dtype=np.int64))
               for m in groups.values())
  listed = [n for m in groups.values() for n in m] + [n for n in sizes if n not in packed]
  at = {n: i for i, n in enumerate(listed)}
  perm = np.array([at[n] for n in sizes], np.int64)  # listing position in header order
  position = {n: i for i, n in enumerate(sizes)}
  heads = [position[m[0]] for m in groups.values()] or [0]
  # the header's form (int shapes, np.dtype dtypes): most often the key itself, so that
  # updates' headers, this layout and held states' records share one key object
  header = arena.interned(
      tuple((n, tuple(int(d) for d in shape), np.dtype(dtype)) for n, shape, dtype in key))
  shapes = {n: shape for n, shape, _ in header}
  columns = layout_columns(header, SECTION_CODEC_VERSION)
  one_call = len(packed) == len(sizes) and 0 < len(groups) <= 2
  frame = pack_coder.update_frame(
      [(int(e[-1]), np.dtype(dtypes[m[0]]).itemsize, e) for m, e in zip(groups.values(), ends)],
      perm, columns[:3]) if one_call else None
  return _Layout(key, header,
                 tuple(sizes), sizes, dtypes, groups,
                 tuple((m, e, int(e[-1])) for m, e in zip(groups.values(), ends)),
                 {m[0]: e for m, e in zip(groups.values(), ends)},
                 tuple(n for n in sizes if n not in packed), _order_of(perm.tolist()),
                 one_call, read_only(perm), heads[0] <= heads[-1], columns,
                 [(shape, dtype) for _, shape, dtype in header],
                 tuple((arena.offsets(tuple(shapes[n] for n in m),
                                      np.dtype(dtypes[m[0]]).itemsize),
                        tuple(shapes[n] for n in m), dtypes[m[0]]) for m in groups.values()),
                 frame,
                 tuple(operator.itemgetter(*m) if len(m) > 1 else _one(m[0])
                       for m in groups.values()),
                 tuple((int(e[-1]), dtypes[m[0]]) for m, e in zip(groups.values(), ends)),
                 arena.anchor_of(tuple(sizes), groups.values()))


def _one(name: str):
  """state -> (state[name],): itemgetter's tuple of a one-member pack."""
  return lambda state: (state[name],)


def _order_of(perm: list):
  """The gather (an itemgetter, to a tuple) that puts a delta's columns, listed as encode
  lists them (each pack's members, then the tensors of no pack), in header order (perm:
  each tensor's listing position)."""
  if len(perm) == 1:
    return lambda column: (column[0],)
  return operator.itemgetter(*perm)  # to a tuple


def _encode_pack(old_state: dict, new_state: dict, members: list[str], ends: np.ndarray,
                 hash_old: bool) -> tuple | None:
  """The columns (modes, sections, checksums, base checksums: None unless hash_old) of the
  members of one pack (packs.py; member j ending at element ends[j]): each unchanged when
  none changed; None when the pack has nothing to share."""
  enc = tensor_codec.encode_pack(_pack_bits([old_state[n] for n in members], "pack old"),
                                 _pack_bits([new_state[n] for n in members], "pack new"),
                                 ends, hash_old)
  if enc is None:
    return None
  mode, section, sums, base_sums = enc
  k = len(members)
  if mode == tensor_codec.UNCHANGED:  # every member as it was: no pack, nothing rescanned
    return [mode] * k, [b""] * k, sums, sums if hash_old else [None] * k
  return ([mode] + [tensor_codec.PACKED] * (k - 1), [section] + [b""] * (k - 1), sums,
          base_sums or [None] * k)


def _pack_bits(arrays, slot: str, i: int = 0) -> np.ndarray:
  """A pack's members' unsigned bits as one flat array: their span where they lie back to
  back (arena.py), else concatenated into this thread's scratch buffer `slot` (of pack i)."""
  span = arena.span_of(arrays)
  if span is not None:
    return span
  bits = [bit_view(a) for a in arrays]
  out = scratch.buffer(f"{slot} {i}", sum(b.size for b in bits), bits[0].dtype)
  return np.concatenate(bits, out=out)


def apply(base, update: Update, *, base_version: int | None = None,
          inplace: bool = False, out: dict | None = None,
          threads: int | None = None) -> dict[str, np.ndarray]:
  """The held state `update` makes of `base` (ignored for a keyframe; may be None), verified
  bit for bit against the update's seals (errors name the tensor). With `base_version`,
  also checks that the update applies to that version.

  The new arrays share one buffer (one allocation, a few page faults), freed once none of
  them is referenced. inplace=True writes into the base's (writable, C-contiguous numpy)
  arrays and returns them instead: only changed elements are written, at the price that a
  failed result check (a corrupted update behind valid digests) leaves tensors damaged, to
  be replaced from a keyframe. Every base tensor is checked against the base seal before
  anything is written. out: a spare held state (writable C-contiguous numpy arrays of the
  update's names, shapes and dtypes, sharing no memory with the base) to write the result
  into and return, e.g. the half of a double buffer not in use: no allocation and no page
  faults. `threads`: tensors applied side by side (parallel.py; None: the host's cores, at
  most 8)."""
  if not isinstance(update, Update):
    raise TypeError(f"update expected an Update, got {type(update).__name__}")
  threads = parallel.resolve(threads)
  names = list(update.tensors)
  if out is not None and inplace:
    raise CodecError("apply: pass inplace=True or out, not both")
  lay = None if update.is_keyframe else _layout(update.layout)
  base_spans = None if lay is None else _recorded_spans(base, lay)
  out_spans = (_recorded_out(out, lay, base_spans)
               if out is not None and lay is not None and lay.packed and XXH3 else None)
  out_slots = None if out is None or out_spans is not None else _out_slots(out, update, base)
  if update.is_keyframe:
    slots = _result_slots(update, out_slots)[0]
    tasks = [(meta.size, functools.partial(_apply_one, update, name, None, slots[name]))
             for name, meta in update.tensors.items()]
    done = parallel.run(tasks, threads)
    update.check_results([sums[0] for _, sums in done])
    return {name: arrays[0] if out is None else out[name]
            for name, (arrays, _) in zip(names, done)}
  if base is None:
    raise CodecError(f"update is a delta from version {update.base_version}; a base is required")
  if base_version is not None and base_version != update.base_version:
    raise CodecError(f"wrong base version: update applies to {update.base_version}, "
                     f"base is {base_version}")
  if base_spans is not None:  # a state made here (arena.py), of the update's layout
    held = base
  else:
    check_names("base", base, update.tensors)
    numpy = type(base) is dict and set(map(type, base.values())) == _NUMPY
    held = base if numpy else {name: np.asarray(base[name]) for name in names}
    if list(map(_SHAPE_DTYPE, map(held.__getitem__, names))) != lay.shape_dtypes:
      held = {name: update.check_base(name, held[name]) for name in names}  # names the misfit
  if lay.packed and not inplace and (out is None or out_spans is not None) and XXH3:
    result = _apply_packed(held, update, lay, base_spans, out_spans)
    if result is not None:
      return result if out is None else dict(out)
    if out_spans is not None:  # the general path writes `out` through per-tensor slots
      out_slots = _out_slots(out, update, base)
  base_digests = None
  if inplace:
    for name in names:
      if not (isinstance(base[name], np.ndarray) and base[name].flags.c_contiguous
              and base[name].flags.writeable):
        raise CodecError(f"tensor {name!r}: inplace apply needs a writable C-contiguous "
                         f"numpy array, got {type(base[name]).__name__}")
    base_digests = parallel.run(
        [(held[n].size, functools.partial(checksum, held[n])) for n in names], threads)
    update.check_bases(base_digests)
  slots, spans = (None, {}) if inplace else _result_slots(update, out_slots)
  metas = update.tensors
  # every task's (new arrays, their xxh3) in the order of lay.order's listing (each pack's
  # members, as one task where the update made the pack, else one a member; then the rest)
  tasks, kept = [], {} if base_digests is None else dict(zip(names, base_digests))

  def alone(name):
    if inplace and metas[name].mode == "unchanged":
      return 0, functools.partial(_held_as_it_is, base[name], kept[name])
    return metas[name].size, functools.partial(_apply_one, update, name, held[name],
                                               None if inplace else slots[name])

  for members, _, size in lay.pack_list:
    if update.pack(members[0]) is not None:
      tasks.append((size, functools.partial(_apply_pack, update, members, held, slots,
                                            spans.get(members[0]))))
    else:  # not made (nothing to share, or unchanged): its members were coded alone
      tasks.extend(map(alone, members))
  tasks.extend(map(alone, lay.alone))
  done = parallel.run(tasks, threads)
  digests = lay.order(list(itertools.chain.from_iterable(map(_SUMS, done))))
  if not update.header.results.matches(digests):
    if base_digests is None:  # tell a wrong base from a corrupted update
      base_digests = [d if meta.mode == "unchanged" else checksum(held[name])
                      for d, (name, meta) in zip(digests, metas.items())]
      update.check_bases(base_digests)
    update.check_results(digests)
  if inplace or out is not None:
    return {name: (base if inplace else out)[name] for name in names}
  return dict(zip(names, lay.order(list(itertools.chain.from_iterable(map(_ARRAYS, done))))))


def _recorded_spans(state, lay: _Layout) -> tuple | None:
  """The packs' spans of `state` where arena.py recorded it whole with lay's names, shapes
  and dtypes, else None (another layout: apply's checks name the misfit)."""
  recorded = arena.state_record(state) if type(state) is dict else None
  if recorded is None or not (recorded[0] is lay.key or recorded[0] == lay.key):
    return None
  return recorded[1]


def _recorded_out(out, lay: _Layout, base_spans: tuple | None) -> tuple | None:
  """The packs' spans of apply's `out` where both it and the base are states arena.py
  recorded whole, of the update's layout (a delta's), in different arenas (one state's
  own, so no array of one shares memory with the other): written through those spans with
  no per-tensor check (its arrays' writeable flags are not read). None: out is checked
  tensor by tensor (_out_slots)."""
  spans = None if base_spans is None else _recorded_spans(out, lay)
  return None if spans is None or spans[0].base is base_spans[0].base else spans


def _apply_packed(held: dict, update: Update, lay: _Layout, base_spans: tuple | None = None,
                  out_spans: tuple | None = None) -> dict | None:
  """apply's new arrays for a delta of a small model (lay.packed), where the update made
  every pack and coded each joint or sparse: each pack decoded from the base's span (its
  members concatenated where they have none) into its span of one new arena and hashed, in
  one compiled call (pack_coder.apply), then checked against the results seal. None where
  a pack is not made so, a call does not read its section, or the seal does not match: the
  general path then applies it and names any problem. base_spans: the base's packs' spans,
  where arena.py recorded the base whole; the result is recorded so too. out_spans: a
  recorded spare state's packs' spans (_recorded_out) to decode into instead of a new
  arena (returns {} then: the caller returns the spare state)."""
  made, metas = update.packs(), update.tensors
  if len(made) != len(lay.pack_list):
    return None
  heads = [metas[members[0]] for members, _, _ in lay.pack_list]
  if not all(h.name in made and h.mode in _ONE_CALL_MODES for h in heads):
    return None
  spans = arena.spans(lay.pieces) if out_spans is None else out_spans
  data = memoryview(update.to_view())
  sums = []
  for i, ((_, ends, _), take, head, span) in enumerate(zip(lay.pack_list, lay.takes, heads,
                                                           spans)):
    base = None if base_spans is None else base_spans[i]
    if base is None:
      members = take(held)
      base = arena.span_of(members)
      if base is None:
        base = np.concatenate([bit_view(a) for a in members], out=span)
    digests = pack_coder.apply(tensor_codec.MODE_NAMES.index(head.mode),
                               data[head.offset:head.offset + head.nbytes], base, span, ends,
                               XXH3)
    if digests is None:
      return None
    sums.append(digests)
  digests = (sums[0] if len(sums) == 1 else np.concatenate(sums))[lay.perm]
  if not update.header.results.matches(digests):
    return None
  if out_spans is not None:
    return {}
  arrays = []
  for span, (cuts, shapes, dtype) in zip(spans, lay.cuts):
    new = arena.cut(span, cuts, shapes, dtype)
    arena.register(new, span)
    arrays += new
  arrays = lay.order(arrays)
  arena.record_state(lay.names, arrays, lay.anchor, tuple(spans), lay.key)
  return dict(zip(lay.names, arrays))


_ONE_CALL_MODES = ("joint", "sparse")


def _held_as_it_is(array: np.ndarray, digest: int) -> tuple[list, list]:
  """The columns of a tensor an in-place apply leaves as it was."""
  return [array], [digest]


def _result_slots(update: Update, out_slots: dict | None):
  """(name -> where its new array goes, pack head -> the span its members fill back to
  back): the checked `out` arrays (no spans), else a fresh arena (arena.lay_out: slots of
  the tensors in no pack), so that a pack is copied in and decoded as one array."""
  if out_slots is not None:
    return out_slots, {}
  lay = _layout(update.layout)
  return arena.lay_out(lay.sizes, lay.dtypes, update.packs())


def _out_slots(out: dict, update: Update, base) -> dict[str, np.ndarray]:
  """Flat unsigned views of the arrays of `out` (see apply), checked tensor by tensor."""
  check_names("out", out, update.tensors)
  slots = {}
  for name, meta in update.tensors.items():
    a = out[name]
    what = f"tensor {name!r}: out"
    if not (isinstance(a, np.ndarray) and a.flags.c_contiguous and a.flags.writeable):
      raise CodecError(f"{what} must be a writable C-contiguous numpy array, got "
                       f"{type(a).__name__}")
    if a.shape != tuple(meta.shape) or a.dtype != meta.dtype:
      raise CodecError(f"{what} has shape {a.shape} and dtype {a.dtype}, expected "
                       f"{tuple(meta.shape)} and {meta.dtype}")
    if base is not None and name in base and np.shares_memory(a, np.asarray(base[name])):
      raise CodecError(f"{what} shares memory with the base (use inplace=True)")
    slots[name] = bit_view(a).reshape(-1)
  return slots


def _apply_one(update: Update, name: str, old: np.ndarray | None,
               slot: np.ndarray | None) -> tuple[list, list]:
  """([new array], [its xxh3]) of a tensor coded alone: from `old` (None for a keyframe)
  into `slot` (None: in place, into old)."""
  meta = update.tensors[name]
  inplace = slot is None
  bits, got = update.decoded(name).apply(None if old is None else bit_view(old),
                                         UINT_OF[meta.dtype], inplace=inplace, out=slot)
  return [bits.view(meta.dtype).reshape(meta.shape)], [got]


def _apply_pack(update: Update, members: list[str], held: dict, slots: dict | None,
                span: np.ndarray | None = None) -> tuple[list, list]:
  """(new arrays, their xxh3) of a pack's members: in place into the held bases (no
  slots), else into their slots, the bases copied in first; where the slots lie back to
  back in `span`, the bases are copied into it (from their own span if they have one, else
  concatenated) and the pack decoded over it at once."""
  metas = update.tensors
  head = metas[members[0]]
  if XXH3 and head.mode in ("joint", "sparse") and (span is not None or slots is None):
    done = _apply_coded_pack(update, members, held, span)
    if done is not None:
      return done
  decoded = update.decoded(members[0])
  if span is not None:
    base = arena.span_of([held[n] for n in members])
    if base is None:
      np.concatenate([bit_view(held[n]) for n in members], out=span)
    else:
      np.copyto(span, base)
    decoded.add_to(span)
    new = arena.members_of(span, [metas[n].shape for n in members], metas[members[0]].dtype)
    arena.register(new, span)
    return new, tensor_codec.hash_parts(span, _layout(update.layout).ends_of[members[0]])
  olds = [bit_view(held[n]).reshape(-1) for n in members]
  parts = olds if slots is None else [slots[n] for n in members]
  if slots is not None:
    for part, old in zip(parts, olds):
      np.copyto(part, old)
  decoded.apply_parts(parts, packs.starts([a.size for a in olds]))
  return ([part.view(metas[n].dtype).reshape(metas[n].shape) for n, part in
           zip(members, parts)], list(map(checksum, parts)))


def _apply_coded_pack(update: Update, members: list[str], held: dict,
                      span: np.ndarray | None) -> tuple[list, list] | None:
  """_apply_pack of a joint or sparse pack in one compiled call (pack_coder.apply): into
  `span`, the new arena's span of the pack, or, where None (in place), into the held
  bases' own span; None where there is none (bases not back to back) or the call does not
  take the section (the caller then takes the general path, which names any problem)."""
  base = arena.span_of([held[n] for n in members])
  into = base if span is None else span
  if into is None:
    return None
  if base is None:
    np.concatenate([bit_view(held[n]) for n in members], out=span)
    base = span
  head = update.tensors[members[0]]
  section = memoryview(update.to_view())[head.offset:head.offset + head.nbytes]
  digests = pack_coder.apply(tensor_codec.MODE_NAMES.index(head.mode), section, base, into,
                             _layout(update.layout).ends_of[members[0]], XXH3)
  if digests is None:
    return None
  metas = update.tensors
  if span is None:
    new = [held[n] for n in members]
  else:
    new = arena.members_of(span, [metas[n].shape for n in members], head.dtype)
    arena.register(new, span)
  return new, digests.tolist()


def dequantize(held: dict) -> dict[str, np.ndarray]:
  """Float32 weights of a held state of either format."""
  if int8.is_held_int8(held):
    return int8.dequantize_params(held)
  return {name: np.asarray(a).astype(np.float32) for name, a in held.items()
          if np.asarray(a).dtype == BF16}
