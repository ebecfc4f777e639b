"""The train state and its sharded creation.

`sharded_init` builds params and optimizer state directly on the mesh: shapes come from
`jax.eval_shape`, shardings from the model's NNX metadata, and one `jax.jit(init,
out_shardings=...)` materialises every shard where it lives, so the full model never
lands on one device.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlax_ps import sharding as shd
from rlax_ps.checkpoint import Checkpointer
from rlax_ps.models import ModelConfig, Transformer, load_hf_checkpoint
from rlax_ps.models.config import _NOT_FORWARD
from rlax_ps.models.transformer import experts_per_device
from rlax_ps.train.trainable import join, split_trainable


@flax.struct.dataclass
class TrainState:
  """Everything a step changes: params (a pure dict), optimizer state, step and RNG."""

  step: jax.Array  # int32 scalar: updates applied so far.
  params: Any  # Nested dict of arrays, the model's nnx.Param values.
  opt_state: Any  # optax state for `params`.
  rng: jax.Array  # uint32[2] raw PRNG key, split once per step.

  def to_tree(self) -> dict[str, Any]:
    """Plain dict form, the one checkpoints hold."""
    return {"step": self.step, "params": self.params, "opt_state": self.opt_state,
            "rng": self.rng}

  @classmethod
  def from_tree(cls, tree: dict[str, Any]) -> "TrainState":
    return cls(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"],
               rng=tree["rng"])


def mesh_layout(config: ModelConfig, mesh: Mesh) -> str:
  """One line for the log: the mesh, and how an MoE's experts lie on it."""
  line = f"mesh {dict(mesh.shape)}"
  if not config.num_experts:
    return line
  per = experts_per_device(config.expert_parallel, config.num_experts, mesh)
  if per:
    return f"{line}; expert parallel: {per} whole experts a device, tokens sent to them"
  if config.expert_parallel:  # (check_expert_parallel: fsdp is 1)
    return f"{line}; expert parallel idle (fsdp=1): every expert on each device"
  return line


def check_expert_parallel(config: ModelConfig, mesh: Mesh) -> None:
  """ValueError naming model.expert_parallel where the mesh's fsdp axis (> 1) does not
  divide the experts: expert parallelism takes the experts' matrices off fsdp for whole
  experts a device, so no split at all would be left and each device would hold them all."""
  fsdp = dict(mesh.shape).get("fsdp", 1)
  if config.expert_parallel and config.num_experts and fsdp > 1 and config.num_experts % fsdp:
    raise ValueError(f"model.expert_parallel: mesh.fsdp={fsdp} does not divide the model's "
                     f"{config.num_experts} experts, so each device would hold every expert "
                     f"whole; expected an fsdp size that divides {config.num_experts}, or "
                     f"model.expert_parallel=False (experts split along their matrices)")


def abstract_model(config: ModelConfig) -> tuple[nnx.GraphDef, Any, Any]:
  """(graphdef, abstract params as a pure dict, their PartitionSpecs) with no allocation."""
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise ValueError(f"model state: expected only nnx.Param variables, also found "
                     f"{list(rest.to_pure_dict())}")
  specs = nnx.get_partition_spec(params).to_pure_dict()
  return graphdef, params.to_pure_dict(), specs


def make_init_fn(config: ModelConfig, optimizer: optax.GradientTransformation
                 ) -> Callable[[jax.Array], TrainState]:
  """seed key -> a fresh TrainState (params from the model's initializers)."""

  def init(key: jax.Array) -> TrainState:
    param_key, train_key = jax.random.split(key)
    model = Transformer(config, rngs=nnx.Rngs(params=param_key))
    params = nnx.state(model, nnx.Param).to_pure_dict()
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(split_trainable(params)[0]), rng=train_key)

  return init


_SAID: set[str] = set()


def state_shardings(abstract_state: TrainState, param_spec_tree: Any, mesh: Mesh) -> TrainState:
  """NamedShardings for every leaf: params per their (fitted) NNX specs, optimizer moments
  like their params, step/RNG/counters replicated."""
  pspecs = shd.param_specs(abstract_state.params, param_spec_tree, mesh)
  note = shd.replication_note(abstract_state.params, param_spec_tree, mesh)
  if note is not None and note not in _SAID and jax.process_index() == 0:
    _SAID.add(note)  # (said once: the state's shardings are asked for more than once)
    logging.warning("%s", note)
  specs = TrainState(
      step=P(), params=pspecs,
      opt_state=shd.follow_param_specs(abstract_state.opt_state, abstract_state.params, pspecs),
      rng=P())
  return shd.named(mesh, specs)


def sharded_init(config: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh,
                 seed: int) -> tuple[TrainState, TrainState, nnx.GraphDef]:
  """(state on the mesh, its shardings, the model graphdef) for a fresh run."""
  graphdef, _, spec_tree = abstract_model(config)
  init = make_init_fn(config, optimizer)
  key = jax.random.PRNGKey(seed)
  abstract = jax.eval_shape(init, key)
  shardings = state_shardings(abstract, spec_tree, mesh)
  key = jax.device_put(key, NamedSharding(mesh, P()))
  state = jax.jit(init, out_shardings=shardings)(key)
  return state, shardings, graphdef


def abstract_state(config: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh
                   ) -> TrainState:
  """Shapes, dtypes and shardings of a TrainState on `mesh` (a restore target)."""
  _, _, spec_tree = abstract_model(config)
  abstract = jax.eval_shape(make_init_fn(config, optimizer), jax.random.PRNGKey(0))
  shardings = state_shardings(abstract, spec_tree, mesh)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings)


def state_from_params(params: Any, optimizer: optax.GradientTransformation,
                      shardings: TrainState, seed: int) -> TrainState:
  """A step-0 TrainState around given params (e.g. a pretrained checkpoint), with the
  optimizer state created directly on its shardings."""
  params = jax.device_put(params, shardings.params)
  opt_state = jax.jit(lambda p: optimizer.init(split_trainable(p)[0]),
                      out_shardings=shardings.opt_state)(params)
  _, train_key = jax.random.split(jax.random.PRNGKey(seed))
  return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), shardings.step),
                    params=params, opt_state=opt_state,
                    rng=jax.device_put(train_key, shardings.rng))


def hf_params(model_config: ModelConfig, mesh: Mesh, path: str, seed: int = 0) -> Any:
  """The params (a pure dict, sharded on `mesh`) of the HF checkpoint folder `path`; a LoRA
  config adds fresh adapters (B = 0: the model is still the checkpoint's). ValueError naming
  init_from_hf where its tensors do not fit its config (a shape, a dtype)."""
  try:
    model = load_hf_checkpoint(path, model_config.param_dtype,
                               compute_dtype=model_config.dtype, mesh=mesh)
  except ValueError as e:
    raise ValueError(f"init_from_hf: HF checkpoint {path!r}: {e}") from None
  params = nnx.state(model, nnx.Param).to_pure_dict()
  if not model_config.lora_rank:
    return params
  return join(fresh_adapters(model_config, mesh, seed), params)


def fresh_adapters(config: ModelConfig, mesh: Mesh, seed: int) -> Any:
  """A LoRA config's adapters as its initializers make them, on their shardings (the rest
  of the model is traced, never computed: only the adapters are outputs)."""
  _, abstract, spec_tree = abstract_model(config)
  specs = split_trainable(shd.param_specs(abstract, spec_tree, mesh))[0]

  def init(key):
    model = Transformer(config, rngs=nnx.Rngs(params=key))
    return split_trainable(nnx.state(model, nnx.Param).to_pure_dict())[0]

  return jax.jit(init, out_shardings=shd.named(mesh, specs))(jax.random.PRNGKey(seed))


def restore_or_init(model_config: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh,
                    checkpointer: Checkpointer, *, init_from_hf: str = "", seed: int = 0
                    ) -> tuple[TrainState, TrainState, nnx.GraphDef, dict | None]:
  """(state, its shardings, graphdef, checkpoint metadata or None): the latest checkpoint
  in `checkpointer` if there is one (its model must be `model_config`), else the weights
  of the HF checkpoint `init_from_hf`, else a fresh sharded init."""
  latest = checkpointer.latest_step()
  if latest is None and init_from_hf:
    graphdef = abstract_model(model_config)[0]
    target = abstract_state(model_config, optimizer, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, target)
    params = hf_params(model_config, mesh, init_from_hf, seed)
    return state_from_params(params, optimizer, shardings, seed), shardings, graphdef, None
  if latest is None:
    return (*sharded_init(model_config, optimizer, mesh, seed), None)
  state, shardings, graphdef, metadata, _ = restore_state(model_config, optimizer, mesh,
                                                          checkpointer, latest)
  return state, shardings, graphdef, metadata


def _is_skipping(x) -> bool:
  return isinstance(x, optax.ApplyIfFiniteState)


def _unwrapped(tree: Any) -> Any:
  """`tree` (a restore target) with each optax.apply_if_finite state replaced by the state
  it wraps: the layout of a checkpoint written before the optimizer was wrapped."""
  return jax.tree.map(lambda x: x.inner_state if _is_skipping(x) else x, tree,
                      is_leaf=_is_skipping)


def _rewrapped(target: Any, restored: Any) -> Any:
  """The state restored as `_unwrapped(target)` says, wrapped again as `target`, the skip
  counts zero (placed as the target's)."""
  def zeros(like):
    return jax.make_array_from_callback(
        like.shape, like.sharding, lambda idx: jnp.zeros(like.shape, like.dtype)[idx])

  def wrap(t, r):
    if isinstance(t, dict):
      return {k: wrap(t[k], r[k]) for k in t}
    if _is_skipping(t):
      return optax.ApplyIfFiniteState(
          notfinite_count=zeros(t.notfinite_count),
          last_finite=jax.make_array_from_callback(
              (), t.last_finite.sharding, lambda idx: jnp.ones((), jnp.bool_)),
          total_notfinite=zeros(t.total_notfinite), inner_state=r)
    return r

  return wrap(target, restored)


def model_changes(saved: dict[str, Any] | None, model_config: ModelConfig
                  ) -> tuple[list[str], dict[str, Any]]:
  """(a line per model field the checkpoint's config `saved` sets otherwise than
  `model_config`, {field: default} of those an older rlax-ps did not write). A field added
  since takes its default, which keeps what the older code built; a field idle in both
  configs (LoRA's targets without LoRA, an MoE's routing without experts) restores alike."""
  if not saved:  # a checkpoint that does not record its model: shapes alone are checked
    return [], {}
  unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(ModelConfig)})
  if unknown:
    return [f"model.{k}: {saved[k]!r} in the checkpoint, a field this rlax-ps does not know "
            f"(a newer one wrote it)" for k in unknown], {}
  added = ModelConfig.absent_defaults(saved)
  was = ModelConfig.from_dict({**saved, **added})
  old, new = (json.loads(json.dumps(c.to_dict())) for c in (was, model_config))
  used = set(was.forward_fields()) | set(model_config.forward_fields()) | set(_NOT_FORWARD)
  return [f"model.{k}: {old[k]!r} in the checkpoint, {new[k]!r} now" for k in sorted(old)
          if old[k] != new[k] and k in used], added


def check_same_model(saved: dict[str, Any] | None, model_config: ModelConfig,
                     directory: str) -> dict[str, Any]:
  """The fields model_changes() says an older checkpoint lacks ({field: default}); ValueError
  naming each changed field where the checkpoint in `directory` (its model config `saved`)
  was written for another model."""
  changed, added = model_changes(saved, model_config)
  if changed:
    raise ValueError(f"model: the checkpoint in {directory} was written for another model "
                     f"({'; '.join(changed)}); resume with its model, or use another workdir")
  return added


def restore_state(model_config: ModelConfig, optimizer: optax.GradientTransformation, mesh: Mesh,
                  checkpointer: Checkpointer, step: int, *, params_like: tuple[str, ...] = (),
                  trees: dict[str, Any] | None = None
                  ) -> tuple[TrainState, TrainState, nnx.GraphDef, dict, dict[str, Any]]:
  """(state, its shardings, graphdef, metadata, {name: tree}) of checkpoint `step`, whose
  model must be `model_config`. `params_like`: the names of more entries its state holds,
  laid out as the params (the RL trainer's mixed reference); `trees`: more entries by name,
  each as its restore target (abstract arrays with their shardings: the RL critic's)."""
  graphdef = abstract_model(model_config)[0]
  saved = checkpointer.metadata(step)
  added = check_same_model(saved.get("model_config"), model_config, checkpointer.directory)
  if added:
    logging.warning("model: the checkpoint in %s predates fields added to the model config "
                    "since; they take their defaults, as the older rlax-ps built it: %s",
                    checkpointer.directory, ", ".join(f"{k}={v!r}" for k, v in added.items()))
  target = abstract_state(model_config, optimizer, mesh)
  trees = trees or {}
  full = dict(target.to_tree(), **{name: target.params for name in params_like}, **trees)
  try:
    tree, metadata = checkpointer.restore(full, step)
  except ValueError as e:  # written before optim.make_optimizer skipped non-finite updates?
    if "laid out otherwise" not in str(e) or _unwrapped(full) == full:
      raise
    try:
      tree, metadata = checkpointer.restore(_unwrapped(full), step)
    except ValueError:
      raise e from None
    tree = _rewrapped(full, tree)
    logging.warning("optimizer: the checkpoint in %s predates the skipping of updates whose "
                    "gradients are not finite; its optimizer state resumes, their counts "
                    "start at 0", checkpointer.directory)
  shardings = jax.tree.map(lambda x: x.sharding, target)
  extras = {name: tree.pop(name) for name in (*params_like, *trees)}
  return TrainState.from_tree(tree), shardings, graphdef, metadata, extras
