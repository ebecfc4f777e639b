"""encode / apply over flat dicts of name -> array, in the bf16 or int8 format."""

import numpy as np

from rlax_ps.sync import int8, tensor_codec
from rlax_ps.sync.bits import BF16, UINT_OF, bit_view, to_bf16
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.wire import FORMATS, Update, base_checksum, build


def held_state(params: dict, fmt: str) -> dict[str, np.ndarray]:
  """What a worker holds for `params` in `fmt`: bf16 arrays, or the int8 layout of int8.py.

  Accepts float weights (rounded or quantized here) or an already-held state."""
  if fmt == "bf16":
    return {name: to_bf16(name, x) for name, x in params.items()}
  if int8.is_held_int8(params):
    return int8.check_held(params)
  return int8.quantize_params(params)


def _check_names(what: str, got: dict, want) -> None:
  missing = [n for n in want if n not in got]
  extra = [n for n in got if n not in want]
  if missing:
    raise CodecError(f"tensor {missing[0]!r}: missing from the {what} "
                     f"({len(missing)} missing in all)")
  if extra:
    raise CodecError(f"tensor {extra[0]!r}: in the {what} but not in the update "
                     f"({len(extra)} extra in all)")


def encode(base, target, fmt: str = "bf16", *, version: int,
           base_version: int | None = None) -> Update:
  """The update taking `base` (None: a keyframe) to `target`, recorded as `version`.

  `target` holds float weights (numpy or jax; int8 also accepts a held state); `base`
  likewise (float weights are rounded/quantized deterministically, exactly as `target`
  was at its version). `base_version` defaults to version - 1 for a delta."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt expected one of {FORMATS}, got {fmt!r}")
  if base is None:
    if base_version is not None:
      raise ValueError(f"base_version must be None for a keyframe, got {base_version}")
  elif base_version is None:
    base_version = version - 1
  if version < 0 or (base_version is not None and not 0 <= base_version < version):
    raise ValueError(f"versions must satisfy 0 <= base_version < version, got "
                     f"base_version={base_version}, version={version}")
  new_state = held_state(target, fmt)
  old_state = None
  if base is not None:
    old_state = held_state(base, fmt)
    _check_names("base", old_state, new_state)
  entries = []
  for name, new in new_state.items():
    old = None
    if old_state is not None:
      old = old_state[name]
      if old.shape != new.shape or old.dtype != new.dtype:
        raise CodecError(f"tensor {name!r}: base is {old.dtype}{list(old.shape)}, target is "
                         f"{new.dtype}{list(new.shape)}")
    enc = tensor_codec.encode_section(None if old is None else bit_view(old), bit_view(new))
    entries.append((name, new.shape, new.dtype, enc.checksum, enc.base_checksum, enc.mode,
                    enc.section))
  return build(fmt, version, base_version, entries)


def apply(base, update: Update, *, base_version: int | None = None,
          inplace: bool = False) -> dict[str, np.ndarray]:
  """The held state `update` makes of `base` (ignored for a keyframe; may be None), verified
  tensor by tensor against the update's checksums. With `base_version`, also checks that
  the update applies to that version.

  inplace=True writes into the base's (writable, C-contiguous numpy) arrays and returns
  them: only changed elements are written, at the price that a failed result checksum
  (a corrupted update behind valid digests) leaves that tensor damaged, to be replaced
  from a keyframe. A wrong base is still detected before anything is written."""
  if not isinstance(update, Update):
    raise TypeError(f"update expected an Update, got {type(update).__name__}")
  if not update.is_keyframe:
    if base is None:
      raise CodecError(f"update is a delta from version {update.base_version}; a base is required")
    if base_version is not None and base_version != update.base_version:
      raise CodecError(f"wrong base version: update applies to {update.base_version}, "
                       f"base is {base_version}")
    _check_names("base", base, update.tensors)
  out = {}
  for name, meta in update.tensors.items():
    dec = update.decoded(name)
    old = None
    if not update.is_keyframe:
      held = update.check_base(name, base[name])
      old = bit_view(held)
    write_into = inplace and not update.is_keyframe
    if write_into:
      if not (isinstance(base[name], np.ndarray) and base[name].flags.c_contiguous
              and base[name].flags.writeable):
        raise CodecError(f"tensor {name!r}: inplace apply needs a writable C-contiguous "
                         f"numpy array, got {type(base[name]).__name__}")
      if base_checksum(held) != meta.base_checksum:
        raise CodecError(f"tensor {name!r}: wrong base: its checksum is "
                         f"{base_checksum(held):08x}, the update was made against "
                         f"{meta.base_checksum:08x}")
    bits, got = dec.apply(old, UINT_OF[meta.dtype], inplace=write_into)
    result = bits.view(meta.dtype).reshape(meta.shape)
    if got != meta.checksum:
      if old is not None and not write_into and base_checksum(held) != meta.base_checksum:
        raise CodecError(f"tensor {name!r}: wrong base: its checksum is "
                         f"{base_checksum(held):08x}, the update was made against "
                         f"{meta.base_checksum:08x}")
      raise CodecError(f"tensor {name!r}: corrupted: result checksum {got:016x}, "
                       f"expected {meta.checksum:016x}")
    out[name] = base[name] if write_into else result
  return out


def dequantize(held: dict) -> dict[str, np.ndarray]:
  """Float32 weights of a held state of either format."""
  if int8.is_held_int8(held):
    return int8.dequantize_params(held)
  return {name: np.asarray(a).astype(np.float32) for name, a in held.items()
          if np.asarray(a).dtype == BF16}
