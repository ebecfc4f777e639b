"""The worker's copy of the policy: the published bf16 or int8 weights, on device, runnable.

Updates from the parameter server (`rlax_ps.sync.Update`) are applied in place: each changed
tensor is one donated jitted scatter of its changed elements (`rlax_ps.sync.device`), so no
second copy of the model ever exists; the whole held state is then checked against the
update's result seal (changed tensors are hashed, unchanged ones keep the checksum they
had). A delta whose base is not the held version, or any mismatch, raises `ResyncNeeded`
and leaves the policy without a version: the caller pulls a keyframe.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference_workers.quantized import Int8Transformer, held_name
from rlax_ps.models.config import ModelConfig
from rlax_ps.models.transformer import Transformer
from rlax_ps.sync import CodecError, Update, checksum, parallel
from rlax_ps.sync.device import apply_changes, each_padded_changes

FORMATS = ("bf16", "int8")


class ResyncNeeded(Exception):
  """The held weights cannot take this update; only a keyframe can bring them back."""


def _variables(model: nnx.Module) -> dict[str, nnx.Variable]:
  state = nnx.state(model, nnx.Param)
  return {held_name(".".join(map(str, path))): var for path, var in nnx.to_flat_state(state)}


class HeldPolicy:
  """A model (bf16 `Transformer` or `Int8Transformer`) whose weights follow published versions.

  `model` is what the sampler runs; `version` is None until a keyframe has been applied
  (and again after a failed update). Compute dtype is `config.dtype`.
  """

  def __init__(self, config: ModelConfig, fmt: str = "bf16"):
    if fmt not in FORMATS:
      raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    self.fmt = fmt
    cls = Transformer if fmt == "bf16" else Int8Transformer
    held_config = config.replace(param_dtype="bfloat16")
    self.model = nnx.eval_shape(lambda: cls(held_config, rngs=nnx.Rngs(0)))
    self._vars = _variables(self.model)
    self._checksums: dict[str, int] = {}  # of held tensors, filled as they are verified
    self.version: int | None = None

  @property
  def names(self) -> list[str]:
    """Held-state tensor names, as the codec names them."""
    return sorted(self._vars)

  @property
  def nbytes(self) -> int:
    """Bytes of weights held (codes, scales, bf16 tensors)."""
    return sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize for v in self._vars.values())

  def held_state(self) -> dict[str, jax.Array]:
    return {name: var[...] for name, var in self._vars.items()}

  def apply(self, update: Update, *, verify: bool = True) -> None:
    """Bring the held weights to `update.version` in place (keyframe or delta).

    Raises ResyncNeeded when the update does not apply to what is held (format, base
    version, tensor names or shapes) or the result fails the update's seal.
    """
    try:
      self._apply(update, verify)
    except (CodecError, ResyncNeeded) as e:
      self.version = None
      raise e if isinstance(e, ResyncNeeded) else ResyncNeeded(str(e)) from e

  def _apply(self, update: Update, verify: bool) -> None:
    if update.fmt != self.fmt:
      raise ResyncNeeded(f"update format: expected {self.fmt!r}, got {update.fmt!r}")
    if not update.is_keyframe and update.base_version != self.version:
      raise ResyncNeeded(f"update {update.version} is a delta from version {update.base_version}; "
                         f"held version is {self.version}")
    names = set(update.tensors)
    if names != set(self._vars):
      odd = sorted(names ^ set(self._vars))
      raise ResyncNeeded(f"update tensors differ from the model's: e.g. {odd[0]!r} "
                         f"({len(odd)} differ)")
    # A keyframe replaces everything, a delta patches what is held; an older version's
    # leftovers would be caught by the seal check below.
    if not update.is_keyframe:
      self.version = None
    for name, changes in each_padded_changes(update, sorted(names)):  # decoded ahead
      var = self._vars[name]
      if changes.kind == "unchanged":
        continue
      if changes.kind == "replace":
        new = jnp.asarray(changes.array)
      elif isinstance(var[...], jax.ShapeDtypeStruct):
        raise ResyncNeeded(f"tensor {name!r}: a delta needs held weights; none are loaded yet")
      else:
        new = apply_changes(var[...], changes)
      var.set_value(new)
      self._checksums.pop(name, None)
    if verify:
      update.verify_all(self._checksums_of(names))
    self.version = update.version

  def _checksums_of(self, names) -> dict[str, int]:
    """name -> checksum of each held tensor: kept from when it last changed, else pulled
    and hashed, side by side on the host's cores (pulls and xxh3 release the GIL)."""
    todo = [name for name in names if name not in self._checksums]
    tasks = [(self._vars[name][...].size, functools.partial(self._pulled_checksum, name))
             for name in todo]
    self._checksums.update(zip(todo, parallel.run(tasks, parallel.resolve(None))))
    return {name: self._checksums[name] for name in names}

  def _pulled_checksum(self, name: str) -> int:
    return checksum(np.asarray(jax.device_get(self._vars[name][...])))

  def verify_all(self, update: Update) -> None:
    """Check every held tensor, pulled afresh, against `update`'s result seal (e.g. after a
    restart); raises CodecError naming the tensor."""
    self._checksums.clear()
    update.verify_all(self._checksums_of(self._vars))
