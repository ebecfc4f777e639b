"""Group-relative advantage estimators: GRPO (and Dr. GRPO), GDPO, GPG, MC-GRPO, RLOO, OPO,
pass@k, verl's REINFORCE++ (with and without its group baseline), GAE over a critic's
values and on-policy distillation's reverse KL to a teacher, whose advantages are per token.

Inputs use the flat layout of `algorithms.groups`: `rewards [B]`, `group_ids [B]`
(ints in `[0, num_groups)`, `num_groups` static), optional `sample_mask [B]`; the
per-token ones take `[B, T]` token rewards or a `[B, T]` token mask.
All are jittable with `num_groups` (and the string options) static. Degenerate
groups are defined, never NaN: a group of one sample or of all-equal rewards gets
advantage 0 for every sample; masked (padding) samples get 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from algorithms.groups import (check_group_inputs, group_mean_std, ranks_within_group,
                               segment_sum)

STD_SCALINGS = ("group", "batch", "none")


def _check_scaling(std_scaling: str):
  if std_scaling not in STD_SCALINGS:
    raise ValueError(f"std_scaling: expected one of {STD_SCALINGS}, got {std_scaling!r}")


def _batch_std(rewards, mask, unbiased: bool):
  """The std of all the batch's masked rewards, as one group's (exactly 0 if all equal)."""
  one_group = jnp.zeros(rewards.shape, jnp.int32)
  return group_mean_std(rewards, one_group, 1, mask, unbiased)[2][0]


def _scale(centred, scale, eps):
  """centred / (scale + eps), and 0 where scale is 0 (all-equal or single-sample groups)."""
  safe = jnp.where(scale > 0, scale + eps, 1.0)
  return jnp.where(scale > 0, centred / safe, 0.0)


@functools.partial(jax.jit, static_argnames=("num_groups", "std_scaling", "unbiased"))
def grpo_advantages(rewards, group_ids, num_groups: int, sample_mask=None, *,
                    std_scaling: str = "group", eps: float = 1e-6, unbiased: bool = True):
  """GRPO: (r - group mean) / (std + eps).

  std_scaling: "group" divides by the group's std (GRPO), "batch" by the std of all
  rewards in the batch (group mean, batch std), "none" leaves r - mean (Dr. GRPO).
  unbiased: std with the n-1 denominator. A zero std gives advantage 0 whatever eps.
  eps defaults to verl's 1e-6; TRL's GRPOTrainer (scale_rewards of the same names) adds
  1e-4, a relative difference of about 1e-4 / std: eps=1e-4 reproduces it.
  """
  _check_scaling(std_scaling)
  rewards, group_ids, mask = check_group_inputs(rewards, group_ids, num_groups, sample_mask)
  _, mean, std = group_mean_std(rewards, group_ids, num_groups, mask, unbiased)
  centred = (rewards - mean[group_ids]) * mask
  if std_scaling == "group":
    return _scale(centred, std[group_ids], eps)
  if std_scaling == "batch":
    return _scale(centred, _batch_std(rewards, mask, unbiased), eps)
  return centred


@functools.partial(jax.jit, static_argnames=("num_groups", "unbiased"))
def gdpo_advantages(parts, weights, group_ids, num_groups: int, sample_mask=None, *,
                    eps: float = 1e-6, unbiased: bool = True):
  """GDPO (arXiv 2601.05242; TRL's multi_objective_aggregation="normalize_then_sum"): each
  reward part of `parts [B, K]` normalised within its group as GRPO does, over the samples
  that have it (NaN: the part does not apply, it adds nothing), weighted by `weights` ([K]
  or [B, K]) and summed; that sum is then normalised over the whole batch. Normalising the
  parts apart keeps a part of small spread from being drowned by one of large spread."""
  parts = jnp.asarray(parts, jnp.float32)
  if parts.ndim != 2:
    raise ValueError(f"parts: expected shape [B, K], got {parts.shape}")
  _, group_ids, mask = check_group_inputs(parts[:, 0], group_ids, num_groups, sample_mask)
  weights = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), parts.shape)
  have = (~jnp.isnan(parts) & (mask[:, None] > 0)).astype(jnp.float32)
  each = jax.vmap(lambda r, m: grpo_advantages(r, group_ids, num_groups, m, eps=eps,
                                               unbiased=unbiased), in_axes=1, out_axes=1)
  total = jnp.sum(each(jnp.where(have > 0, parts, 0.0), have) * weights, axis=1)
  return grpo_advantages(total, jnp.zeros_like(group_ids), 1, mask, eps=eps, unbiased=unbiased)


GPG_MAX_ALPHA = 20.0  # GPG's correction B / (B - M) at most (the authors' GPGTrainer)


@functools.partial(jax.jit, static_argnames=("num_groups", "std_scaling", "unbiased"))
def gpg_advantages(rewards, group_ids, num_groups: int, sample_mask=None, *,
                   std_scaling: str = "none", eps: float = 1e-6, unbiased: bool = True):
  """GPG (Group Policy Gradient, arXiv 2504.02546): alpha (r - group mean) / F_norm, F_norm
  1 (std_scaling "none", the paper's choice) or a std as GRPO's. alpha = B / (B - M): of
  the batch's B samples, M are in groups whose rewards are all equal (or of one sample),
  which learn nothing, so the others are scaled up to the gradient the whole batch would
  give (the paper's correction; verl's gpg takes B over the samples of non-zero reward
  instead), at most GPG_MAX_ALPHA (the authors' trainer: 1 / max(1 - M/B, 0.05); a batch of
  one learning group in 64 took 64x the step, with no ratio or clip to bound it). A batch of
  none but such groups gets 0."""
  _check_scaling(std_scaling)
  rewards, group_ids, mask = check_group_inputs(rewards, group_ids, num_groups, sample_mask)
  _, _, std = group_mean_std(rewards, group_ids, num_groups, mask, unbiased)
  b = jnp.sum(mask)
  valid = jnp.sum(mask * (std[group_ids] > 0))
  alpha = jnp.where(valid > 0, b / jnp.maximum(valid, b / GPG_MAX_ALPHA), 0.0)
  return alpha * grpo_advantages(rewards, group_ids, num_groups, mask, std_scaling=std_scaling,
                                 eps=eps, unbiased=unbiased)


@functools.partial(jax.jit, static_argnames=("num_groups",))
def rloo_advantages(rewards, group_ids, num_groups: int, sample_mask=None):
  """RLOO: r_i minus the mean of the *other* samples of its group, = n/(n-1) (r_i - mean).

  A group of one sample has no other sample to compare with: advantage 0.
  """
  rewards, group_ids, mask = check_group_inputs(rewards, group_ids, num_groups, sample_mask)
  count, mean, _ = group_mean_std(rewards, group_ids, num_groups, mask)
  n = count[group_ids]
  factor = jnp.where(n > 1, n / jnp.maximum(n - 1.0, 1.0), 0.0)
  return (rewards - mean[group_ids]) * mask * factor


@functools.partial(jax.jit, static_argnames=("num_groups", "std_scaling", "unbiased"))
def mc_grpo_advantages(rewards, group_ids, num_groups: int, sample_mask=None, *,
                       std_scaling: str = "group", eps: float = 1e-6, unbiased: bool = True):
  """MC-GRPO: the group median as baseline; returns (advantages [B], loss_mask [B]).

  In an odd-sized group the median is one sample (the pivot: the middle one in sorted
  order, ties broken by position); its advantage is 0 and `loss_mask` drops it so the
  group keeps n-1 gradient-carrying samples (sample G+1 to train on G). In an even-sized
  group the median is the mean of the two middle rewards and no sample is dropped.
  std_scaling as in `grpo_advantages` (the std is the usual one, around the mean).
  """
  _check_scaling(std_scaling)
  rewards, group_ids, mask = check_group_inputs(rewards, group_ids, num_groups, sample_mask)
  count, _, std = group_mean_std(rewards, group_ids, num_groups, mask, unbiased)
  count_i = count.astype(jnp.int32)
  rank = ranks_within_group(rewards, group_ids, num_groups, mask)
  lo = (count_i - 1) // 2
  hi = count_i // 2
  at_lo = segment_sum(jnp.where(rank == lo[group_ids], rewards, 0.0) * mask, group_ids,
                      num_groups)
  at_hi = segment_sum(jnp.where(rank == hi[group_ids], rewards, 0.0) * mask, group_ids,
                      num_groups)
  median = 0.5 * (at_lo + at_hi)
  centred = (rewards - median[group_ids]) * mask
  if std_scaling == "group":
    adv = _scale(centred, std[group_ids], eps)
  elif std_scaling == "batch":
    adv = _scale(centred, _batch_std(rewards, mask, unbiased), eps)
  else:
    adv = centred
  n = count_i[group_ids]
  pivot = (n % 2 == 1) & (rank == lo[group_ids]) & (mask > 0)
  adv = jnp.where(pivot, 0.0, adv)
  return adv, (mask > 0) & ~pivot


@functools.partial(jax.jit, static_argnames=("num_groups",))
def opo_advantages(rewards, lengths, group_ids, num_groups: int, sample_mask=None):
  """OPO (On-Policy RL with Optimal reward baseline, arXiv 2505.23585; verl's "opo"):
  r_i minus the group's length-weighted mean reward sum_j(l_j r_j) / sum_j(l_j), the
  baseline that minimizes the gradient's variance when each token's gradient is alike.

  `lengths [B]`: each response's tokens. A group of one sample gets 0 (verl keeps its raw
  reward: it has nothing to compare with); a group whose lengths are all 0 uses the mean.
  """
  rewards, group_ids, mask = check_group_inputs(rewards, group_ids, num_groups, sample_mask)
  lengths = jnp.asarray(lengths, rewards.dtype)
  if lengths.shape != rewards.shape:
    raise ValueError(f"lengths: expected shape {rewards.shape} like rewards, got "
                     f"{lengths.shape}")
  count, mean, _ = group_mean_std(rewards, group_ids, num_groups, mask)
  # the weighted mean as the mean plus a weighted mean of deviations: exact for equal rewards
  centred = (rewards - mean[group_ids]) * mask
  weight = segment_sum(lengths * mask, group_ids, num_groups)
  shift = segment_sum(lengths * centred, group_ids, num_groups)
  baseline = mean + jnp.where(weight > 0, shift / jnp.where(weight > 0, weight, 1.0), 0.0)
  return jnp.where(count[group_ids] > 1, rewards - baseline[group_ids], 0.0) * mask


@functools.partial(jax.jit, static_argnames=("num_groups", "std_scaling", "unbiased"))
def passk_advantages(rewards, group_ids, num_groups: int, sample_mask=None, *,
                     std_scaling: str = "group", eps: float = 1e-6, unbiased: bool = True):
  """Pass@k training (arXiv 2503.19595; verl's "grpo_passk"): only each group's best sample
  learns, with advantage r_max - r_second_max (0 when the best is tied), divided by the
  group's std as `std_scaling` says; every other sample gets 0. Optimizes the chance that
  one of k samples is right, rather than each sample's."""
  _check_scaling(std_scaling)
  rewards, group_ids, mask = check_group_inputs(rewards, group_ids, num_groups, sample_mask)
  count, _, std = group_mean_std(rewards, group_ids, num_groups, mask, unbiased)
  count_i = count.astype(jnp.int32)
  rank = ranks_within_group(rewards, group_ids, num_groups, mask)
  top = segment_sum(jnp.where(rank == count_i[group_ids] - 1, rewards, 0.0) * mask, group_ids,
                    num_groups)
  second = segment_sum(jnp.where(rank == count_i[group_ids] - 2, rewards, 0.0) * mask,
                       group_ids, num_groups)
  best = (rank == count_i[group_ids] - 1) & (count_i[group_ids] > 1) & (mask > 0)
  gap = jnp.where(best, (top - second)[group_ids], 0.0)
  if std_scaling == "group":
    return _scale(gap, std[group_ids], eps)
  if std_scaling == "batch":
    return _scale(gap, _batch_std(rewards, mask, unbiased), eps)
  return gap


def remax_advantages(rewards, baselines, sample_mask=None):
  """ReMax (Li et al., 2023; verl's remax): each sample's reward minus its prompt's greedy
  sample's reward, no std. rewards, baselines, sample_mask: [B] (0 on padding)."""
  rewards, baselines = jnp.asarray(rewards, jnp.float32), jnp.asarray(baselines, jnp.float32)
  if rewards.ndim != 1 or baselines.shape != rewards.shape:
    raise ValueError(f"baselines: expected the rewards' shape {rewards.shape} ([B]), got "
                     f"{baselines.shape}")
  mask = (jnp.ones_like(rewards) if sample_mask is None
          else jnp.asarray(sample_mask, jnp.float32))
  return (rewards - baselines) * mask


def distillation_advantages(student_logp, teacher_logp, token_mask):
  """On-policy distillation (as Thinking Machines' and Qwen3's): each sampled token's
  advantage is minus its reverse KL to the teacher, log pi_teacher - log pi_student, on the
  tokens of `token_mask` [B, T] (0 elsewhere); no discount, no whitening. The student's
  log-probs are those it sampled with, so the signal costs the teacher's forward alone."""
  student_logp, teacher_logp = jnp.asarray(student_logp), jnp.asarray(teacher_logp)
  if student_logp.ndim != 2 or teacher_logp.shape != student_logp.shape:
    raise ValueError(f"teacher_logp: expected the student's shape {student_logp.shape} "
                     f"([B, T]), got {teacher_logp.shape}")
  token_mask = jnp.asarray(token_mask, jnp.float32)
  return jnp.where(token_mask > 0, teacher_logp - student_logp, 0.0) * token_mask


def masked_whiten(values, mask):
  """verl's masked_whiten: (values - mean) / sqrt(var + 1e-8) over the entries `mask` holds,
  the mean and variance dividing by their count + 1e-8 and the variance unbiased (n / (n - 1);
  a single entry: none). Entries all equal whiten to exactly 0 (verl's: to their mean's
  rounding residual times 1e4)."""
  mask = jnp.asarray(mask, values.dtype)
  n = jnp.sum(mask)
  mean = jnp.sum(values * mask) / (n + 1e-8)
  held = mask > 0  # all equal: that value exactly, so they whiten to 0, not to a residual
  lo, hi = jnp.min(jnp.where(held, values, jnp.inf)), jnp.max(jnp.where(held, values, -jnp.inf))
  mean = jnp.where(lo == hi, lo, mean)
  var = jnp.sum((values - mean) ** 2 * mask) / (n + 1e-8)
  var = var * jnp.where(n > 1, n / jnp.maximum(n - 1.0, 1.0), 1.0)
  return (values - mean) * jax.lax.rsqrt(var + 1e-8)


def token_rewards(scores, token_mask, kl=None, kl_coef: float = 0.0):
  """[B, T] per-token rewards as verl builds them: each sample's score on its last
  `token_mask`ed token (none without one; a multi-turn sample the budget ended within an
  environment's reply: its policy's last token, where verl's would lose it), minus
  `kl_coef` times each `token_mask`ed token's `kl [B, T]` (verl's use_kl_in_reward)."""
  token_mask = jnp.asarray(token_mask, jnp.float32)
  steps = jnp.arange(token_mask.shape[-1])
  last_index = jnp.max(jnp.where(token_mask > 0, steps, -1), axis=-1)  # -1: no one-hot
  last = jax.nn.one_hot(last_index, token_mask.shape[-1], dtype=jnp.float32)
  rewards = jnp.asarray(scores, jnp.float32)[:, None] * last
  return rewards if kl is None else rewards - kl_coef * kl * token_mask


def discounted_returns(rewards, token_mask, gamma: float = 1.0):
  """[B, T] G_t = r_t + gamma G_(t+1) on the `token_mask`ed tokens, 0 elsewhere; an unmasked
  token (an environment's reply) passes the return through undiscounted and adds no reward,
  so the policy's tokens before a tool reply share the final reward, as verl's
  REINFORCE++ does."""
  mask = jnp.asarray(token_mask, jnp.float32)
  a = jnp.where(mask > 0, gamma, 1.0)  # G_t = a_t G_(t+1) + b_t, composed from the end
  b = jnp.asarray(rewards, jnp.float32) * mask
  compose = lambda later, here: (later[0] * here[0], here[0] * later[1] + here[1])
  _, returns = jax.lax.associative_scan(compose, (a, b), reverse=True, axis=1)
  return returns * mask


def gae(rewards, values, token_mask, *, gamma: float = 1.0, lam: float = 1.0):
  """Generalized advantage estimation (Schulman et al. 2016; verl's
  compute_gae_advantage_return) -> (advantages, returns) [B, T]: from per-token `rewards`
  and the critic's `values` of the states before each token, A_t = delta_t + gamma lam
  A_(t+1), delta_t = r_t + gamma V_(t+1) - V_t, V past the last token 0; returns = A + V.
  An unmasked token (an environment's reply) carries the next value and advantage through,
  adding no TD error; the advantages are not whitened here."""
  mask = jnp.asarray(token_mask, jnp.float32)
  rewards, values = jnp.asarray(rewards, jnp.float32), jnp.asarray(values, jnp.float32)

  def back(carry, x):
    next_value, next_adv = carry
    r, v, m = x
    adv = r + gamma * next_value - v + gamma * lam * next_adv
    carry = (jnp.where(m > 0, v, next_value), jnp.where(m > 0, adv, next_adv))
    return carry, carry[1]

  zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
  _, adv = jax.lax.scan(back, (zeros, zeros), (rewards.T, values.T, mask.T), reverse=True)
  adv = adv.T
  return adv, adv + values


@functools.partial(jax.jit, static_argnames=("gamma",))
def reinforce_pp_advantages(rewards, token_mask, *, gamma: float = 1.0):
  """REINFORCE++ (arXiv 2501.03262; verl's "reinforce_plus_plus"): each token's discounted
  return from per-token `rewards [B, T]` (`token_rewards`), whitened over all the batch's
  `token_mask`ed tokens (no critic, no group: the batch is the baseline)."""
  mask = jnp.asarray(token_mask, jnp.float32)
  return masked_whiten(discounted_returns(rewards, mask, gamma), mask) * mask


@functools.partial(jax.jit, static_argnames=("num_groups",))
def reinforce_pp_baseline_advantages(scores, group_ids, num_groups: int, token_mask,
                                     sample_mask=None):
  """REINFORCE++ with baseline (verl's "reinforce_plus_plus_baseline"): each sample's score
  `scores [B]` minus its group's mean (a group of one keeps its score, as verl's), given to
  each of its tokens and whitened over all the batch's `token_mask [B, T]`ed tokens."""
  scores, group_ids, mask = check_group_inputs(scores, group_ids, num_groups, sample_mask)
  tokens = jnp.asarray(token_mask, jnp.float32)
  if tokens.shape[:1] != scores.shape:
    raise ValueError(f"token_mask: expected shape [{scores.shape[0]}, T] like scores, got "
                     f"{tokens.shape}")
  count, mean, _ = group_mean_std(scores, group_ids, num_groups, mask)
  baseline = jnp.where(count > 1, mean, 0.0)[group_ids]
  centred = ((scores - baseline) * mask)[:, None] * tokens
  return masked_whiten(centred, tokens) * tokens
