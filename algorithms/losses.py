"""Policy losses on token-level log-probs: PPO-clip (DAPO clip-higher, dual clip), GSPO,
CISPO, GMPO, Clip-Cov and KL-Cov, SAPO, the plain policy gradient (GPG), KL penalty to a
reference policy, the loss aggregation modes, and the high-entropy token selection
("Beyond the 80/20 rule").

Shapes: `logp`, `old_logp`, `ref_logp`, `mask` are `[B, T]` (B sequences of T
response tokens, `mask` 1 on real tokens); `advantages` is `[B]` (one per sequence)
or `[B, T]`. `token_weights [B, T]` multiplies each token's loss (importance weights
from `algorithms.corrections`; treated as constants). Every loss returns
`(scalar loss, dict of scalar metrics)` and is differentiable in `logp`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")
# Schulman's k1, k2, k3; verl's low_var_kl (k3 clamped) and abs. verl's kl_loss_type "kl" is
# k1 and "mse" is k2; verl's "k3" is its low_var_kl (clamped), ours is not.
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")


def _check_tokens(name: str, x, shape):
  if x.shape != shape:
    raise ValueError(f"{name}: expected shape {shape} like logp, got {x.shape}")


def _broadcast_advantages(advantages, shape):
  advantages = jnp.asarray(advantages)
  if advantages.shape == shape[:1]:
    return advantages[:, None]
  if advantages.shape == shape:
    return advantages
  raise ValueError(f"advantages: expected shape {shape[:1]} or {shape}, got "
                   f"{advantages.shape}")


def aggregate(per_token, mask, mode: str = "token-mean", norm_const: float | None = None):
  """Reduce a `[B, T]` per-token loss to a scalar.

  token-mean: sum over all real tokens / their count (long answers weigh more).
  seq-mean-token-mean: mean over sequences of each sequence's token mean.
  seq-mean-token-sum: mean over sequences of each sequence's token sum.
  seq-mean-token-sum-norm: sum over all tokens / (B * norm_const), a constant
    normaliser (Dr. GRPO); norm_const defaults to T, the padded length.
  Sequences without real tokens are left out of the seq-mean modes; nothing is NaN.
  TRL's GRPOTrainer loss_type: bnpo and dapo = token-mean, grpo = seq-mean-token-mean
  (TRL counts a sequence without tokens as a 0), dr_grpo = seq-mean-token-sum-norm with
  norm_const = max_completion_length.
  """
  if mode not in AGGREGATIONS:
    raise ValueError(f"aggregation mode: expected one of {AGGREGATIONS}, got {mode!r}")
  if per_token.ndim != 2 or mask.shape != per_token.shape:
    raise ValueError(f"mask: expected shape {per_token.shape} like the per-token loss, got "
                     f"{mask.shape}")
  mask = mask.astype(per_token.dtype)
  masked = per_token * mask
  if mode == "token-mean":
    return jnp.sum(masked) / jnp.maximum(jnp.sum(mask), 1.0)
  tokens = jnp.sum(mask, axis=-1)
  has_tokens = (tokens > 0).astype(per_token.dtype)
  num_seqs = jnp.maximum(jnp.sum(has_tokens), 1.0)
  if mode == "seq-mean-token-mean":
    return jnp.sum(jnp.sum(masked, axis=-1) / jnp.maximum(tokens, 1.0)) / num_seqs
  if mode == "seq-mean-token-sum":
    return jnp.sum(masked) / num_seqs
  norm = per_token.shape[-1] if norm_const is None else norm_const
  if not norm > 0:
    raise ValueError(f"norm_const: expected > 0, got {norm_const!r}")
  return jnp.sum(masked) / (per_token.shape[0] * norm)


def value_loss(values, old_values, returns, mask, *, clip: float | None = 0.5,
               agg: str = "token-mean", norm_const: float | None = None):
  """PPO's critic loss (verl's compute_value_loss): 0.5 * the aggregate over `mask`ed tokens of
  max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2), V the critic's `values`,
  V_old the ones the advantages came from, R the `returns` [B, T]; `clip` None: unclipped.
  -> (loss, metrics: vf_clipfrac, the share of tokens whose clipped error is the larger)."""
  returns = jax.lax.stop_gradient(returns)
  old_values = jax.lax.stop_gradient(old_values)
  err = (values - returns) ** 2
  if clip is None:
    clipped_err = err
  else:
    clipped_err = (jnp.clip(values, old_values - clip, old_values + clip) - returns) ** 2
  loss = 0.5 * aggregate(jnp.maximum(err, clipped_err), mask, agg, norm_const)
  mask = mask.astype(err.dtype)
  frac = jnp.sum((clipped_err > err) * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  return loss, {"vf_clipfrac": frac}


def _abs_flat_at_zero(x):
  """|x| with gradient 0 at 0 (torch's), not jnp.abs's 1: a KL term that is 0 (log pi equal to
  log pi_old, as on a batch's one update) must not push the tokens it holds."""
  return x * jax.lax.stop_gradient(jnp.sign(x))


def kl_penalty(logp, ref_logp, estimator: str = "k3"):
  """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

  With log r = ref_logp - logp: k1 = -log r (unbiased, can be negative),
  k2 = (log r)^2 / 2 (biased, low variance), k3 = r - 1 - log r (unbiased, >= 0).
  low_var_kl is verl's: k3 with log r clamped to [-20, 20] and the result to [-10, 10], so
  that one token far from the reference bounds its term (and gets no gradient); abs is
  verl's |log r|. The losses add it as is, as the GRPO paper does (= TRL with
  use_bias_correction_kl=False); their kl_bias_correction multiplies it by pi/pi_old.
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"kl estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")
  log_r = ref_logp - logp
  if estimator == "k1":
    return -log_r
  if estimator == "k2":
    return 0.5 * log_r * log_r
  if estimator == "abs":
    return _abs_flat_at_zero(log_r)
  if estimator == "low_var_kl":
    log_r = jnp.clip(log_r, -20.0, 20.0)
    return jnp.clip(jnp.expm1(log_r) - log_r, -10.0, 10.0)
  return jnp.expm1(log_r) - log_r


def entropy_threshold(entropy, mask, quantile: float):
  """The entropy that the top `quantile` of the real tokens (`mask`) reach: the 1 - quantile
  quantile of their entropies, interpolated linearly as TRL's torch.quantile is (NaN
  without a token). A constant: no gradient flows through the selection."""
  x = jnp.where(jnp.asarray(mask) > 0, jax.lax.stop_gradient(entropy), jnp.nan)
  return jnp.nanquantile(x.reshape(-1).astype(jnp.float32), 1.0 - quantile)


def high_entropy_tokens(entropy, mask, threshold):
  """[B, T] 1 on the real tokens whose entropy reaches `threshold` (the "forking" tokens
  that alone get policy loss in "Beyond the 80/20 rule", TRL's top_entropy_quantile), else 0."""
  mask = jnp.asarray(mask)
  keep = (jax.lax.stop_gradient(entropy) >= threshold) & (mask > 0)
  return keep.astype(mask.dtype)


def _masked_stats(x, mask):
  n = jnp.maximum(jnp.sum(mask), 1.0)
  big = jnp.finfo(x.dtype).max
  return (jnp.sum(x * mask) / n, jnp.max(jnp.where(mask > 0, x, -big)),
          jnp.min(jnp.where(mask > 0, x, big)))


def _masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _frac(cond, mask):
  return _masked_mean(cond.astype(mask.dtype), mask)


def _finish(pg_per_token, logp, old_logp, ratio, mask, agg, norm_const, ref_logp, kl_coef,
            kl_estimator, kl_bias_correction, metrics):
  loss = aggregate(pg_per_token, mask, agg, norm_const)
  metrics["pg_loss"] = loss
  log_ratio = jax.lax.stop_gradient(logp - old_logp)
  metrics["approx_kl"] = _masked_mean(jnp.expm1(log_ratio) - log_ratio, mask)
  r = jax.lax.stop_gradient(ratio)
  metrics["ratio_mean"], metrics["ratio_max"], metrics["ratio_min"] = _masked_stats(r, mask)
  if ref_logp is not None:
    _check_tokens("ref_logp", ref_logp, logp.shape)
    kl = kl_penalty(logp, ref_logp, kl_estimator)
    if kl_bias_correction:  # TRL's use_bias_correction_kl: times the loss's ratio, not detached
      kl = kl * ratio
    kl_loss = aggregate(kl, mask, agg, norm_const)
    metrics["kl_ref"] = kl_loss
    loss = loss + kl_coef * kl_loss
  metrics["loss"] = loss
  return loss, metrics


def _prepare(logp, old_logp, advantages, mask, token_weights):
  logp = jnp.asarray(logp)
  if logp.ndim != 2:
    raise ValueError(f"logp: expected shape [B, T], got {logp.shape}")
  _check_tokens("old_logp", old_logp, logp.shape)
  _check_tokens("mask", mask, logp.shape)
  adv = _broadcast_advantages(advantages, logp.shape).astype(logp.dtype)
  mask = jnp.asarray(mask).astype(logp.dtype)
  if token_weights is None:
    weights = jnp.ones_like(logp)
  else:
    _check_tokens("token_weights", token_weights, logp.shape)
    weights = jax.lax.stop_gradient(jnp.asarray(token_weights).astype(logp.dtype))
  return logp, jax.lax.stop_gradient(old_logp), adv, mask, weights


def ppo_clip_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.2,
                  clip_high: float = 0.2, dual_clip: float | None = None,
                  agg: str = "token-mean", norm_const: float | None = None,
                  token_weights=None, ref_logp=None, kl_coef: float = 0.0,
                  kl_estimator: str = "k3", kl_bias_correction: bool = False):
  """PPO-clip with ratio r = pi/pi_old clipped to [1 - clip_low, 1 + clip_high].

  clip_high > clip_low is DAPO's clip-higher (e.g. 0.2 / 0.28). dual_clip = c > 1
  bounds the loss of negative-advantage tokens at -c * A (dual-clip PPO). With
  ref_logp, adds kl_coef * aggregated KL(pi || pi_ref) by `kl_estimator`, each token's
  times its ratio r with kl_bias_correction (TRL's use_bias_correction_kl, DeepSeek-V3.2).
  Metrics: clip_frac (either bound active), clip_frac_low, clip_frac_high,
  dual_clip_frac, approx_kl (k3 estimate of KL(pi_old || pi)), ratio_mean/max/min, pg_loss, kl_ref.
  """
  if not (clip_low >= 0 and clip_high >= 0):
    raise ValueError(f"clip_low/clip_high: expected >= 0, got {clip_low}/{clip_high}")
  if dual_clip is not None and not dual_clip > 1.0:
    raise ValueError(f"dual_clip: expected a constant > 1, got {dual_clip!r}")
  logp, old_logp, adv, mask, weights = _prepare(logp, old_logp, advantages, mask,
                                                token_weights)
  ratio = jnp.exp(logp - old_logp)
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  pg = jnp.maximum(unclipped, clipped)
  metrics = {
      "clip_frac_low": _frac((adv < 0) & (ratio < 1.0 - clip_low), mask),
      "clip_frac_high": _frac((adv > 0) & (ratio > 1.0 + clip_high), mask),
      "clip_frac": _frac(clipped > unclipped, mask),
  }
  if dual_clip is not None:
    bound = -adv * dual_clip
    dual = (adv < 0) & (bound < pg)
    pg = jnp.where(adv < 0, jnp.minimum(pg, bound), pg)
    metrics["dual_clip_frac"] = _frac(dual, mask)
  return _finish(pg * weights, logp, old_logp, ratio, mask, agg, norm_const, ref_logp,
                 kl_coef, kl_estimator, kl_bias_correction, metrics)


def cispo_loss(logp, old_logp, advantages, mask, *, clip_low: float = 1.0,
               clip_high: float = 0.28, agg: str = "token-mean",
               norm_const: float | None = None, token_weights=None, ref_logp=None,
               kl_coef: float = 0.0, kl_estimator: str = "k3",
               kl_bias_correction: bool = False):
  """CISPO (MiniMax-M1): REINFORCE on every token, each weighted by its importance ratio
  r = pi/pi_old clipped to [1 - clip_low, 1 + clip_high] and held constant:
  -sg(clip(r)) * A * log pi. Unlike PPO's clip, no token's gradient is dropped (a rare
  token whose ratio runs off still teaches, at the capped weight); clip_low = 1 leaves
  the weight no lower bound, as the paper does. TRL's loss_type="cispo" with epsilon_high=E
  is clip_low=1, clip_high=E - 1. Metrics: clip_frac (weights capped, either sign of A;
  TRL's cispo_clip_ratio counts A > 0 only), clip_frac_low, clip_frac_high, approx_kl,
  ratio_mean/max/min, pg_loss, kl_ref.
  """
  if not (clip_low >= 0 and clip_high >= 0):
    raise ValueError(f"clip_low/clip_high: expected >= 0, got {clip_low}/{clip_high}")
  logp, old_logp, adv, mask, weights = _prepare(logp, old_logp, advantages, mask,
                                                token_weights)
  ratio = jnp.exp(logp - old_logp)
  r = jax.lax.stop_gradient(ratio)
  low, high = r < 1.0 - clip_low, r > 1.0 + clip_high
  weight = jax.lax.stop_gradient(jnp.clip(r, 1.0 - clip_low, 1.0 + clip_high))
  pg = -weight * adv * logp
  metrics = {"clip_frac_low": _frac(low, mask), "clip_frac_high": _frac(high, mask),
             "clip_frac": _frac(low | high, mask)}
  return _finish(pg * weights, logp, old_logp, ratio, mask, agg, norm_const, ref_logp,
                 kl_coef, kl_estimator, kl_bias_correction, metrics)


def gspo_loss(logp, old_logp, advantages, mask, *, clip_low: float = 3e-4,
              clip_high: float = 4e-4, agg: str = "seq-mean-token-mean",
              norm_const: float | None = None, token_weights=None, ref_logp=None,
              kl_coef: float = 0.0, kl_estimator: str = "k3",
              kl_bias_correction: bool = False):
  """GSPO: one ratio per sequence, s_i = exp(mean_t (logp - old_logp)), clipped per sequence.

  advantages must be per sequence `[B]`. The sequence's clipped term is given to each
  of its tokens, so with the default seq-mean-token-mean the loss is
  -mean_i min(s_i A_i, clip(s_i) A_i). Clip ranges are small (length-normalised ratio).
  """
  if jnp.ndim(advantages) != 1:
    raise ValueError(f"advantages: GSPO expects one per sequence, shape [B], got "
                     f"{jnp.shape(advantages)}")
  logp, old_logp, adv, mask, weights = _prepare(logp, old_logp, advantages, mask,
                                                token_weights)
  tokens = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
  seq_log_ratio = jnp.sum((logp - old_logp) * mask, axis=-1, keepdims=True) / tokens
  ratio = jnp.broadcast_to(jnp.exp(seq_log_ratio), logp.shape)
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  pg = jnp.maximum(unclipped, clipped)
  seq_mask = (jnp.sum(mask, axis=-1) > 0).astype(logp.dtype)
  metrics = {
      "clip_frac_low": _frac((adv[:, 0] < 0) & (ratio[:, 0] < 1.0 - clip_low), seq_mask),
      "clip_frac_high": _frac((adv[:, 0] > 0) & (ratio[:, 0] > 1.0 + clip_high), seq_mask),
      "clip_frac": _frac(clipped[:, 0] > unclipped[:, 0], seq_mask),
  }
  return _finish(pg * weights, logp, old_logp, ratio, mask, agg, norm_const, ref_logp,
                 kl_coef, kl_estimator, kl_bias_correction, metrics)


def geo_mean_loss(logp, old_logp, advantages, mask, *, clip_low: float = 0.4,
                  clip_high: float = 0.4, agg: str = "seq-mean-token-mean",
                  norm_const: float | None = None, token_weights=None, ref_logp=None,
                  kl_coef: float = 0.0, kl_estimator: str = "k3",
                  kl_bias_correction: bool = False):
  """GMPO (Geometric-Mean Policy Optimization; verl's policy_loss geo_mean): one ratio per
  sequence, the geometric mean of its tokens' ratios, each token's log-ratio clipped to
  [-clip_low, clip_high] on the side its advantage's sign makes pessimistic (PPO's min,
  token by token, in log space): s_i = exp(mean_t sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t))),
  d_t = log pi - log pi_old, loss -A_i s_i, A_i the sequence's token-mean advantage. Less
  sensitive than GRPO's arithmetic mean to one token's outlying ratio. Metrics: clip_frac
  (tokens clipped), clip_frac_high (of those, A > 0), clip_frac_low (A < 0), approx_kl,
  ratio_mean/max/min (the sequence ratios, per token), pg_loss, kl_ref."""
  if not (clip_low >= 0 and clip_high >= 0):
    raise ValueError(f"clip_low/clip_high: expected >= 0, got {clip_low}/{clip_high}")
  logp, old_logp, adv, mask, weights = _prepare(logp, old_logp, advantages, mask,
                                                token_weights)
  adv = jnp.broadcast_to(adv, logp.shape)
  tokens = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
  log_ratio = logp - old_logp
  bounded = jnp.clip(log_ratio, -clip_low, clip_high)
  sign = jnp.sign(adv)
  pessimistic = sign * jnp.minimum(sign * log_ratio, sign * bounded)
  seq_ratio = jnp.exp(jnp.sum(pessimistic * mask, axis=-1, keepdims=True) / tokens)
  seq_adv = jnp.sum(adv * mask, axis=-1, keepdims=True) / tokens
  ratio = jnp.broadcast_to(seq_ratio, logp.shape)
  pg = jnp.broadcast_to(-seq_adv * seq_ratio, logp.shape)
  clipped = jax.lax.stop_gradient(log_ratio != bounded)
  metrics = {"clip_frac": _frac(clipped, mask), "clip_frac_high": _frac(clipped & (adv > 0), mask),
             "clip_frac_low": _frac(clipped & (adv < 0), mask)}
  return _finish(pg * weights, logp, old_logp, ratio, mask, agg, norm_const, ref_logp,
                 kl_coef, kl_estimator, kl_bias_correction, metrics)


def clip_cov_loss(logp, old_logp, advantages, mask, *, noise, clip_low: float = 0.2,
                  clip_high: float = 0.2, clip_cov_ratio: float = 2e-4,
                  clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, cov_stats=None,
                  agg: str = "token-mean", norm_const: float | None = None,
                  token_weights=None, ref_logp=None, kl_coef: float = 0.0,
                  kl_estimator: str = "k3", kl_bias_correction: bool = False):
  """Clip-Cov ("The Entropy Mechanism of RL for Reasoning LMs", verl's policy_loss clip_cov):
  PPO-clip, and of the tokens PPO's clip leaves whose covariance term
  (A - mean A)(log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub), at most
  max(1, int(tokens * clip_cov_ratio)) taken at random (those with the smallest `noise`
  [B, T], uniform draws) lose their gradient: their loss is dropped. `cov_stats`:
  clip_cov_stats of a larger batch these rows are a slice of (None: of these rows).
  Metrics: clip_cov_frac (tokens dropped), and PPO's clip_frac(_low/_high), approx_kl,
  ratio_mean/max/min, pg_loss, kl_ref."""
  if not (clip_low >= 0 and clip_high >= 0):
    raise ValueError(f"clip_low/clip_high: expected >= 0, got {clip_low}/{clip_high}")
  if not 0 < clip_cov_ratio <= 1:
    raise ValueError(f"clip_cov_ratio: expected a share of the tokens in (0, 1], got "
                     f"{clip_cov_ratio!r}")
  _check_tokens("noise", noise, jnp.shape(logp))
  bounds = dict(clip_low=clip_low, clip_high=clip_high, clip_cov_lb=clip_cov_lb,
                clip_cov_ub=clip_cov_ub)
  if cov_stats is None:
    cov_stats = clip_cov_stats(logp, old_logp, advantages, mask, noise,
                               clip_cov_ratio=clip_cov_ratio, **bounds)
  logp, old_logp, adv, mask, weights = _prepare(logp, old_logp, advantages, mask,
                                                token_weights)
  ratio, unclipped, clipped, candidate = _clip_cov_candidates(logp, old_logp, adv, mask,
                                                              cov_stats[:2], **bounds)
  dropped = candidate & (noise <= cov_stats[2])
  pg = jnp.where(dropped, 0.0, jnp.maximum(unclipped, clipped))
  metrics = {
      "clip_cov_frac": _frac(dropped, mask),
      "clip_frac_low": _frac((adv < 0) & (ratio < 1.0 - clip_low), mask),
      "clip_frac_high": _frac((adv > 0) & (ratio > 1.0 + clip_high), mask),
      "clip_frac": _frac(clipped > unclipped, mask),
  }
  return _finish(pg * weights, logp, old_logp, ratio, mask, agg, norm_const, ref_logp,
                 kl_coef, kl_estimator, kl_bias_correction, metrics)


def clip_cov_stats(logp, old_logp, advantages, mask, noise, *, clip_low: float = 0.2,
                   clip_high: float = 0.2, clip_cov_ratio: float = 2e-4,
                   clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0):
  """Clip-Cov's selection over the real tokens (`mask`) of a batch: (mean advantage, mean
  log-prob, the largest draw that drops a token: the k-th smallest `noise` of the tokens
  that may drop, k = max(1, int(tokens * clip_cov_ratio)), verl's count; inf when fewer
  may). Constants: no gradient flows through the selection."""
  logp = jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
  adv = jax.lax.stop_gradient(_broadcast_advantages(advantages, logp.shape)
                              .astype(jnp.float32))
  mask = jnp.asarray(mask, jnp.float32)
  means = (_masked_mean(adv, mask), _masked_mean(logp, mask))
  candidate = _clip_cov_candidates(logp, jnp.asarray(old_logp, jnp.float32), adv, mask, means,
                                   clip_low=clip_low, clip_high=clip_high,
                                   clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub)[3]
  draws = jnp.where(candidate, jnp.asarray(noise, jnp.float32), jnp.inf)
  return (*means, _kth_smallest(draws, _share(mask, clip_cov_ratio)))


def _clip_cov_candidates(logp, old_logp, adv, mask, means, *, clip_low, clip_high,
                         clip_cov_lb, clip_cov_ub):
  """(ratio, unclipped and clipped PPO terms, the tokens Clip-Cov may drop: real, left by
  PPO's clip, covariance term against `means` (mean A, mean log pi) in (lb, ub))."""
  ratio = jnp.exp(logp - old_logp)
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  cov = (adv - means[0]) * (jax.lax.stop_gradient(logp) - means[1])
  candidate = ((mask > 0) & ~(clipped > unclipped) & (cov > clip_cov_lb)
               & (cov < clip_cov_ub))
  return ratio, unclipped, clipped, candidate


def sapo_loss(logp, old_logp, advantages, mask, *, tau_pos: float = 1.0,
              tau_neg: float = 1.05, agg: str = "seq-mean-token-mean",
              norm_const: float | None = None, token_weights=None, ref_logp=None,
              kl_coef: float = 0.0, kl_estimator: str = "k3",
              kl_bias_correction: bool = False):
  """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347; verl's policy_loss sapo): a
  soft trust region in place of PPO's clip. Each token's term is -f(r) * A with the gate
  f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg: at r = 1 its
  gradient is the policy gradient's, and it fades smoothly as r leaves 1, faster for the
  larger tau (negative advantages, which destabilize more, by default). The log-ratio is
  clamped to [-20, 20] as verl's. Metrics: clip_frac (0: nothing clipped), approx_kl,
  ratio_mean/max/min, pg_loss, kl_ref."""
  if not (_is_positive(tau_pos) and _is_positive(tau_neg)):
    raise ValueError(f"tau_pos/tau_neg: expected temperatures > 0, got {tau_pos}/{tau_neg}")
  logp, old_logp, adv, mask, weights = _prepare(logp, old_logp, advantages, mask,
                                                token_weights)
  ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
  tau = jnp.where(adv > 0, tau_pos, tau_neg).astype(logp.dtype)
  pg = -jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
  metrics = {"clip_frac": jnp.zeros((), logp.dtype)}
  return _finish(pg * weights, logp, old_logp, ratio, mask, agg, norm_const, ref_logp,
                 kl_coef, kl_estimator, kl_bias_correction, metrics)


def pg_loss(logp, old_logp, advantages, mask, *, agg: str = "token-mean",
            norm_const: float | None = None, token_weights=None, ref_logp=None,
            kl_coef: float = 0.0, kl_estimator: str = "k3", kl_bias_correction: bool = False):
  """The plain policy gradient: each token's term is -A * log pi, no ratio and no clip (GPG,
  arXiv 2504.02546; verl's policy_loss gpg). old_logp enters the metrics alone (and the KL
  term's bias correction). Metrics: clip_frac (0: nothing clipped), approx_kl,
  ratio_mean/max/min, pg_loss, kl_ref."""
  logp, old_logp, adv, mask, weights = _prepare(logp, old_logp, advantages, mask,
                                                token_weights)
  ratio = jnp.exp(logp - old_logp)
  metrics = {"clip_frac": jnp.zeros((), logp.dtype)}
  return _finish(-adv * logp * weights, logp, old_logp, ratio, mask, agg, norm_const,
                 ref_logp, kl_coef, kl_estimator, kl_bias_correction, metrics)


def _is_positive(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def covariance_stats(logp, advantages, mask, ratio: float):
  """KL-Cov's selection over the real tokens (`mask`) of a batch: (mean advantage, mean
  log-prob, the covariance term the top `ratio` of them reach: the k-th largest of
  (A - mean A) (log pi - mean log pi), k = max(1, int(tokens * ratio)), verl's count).
  Constants: no gradient flows through the selection."""
  logp = jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
  adv = jax.lax.stop_gradient(_broadcast_advantages(advantages, logp.shape)
                              .astype(jnp.float32))
  mask = jnp.asarray(mask, jnp.float32)
  adv_mean, logp_mean = _masked_mean(adv, mask), _masked_mean(logp, mask)
  cov = jnp.where(mask > 0, (adv - adv_mean) * (logp - logp_mean), -jnp.inf)
  return adv_mean, logp_mean, -_kth_smallest(-cov, _share(mask, ratio))


def _share(mask, ratio: float) -> jax.Array:
  """max(1, int(tokens * ratio)): how many of the real tokens a share names (verl's count)."""
  return jnp.maximum(1, jnp.floor(jnp.sum(mask) * ratio).astype(jnp.int32))


def _kth_smallest(values, k) -> jax.Array:
  """The k-th smallest (1-based, traced k) of all `values`."""
  return jnp.take(jnp.sort(values.reshape(-1)), k - 1)


def kl_cov_loss(logp, old_logp, advantages, mask, *, kl_cov_ratio: float = 2e-4,
                kl_cov_coef: float = 1.0, cov_stats=None, agg: str = "token-mean",
                norm_const: float | None = None, token_weights=None, ref_logp=None,
                kl_coef: float = 0.0, kl_estimator: str = "k3",
                kl_bias_correction: bool = False):
  """KL-Cov ("The Entropy Mechanism of RL for Reasoning LMs", verl's policy_loss kl_cov):
  the unclipped surrogate -A r, r = pi/pi_old, and on the top `kl_cov_ratio` of tokens by
  the covariance of their log-prob and advantage (those whose updates drive entropy down)
  plus kl_cov_coef * |log pi - log pi_old|, which holds them near the old policy. No ratio
  is clipped. `cov_stats`: covariance_stats of a larger batch these rows are a slice of
  (None: of these rows); tokens tied at the k-th covariance all join. Metrics:
  kl_cov_frac (tokens held), clip_frac (0: nothing clipped), approx_kl, ratio_mean/max/min,
  pg_loss, kl_ref."""
  if not 0 < kl_cov_ratio <= 1:
    raise ValueError(f"kl_cov_ratio: expected a share of the tokens in (0, 1], got "
                     f"{kl_cov_ratio!r}")
  logp, old_logp, adv, mask, weights = _prepare(logp, old_logp, advantages, mask,
                                                token_weights)
  adv_mean, logp_mean, threshold = (covariance_stats(logp, advantages, mask, kl_cov_ratio)
                                    if cov_stats is None else cov_stats)
  cov = (adv - adv_mean) * (jax.lax.stop_gradient(logp) - logp_mean)
  held = (cov >= threshold) & (mask > 0)
  ratio = jnp.exp(logp - old_logp)
  pg = -adv * ratio + jnp.where(held, kl_cov_coef * _abs_flat_at_zero(logp - old_logp), 0.0)
  metrics = {"kl_cov_frac": _frac(held, mask), "clip_frac": jnp.zeros((), logp.dtype)}
  return _finish(pg * weights, logp, old_logp, ratio, mask, agg, norm_const, ref_logp,
                 kl_coef, kl_estimator, kl_bias_correction, metrics)
