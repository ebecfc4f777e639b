"""The SFT loss and the jitted train step, as pure functions the RL trainer reuses.

A batch is a dict of [B, T] arrays: `tokens` (inputs), `targets` (next tokens),
`loss_mask` (1.0 where the target is an answer token or its eos), `positions` and
`segment_ids` (0 = padding; several sequences may share a row when packed).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax_ps import optim, sharding as shd
from rlax_ps.train.state import TrainState
from rlax_ps.train.trainable import join, split_as, split_trainable, trainable_value_and_grad

BATCH_KEYS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")

LossFn = Callable[[Any, nnx.GraphDef, dict], tuple[jax.Array, dict]]


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-token negative log-likelihood [B, T] of `targets` under float32 `logits`."""
  logits = logits.astype(jnp.float32)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - target_logit


def sft_loss_sum(params: Any, graphdef: nnx.GraphDef, batch: dict) -> tuple[jax.Array, dict]:
  """(sum of masked token NLL, {"tokens": mask sum, "correct": greedy hits on masked tokens}).

  Sums rather than means so micro-batches add up to exactly the full-batch gradient.
  """
  model = nnx.merge(graphdef, params)
  logits = model(batch["tokens"], positions=batch["positions"],
                 segment_ids=batch["segment_ids"])
  mask = batch["loss_mask"].astype(jnp.float32)
  nll = token_nll(logits, batch["targets"])
  correct = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
  return jnp.sum(nll * mask), {"tokens": jnp.sum(mask), "correct": jnp.sum(correct * mask)}


def split_micro_batches(batch: dict, num_micro: int) -> dict:
  """[B, ...] -> [num_micro, B / num_micro, ...], micro-batch m holding rows m, m+A, ...

  Interleaving keeps every micro-batch spread over all data shards (rows are sharded in
  contiguous blocks), so no micro-batch lives on a subset of devices.
  """
  def split(x):
    b = x.shape[0]
    if b % num_micro:
      raise ValueError(f"batch size {b} is not divisible by grad_accum_steps={num_micro}")
    x = x.reshape((b // num_micro, num_micro) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)

  return jax.tree.map(split, batch)


def loss_and_grads(params: Any, graphdef: nnx.GraphDef, batch: dict, num_micro: int = 1,
                   loss_sum_fn: LossFn = sft_loss_sum, mesh=None) -> tuple[jax.Array, Any, dict]:
  """Mean masked loss and its gradient over the whole batch, accumulated over micro-batches."""
  grad_fn = trainable_value_and_grad(loss_sum_fn)
  if num_micro == 1:
    (total, aux), grads = grad_fn(params, graphdef, batch)
  else:
    micro = split_micro_batches(batch, num_micro)
    if mesh is not None:
      micro = jax.tree.map(
          lambda x: jax.lax.with_sharding_constraint(
              x, NamedSharding(mesh, P(None, *shd.batch_spec(mesh, x.shape[1:])))), micro)

    def body(carry, mb):
      acc_total, acc_aux, acc_grads = carry
      (t, aux), g = grad_fn(params, graphdef, mb)
      return (acc_total + t, jax.tree.map(jnp.add, acc_aux, aux),
              jax.tree.map(jnp.add, acc_grads, g)), None

    zero_aux = {"tokens": jnp.zeros(()), "correct": jnp.zeros(())}
    init = (jnp.zeros(()), zero_aux, jax.tree.map(jnp.zeros_like, split_trainable(params)[0]))
    (total, aux, grads), _ = jax.lax.scan(body, init, micro)
  denom = jnp.maximum(aux["tokens"], 1.0)
  grads = jax.tree.map(lambda g: g / denom, grads)
  metrics = {"loss": total / denom, "token_accuracy": aux["correct"] / denom,
             "tokens": aux["tokens"]}
  return total / denom, grads, metrics


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    state_shardings: TrainState, mesh, *, num_micro: int = 1,
                    schedule: optax.Schedule | None = None,
                    loss_sum_fn: LossFn = sft_loss_sum) -> Callable[[TrainState, dict],
                                                                    tuple[TrainState, dict]]:
  """jit(step)(state, batch) -> (new state, metrics), state donated and kept on its shardings."""

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    _, grads, metrics = loss_and_grads(state.params, graphdef, batch, num_micro, loss_sum_fn,
                                       mesh)
    return apply_gradients(state, grads, metrics, optimizer, schedule)

  return jit_step(step, state_shardings, mesh)


def apply_gradients(state: TrainState, grads: Any, metrics: dict,
                    optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule | None = None) -> tuple[TrainState, dict]:
  """One optax update of `state` (step + 1, RNG split); adds grad_norm, lr and the
  optimizer's skip counts (optim.skip_counts) to metrics. `grads` are those of the trainable
  params (all of them, or a LoRA run's adapters): the params they cover are updated, the
  rest kept."""
  trainable, frozen = split_as(state.params, grads)
  updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
  params = join(optax.apply_updates(trainable, updates), frozen)
  rng, _ = jax.random.split(state.rng)
  metrics["grad_norm"] = optax.global_norm(grads)
  metrics.update(optim.skip_counts(opt_state))
  if schedule is not None:
    metrics["lr"] = schedule(state.step)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng), metrics


def jit_step(step: Callable, state_shardings: TrainState, mesh) -> Callable:
  """jit(step)(state, *args) -> (new state, metrics) with the state donated.

  Inputs keep the shardings they arrive with (state from `sharded_init`, batch from
  `shard_batch`); outputs are pinned so the state never drifts off its layout. The step is
  traced with the mesh in context: a model may split work over its axes by hand (expert
  parallelism)."""
  replicated = NamedSharding(mesh, P())

  def on_mesh(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return step(*args)

  return jax.jit(on_mesh, out_shardings=(state_shardings, replicated), donate_argnums=(0,))
