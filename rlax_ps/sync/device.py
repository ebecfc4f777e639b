"""Applies an update's TensorChanges to JAX arrays in place on device (imports JAX).

Only the changed elements travel to the device: a sparse tensor is one jitted scatter-add
of wrapping bit offsets into the donated buffer, so the worker never holds a second copy
of the weights. Index counts are padded to powers of two to bound recompilation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.wire import TensorChanges

_UINT = {jnp.dtype(jnp.bfloat16): jnp.uint16, jnp.dtype(jnp.int8): jnp.uint8}
_MIN_PAD = 1024


def _bits(buf):
  return jax.lax.bitcast_convert_type(buf, _UINT[buf.dtype])


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_add(buf, idx, off):
  bits = _bits(buf).reshape(-1).at[idx].add(off, mode="drop", indices_are_sorted=True)
  return jax.lax.bitcast_convert_type(bits.reshape(buf.shape), buf.dtype)


@functools.partial(jax.jit, donate_argnums=0)
def _dense_add(buf, off):
  return jax.lax.bitcast_convert_type(_bits(buf) + off.reshape(buf.shape), buf.dtype)


def _padded(indices: np.ndarray, offsets: np.ndarray, size: int):
  n = max(_MIN_PAD, 1 << (indices.size - 1).bit_length())
  itype = np.int32 if size < 2**31 else np.int64
  idx = np.full(n, size, itype)  # Out of bounds: dropped by the scatter.
  idx[:indices.size] = indices
  off = np.zeros(n, offsets.dtype)
  off[:offsets.size] = offsets
  return idx, off


def apply_changes(buf: jax.Array, changes: TensorChanges) -> jax.Array:
  """`buf` (donated: do not use it afterwards) with `changes` applied, on its devices."""
  if tuple(buf.shape) != changes.shape or jnp.dtype(buf.dtype) != jnp.dtype(changes.dtype):
    raise CodecError(f"tensor {changes.name!r}: expected {changes.dtype}{list(changes.shape)}, "
                     f"got {buf.dtype}{list(buf.shape)}")
  if changes.kind == "unchanged":
    return buf
  if changes.kind == "replace":
    return jax.device_put(changes.array, buf.sharding)
  if changes.kind == "dense":
    return _dense_add(buf, jnp.asarray(changes.offsets))
  idx, off = _padded(changes.indices, changes.offsets, int(np.prod(changes.shape)))
  return _scatter_add(buf, jnp.asarray(idx), jnp.asarray(off))
