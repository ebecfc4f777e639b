"""Rollout groups -> the RL trainer's batch: one packed `[P + N*R]` row per group (numpy).

A group of k samples fills ceil(k / N) rows (VIGOR's groups are unequal); every row repeats
its group's prompt and carries the group's index, so advantages are taken over the whole
group. Row counts are rounded up to `groups * 2**j` so a few compiled shapes serve every
step; padding rows and slots have a zero sample mask. With routing replay the batch also
carries each token's experts, -1 where a group brought none (the trainer's routers pick).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

ROUTE_DTYPE = np.int16  # expert ids in the batch (-1: the trainer's routers pick)


@dataclasses.dataclass(frozen=True)
class BatchShape:
  """Static sizes of the packed batch: what one compiled step takes."""

  groups: int  # G: rollout groups per step.
  samples: int  # N: response slots per packed row.
  prompt_len: int  # P: prompt tokens per row (bos included).
  response_len: int  # R: tokens per response (the workers' max_new_tokens).
  # Routing replay (worker.routing_replay): the model's MoE layers M, experts per token k
  # and experts E; 0 = no routes in the batch.
  moe_layers: int = 0
  top_k: int = 0
  num_experts: int = 0
  # The reward parts the batch carries by name, reward_parts [rows, N, K] (loss.
  # reward_aggregation="normalize_then_sum"); (): none.
  reward_parts: tuple[str, ...] = ()
  # ReMax (loss.advantage="remax"): each group brings its greedy sample's reward, baselines
  # [rows, N] (the group's on each of its samples).
  baselines: bool = False
  # Distillation with the teacher on the workers (worker.teacher): each sample brings the
  # teacher's log-probs of its tokens, teacher_logp [rows, N, R] (loss.advantage="opd"),
  # and its `teacher_topk` most likely tokens at each position, teacher_topk_ids and
  # teacher_topk_logp [rows, N, R, k] (loss.distill_topk); 0 at padding.
  teacher_logp: bool = False
  teacher_topk: int = 0

  def __post_init__(self):
    if (not isinstance(self.reward_parts, tuple) or len(set(self.reward_parts))
        != len(self.reward_parts) or not all(isinstance(n, str) for n in self.reward_parts)):
      raise ValueError(f"BatchShape.reward_parts: expected a tuple of distinct names, got "
                       f"{self.reward_parts!r}")
    for f in dataclasses.fields(self):
      if f.name in ("reward_parts", "baselines", "teacher_logp"):
        continue
      v, least = getattr(self, f.name), 0 if f.name in _ROUTING + ("teacher_topk",) else 1
      if not isinstance(v, int) or v < least:
        raise ValueError(f"BatchShape.{f.name}: expected an int >= {least}, got {v!r}")
    if self.moe_layers and not 0 < self.top_k <= self.num_experts:
      raise ValueError(f"BatchShape.top_k: expected 1 to num_experts={self.num_experts} with "
                       f"moe_layers={self.moe_layers}, got {self.top_k}")

  @property
  def routed(self) -> bool:
    return self.moe_layers > 0


_ROUTING = ("moe_layers", "top_k", "num_experts")


@dataclasses.dataclass(frozen=True)
class Group:
  """One prompt's rollouts as the trainer uses them."""

  rollout_id: int
  prompt_tokens: np.ndarray  # [p] int32
  responses: tuple[np.ndarray, ...]  # k arrays of token ids
  behaviour_logp: tuple[np.ndarray, ...]  # k arrays, one log-prob per token
  rewards: np.ndarray  # [k] float32
  policy_version: int
  # Routing replay: the sampler's experts, [p, M, k] for the prompt and, per sample,
  # [tokens - 1, M, k] for its fed-back tokens; None when the worker sent none.
  prompt_routes: np.ndarray | None = None
  response_routes: tuple[np.ndarray, ...] | None = None
  # Multi-turn: per sample, True on the tokens an environment wrote (no loss), or None for a
  # sample that is all the policy's; None: every sample is.
  observed: tuple[np.ndarray | None, ...] | None = None
  # Samples a stopped or killed worker began and another finished (partial rollouts).
  resumed: int = 0
  # Samples scored 0 because a worker's verifier raised on them (its log says why).
  score_errors: int = 0
  # The prompt's id: a step's groups are trained in its order, not the order they came in.
  prompt_id: str = ""
  # Each sample's verifier verdict (reward alone cannot tell it once a reward model's score
  # is added); None when the worker sent none (task reward_model: a score).
  passed: tuple[bool, ...] | None = None
  # The raw parts of the samples' rewards by name (metadata "reward/<name>": the task
  # verifier's, worker.reward_terms', the reward model's), for the step's log; and the
  # entries skipped as malformed, as key=value.
  reward_parts: dict[str, tuple[float, ...]] | None = None
  reward_parts_bad: tuple[str, ...] = ()
  # The reward of the prompt's greedy sample, not among `responses` (worker.greedy_baseline,
  # ReMax's baseline); None when the worker sent none.
  baseline_reward: float | None = None
  # Per sample, the teacher's scores the worker sent (worker.teacher): its log-probs [t], top
  # ids [t, k] and their log-probs [t, k] (None: not sent); None when no sample has any.
  teacher: tuple[tuple[np.ndarray | None, ...], ...] | None = None
  # The prompt in the tokens of a teacher of another tokenizer (teacher.tokenizer), rendered
  # by its own chat template; None without one.
  teacher_prompt: np.ndarray | None = None


def check_group(group: Group, shape: BatchShape, vocab_size: int | None = None,
                reward_weights: tuple[tuple[str, float], ...] = ()) -> None:
  """ValueError naming the rollout and the field when `group` cannot enter a batch (token
  ids past `vocab_size` too: an embedding lookup would clamp them, silently; with
  `reward_weights` (loss.reward_parts), rewards that are not their parts' weighted sum)."""
  where = f"rollout {group.rollout_id}"
  p = len(group.prompt_tokens)
  if not 1 <= p <= shape.prompt_len:
    raise ValueError(f"{where}: prompt of {p} tokens; rl.max_prompt_tokens={shape.prompt_len} "
                     f"holds 1 to {shape.prompt_len}")
  k = len(group.responses)
  if k == 0 or len(group.behaviour_logp) != k or len(group.rewards) != k:
    raise ValueError(f"{where}: expected as many log-prob arrays and rewards as samples (>= 1), "
                     f"got {k} samples, {len(group.behaviour_logp)} log-prob arrays and "
                     f"{len(group.rewards)} rewards")
  for i, (toks, lp) in enumerate(zip(group.responses, group.behaviour_logp)):
    if len(toks) > shape.response_len:
      raise ValueError(f"{where}: samples[{i}] has {len(toks)} tokens, more than "
                       f"worker.max_new_tokens={shape.response_len}")
    if len(lp) != len(toks):
      raise ValueError(f"{where}: samples[{i}].logprobs: expected {len(toks)} (one per token), "
                       f"got {len(lp)}")
    if len(lp) and not np.all(np.isfinite(lp)):
      raise ValueError(f"{where}: samples[{i}].logprobs: expected finite values")
  if group.observed is not None:
    if len(group.observed) != k:
      raise ValueError(f"{where}: observed: expected one entry per sample ({k}), got "
                       f"{len(group.observed)}")
    for i, (toks, seen) in enumerate(zip(group.responses, group.observed)):
      if seen is not None and len(seen) != len(toks):
        raise ValueError(f"{where}: samples[{i}].observed: expected {len(toks)} (one per "
                         f"token), got {len(seen)}")
  if not np.all(np.isfinite(group.rewards)):
    raise ValueError(f"{where}: rewards: expected finite values, got {group.rewards}")
  if shape.baselines and (group.baseline_reward is None
                          or not math.isfinite(group.baseline_reward)):
    raise ValueError(f"{where}: baseline_reward: expected a finite number (loss.advantage="
                     f"'remax' takes each group's greedy sample's reward as its baseline: "
                     f"workers with worker.greedy_baseline=True), got {group.baseline_reward}")
  if vocab_size is not None:
    for field, ids in [("prompt", group.prompt_tokens),
                       *((f"samples[{i}]", t) for i, t in enumerate(group.responses))]:
      if len(ids) and int(np.max(ids)) >= vocab_size:
        raise ValueError(f"{where}: {field}.token_ids: expected ids below the model's vocab_size "
                         f"{vocab_size}, got {int(np.max(ids))} (a worker with another "
                         f"tokenizer or model?)")
  if shape.teacher_logp or shape.teacher_topk:
    _check_teacher(group, shape, where)
  if shape.routed and (group.prompt_routes is not None or group.response_routes is not None):
    _check_routes(group, shape, where)  # (a trainer that replays none leaves routes unread)
  if shape.reward_parts:
    _check_reward_parts(group, shape, where, dict(reward_weights))


def _check_teacher(group: Group, shape: BatchShape, where: str) -> None:
  """Each sample brings the teacher's scores the batch takes, one per token (top k: k); a
  sample of no tokens may come without (none due)."""
  scores = group.teacher or (None,) * len(group.responses)
  for i, (toks, teacher) in enumerate(zip(group.responses, scores)):
    logp, ids, _ = teacher or (None, None, None)
    if shape.teacher_logp and len(toks) and (logp is None or len(logp) != len(toks)):
      raise ValueError(f"{where}: samples[{i}].teacher_logprobs_f32: expected one teacher "
                       f"log-prob per token ({len(toks)}: workers with worker.teacher), got "
                       f"{None if logp is None else len(logp)}")
    k = shape.teacher_topk
    if k and len(toks) and (ids is None or ids.shape != (len(toks), k)):
      raise ValueError(f"{where}: samples[{i}].teacher_topk_ids: expected the teacher's top "
                       f"{k} (loss.distill_topk; worker.teacher_topk) at each of {len(toks)} "
                       f"tokens, got shape {None if ids is None else ids.shape}")


def _check_reward_parts(group: Group, shape: BatchShape, where: str,
                        weights: dict[str, float]) -> None:
  """The group's reward parts are among the batch's, each with a value for every sample."""
  parts = group.reward_parts or {}
  if not parts or set(parts) - set(shape.reward_parts):
    raise ValueError(f"{where}: reward parts {sorted(parts)}: expected some of "
                     f"{list(shape.reward_parts)}, the parts loss.reward_aggregation="
                     f"'normalize_then_sum' weighs (worker.reward_terms, worker.reward_model)")
  for name, values in parts.items():
    if len(values) != len(group.responses):
      raise ValueError(f"{where}: reward part {name!r}: expected a value for each of "
                       f"{len(group.responses)} samples, got {len(values)}")
  if not weights:
    return
  if "task" not in parts and "reward_model" in weights:  # task reward_model: its score, x 1
    weights = {**weights, "reward_model": 1.0}
  summed = sum(weights[name] * np.asarray(values, np.float64) for name, values in parts.items())
  odd = np.flatnonzero(~np.isclose(summed, group.rewards, rtol=1e-4, atol=1e-4))
  if len(odd):
    i = int(odd[0])
    raise ValueError(
        f"{where}: samples[{i}].reward {group.rewards[i]:g} is not the weighted sum of its "
        f"parts with this trainer's weights {weights} ({float(summed[i]):g}): the workers "
        f"weigh worker.reward_terms / worker.reward_model_weight otherwise than this config, "
        f"whose weights loss.reward_aggregation='normalize_then_sum' uses; give both the same")


def _check_routes(group: Group, shape: BatchShape, where: str) -> None:
  if group.prompt_routes is None or group.response_routes is None:
    raise ValueError(f"{where}: expected routes for the prompt and every sample, or none")
  if len(group.response_routes) != len(group.responses):
    raise ValueError(f"{where}: expected routes for each of {len(group.responses)} samples, "
                     f"got {len(group.response_routes)}")
  m, k = shape.moe_layers, shape.top_k
  named = [("prompt_routes", group.prompt_routes, len(group.prompt_tokens))]
  named += [(f"samples[{i}].routes", r, max(len(t) - 1, 0))
            for i, (r, t) in enumerate(zip(group.response_routes, group.responses))]
  for name, routes, tokens in named:
    if routes.shape != (tokens, m, k):
      raise ValueError(f"{where}: {name}: expected shape [{tokens} tokens, {m} MoE layers, "
                       f"top_k={k}], got {list(routes.shape)}")
    if routes.size and (routes.min() < 0 or routes.max() >= shape.num_experts):
      raise ValueError(f"{where}: {name}: expected expert ids in [0, {shape.num_experts}), "
                       f"got [{routes.min()}, {routes.max()}]")
    if k > 1 and routes.size and np.any(np.diff(np.sort(routes, axis=-1), axis=-1) == 0):
      raise ValueError(f"{where}: {name}: expected {k} distinct experts per token and layer")


def response_stats(groups: Sequence[Group], max_len: int, stop_ids: Sequence[int]
                   ) -> dict[str, float]:
  """Mean and max response length of the groups' samples, and the share truncated: at
  `max_len` tokens without ending on a stop id (what DAPO's overlong punishment targets).
  Multi-turn groups add the environment's replies per sample and its share of the tokens."""
  responses = [r for g in groups for r in g.responses]
  if not responses:
    return {"response_len_mean": 0.0, "response_len_max": 0.0, "truncated_frac": 0.0}
  lens = np.asarray([len(r) for r in responses])
  stops = set(int(i) for i in stop_ids)
  cut = [len(r) >= max_len and int(r[-1]) not in stops for r in responses]
  stats = {"response_len_mean": float(lens.mean()), "response_len_max": float(lens.max()),
           "truncated_frac": float(np.mean(cut))}
  if any(g.observed is not None for g in groups):
    seen = [np.asarray(o, bool) if o is not None else np.zeros(len(r), bool)
            for g in groups for r, o in zip(g.responses, g.observed or (None,) * len(g.responses))]
    stats["env_replies_mean"] = float(np.mean(
        [int(np.sum(np.diff(np.concatenate([[False], s]).astype(np.int8)) == 1)) for s in seen]))
    stats["env_token_frac"] = float(sum(s.sum() for s in seen) / max(lens.sum(), 1))
  return stats


def fit_response_len(groups: Sequence[Group], shape: BatchShape, buckets: int) -> BatchShape:
  """`shape` with the response capacity cut to the smallest of `buckets` sizes (the budget R,
  R/2, R/4, ..., each rounded up to 8 tokens) that holds the groups' longest response: a
  step of short responses packs and computes [P + N*R'] rows, not [P + N*R], and at most
  `buckets` shapes compile. A response over R is left for check_group to refuse."""
  if buckets < 1:
    raise ValueError(f"rl.response_buckets: expected >= 1, got {buckets}")
  cap = shape.response_len
  longest = max((len(r) for g in groups for r in g.responses), default=0)
  fits = [c for c in response_lens(cap, buckets) if c >= longest]
  return dataclasses.replace(shape, response_len=fits[0] if fits else cap)


def response_lens(cap: int, buckets: int) -> list[int]:
  """The response capacities a budget of `cap` tokens packs to, smallest first."""
  ceil = lambda a, b: -(-a // b)  # noqa: E731
  return sorted({min(cap, ceil(ceil(cap, 2 ** k), 8) * 8) for k in range(buckets)})


def rows_needed(groups: Sequence[Group], shape: BatchShape) -> int:
  """Packed rows for `groups`, rounded up to shape.groups * 2**j."""
  need = sum(math.ceil(len(g.responses) / shape.samples) for g in groups)
  rows = shape.groups
  while rows < need:
    rows *= 2
  return rows


def empty_batch(rows: int, shape: BatchShape, pad_id: int = 0) -> dict[str, np.ndarray]:
  """A packed batch of `rows` rows holding no sample (build_batch's arrays, padding only)."""
  n, p, r = shape.samples, shape.prompt_len, shape.response_len
  extra = {}
  if shape.routed:
    m, k = shape.moe_layers, shape.top_k
    extra = {"prompt_routes": np.full((rows, p, m, k), -1, ROUTE_DTYPE),
             "response_routes": np.full((rows, n, r, m, k), -1, ROUTE_DTYPE)}
  if shape.reward_parts:
    extra["reward_parts"] = np.full((rows, n, len(shape.reward_parts)), np.nan, np.float32)
  if shape.baselines:
    extra["baselines"] = np.zeros((rows, n), np.float32)
  if shape.teacher_logp:
    extra["teacher_logp"] = np.zeros((rows, n, r), np.float32)
  if shape.teacher_topk:
    extra["teacher_topk_ids"] = np.zeros((rows, n, r, shape.teacher_topk), np.int32)
    extra["teacher_topk_logp"] = np.zeros((rows, n, r, shape.teacher_topk), np.float32)
  return {
      **extra,
      "prompt_tokens": np.full((rows, p), pad_id, np.int32),
      "prompt_lens": np.ones((rows,), np.int32),
      "response_tokens": np.full((rows, n, r), pad_id, np.int32),
      "response_lens": np.zeros((rows, n), np.int32),
      "behaviour_logp": np.zeros((rows, n, r), np.float32),
      "policy_tokens": np.ones((rows, n, r), np.float32),
      "rewards": np.zeros((rows, n), np.float32),
      "sample_mask": np.zeros((rows, n), np.float32),
      "row_group": np.zeros((rows,), np.int32),
  }


def build_batch(groups: Sequence[Group], shape: BatchShape, pad_id: int = 0
                ) -> dict[str, np.ndarray]:
  """The packed batch of `groups` (at most shape.groups of them), as host arrays.

  prompt_tokens [rows, P], prompt_lens [rows], response_tokens [rows, N, R],
  response_lens [rows, N], behaviour_logp [rows, N, R], policy_tokens [rows, N, R] (0 on an
  environment's tokens: context, not trained on), rewards [rows, N],
  sample_mask [rows, N] (1 on real samples), row_group [rows] (the group's index); routing
  replay: prompt_routes [rows, P, M, k], response_routes [rows, N, R, M, k] (-1: none);
  shape.reward_parts: reward_parts [rows, N, K], the samples' raw parts (NaN: none);
  shape.baselines: baselines [rows, N], each sample's group's baseline_reward;
  shape.teacher_logp / teacher_topk: the workers' teacher scores (BatchShape).
  """
  if not 1 <= len(groups) <= shape.groups:
    raise ValueError(f"groups: expected 1 to {shape.groups} (rl.groups_per_step), got "
                     f"{len(groups)}")
  for g in groups:
    check_group(g, shape)
  out = empty_batch(rows_needed(groups, shape), shape, pad_id)
  n, row = shape.samples, 0
  for gi, g in enumerate(groups):
    for start in range(0, len(g.responses), n):
      out["prompt_tokens"][row, :len(g.prompt_tokens)] = g.prompt_tokens
      out["prompt_lens"][row] = len(g.prompt_tokens)
      out["row_group"][row] = gi
      routed = shape.routed and g.prompt_routes is not None
      if routed:
        out["prompt_routes"][row, :len(g.prompt_tokens)] = g.prompt_routes
      for slot, i in enumerate(range(start, min(start + n, len(g.responses)))):
        k = len(g.responses[i])
        out["response_tokens"][row, slot, :k] = g.responses[i]
        out["response_lens"][row, slot] = k
        out["behaviour_logp"][row, slot, :k] = g.behaviour_logp[i]
        if g.observed is not None and g.observed[i] is not None:
          out["policy_tokens"][row, slot, :k] = ~np.asarray(g.observed[i], bool)
        out["rewards"][row, slot] = g.rewards[i]
        if shape.baselines:
          out["baselines"][row, slot] = g.baseline_reward
        if (shape.teacher_logp or shape.teacher_topk) and k:  # (a sample of no tokens
          logp, ids, top = g.teacher[i]  # may come without the teacher's scores: none due)
          if shape.teacher_logp:
            out["teacher_logp"][row, slot, :k] = logp
          if shape.teacher_topk:
            out["teacher_topk_ids"][row, slot, :k] = ids
            out["teacher_topk_logp"][row, slot, :k] = top
        for j, name in enumerate(shape.reward_parts):
          if name in (g.reward_parts or {}):
            out["reward_parts"][row, slot, j] = g.reward_parts[name][i]
        out["sample_mask"][row, slot] = 1.0
        if routed:
          out["response_routes"][row, slot, :max(k - 1, 0)] = g.response_routes[i]
      row += 1
  return out
