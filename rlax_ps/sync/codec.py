"""encode / apply over flat dicts of name -> array, in the bf16 or int8 format."""

import functools
from collections.abc import Mapping

import numpy as np

from rlax_ps.sync import int8, parallel, sparse
from rlax_ps.sync.bits import BF16, bit_view, to_bf16
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.fingerprints import of_state as host_fingerprints
from rlax_ps.sync.integrity import checksum
from rlax_ps.sync.wire import (FORMATS, PACKED, RAW, SPARSE, UNCHANGED, Update, build,
                               check_names, message_parts, model_json)

# Tensors of fewer elements share their dtype's pack: one section (and one pair of entropy
# tables) for all the norms, biases and scales of a model.
PACK_MAX = 1 << 16


def held_state(params: dict, fmt: str) -> dict[str, np.ndarray]:
  """What a worker holds for `params` in `fmt`: bf16 arrays, or the int8 layout of int8.py.
  Float weights are rounded or quantized; a held state's arrays are kept as they are."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt expected one of {FORMATS}, got {fmt!r}")
  arrays = {name: np.asarray(x) for name, x in params.items()}
  if fmt == "bf16":
    return {name: to_bf16(name, a) for name, a in arrays.items()}
  if int8.is_held_int8(arrays):
    return int8.check_held(arrays)
  return int8.quantize_params(arrays)


def dequantize(held: dict) -> dict[str, np.ndarray]:
  """Float32 weights of a held state of either format."""
  if int8.is_held_int8(held):
    return int8.dequantize_params(held)
  return {name: np.asarray(a).astype(np.float32) for name, a in held.items()
          if np.asarray(a).dtype == BF16}


def _raw(array: np.ndarray) -> memoryview:
  return memoryview(bit_view(array)).cast("B")


def _diff(old: np.ndarray, new: np.ndarray, base_sum: int | None) -> tuple:
  """(mode, section, result checksum, base checksum, changes) of one tensor of a delta;
  a small tensor's changes are left for its pack (mode PACKED, no section)."""
  base_sum = checksum(old) if base_sum is None else base_sum
  idx, off = sparse.changes(bit_view(old), bit_view(new))
  if not idx.size:
    return UNCHANGED, b"", checksum(new), base_sum, None
  if new.size < PACK_MAX:
    return PACKED, b"", checksum(new), base_sum, (idx, off)
  section = sparse.encode(idx, off)
  if len(section) >= new.nbytes:
    return RAW, _raw(new), checksum(new), base_sum, None
  return SPARSE, section, checksum(new), base_sum, None


def encode(base, target, fmt: str = "bf16", *, version: int,
           base_version: int | None = None, base_checksums: dict | None = None,
           fingerprints: dict | bool | None = None, threads: int | None = None,
           model: dict | None = None) -> Update:
  """The update taking `base` (None: a keyframe) to `target`, recorded as `version`.

  `target` and `base` hold float weights (numpy or jax; rounded or quantized exactly as
  held_state does) or held states. `base_version` defaults to version - 1 for a delta.
  `base_checksums`: name -> checksum of each base tensor as the update that made the base
  recorded them (`Update.checksums`): the base is then not hashed again. Wrong ones make
  in-place applies fail with a wrong-base CodecError; neither path yields wrong weights.
  `fingerprints`: seal the results' device fingerprints too (fingerprints.py): name ->
  fingerprint of every target tensor as held (device.fingerprints_of on the publisher's
  devices), or True to compute them here. `threads`: tensors coded side by side (None: the
  host's cores, at most 8); the bytes do not depend on it. `model`: the publishing model's
  config fields (ModelConfig.forward_fields()), carried in the header for workers to check
  against their own (Update.model)."""
  return build(*_message(base, target, fmt, version, base_version, base_checksums,
                         fingerprints, threads, model))


def keyframe_parts(target, fmt: str = "bf16", *, version: int,
                   fingerprints: dict | bool | None = None,
                   threads: int | None = None, model: dict | None = None) -> list:
  """encode(None, target, ...)'s bytes as a list of buffers: the prefix and header, then
  each tensor's held bytes as a view of its array (of `target`'s own where it is held
  already): a large keyframe written out a part at a time is never held twice."""
  return message_parts(*_message(None, target, fmt, version, None, None, fingerprints,
                                 threads, model))


def _message(base, target, fmt, version, base_version, base_checksums, fingerprints,
             threads, model) -> tuple:
  """The arguments of wire.build / wire.message_parts for encode's update."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt expected one of {FORMATS}, got {fmt!r}")
  for field, value in (("version", version), ("base_version", base_version)):
    if value is not None and (isinstance(value, (bool, np.bool_))
                              or not isinstance(value, (int, np.integer))):
      raise ValueError(f"{field} expected an int, got {value!r}")
  if not isinstance(target, Mapping) or (base is not None and not isinstance(base, Mapping)):
    what, given = ("target", target) if not isinstance(target, Mapping) else ("base", base)
    raise ValueError(f"{what} expected a dict of name -> array, got {type(given).__name__}")
  if base is None:
    if base_version is not None:
      raise ValueError(f"base_version must be None for a keyframe, got {base_version}")
    if base_checksums is not None:
      raise ValueError("base_checksums given for a keyframe (base is None)")
  elif base_version is None:
    base_version = version - 1
  if version >= 1 << 63:
    raise ValueError(f"version: expected below 2**63 (an int64 in every RPC), got {version}")
  if version < 0 or (base_version is not None and not 0 <= base_version < version):
    raise ValueError(f"versions must satisfy 0 <= base_version < version, got "
                     f"base_version={base_version}, version={version}")
  if not len(target):
    raise ValueError("target: expected at least one tensor, got none")
  if model is not None:
    model_json(model)  # ValueError naming `model` before any tensor is coded
  new = held_state(target, fmt)
  names = sorted(new)
  threads = parallel.resolve(threads)
  if base is None:
    tasks = [(new[n].size, functools.partial(checksum, new[n])) for n in names]
    rows = [(RAW, _raw(new[n]), s, None, None) for n, s in zip(names, parallel.run(tasks, threads))]
  else:
    old = held_state(base, fmt)
    check_names("base", old, new)
    for name in names:
      if old[name].shape != new[name].shape or old[name].dtype != new[name].dtype:
        raise CodecError(f"tensor {name!r}: base is {old[name].dtype}{list(old[name].shape)}, "
                         f"target is {new[name].dtype}{list(new[name].shape)}")
    known = {} if base_checksums is None else _u64s("base_checksums", base_checksums, new)
    rows = parallel.run([(new[n].size, functools.partial(_diff, old[n], new[n], known.get(n)))
                         for n in names], threads)
  packs = {} if base is None else _packs(names, new, rows)
  if fingerprints is True:
    fingerprints = host_fingerprints(new, threads)
  elif fingerprints is not None:
    fingerprints = _u64s("fingerprints", fingerprints, new)
  return (fmt, version, base_version,
          [(n, new[n].shape, new[n].dtype, row[0]) for n, row in zip(names, rows)],
          [row[1] for row in rows], packs, [row[2] for row in rows],
          None if base is None else [row[3] for row in rows],
          None if fingerprints is None else [fingerprints[n] for n in names], model)


def _u64s(what: str, given, new: dict) -> dict:
  """`given` (name -> u64 for every tensor of `new`), checked: ValueError unless a mapping,
  CodecError naming a tensor missing, extra or not a u64."""
  if not isinstance(given, dict):
    raise ValueError(f"{what} expected a dict, got {type(given).__name__}")
  check_names(what, given, new)
  for name, value in given.items():
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
        0 <= value < 1 << 64):
      raise CodecError(f"tensor {name!r}: {what} expected a u64, got {value!r}")
  return given


def _packs(names: list, new: dict, rows: list) -> dict:
  """dtype -> the pack section of its PACKED rows (changes over their concatenated
  elements, header order); where raw is smaller, those rows become raw (rows is updated)."""
  packs = {}
  for dtype in {new[n].dtype for n in names}:
    members = [i for i, n in enumerate(names) if rows[i][0] == PACKED and new[n].dtype == dtype]
    if not members:
      continue
    starts = np.cumsum([0] + [new[names[i]].size for i in members])
    idx = np.concatenate([rows[i][4][0] + s for i, s in zip(members, starts)])
    off = np.concatenate([rows[i][4][1] for i in members])
    section = sparse.encode(idx, off)
    if len(section) < starts[-1] * dtype.itemsize:
      packs[dtype] = section
      continue
    for i in members:
      rows[i] = (RAW, _raw(new[names[i]]), *rows[i][2:])
  return packs


def apply(base, update: Update, *, base_version: int | None = None, inplace: bool = False,
          threads: int | None = None) -> dict[str, np.ndarray]:
  """The held state `update` makes of `base` (ignored for a keyframe; may be None), as new
  arrays, verified bit for bit against the update's result seal (errors name the tensor).
  With `base_version`, also checks that the update applies to that version.
  inplace=True writes only the changed elements into the base's (writable, C-contiguous
  numpy) arrays and returns them; every base tensor is first checked against the base
  seal, and a result that fails its check (a corrupted update behind valid digests) leaves
  the state to be replaced from a keyframe. `threads`: tensors side by side."""
  if not isinstance(update, Update):
    raise TypeError(f"update expected an Update, got {type(update).__name__}")
  threads = parallel.resolve(threads)
  if update.header.tensors is None and base is not None:
    update.bind({name: np.asarray(a) for name, a in base.items()})
  names = list(update.tensors)
  if update.is_keyframe:
    def fresh(name):
      array = update.raw(name).copy()
      return array, checksum(array)
    done = parallel.run([(update.tensors[n].size, functools.partial(fresh, n)) for n in names],
                        threads)
    update.check_results([s for _, s in done])
    return {n: a for n, (a, _) in zip(names, done)}
  if base is None:
    raise CodecError(f"update is a delta from version {update.base_version}; a base is required")
  if base_version is not None and base_version != update.base_version:
    raise CodecError(f"wrong base version: update applies to {update.base_version}, "
                     f"base is {base_version}")
  check_names("base", base, update.tensors)
  held = {}
  for name, meta in update.tensors.items():
    a = held[name] = np.asarray(base[name])
    if a.shape != meta.shape or a.dtype != meta.dtype:
      raise CodecError(f"tensor {name!r}: base expected {meta.dtype}{list(meta.shape)}, got "
                       f"{a.dtype}{list(a.shape)}")
    if inplace and not (isinstance(base[name], np.ndarray) and a.flags.c_contiguous
                        and a.flags.writeable):
      raise CodecError(f"tensor {name!r}: inplace apply needs a writable C-contiguous numpy "
                       f"array, got {type(base[name]).__name__}")
  base_sums = None
  if inplace:
    base_sums = parallel.run([(held[n].size, functools.partial(checksum, held[n]))
                              for n in names], threads)
    update.check_bases(base_sums)
  for dtype in update.header.packs:
    update._pack(dtype)  # noqa: SLF001 (decoded once, before the threads share it)

  def patch(i, name):
    mode = update.tensors[name].mode
    if inplace and mode == "unchanged":
      return held[name], base_sums[i]
    if mode == "raw":
      array = update.raw(name).copy()
      if inplace:
        held[name][...] = array
        array = held[name]
    else:
      array = held[name] if inplace else np.array(held[name], order="C")
      if mode != "unchanged":
        sparse.add_at(bit_view(array), *update.sparse_changes(name))
    return array, checksum(array)
  done = parallel.run([(held[n].size, functools.partial(patch, i, n))
                       for i, n in enumerate(names)], threads)
  try:
    update.check_results([s for _, s in done])
  except CodecError:
    if not inplace:  # say so when the base, not the update, is at fault
      update.check_bases([checksum(held[n]) for n in names])
    raise
  return {n: a for n, (a, _) in zip(names, done)}
