"""A worker's side of the codec on device: updates applied in place to held bit arrays.

Held weights live as their bit patterns (uint16 for bf16, uint8 for int8; device.bits_of
and values_of), so a delta's wrapping offsets are one native integer scatter-add into the
donated buffer on every backend, with no bitcast around it (which XLA:CPU turns into two
full passes over the tensor). The tensors of an update go in one jitted call per group of
about Patcher.GROUP_BYTES of weights: an update costs a few dispatches, not three per
tensor. A tensor replaced whole (a keyframe's, a raw delta's) frees its old buffer as it
is placed: no second copy of the model exists on device.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_ps.sync import device, parallel
from rlax_ps.sync.bits import bit_view
from rlax_ps.sync.device import BITS_OF, MIN_PAD
from rlax_ps.sync.errors import CodecError
from rlax_ps.sync.wire import TensorChanges, Update


@functools.partial(jax.jit, static_argnums=(3, 4), donate_argnums=0)
def _scatter(bufs, indices, offsets, caps, shardings=None):
  """Each buffer of `bufs` (bit arrays) plus its segment of offsets at its indices: buffer
  i's segment is the next caps[i] entries of the arrays of its dtype. `shardings`: the
  buffers' own, over several devices, which the results keep (the flattening would
  otherwise let XLA pick another)."""
  start, out = {}, []
  for i, (buf, cap) in enumerate(zip(bufs, caps)):
    key = jnp.dtype(buf.dtype).name
    s = start.get(key, 0)
    start[key] = s + cap
    flat = buf.reshape(-1)
    flat = flat.at[indices[key][s:s + cap]].add(  # in the buffer's sharding (Explicit axes)
        offsets[key][s:s + cap], mode="drop", indices_are_sorted=True,
        out_sharding=jax.typeof(flat).sharding)
    flat = flat.reshape(buf.shape)
    if shardings is not None:
      flat = jax.lax.with_sharding_constraint(flat, shardings[i])
    out.append(flat)
  return tuple(out)


@functools.partial(jax.jit, donate_argnums=0)
def _scatter_rows(buf, rows, cols, offsets):
  """A large tensor's buffer (device.LARGE) plus `offsets` at [rows, cols] of its first axis
  by the rest; rows past its first axis are dropped (padding)."""
  grid = buf.reshape(buf.shape[0], -1)
  grid = grid.at[rows, cols].add(offsets, mode="drop", out_sharding=jax.typeof(grid).sharding)
  return grid.reshape(buf.shape)


class Patcher:
  """Applies updates to held bit arrays (name -> JAX array, or ShapeDtypeStruct before
  the first keyframe) on their devices.

  The held tensors, in name order, fall into fixed groups of about GROUP_BYTES of
  weights; a delta is one jitted call per group, every member in it (an unchanged one
  with only padding). A tensor's changes are padded to its capacity: when set, the power
  of two at least twice its count (and MIN_PAD), then kept from update to update while
  the counts fit in it and stay above 1/SHRINK of it. So a worker's like-sized updates
  run the same compiled programs (compiling one takes a second or more on CPU). Not
  thread-safe: one per held policy."""

  GROUP_BYTES = 1 << 30  # at 1% changed, about 30 MB of padded changes on device per call
  SHRINK = 16

  def __init__(self):
    self._caps: dict[str, int] = {}

  @property
  def capacities(self) -> dict[str, int]:
    """name -> padded change count of each tensor (MIN_PAD until it first changes)."""
    return dict(self._caps)

  def apply(self, held: dict, update: Update, threads: int | None = None) -> list[str]:
    """Brings `held` (name -> bit array, every tensor of `update`) to `update` in place:
    the entries a call donated are replaced by its results as soon as it is dispatched.
    Returns the names of the tensors the update replaced or changed. Shapes and dtypes
    are checked before anything is written; an undecodable tensor raises CodecError
    naming it, with the groups dispatched before its own already in `held`. Tensors are
    decoded on up to `threads` host threads (None: the host's cores, at most 8)."""
    names = sorted(update.tensors)
    if set(names) != set(held):
      odd = sorted(set(names) ^ set(held))
      raise CodecError(f"update tensors differ from the held ones: e.g. {odd[0]!r} "
                       f"({len(odd)} differ)")
    for name in names:
      meta, buf = update.meta(name), held[name]
      want = BITS_OF[jnp.dtype(meta.dtype)]
      if tuple(buf.shape) != tuple(meta.shape) or jnp.dtype(buf.dtype) != want:
        raise CodecError(f"tensor {name!r}: expected {want}{list(meta.shape)} (the bits of "
                         f"{meta.dtype}), got {buf.dtype}{list(buf.shape)}")
      if device.is_large(meta.shape):
        try:
          device.row_size(name, meta.shape)
        except ValueError as e:
          raise CodecError(str(e)) from None
    changed = []
    for group in self._groups(names, update):  # a group decodes while the last one scatters
      changes = parallel.run([(update.meta(name).size, functools.partial(update.changes, name))
                              for name in group], parallel.resolve(threads))
      sparse = [ch for ch in changes if ch.kind == "sparse"]
      for ch in sparse:
        if not isinstance(held[ch.name], jax.Array):
          raise CodecError(f"tensor {ch.name!r}: a delta needs held weights; none are "
                           f"loaded yet")
        self._fit(ch.name, ch.indices.size)
      if sparse:
        self._call(held, group, {ch.name: ch for ch in sparse})
      for ch in changes:
        if ch.kind == "replace":  # the old buffer goes at once, as a donated one does: a
          old = held[ch.name]  # keyframe never holds two copies of the model on device
          held[ch.name] = _placed(bit_view(ch.array).reshape(ch.shape), old)
          if isinstance(old, jax.Array) and not old.is_deleted():
            old.delete()
        if ch.kind != "unchanged":
          changed.append(ch.name)
    return changed

  def _groups(self, names: list[str], update: Update) -> list[list[str]]:
    """`names` in runs of about GROUP_BYTES of weights (fixed for a model)."""
    groups, nbytes = [[]], 0
    for name in names:
      meta = update.meta(name)
      if groups[-1] and nbytes + meta.size * meta.dtype.itemsize > self.GROUP_BYTES:
        groups.append([])
        nbytes = 0
      groups[-1].append(name)
      nbytes += meta.size * meta.dtype.itemsize
    return groups

  def _fit(self, name: str, n: int) -> None:
    """Sets `name`'s capacity for n changes where it must change: at least twice n, so
    that counts a little larger next time still fit (each new capacity compiles anew)."""
    cap = self._caps.get(name)
    if cap is None or n > cap or n * self.SHRINK < cap:
      self._caps[name] = max(MIN_PAD, 1 << (2 * n - 1).bit_length())

  def _call(self, held: dict, group: list[str], sparse: dict[str, TensorChanges]) -> None:
    """One jitted scatter of `sparse`'s changes into `group`'s `held` buffers (the others
    get padding only), their results put in `held`."""
    for name in [n for n in group if device.is_large(held[n].shape)]:  # by rows, alone
      group = [n for n in group if n != name]
      if name in sparse:
        held[name] = self._by_rows(held[name], name, sparse[name])
    if not group:
      return
    caps = tuple(self._caps.setdefault(name, MIN_PAD) for name in group)
    members = {}  # bit dtype -> [(name, cap)]
    for name, cap in zip(group, caps):
      members.setdefault(jnp.dtype(held[name].dtype).name, []).append((name, cap))
    indices, offsets = {}, {}
    for key, items in members.items():
      total = sum(cap for _, cap in items)
      idx, off = np.empty(total, np.int32), np.zeros(total, np.dtype(key))
      s = 0
      for name, cap in items:
        ch = sparse.get(name)
        n = 0 if ch is None else ch.indices.size
        if n:
          idx[s:s + n] = ch.indices
          off[s:s + n] = ch.offsets
        idx[s + n:s + cap] = int(np.prod(held[name].shape))  # out of bounds: dropped
        s += cap
      indices[key], offsets[key] = jnp.asarray(idx), jnp.asarray(off)
    bufs = tuple(held[name] for name in group)
    shardings = tuple(b.sharding for b in bufs)
    auto = all(isinstance(sh, jax.sharding.NamedSharding) and all(
        t == jax.sharding.AxisType.Auto for t in sh.mesh.axis_types) for sh in shardings)
    spread = auto and any(len(sh.device_set) > 1 for sh in shardings)  # Explicit: kept
    new = _scatter(bufs, indices, offsets, caps, shardings if spread else None)
    held.update(zip(group, new))


  def _by_rows(self, buf, name: str, ch: TensorChanges):
    """A large tensor's changes scattered by [row, column] (padded to its capacity)."""
    cap, cols = self._caps.setdefault(name, MIN_PAD), int(np.prod(buf.shape[1:]))
    n = ch.indices.size
    rows = np.full(cap, buf.shape[0], np.int32)  # out of bounds: dropped
    cols_at, offsets = np.zeros(cap, np.int32), np.zeros(cap, buf.dtype)
    rows[:n], cols_at[:n] = np.divmod(np.asarray(ch.indices, np.int64), cols)
    offsets[:n] = ch.offsets
    return _scatter_rows(buf, jnp.asarray(rows), jnp.asarray(cols_at), jnp.asarray(offsets))


def _placed(bits: np.ndarray, like) -> jax.Array:
  """Host bits on the devices (and sharding) of the held array `like`, or of the sharding a
  placeholder (jax.ShapeDtypeStruct) names; else on the default device."""
  sharding = getattr(like, "sharding", None)
  if sharding is not None:
    return jax.device_put(bits, sharding)
  return jnp.asarray(bits)
