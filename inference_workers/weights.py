"""The worker's copy of the policy: the published bf16 or int8 weights, on device, runnable.

The weights are held as their bit patterns (`HeldBits`), which the model reads as bf16/int8
values. Updates from the parameter server (`rlax_ps.sync.Update`) are applied in place:
every changed tensor's elements in one donated jitted scatter (`rlax_ps.sync.patch`), so no
second copy of the model ever exists; the whole held state is then checked against the
update's seal: on an accelerator, by device fingerprints (rlax_ps.sync.fingerprints; 8 bytes
per changed tensor reach the host) where the publisher sealed them; otherwise by the xxh3
result seal (changed tensors pulled and hashed). Unchanged tensors keep the digest they
had. A delta whose base is not the held version, or any mismatch, raises `ResyncNeeded`
and leaves the policy without a version: the caller pulls a keyframe. A keyframe of other
tensor names or shapes, or any update published by a model whose config fields differ from
this worker's where shapes do not show it (rope_theta, norm eps, ...), raises
`WeightsDoNotFit`: another model; no update can mend that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inference_workers.quantized import Int8Transformer, held_name
from rlax_ps import sharding as shd
from rlax_ps.models.config import ModelConfig
from rlax_ps.models.transformer import Transformer
from rlax_ps.sync import CodecError, Update, checksum, parallel, state_digest
from rlax_ps.sync.device import BITS_OF, VALUE_OF, bits_of, fingerprints_of, values_of
from rlax_ps.sync.patch import Patcher

FORMATS = ("bf16", "int8")


class ResyncNeeded(Exception):
  """The held weights cannot take this update; only a keyframe can bring them back."""


class WeightsDoNotFit(ValueError):
  """A keyframe whose tensors (names or shapes), or an update whose publishing model's config
  fields, are not this worker's model's: the worker was given another model than the
  trainer publishes. No update can mend that."""


class HeldBits(nnx.Param):
  """A held weight stored as its bit pattern (uint16 for bf16, uint8 for int8): read and
  written as values (`var[...]`; set_value casts to the held dtype); `get_raw_value()` is
  the bits, which updates patch in place. Inside a jitted forward the bitcast fuses into
  the weight's consumer."""

  def get_value(self, **kwargs):
    value = super().get_value(**kwargs)
    if isinstance(value, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(value.shape, VALUE_OF[jnp.dtype(value.dtype)])
    return values_of(value)

  def set_value(self, value, **kwargs):
    bits = jnp.dtype(self.get_raw_value().dtype)
    value = jnp.asarray(value)
    if value.dtype != bits:  # values of any dtype: cast to the held one, stored as its bits
      value = bits_of(value.astype(VALUE_OF[bits]))
    super().set_value(value, **kwargs)


def _held_bits(model: nnx.Module, shardings: dict | None = None) -> nnx.Module:
  """`model` (built under nnx.eval_shape) with its params as HeldBits of the bit dtype, each
  placeholder naming the sharding its keyframe is placed with (`shardings`, by held name)."""
  graphdef, state = nnx.split(model)
  shardings = shardings or {}

  def held(path, v):
    if not isinstance(v, nnx.Param):
      return v
    return HeldBits(jax.ShapeDtypeStruct(
        v.shape, BITS_OF[jnp.dtype(v.dtype)],
        sharding=shardings.get(held_name(".".join(map(str, path))))))

  return nnx.merge(graphdef, nnx.from_flat_state(
      [(path, held(path, v)) for path, v in nnx.to_flat_state(state)]))


def held_shardings(config: ModelConfig, names_shapes: dict, mesh) -> dict:
  """Held name -> NamedSharding on `mesh` of each held tensor: the bf16 model's sharding of
  the weight of that name (fitted to the mesh); an int8 scale follows its codes, less the
  dimension it was taken over."""
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  specs = {held_name(".".join(map(str, path))): (spec, tuple(var.shape)) for (path, spec), (_, var)
           in zip(nnx.to_flat_state(nnx.get_partition_spec(state)), nnx.to_flat_state(state))}
  out = {}
  for name, shape in names_shapes.items():
    spec, base_shape = specs.get(name, (None, None))
    if spec is None and name.endswith(".scale"):  # int8: one scale per output channel/row
      spec, base_shape = specs.get(name[:-len(".scale")], (None, None))
      if spec is not None:
        entries = list(spec) + [None] * (len(base_shape) - len(spec))
        drop = len(base_shape) - 2 if base_shape[:-2] + base_shape[-1:] == shape else -1
        spec = jax.sharding.PartitionSpec(*(entries[:drop] + entries[drop:][1:]))
        base_shape = shape
    if spec is None or tuple(base_shape) != tuple(shape):
      spec = jax.sharding.PartitionSpec()
    out[name] = jax.sharding.NamedSharding(mesh, shd.fit_spec(spec, shape, mesh))
  return out


def _shown(fields: dict, name: str) -> str:
  """A config field's value as an error shows it; a field one side lacks comes from
  another rlax-ps version."""
  return repr(fields[name]) if name in fields else "absent (another rlax-ps version?)"


def _variables(model: nnx.Module) -> dict[str, nnx.Variable]:
  state = nnx.state(model, nnx.Param)
  return {held_name(".".join(map(str, path))): var for path, var in nnx.to_flat_state(state)}


class HeldPolicy:
  """A model (bf16 `Transformer` or `Int8Transformer`) whose weights follow published versions.

  `model` is what the sampler runs (its params are `HeldBits`); `version` is None until a
  keyframe has been applied (and again after a failed update). Compute dtype is
  `config.dtype`. `mesh`: the devices the weights live on, each split as the model's
  sharding says (tensor parallel over the mesh's tensor axis; replicated over data);
  None: the default device.
  `on_device_checks`: check fingerprinted updates on device (True), always by pulling and
  hashing (False), or None: on device unless the weights live on the CPU, where pulling
  is free and xxh3 outruns XLA's CPU fingerprint (4 vs 44 ms for 176 MB: worker_checks.py).
  """

  def __init__(self, config: ModelConfig, fmt: str = "bf16", *,
               on_device_checks: bool | None = None, mesh: jax.sharding.Mesh | None = None):
    if fmt not in FORMATS:
      raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    if on_device_checks not in (None, True, False):
      raise ValueError(f"on_device_checks: expected None, True or False, got "
                       f"{on_device_checks!r}")
    self.fmt = fmt
    self.on_device_checks = on_device_checks
    self.model_fields = config.forward_fields()  # what publishers' fields must equal
    cls = Transformer if fmt == "bf16" else Int8Transformer
    held_config = config.replace(param_dtype="bfloat16", lora_dtype="bfloat16")
    shapes = nnx.eval_shape(lambda: cls(held_config, rngs=nnx.Rngs(0)))
    self._layout = {name: var.get_raw_value() for name, var in _variables(shapes).items()}
    self.mesh = mesh
    self.shardings = None if mesh is None else held_shardings(
        held_config, {name: tuple(x.shape) for name, x in self._layout.items()}, mesh)
    self.model = _held_bits(shapes, self.shardings)
    self._vars = _variables(self.model)
    self._checksums: dict[str, int] = {}  # of held tensors, filled as they are verified
    self._fingerprints: dict[str, int] = {}  # likewise, where checked on device
    self._patcher = Patcher()
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
    """name -> held bit array (uint16 for bf16, uint8 for int8), as held (no copy)."""
    return {name: var.get_raw_value() for name, var in self._vars.items()}

  def apply(self, update: Update, *, verify: bool = True) -> None:
    """Bring the held weights to `update.version` in place (keyframe or delta).

    Raises ResyncNeeded when the update does not apply to what is held (format, base
    version, tensor names or shapes) or the result fails the update's seal, and
    WeightsDoNotFit (nothing changed) for an update made by another model.
    """
    try:
      self._apply(update, verify)
    except (CodecError, ResyncNeeded) as e:
      self.version = None
      raise e if isinstance(e, ResyncNeeded) else ResyncNeeded(str(e)) from e

  def _apply(self, update: Update, verify: bool) -> None:
    if update.fmt != self.fmt:
      raise ResyncNeeded(f"update format: expected {self.fmt!r}, got {update.fmt!r}")
    self.check_model(update)
    if update.is_keyframe:
      self.check_fits(update)
    if not update.is_keyframe and update.base_version != self.version:
      raise ResyncNeeded(f"update {update.version} is a delta from version {update.base_version}; "
                         f"held version is {self.version}")
    if update.header.tensors is None:  # a delta names its tensors by the held layout
      update.bind(self._layout)
    # A keyframe replaces everything, a delta patches what is held; an older version's
    # leftovers would be caught by the seal check below. Either, failing half-way (the
    # device out of memory), leaves a mix of versions: none is held until it is whole.
    self.version = None
    held, changed = self.held_state(), None
    try:
      changed = self._patcher.apply(held, update)
    finally:  # what was patched before an error is held (its old buffers are gone)
      for name, var in self._vars.items():
        if held[name] is not var.get_raw_value():
          var.set_raw_value(held[name])
          if changed is None or name in changed:
            self._checksums.pop(name, None)
            self._fingerprints.pop(name, None)
    if verify:
      self._verify(update, list(update.tensors))
    self.version = update.version

  def check_model(self, update: Update) -> None:
    """WeightsDoNotFit naming every differing field and both values, unless the model that
    published `update` has this worker's forward fields (ModelConfig.forward_fields; one an
    older publisher lacks, at its default); an update that carries none (one not given its
    model) passes."""
    published, own = update.model, self.model_fields
    if published is None:
      return
    # A field an older publisher did not know counts as its default, which it computed with.
    published = {**{n: v for n, v in ModelConfig.absent_defaults(published).items()
                    if n in own}, **published}
    odd = sorted(n for n in published.keys() | own.keys()
                 if n not in published or n not in own or published[n] != own[n])
    if not odd:
      return
    what = "; ".join(f"model.{n}: published {_shown(published, n)}, this worker's "
                     f"{_shown(own, n)}" for n in odd)
    raise WeightsDoNotFit(
        f"the published weights (version {update.version}) do not fit this worker's model: "
        f"{what}; give the worker the trainer's config (its model section, or the same "
        f"init_from_hf)")

  def check_fits(self, keyframe: Update) -> None:
    """WeightsDoNotFit, naming the first tensor that differs and its shapes, unless the
    keyframe's tensors are this model's, name for name and shape for shape."""
    published = {name: tuple(meta.shape) for name, meta in keyframe.tensors.items()}
    held = {name: tuple(x.shape) for name, x in self._layout.items()}
    odd = sorted(n for n in published.keys() | held.keys() if published.get(n) != held.get(n))
    if not odd:
      return
    name = odd[0]
    if name not in held:
      what = f"tensor {name!r} {list(published[name])} is published, not in this model"
    elif name not in published:
      what = f"tensor {name!r} {list(held[name])} of this model is not published"
    else:
      what = (f"tensor {name!r} is published {list(published[name])}, "
              f"{list(held[name])} in this model")
    raise WeightsDoNotFit(
        f"the published weights (version {keyframe.version}) do not fit this worker's model: "
        f"{what} ({len(odd)} of {len(published.keys() | held.keys())} tensors differ); give "
        f"the worker the trainer's config (its model section, or the same init_from_hf)")

  def _checks_on_device(self) -> bool:
    if self.on_device_checks is not None:
      return self.on_device_checks
    held = next((x for x in (v.get_raw_value() for v in self._vars.values())
                 if isinstance(x, jax.Array)), None)
    return held is not None and next(iter(held.devices())).platform != "cpu"

  def _verify(self, update: Update, names) -> None:
    """CodecError unless the held tensors `names` are what `update` makes: by fingerprints
    on device where the update has them and checks run there, else by checksums."""
    if update.fingerprinted and self._checks_on_device():
      todo = {name: self._vars[name].get_raw_value() for name in names
              if name not in self._fingerprints}
      self._fingerprints.update(fingerprints_of(todo))
      update.check_fingerprints({name: self._fingerprints[name] for name in names})
    else:
      update.verify_all(self._checksums_of(names))

  def _checksums_of(self, names) -> dict[str, int]:
    """name -> checksum of each held tensor: kept from when it last changed, else pulled
    and hashed, side by side on the host's cores (pulls and xxh3 release the GIL)."""
    todo = [name for name in names if name not in self._checksums]
    tasks = [(self._vars[name].get_raw_value().size,
              functools.partial(self._pulled_checksum, name))
             for name in todo]
    # Across processes a pull gathers from every one: in one order everywhere, one thread.
    threads = parallel.resolve(None) if jax.process_count() == 1 else 1
    self._checksums.update(zip(todo, parallel.run(tasks, threads)))
    return {name: self._checksums[name] for name in names}

  def digest(self) -> int:
    """sync.state_digest of the held weights, each tensor pulled and hashed afresh: equals
    the publisher's digest of the same version when the copy is exact."""
    return state_digest({name: self._pulled_checksum(name) for name in self._vars})

  def _pulled_checksum(self, name: str) -> int:
    return checksum(np.asarray(shd.to_host(self._vars[name].get_raw_value())))

  def verify_all(self, update: Update) -> None:
    """Check every held tensor afresh (on device or pulled, as apply would) against
    `update`'s seal (e.g. after a restart); raises CodecError naming the tensor."""
    self._checksums.clear()
    self._fingerprints.clear()
    self._verify(update, list(self._vars))
