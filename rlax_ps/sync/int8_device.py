"""The int8 quantizer of int8.py in JAX, bit-identical to it: the trainer quantizes on device
before its device-to-host copy (int8 codes are a quarter of the float32 bytes).

Jittable, works on sharded arrays (reductions and elementwise math only, no host
callbacks) and uses float32 arithmetic only (no float64 on TPUs): the steps of
int8.scale_constants and int8_loops.code_f32, whose comments prove each one exact, with
one change: XLA on CPU and TPUs flush float32 subnormals to zero, so no subnormal is ever
an operand here (tiny absmax values and subnormal weights are scaled by powers of two
through their bit patterns; see _scale_bits and _codes). The absmax and its non-finite flag
are integer maxima of bit patterns, exact everywhere (on XLA:CPU an int32 reduction is
much slower than a float32 one, so there the absmax pass is the costly part).
A channel holding a NaN or infinity gets a NaN scale and zero codes (the device-side flag);
`fetch_held` turns it into the CodecError that int8.quantize_params raises. Inputs are
float32, bf16 or float16 (float64 host weights reach a jitted function as float32 unless
jax_enable_x64 is on; the host quantizes float64 itself by float64 division).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rlax_ps.sync.bits import BF16, INT8, is_float_dtype
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.int8 import SCALE_SUFFIX, broadcast_scales, layout

_INPUT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))
_NAN_BF16 = 0x7FC0
_EXP = 0x7F800000  # float32 exponent field
_MANT = 0x007FFFFF
_SIGN = -0x80000000
_TINY = 67 << 23  # absmax < 2**-60: scaled by 2**64 before dividing
_F32 = jnp.float32


def _f32(bits):
  return lax.bitcast_convert_type(bits, _F32)


def _i32(x):
  return lax.bitcast_convert_type(x, jnp.int32)


def _pow2(e):
  """2**(e - 127) as float32 for an int32 exponent field e in [1, 254]; 0 where e < 1."""
  return _f32(jnp.maximum(e, 0) << 23)


def _scale_bits(top):
  """bf16 bits of the smallest bf16 >= absmax / 127, absmax given by its (finite, sign-free)
  float32 bits `top`, without a subnormal operand anywhere.

  absmax >= 2**-60 is used as is; a smaller one as a = absmax * 2**64 (exact: bits + 64
  exponents, or for a subnormal its integer mantissa * 2**-85). s0 = bf16(fl(a / 127)) is
  the bf16 just below or above a / 127 (the division errs by far less than half a bf16 ulp),
  s0 * 127 is exact (8 x 7 significant bits): s0 is the answer unless s0 * 127 < a, and then
  the next bf16 is. Scaled back by 2**-64 (the bf16 exponent field minus 64) this stays the
  answer while it is >= 2**-126; below, bf16 is subnormal, spaced 2**-133, and the answer
  is n * 2**-133 with n = ceil(A / 127), A = absmax * 2**133 = a * 2**69 < 2**14: n0 =
  ceil(fl(A / 127)) is within one of n and n0 * 127 is exact, so one step fixes it."""
  e = top >> 23
  tiny = top < _TINY
  up = jnp.where(e == 0, (top & _MANT).astype(_F32) * _F32(2.0**-85), _f32(top + (64 << 23)))
  a = jnp.where(tiny, up, _f32(top))
  s0 = (a / _F32(127)).astype(jnp.bfloat16)
  low = s0.astype(_F32) * _F32(127) < a
  s1 = lax.bitcast_convert_type(s0, jnp.uint16).astype(jnp.int32) + low.astype(jnp.int32)
  big = (s1 >> 7) >= 65  # scaled back, s1 * 2**-64 >= 2**-126
  A = a * _F32(2.0**69)
  n0 = jnp.ceil(A / _F32(127))
  n = n0 + (n0 * _F32(127) < A).astype(_F32) - ((n0 - 1) * _F32(127) >= A).astype(_F32)
  bits = jnp.where(tiny, jnp.where(big, s1 - (64 << 7), n.astype(jnp.int32)), s1)
  return bits.astype(jnp.uint16)


def scale_constants(scale_bits: jax.Array) -> tuple[jax.Array, ...]:
  """(f, g, s, inv, half) per channel from bf16 scale bits: int8.scale_constants' f, s,
  inv, half computed from bit patterns (exact with subnormals flushed; s = 1 for scale 0),
  and g = f * 2**-149 (0 when below 2**-126) for the weights that are subnormal."""
  bits = scale_bits.astype(jnp.int32) << 16
  e = (bits >> 23) & 0xFF
  f = _pow2(254 - e)
  g = _pow2(105 - e)
  mant = bits & _MANT
  s = jnp.where(e == 0, mant.astype(_F32) * g, _f32(mant | (127 << 23)))
  s = jnp.where(bits > 0, s, _F32(1))
  return f, g, s, _F32(1) / s, s * _F32(0.5)


def _codes(bits, f, g, s, inv, half):
  """int8_loops.code_f32 on arrays of float32 weight bits (constants broadcast), with
  v = w * f exact for subnormal w too: (integer mantissa * g) with w's sign."""
  sub = _f32(_i32((bits & _MANT).astype(_F32) * g) | (bits & _SIGN))
  v = jnp.where((bits & _EXP) == 0, sub, _f32(bits) * f)
  c = lax.round(v * inv, lax.RoundingMethod.TO_NEAREST_EVEN)
  r = v - c * s  # exact, or (c = +-1) rounded past +-half: see code_f32
  h = c * _F32(0.5)
  odd = lax.round(h, lax.RoundingMethod.TO_NEAREST_EVEN) != h
  up = (r > half) | ((r == half) & odd)
  down = (r < -half) | ((r == -half) & odd)
  return (c + up.astype(_F32) - down.astype(_F32)).astype(jnp.int8)


def _f32_bits(x):
  """int32 bits of x as float32 (exact; a bf16 is the top half of its float32, moved as bits
  so that no conversion can flush a subnormal)."""
  if jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16):
    return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32) << 16
  return _i32(x.astype(_F32))


def quantize_tensor_jax(name: str, x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(int8 codes shaped like x, bf16 scales) of one float32/bf16/float16 tensor of ndim >= 2,
  equal bit for bit to int8.quantize_tensor; a channel with a NaN or infinity has a NaN
  scale and zero codes."""
  kind = layout(name, x.ndim)
  if kind == "bf16":
    raise CodecError(f"tensor {name!r}: int8 quantization needs ndim >= 2 and no 'router' in "
                     f"the name, got shape {x.shape}")
  if jnp.dtype(x.dtype) not in _INPUT_DTYPES:
    raise CodecError(f"tensor {name!r}: dtype expected float32, bfloat16 or float16 on "
                     f"device, got {x.dtype}")
  bits = _f32_bits(x)
  kept = {"rows": (0,), "experts": (0, x.ndim - 1), "channels_last": (x.ndim - 1,)}[kind]
  axes = tuple(i for i in range(x.ndim) if i not in kept)
  top = jnp.max(bits & 0x7FFFFFFF, axis=axes, initial=0)  # exact, subnormals too
  bad = top >= _EXP  # a NaN or infinity in the channel
  scale_bits = _scale_bits(jnp.where(bad, 0, top))
  consts = scale_constants(scale_bits)
  scale = lax.bitcast_convert_type(jnp.where(bad, jnp.uint16(_NAN_BF16), scale_bits),
                                   jnp.bfloat16)
  consts = [broadcast_scales(name, x.ndim, c) for c in consts]
  bad = broadcast_scales(name, x.ndim, bad)
  codes = jnp.where(bad, jnp.int8(0), _codes(bits, *consts))
  return codes, scale


def quantize_params_jax(params: dict) -> dict[str, jax.Array]:
  """Float params -> the int8 held state on device (int8.quantize_params' layout); jittable.
  Non-finite weights show as NaN scales: `fetch_held` raises for them."""
  held = {}
  for name, x in params.items():
    if not is_float_dtype(np.dtype(x.dtype)):
      raise CodecError(f"tensor {name!r}: dtype expected a floating type, got {x.dtype}")
    if layout(name, x.ndim) == "bf16":
      held[name] = jnp.asarray(x).astype(jnp.bfloat16)
      continue
    if name + SCALE_SUFFIX in params:
      raise CodecError(f"tensor {name + SCALE_SUFFIX!r}: collides with the int8 scales of {name!r}")
    held[name], held[name + SCALE_SUFFIX] = quantize_tensor_jax(name, jnp.asarray(x))
  return held


def fetch_held(held: dict) -> dict[str, np.ndarray]:
  """A held state from `quantize_params_jax` copied to the host as numpy arrays; raises the
  CodecError of int8.quantize_params for a tensor whose weights were not all finite."""
  out = jax.device_get(held)
  out = {name: np.asarray(a) for name, a in out.items()}
  check_finite(out)
  return out


def check_finite(held: dict) -> None:
  """Raises the CodecError of int8.quantize_params for the first tensor of a host copy of a
  `quantize_params_jax` state whose weights were not all finite (its scales are NaN)."""
  for name, a in held.items():
    sname = name + SCALE_SUFFIX
    if a.dtype == INT8 and sname in held and held[sname].dtype == BF16:
      if np.isnan(held[sname]).any():
        raise CodecError(f"tensor {name!r}: int8 quantization needs finite weights")


_quantize_params_jit = jax.jit(quantize_params_jax)


def quantize_params_device(params: dict) -> dict[str, np.ndarray]:
  """int8.quantize_params computed on the params' devices (jitted), fetched to the host."""
  return fetch_held(_quantize_params_jit(params))
