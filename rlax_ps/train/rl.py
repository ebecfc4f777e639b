"""The RL trainer: feed prompts, take rollout groups under the staleness bound, train on them
with the packed shared-prompt loss, publish versions, checkpoint, and only then acknowledge
the groups, so each group has exactly one training effect across trainer kills.

`RLTrainer(config, workdir, client).train()` is the job `rlax-ps train` runs. A restart on
the same workdir restores the latest checkpoint (params, optimizer, step, RNG, prompt
stream, version), acknowledges the takes that checkpoint trained on, asks the server for
the groups of the lost steps again, and republishes its weights as a keyframe of the next
version.

On a multi-host slice (jax.distributed initialized) every process runs the trainer on its
devices; process 0, the leader, alone talks to the server (prompts, takes, acks, versions)
and writes the logs, broadcasts each step's batch and its decision to go on or stop, and
alone keeps the host copy of the published weights and encodes them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import signal
import threading
import time
import uuid
from typing import Any, Sequence

import grpc
import jax
import numpy as np
from absl import logging

from algorithms.allocation import DynamicSampler, DynamicSamplingExhausted
from algorithms.selection import fed, next_streak
from algorithms.shaping import soft_overlong_punishment
from param_server.client import (RETRYABLE, ParamServerError, Prompt, RetryPolicy, routes_of,
                                 sample_logprobs, sample_observed, sample_teacher)
from param_server.protos import PROMPT_SEED, SCORE_ERROR
from rlax_ps import chat, optim
from rlax_ps import sharding as shd
from rlax_ps.config_files import save_run_config, write_json
from rlax_ps.tokenizers import Tokenizer
from rlax_ps.train import heldout as heldout_lib
from rlax_ps.train.prompts import (PromptFeed, PromptRecords, TaskPrompts, data_files,
                                   file_parts, file_weights, iter_config_records)
from rlax_ps.train.publisher import Publisher
from rlax_ps.train.rl_checks import (NEW_SOURCE_FED, check_prompt_lengths, check_resumed_updates,
                                     check_rl_config, check_task_prompts, prompt_limit)
from rlax_ps.train.rl_loss import LossConfig, adapt_entropy_coef, adapt_kl_coef, \
  entropy_bonus_coef, logged_advantages, micro_batched_loss_and_grad, needs_reference, \
  ref_sync_settings, reference_logprobs, rl_loss
from rlax_ps.train.rollouts import BatchShape, Group, build_batch, check_group, empty_batch, \
  fit_response_len, response_lens, response_stats
from rlax_ps.train.events import open_jsonl, open_steps_jsonl, read_jsonl
from rlax_ps.train.run import (STOP_SIGNALS, TrainerRun, check_resumed_clipping, data_source,
                               open_checkpointer, prune_exports)
from rlax_ps.train.critic import LAYOUTS, Critic
from rlax_ps.train.state import (TrainState, abstract_model, hf_params, restore_or_init,
                                 restore_state)
from rlax_ps.train.step import apply_gradients, jit_step
from rlax_ps.teacher import Teacher, own_tokenizer, score_retokenized
from rlax_ps.train.trainable import trainable_value_and_grad


def mix_reference(ref_params: Any, params: Any, alpha: float) -> Any:
  """alpha * params + (1 - alpha) * ref_params, leaf by leaf in float32, in the reference's
  dtypes: TRL's reference-model sync (TR-DPO's soft update)."""
  return jax.tree.map(lambda r, p: (alpha * p.astype(np.float32) + (1.0 - alpha) *
                                    r.astype(np.float32)).astype(r.dtype), ref_params, params)


def make_rl_step(graphdef, optimizer, state_shardings: TrainState, mesh, *, num_groups: int,
                 loss_cfg: LossConfig, schedule=None, updates_per_batch: int = 1,
                 micro_batches: int = 1):
  """jit(step)(state, batch, ref_params[, entropy_coef[, kl_beta]]) -> (new state, metrics),
  the state donated. `entropy_coef`: the entropy bonus's coefficient as a float32 scalar
  input (loss.adaptive_entropy: a new value each step, one compile); None or absent:
  loss.entropy_coef. `kl_beta`: loss.kl_in_reward's likewise (loss.kl_target). The frozen
  reference's log-probs, where the loss needs them, are computed once a batch, or taken
  from the batch's `ref_logp` [rows, N, R] (the critic's targets computed them).

  `updates_per_batch` > 1 takes that many optimizer updates on the batch (PPO epochs)
  against proximal log-probs computed once; the state's step still counts batches and the
  metrics are the mean over the updates. `micro_batches` > 1 accumulates each update's
  gradient over that many slices of the batch's rows (the same gradient, a slice's memory)."""
  if updates_per_batch < 1:
    raise ValueError(f"rl.updates_per_batch: expected >= 1, got {updates_per_batch}")
  grad_fn = trainable_value_and_grad(rl_loss)

  def update(state: TrainState, batch: dict, ref_logp, proximal, entropy_coef, kl_beta):
    noise = None  # Clip-Cov's draws, new each update (its state's key is)
    if loss_cfg.policy_loss == "clip_cov":
      r = batch["response_tokens"]
      noise = jax.random.uniform(jax.random.fold_in(state.rng, 1),
                                 (r.shape[0] * r.shape[1], r.shape[2]))
    if micro_batches == 1:
      (_, metrics), grads = grad_fn(state.params, graphdef, batch, None,
                                    num_groups=num_groups, cfg=loss_cfg, proximal=proximal,
                                    entropy_coef=entropy_coef, kl_beta=kl_beta,
                                    ref_logp=ref_logp, noise=noise)
    else:
      (_, metrics), grads = micro_batched_loss_and_grad(
          state.params, graphdef, batch, None, num_groups=num_groups, cfg=loss_cfg,
          micro_batches=micro_batches, proximal=proximal, entropy_coef=entropy_coef,
          kl_beta=kl_beta, ref_logp=ref_logp, noise=noise)
    return apply_gradients(state, grads, metrics, optimizer, schedule)

  def step(state: TrainState, batch: dict, ref_params: Any,
           entropy_coef: jax.Array | None = None,
           kl_beta: jax.Array | None = None) -> tuple[TrainState, dict]:
    batch = dict(batch)
    ref_logp = batch.pop("ref_logp", None)
    if ref_logp is not None:
      ref_logp = ref_logp.reshape(-1, ref_logp.shape[-1])
    elif needs_reference(loss_cfg):  # once, whatever the updates
      ref_logp = reference_logprobs(ref_params, graphdef, batch, loss_cfg, micro_batches)
    if updates_per_batch == 1:
      return update(state, batch, ref_logp, None, entropy_coef, kl_beta)
    # (a pass of rl.micro_batches slices, as the reference's: the whole batch's logits at
    # once ran out of the memory the micro-batches were set to keep)
    proximal = jax.lax.stop_gradient(
        reference_logprobs(state.params, graphdef, batch, loss_cfg, micro_batches))
    final, metrics = jax.lax.scan(
        lambda st, _: update(st, batch, ref_logp, proximal, entropy_coef, kl_beta), state,
        None, length=updates_per_batch)
    metrics = jax.tree.map(lambda m: m.mean(0), metrics)
    metrics.update(optim.skip_counts(final.opt_state))  # the last update's, not a mean
    if schedule is not None:  # the step's: its updates share it (not the mean of the steps
      metrics["lr"] = schedule(state.step)  # the scan counted through)
    return final.replace(step=state.step + 1), metrics

  return jit_step(step, state_shardings, mesh)


def group_of(taken, tokenizer: Tokenizer) -> Group:
  """A taken rollout (param_server TakenRollout) as the trainer's Group."""
  prompt = taken.prompt
  tokens = list(prompt.token_ids) or tokenizer.encode_prompt(prompt.text)
  samples = taken.group.samples
  routed = taken.group.HasField("prompt_routes")
  observed = tuple(sample_observed(s) for s in samples)
  parts, bad = reward_parts_of(samples)
  return Group(rollout_id=int(taken.rollout_id), prompt_tokens=np.asarray(tokens, np.int32),
               responses=tuple(np.asarray(s.token_ids, np.int32) for s in samples),
               behaviour_logp=tuple(sample_logprobs(s) for s in samples),
               rewards=np.asarray([s.reward for s in samples], np.float32),
               policy_version=int(taken.group.policy_version),
               prompt_routes=routes_of(taken.group.prompt_routes) if routed else None,
               response_routes=tuple(routes_of(s.routes) for s in samples) if routed else None,
               observed=observed if any(o is not None for o in observed) else None,
               resumed=_count(taken.group.metadata.get("resumed_samples", "")),
               score_errors=sum(s.metadata.get(SCORE_ERROR) == "1" for s in samples),
               prompt_id=prompt.id,
               passed=_verdicts(samples),
               reward_parts={k: tuple(v) for k, v in parts.items()} or None,
               reward_parts_bad=tuple(bad),
               baseline_reward=(float(taken.group.baseline_reward)
                                if taken.group.HasField("baseline_reward") else None),
               teacher=(tuple(sample_teacher(s) for s in samples)
                        if any(s.teacher_logprobs_f32 for s in samples) else None))


# What a worker samples with, as it says in each group's metadata (a group without a field,
# from an older worker, is let be). Temperature changes the behaviour log-probs the ratios
# divide by; the others what is sampled: top-k/top-p/min-p the distribution, max_new_tokens
# where samples are cut (the overlong penalty and truncation masks judge by the trainer's),
# samples_per_prompt the groups' size (GRPO's advantage of a 1-sample group is 0).
SAMPLING_METADATA = ("temperature", "top_k", "top_p", "min_p", "max_new_tokens",
                     "samples_per_prompt")


def trainer_sampling(worker) -> dict[str, float]:
  """SAMPLING_METADATA as this trainer's `worker` block sets them, for `check_sampling`."""
  return {**heldout_lib.worker_sampling(worker), "max_new_tokens": int(worker.max_new_tokens),
          "samples_per_prompt": int(worker.samples_per_prompt)}


def check_sampling(group, settings: dict[str, float]) -> None:
  """ValueError for a group a worker sampled with other settings than the trainer's worker
  block (`trainer_sampling`): a worker started with its own --temperature, --top_p,
  --max_new_tokens... is named with the field."""
  for name, ours in settings.items():
    said = group.metadata.get(name)
    if said is None:
      continue
    try:
      theirs = float(said)
    except ValueError:
      theirs = math.nan
    if not math.isclose(theirs, ours, rel_tol=1e-6):
      raise ValueError(f"prompt {group.prompt_id}: sampled with {name}={said} by worker "
                       f"{group.metadata.get('worker', '?')!r}, this trainer's "
                       f"worker.{name}={ours:g}; start the workers with the trainer's config "
                       f"(or the same --{name})")


def check_tokenizer(group, identity: str) -> None:
  """ValueError for a group a worker sampled with another tokenizer than the trainer's (its
  `identity` in the group's metadata; none, an older worker's, is let be): its ids are of
  another vocabulary, its rewards scored on another decoding."""
  said = group.metadata.get("tokenizer")
  if said is not None and said != identity:
    raise ValueError(f"prompt {group.prompt_id}: sampled by worker "
                     f"{group.metadata.get('worker', '?')!r} with another tokenizer ({said}) "
                     f"than this trainer's ({identity}: its vocabulary, chat template and "
                     f"chat_kwargs); start the workers with the trainer's config, its "
                     f"--config.tokenizer.* overrides and init_from_hf")


def teacher_shape(loss_cfg, config) -> dict:
  """BatchShape's teacher fields: the teacher's scores the loss takes in the host batch:
  those the workers' teacher (worker.teacher) sends, or a trainer's teacher of another
  tokenizer's (teacher.tokenizer: scored on the host, the text of each response); none
  where the trainer's teacher scores the batch on its devices, or without a teacher."""
  if str((config.get("teacher") or {}).get("tokenizer", "")):
    return dict(teacher_logp=True)
  if not str(config.worker.get("teacher", "")):
    return {}
  return dict(teacher_logp=loss_cfg.advantage == "opd", teacher_topk=loss_cfg.distill_topk)


def _verdicts(samples) -> tuple[bool, ...] | None:
  """The samples' "passed" metadata (the worker's verifier verdicts); None unless every
  sample carries one."""
  marks = [s.metadata.get("passed") for s in samples]
  if not marks or any(m not in ("0", "1") for m in marks):
    return None
  return tuple(m == "1" for m in marks)


def versions_behind(sampled: int, trained: int, saved: int, restarted: int) -> int:
  """How many versions the weights that sampled a group (`sampled`) are from those a step
  trains (`trained`). A restart republished its checkpoint's weights (version `saved`) as
  version `restarted`: a group of the run before counts its way to `saved`, back from the
  lost steps' versions too, then on from `restarted`."""
  if sampled >= restarted:
    return trained - sampled
  return abs(saved - sampled) + trained - restarted


def pass_at_n(groups: list[Group]) -> float | None:
  """The share of groups with a sample its verifier passed, over the groups that carry
  verdicts; None when none does (a reward model's scores only)."""
  judged = [any(g.passed) for g in groups if g.passed is not None]
  return float(np.mean(judged)) if judged else None


REWARD_PART = "reward/"  # sample metadata "reward/<name>": one raw part of its reward


def reward_parts_of(samples) -> tuple[dict[str, list[float]], list[str]]:
  """The samples' reward parts by name (metadata "reward/<name>": the worker's raw task
  verifier, worker.reward_terms and reward model values), and the entries skipped as
  malformed (no name, or not a finite float) as key=value."""
  parts: dict[str, list[float]] = {}
  bad: list[str] = []
  for s in samples:
    for key, text in s.metadata.items():
      if not key.startswith(REWARD_PART):
        continue
      try:
        value = float(text)
      except ValueError:
        value = float("nan")
      name = key[len(REWARD_PART):]
      if name and np.isfinite(value):
        parts.setdefault(name, []).append(value)
      else:
        bad.append(f"{key}={text!r}")
  return parts, bad


def part_values(groups: list[Group]) -> dict[str, list[float]]:
  """The reward parts' values by name over the groups' samples that carry them."""
  values: dict[str, list[float]] = {}
  for group in groups:
    for name, got in (group.reward_parts or {}).items():
      values.setdefault(name, []).extend(got)
  return values


def add_part_totals(totals: dict[str, list[float]], values: dict[str, list[float]]) -> None:
  """Add part_values to the run's [sum, count] of each part (in place)."""
  for name, got in values.items():
    total = totals.setdefault(name, [0.0, 0])
    total[0] += float(np.sum(got))
    total[1] += len(got)


def part_means(totals: dict[str, list[float]]) -> dict[str, float]:
  """summary.json's reward_parts: each part's mean over the run's trained samples that carry
  it (every restart's: the totals are in the checkpoint, as rollout_groups_trained is)."""
  return {name: total / n for name, (total, n) in sorted(totals.items())}


def _count(text: str) -> int:
  """A count a worker wrote as metadata; 0 when absent or not a count."""
  return int(text) if text.isdigit() else 0


def routing_shape(model_config, worker) -> dict[str, int]:
  """BatchShape's routing sizes: the model's when `worker.routing_replay` (the workers send
  each token's experts and the trainer routes by them), else none."""
  if not bool(worker.get("routing_replay", False)):
    return {}
  if not model_config.moe_layers:
    raise ValueError("worker.routing_replay: expected False for a model without "
                     "mixture-of-experts layers (there are no routes to replay)")
  return dict(moe_layers=len(model_config.moe_layers), top_k=model_config.num_experts_per_tok,
              num_experts=model_config.num_experts)


def critic_schedule(metadata: dict[str, Any] | None) -> dict[str, Any] | None:
  """The critic's lr schedule a checkpoint records; for one that records none (written by an
  older rlax-ps), the one its saved config implies; None without a checkpoint or a critic."""
  if not metadata or not metadata.get("critic"):
    return None
  if metadata.get("critic_schedule"):
    return dict(metadata["critic_schedule"])
  config = metadata.get("config") or {}
  steps = (config.get("rl") or {}).get("steps")
  if not isinstance(steps, int):
    return None
  return optim.schedule_settings((config.get("critic") or {}).get("optimizer") or {}, steps)


@dataclasses.dataclass
class PendingTake:
  """A take of rollout groups, acknowledged once a durable checkpoint holds `step`."""

  take_id: str
  rollout_ids: list[int]
  step: int
  prompt_ids: list[str] = dataclasses.field(default_factory=list)  # the groups' (same order)


class StepRate:
  """Samples trained per second over the last `window` steps, as the live line shows it. The
  clock starts with the training loop; the first step's span (step compiles, the workers'
  first samples) counts only until the second step ends."""

  def __init__(self, window: int = 10, now: float | None = None):
    self.marks = collections.deque([(time.monotonic() if now is None else now, 0)],
                                   maxlen=window + 1)
    self.steps = 0

  def add(self, samples: int, now: float | None = None) -> float:
    """Note a step of `samples` samples ending `now`; the rate over the window it closes."""
    self.steps += 1
    if self.steps == 2:  # the loop's start mark goes: from here steady-state steps only
      self.marks.popleft()
    self.marks.append((time.monotonic() if now is None else now, int(samples)))
    span = self.marks[-1][0] - self.marks[0][0]
    return sum(n for _, n in list(self.marks)[1:]) / span if span > 0 else 0.0


# The run totals (RLTrainer attributes) that the checkpoint carries: groups dropped as stale,
# rejected, left out or filled by dynamic sampling, trained groups that came back, the
# malformed reward part values skipped, and servers met that had lost what they held.
COUNTS = ("dropped_stale", "rejected", "filtered", "filled", "came_back",
          "reward_parts_malformed", "servers_lost")
ENQUEUE_BATCH = 1024  # prompts per enqueue call


def sync_summary(fmt: str, log: Sequence[tuple[int, int, float, bool, int]]) -> dict[str, Any]:
  """The summary's sync figures of the publications `log` (version, bytes, seconds, sent as
  a keyframe alone, the bytes of a keyframe sent beside its delta): a scheduled version
  counts as a delta, its keyframe as the last keyframe."""
  deltas = [(b, s) for _, b, s, key, _ in log if not key]
  keys = [b if key else beside for _, b, _, key, beside in log if key or beside]
  return {
      "format": fmt, "versions": len(log),
      "delta_bytes_mean": float(np.mean([b for b, _ in deltas])) if deltas else 0.0,
      "delta_seconds_mean": float(np.mean([s for _, s in deltas])) if deltas else 0.0,
      # The first delta's seconds hold the diff's compile: the median is a delta's cost.
      "delta_seconds_median": float(np.median([s for _, s in deltas])) if deltas else 0.0,
      "keyframe_bytes": keys[-1] if keys else 0,
  }


class TakeTimeout(TimeoutError):
  """rl.take_timeout_s ran out with no group to train on (no fleet, or one that runs another
  config), or the fleet's groups were all rejected for REFUSED_WAIT_S: the run ends,
  checkpointed, with this one line."""


# A fleet run with other settings than the trainer's (a verifier, tokenizer or budget of its
# own) answers every prompt in a blink, the trainer feeding it more at once: it rejected
# hundreds a second for rl.take_timeout_s (up to half an hour), leaving them all to the next
# start. It stops once the groups of this start were rejected REFUSED_IN_A_ROW times in a row
# (at least; 4 steps' worth) with no trainable group for REFUSED_WAIT_S (at most
# rl.take_timeout_s): one worker of another config among good ones, slower, stops nothing.
REFUSED_IN_A_ROW = 64
REFUSED_WAIT_S = 120.0


class RLTrainer(TrainerRun):
  """Owns one RL run: mesh, state, jitted step, prompt feed, publisher, checkpoints, logs.
  `client` is the server's client on the leader (process 0) and None on the other
  processes of a multi-host slice."""

  def __init__(self, config, workdir: str, client, *, devices=None):
    self.config, self.client = config, client
    if (client is None) == self.leader:
      raise ValueError(f"client: expected one on process 0 only, process "
                       f"{jax.process_index()} got {client!r}")
    self.open_workdir(workdir, lambda: self._build(config, devices))

  def _build(self, config, devices) -> None:
    """The trainer's parts, built once it holds its workdir."""
    rl = config.rl
    self.loss_cfg = check_rl_config(config, files=False)  # the files are read below
    self.read_model(config)
    # A response of the whole budget that ends on a stop id stopped; else it was cut.
    self.loss_cfg = dataclasses.replace(self.loss_cfg, stop_ids=tuple(self.tokenizer.stop_ids))
    self.total_steps = int(rl.steps)
    self.max_staleness = int(rl.max_staleness)
    self.publish_every = int(rl.publish_every)
    self.shape = BatchShape(groups=int(rl.groups_per_step),
                            samples=int(config.worker.samples_per_prompt),
                            prompt_len=int(rl.max_prompt_tokens),
                            response_len=int(config.worker.max_new_tokens),
                            reward_parts=tuple(n for n, _ in self.loss_cfg.reward_parts),
                            baselines=self.loss_cfg.advantage == "remax",
                            **teacher_shape(self.loss_cfg, config),
                            **routing_shape(self.model_config, config.worker))
    # A step's rows are packed to the smallest of these many capacities (the budget, half
    # of it, ...) that holds its longest response.
    self.response_buckets = int(rl.get("response_buckets", 1))
    self.micro_batches = int(rl.get("micro_batches", 1))
    self.dynamic = _dynamic_sampler(config, self.shape.samples)
    # The fixed allocator's groups hold worker.samples_per_prompt samples (VIGOR's vary)
    self.fixed_groups = str(config.worker.get("allocator", "fixed")) == "fixed"
    self.sampling = trainer_sampling(config.worker)
    self.left_out: list[Group] = []  # the last step's groups dynamic sampling left out
    self.tokenizer_identity = self.tokenizer.identity
    if needs_reference(self.loss_cfg) and not self.init_from_hf:
      field = "loss.kl_coef" if self.loss_cfg.kl_coef > 0 else "loss.kl_in_reward"
      raise ValueError(f"{field}: a KL term needs a reference policy; set init_from_hf")
    self.ref_sync_steps, ref_alpha = ref_sync_settings(rl, self.loss_cfg,
                                                       self.model_config.lora_rank)
    self.mesh = shd.make_mesh(config.mesh.to_dict(), devices)
    self.check_mesh()
    self.teacher = None  # distillation's (loss.advantage="opd", loss.distill_topk)
    self.teacher_tokenizer = None  # teacher.tokenizer's: None, the policy's ids
    if str((config.get("teacher") or {}).get("path", "")):  # else on the workers, or none
      own = str(config.teacher.get("tokenizer", ""))
      if own:
        if jax.process_count() > 1:  # the leader alone holds the groups' texts
          raise ValueError(f"teacher.tokenizer: a trainer of {jax.process_count()} processes "
                           f"cannot score responses as text; expected '' (a teacher of the "
                           f"policy's tokenizer), or the teacher on the workers "
                           f"(worker.teacher, worker.teacher_tokenizer)")
        self.teacher_tokenizer = own_tokenizer(own, self.tokenizer, "teacher.tokenizer")
      self.teacher = Teacher(str(config.teacher.path), self.mesh,
                             vocab_size=(self.teacher_tokenizer or self.tokenizer).vocab_size,
                             dtype=self.model_config.dtype, backend=self.loss_cfg.backend,
                             logits_chunk=self.loss_cfg.logits_chunk,
                             sampled=self.loss_cfg.advantage == "opd",
                             topk=self.loss_cfg.distill_topk,
                             tokenizer=self.teacher_tokenizer or self.tokenizer,
                             retokenized=bool(own))
    # What a taken group brings: not the scores a teacher of another tokenizer adds here.
    self.taken_shape = (self.shape if self.teacher_tokenizer is None
                        else dataclasses.replace(self.shape, teacher_logp=False))
    self.warn_unsplit_rows(self.shape.groups, self.micro_batches,  # a packed row per group
                           f"rl.groups_per_step={self.shape.groups}, "
                           f"rl.micro_batches={self.micro_batches}")
    # Its records checked before any checkpoint is opened.
    source, recorded, parts = self._prompt_source()
    self.checkpointer = open_checkpointer(config, self.workdir)
    latest = self.checkpointer.latest_metadata()
    self.note_resumed_init(latest)
    self.new_source = self.check_data_source(  # True: fed from its start (_load_metadata)
        latest, recorded, NEW_SOURCE_FED)
    check_resumed_updates(latest, int(rl.get("updates_per_batch", 1)))
    self.build_optimizer(latest, "rl.steps", int(rl.get("updates_per_batch", 1)))
    self.critic = None  # loss.advantage="gae": PPO's critic beside the policy
    if self.loss_cfg.advantage == "gae":
      self.critic = Critic(self.model_config, config.get("critic") or {}, self.mesh,
                           total_steps=self.total_steps, loss_cfg=self.loss_cfg,
                           policy_graphdef=abstract_model(self.model_config)[0],
                           updates_per_batch=int(rl.get("updates_per_batch", 1)),
                           micro_batches=self.micro_batches, tokenizer=self.tokenizer,
                           saved_schedule=critic_schedule(latest),
                           step=int((latest or {}).get("step", 0)))
    held = {}  # a reference mixed with the policy (rl.ref_sync_steps), the critic, as saved
    if self.critic is None and latest is not None and latest.get("critic"):
      raise ValueError(f"loss.advantage: the checkpoint in {self.checkpointer.directory} holds "
                       f"a critic (its run had loss.advantage='gae'), got "
                       f"{self.loss_cfg.advantage!r}; resume with 'gae', or use another workdir")
    # The critic a checkpoint holds: one of critic.LAYOUTS (True: "full", as written before
    # LoRA critics), or none; one of another layout is not restored.
    saved_critic = (latest or {}).get("critic")
    saved_critic = "full" if saved_critic is True else saved_critic
    if self.critic is not None and saved_critic not in (None, self.critic.layout):
      raise ValueError(f"critic: the checkpoint in {self.checkpointer.directory} holds a "
                       f"critic of layout {saved_critic!r}, this run's is "
                       f"{self.critic.layout!r} (a LoRA run's critic: adapters of its own over "
                       f"the policy's weights, or over critic.init_from_hf's); resume it with "
                       f"the settings and the rlax-ps that wrote it, or use another workdir")
    critic_saved = self.critic is not None and saved_critic is not None
    if critic_saved and latest.get("config"):  # (its optimizer block: absent, the defaults)
      was = (latest["config"].get("critic") or {}).get("optimizer") or {}
      check_resumed_clipping(was, (config.get("critic") or {}).get("optimizer") or {},
                             latest, "critic.optimizer")
      was = (latest["config"].get("critic") or {}).get("init_from_hf", "")
      if self.critic.layout == LAYOUTS[2] and was != self.critic.init_from_hf and self.leader:
        logging.warning(
            "critic.init_from_hf: %r in the checkpoint (step %s), %r now: the critic's "
            "adapters and value head resume over the weights of %r, which they were not "
            "trained over. Use another --workdir to start a critic from it", was,
            latest.get("step", "?"), self.critic.init_from_hf, self.critic.init_from_hf)
    if latest is not None and (latest.get("mixed_reference") or critic_saved):
      self.state, self.shardings, self.graphdef, saved, held = restore_state(
          self.model_config, self.optimizer, self.mesh, self.checkpointer,
          self.checkpointer.latest_step(),
          params_like=("ref_params",) if latest.get("mixed_reference") else (),
          trees={"critic": self.critic.abstract_tree()} if critic_saved else None)
    else:
      self.state, self.shardings, self.graphdef, saved = restore_or_init(
          self.model_config, self.optimizer, self.mesh, self.checkpointer,
          init_from_hf=self.init_from_hf, seed=int(config.seed))
    self.ref_params = None
    if needs_reference(self.loss_cfg):  # the checkpoint's mixed reference, else the warm start
      self.ref_params = held.get("ref_params")
      if self.ref_params is None:
        self.ref_params = jax.device_put(hf_params(self.model_config, self.mesh,
                                                   self.init_from_hf), self.shardings.params)
    if self.critic is not None:
      if latest is not None and not critic_saved and self.leader:
        logging.warning("critic: the checkpoint in %s holds none (its run had no "
                        "loss.advantage='gae'); it starts from the policy's weights",
                        self.checkpointer.directory)
      self.critic.start(self.state.params, held.get("critic"), int(config.seed))
    # Once mixed, the reference is no longer the warm start: the checkpoints carry it.
    self.mixed_reference = self.ref_params is not None and bool(
        self.ref_sync_steps or "ref_params" in held)  # (held: the critic too)
    self._mix_reference = jax.jit(lambda ref, params: mix_reference(ref, params, ref_alpha),
                                  out_shardings=self.shardings.params, donate_argnums=0)
    self.rl_step = make_rl_step(self.graphdef, self.optimizer, self.shardings, self.mesh,
                                num_groups=self.shape.groups, loss_cfg=self.loss_cfg,
                                schedule=self._policy_schedule(),
                                updates_per_batch=int(rl.get("updates_per_batch", 1)),
                                micro_batches=self.micro_batches)
    # The step compiled ahead for each response capacity (_precompile), by batch shape.
    self._compiles: dict[tuple[int, int], concurrent.futures.Future] = {}
    # The critic's targets_fn and update_fn likewise (loss.advantage="gae").
    self._critic_compiles: dict[str, dict[tuple[int, int], concurrent.futures.Future]] = {
        "targets": {}, "update": {}}
    self._compiler = None
    self.precompiled_steps = 0  # steps that ran a step compiled ahead
    self.precompiled_critic_steps = 0  # and the critic's programs too
    self.source = source
    self.feed = PromptFeed(source, int(config.seed), parts)
    self.revisit = (float(rl.get("revisit_solved", 1.0)), float(rl.get("revisit_failed", 1.0)))
    self.selective = self.revisit != (1.0, 1.0)
    self.publisher = Publisher(self.client, str(config.publish.format),
                               int(config.publish.keyframe_every), model=self.model_config)
    self.run_id = hashlib.blake2b(self.workdir.encode(), digest_size=4).hexdigest()
    # How many times data.allow_new_source replaced the source: part of the prompt ids past
    # the first, so a new source's never meet those the old one fed after the checkpoint.
    self.source_tag = 0
    self.publisher.run = self.run_id
    if self.leader:  # where `rlax-ps export --workdir` finds the checkpoints (gs:// too)
      save_run_config(config, self.workdir)
    self.heldout = heldout_lib.heldout_from_config(config, self.tasks, self.tokenizer)
    self.warn_heldout_overlap(r["prompt"] for r in source)
    # What the checkpoint carries besides the state.
    self.consumed = 0  # groups taken in all (trained, skipped or rejected)
    # Records' streaks of groups with all-equal rewards (algorithms.selection), and the
    # feed positions passed over for them (rl.revisit_*; "retired" in the checkpoint).
    self.streaks: dict[int, int] = {}
    self.retired = 0
    self.trained_rollouts = 0
    self.resumed_samples = 0  # trained samples that a stopped worker began
    self.score_errors = 0  # samples scored 0 because a worker's verifier raised on them
    self._all_erred_steps = 0  # this run's steps whose every sample was one (warned of)
    # Seconds the last step, and this run's steps, waited for rollout groups.
    self.rollout_wait_s = self.rollout_wait_total_s = 0.0
    self.pending: list[PendingTake] = []  # takes trained on, not yet in a durable checkpoint
    self.saved_version = -1
    self.warm_start_eval: dict[str, float] | None = None
    # eval.on_workers: the held-out rounds the workers are decoding (each: the step that fed
    # it, its prompts not back yet, as id -> (set name, index, sampled answers), the
    # greedy scores back by set name, each sampled prompt's (mean, best, k), and the versions
    # that answered; kept in the checkpoint), and the rounds done
    # since the last step's record, as (step, result, pass@1 and pass@k or None).
    self.fleet_eval = bool(config.eval.get("on_workers", False))
    self._published_step = -1  # the step whose weights were published last
    self._round_due = False  # eval.on_workers: a round waits for the next publication
    self.left_unacked = 0  # groups the workers' evaluations took and left unacknowledged
    # (training groups, other rounds' answers)
    self._eval_rounds: dict[str, dict[str, Any]] = {}  # by metadata "eval": str(step)
    self._evals_done: list[tuple[int, dict[str, float], dict[str, float] | None]] = []
    self.skip_ids: set[int] = set()  # groups a restored checkpoint trained on, requeued
    # Their prompts, where known: a requeued group the server then drops as stale has its
    # prompt sampled again, as a new rollout id, to skip alike (it was trained on).
    self.skip_prompts: dict[str, int] = {}
    # Prompts fed and not yet back as groups: id -> (feed index, record), fed again to a
    # server that lost them; and the id of the server's storage folder (VersionInfo.store_id).
    self.outstanding: dict[str, tuple[int, int]] = {}
    self.store_id = ""
    self.servers_lost = 0
    self.came_back = 0  # groups trained on already that a requeued take brought again
    self.dropped_stale = 0  # groups the server dropped as older than the staleness floor
    self.rejected = 0  # groups that could not enter a batch (logged)
    self.last_rejection: str | None = None  # why the last of them could not
    self.filtered = 0  # groups with all-equal rewards left out (rl.dynamic_sampling)
    self.filled = 0  # such groups that filled a step at the cap (rl.dynamic_sampling)
    self.reward_parts_malformed = 0  # reward part values skipped (warned of once)
    # Each reward part's [sum, count] over the run's trained samples that carry it.
    self.reward_parts_totals: dict[str, list[float]] = {}
    # loss.adaptive_entropy's controller: its coefficient and the entropy the last step
    # measured (inf: none yet), as TRL's entropy_ctrl_state.json holds them.
    self.entropy_coef, self.last_entropy = self.loss_cfg.entropy_coef, math.inf
    self.kl_beta = self.loss_cfg.kl_in_reward  # loss.kl_target's controller: its coefficient
    self.restored = saved is not None
    if saved is not None:
      self._load_metadata(saved)
    self._restart_floor: int | None = None
    self._restart_version = 0  # the version a restart published its restored weights as
    self._refused_in_a_row = 0  # groups of this start rejected since the last trainable one
    self._journal: dict[str, Any] | None = None  # a take round's changes (_take_bookkeeping)
    self._completions_log = None  # completions.jsonl while train() runs (log.completions_every)
    self._requeue_next = True  # the first take returns any unacknowledged take
    self.ended_by: Exception | None = None  # what ended the run before its last step
    self._told_routes = False  # warned once of a group whose routes the run does not expect
    self._stop = threading.Event()
    self.stop_signal: int | None = None  # the signal that asked for the stop, if any
    log = config.get("log") or {}  # the completions log (check_rl_config checked it)
    self.completions_every = int(log.get("completions_every", 0))
    self.completions_groups = int(log.get("completions_groups", 0))
    self._taken: dict[int, Any] = {}  # the taken rollouts of the step being taken, by id

  # -- configuration and state ------------------------------------------------------------

  def _prompt_source(self) -> tuple[Sequence[dict[str, str]], dict[str, Any],
                                    list[tuple[int, int, float]]]:
    """(data.jsonl's records, held compactly, else the built-in tasks' stream; the source as
    checkpoints record it, data_source; each file's records and weight, file_parts, where
    data.weights mixes the files). Each record is checked to fit rl.max_prompt_tokens
    now rather than when its group is rejected after sampling, unless a check of the same
    records (their digest) with this tokenizer passed before (`rlax-ps local`'s)."""
    path = self.config.data.get("jsonl", "")
    if not path:
      check_task_prompts(self.tasks, self.weights, self.tokenizer,
                         *prompt_limit(self.config, self.model_config.max_position_embeddings))
      return (TaskPrompts(self.tasks, self.weights, int(self.config.seed)),
              data_source(self.config, None), [])
    weights, sizes = file_weights(self.config.data), []
    records = PromptRecords(iter_config_records(self.config, "data.jsonl", path, sizes=sizes))
    recorded = data_source(self.config, ((r["prompt"], r["answer"], r["task"]) for r in records))
    # The first prompt too long is named by its file and line, as `rlax-ps local` names it;
    # with the model's positions as the bound where they allow less than rl.max_prompt_tokens.
    limit, bound = prompt_limit(self.config, self.model_config.max_position_embeddings)
    check_prompt_lengths(self.config, "data.jsonl", path, recorded["digest"], self.tokenizer,
                         limit, bound)
    return records, recorded, file_parts(sizes, weights, data_files(path)) if weights else []

  @property
  def step(self) -> int:
    return int(shd.to_host(self.state.step))

  @property
  def version(self) -> int:
    return -1 if self.publisher.version is None else self.publisher.version

  def metadata(self) -> dict[str, Any]:
    """The JSON blob saved with each checkpoint."""
    saved = {
        "step": self.step,
        "data": self.feed.state(),
        "data_source": self.data_source,
        "schedule": self.schedule_settings,
        "consumed": self.consumed,
        "streaks": sorted(self.streaks.items()),
        "retired": self.retired,
        "trained_rollouts": self.trained_rollouts,
        "resumed_samples": self.resumed_samples,
        "score_errors": self.score_errors,
        "version": self.version,
        "pending_takes": [dataclasses.asdict(t) for t in self.pending],
        # groups trained on whose take the server requeued (its ack came too late): a rerun
        # from this checkpoint skips them too when they come back
        "skip_ids": sorted(self.skip_ids),
        "skip_prompts": sorted(self.skip_prompts.items()),
        "server_store": self.store_id,
        "outstanding": sorted(self.outstanding.values()),
        "eval_rounds": self._saved_eval_rounds(),
        "eval_round_due": self._round_due,  # (fed at the next publication)
        "counts": self.counts(),
        "reward_parts_totals": self.reward_parts_totals,
        "warm_start_eval": self.warm_start_eval,
        "run_id": self.run_id,
        "source_tag": self.source_tag,
        "mixed_reference": self.mixed_reference,  # the state holds ref_params
        # and the critic's state: one of critic.LAYOUTS; None: no critic
        "critic": self.critic.layout if self.critic is not None else None,
        "critic_schedule": self.critic.schedule_settings if self.critic is not None else None,
        "model_config": self.model_config.to_dict(),
        "config": json.loads(self.config.to_json_best_effort()),
    }
    if self.loss_cfg.kl_target is not None:
      saved["kl_control"] = {"kl_in_reward": self.kl_beta}
    if self.loss_cfg.adaptive_entropy:  # last_entropy None: none measured (or not finite)
      saved["entropy_control"] = {"entropy_coef": self.entropy_coef, "last_entropy":
                                  self.last_entropy if math.isfinite(self.last_entropy)
                                  else None}
    return saved

  def _load_metadata(self, saved: dict[str, Any]) -> None:
    # A run resumed elsewhere (another machine, a moved workdir) keeps its id: first, as
    # the ids of its outstanding prompts below are made of it.
    self.run_id = self.publisher.run = str(saved.get("run_id", self.run_id))
    self.source_tag = int(saved.get("source_tag", 0))
    if self.new_source:  # data.allow_new_source: its first record, numbered on, and ids of
      self.feed.number_from(int(saved["data"]["position"]))  # their own (a killed run fed
      self.source_tag += 1  # the old source's past the checkpoint's position)
    else:
      self.feed.restore(saved["data"])
      self.streaks = {int(r): int(z) for r, z in saved.get("streaks", [])}
    self.consumed = int(saved["consumed"])
    self.retired = int(saved.get("retired", 0))
    self.trained_rollouts = int(saved.get("trained_rollouts", 0))
    self.resumed_samples = int(saved.get("resumed_samples", 0))
    self.score_errors = int(saved.get("score_errors", 0))
    self.saved_version = int(saved["version"])
    self.pending = [PendingTake(**t) for t in saved.get("pending_takes", [])]
    self.store_id = str(saved.get("server_store", ""))
    if not self.new_source:  # another source's records cannot be fed again by index
      self.outstanding = {self._prompt_id(i): (int(i), int(r))
                          for i, r in saved.get("outstanding", [])}
    self.warm_start_eval = saved.get("warm_start_eval")
    if self.leader:  # (which alone feeds rounds and takes their answers)
      self._load_eval_rounds(saved.get("eval_rounds", []))
    self._round_due = bool(self.fleet_eval and saved.get("eval_round_due", False))
    self.restore_counts(saved.get("counts", {}))
    self.reward_parts_totals = {name: [float(total), int(n)] for name, (total, n)
                                in saved.get("reward_parts_totals", {}).items()}
    if self.loss_cfg.kl_target is not None and "kl_control" in saved:  # else kl_in_reward
      self.kl_beta = float(saved["kl_control"]["kl_in_reward"])
    control = saved.get("entropy_control")
    if self.loss_cfg.adaptive_entropy and control:
      self.entropy_coef = float(control["entropy_coef"])
      last = control["last_entropy"]
      self.last_entropy = math.inf if last is None else float(last)
    elif self.loss_cfg.adaptive_entropy and self.leader:  # it starts at loss.entropy_coef
      logging.warning("loss.adaptive_entropy: the checkpoint at step %d holds no entropy "
                      "coefficient (written without loss.adaptive_entropy, or by an older "
                      "rlax-ps); it starts at loss.entropy_coef=%g", int(saved["step"]),
                      self.loss_cfg.entropy_coef)
    self.skip_ids = {int(i) for i in saved.get("skip_ids", [])}
    self.skip_prompts = {str(p): int(i) for p, i in saved.get("skip_prompts", [])}

  def counts(self) -> dict[str, int]:
    """The run's totals the summary reports beside rollout_groups_trained: kept in the
    checkpoint so that after a restart they count every run, as that one does."""
    return {name: int(getattr(self, name)) for name in COUNTS}

  def restore_counts(self, saved: dict[str, int]) -> None:
    """The totals of counts() from a checkpoint (0 where it has none)."""
    for name in COUNTS:
      setattr(self, name, int(saved.get(name, 0)))

  # -- server side of a (re)start ---------------------------------------------------------

  def start(self) -> None:
    """Acknowledge what the restored checkpoint trained on, then publish this trainer's
    weights as a keyframe of the next version (0 on a fresh server)."""
    version = self._shared(self._server_start() if self.leader else 0)
    if self.restored:
      self._restart_floor = max(0, self.saved_version - self.max_staleness)
      self._restart_version = version  # the keyframe of the restored weights
    # (a restart's in versions.jsonl alone: the restored step's sync point is the first run's)
    self._publish(version, keyframe=True, tensorboard=not self.restored)

  def _server_start(self) -> int:
    """The leader's side of start(): acknowledgements (or, on a server that lost what it
    held, the prompts fed again); returns the version to publish."""
    info = self.client.version_info()
    # A server behind the checkpoint's version lost it (a publication is saved once sent).
    if self._server_lost(info.store_id, behind=info.latest_version < self.saved_version):
      # Workers may hold a newer version of this run's than the checkpoint's: go above it.
      return max(info.latest_version, self.saved_version, self._published_before()) + 1
    for take in self.pending:
      if take.step > self.step:  # taken for a step the checkpoint does not hold: requeued
        continue
      try:  # the checkpoint is durable and holds this take's step: its groups are trained on
        self.client.ack(take.take_id)
      except ParamServerError as e:
        if e.code != grpc.StatusCode.NOT_FOUND:
          raise
        # Requeued meanwhile (its ack deadline passed): skip its groups when they come back.
        self._skip(take)
    self.pending = []
    self._feed_outstanding()  # a stop may have cut their enqueue short
    return max(info.latest_version, self.saved_version) + 1

  def _skip(self, take: PendingTake) -> None:
    """An expired take's groups, trained on: skipped when they come back, or when their
    prompts come sampled again (the server dropped the requeued groups as stale)."""
    self.skip_ids.update(take.rollout_ids)
    self.skip_prompts.update(zip(take.prompt_ids, take.rollout_ids))

  def _server_lost(self, store_id: str, behind: bool = False) -> bool:
    """Whether the server lost what this run fed it: its storage id `store_id` is not the
    one the run met before (its storage folder lost or replaced), or it is `behind` the
    run. If so: its takes cannot be acknowledged (the steps that used them are trained on;
    the checkpoint holds them or they are lost with the server's copies), the prompts fed
    and not trained on (and the held-out prompts of rounds not whole) are fed again, and
    the latest version is sent again as a keyframe where the server lacks it."""
    known = self.store_id
    self.store_id = store_id or known  # "": a server from before storage ids
    if not (behind or (known and store_id and store_id != known)):
      return False
    keyframe = ("the next version" if self.publisher.version is None  # (at start: not
                else f"v{self.version}")                           # published yet)
    logging.warning("rl: the parameter server at %s (storage %s; this run fed %s) lost its "
                    "weights and queues (a new --storage_dir?); feeding it %d prompts again "
                    "and sending %s as a keyframe", self.client.address, store_id or "?",
                    known or "?", len(self.outstanding), keyframe)
    self.pending = []
    self.skip_ids.clear()  # ids of the lost server's rollouts
    self.skip_prompts.clear()
    self.servers_lost += 1
    if self._journal is not None:  # a take round's groups so far: the lost server's
      self._journal["refeed"].update(self._journal["outstanding"])
      self._journal["skips"].clear()
      self._journal["skip_prompts"].clear()
    if self.publisher.version is not None and self.client.latest_version() < self.version:
      self.publisher.resend_keyframe()
    self._feed_outstanding()
    return True

  def _feed_outstanding(self) -> None:
    """The prompts fed and not trained on, and the held-out rounds' (eval.on_workers) not
    answered, enqueued again: the server skips the ids it holds (queued, leased, answered)."""
    self._feed_again(self.outstanding.values())
    for key, round_ in sorted(self._eval_rounds.items()):
      self._enqueue_eval(key, round_["left"])

  def _feed_again(self, fed) -> None:
    """Enqueue again the prompts at (feed index, record) pairs `fed`, with their ids."""
    fed = sorted(fed)
    for i in range(0, len(fed), ENQUEUE_BATCH):
      self.client.enqueue_prompts([self._prompt(index, {**self.source[record], "record": record})
                                   for index, record in fed[i:i + ENQUEUE_BATCH]])

  def _published_before(self) -> int:
    """The highest version in this run's versions.jsonl (-1: none)."""
    return max((int(r["version"]) for r in read_jsonl(os.path.join(
        self.workdir, "versions.jsonl")) if isinstance(r.get("version"), int)), default=-1)

  def _versions_log(self) -> list[dict[str, Any]]:
    """versions.jsonl's publications, of every run in this workdir (a line a kill tore, or
    a record without the fields, left out)."""
    keys = ("version", "bytes", "seconds", "keyframe")
    return [r for r in read_jsonl(os.path.join(self.workdir, "versions.jsonl"))
            if all(k in r for k in keys)]

  def _shared(self, value: int) -> int:
    """The leader's `value`, on every process of a multi-host slice."""
    if jax.process_count() == 1:
      return int(value)
    return shd.broadcast_int(value)

  def _step_inputs(self) -> tuple[jax.Array | None, ...]:
    """The step's inputs after the reference, replicated: with loss.adaptive_entropy, the
    coefficient this step's bonus applies (entropy_bonus_coef); with loss.kl_target,
    loss.kl_in_reward's (None where the other is not adaptive); else none."""
    entropy = (self._scalar(entropy_bonus_coef(self.entropy_coef, self.last_entropy,
                                               self.loss_cfg))
               if self.loss_cfg.adaptive_entropy else None)
    if self.loss_cfg.kl_target is not None:
      return entropy, self._kl_beta_input()
    return () if entropy is None else (entropy,)

  def _scalar(self, value: float) -> jax.Array:
    """`value` as a float32 scalar replicated on the mesh (a traced step input)."""
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return jax.make_array_from_callback((), replicated, lambda _: np.float32(value))

  def _kl_beta_input(self) -> jax.Array | None:
    """loss.kl_target's adaptive KL-in-reward coefficient as a step input; None: fixed."""
    return None if self.loss_cfg.kl_target is None else self._scalar(self.kl_beta)

  def _adapt_entropy(self, entropy: float) -> float:
    """loss.adaptive_entropy's controller after a step that measured `entropy` (the step's
    train/entropy); returns the new coefficient."""
    self.entropy_coef = adapt_entropy_coef(self.entropy_coef, entropy, self.loss_cfg)
    self.last_entropy = entropy
    return self.entropy_coef

  def _precompile(self) -> None:
    """Compile the step for each response capacity (rl.response_buckets), smallest first, on
    a thread of its own: a batch that packs to a capacity not seen yet does not stop
    training for its compile (minutes for a large model)."""
    def abstract(tree):
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                          if isinstance(x, jax.Array) else x, tree)

    state, ref, extra = abstract(self.state), abstract(self.ref_params), abstract(
        self._step_inputs())
    rows = self.shape.groups
    self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rl-compile")
    for capacity in response_lens(self.shape.response_len, self.response_buckets):
      shape = dataclasses.replace(self.shape, response_len=capacity)
      host = empty_batch(rows, shape, self.tokenizer.pad_id)
      if self.teacher is not None and self.teacher_tokenizer is None:  # its scores join
        host.update(jax.eval_shape(self.teacher.scores, host))  # the batch
      if self.critic is not None:  # its values join the batch (float32, as the log-probs),
        host["values"] = host["behaviour_logp"]  # and the reference's log-probs it computes
        if needs_reference(self.loss_cfg):
          host["ref_logp"] = host["behaviour_logp"]
      batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=jax.sharding.NamedSharding(
          self.mesh, shd.batch_spec(self.mesh, v.shape)))
               for k, v in host.items()}
      self._compiles[(rows, capacity)] = self._compiler.submit(
          lambda batch=batch: self.rl_step.lower(state, batch, ref, *extra).compile())
      if self.critic is not None:
        self._precompile_critic((rows, capacity), batch, ref, abstract)

  def _precompile_critic(self, key: tuple[int, int], batch: dict, ref: Any, abstract) -> None:
    """Queue the critic's compiles for a batch shape `key` (`batch`: the policy step's
    abstract batch, its values included) behind the step's."""
    critic, base = abstract(self.critic.state), abstract(self.critic.base(self.state.params))
    kl_beta = abstract(self._kl_beta_input())
    sampled = {k: v for k, v in batch.items() if k not in ("values", "ref_logp")}
    self._critic_compiles["targets"][key] = self._compiler.submit(
        lambda: self.critic.targets_fn.lower(critic.params, base, sampled, ref, kl_beta)
        .compile())
    self._critic_compiles["update"][key] = self._compiler.submit(
        lambda: self.critic.update_fn.lower(critic, base,
                                            {**batch, "returns": batch["values"]}).compile())

  def _policy_schedule(self):
    """The policy's lr by step, as logged: critic.warmup_steps' steps do not update it, and its
    optimizer counts its own updates."""
    warmup = self.critic.warmup_steps if self.critic is not None else 0
    return (lambda step: self.schedule(step - warmup)) if warmup else self.schedule

  @staticmethod
  def _batch_key(batch: dict) -> tuple[int, int]:
    return len(batch["row_group"]), batch["response_tokens"].shape[-1]

  def _ahead(self, futures: dict, key: tuple[int, int], jitted, what: str,
             drop_queued: bool = True):
    """(the program compiled ahead for batch shape `key` in `futures` if that compile is done
    or under way (waited for), True), else (`jitted`, False): a compile queued behind others
    is dropped (unless not `drop_queued`: waited for too), one that failed is logged and
    compiled again by `jitted`."""
    future = futures.get(key)
    if future is None or (drop_queued and future.cancel()):
      futures.pop(key, None)
      return jitted, False
    try:
      return future.result(), True
    except Exception as e:  # noqa: BLE001: the jitted one compiles it again, or says why
      logging.warning("rl: the %s compiled ahead for %s failed (%s); compiling it now", what,
                      key, e)
      futures.pop(key, None)
      return jitted, False

  def _step_for(self, batch: dict):
    """The step for this batch's shape: compiled ahead if that compile is done or under way
    (waited for), else the jitted step (a compile queued behind others is dropped)."""
    step, ahead = self._ahead(self._compiles, self._batch_key(batch), self.rl_step, "step")
    self.precompiled_steps += ahead
    return step

  def _critic_for(self, batch: dict):
    """(targets, update) of the critic for this batch's shape, as _step_for's, but queued
    ones are waited for (each queues right behind its shape's step compile)."""
    key = self._batch_key(batch)
    targets, ahead = self._ahead(self._critic_compiles["targets"], key, self.critic.targets_fn,
                                 "critic's values", drop_queued=False)
    update, ahead_too = self._ahead(self._critic_compiles["update"], key,
                                    self.critic.update_fn, "critic's update", drop_queued=False)
    self.precompiled_critic_steps += ahead and ahead_too
    return targets, update

  def _next_batch(self, go: bool) -> tuple[dict | None, list[Group] | None]:
    """(host batch, its groups) of the next step, or (None, None) to stop. The leader
    decides (`go`: its own limits) and takes the groups; every other process of a
    multi-host slice gets the same batch (and no groups)."""
    groups = batch = None
    if self.leader and go:
      self._ack_durable()
      t0 = time.monotonic()
      groups = self._take_groups()
      self.rollout_wait_s = time.monotonic() - t0
      self.rollout_wait_total_s += self.rollout_wait_s
      if groups is not None:  # in the prompts' order, not their arrival's (scoring threads,
        groups = sorted(groups, key=lambda g: g.prompt_id)  # workers): sums repeat exactly
        if self.teacher_tokenizer is not None:  # the teacher's scores of the responses' text
          groups = self._retokenized_scores(groups)
        batch = build_batch(groups, fit_response_len(groups, self.shape,
                                                     self.response_buckets),
                            self.tokenizer.pad_id)
    rows = self._shared(0 if batch is None else len(batch["row_group"]))
    if not rows:
      return None, None
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      packed = self._shared(batch["response_tokens"].shape[-1] if self.leader else 0)
      shape = dataclasses.replace(self.shape, response_len=packed)
      batch = multihost_utils.broadcast_one_to_all(
          batch if self.leader else empty_batch(rows, shape, self.tokenizer.pad_id))
    return batch, groups

  # -- the loop ---------------------------------------------------------------------------

  def request_stop(self, signum: int | None = None) -> None:
    """Finish the current step, checkpoint and return (a SIGTERM or Ctrl-C: `signum`). A
    server call retrying meanwhile gives up at once: a server gone too (its supervisor
    killed) must not hold the stop, and the workdir, for the client's retry deadline."""
    self.stop_signal = self.stop_signal or signum
    self._stop.set()
    if self.client is not None:
      self.client.interrupt.set()

  def _stop_agreed(self) -> bool:
    """Whether any process was asked to stop (a collective): on a multi-host slice a
    follower's SIGTERM was ignored (the leader alone decided), and a preempted follower
    trained on until it was killed. Each process then holds the stop and its signal."""
    stop, signum = shd.agreed_stop(self._stop.is_set(), self.stop_signal)
    if stop:
      self._stop.set()
      self.stop_signal = signum
    return stop

  def _stopping(self, error: ParamServerError, what: str) -> bool:
    """True (and logged) when `error` ended a server call because a stop was requested: the
    checkpoint then keeps what the call would have done (its takes are acked at the next
    start)."""
    if not self._stop.is_set():
      return False
    logging.warning("rl: stopping; %s left to the next start: %s", what, error)
    return True

  def _evaluate_warm_start(self) -> None:
    """The held-out figure of the weights RL starts from, once, before the first step; a
    run resumed past it has none to give (a later step's is no warm start's)."""
    if self.warm_start_eval is not None or not self.heldout.size or self.step != 0:
      return
    if not self.fleet_eval:
      self.warm_start_eval = self.evaluate()
    elif self.leader:  # the workers answer it, holding the version
      self.warm_start_eval, _ = self._fleet_evaluation("warm_start", 0)  # just published
    if self.warm_start_eval is not None:
      self.log_eval(self.warm_start_eval, self.step)

  def train(self, *, max_seconds: float = 0.0) -> dict[str, Any]:
    """Run RL steps up to rl.steps (or `max_seconds` of wall time; 0 = no limit), then
    checkpoint, evaluate and write summary.json. Returns the summary."""
    t0 = time.time()
    self.start()
    self._precompile()
    self._evaluate_warm_start()
    start_step = self.step
    rate = StepRate()  # from here: the warm start's evaluation is not sampling time
    steps_log = (open_steps_jsonl(os.path.join(self.workdir, "steps.jsonl"), self.step)
                 if self.leader else None)
    # Likewise the completions of steps a kill undid: their groups are logged again.
    self._completions_log = (open_steps_jsonl(os.path.join(self.workdir, "completions.jsonl"),
                                              self.step)
                             if self.leader and self.completions_every else None)
    try:
      while True:
        go = (self.step < self.total_steps and not self._stop_agreed()
              and not (max_seconds and time.time() - t0 >= max_seconds))
        batch, groups = self._next_batch(go)
        if batch is None:  # done, or stopped while waiting
          break
        placed = shd.shard_batch(self.mesh, batch)
        if self.teacher is not None and self.teacher_tokenizer is None:  # once a step
          scores = self.teacher.scores(placed)
          placed.update(scores)
          batch.update(shd.to_host(scores))  # the completions log's advantages
        if self.critic is not None:  # its values (and returns) before either update
          targets, update = self._critic_for(batch)
          values, returns, ref_logp = self.critic.targets(
              placed, self.state.params, self.ref_params, self._kl_beta_input(), targets)
          placed["values"] = values
          if ref_logp is not None:  # the reference runs once a step, not again in the policy's
            placed["ref_logp"] = ref_logp
          batch["values"] = shd.to_host(values)  # the completions log's advantages
        # critic.warmup_steps: the policy waits while its critic learns (verl's critic_warmup)
        warming = self.critic is not None and self.step < self.critic.warmup_steps
        if warming:  # a step all the same: its groups are acked with its checkpoint
          self.state, metrics = self.state.replace(step=self.state.step + 1), {}
        else:
          self.state, metrics = self._step_for(batch)(
              self.state, placed, self.ref_params, *self._step_inputs())
        if self.critic is not None:
          metrics.update(self.critic.update({**placed, "returns": returns}, self.state.params,
                                            update))
        done = self.step
        if self.ref_sync_steps and done % self.ref_sync_steps == 0:  # TRL's sync_ref_model
          self.ref_params = self._mix_reference(self.ref_params, self.state.params)
        metrics = {k: float(v) for k, v in shd.to_host(metrics).items()}
        self._check_finite(metrics, done)
        if self.loss_cfg.adaptive_entropy and not warming:  # TRL's logged entropy_coef
          metrics["entropy_coef"] = self._adapt_entropy(metrics["entropy"])
        if self.loss_cfg.kl_target is not None and not warming:  # verl's adaptive KL:
          metrics["kl_in_reward"] = self.kl_beta  # the step's beta, then the next one's
          self.kl_beta = adapt_kl_coef(self.kl_beta, metrics["reward_kl"],
                                       int(batch["sample_mask"].sum()), self.loss_cfg)
        every = int(self.config.checkpoint.every_steps)
        eval_every = int(self.config.eval.every_steps)
        record = {}  # the leader's log line; the other processes do the same device work
        if self.leader:
          self.trained_rollouts += len(groups)
          record = self._step_record(done, groups, batch, metrics,
                                     rate.add(int(batch["sample_mask"].sum())))
          self.resumed_samples += record["resumed_samples"]
          self._count_score_errors(done, record["score_errors"],
                                   sum(len(g.rewards) for g in groups + self.left_out))
          add_part_totals(self.reward_parts_totals, part_values(groups))
          record.update(self._reward_parts_record(groups))
        if done % self.publish_every == 0 and not warming:  # (warming: the weights as were)
          try:
            pub = self._publish(self.version + 1)
            record.update(sync_bytes=pub.bytes, sync_keyframe_bytes=pub.keyframe_bytes,
                          sync_seconds=pub.seconds, version=pub.version)
          except ParamServerError as e:  # the next start publishes a keyframe of this step
            if not self._stopping(e, f"the publication of step {done}"):
              raise
        due = eval_every and done % eval_every == 0 and done < self.total_steps
        if due and not self.fleet_eval:
          self.log_eval(self.evaluate(), done)
          record["heldout"] = self.last_eval
        # eval.on_workers: the workers decode a round between training prompts, once the
        # weights it evaluates are published (rl.publish_every > 1: at the next publication)
        self._round_due = bool(self.fleet_eval and self.heldout.size
                               and (self._round_due or due))
        if self._round_due and self._published_step == done and done < self.total_steps:
          self._round_due = False
          if self.leader:  # (which alone talks to the server and takes the answers)
            self._feed_eval(done)
        if self._evals_done:  # eval.on_workers: the newest round the workers finished
          record["heldout_step"], record["heldout"], passes = self._evals_done[-1]
          if passes:
            record["heldout_pass"] = passes
          self._evals_done.clear()
        if self.leader:
          self._log_step(record, metrics)
          self._log_completions(done, groups, batch)
          steps_log.write(json.dumps(record) + "\n")
          steps_log.flush()
        if every and done % every == 0:
          self.save()
        export_every = int(self.config.export.get("every_steps", 0))
        if export_every and done % export_every == 0 and done < self.total_steps:
          self.export_hf(os.path.join(self.workdir, "exports", f"step_{done:06d}"))
          if self.leader:
            prune_exports(os.path.join(self.workdir, "exports"),
                          int(self.config.export.get("max_to_keep", 0)))
    finally:
      for log in (steps_log, self._completions_log):
        if log is not None:
          log.close()
      self._completions_log = None
      if self._compiler is not None:  # compiles not begun are dropped
        self._compiler.shutdown(wait=False, cancel_futures=True)
    self.save()
    self.checkpointer.wait()
    refused = self._ack_or_defer()
    if refused is not None:
      raise refused
    if self._shared(self.ended_by is not None):  # (the other processes of a slice too)
      raise self.ended_by or RuntimeError("rl: the run ended on process 0: see its log")
    return self.finish(time.time() - t0, start_step)

  def _check_finite(self, metrics: dict, step: int) -> None:
    """Warns of a step whose update (policy's or critic's) was skipped for non-finite
    gradients, and stops the run (before its checkpoint) after too many in a row."""
    for prefix, cfg in (("", self.config.optimizer),) + (
        (("critic_", self.critic.optimizer_config),) if self.critic is not None else ()):
      if metrics.get(prefix + "nonfinite_streak", 0) and self.leader:
        logging.warning("step %d: the %supdate was skipped: its gradients are not finite "
                        "(grad norm %s, %d in a row)", step, prefix.replace("_", " "),
                        metrics.get(prefix + "grad_norm"),
                        int(metrics[prefix + "nonfinite_streak"]))
      optim.check_finite_updates(metrics, cfg, step, prefix)

  def _min_version(self) -> int:
    floor = self.version - self.max_staleness
    if self._restart_floor is not None:
      floor = min(floor, self._restart_floor)
    return max(0, floor)

  def _feed_prompts(self, want: int = 0) -> None:
    """Keep queued or in flight the `want` groups the step being taken still needs and
    max_staleness steps' more: a group sampled by the version published now may train
    that many steps after this one, so the workers sample ahead while the trainer trains,
    and none that would be too stale (max_staleness 0: the step's own groups only)."""
    target = want + self.shape.groups * self.max_staleness
    missing = target - (self.feed.position - self.retired - self.consumed)
    if missing <= 0:
      return
    # A server that lost its weights and queues gets the weights before any prompt: a worker
    # leasing one first would sample it with the lost server's (_server_lost).
    self._server_lost(self.client.version_info().store_id)
    prompts = []
    passed = 0  # records passed over in this call: at most an epoch's worth
    while len(prompts) < missing:
      (index, rec), = self.feed.take(1)
      streak = self.streaks.get(rec["record"], 0)
      if streak and not fed(streak, int(self.config.seed), index, *self.revisit):
        if passed < self.feed.size:
          passed += 1
          self.retired += 1
          continue
        if passed == self.feed.size:  # an epoch of them: feed them rather than stall
          passed += 1
          logging.warning("rl.revisit_*: a whole epoch of data.jsonl passed over; feeding "
                          "its records again")
      prompts.append(self._prompt(index, rec))
      self.outstanding[prompts[-1].id] = (index, int(rec["record"]))
    for i in range(0, len(prompts), ENQUEUE_BATCH):  # (a server takes at most 10,000 a call)
      self.client.enqueue_prompts(prompts[i:i + ENQUEUE_BATCH])

  def _prompt_id(self, index: int) -> str:
    return f"{self._id_prefix}-{index}"

  @property
  def _id_prefix(self) -> str:
    return self.run_id if not self.source_tag else f"{self.run_id}-s{self.source_tag}"

  def _prompt(self, index: int, rec: dict[str, Any]) -> Prompt:
    """The prompt fed at feed position `index`: record `rec` rendered and tokenized, with
    its sampling seed, of the run's seed and that position (the workdir, the worker that
    leases it and a restart change none of its samples)."""
    ids = self.tokenizer.encode_prompt(rec["prompt"])
    if len(ids) > self.shape.prompt_len:  # its group would be rejected once sampled
      raise ValueError(f"rl.max_prompt_tokens: {self.shape.prompt_len} is too small for "
                       f"prompt {rec['prompt']!r} of {len(ids)} tokens; raise it")
    return self._rendered(self._prompt_id(index), rec["prompt"], rec["task"], rec["answer"],
                          ids, {"record": str(rec["record"]), PROMPT_SEED:
                                f"{int(self.config.seed)}-s{self.source_tag}-{index}"})

  def _rendered(self, prompt_id: str, prompt: Any, task: str, answer: Any, ids: list[int],
                metadata: dict[str, str]) -> Prompt:
    """A Prompt for the workers: `prompt` rendered, its token ids, the answer the verifiers
    check, and `metadata`."""
    text = self.tokenizer.render_prompt(prompt)
    # The raw prompt where the text is a rendering of it: a reward model with a chat
    # template of its own renders the conversation again (rlax_ps.reward_scoring).
    raw = {} if text == prompt else {"prompt": json.dumps(prompt)}
    return Prompt(id=prompt_id, text=text, task=task, token_ids=ids,
                  extra=str(answer).encode("utf-8"), metadata={**raw, **metadata})

  def _feed_eval(self, step: int) -> None:
    """eval.on_workers: queue the held-out prompts for the workers, each for one greedy
    answer, and again for eval.rounds_pass_k sampled ones; logged when whole (_eval_group)
    at `step`."""
    self._feed_round(str(step), step, int(self.config.eval.get("rounds_pass_k", 0)))

  def _feed_round(self, key: str, step: int, k: int, waited: bool = False) -> None:
    """Queue a round of the held-out prompts (metadata eval: `key`, eval_set: the set it
    scores, eval_samples: `k` on each prompt's second copy, for pass@k); `waited`: one
    that _fleet_evaluation waits for, neither logged nor checkpointed when whole."""
    left = {}  # prompt id -> (set name, index in the set, sampled answers: 0 for greedy)
    round_id = uuid.uuid4().hex[:8]  # a step fed again after a restart: other prompt ids
    for name, examples in self.heldout.examples.items():
      for i in range(len(examples)):
        left[f"{self.run_id}-eval{key}-{round_id}-{name}-{i}"] = (name, i, 0)
        if k:
          left[f"{self.run_id}-eval{key}-{round_id}-{name}-pass-{i}"] = (name, i, k)
    try:
      self._enqueue_eval(key, left)
    except ParamServerError as e:  # a stop meanwhile: no round (answers to what was queued
      if self._stopping(e, f"the held-out round of {key}"):  # are passed over)
        return
      raise
    self._eval_rounds[key] = {"step": step, "left": left, "waited": waited, "passes": [],
                              "scores": collections.defaultdict(list), "versions": []}

  def _enqueue_eval(self, key: str, prompts: dict[str, tuple[str, int, int]]) -> None:
    """Queue the held-out prompts of round `key`: {prompt id: (set, index, sampled
    answers)}."""
    rendered = []
    for prompt_id, (name, i, k) in prompts.items():
      ex = self.heldout.examples[name][i]
      meta = {"eval": key, "eval_set": name,  # its samples' seeds: of the round, not its ids
              PROMPT_SEED: f"{int(self.config.seed)}-eval{key}-{name}-{i}-{k}"}
      if k:
        meta["eval_samples"] = str(k)
      rendered.append(self._rendered(prompt_id, ex.prompt, ex.task or name, ex.answer,
                                     self.tokenizer.encode_prompt(ex.prompt), meta))
    for i in range(0, len(rendered), ENQUEUE_BATCH):
      self.client.enqueue_prompts(rendered[i:i + ENQUEUE_BATCH])

  def _fleet_evaluation(self, key: str, k: int) -> tuple[dict | None, dict | None]:
    """eval.on_workers' evaluation of the latest version (the warm start's, the final
    weights'): a round of the held-out prompts (one greedy answer each, and k sampled ones
    for pass@k) answered by workers holding it, waited for up to rl.take_timeout_s. Returns
    (exact match, pass@1 and pass@k or None), or (None, None) with a warning when it is not
    whole by then. Training groups and answers of periodic rounds taken meanwhile are not
    acknowledged (left_unacked): the server serves them again, to the next start's first
    take at once; a periodic round they make whole is logged all the same."""
    self._feed_round(key, self.step, k, waited=True)
    round_ = self._eval_rounds.get(key, {})  # (none: stopped while it was queued)
    wait = float(self.config.rl.take_timeout_s)
    deadline = time.monotonic() + wait
    requeue = self._requeue_next  # a restart's first take: what the last run left comes back
    while (round_ and "done" not in round_ and time.monotonic() < deadline
           and not self._stop.is_set()):
      try:
        take = self.client.take_rollouts(self.version, ENQUEUE_BATCH, wait_s=1.0,
                                          ack_deadline_s=float(self.config.rl.ack_deadline_s),
                                          requeue_unacked=requeue)
      except ParamServerError as e:
        if self._stopping(e, f"the {key} evaluation"):
          break
        raise
      requeue = False  # (the training loop's first take still requeues what this one left)
      for taken in take.rollouts:
        if "eval" in taken.prompt.metadata:
          self._eval_group(taken)
      if take.take_id and all(r.prompt.metadata.get("eval") == key for r in take.rollouts):
        self.client.ack(take.take_id)  # this round's answers alone: scored, done with
      elif take.rollouts and key == "final":  # served again, at once, to the next start's
        # first take: training groups, and answers of rounds the last checkpoint holds
        self.left_unacked += len(take.rollouts)  # unfinished (it scores them)
    self._eval_rounds.pop(key, None)
    if not round_:
      return None, None
    if "done" not in round_:
      if self._stop.is_set():
        logging.warning("eval.on_workers: the %s evaluation of v%d was stopped with %d of its "
                        "prompts unanswered: no result", key, self.version, len(round_["left"]))
      else:
        logging.warning("eval.on_workers: the %s evaluation of v%d is not whole after %gs (%d "
                        "of its prompts unanswered): no result", key, self.version, wait,
                        len(round_["left"]))
      return None, None
    return round_["done"]

  def _saved_eval_rounds(self) -> list[dict[str, Any]]:
    """The rounds not yet whole, as the checkpoint keeps them: a restart goes on scoring
    them (the answers taken after the checkpoint come again), and feeds their prompts again
    to a server that lost them."""
    return [{"step": r["step"], "left": sorted([k, *v] for k, v in r["left"].items()),
             "scores": dict(r["scores"]), "passes": list(r["passes"]),
             "versions": list(r["versions"])}
            for _, r in sorted(self._eval_rounds.items()) if not r["waited"]]

  def _load_eval_rounds(self, saved: list[dict[str, Any]]) -> None:
    """The checkpoint's rounds not yet whole (_saved_eval_rounds); a round whose prompts
    this run's held-out sets no longer hold is dropped, with a warning."""
    sizes = {name: len(v) for name, v in self.heldout.examples.items()}
    for r in saved:
      left = {key: (str(name), int(i), int(k)) for key, name, i, k in r["left"]}
      if not self.fleet_eval or any(i >= sizes.get(name, 0) for name, i, _ in left.values()):
        logging.warning("eval.on_workers: the held-out round fed at step %d is not logged: "
                        "this run has %s", int(r["step"]),
                        "eval.on_workers off" if not self.fleet_eval else
                        f"other held-out sets ({sizes})")
        continue
      self._eval_rounds[str(r["step"])] = {
          "step": int(r["step"]), "left": left, "waited": False,
          "versions": [int(v) for v in r["versions"]],
          "passes": [(float(m), float(x), int(k)) for m, x, k in r["passes"]],
          "scores": collections.defaultdict(
              list, {name: [float(x) for x in v] for name, v in r["scores"].items()})}

  @staticmethod
  def _answer_score(sample) -> float:
    """A held-out answer's score: its verifier's verdict (a reward model's task: its score)."""
    verdict = sample.metadata.get("passed")
    return float(verdict == "1") if verdict is not None else float(sample.reward)

  def _eval_group(self, taken) -> None:
    """One held-out prompt's answers (eval.on_workers): the greedy one's score, or the
    sampled ones' mean and best (pass@1, pass@k); a prompt no worker could sample scores 0.
    A finished round is logged as the trainer's own evaluation is, at the step that fed it
    (a waited one: its result is kept for _fleet_evaluation)."""
    round_ = self._eval_rounds.get(taken.prompt.metadata["eval"])
    if round_ is None or taken.prompt.id not in round_["left"]:  # scored, or fed after the
      return  # checkpoint a restart resumed from (the restart fed the step's round again)
    _, _, k = round_["left"].pop(taken.prompt.id)
    if taken.group.failure:  # said here, not in a worker's log alone: it lowers the score
      logging.log_every_n_seconds(
          logging.WARNING, "rl: held-out prompt %s could not be sampled by worker %r (%s); "
          "it scores 0", 30, taken.group.prompt_id, taken.group.metadata.get("worker", "?"),
          taken.group.failure)
    scores = [self._answer_score(s) for s in taken.group.samples] or [0.0]
    if taken.group.samples:
      round_["versions"].append(int(taken.group.policy_version))
    if k:
      scores += [0.0] * (k - len(scores))  # (a worker sends k; fewer: the rest failed)
      round_["passes"].append((float(np.mean(scores)), max(scores), k))
    else:
      round_["scores"][taken.prompt.metadata["eval_set"]].append(scores[0])
    if round_["left"]:
      return
    scores = round_["scores"]
    result = {name: float(np.mean(v)) for name, v in scores.items()}
    result["all"] = float(np.mean([x for v in scores.values() for x in v]))
    passes = None
    if round_["passes"]:
      means, best, ks = zip(*round_["passes"])
      passes = {"pass@1": float(np.mean(means)), f"pass@{max(ks)}": float(np.mean(best))}
    if round_["waited"]:
      round_["done"] = (result, passes)
      return
    del self._eval_rounds[taken.prompt.metadata["eval"]]
    step = round_["step"]
    self.last_eval = result
    if self.leader:
      self.log_eval(result, step)
      for name, v in (passes or {}).items():
        self.writer.add_scalar(f"eval/{name}", v, step)
      if round_["versions"]:
        self.writer.add_scalar("eval/policy_version_min", min(round_["versions"]), step)
    self._evals_done.append((step, result, passes))

  def _teacher_prompt(self, prompt) -> np.ndarray:
    """A taken group's prompt in the tokens of teacher.tokenizer, rendered by its own chat
    template where this trainer rendered a conversation; ValueError naming the rollout's
    prompt where the teacher cannot read it (its template refuses the conversation)."""
    try:
      ids = self.teacher_tokenizer.encode_prompt(chat.raw_prompt(prompt.text, prompt.metadata))
    except (ValueError, KeyError, UnicodeError) as e:
      raise ValueError(f"prompt {prompt.id}: teacher.tokenizer: the teacher cannot read it: "
                       f"{e}") from None
    return np.asarray(ids, np.int32)

  def _retokenized_scores(self, groups: list[Group]) -> list[Group]:
    """`groups` with the teacher's log-probs of each response token (teacher.tokenizer: its
    log-probs of the responses' text, shared out over the policy's tokens), scored a packed
    row a group, in rl.micro_batches forward passes (as the policy's, for its memory)."""
    stop_ids = set(self.loss_cfg.stop_ids)
    most = max(self.shape.samples, *(len(g.responses) for g in groups))
    scores = score_retokenized(
        self.teacher, self.tokenizer, self.teacher_tokenizer,
        [g.teacher_prompt for g in groups], [g.responses for g in groups],
        [g.behaviour_logp for g in groups],
        [[len(r) > 0 and int(r[-1]) in stop_ids for r in g.responses] for g in groups],
        1 << (most - 1).bit_length(), [g.observed for g in groups],
        rows=-(-len(groups) // self.micro_batches) if self.micro_batches > 1 else None)
    return [dataclasses.replace(g, teacher=tuple((logp, None, None) for logp in s))
            for g, s in zip(groups, scores)]

  def _take_groups(self) -> list[Group] | None:
    """groups_per_step valid groups at or above the staleness floor; None when stopped.
    With rl.dynamic_sampling, groups whose rewards are all equal are left out and more are
    taken, up to the cap, where the step is filled with the first ones left out."""
    before = self._take_bookkeeping()
    try:
      try:
        groups = self._take_round()
      except TimeoutError as e:  # rl.take_timeout_s: the run ends as a stop does, its
        self.ended_by, groups = e, None  # checkpoint first (the steps since the last kept)
      if groups is None:  # stopped: the round's groups come again to the next start's first
        self._undo_take_bookkeeping(before)  # take (their takes unacked), counted then
      return groups
    finally:
      self._journal = None

  _COUNTS = ("consumed", "rejected", "last_rejection", "filtered", "filled", "came_back",
             "reward_parts_malformed")
  # (not dropped_stale: the server drops stale groups for good)

  def _take_bookkeeping(self) -> dict[str, Any]:
    """The counts that taking groups changes before they train, as they are before a take
    round; the other changes (records' streaks, prompts no longer outstanding, groups no
    longer to skip) are noted in the round's journal as they are made."""
    self._journal = {"streaks": {}, "outstanding": {}, "skips": set(), "skip_prompts": {},
                     "refeed": {}}
    return {k: getattr(self, k) for k in self._COUNTS}

  def _undo_take_bookkeeping(self, counts: dict[str, Any]) -> None:
    """Back to `counts` (_take_bookkeeping) and the journal's first values: the checkpoint a
    stop writes must not count the groups its restart takes again. The prompts of groups
    taken from a server lost since are fed to the one now (it never held them)."""
    for k, v in counts.items():
      setattr(self, k, v)
    for record, streak in self._journal["streaks"].items():
      if streak is None:
        self.streaks.pop(record, None)
      else:
        self.streaks[record] = streak
    self.outstanding.update(self._journal["outstanding"])
    self.skip_ids |= self._journal["skips"]
    self.skip_prompts.update(self._journal["skip_prompts"])
    try:  # one try: a stop gives up retrying
      self._feed_again(self._journal["refeed"].values())
    except ParamServerError as e:
      logging.error("rl: stopping; %d prompts of groups the lost server held could not be "
                    "fed again (%s): the restart does not train on them",
                    len(self._journal["refeed"]), e)

  def _take_round(self) -> list[Group] | None:
    """_take_groups' groups (None when stopped), the bookkeeping done as they are taken."""
    rl = self.config.rl
    groups: list[Group] = []
    uniform: list[Group] = []  # left out by dynamic sampling
    sampling = self.dynamic.start(self.shape.groups) if self.dynamic else None
    waited_since = time.monotonic()
    while len(groups) < self.shape.groups:
      if self._stop.is_set():
        return None
      want = self.shape.groups - len(groups)
      if sampling is not None:
        try:
          want = self.dynamic.requests(sampling)
        except DynamicSamplingExhausted as e:
          logging.warning("rl: %s; step %d is filled with %d of them", e, self.step + 1, want)
          self.filled += want
          self.filtered -= want
          self.left_out = uniform[want:]
          return groups + uniform[:want]
      try:
        self._feed_prompts(want)  # before each take: groups left out need prompts in their place
        take = self.client.take_rollouts(
            self._min_version(), want, wait_s=1.0,
            ack_deadline_s=float(rl.ack_deadline_s), requeue_unacked=self._requeue_next)
      except ParamServerError as e:
        if self._stopping(e, "the step's take"):
          return None
        if (e.code == grpc.StatusCode.INVALID_ARGUMENT
            and e.details.startswith("ack_deadline_s")):
          raise ValueError(f"rl.ack_deadline_s: {rl.ack_deadline_s} is past what the server at "
                           f"{self.client.address} allows ({e.details}); lower it or start "
                           f"the server with a larger --max_lease_deadline_s") from None
        # e.g. min_version above anything a server that lost its weights holds: feed it
        if (e.code == grpc.StatusCode.FAILED_PRECONDITION
            and self._server_lost(self.client.version_info().store_id)):
          continue
        raise
      self._requeue_next = False
      self._server_lost(take.store_id)
      self.dropped_stale += take.dropped_stale
      valid, rejected = [], self.rejected
      if take.rollouts:  # acknowledged with this step, the rejected groups too
        taken_before = self._pending_prompts()
        self.pending.append(PendingTake(take.take_id,
                                        [int(r.rollout_id) for r in take.rollouts],
                                        self.step + 1, [r.prompt.id for r in take.rollouts]))
        valid = self._valid_groups(take.rollouts, taken_before)
      if self.rejected - rejected < len(take.rollouts):  # a group came that was not refused
        waited_since = time.monotonic()
      elif time.monotonic() - waited_since > float(rl.take_timeout_s):
        raise TakeTimeout(self._no_groups_message())
      most, wait = self._refusal_bounds
      if self._refused_in_a_row >= most and time.monotonic() - waited_since > wait:
        raise TakeTimeout(self._refused_message())
      if not take.rollouts:
        continue
      if sampling is None:
        groups += valid
        continue
      drawn = sampling.drawn
      sampling = self.dynamic.observe(sampling, [g.rewards for g in valid])
      for j, group in enumerate(valid):
        if drawn + j in sampling.kept:
          groups.append(group)
        else:
          uniform.append(group)
          self.filtered += 1
    self.left_out = uniform
    return groups

  def _pending_prompts(self) -> dict[str, int]:
    """prompt id -> rollout id of each group in a take not yet acknowledged."""
    return {p: i for t in self.pending for p, i in zip(t.prompt_ids, t.rollout_ids)}

  @property
  def _refusal_bounds(self) -> tuple[int, float]:
    """(groups rejected in a row, seconds with none to train on) that end the run."""
    return (max(REFUSED_IN_A_ROW, 4 * self.shape.groups),
            min(REFUSED_WAIT_S, float(self.config.rl.take_timeout_s)))

  def _refused_message(self) -> str:
    return (f"rl: the fleet's last {self._refused_in_a_row} groups were all rejected (none to "
            f"train on for {self._refusal_bounds[1]:g}s), "
            f"the last: {self.last_rejection}; the workers cannot serve this run's prompts: start "
            f"them with this trainer's --config and its --config.* overrides (worker.*, "
            f"tokenizer.*, init_from_hf; a worker.verifiers file on their machines too)")

  def _no_groups_message(self) -> str:
    """Why rl.take_timeout_s ran out: no group came, or none that could be trained on."""
    waited = f"rl.take_timeout_s: no usable rollout group for {self.config.rl.take_timeout_s}s"
    if self.last_rejection is None:
      return f"{waited}; are workers running against {self.client.address}?"
    return (f"{waited}; {self.rejected} groups rejected, the last: {self.last_rejection} (do "
            f"the workers run this trainer's config?)")

  def _valid_groups(self, taken_rollouts, taken_before: dict[str, int] | None = None
                    ) -> list[Group]:
    """The groups of a take that can enter a batch; the others are counted and logged.
    Skipped: groups trained on already, whose take expired before a checkpoint held it
    (`skip_ids`, or a prompt still in an earlier take not yet acknowledged, `taken_before`:
    prompt id -> rollout id, come back as it was or sampled again under a new rollout id
    after the server dropped the requeued group as stale)."""
    taken_before = taken_before or {}
    valid = []
    for taken in taken_rollouts:
      if "eval" in taken.prompt.metadata:  # eval.on_workers: scored, not trained on
        self._eval_group(taken)
        continue
      fed = self.outstanding.pop(taken.prompt.id, None)
      if fed is not None and self._journal is not None:
        self._journal["outstanding"].setdefault(taken.prompt.id, fed)
      if (self._restart_floor is not None
          and taken.group.policy_version >= self._restart_version):
        self._restart_floor = None  # the restored weights' rollouts: the lost steps' came first
      # One that came back was counted (consumed, its record's streak) when first taken; so
      # was a prompt sampled again after the server dropped its requeued group as stale
      skipped = (taken.rollout_id if taken.rollout_id in self.skip_ids
                 else self.skip_prompts.get(taken.prompt.id))
      if skipped is not None and skipped in self.skip_ids:  # (and is in the checkpoint)
        self.skip_ids.discard(skipped)
        if taken.prompt.id in self.skip_prompts:
          fed = self.skip_prompts.pop(taken.prompt.id)
          if self._journal is not None:
            self._journal["skip_prompts"][taken.prompt.id] = fed
        if self._journal is not None:
          self._journal["skips"].add(skipped)
        self.came_back += 1
        continue
      if taken.prompt.id in taken_before:
        self.came_back += 1
        logging.log_every_n_seconds(
            logging.WARNING, "rl: prompt %s came back (rollout %d) before the checkpoint of "
            "its first take (rollout %d; rl.ack_deadline_s passed); skipped, trained on once",
            10, taken.prompt.id, taken.rollout_id, taken_before[taken.prompt.id])
        continue
      self.consumed += 1
      if taken.group.failure:  # a prompt no worker could sample: answered, not trained on
        self._reject(taken, f"prompt {taken.group.prompt_id} could not be sampled by worker "
                     f"{taken.group.metadata.get('worker', '?')!r}: {taken.group.failure}")
        continue
      if (self.selective and "record" in taken.prompt.metadata  # (an old source's: not ours)
          and taken.prompt.id.rpartition("-")[0] == self._id_prefix):
        record = int(taken.prompt.metadata["record"])
        if self._journal is not None:  # (a take round cut short puts it back)
          self._journal["streaks"].setdefault(record, self.streaks.get(record))
        streak = next_streak(self.streaks.get(record, 0), [s.reward for s in taken.group.samples])
        if streak:
          self.streaks[record] = streak
        else:
          self.streaks.pop(record, None)
      group = group_of(taken, self.tokenizer)
      try:
        check_group(group, self.taken_shape, self.model_config.vocab_size,
                    self.loss_cfg.reward_parts)
        if self.teacher_tokenizer is not None:  # the teacher reads it in its own tokens
          group = dataclasses.replace(group, teacher_prompt=self._teacher_prompt(taken.prompt))
        check_sampling(taken.group, self.sampling)
        check_tokenizer(taken.group, self.tokenizer_identity)
        if self.fixed_groups and len(group.rewards) > self.shape.samples:  # (memory planned
          # for this many: a batch of larger groups trained silently, twice the rows)
          raise ValueError(f"rollout {group.rollout_id}: {len(group.rewards)} samples, more "
                           f"than this trainer's worker.samples_per_prompt="
                           f"{self.shape.samples}")
        if self.dynamic and len(group.rewards) != self.shape.samples:
          raise ValueError(f"rollout {group.rollout_id}: {len(group.rewards)} samples; "
                           f"rl.dynamic_sampling needs worker.samples_per_prompt="
                           f"{self.shape.samples}")
      except ValueError as e:
        self._reject(taken, str(e))
        continue
      if (group.prompt_routes is None) == self.shape.routed and not self._told_routes:
        self._told_routes = True  # a worker started with another worker.routing_replay
        if self.shape.routed:
          logging.warning("rl: rollout %d came without routes although worker.routing_replay "
                          "is on; the trainer's routers pick its experts (rollouts/routed_frac "
                          "counts such groups)", group.rollout_id)
        else:
          logging.warning("rl: rollout %d came with routes but worker.routing_replay is off "
                          "here; they are not used", group.rollout_id)
      if self.completions_every:  # their texts, for the completions log
        self._taken[group.rollout_id] = taken
      if group.reward_parts_bad:
        self._count_malformed(group)
      self._refused_in_a_row = 0
      valid.append(group)
    return valid

  def _count_malformed(self, group: Group) -> None:
    """Count a group's malformed reward parts (skipped); a malformed one must not stop the
    run, and is warned of once."""
    if group.reward_parts_bad and not self.reward_parts_malformed:
      logging.warning("rl: rollout %d: reward part metadata %s: expected a finite number; "
                      "skipped (steps.jsonl's reward_parts_malformed counts such values)",
                      group.rollout_id, ", ".join(group.reward_parts_bad))
    self.reward_parts_malformed += len(group.reward_parts_bad)

  def _count_score_errors(self, step: int, errors: int, samples: int) -> None:
    """Counts the samples a worker's verifier raised on (scored 0), warning at the first and
    at steps whose every sample was one: a broken verifier, not a hard task."""
    every = bool(errors) and errors == samples
    self._all_erred_steps += every
    if errors and not self.score_errors:
      logging.warning("rl: step %d: %d of %d samples scored 0 because a worker's verifier "
                      "raised on them: the workers' logs say why (summary.json's "
                      "samples_score_errors counts them)", step, errors, samples)
    elif every:
      if self._all_erred_steps <= 3 or self._all_erred_steps % 100 == 0:
        logging.warning("rl: step %d: every sample scored 0 because a worker's verifier "
                        "raised on it (%d steps so far): the workers' logs say why",
                        step, self._all_erred_steps)
    self.score_errors += errors

  def _reward_parts_record(self, groups: list[Group]) -> dict[str, Any]:
    """steps.jsonl's reward_parts: each part's mean over the step's samples that carry it
    (absent when none does); reward_parts_malformed: the values skipped since the run
    began (every restart's), if any."""
    values = part_values(groups)
    record: dict[str, Any] = {}
    if values:
      record["reward_parts"] = {name: float(np.mean(values[name])) for name in sorted(values)}
    if self.reward_parts_malformed:
      record["reward_parts_malformed"] = self.reward_parts_malformed
    return record

  def _reject(self, taken, why: str) -> None:
    """Count and log (at most every 10 s) a group that cannot enter a batch; one sampled for
    this start (not one an earlier start left unacknowledged) counts towards
    REFUSED_IN_A_ROW."""
    if taken.group.policy_version >= self._restart_version:
      self._refused_in_a_row += 1
    logging.log_every_n_seconds(
        logging.WARNING, "rl: rollout group rejected: %s (%d so far; do the workers run this "
        "trainer's config? the run ends when none can be trained on for rl.take_timeout_s, or "
        "%d in a row for %gs)", 10, why, self.rejected + 1, *self._refusal_bounds)
    self.rejected += 1
    self.last_rejection = why

  def _publish(self, version: int, *, keyframe: bool = False, tensorboard: bool = True):
    """Publish the current params as `version`; one line of versions.jsonl per version, and
    its sync/ points at this step (`tensorboard`)."""
    pub = self.publisher.publish(self.state.params, version, keyframe=keyframe)
    self._published_step = self.step
    if not self.leader:  # the leader's go to versions.jsonl; a follower keeps none
      return pub
    with open_jsonl(os.path.join(self.workdir, "versions.jsonl")) as f:
      f.write(json.dumps({"version": pub.version, "step": self.step, "keyframe": pub.keyframe,
                          "bytes": pub.bytes, "seconds": pub.seconds,
                          "digest": f"{pub.digest:016x}",
                          **({"keyframe_bytes": pub.keyframe_bytes} if pub.keyframe_bytes
                             else {})}) + "\n")
    if tensorboard:
      self.writer.add_scalar("sync/bytes", pub.bytes + pub.keyframe_bytes, self.step)
      self.writer.add_scalar("sync/seconds", pub.seconds, self.step)
      self.writer.add_scalar("sync/version", pub.version, self.step)
    return pub

  # -- checkpoints and acknowledgements ---------------------------------------------------

  def save(self) -> None:
    """Checkpoint this step (async when configured); its takes are acked once durable."""
    step = self.step
    if step in self.checkpointer.all_steps():
      return
    tree = self.state.to_tree()
    if self.mixed_reference:
      tree["ref_params"] = self.ref_params
    if self.critic is not None:
      tree["critic"] = self.critic.state.to_tree()
    # An async save before it is durable first (orbax's save waits for it anyway): its takes
    # are acked now, not left unacked for as long as each save is still running at the next.
    self.checkpointer.wait()
    refused = self._ack_or_defer()
    self.checkpointer.save(step, tree, self.metadata())
    if not self.config.checkpoint.async_save:
      refused = refused or self._ack_or_defer()
    if refused is not None:
      raise refused

  def _ack_or_defer(self) -> ParamServerError | None:
    """_ack_durable, where a server error leaves the takes to the next checkpoint or start
    (they are in the checkpoint's metadata): a checkpoint waiting on it was lost with the
    run, and the steps since the last one with it. Returns the error unless it is one a
    server out of reach gives (RETRYABLE, past the client's retries): a refusal (a token, a
    take of another run) is raised once the checkpoint is written."""
    try:
      self._ack_durable()
    except ParamServerError as e:
      logging.warning("rl: %d takes trained on are left unacknowledged for the next "
                      "checkpoint or start: %s", len(self.pending), e)
      return None if e.code in RETRYABLE else e
    return None

  def _ack_durable(self) -> None:
    """Acknowledge the takes that a durable checkpoint has trained on (the leader's)."""
    if not self.leader or not self.pending or self.checkpointer.saving():
      return
    # At once when nothing is in flight, and raises where the last async save failed: orbax
    # lists a step from save() on, so latest_step alone would name one never written.
    self.checkpointer.wait()
    durable = self.checkpointer.latest_step()
    if durable is None:
      return
    keep = []
    for take in self.pending:
      if take.step > durable:
        keep.append(take)
        continue
      try:
        self.client.ack(take.take_id)
      except ParamServerError as e:
        if e.code != grpc.StatusCode.NOT_FOUND:
          if self._stopping(e, f"the acknowledgement of take {take.take_id} (step "
                               f"{take.step}, checkpointed)"):
            keep.append(take)
            continue
          raise
        if self._server_lost(self.client.version_info().store_id):
          return  # no take of this run's is left to acknowledge
        # Its ack deadline passed before this checkpoint: the server serves its groups
        # again, and they are skipped (trained on already) when they come.
        logging.warning("rl: take %s expired before the checkpoint of step %d held it; its "
                        "%d groups are skipped when they come back (rl.ack_deadline_s %gs is "
                        "shorter than checkpoint.every_steps steps take)", take.take_id,
                        take.step, len(take.rollout_ids), float(self.config.rl.ack_deadline_s))
        self._skip(take)
    self.pending = keep

  # -- logs, evaluation, summary ----------------------------------------------------------

  def _step_record(self, step: int, groups: list[Group], batch: dict, metrics: dict,
                   samples_per_s: float) -> dict[str, Any]:
    """The step's line of steps.jsonl; taken before the step's publication, so staleness is
    versions behind the weights the step trained (one per group, as rollout_ids;
    versions_behind)."""
    mask = batch["sample_mask"] > 0
    staleness = [versions_behind(g.policy_version, self.version, self.saved_version,
                                 self._restart_version) for g in groups]
    # What the policy scored: every group the step took, those dynamic sampling left out
    # too (the trained ones alone all vary: their pass@n is 1, their mean near 0.5)
    taken = groups + self.left_out
    record = {
        "step": step, "version": self.version, "time": time.time(),
        "rollout_ids": [g.rollout_id for g in groups],
        "reward_mean": float(np.mean([r for g in taken for r in g.rewards])),
        "pass_at_n": pass_at_n(taken),
        "resumed_samples": sum(g.resumed for g in groups),
        "score_errors": sum(g.score_errors for g in taken),  # (left out ones too: all 0)
        "staleness": staleness, "staleness_mean": float(np.mean(staleness)),
        "staleness_max": int(max(staleness)),
        "samples_per_s": samples_per_s,
        "rollout_wait_s": self.rollout_wait_s,  # taking the step's groups (waiting for them)
        # None where the loss clips nothing (m2po masks: train/m2po_masked_frac)
        # None where the policy did not step (critic.warmup_steps)
        "loss": metrics.get("loss"), "clip_frac": metrics.get("clip_frac"),
        "iw_mean": metrics.get("iw_mean"), "entropy": metrics.get("entropy"), "heldout": None,
        "trained_token_frac": metrics.get("trained_token_frac"),
        **response_stats(groups, self.shape.response_len, self.tokenizer.stop_ids),
        "response_capacity": int(batch["response_tokens"].shape[-1]),  # what rows packed
    }
    if self.shape.baselines:  # ReMax: the greedy samples' mean reward, beside reward_mean
      record["baseline_reward_mean"] = float(np.mean([g.baseline_reward for g in groups]))
    if self.loss_cfg.overlong_buffer:  # what the advantages add to reward_mean's rewards
      budget = self.loss_cfg.budget or int(batch["response_tokens"].shape[-1])
      record["overlong_penalty_mean"] = float(np.mean(soft_overlong_punishment(
          batch["response_lens"][mask], budget, min(self.loss_cfg.overlong_buffer, budget))))
    if self.dynamic:  # totals so far; the trained groups' mean reward
      record.update(filtered=self.filtered, filled=self.filled,
                    reward_mean_trained=float(batch["rewards"][mask].mean()))
    if self.selective:  # totals so far: records passed over, records on a streak now
      record.update(passed_over=self.retired, uniform_records=len(self.streaks))
    if "entropy_coef" in metrics:  # loss.adaptive_entropy's, for the next step
      record["entropy_coef"] = metrics["entropy_coef"]
    # loss.kl_in_reward's KL; loss.kl_target's beta; loss.advantage="opd"'s reverse KL left
    for k in ("reward_kl", "kl_in_reward", "teacher_kl"):
      if k in metrics:
        record[k] = metrics[k]
    for k in ("vf_loss", "value_explained_var"):  # loss.advantage="gae": the critic's
      if k in metrics:
        record[k] = metrics[k]
    if "router_aux_loss" in metrics:  # a mixture of experts: its load balance (1 = even)
      record["router_aux_loss"] = metrics["router_aux_loss"]
    if self.shape.routed:  # routing replay: groups that brought routes, and how alike the
      # trainer's routers pick (1: as the workers' did)
      record.update(routed_frac=float(np.mean([g.prompt_routes is not None for g in groups])),
                    router_agreement=metrics.get("router_agreement", 0.0))
    return record

  def _log_step(self, record: dict, metrics: dict) -> None:
    w, step = self.writer, record["step"]
    w.add_scalar("rollouts/reward_mean", record["reward_mean"], step)
    if "overlong_penalty_mean" in record:  # (loss.overlong_buffer)
      w.add_scalar("rollouts/overlong_penalty_mean", record["overlong_penalty_mean"], step)
    if "reward_mean_trained" in record:  # (dynamic sampling)
      w.add_scalar("rollouts/reward_mean_trained", record["reward_mean_trained"], step)
    for name, mean in record.get("reward_parts", {}).items():
      w.add_scalar(f"rollouts/reward/{name}", mean, step)
    if record["pass_at_n"] is not None:
      w.add_scalar("rollouts/pass_at_n", record["pass_at_n"], step)
    w.add_scalar("rollouts/samples_per_second", record["samples_per_s"], step)
    w.add_scalar("rollouts/wait_seconds", record["rollout_wait_s"], step)
    w.add_scalar("rollouts/staleness_mean", record["staleness_mean"], step)
    w.add_scalar("rollouts/staleness_max", record["staleness_max"], step)
    w.add_scalar("rollouts/resumed_samples", record["resumed_samples"], step)
    w.add_scalar("rollouts/score_errors", record["score_errors"], step)
    for k in ("response_len_mean", "response_len_max", "response_capacity", "truncated_frac",
              "env_replies_mean", "env_token_frac", "baseline_reward_mean"):
      if k in record:  # (env_: multi-turn groups only; baseline_: ReMax)
        w.add_scalar(f"rollouts/{k}", record[k], step)
    if "routed_frac" in record:
      w.add_scalar("rollouts/routed_frac", record["routed_frac"], step)
    for k in ("filtered", "filled", "passed_over", "uniform_records"):
      if k in record:  # totals so far (dynamic sampling, selective rollouts)
        w.add_scalar(f"rollouts/{k}", record[k], step)
    w.add_histogram("rollouts/staleness", np.asarray(record["staleness"]), step)
    for k, v in metrics.items():
      w.add_scalar(f"train/{k}", v, step)
    try:
      w.add_scalar("workers/alive", self.client.stats().workers_alive, step)
    except ParamServerError as e:
      logging.warning("rl: stats: %s", e)

  def _log_completions(self, step: int, groups: list[Group], batch: dict) -> None:
    """Every log.completions_every steps, the step's first log.completions_groups groups
    with all their samples: a line each in completions.jsonl and a table in the events."""
    taken, self._taken = self._taken, {}
    if not self.completions_every or step % self.completions_every:
      return
    adv, mask = logged_advantages(batch, self.shape.groups, self.loss_cfg)
    trained = np.asarray(adv * mask).reshape(batch["rewards"].shape)  # 0: left out (mc_grpo)
    records = []
    for gi, group in enumerate(groups[:self.completions_groups]):
      rows = batch["row_group"] == gi
      advantages = trained[rows][batch["sample_mask"][rows] > 0]  # in sample order
      records.append(completion_record(step, group, taken[group.rollout_id], advantages,
                                       self.tokenizer))
    self._completions_log.writelines(json.dumps(r) + "\n" for r in records)
    self._completions_log.flush()
    self.writer.add_table("rollouts/completions", COMPLETION_COLUMNS,
                          [row for r in records for row in completion_rows(r)], step)

  def finish(self, seconds: float, start_step: int) -> dict[str, Any]:
    """Final evaluation (exact match, pass@1 and pass@k; the workers' with eval.on_workers),
    the Hugging Face export and summary.json. A run stopped (SIGTERM, Ctrl-C) before
    rl.steps, or during the workers' final evaluation, writes the summary alone (`stopped`):
    it is checkpointed, a rerun goes on, and a preempted machine's grace (or `rlax-ps
    local`'s) is no time for an evaluation."""
    stopped = self._stop_agreed() and self.step < self.total_steps
    summary: dict[str, Any] = {"step": self.step, "version": self.version, "seconds": seconds,
                               "steps_this_run": self.step - start_step,
                               "rollout_groups_trained": self.trained_rollouts,
                               "samples_resumed": self.resumed_samples,
                               "samples_score_errors": self.score_errors,
                               # the share of this run's time spent taking groups
                               "rollout_wait_frac": self.rollout_wait_total_s
                                                    / max(seconds, 1e-9),
                               "warm_start": self.warm_start_eval}
    if self.heldout.size and not stopped:
      exact = passes = None
      if self.fleet_eval:  # the workers answer it, holding the final weights (published by
        # every process of a multi-host trainer alike: the leader's word)
        if self._shared(not self._stop.is_set() and self._published_step != self.step):
          self._publish(self.version + 1)
        if self.leader and not self._stop.is_set():
          exact, passes = self._fleet_evaluation("final", int(self.config.eval.pass_k))
        # A stop cut it short: the run is stopped at its last step, a rerun evaluates it
        stopped = bool(self._shared(self._stop_agreed() and exact is None))
      else:
        exact = self.evaluate()
        passes = heldout_lib.pass_at_k(self.graphdef, self.state.params, self.tokenizer,
                                       self.heldout, self.config)
      if exact is not None:
        summary["heldout_exact_match"] = self.last_eval = exact
        self.log_eval(exact, self.step)
      if passes:
        summary["heldout_pass"] = passes
        summary["pass_sampling"] = dict(self.heldout.sampling)  # the workers' settings
        for name, v in passes.items():
          self.writer.add_scalar(f"eval/{name}", v, self.step)
    if stopped:  # as the SFT trainer's: the signal (True: a stop without one)
      summary["stopped"] = self.stop_signal or True
    log = []  # (a follower's summary, written nowhere, has no sync figures)
    if self.leader and os.path.exists(os.path.join(self.workdir, "versions.jsonl")):
      log = [(r["version"], r["bytes"], r["seconds"], r["keyframe"],  # every run's
              r.get("keyframe_bytes", 0)) for r in self._versions_log()]
    summary["sync"] = sync_summary(self.publisher.fmt, log)
    summary["export"] = self.export_hf() if self.config.export.hf and not stopped else None
    summary["dropped_stale"], summary["rejected"] = self.dropped_stale, self.rejected
    if self.left_unacked:  # taken by the final evaluation on the workers, left for a rerun
      summary["groups_left_unacked"] = self.left_unacked
    if self.servers_lost:
      summary["servers_lost"] = self.servers_lost
    if self.dynamic:
      summary["filtered"], summary["filled"] = self.filtered, self.filled
    if self.reward_parts_totals:
      summary["reward_parts"] = part_means(self.reward_parts_totals)
    summary["reward_parts_malformed"] = self.reward_parts_malformed
    if self.leader:
      write_json(os.path.join(self.workdir, "summary.json"), summary)
    self.writer.flush()
    return summary


def completion_record(step: int, group: Group, taken, advantages: np.ndarray,
                      tokenizer: Tokenizer) -> dict[str, Any]:
  """A line of completions.jsonl: a trained group's prompt, answer and samples as the worker
  submitted them (`taken`, its TakenRollout; a text left empty is decoded from the tokens),
  each with its reward, the advantage it was trained with and its token count."""
  prompt = taken.prompt
  return {
      "step": step, "policy_version": group.policy_version, "rollout_id": group.rollout_id,
      "prompt_id": prompt.id, "task": prompt.task,
      "prompt": prompt.text or tokenizer.decode(group.prompt_tokens),
      "answer": prompt.extra.decode("utf-8", "replace"), "worker_id": taken.worker_id,
      "samples": [{"completion": s.text or tokenizer.decode(tokens), "reward": float(reward),
                   "advantage": float(adv), "tokens": len(tokens),
                   "finish_reason": s.finish_reason}  # stop | length | "": not sent
                  for s, tokens, reward, adv in zip(taken.group.samples, group.responses,
                                                    group.rewards, advantages)],
  }


COMPLETION_COLUMNS = ("prompt_id", "version", "worker", "prompt", "answer", "completion",
                      "reward", "advantage", "tokens", "finish")


def completion_rows(record: dict[str, Any]) -> list[list[Any]]:
  """A completions.jsonl line as table rows (COMPLETION_COLUMNS), one per sample."""
  head = [record["prompt_id"], record["policy_version"], record["worker_id"], record["prompt"],
          record["answer"]]
  return [head + [s["completion"], s["reward"], s["advantage"], s["tokens"], s["finish_reason"]]
          for s in record["samples"]]


def _dynamic_sampler(config, samples: int) -> DynamicSampler | None:
  """DAPO dynamic sampling as rl.dynamic_sampling asks (None: off; check_rl_config checked
  its settings)."""
  if not config.rl.get("dynamic_sampling", False):
    return None
  return DynamicSampler(group_size=samples,
                        max_groups_factor=float(config.rl.get("dynamic_sampling_max_factor", 3.0)),
                        cap_setting="rl.dynamic_sampling_max_factor")


def server_retry(config) -> RetryPolicy:
  """How long the trainer's server calls are retried while the server does not answer (a
  restart, a route down): rl.take_timeout_s, its patience for rollouts that do not come,
  not the client's 60 s (a server back after 80 s ended the trainer)."""
  return RetryPolicy(deadline_s=float(config.rl.take_timeout_s))


def stop_on_signals(trainer: RLTrainer) -> None:
  """SIGTERM / SIGINT / SIGHUP: finish the step, checkpoint and return, noting the signal
  (with steps left, `rlax-ps train` then exits with 128 + it)."""
  for sig in STOP_SIGNALS:
    signal.signal(sig, lambda signum, _: trainer.request_stop(signum))

