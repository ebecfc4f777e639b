"""Off-policy and train/inference mismatch corrections.

Three log-probs of the same sampled tokens meet here, all `[B, T]` with a `[B, T]` mask:
- `behaviour_logp`: from the worker that sampled the tokens, i.e. the policy version it
  held (possibly stale by a few publishes) and, in int8 mode, its quantized weights.
  The worker sends them with the rollout.
- `proximal_logp` (= old_logp): recomputed by the trainer with its own full-precision
  weights at the start of the update, before any gradient step on this batch.
- `logp`: the current policy, differentiated.

Which function needs which:
- `truncated_importance_weights` (TIS) and `masked_importance_weights` (MIS): proximal
  and behaviour; their weights go to a loss's `token_weights` (and MIS's mask to `mask`).
- `decoupled_ppo_loss`: all three (PPO clip on pi/pi_prox, weight pi_prox/pi_behav).
- `m2po_mask` / `m2po_loss`: proximal and behaviour for the mask, logp for the loss.
- `off_policy_sequence_mask`: behaviour and logp (gradient stopped), and the advantages.
The two losses take `token_weights` as `algorithms.losses` does: a constant weight per
token multiplying its loss, the token still counting in the aggregation's denominators.
Weights and masks are constants (stop-gradient); all functions are jittable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from algorithms.losses import aggregate, ppo_clip_loss

LEVELS = ("token", "sequence", "geometric")


def _check(proximal_logp, behaviour_logp, mask):
  proximal_logp = jnp.asarray(proximal_logp)
  if proximal_logp.ndim != 2:
    raise ValueError(f"proximal_logp: expected shape [B, T], got {proximal_logp.shape}")
  if jnp.shape(behaviour_logp) != proximal_logp.shape:
    raise ValueError(f"behaviour_logp: expected shape {proximal_logp.shape}, got "
                     f"{jnp.shape(behaviour_logp)}")
  if jnp.shape(mask) != proximal_logp.shape:
    raise ValueError(f"mask: expected shape {proximal_logp.shape}, got {jnp.shape(mask)}")
  mask = jnp.asarray(mask).astype(proximal_logp.dtype)
  log_ratio = jax.lax.stop_gradient((proximal_logp - jnp.asarray(behaviour_logp)) * mask)
  return log_ratio, mask


def _token_weights(token_weights, like):
  """`token_weights` as a constant `[B, T]` array like `like` (None: 1 on every token)."""
  if token_weights is None:
    return jnp.ones_like(like)
  if jnp.shape(token_weights) != like.shape:
    raise ValueError(f"token_weights: expected shape {like.shape} like logp, got "
                     f"{jnp.shape(token_weights)}")
  return jax.lax.stop_gradient(jnp.asarray(token_weights).astype(like.dtype))


def _log_weights(log_ratio, mask, level: str):
  """Per-token log importance weight at the given level, broadcast to [B, T]."""
  if level not in LEVELS:
    raise ValueError(f"level: expected one of {LEVELS}, got {level!r}")
  if level == "token":
    return log_ratio
  seq = jnp.sum(log_ratio, axis=-1, keepdims=True)
  if level == "geometric":
    seq = seq / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
  return jnp.broadcast_to(seq, log_ratio.shape)


def truncated_importance_weights(proximal_logp, behaviour_logp, mask, *, level: str = "token",
                                 cap: float = 2.0):
  """TIS: w = min(pi_prox / pi_behav, cap), per token or per sequence.

  level "token": each token's ratio; "sequence": the product over the sequence's tokens;
  "geometric": the geometric mean over its tokens (length-normalised sequence ratio).
  Returns `[B, T]` weights, 0 on padding. TRL: vllm_importance_sampling_mode
  "{token,sequence}_truncate" with clip_max=cap.
  """
  if not cap > 0:
    raise ValueError(f"cap: expected > 0, got {cap!r}")
  log_ratio, mask = _check(proximal_logp, behaviour_logp, mask)
  log_w = jnp.minimum(_log_weights(log_ratio, mask, level), jnp.log(cap))
  return jnp.exp(log_w) * mask


def masked_importance_weights(proximal_logp, behaviour_logp, mask, *, level: str = "token",
                              low: float = 0.5, high: float = 2.0):
  """MIS: drop tokens (or whole sequences) whose ratio pi_prox/pi_behav leaves [low, high].

  Returns (weights [B, T], new mask [B, T]): kept tokens carry their untruncated ratio,
  dropped ones have weight 0 and mask 0. level as in `truncated_importance_weights`.
  TRL: "{token,sequence}_mask" with clip_min=low (None: 0), clip_max=high.
  """
  if not 0 <= low < high:
    raise ValueError(f"low/high: expected 0 <= low < high, got {low!r}/{high!r}")
  log_ratio, mask = _check(proximal_logp, behaviour_logp, mask)
  log_w = _log_weights(log_ratio, mask, level)
  low_log = jnp.log(low) if low > 0 else -jnp.inf
  keep = (log_w >= low_log) & (log_w <= jnp.log(high)) & (mask > 0)
  keep = keep.astype(mask.dtype)
  return jnp.exp(jnp.where(keep > 0, log_w, 0.0)) * keep, keep


def decoupled_ppo_loss(logp, proximal_logp, behaviour_logp, advantages, mask, *,
                       behaviour_cap: float | None = 5.0, cap_mode: str = "truncate",
                       token_weights=None, **ppo_kwargs):
  """Decoupled PPO: clip pi/pi_prox as in PPO, weight each token by pi_prox/pi_behav.

  The proximal policy (trainer, full precision) anchors the trust region; the behaviour
  policy (worker: stale and/or int8) only enters through the weight. behaviour_cap
  bounds that weight: cap_mode "truncate" takes min(w, cap), "mask" drops tokens with
  w > cap. token_weights multiply that weight (e.g. the high-entropy token selection).
  Other keyword arguments go to `ppo_clip_loss`. Metrics add behaviour_weight_mean and
  behaviour_capped_frac (over every real token, whatever its token weight).
  """
  if cap_mode not in ("truncate", "mask"):
    raise ValueError(f"cap_mode: expected 'truncate' or 'mask', got {cap_mode!r}")
  log_ratio, fmask = _check(proximal_logp, behaviour_logp, mask)
  w = jnp.exp(log_ratio)
  capped = jnp.zeros_like(w)
  if behaviour_cap is not None:
    if not behaviour_cap > 0:
      raise ValueError(f"behaviour_cap: expected > 0 or None, got {behaviour_cap!r}")
    capped = (w > behaviour_cap).astype(w.dtype) * fmask
    w = jnp.minimum(w, behaviour_cap) if cap_mode == "truncate" else w * (1.0 - capped)
  weights = w * fmask * _token_weights(token_weights, w)
  loss, metrics = ppo_clip_loss(logp, proximal_logp, advantages, mask, token_weights=weights,
                                **ppo_kwargs)
  n = jnp.maximum(jnp.sum(fmask), 1.0)
  metrics["behaviour_weight_mean"] = jnp.sum(w * fmask) / n
  metrics["behaviour_capped_frac"] = jnp.sum(capped) / n
  return loss, metrics


def m2po_mask(proximal_logp, behaviour_logp, mask, *, threshold: float = 0.04):
  """M2PO: mask the tokens with the largest (log pi_prox/pi_behav)^2, fewest first, until
  the mean of that second moment over the remaining tokens is <= threshold.

  Batch-wide (all tokens of the batch together). Returns the new `[B, T]` mask; when
  the batch already satisfies the bound nothing is masked.
  """
  if not threshold >= 0:
    raise ValueError(f"threshold: expected >= 0, got {threshold!r}")
  log_ratio, fmask = _check(proximal_logp, behaviour_logp, mask)
  m2 = (log_ratio * log_ratio).reshape(-1)
  valid = fmask.reshape(-1) > 0
  n = jnp.sum(valid)
  key = jnp.where(valid, m2, -1.0)
  order = jnp.argsort(-key, stable=True)  # largest second moment first, padding last
  sorted_m2 = jnp.where(valid[order], m2[order], 0.0)
  removed_sum = jnp.concatenate([jnp.zeros((1,), m2.dtype), jnp.cumsum(sorted_m2)])
  k = jnp.arange(m2.shape[0] + 1)
  remaining = n - k
  mean_after = (removed_sum[-1] - removed_sum) / jnp.maximum(remaining, 1)
  ok = (mean_after <= threshold) | (remaining <= 0)
  num_drop = jnp.argmax(ok)  # mean_after falls as k grows: the first k that satisfies it
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
  keep = valid & (rank >= num_drop)
  return keep.reshape(fmask.shape).astype(fmask.dtype)


def m2po_loss(logp, proximal_logp, behaviour_logp, advantages, mask, *,
              threshold: float = 0.04, agg: str = "token-mean",
              norm_const: float | None = None, token_weights=None):
  """M2PO objective: -M * (pi/pi_prox) * A * token_weights, no clipping, with M from
  `m2po_mask`.

  M's second moment is over every real token (`mask`), unweighted: it measures how far the
  behaviour policy is from the proximal one on the batch, as the paper's threshold does;
  token_weights (e.g. the high-entropy selection) only weigh the loss.
  Metrics: m2po_masked_frac, m2 (second moment before masking), loss.
  """
  logp = jnp.asarray(logp)
  weights = _token_weights(token_weights, logp)
  keep = m2po_mask(proximal_logp, behaviour_logp, mask, threshold=threshold)
  adv = jnp.asarray(advantages)
  adv = adv[:, None] if adv.ndim == 1 else adv
  ratio = jnp.exp(logp - jax.lax.stop_gradient(proximal_logp))
  loss = aggregate(-ratio * adv * keep * weights, jnp.asarray(mask).astype(logp.dtype), agg,
                   norm_const)
  log_ratio, fmask = _check(proximal_logp, behaviour_logp, mask)
  n = jnp.maximum(jnp.sum(fmask), 1.0)
  metrics = {"loss": loss, "m2": jnp.sum(log_ratio * log_ratio) / n,
             "m2po_masked_frac": 1.0 - jnp.sum(keep) / n}
  return loss, metrics


def off_policy_sequence_mask(logp, behaviour_logp, advantages, mask, *, threshold: float):
  """DeepSeek-V3.2's off-policy sequence masking (TRL's off_policy_mask_threshold): a
  sequence with negative advantage whose mean log(pi_behav / pi) over its tokens exceeds
  `threshold` gets no policy loss. pi is the current policy (gradient stopped), pi_behav
  the sampler's. Returns (keep [B, T]: `mask` with those sequences' tokens 0, dropped [B])."""
  if not threshold >= 0:
    raise ValueError(f"threshold: expected >= 0, got {threshold!r}")
  logp = jnp.asarray(logp)
  log_ratio, fmask = _check(jax.lax.stop_gradient(logp), behaviour_logp, mask)
  mean = -jnp.sum(log_ratio, axis=-1) / jnp.maximum(jnp.sum(fmask, axis=-1), 1.0)
  adv = jnp.asarray(advantages)
  if adv.shape != logp.shape[:1]:
    raise ValueError(f"advantages: expected one per sequence, shape {logp.shape[:1]}, got "
                     f"{adv.shape}")
  dropped = (jax.lax.stop_gradient(adv) < 0) & (mean > threshold)
  return fmask * (~dropped)[:, None].astype(fmask.dtype), dropped
