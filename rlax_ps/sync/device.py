"""The codec's device side (imports JAX): only changed elements cross the host link.

Held arrays on device are the held dtypes (bf16, int8) or their bit patterns (uint16,
uint8: `bits_of`, `values_of`), in which workers hold them (patch.py applies updates).
Publishers: `host_state` brings the host copy of the held state (what `encode` reads) to a
new version held on device by fetching only the elements whose bits changed, found by a
jitted compare on the arrays' devices; a tensor travels whole only when that is smaller.
Both: `fingerprints_of` computes device fingerprints (fingerprints.py) where the arrays are,
for a publisher to seal and a worker to check without pulling its weights.
Counts of fetched changes are padded to powers of two to bound recompilation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_ps.sharding import to_host
from rlax_ps.sync import fingerprints, parallel
from rlax_ps.sync.bits import UINT_OF, bit_view
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.wire import check_names

BITS_OF = {jnp.dtype(k): jnp.dtype(v) for k, v in UINT_OF.items()}  # held -> bit dtype
VALUE_OF = {v: k for k, v in BITS_OF.items()}  # bit -> held dtype
MIN_PAD = 1024
# Tensors of LARGE or more elements (DeepSeek-V3's stacked experts: 3.8e9) are compared,
# fetched and patched by [row, column], rows along their first axis: a flat index would pass
# int32. Each row must hold fewer than 2**31 elements.
LARGE = 2**31


def is_large(shape) -> bool:
  """Whether a tensor of `shape` is handled by rows (LARGE)."""
  return int(np.prod(shape)) >= LARGE


def row_size(name: str, shape) -> int:
  """The elements in a row of large tensor `name` (its first axis by the rest); ValueError
  naming it where a row would pass int32 too."""
  cols = int(np.prod(shape[1:]))
  if len(shape) < 2 or cols >= 2**31 or shape[0] >= 2**31:
    raise ValueError(f"tensor {name!r}: {int(np.prod(shape))} elements are handled by rows "
                     f"of its first axis, which must hold fewer than 2**31 each; got shape "
                     f"{list(shape)}")
  return cols


def bits_of(x):
  """A held (bf16/int8) JAX array as its bit pattern (uint16/uint8); bit arrays as they are."""
  dtype = jnp.dtype(x.dtype)
  return jax.lax.bitcast_convert_type(x, BITS_OF[dtype]) if dtype in BITS_OF else x


def values_of(x):
  """A held bit array (uint16/uint8) as its bf16/int8 values; other arrays as they are."""
  dtype = jnp.dtype(x.dtype)
  return jax.lax.bitcast_convert_type(x, VALUE_OF[dtype]) if dtype in VALUE_OF else x


# ---- publisher: the host copy of a new version from the changed elements ------------------

@jax.jit
def _count(old, new):
  return jnp.sum(bits_of(old) != bits_of(new), dtype=jnp.int32)


@jax.jit
def _count_rows(old, new):
  a, b = (bits_of(x).reshape(x.shape[0], -1) for x in (old, new))
  return jnp.sum(a != b, axis=1, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnums=2)
def _changed(old, new, cap):
  a, b = bits_of(old).reshape(-1), bits_of(new).reshape(-1)
  idx = jnp.nonzero(a != b, size=cap, fill_value=a.size)[0].astype(jnp.int32)
  return idx, b.at[idx].get(mode="fill", fill_value=0)


@functools.partial(jax.jit, static_argnums=2)
def _changed_rows(old, new, cap):
  a, b = (bits_of(x).reshape(x.shape[0], -1) for x in (old, new))
  rows, cols = jnp.nonzero(a != b, size=cap, fill_value=0)
  return rows.astype(jnp.int32), cols.astype(jnp.int32), b[rows, cols]


def _counting(old, new):
  """The changed elements of a pair on device: a count, or a large pair's count a row."""
  return _count_rows(old, new) if is_large(new.shape) else _count(old, new)


def _changes(old, new, cap):
  """The first `cap` changes of a pair on device (_changed, or _changed_rows if large)."""
  return _changed_rows(old, new, cap) if is_large(new.shape) else _changed(old, new, cap)


def _flat_changes(fetched, shape) -> tuple[np.ndarray, np.ndarray]:
  """(flat int64 indices, bit values) of fetched _changes (a large tensor's by rows)."""
  if len(fetched) == 2:
    return fetched
  rows, cols, values = fetched
  return np.asarray(rows, np.int64) * int(np.prod(shape[1:])) + cols, values


def _flat_index(shape) -> jax.Array:
  """Each element's flat C-order index mod 2**32 (uint32), built from per-axis iotas: no
  reshape, so a sharded operand keeps its sharding."""
  index, stride = jnp.zeros(shape, jnp.uint32), 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(
        stride & 0xFFFFFFFF)
    stride *= shape[axis]
  return index


def _fmix32(h):
  h = (h ^ (h >> 16)) * jnp.uint32(fingerprints.F1)
  h = (h ^ (h >> 13)) * jnp.uint32(fingerprints.F2)
  return h ^ (h >> 16)


@jax.jit
def fingerprint(x: jax.Array) -> jax.Array:
  """[lo, hi] (uint32) of the held array's fingerprint (fingerprints.py), computed on its
  devices: one fused elementwise pass and two sums; fingerprints.join makes the int."""
  bits = bits_of(x).astype(jnp.uint32)
  index = _flat_index(x.shape)
  h = _fmix32((bits * jnp.uint32(fingerprints.M_BITS)) ^ (index * jnp.uint32(fingerprints.M_INDEX)))
  return jnp.stack([jnp.sum(h, dtype=jnp.uint32),
                    jnp.sum(h * (index + index + jnp.uint32(1)), dtype=jnp.uint32)])


def fingerprints_of(state: dict) -> dict[str, int]:
  """name -> fingerprint of each held JAX array of `state` (bf16 or int8 or their bits, on any devices,
  sharded or not), computed where the arrays are; only 8 bytes per tensor reach the host.
  What a publisher whose state is on device passes to encode(..., fingerprints=)."""
  for name, x in state.items():
    if jnp.dtype(x.dtype) not in BITS_OF and jnp.dtype(x.dtype) not in VALUE_OF:
      raise ValueError(f"tensor {name!r}: expected a held dtype or its bits "
                       f"({', '.join(sorted(map(str, [*BITS_OF, *VALUE_OF])))}), got {x.dtype}")
  pending = {name: fingerprint(x) for name, x in state.items()}  # all dispatched, then read
  return {name: _joined(v) for name, v in to_host(pending).items()}


def _joined(pair) -> int:
  """The int fingerprint of fingerprint()'s fetched [lo, hi]."""
  return fingerprints.join(int(pair[0]), int(pair[1]))


def _replicated_if_explicit(x: jax.Array) -> jax.Array:
  """x itself, or replicated when sharded over Explicit mesh axes (whose arrays cannot be
  flattened and scanned as one without it; Auto axes let the compiler gather)."""
  s = getattr(x, "sharding", None)
  if (isinstance(s, jax.sharding.NamedSharding) and not s.is_fully_replicated
      and jax.sharding.AxisType.Explicit in tuple(s.mesh.axis_types)):
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec()))
  return x


def _pair_size(old, new) -> int:
  """Elements of a pair of device arrays that changed_elements can compare (ValueError
  otherwise)."""
  if tuple(old.shape) != tuple(new.shape) or old.dtype != new.dtype:
    raise ValueError(f"old and new must match: {old.dtype}{list(old.shape)} vs "
                     f"{new.dtype}{list(new.shape)}")
  if jnp.dtype(new.dtype) not in BITS_OF:
    raise ValueError(f"expected a held dtype ({sorted(map(str, BITS_OF))}), got {new.dtype}")
  if is_large(new.shape):
    row_size("new", new.shape)
  return int(np.prod(new.shape))


def _fetch_cap(n: int, size: int, dtype) -> int | None:
  """The padded count of n changes to fetch from a tensor of `size` elements, or None when
  fetching it whole is smaller (changes take more than a third of its bytes)."""
  itemsize = jnp.dtype(dtype).itemsize
  index = 8 if size >= LARGE else 4  # (a row and a column)
  if n * (index + itemsize) * 3 > size * itemsize:
    return None
  return max(MIN_PAD, 1 << max(0, n - 1).bit_length())


def changed_elements(old: jax.Array, new: jax.Array) -> tuple[np.ndarray, np.ndarray] | None:
  """(flat indices, new bit patterns) of the elements whose bits differ between two device
  arrays of one shape and held dtype, fetched to the host; None when they are so many that
  fetching `new` whole is smaller (more than a third of its bytes)."""
  size = _pair_size(old, new)
  old, new = _replicated_if_explicit(old), _replicated_if_explicit(new)
  n = int(np.sum(to_host(_counting(old, new)), dtype=np.int64))
  cap = _fetch_cap(n, size, new.dtype)
  if cap is None:
    return None
  if n == 0:  # (nothing to gather: an empty tensor has no element to pad the fetch with)
    return np.zeros(0, np.int32), np.zeros(0, bit_view(np.zeros(0, new.dtype)).dtype)
  idx, values = _flat_changes(to_host(_changes(old, new, cap)), new.shape)
  return idx[:n], values[:n]


# Device bytes of fetched changes held at once by publish_state (each tensor's are at most a
# third of its bytes); more are fetched in further round trips.
FETCH_BYTES = 1 << 28
# Arrays in this host's memory (the CPU backend) are copied, not diffed on their devices:
# there a copy is a memcpy, far cheaper than XLA:CPU's nonzero (and its compile per shape
# and bucket). False: the device path everywhere (tests, benchmarks/weight_sync.py).
HOST_MEMORY_DIRECT = True


def host_state(host_old: dict, old: dict, new: dict, *, check: bool = True
               ) -> dict[str, np.ndarray]:
  """The host copy (numpy) of the held state `new` (name -> JAX array on any devices, e.g.
  int8_device.quantize_params_jax's output or bf16 params), made from `host_old`, the host
  copy of the state `old` still on device: only changed elements are fetched, and each
  tensor is one host copy plus a scatter. `host_old` is not modified.

  With `check`, each changed tensor's result is compared with a fingerprint computed on
  device (one more pass on each side), so that a `host_old` that is not the host copy of
  `old` raises CodecError naming the tensor instead of publishing a state the devices do
  not hold; an unchanged one is `host_old`'s own, not hashed (a frozen base would cost a
  pass every version), except on the host-memory path, which compares every tensor."""
  return _fetch_state(host_old, old, new, prints=False, check=check)[0]


def publish_state(host_old: dict | None, old: dict, new: dict, *, check: bool = True,
                  host: bool = True) -> tuple[dict[str, np.ndarray], dict[str, int]]:
  """(host_state(host_old, old, new), name -> device fingerprint of each tensor of `new`):
  what a publisher whose held state lives on device needs to encode and seal a version,
  encode(host_old, host, fmt, ..., fingerprints=fingerprints). The fingerprints are the
  ones host_state's check computes anyway. `host=False` (a multi-host slice's processes
  other than the one that encodes): the same device work and gathers, which are
  collective, but no host copy; returns (None, None) and host_old may be None."""
  return _fetch_state(host_old, old, new, prints=True, check=check, host=host)


def _fetch_state(host_old: dict | None, old: dict, new: dict, *, prints: bool, check: bool,
                 host: bool = True) -> tuple[dict[str, np.ndarray], dict[str, int] | None]:
  """host_state (checked if `check`) and, with `prints`, the device fingerprints of `new`.
  Few round trips to the devices whatever the tensor count: the change counts (and
  fingerprints) of every tensor in one, then the changes of as many tensors as FETCH_BYTES
  holds in each next one (with a check's fingerprints where the first trip had none); the
  host copies and scatters run on the host's cores, unless not `host`."""
  if host:
    check_names("host_old", host_old, new)
  check_names("old", old, new)
  for name, arr in new.items():  # everything checked before anything is fetched
    for what, other in ((("host_old", np.asarray(host_old[name])),) if host else ()) + (
        ("old", old[name]),):
      if tuple(other.shape) != tuple(arr.shape) or jnp.dtype(other.dtype) != jnp.dtype(arr.dtype):
        raise CodecError(f"tensor {name!r}: {what} is {other.dtype}{list(other.shape)}, new "
                         f"is {arr.dtype}{list(arr.shape)}")
  sizes = {name: _pair_size(old[name], arr) for name, arr in new.items()}
  direct = [name for name in new if HOST_MEMORY_DIRECT and _in_host_memory(old[name])
            and _in_host_memory(new[name])]  # never on a multi-host slice
  out, printed = {}, {}
  if direct and host:
    tasks = [(sizes[n], functools.partial(_copied, n, host_old[n], old[n], new[n], prints, check))
             for n in direct]
    for name, (result, mark) in zip(direct, parallel.run(tasks, parallel.resolve(None))):
      out[name] = result
      if prints:
        printed[name] = mark
  rest = [name for name in new if name not in direct]
  flat = {name: (_replicated_if_explicit(old[name]), _replicated_if_explicit(new[name]))
          for name in rest}
  counts, marks = to_host((
      {name: _counting(*pair) for name, pair in flat.items()},
      {name: fingerprint(new[name]) for name in rest} if prints else {}))
  printed.update({name: _joined(v) for name, v in marks.items()})
  batch, held = {}, 0
  for i, name in enumerate(rest):
    n = int(np.sum(counts[name], dtype=np.int64))
    cap = _fetch_cap(n, sizes[name], new[name].dtype)
    if cap is None:
      batch[name] = (new[name], None, None)  # whole: already on device, no extra memory
    elif n == 0:  # unchanged (a LoRA run's frozen base; an empty tensor): nothing fetched
      batch[name] = (None, 0, None)
    else:  # a check's fingerprint comes with the changes unless the first trip had it
      batch[name] = (_changes(*flat[name], cap), n,
                     None if prints or not check else fingerprint(new[name]))
      held += cap * (4 + jnp.dtype(new[name].dtype).itemsize)
    if held >= FETCH_BYTES or i == len(rest) - 1:
      got = to_host({k: (v, p) for k, (v, _, p) in batch.items()}, keep=host)
      if host:
        tasks = []
        for k, (_, n, _) in batch.items():
          want = (printed[k] if prints else _joined(got[k][1])) if (check and n) else None
          tasks.append((sizes[k], functools.partial(_host_tensor, k, host_old[k], got[k][0],
                                                    n, want)))
        out.update(zip(batch, parallel.run(tasks, parallel.resolve(None))))
      batch, held = {}, 0
  if not host:
    return None, None
  return {name: out[name] for name in new}, (
      {name: printed[name] for name in new} if prints else None)


def _in_host_memory(x) -> bool:
  """Whether every shard of x lies in this process's host memory (the CPU backend)."""
  return (isinstance(x, jax.Array) and x.is_fully_addressable
          and all(d.platform == "cpu" for d in x.devices()))


def _copied(name: str, base, old, new, prints: bool, check: bool):
  """(host copy of `new`, its fingerprint if `prints`) of _fetch_state's host-memory path:
  a copy (the device buffer may be donated later), `base` checked against `old` bit for
  bit where `check`."""
  result = np.array(jax.device_get(new), order="C")
  if check and not np.array_equal(bit_view(np.asarray(base)).reshape(-1),
                                  bit_view(np.asarray(jax.device_get(old))).reshape(-1)):
    raise CodecError(f"tensor {name!r}: host_old is not the host copy of old (they differ "
                     f"bit for bit)")
  return result, fingerprints.fingerprint(result) if prints else None


def _host_tensor(name: str, base, fetched, n: int | None, want: int | None) -> np.ndarray:
  """One tensor of _fetch_state: fetched whole (n None), `base` itself where nothing changed
  (n 0: a LoRA run's frozen base is not copied nor hashed every publication; host copies are
  never written), or `base` copied and its n changed elements set, checked against the
  device fingerprint `want` unless None."""
  if n is None:
    return np.asarray(fetched)
  if n == 0:
    return np.asarray(base)
  result = np.array(np.asarray(base), order="C")
  idx, values = _flat_changes(fetched, result.shape)
  bit_view(result)[idx[:n]] = values[:n]
  if want is not None and fingerprints.fingerprint(result) != want:
    raise CodecError(f"tensor {name!r}: host_old is not the host copy of old (the host "
                     f"result differs from the device array)")
  return result
