"""PPO's critic beside the policy (loss.advantage="gae"): a value model trained on the returns
of the rollouts the policy trains on, as verl's critic is.

Each step: the critic's values of the batch (before either update) give GAE's advantages,
which the policy step whitens and trains on, and the returns, which the critic regresses
on with verl's clipped value loss (`critic.value_clip` around the values the advantages came
from), `rl.updates_per_batch` times and over `rl.micro_batches` slices of rows as the policy
does. It starts from the policy's weights (its body; a zero value head) and is checkpointed
with it. A LoRA policy's critic is LoRA too: its own adapters and head over the policy's
frozen weights, read from the policy at each call rather than copied (a full critic would
hold a second model and its optimizer moments), or over critic.init_from_hf's weights, held
frozen beside it and read from the folder again on a restart (never checkpointed).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from algorithms import losses
from rlax_ps import optim
from rlax_ps import sharding as shd
from rlax_ps.models.config import ModelConfig
from rlax_ps.models.value_model import (ValueModel, critic_config, packed_values,
                                        source_config, source_params)
from rlax_ps.train.rl_loss import (LossConfig, gae_targets, needs_reference, reference_logprobs,
                                   token_mask)
from rlax_ps.train.state import TrainState, fresh_adapters, state_shardings
from rlax_ps.train.step import apply_gradients, jit_step
from rlax_ps.train.trainable import join, split_as, split_trainable

CRITIC_FIELDS = ("optimizer", "value_clip", "warmup_steps", "init_from_hf")
# What the critic's state holds, as the checkpoint's metadata records it: a model of its own,
# or (a LoRA run's) adapters and head over the policy's frozen weights or over those of
# critic.init_from_hf.
LAYOUTS = ("full", "adapters", "adapters over init_from_hf")
# The policy's LoRA settings, which its critic takes (its adapters over its own base too).
_LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dtype", "lora_targets")


def check_critic_config(block, total_steps: int) -> dict[str, Any]:
  """The `critic` block as a dict, checked: its optimizer (the optimizer block's fields),
  value_clip (>= 0, or None: unclipped, as inf, which a flag can give, is read), warmup_steps (the first steps, which train the
  critic alone: below rl.steps) and init_from_hf (a path, or "": the policy's weights); a
  ValueError names the field."""
  d = block.to_dict() if hasattr(block, "to_dict") else dict(block or {})
  unknown = sorted(set(d) - set(CRITIC_FIELDS))
  if unknown:
    raise ValueError(f"critic: unknown fields {unknown}; known: {sorted(CRITIC_FIELDS)}")
  try:
    optim.check_optimizer_config(d.get("optimizer") or {}, total_steps)
  except ValueError as e:
    raise ValueError(f"critic.{e}") from None
  clip = d.get("value_clip", 0.5)
  if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                           or not clip >= 0):
    raise ValueError(f"critic.value_clip: expected a clip range >= 0 around the old values "
                     f"(None or inf: unclipped), got {clip!r}")
  if clip == float("inf"):  # (--config.critic.value_clip=inf: a flag cannot give None)
    d["value_clip"] = None
  warmup = d.get("warmup_steps", 0)
  if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < total_steps:
    raise ValueError(f"critic.warmup_steps: expected an int from 0 to rl.steps - 1 "
                     f"({total_steps - 1}): the steps that train the critic alone, got "
                     f"{warmup!r}")
  if not isinstance(d.get("init_from_hf", ""), str):
    raise ValueError(f"critic.init_from_hf: expected an HF checkpoint folder ('': the "
                     f"policy's weights), got {d['init_from_hf']!r}")
  return d


def check_critic_source(path: str, tokenizer) -> ModelConfig:
  """The body config of critic.init_from_hf's checkpoint `path`, checked against the
  policy's `tokenizer`, whose ids it reads: a vocabulary at least as large and, where the
  folder ships a tokenizer, the same ids for the same text. A ValueError names the field."""
  from rlax_ps.tokenizers import HFTokenizer, tokenizer_file
  try:
    config = source_config(path)
  except (OSError, ValueError) as e:
    raise ValueError(f"critic.init_from_hf: {e}") from None
  if config.vocab_size < tokenizer.vocab_size:
    raise ValueError(f"critic.init_from_hf: {path!r} has vocab_size {config.vocab_size}, "
                     f"smaller than the policy tokenizer's {tokenizer.vocab_size}")
  if tokenizer_file(path):
    # Text the policy's tokenizer makes of ids spread over its vocabulary, encoded by both.
    ids = range(0, tokenizer.vocab_size, max(1, tokenizer.vocab_size // 4096))
    text = tokenizer.decode(ids, skip_special=True)
    if HFTokenizer(path).encode(text) != tokenizer.encode(text):
      raise ValueError(f"critic.init_from_hf: {path!r} ships a tokenizer that encodes text "
                       f"otherwise than the policy's; the critic reads the policy's ids")
  return config


def value_model(graphdef: nnx.GraphDef, params: dict, base: dict) -> ValueModel:
  """The critic of trainable `params` over frozen body weights `base` (the policy's, or
  critic.init_from_hf's; {} for a full critic, which holds its whole body)."""
  return nnx.merge(graphdef, {**params, "body": join(params["body"], base)})


def critic_loss(params: Any, base: Any, graphdef: nnx.GraphDef, batch: dict,
                total_tokens: jax.Array, *, value_clip: float | None, backend: str = "auto",
                remat: bool = False, replay_routes: bool = True) -> tuple[jax.Array, dict]:
  """(verl's clipped value loss of these rows as a share of the whole batch's token mean:
  their token sum over `total_tokens`, metrics). `batch` carries the `values` the advantages
  came from and the `returns` [rows, N, R]; `base` as value_model's."""
  model = value_model(graphdef, params, base)
  values = packed_values(model, batch, backend=backend, remat=remat,
                         replay_routes=replay_routes)
  r = values.shape[-1]
  returns, old = batch["returns"].reshape(-1, r), batch["values"].reshape(-1, r)
  mask = _tokens(batch)
  tokens = jnp.maximum(jnp.sum(mask), 1.0)
  loss, metrics = losses.value_loss(values.reshape(-1, r), old, returns, mask, clip=value_clip)
  share = tokens / total_tokens
  return loss * share, {"vf_loss": loss * share, "vf_clipfrac": metrics["vf_clipfrac"] * share}


def _tokens(batch: dict) -> jax.Array:
  """[rows * N, R]: the tokens the rows' real samples drew (an environment's replies out)."""
  return token_mask(batch, batch["sample_mask"].reshape(-1))


def value_stats(batch: dict) -> dict[str, jax.Array]:
  """The batch's values and returns over its tokens: their means and the share of the
  returns' variance the values explain (verl's critic/vf_explained_var)."""
  mask = _tokens(batch)
  r = mask.shape[-1]
  values, returns = batch["values"].reshape(-1, r), batch["returns"].reshape(-1, r)
  n = jnp.maximum(jnp.sum(mask), 1.0)
  mean = lambda x: jnp.sum(x * mask) / n  # noqa: E731
  var = lambda x: mean((x - mean(x)) ** 2)  # noqa: E731
  return {"value_mean": mean(values), "returns_mean": mean(returns),
          "value_explained_var": 1.0 - var(returns - values) / jnp.maximum(var(returns), 1e-8)}


class Critic:
  """The critic's state on the trainer's mesh and its two jitted calls: `targets` (values and
  returns of a batch) and `update` (its optimizer steps on them). Both take the policy's
  current params: a LoRA critic's frozen body is the policy's, unless it has its own
  (critic.init_from_hf)."""

  def __init__(self, model_config: ModelConfig, block, mesh, *, total_steps: int,
               loss_cfg: LossConfig, policy_graphdef: nnx.GraphDef, updates_per_batch: int = 1,
               micro_batches: int = 1, tokenizer=None,
               saved_schedule: dict | None = None, step: int = 0):
    """`saved_schedule`, `step`: the critic's lr schedule in the checkpoint resumed and its
    step (optim.resumed_optimizer_config: a changed rl.steps keeps its decay horizon, as the
    policy's does)."""
    d = check_critic_config(block, total_steps)
    # critic.init_from_hf: a model of its own (checked against the policy's `tokenizer`),
    # in the policy's dtypes and with its LoRA settings; else the policy's
    self.init_from_hf = d.get("init_from_hf", "")
    self.config = (check_critic_source(self.init_from_hf, tokenizer).replace(
        param_dtype=model_config.param_dtype, dtype=model_config.dtype,
        **{f: getattr(model_config, f) for f in _LORA_FIELDS})
                   if self.init_from_hf else critic_config(model_config))
    self.value_clip = d.get("value_clip", 0.5)
    self.warmup_steps = d.get("warmup_steps", 0)  # the first steps: the critic's alone
    self.optimizer_config, line = optim.resumed_optimizer_config(
        d.get("optimizer") or {}, total_steps, saved_schedule, step, "rl.steps")
    if line:
      logging.warning("critic: %s", line)
    self.optimizer = optim.make_optimizer(self.optimizer_config, total_steps, updates_per_batch)
    self.schedule = optim.learning_rate_schedule(self.optimizer_config, total_steps)
    self.schedule_settings = optim.schedule_settings(self.optimizer_config, total_steps)
    self.mesh, self.loss_cfg, self.micro = mesh, loss_cfg, micro_batches
    model = nnx.eval_shape(lambda: ValueModel(self.config, rngs=nnx.Rngs(0)))
    self.graphdef, params = nnx.split(model, nnx.Param)
    full, full_specs = params.to_pure_dict(), nnx.get_partition_spec(params).to_pure_dict()
    # Its state: all of it, or (LoRA) its adapters and head; the rest, the policy's or
    # (critic.init_from_hf) its own frozen weights, set by `start`.
    body, self._base_like = split_trainable(full["body"])
    self._abstract_params = {**full, "body": body}
    self._frozen: dict | None = None
    specs = {**full_specs, "body": split_as(full_specs["body"], body)[0]}
    self.layout = LAYOUTS[0 if not self._base_like else 2 if self.init_from_hf else 1]
    abstract = jax.eval_shape(lambda p: TrainState(
        step=jnp.zeros((), jnp.int32), params=p, opt_state=self.optimizer.init(p),
        rng=jax.random.PRNGKey(0)), self._abstract_params)
    self.shardings = state_shardings(abstract, specs, mesh)
    self._abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  abstract, self.shardings)
    self.state: TrainState | None = None
    # jit(fn)(params, base, batch, ref_params, kl_beta) -> (values, returns, ref_logp);
    # jit(fn)(state, base, batch) -> (state, metrics), the state donated: what the trainer
    # compiles ahead per shape (`base`: self.base of the policy's params).
    self.targets_fn = self._make_targets(policy_graphdef)
    self.update_fn = self._make_update(updates_per_batch, micro_batches)

  def abstract_tree(self) -> dict[str, Any]:
    """The checkpoint's critic entry as a restore target (shapes, dtypes, shardings)."""
    return self._abstract.to_tree()

  def base(self, policy_params: Any) -> dict:
    """The frozen body weights of a LoRA critic: its own (critic.init_from_hf's) or those it
    reads from the policy's `policy_params` (of the policy's current state: its step donates
    the last); {} for a full critic."""
    if self._frozen is not None:
      return self._frozen
    return split_as(policy_params, self._base_like)[0] if self._base_like else {}

  def start(self, policy_params: Any, restored: dict[str, Any] | None = None,
            seed: int = 0) -> None:
    """The critic of a checkpoint (`restored`, its critic entry), else a fresh one: that of
    critic.init_from_hf (a LoRA critic: fresh adapters over its weights), or the policy's
    weights for its body (a LoRA critic's: the policy's adapters) and a zero head, copied
    (the policy's step donates its own)."""
    params = None
    if self.init_from_hf and (restored is None or self.layout == LAYOUTS[2]):
      try:
        params = source_params(self.init_from_hf, self.config, self.mesh)
      except (OSError, ValueError) as e:
        raise ValueError(f"critic.init_from_hf: {e}") from None
      if self.layout == LAYOUTS[2]:  # the weights stay frozen beside the adapters' state
        self._frozen = params["body"]
        if restored is None:
          params = {**params, "body": fresh_adapters(self.config, self.mesh, seed)}
    if restored is not None:
      self.state = TrainState.from_tree(restored)
      return
    if params is None:
      params = {**{k: np.zeros(x.shape, x.dtype)  # the value head
                   for k, x in self._abstract_params.items() if k != "body"},
                "body": split_as(policy_params, self._abstract_params["body"])[0]}

    def fresh(params):
      params = jax.tree.map(lambda p, like: p.astype(like.dtype), params,
                            self._abstract_params)
      return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                        opt_state=self.optimizer.init(params),
                        rng=jax.random.fold_in(jax.random.PRNGKey(seed), 1))

    self.state = jax.jit(fresh, out_shardings=self.shardings)(params)

  def targets(self, batch: dict, policy_params: Any, ref_params: Any,
              kl_beta: jax.Array | None = None, fn=None
              ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(values, returns, the frozen reference's log-probs or None) [rows, N, R] of a batch on
    the mesh: loss.kl_in_reward penalizes the returns by `ref_params`' log-probs, at
    coefficient `kl_beta` when adaptive; those log-probs, computed wherever the loss needs
    them, serve the policy's step too. By `fn` (targets_fn compiled for this shape; None:
    targets_fn)."""
    return (fn or self.targets_fn)(self.state.params, self.base(policy_params), batch,
                                   ref_params, kl_beta)

  def update(self, batch: dict, policy_params: Any, fn=None) -> dict[str, jax.Array]:
    """The critic's optimizer steps on a batch carrying its `values` and `returns` (by `fn`,
    as `targets`); their metrics (value_* and the vf_* of the loss, critic_grad_norm,
    critic_lr)."""
    self.state, metrics = (fn or self.update_fn)(self.state, self.base(policy_params), batch)
    return metrics

  def _make_targets(self, policy_graphdef):
    cfg = self.loss_cfg

    def targets(params, base, batch, ref_params, kl_beta):
      model = value_model(self.graphdef, params, base)
      values = jax.lax.stop_gradient(packed_values(
          model, batch, backend=cfg.backend, replay_routes=not self.init_from_hf))
      ref_logp = None
      if needs_reference(cfg):
        ref_logp = reference_logprobs(ref_params, policy_graphdef, batch, cfg, self.micro)
      _, returns, _ = gae_targets({**batch, "values": values}, cfg, ref_logp, kl_beta)
      rows = jax.sharding.NamedSharding(self.mesh, shd.batch_spec(self.mesh, values.shape))
      return tuple(None if x is None else  # as the batch's rows lie
                   jax.lax.with_sharding_constraint(x.reshape(values.shape), rows)
                   for x in (values, returns, ref_logp))

    def on_mesh(*args):
      with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
        return targets(*args)

    return jax.jit(on_mesh)

  def _make_update(self, updates: int, micro: int):
    cfg, graphdef = self.loss_cfg, self.graphdef
    grad_fn = jax.value_and_grad(critic_loss, has_aux=True)
    settings = dict(value_clip=self.value_clip, backend=cfg.backend, remat=cfg.remat,
                    replay_routes=not self.init_from_hf)

    def one_update(state: TrainState, base: dict, batch: dict):
      total = jnp.maximum(jnp.sum(_tokens(batch)), 1.0)
      if micro == 1:
        (_, metrics), grads = grad_fn(state.params, base, graphdef, batch, total, **settings)
      else:  # slice m holds rows m, m + M, ...: each slice's share of the token mean
        slices = jax.tree.map(lambda x: x.reshape(x.shape[0] // micro, micro, *x.shape[1:])
                              .swapaxes(0, 1), batch)

        def body(acc, mb):  # gradients summed in float32, as the policy's (bf16 params)
          (_, m), g = grad_fn(state.params, base, graphdef, mb, total, **settings)
          g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
          return jax.tree.map(jnp.add, acc, (g, m)), None

        zero = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                            (state.params, {"vf_loss": total, "vf_clipfrac": total}))
        (grads, metrics), _ = jax.lax.scan(body, zero, slices)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
      state, metrics = apply_gradients(state, grads, metrics, self.optimizer, self.schedule)
      return state, metrics

    def step(state: TrainState, base: dict, batch: dict):
      if updates == 1:
        state, metrics = one_update(state, base, batch)
      else:
        final, metrics = jax.lax.scan(lambda st, _: one_update(st, base, batch), state, None,
                                      length=updates)
        metrics = jax.tree.map(lambda m: m.mean(0), metrics)
        metrics["lr"] = self.schedule(state.step)  # the step's, which its updates share
        state = final.replace(step=state.step + 1)  # batches, as the policy's step counts
      metrics = {"vf_loss": metrics["vf_loss"], "vf_clipfrac": metrics["vf_clipfrac"],
                 "critic_grad_norm": metrics["grad_norm"], "critic_lr": metrics["lr"],
                 **{"critic_" + k: v for k, v in optim.skip_counts(state.opt_state).items()},
                 **value_stats(batch)}
      return state, metrics

    return jit_step(step, self.shardings, self.mesh)

