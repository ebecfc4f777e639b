"""Per-output-channel symmetric int8 quantization and the int8 held state.

Layout, per float tensor `name` of the trainer:
  * ndim >= 2 and name ends in "embedding" ([V, H] tables): one scale per row (axis 0 kept,
    all other axes reduced): `name` -> int8 codes, `name + ".scale"` -> bf16 scales [V].
  * ndim >= 3 and a path component "experts" (stacked experts [E, in, out]): one scale per
    expert and output channel (axes 0 and -1 kept): `name + ".scale"` -> bf16 scales
    [E, out], so that one expert's weights never set another's step.
  * any other ndim >= 2 tensor (kernels, x @ W with W [in, out]): one scale per output
    channel, the LAST axis (all other axes reduced): `name` -> int8 codes,
    `name + ".scale"` -> bf16 scales [out].
  * ndim < 2 (norm scales, biases), biases of stacked experts (a last component ending in
    "bias", e.g. gpt-oss's [E, out]), LoRA adapters (a last component starting "lora_", what
    a LoRA run trains) and expert routers (a path component "router"): `name` -> bf16, not
    quantized. A router is a sliver of the weights, and int8 steps in
    its logits would send tokens to other experts than the trainer's policy picks.
Quantization is a pure function of the float weights: scale = absmax / 127 rounded UP to
the next bf16 value (bf16 so that a scale changes only when its channel's absmax moves by
more than a bf16 ulp, which keeps int8 deltas sparse; rounded up so that no code clips),
code = round_half_even(w / scale), in [-127, 127], computed exactly in float32 arithmetic
alone (int8_loops.code_f32; the same steps run on device in int8_device.py; float64
weights divide in float64); an all-zero channel has scale 0 and codes 0. Then
|w - code * scale| <= scale / 2 for every element, and dequantized weights are code * scale (exact in float32).
"""

import numpy as np

from rlax_ps.sync import int8_loops
from rlax_ps.sync.bits import BF16, INT8, c_contiguous, is_float_dtype, to_bf16
from rlax_ps.sync.errors import CodecError

SCALE_SUFFIX = ".scale"


def layout(name: str, ndim: int) -> str:
  """"bf16" (not quantized), "rows" (embedding tables), "experts" (stacked expert kernels)
  or "channels_last" (kernels) for a float tensor."""
  parts = name.split(".")
  if (ndim < 2 or "router" in parts or parts[-1].endswith("bias")
      or parts[-1].startswith("lora_")):
    return "bf16"
  if name.endswith("embedding"):
    return "rows"
  return "experts" if ndim >= 3 and "experts" in parts else "channels_last"


def scale_shape(name: str, shape: tuple) -> tuple:
  """Shape of the bf16 scales of a quantized tensor (see the module docstring)."""
  kind = layout(name, len(shape))
  if kind == "rows":
    return (shape[0],)
  return (shape[0], shape[-1]) if kind == "experts" else (shape[-1],)


def broadcast_scales(name: str, ndim: int, scale):
  """Scales reshaped to broadcast against their tensor's codes (numpy or jax arrays)."""
  kind = layout(name, ndim)
  if kind == "rows":
    return scale.reshape((-1,) + (1,) * (ndim - 1))
  if kind == "experts":
    return scale.reshape((scale.shape[0],) + (1,) * (ndim - 2) + (scale.shape[1],))
  return scale


def _ceil_bf16(v: np.ndarray) -> np.ndarray:
  """Smallest bf16 value >= v (float64, v >= 0, finite), elementwise."""
  s = v.astype(np.float32).astype(BF16)
  bits = s.view(np.uint16).copy()
  low = s.astype(np.float64) < v
  bits[low] += 1
  return bits.view(BF16)


def scale_constants(absmax: np.ndarray) -> tuple[np.ndarray, ...]:
  """Per-channel bf16 scales and the float32 constants (f, s, inv, half) of
  int8_loops.code_f32, from float32 absmax values, in float32 arithmetic (with IEEE
  subnormals; int8_device computes the same values without any subnormal operand).

  scale: s0 = bf16(fl(absmax / 127)) is the bf16 just below or just above absmax / 127
  (float32 division errs by far less than half a bf16 ulp); s0 * 127 is exact in float32
  (8 x 7 significant bits), so s0 is the smallest bf16 >= absmax / 127 unless
  s0 * 127 < absmax, and then the next bf16 is. f = 2**(127 - E) for the float32 exponent
  field E of the scale puts s = scale * f in [2**-6, 2) (a zero scale: s = 1, codes 0)."""
  a = absmax.astype(np.float32)
  s0 = (a / np.float32(127)).astype(BF16)
  low = s0.astype(np.float32) * np.float32(127) < a
  scale = (s0.view(np.uint16) + low.astype(np.uint16)).view(BF16)
  bits = scale.view(np.uint16).astype(np.uint32) << 16
  f = ((np.uint32(254) - ((bits >> 23) & np.uint32(0xff))) << 23).view(np.float32)
  s = np.where(bits > 0, bits.view(np.float32) * f, np.float32(1))
  inv = np.float32(1) / s
  return scale, f, s, inv, s * np.float32(0.5)


def quantize_tensor(name: str, x, out: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(int8 codes shaped like x, bf16 scales) of one float tensor of ndim >= 2, written into
  `out` = (codes, scales) when given (C-contiguous, of those shapes and dtypes)."""
  a = np.asarray(x)
  kind = layout(name, a.ndim)
  if kind == "bf16":
    raise CodecError(f"tensor {name!r}: int8 quantization needs ndim >= 2 and no 'router' in "
                     f"the name, got shape {a.shape}")
  if a.dtype not in (np.float32, np.float64, BF16):
    a = a.astype(np.float32)  # float16: exact
  a = c_contiguous(a)
  if out is None:
    out = np.empty(a.shape, INT8), np.empty(scale_shape(name, a.shape), BF16)
  codes, scales = out
  if not a.size:  # nothing to quantize (reshape(-1, 0) cannot say how many rows)
    scales[...] = 0
    return codes, scales
  if kind == "experts":  # each expert's [in, out] matrix on its own
    for e in range(a.shape[0]):
      _quantize_matrix(name, a[e].reshape(-1, a.shape[-1]), False,
                       codes[e].reshape(-1, a.shape[-1]), scales[e])
  elif kind == "rows":
    _quantize_matrix(name, a.reshape(a.shape[0], -1), True, codes.reshape(a.shape[0], -1), scales)
  else:
    _quantize_matrix(name, a.reshape(-1, a.shape[-1]), False, codes.reshape(-1, a.shape[-1]),
                     scales)
  return codes, scales


def _quantize_matrix(name: str, rows: np.ndarray, by_row: bool, codes: np.ndarray,
                     scales: np.ndarray) -> None:
  """Codes and scales of a 2-D float32/float64/bf16 matrix, one scale per row (by_row) or
  per column, written into `codes` and `scales`."""
  ibits = np.dtype(f"i{rows.dtype.itemsize}")
  mask = ibits.type(np.iinfo(ibits).max)  # clears the sign bit
  bits = rows.view(ibits)
  absmax = np.zeros(rows.shape[0] if by_row else rows.shape[1], ibits)
  if by_row:
    int8_loops.absmax_bits_rows(bits, mask, absmax)
  else:
    int8_loops.absmax_bits_cols(bits, mask, absmax)
  if rows.dtype == BF16:  # bf16 bits are the top half of the float32 bits of the same value
    absmax = (absmax.astype(np.int32) << 16).view(np.float32)
  else:
    absmax = absmax.view(rows.dtype)
  if not np.isfinite(absmax).all():
    raise CodecError(f"tensor {name!r}: int8 quantization needs finite weights")
  if rows.dtype == np.float64:
    scale = _ceil_bf16(absmax / 127.0)
    safe = np.where(scale.view(np.uint16) > 0, scale.astype(np.float64), 1.0)
    int8_loops.quantize_f64(rows, safe, by_row, codes)
  else:
    scale, *consts = scale_constants(absmax)
    if rows.dtype == BF16:
      loop = int8_loops.quantize_rows_bf16 if by_row else int8_loops.quantize_cols_bf16
      loop(rows.view(np.uint16), *consts, codes)
    else:
      loop = int8_loops.quantize_rows_f32 if by_row else int8_loops.quantize_cols_f32
      loop(rows, *consts, codes)
  scales[...] = scale


def quantize_params(params: dict) -> dict[str, np.ndarray]:
  """Float params -> the int8 held state (see the module docstring for the layout)."""
  arrays, shapes, dtypes = {}, {}, {}
  for name, x in params.items():
    a = arrays[name] = np.asarray(x)
    if not is_float_dtype(a.dtype):
      raise CodecError(f"tensor {name!r}: dtype expected a floating type, got {a.dtype}")
    if layout(name, a.ndim) == "bf16":
      shapes[name], dtypes[name] = a.shape, BF16
      continue
    if name + SCALE_SUFFIX in params:
      raise CodecError(f"tensor {name + SCALE_SUFFIX!r}: collides with the int8 scales of {name!r}")
    shapes[name], dtypes[name] = a.shape, INT8
    shapes[name + SCALE_SUFFIX], dtypes[name + SCALE_SUFFIX] = scale_shape(name, a.shape), BF16
  held = {name: np.empty(shapes[name], dtypes[name]) for name in shapes}
  for name, a in arrays.items():
    if dtypes[name] == BF16:
      held[name] = to_bf16(name, a)
    else:
      quantize_tensor(name, a, (held[name], held[name + SCALE_SUFFIX]))
  return held


def is_held_int8(params: dict) -> bool:
  """Whether `params` is already an int8 held state (has int8 codes)."""
  return any(np.asarray(v).dtype == INT8 for v in params.values())


def check_held(params: dict) -> dict[str, np.ndarray]:
  """Validates an int8 held state and returns it as numpy arrays."""
  held = {k: np.asarray(v) for k, v in params.items()}
  check_layout({name: (a.shape, a.dtype) for name, a in held.items()})
  return held


def check_layout(held: dict) -> None:
  """Raises the CodecError naming the first tensor of an int8 held state (name -> (shape,
  dtype)) that breaks int8.py's layout: codes without bf16 scales of their channels' shape,
  or a dtype other than int8 and bf16."""
  for name, (shape, dtype) in held.items():
    if dtype == INT8:
      sname = name + SCALE_SUFFIX
      if sname not in held or held[sname][1] != BF16:
        raise CodecError(f"tensor {name!r}: int8 codes need bf16 scales {sname!r}")
      want = scale_shape(name, tuple(shape))
      if tuple(held[sname][0]) != want:
        raise CodecError(f"tensor {sname!r}: shape expected {want}, got {held[sname][0]}")
    elif dtype != BF16:
      raise CodecError(f"tensor {name!r}: int8 held state dtype expected int8 or bfloat16, "
                       f"got {dtype}")


def dequantize_params(held: dict) -> dict[str, np.ndarray]:
  """The int8 held state -> float32 weights (codes * scales; bf16 tensors widened)."""
  out = {}
  for name, a in check_held(held).items():
    if a.dtype == INT8:
      s = broadcast_scales(name, a.ndim, held[name + SCALE_SUFFIX].astype(np.float32))
      out[name] = a.astype(np.float32) * s
    elif not (name.endswith(SCALE_SUFFIX) and held.get(name[:-len(SCALE_SUFFIX)]) is not None
              and np.asarray(held[name[:-len(SCALE_SUFFIX)]]).dtype == INT8):
      out[name] = a.astype(np.float32)
  return out
