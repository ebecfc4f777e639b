"""The RL objective on a packed rollout batch, as pure functions: advantages from
`algorithms.advantages`, current log-probs from the packed shared-prompt path (the prompt
runs once per row), then the configured policy loss and off-policy correction.

With one optimizer step per batch the proximal policy (the trainer's weights before the
batch) is the current one with its gradient stopped: PPO's ratio then measures the policy
against the workers' behaviour log-probs (correction "none"), or is 1 with the behaviour
gap carried by importance weights ("tis", "mis", "decoupled") or bounded by masking the
tokens of largest second moment ("m2po"). With several steps per batch the
proximal log-probs are computed once, before the first, and the clip bounds the later ones.

Mixture of experts with routing replay: every forward here (current, proximal, reference)
sends each token to the experts the workers' sampler used, so the ratios compare policies
that differ by their weights, not by a router flipping between near-equal experts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from algorithms import advantages as adv_lib
from algorithms import corrections, losses, shaping
from rlax_ps.kernels import pack_group, pack_routes, packed_response_logprobs
from rlax_ps.models.transformer import load_balancing_loss
from rlax_ps.train.trainable import split_trainable, trainable_value_and_grad

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "mc_grpo", "opo", "passk", "gpg", "remax",
              "reinforce_pp", "reinforce_pp_baseline", "gae", "opd")
# The advantages given per token ([rows * N, R]): whitened over the whole batch's tokens, or
# (opd) each token's own.
TOKEN_ADVANTAGES = ("reinforce_pp", "reinforce_pp_baseline", "gae", "opd")
# The advantages whose returns are discounted (loss.gamma).
DISCOUNTED = ("reinforce_pp", "gae")
# The advantages divided by a std of the rewards, and the stds they may take: their group's
# or the whole batch's (dr_grpo is grpo divided by none; rloo and opo have none; gpg takes
# one when set, else none, as its paper).
SCALED_ADVANTAGES = ("grpo", "mc_grpo", "passk")
SCALE_REWARDS = ("group", "batch")
POLICY_LOSSES = ("ppo", "gspo", "cispo", "geo_mean", "clip_cov", "kl_cov", "sapo", "pg")
# The policy losses that clip no ratio (loss.clip_low and clip_high stay unset).
UNCLIPPED = ("kl_cov", "sapo", "pg")
# Each policy loss's clip bounds and aggregation as published, for the fields left unset:
# PPO with DAPO's clip-higher; GSPO's bounds of a length-normalised sequence ratio, averaged
# per sequence (token-mean would weigh a sequence by its length); CISPO with no floor on the
# weight (MiniMax-M1).
POLICY_DEFAULTS = {"ppo": dict(clip_low=0.2, clip_high=0.28, agg="token-mean"),
                   "gspo": dict(clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"),
                   "cispo": dict(clip_low=1.0, clip_high=0.28, agg="token-mean"),
                   # GMPO: its log-ratio bounds (e^-0.4, e^0.4), one term per sequence
                   "geo_mean": dict(clip_low=0.4, clip_high=0.4, agg="seq-mean-token-mean"),
                   "clip_cov": dict(clip_low=0.2, clip_high=0.28, agg="token-mean"),  # PPO's
                   "kl_cov": dict(agg="token-mean"),  # it clips no ratio
                   "sapo": dict(agg="seq-mean-token-mean"),  # its soft gate clips none
                   "pg": dict(agg="token-mean")}  # verl's gpg
CORRECTIONS = ("none", "tis", "mis", "decoupled", "m2po")
REWARD_AGGREGATIONS = ("sum", "normalize_then_sum")


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The `loss` config block: which estimator, loss and correction, and their knobs."""

  # grpo | dr_grpo (no std scaling) | rloo | mc_grpo (median baseline) | opo (length-weighted
  # mean baseline) | passk (only each group's best sample learns: pass@k training) |
  # reinforce_pp (verl's reinforce_plus_plus: each token's return, whitened over the batch's
  # tokens) | reinforce_pp_baseline (verl's reinforce_plus_plus_baseline: the score minus
  # its group's mean, whitened over the batch's tokens) | gpg (GPG: r - group mean, the
  # batch scaled by B / (B - M), M its samples in groups of all-equal rewards, so those
  # groups do not shrink the gradient; divided by a std only with scale_rewards set; pair
  # it with policy_loss="pg", as GPG does) | remax (ReMax: r minus the reward of the
  # prompt's greedy sample, which workers with worker.greedy_baseline decode beside the
  # others and send as the group's baseline; no std) | gae (PPO's generalized advantage
  # estimation over a critic's values, the critic trained beside the policy: the `critic`
  # block; verl's "gae") | opd (on-policy distillation: each sampled token's advantage is
  # log pi_teacher - log pi_sampled, minus its reverse KL to the `teacher` block's model;
  # rewards do not enter). These four are per token.
  advantage: str = "grpo"
  # reinforce_pp and gae: the returns' discount (verl's algorithm.gamma); 1.0 for the others.
  gamma: float = 1.0
  # gae: its lambda (verl's algorithm.lam); 1.0 for the others.
  lam: float = 1.0
  # grpo and mc_grpo: divide by the std of the sample's group ("group") or of the whole
  # batch's rewards ("batch", around each group's baseline: TRL's scale_rewards="batch");
  # None: "group". Unset for dr_grpo and rloo, which divide by no std; gpg: None divides by
  # none (GPG's F_norm = 1), "group" or "batch" as grpo's.
  scale_rewards: str | None = None
  std_eps: float = 1e-6  # grpo, mc_grpo: (r - baseline) / (std + std_eps); TRL's is 1e-4
  # sum: the advantages of each sample's reward, the workers' weighted sum of its parts |
  # normalize_then_sum (GDPO; TRL's multi_objective_aggregation): each reward part normalised
  # within its group, weighted and summed, the sum normalised over the batch (advantage
  # grpo, std_eps at both steps).
  reward_aggregation: str = "sum"
  # normalize_then_sum: (name, weight) of each reward part the batch carries, as the workers
  # weigh them (the trainer sets them from worker.reward_terms and worker.reward_model_weight;
  # the reward model's weighs 1 in a group without a task part, of task reward_model).
  reward_parts: tuple[tuple[str, float], ...] = ()
  # ppo (clip, clip-higher when clip_high > clip_low) | gspo | cispo (every token's
  # log-prob weighted by its ratio clipped to [1 - clip_low, 1 + clip_high], held constant)
  # | geo_mean (GMPO: the geometric mean of each sequence's token ratios, each clipped in log
  # space to [-clip_low, clip_high]) | clip_cov (Clip-Cov: PPO-clip, a random few of the
  # tokens of high covariance left without gradient; below) | kl_cov (KL-Cov: unclipped,
  # its most covarying tokens held by a KL term; below) | sapo (SAPO: a soft gate of the
  # ratio in place of the clip; below) | pg (the plain policy gradient -A log pi, no ratio
  # and no clip: GPG's loss, verl's gpg)
  policy_loss: str = "ppo"
  # none | tis (truncated IS) | mis (masked IS) | decoupled (decoupled PPO) | m2po (M2PO:
  # unclipped ratio, tokens of largest (log pi_prox/pi_behav)^2 masked)
  correction: str = "none"
  # The policy loss's clip bounds and aggregation (algorithms.losses.AGGREGATIONS); None:
  # that loss's own as published (POLICY_DEFAULTS), so that choosing GSPO or CISPO does not
  # keep PPO's.
  clip_low: float | None = None
  clip_high: float | None = None
  agg: str | None = None
  # ppo: > 1 bounds a negative-advantage token's loss at -dual_clip * A however large its
  # ratio (dual-clip PPO: verl's clip_ratio_c, TRL's delta); None: off.
  dual_clip: float | None = None
  # kl_cov: the share of the batch's tokens, those whose log-prob and advantage covary most,
  # held near the old policy by kl_cov_coef * |log pi - log pi_old| (verl's kl_cov_ratio and
  # ppo_kl_coef); the share is of the whole batch however rl.micro_batches slices it.
  kl_cov_ratio: float = 2e-4
  kl_cov_coef: float = 1.0
  # clip_cov: at most this share of the batch's tokens, drawn at random (new draws each
  # update) from those PPO's clip leaves whose covariance term lies in (clip_cov_lb,
  # clip_cov_ub), lose their gradient (verl's clip_cov_ratio, clip_cov_lb, clip_cov_ub); the
  # draw is over the whole batch however rl.micro_batches slices it.
  clip_cov_ratio: float = 2e-4
  clip_cov_lb: float = 1.0
  clip_cov_ub: float = 5.0
  # sapo: each token's term is -sigmoid(tau (r - 1)) * 4 / tau * A, tau = sapo_tau_pos where
  # A > 0 else sapo_tau_neg (verl's tau_pos, tau_neg): the larger, the sooner it fades.
  sapo_tau_pos: float = 1.0
  sapo_tau_neg: float = 1.05
  tis_cap: float = 2.0  # TIS: weights min(pi_prox / pi_behav, cap)
  # TIS and MIS: the ratio of each token, of the whole sequence (the product: TRL's
  # sequence_truncate / sequence_mask) or its geometric mean (corrections.LEVELS)
  is_level: str = "token"
  behaviour_cap: float = 5.0  # decoupled PPO: cap on pi_prox / pi_behav
  mis_low: float = 0.5  # MIS: tokens whose pi_prox / pi_behav leaves [low, high] weigh 0
  mis_high: float = 2.0
  m2po_threshold: float = 0.04  # M2PO: bound on the kept tokens' mean second moment
  # > 0: a sample with negative advantage whose mean log(pi_behav / pi) over its tokens
  # exceeds this gets no policy loss (DeepSeek-V3.2's off-policy sequence masking; TRL's
  # off_policy_mask_threshold); pi_behav: the workers' sampling log-probs (behaviour_logp),
  # pi: the current policy (the proximal one at an update's start), with any correction.
  # None or 0: off.
  off_policy_mask: float | None = None
  # DAPO's soft overlong punishment: a response within this many tokens of the budget
  # (worker.max_new_tokens) loses up to 1 reward, linearly; 0 = off.
  overlong_buffer: int = 0
  # True: a response cut at the budget (no stop token: `truncated_samples`) gets no loss; its
  # reward still counts in its group's baseline and std (DAPO; TRL's
  # mask_truncated_completions, which masks after the advantages too).
  mask_truncated: bool = False
  # < 1: only the tokens whose entropy (the trainer's policy) is in this top share of the
  # whole batch's get policy loss; the others weigh 0 and still count in its mean ("Beyond
  # the 80/20 rule", 0.2; TRL's top_entropy_quantile). 1.0: every token.
  top_entropy_quantile: float = 1.0
  # > 0: minus this times the policy's entropy, aggregated as the policy loss (`agg`) over
  # all its tokens (those top_entropy_quantile leaves out too), joins the loss with its
  # gradient (verl's entropy_coeff; TRL's takes the token mean of the selected ones).
  entropy_coef: float = 0.0
  # True: entropy_coef is where an adaptive coefficient starts (Skywork-OR1; TRL's
  # use_adaptive_entropy): after each step it moves up by entropy_coef_delta if the step's
  # entropy (train/entropy: the token mean over all the tokens the bonus acts on; TRL's,
  # with top_entropy_quantile < 1, over the selected ones its bonus acts on) was at or below
  # entropy_target, else down, within [entropy_coef_min, entropy_coef_max]; a step applies
  # it only when the last step's entropy was at or below the target (the first: none).
  adaptive_entropy: bool = False
  entropy_target: float = 0.2  # nats a token (TRL's default)
  entropy_coef_delta: float = 0.005
  entropy_coef_min: float = 0.0
  entropy_coef_max: float = 1.0
  kl_coef: float = 0.0  # > 0: KL(pi || frozen reference) term
  # > 0: distil the `teacher` block's model's k most likely next tokens at each sampled
  # position: plus distill_coef times the forward KL, aggregated as the policy loss, from the
  # teacher's distribution over those k ids (renormalised) to the policy's (GKD on the
  # policy's own samples: every position names what the teacher would say, not only
  # whether the sampled token pleased it). 0: off.
  distill_topk: int = 0
  distill_coef: float = 1.0
  # > 0: each response token's reward loses this times its KL(pi_behav || frozen reference)
  # by kl_estimator (pi_behav: the workers' sampling log-probs), the score on its last
  # token: verl's algorithm.use_kl_in_reward with a fixed kl_ctrl.kl_coef. The advantages of
  # one number per sample take the sum of its token rewards, as verl's. 0: off.
  kl_in_reward: float = 0.0
  # A KL target: kl_in_reward is where an adaptive coefficient starts (verl's kl_ctrl.type
  # "adaptive", target_kl, horizon; Ziegler et al. 2019): after each step it is multiplied
  # by 1 + clip(KL / kl_target - 1, -0.2, 0.2) * samples / kl_horizon, KL the step's mean
  # over its samples of their token-mean KL (train/reward_kl). None: fixed.
  kl_target: float | None = None
  kl_horizon: int = 10000
  # > 0: plus this times the mixture-of-experts load-balancing loss (transformers'
  # router_aux_loss_coef; train/router_aux_loss reports it either way).
  router_aux_coef: float = 0.0
  # KL(pi || reference) per token (algorithms.losses.kl_penalty): k1 (verl's "kl") | k2
  # (verl's "mse") | k3 (unclamped) | low_var_kl (verl's default: k3 clamped) | abs (verl's)
  kl_estimator: str = "k3"
  # True: each token's KL times its ratio pi/pi_old, the policy loss's, with its gradient
  # (TRL's use_bias_correction_kl, DeepSeek-V3.2's unbiased KL); needs kl_coef > 0.
  kl_bias_correction: bool = False
  backend: str = "auto"  # shared-prompt attention backend (rlax_ps.kernels)
  # > 0: project this many response positions to the vocabulary at a time (and again in
  # the backward pass) instead of whole rows: bounds the logits' memory for long responses
  # and large vocabularies.
  logits_chunk: int = 0
  remat: bool = False  # recompute each layer's activations in the backward pass
  # The responses' token budget (worker.max_new_tokens; the trainer sets it): DAPO's
  # overlong punishment and Dr. GRPO's constant normaliser count from it, whatever length
  # a step's batch is packed to (rl.response_buckets). 0: the batch's padded length.
  budget: int = 0
  # The tokenizer's stop ids (the trainer sets them): a response of `budget` tokens that ends
  # on one stopped rather than being cut (mask_truncated). (): none is known.
  stop_ids: tuple[int, ...] = ()
  # The workers' sampling temperature (worker.temperature; the trainer sets it): the policy's,
  # the proximal and the reference log-probs are of softmax(logits / temperature), the
  # distribution the behaviour log-probs are of (before top-k/top-p/min-p narrow the draw:
  # sampling.choose_tokens), as verl and TRL score them.
  temperature: float = 1.0

  def __post_init__(self):
    def need(cond, field, expected):
      if not cond:
        raise ValueError(f"loss.{field}: expected {expected}, got {getattr(self, field)!r}")

    def number(field, above=None, at_least=None):  # a finite number past a bound
      v = getattr(self, field)
      return (_is_number(v) and math.isfinite(v) and (above is None or v > above)
              and (at_least is None or v >= at_least))

    def whole(field):  # a whole number >= 0
      v = getattr(self, field)
      return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0

    defaults = {f.name: f.default for f in dataclasses.fields(self)}

    def unused(fields, used, why):  # settings the objective would not read: refused unless
      for field in fields:  # at their defaults (set by mistake, they would do nothing)
        need(used or getattr(self, field) == defaults[field], field,
             f"its default {defaults[field]!r} {why}")
    need(self.advantage in ADVANTAGES, "advantage", f"one of {ADVANTAGES}")
    need(self.policy_loss in POLICY_LOSSES, "policy_loss", f"one of {POLICY_LOSSES}")
    need(self.correction in CORRECTIONS, "correction", f"one of {CORRECTIONS}")
    if self.advantage in SCALED_ADVANTAGES:
      if self.scale_rewards is None:
        object.__setattr__(self, "scale_rewards", "group")
      need(self.scale_rewards in SCALE_REWARDS, "scale_rewards",
           f"one of {SCALE_REWARDS} with advantage={self.advantage!r} (no std: "
           "advantage='dr_grpo')")
    need(self.advantage not in TOKEN_ADVANTAGES or self.scale_rewards is None,
         "scale_rewards", f"unset with advantage={self.advantage!r}, which whitens over the "
         "batch's tokens itself")
    need(self.advantage in SCALED_ADVANTAGES or self.scale_rewards is None
         or (self.advantage == "gpg" and self.scale_rewards in SCALE_REWARDS), "scale_rewards",
         f"unset with advantage={self.advantage!r}, which divides by no std (grpo and "
         f"mc_grpo do; gpg takes one of {SCALE_REWARDS})")
    need(_is_number(self.gamma) and 0 < self.gamma <= 1, "gamma", "a discount in (0, 1]")
    need(self.gamma == 1 or self.advantage in DISCOUNTED, "gamma",
         f"1.0 with advantage={self.advantage!r} (only {' and '.join(DISCOUNTED)} discount "
         "returns)")
    need(_is_number(self.lam) and 0 <= self.lam <= 1, "lam", "a GAE lambda in [0, 1]")
    need(self.lam == 1 or self.advantage == "gae", "lam",
         f"1.0 with advantage={self.advantage!r} (GAE's lambda: advantage='gae')")
    need(_is_number(self.kl_in_reward) and math.isfinite(self.kl_in_reward)
         and self.kl_in_reward >= 0, "kl_in_reward", "a finite coefficient >= 0 (0: off)")
    need(self.kl_target is None or (_is_number(self.kl_target) and math.isfinite(self.kl_target)
                                    and self.kl_target > 0), "kl_target",
         "a finite KL > 0 (None: a fixed kl_in_reward)")
    need(self.kl_target is None or self.kl_in_reward > 0, "kl_target",
         "None with kl_in_reward=0 (it adapts the KL-in-reward coefficient, which starts there)")
    need(isinstance(self.kl_horizon, numbers.Integral) and not isinstance(self.kl_horizon, bool)
         and self.kl_horizon > 0, "kl_horizon", "a whole number of samples > 0")
    need(not (self.kl_in_reward > 0 and self.advantage == "opd"), "kl_in_reward",
         "0 with advantage='opd' (its advantages take no reward: the teacher's log-probs "
         "are the signal)")
    need(not (self.kl_in_reward > 0 and self.reward_aggregation != "sum"), "kl_in_reward",
         f"0 with reward_aggregation={self.reward_aggregation!r} (the KL penalty is no "
         "reward part of its own)")
    need(not (self.advantage in TOKEN_ADVANTAGES and self.off_policy_mask), "off_policy_mask",
         f"None or 0 with advantage={self.advantage!r} (it masks a sample by the sign of "
         "its advantage; these are per token)")
    need(math.isfinite(self.std_eps) and self.std_eps >= 0, "std_eps", "a finite eps >= 0")
    need(self.reward_aggregation in REWARD_AGGREGATIONS, "reward_aggregation",
         f"one of {REWARD_AGGREGATIONS}")
    need(self.reward_aggregation == "sum" or (self.advantage == "grpo"
                                              and self.scale_rewards == "group"),
         "reward_aggregation", f"'sum' with advantage={self.advantage!r}, scale_rewards="
         f"{self.scale_rewards!r} (normalize_then_sum is GDPO's GRPO: group, then batch)")
    need(all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) and p[0]
             and _is_number(p[1]) and math.isfinite(p[1]) for p in self.reward_parts),
         "reward_parts", "(name, finite weight) pairs")
    object.__setattr__(self, "reward_parts", tuple((n, float(w)) for n, w in self.reward_parts))
    need(self.off_policy_mask is None or (_is_number(self.off_policy_mask)
                                          and math.isfinite(self.off_policy_mask)
                                          and self.off_policy_mask >= 0),
         "off_policy_mask", "a finite threshold > 0 on the mean log(pi_behav / pi) (None or "
         "0: off)")
    for field, value in POLICY_DEFAULTS[self.policy_loss].items():
      if getattr(self, field) is None:
        object.__setattr__(self, field, value)
    if self.policy_loss in UNCLIPPED:
      need(self.clip_low is None and self.clip_high is None, "clip_low",
           f"unset with policy_loss={self.policy_loss!r} (it clips no ratio: "
           + {"kl_cov": "its kl_cov_ratio of tokens are held by a KL term instead)",
              "sapo": "a soft gate bounds each token's step instead)",
              "pg": "the plain policy gradient takes no ratio)"}[self.policy_loss])
    for field in ("sapo_tau_pos", "sapo_tau_neg"):
      value = getattr(self, field)
      need(_is_number(value) and math.isfinite(value) and value > 0, field,
           "a finite temperature > 0")
    need(_is_number(self.temperature) and math.isfinite(self.temperature)
         and self.temperature > 0, "temperature", "the workers' sampling temperature > 0")
    need(_is_number(self.kl_cov_ratio) and 0 < self.kl_cov_ratio <= 1, "kl_cov_ratio",
         "a share of the tokens in (0, 1]")
    need(_is_number(self.kl_cov_coef) and math.isfinite(self.kl_cov_coef)
         and self.kl_cov_coef >= 0, "kl_cov_coef", "a finite coefficient >= 0")
    need(_is_number(self.clip_cov_ratio) and 0 < self.clip_cov_ratio <= 1, "clip_cov_ratio",
         "a share of the tokens in (0, 1]")
    need(_is_number(self.clip_cov_lb) and _is_number(self.clip_cov_ub)
         and self.clip_cov_lb < self.clip_cov_ub, "clip_cov_ub",
         f"a bound above clip_cov_lb={self.clip_cov_lb}")
    need(not (self.advantage in TOKEN_ADVANTAGES and self.policy_loss in ("gspo", "geo_mean")),
         "policy_loss", f"'ppo', 'cispo' or 'kl_cov' with advantage={self.advantage!r} (GSPO's "
         "and GMPO's sequence ratios take one advantage per sample)")
    need(not (self.policy_loss != "ppo" and self.correction in ("decoupled", "m2po")),
         "correction", f"'none', 'tis' or 'mis' with policy_loss={self.policy_loss!r} "
         "(decoupled PPO and M2PO are losses of their own)")
    need(not (self.correction == "m2po" and self.kl_coef > 0), "correction",
         "not 'm2po' with kl_coef > 0 (M2PO's objective has no KL term)")
    need(0 <= self.mis_low < self.mis_high, "mis_low", f"0 <= mis_low < mis_high={self.mis_high}")
    need(self.m2po_threshold >= 0, "m2po_threshold", ">= 0")
    if self.dual_clip is not None:
      need(self.dual_clip > 1, "dual_clip", "a constant > 1 (None: off)")
      need(self.policy_loss == "ppo" and self.correction != "m2po", "dual_clip",
           f"None with policy_loss={self.policy_loss!r}, correction={self.correction!r} "
           "(it bounds PPO's clipped loss)")
    need(whole("overlong_buffer"), "overlong_buffer", "a whole number of tokens >= 0")
    need(not (self.overlong_buffer and self.advantage == "remax"), "overlong_buffer",
         "0 with advantage='remax' (the greedy baseline's length does not reach the trainer: "
         "its samples would be punished for length and their baseline not)")
    need(not (self.kl_in_reward and self.advantage == "remax"
              and self.policy_loss in ("gspo", "geo_mean")), "policy_loss",
         f"'ppo', 'cispo' or 'kl_cov' with advantage='remax' and kl_in_reward (a token's "
         f"advantage is its return less the baseline), got {self.policy_loss!r}")
    need(isinstance(self.mask_truncated, bool), "mask_truncated", "True or False")
    need(_is_number(self.top_entropy_quantile) and 0 < self.top_entropy_quantile <= 1,
         "top_entropy_quantile", "a share in (0, 1] (1.0: every token)")
    need(_is_number(self.entropy_coef) and math.isfinite(self.entropy_coef)
         and self.entropy_coef >= 0, "entropy_coef", "a finite coefficient >= 0 (0: off)")
    need(isinstance(self.adaptive_entropy, bool), "adaptive_entropy", "True or False")
    for field, low in (("entropy_target", ">= 0"), ("entropy_coef_delta", "> 0"),
                       ("entropy_coef_min", ">= 0")):
      value = getattr(self, field)
      need(_is_number(value) and math.isfinite(value)
           and (value > 0 if low == "> 0" else value >= 0), field, f"a finite value {low}")
    need(_is_number(self.entropy_coef_max) and math.isfinite(self.entropy_coef_max)
         and self.entropy_coef_max >= self.entropy_coef_min, "entropy_coef_max",
         f"a finite bound >= entropy_coef_min={self.entropy_coef_min}")
    need(not self.adaptive_entropy
         or self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max,
         "entropy_coef", f"a starting coefficient in [entropy_coef_min, entropy_coef_max] = "
         f"[{self.entropy_coef_min}, {self.entropy_coef_max}] with adaptive_entropy=True")
    need(all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0
             for i in self.stop_ids), "stop_ids", "token ids >= 0")
    object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
    if self.policy_loss not in UNCLIPPED:  # (which clip nothing: unset, checked above)
      need(number("clip_low", at_least=0), "clip_low", "a finite clip bound >= 0")
      need(number("clip_high", at_least=0), "clip_high", "a finite clip bound >= 0")
    need(self.agg in losses.AGGREGATIONS, "agg", f"one of {losses.AGGREGATIONS}")
    need(number("tis_cap", above=0), "tis_cap", "a finite cap > 0")
    need(self.is_level in corrections.LEVELS, "is_level", f"one of {corrections.LEVELS}")
    need(number("behaviour_cap", above=0), "behaviour_cap", "a finite cap > 0")
    need(number("kl_coef", at_least=0), "kl_coef", "a finite coefficient >= 0")
    need(isinstance(self.distill_topk, numbers.Integral) and not isinstance(
        self.distill_topk, bool) and self.distill_topk >= 0, "distill_topk",
         "a whole number of the teacher's tokens >= 0 (0: off)")
    need(_is_number(self.distill_coef) and math.isfinite(self.distill_coef)
         and self.distill_coef >= 0, "distill_coef", "a finite coefficient >= 0")
    need(number("router_aux_coef", at_least=0), "router_aux_coef",
         "a finite coefficient >= 0")
    need(whole("logits_chunk"), "logits_chunk", "a whole number of positions >= 0 (0 = whole "
         "rows)")
    need(whole("budget"), "budget", "a whole number of tokens >= 0")
    need(self.kl_estimator in losses.KL_ESTIMATORS, "kl_estimator",
         f"one of {losses.KL_ESTIMATORS}")
    need(isinstance(self.kl_bias_correction, bool), "kl_bias_correction", "True or False")
    need(not (self.kl_bias_correction and self.kl_coef <= 0), "kl_bias_correction",
         "False with kl_coef=0 (it corrects the KL term, which kl_coef > 0 turns on)")
    for fields, reads in ((("is_level",), ("tis", "mis")), (("tis_cap",), ("tis",)),
                          (("mis_low", "mis_high"), ("mis",)), (("m2po_threshold",), ("m2po",)),
                          (("behaviour_cap",), ("decoupled",))):
      unused(fields, self.correction in reads, f"with correction={self.correction!r} (read "
             f"with {' or '.join(map(repr, reads))})")
    unused(("kl_horizon",), self.kl_target is not None, "without kl_target")
    unused(("distill_coef",), self.distill_topk > 0, "with distill_topk=0")
    unused(("entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max"),
           self.adaptive_entropy, "without adaptive_entropy")
    for loss_name, fields in (("kl_cov", ("kl_cov_ratio", "kl_cov_coef")),
                              ("clip_cov", ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")),
                              ("sapo", ("sapo_tau_pos", "sapo_tau_neg"))):
      unused(fields, self.policy_loss == loss_name, f"with policy_loss={self.policy_loss!r}")

  @classmethod
  def from_config(cls, block) -> "LossConfig":
    d = block.to_dict() if hasattr(block, "to_dict") else dict(block)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ValueError(f"loss: unknown fields {unknown}; known: {sorted(known)}")
    return cls(**d)


def needs_reference(cfg: LossConfig) -> bool:
  """Whether the objective reads the frozen reference's log-probs: a KL loss term
  (loss.kl_coef) or a KL penalty in the rewards (loss.kl_in_reward)."""
  return cfg.kl_coef > 0 or cfg.kl_in_reward > 0


def entropy_bonus_coef(coef: float, last_entropy: float, cfg: LossConfig) -> float:
  """The coefficient a step's entropy bonus applies under loss.adaptive_entropy: the
  controller's `coef` if the last step's entropy was at or below loss.entropy_target, else
  0 (TRL's rule; before any step `last_entropy` is inf)."""
  return coef if last_entropy <= cfg.entropy_target else 0.0


def adapt_entropy_coef(coef: float, entropy: float, cfg: LossConfig) -> float:
  """The controller's coefficient after a step that measured `entropy`: up by
  loss.entropy_coef_delta if at or below loss.entropy_target, else down, clipped to
  [entropy_coef_min, entropy_coef_max] (Skywork-OR1; TRL's use_adaptive_entropy)."""
  if entropy <= cfg.entropy_target:
    return min(coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
  return max(coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)


def truncated_samples(batch: dict, cfg: LossConfig) -> jax.Array:
  """[rows * N] bool: the samples cut at the budget (cfg.budget, else the padded length)
  rather than ended by a stop id of cfg.stop_ids: the workers' finish_reason "length", by
  rollouts.response_stats's rule."""
  r = batch["response_tokens"].shape[-1]
  lens = batch["response_lens"].reshape(-1)
  last = jnp.take_along_axis(batch["response_tokens"].reshape(-1, r),
                             jnp.clip(lens - 1, 0, r - 1)[:, None], axis=1)[:, 0]
  cut = lens >= (cfg.budget or r)
  return cut & ~jnp.isin(last, jnp.asarray(cfg.stop_ids, last.dtype)) if cfg.stop_ids else cut


def adapt_kl_coef(beta: float, reward_kl: float, samples: int, cfg: LossConfig) -> float:
  """loss.kl_target's controller after a step whose samples' mean KL was `reward_kl`: beta
  times 1 + clip(reward_kl / kl_target - 1, -0.2, 0.2) * samples / kl_horizon (verl's
  AdaptiveKLController, from TRL's PPO)."""
  error = min(max(reward_kl / cfg.kl_target - 1.0, -0.2), 0.2)
  return beta * (1.0 + error * samples / cfg.kl_horizon)


def reward_kl(batch: dict, ref_logp: jax.Array, tokens: jax.Array, cfg: LossConfig
              ) -> jax.Array:
  """loss.kl_in_reward's KL(pi_behav || reference) of each token [rows * N, R] by
  loss.kl_estimator, 0 off `tokens` (the trained ones)."""
  behaviour = batch["behaviour_logp"].reshape(tokens.shape)
  return losses.kl_penalty(behaviour, ref_logp.reshape(tokens.shape), cfg.kl_estimator) * tokens


def reward_kl_mean(batch: dict, ref_logp: jax.Array, sample_mask: jax.Array,
                   cfg: LossConfig) -> jax.Array:
  """The batch's mean over its samples of each one's token-mean reward_kl (verl's
  actor/reward_kl_penalty, what loss.kl_target's controller reads)."""
  tokens = token_mask(batch, sample_mask)
  per_sample = (jnp.sum(reward_kl(batch, ref_logp, tokens, cfg), axis=-1)
                / (jnp.sum(tokens, axis=-1) + 1e-8))
  return jnp.sum(per_sample * sample_mask) / jnp.maximum(jnp.sum(sample_mask), 1.0)


def sample_scores(batch: dict, cfg: LossConfig) -> jax.Array:
  """[rows * N] each sample's reward, with DAPO's soft overlong punishment
  (loss.overlong_buffer)."""
  rewards = batch["rewards"].reshape(-1)
  if cfg.overlong_buffer:
    budget = cfg.budget or batch["response_tokens"].shape[-1]
    rewards = rewards + shaping.soft_overlong_punishment(
        batch["response_lens"].reshape(-1), budget, min(cfg.overlong_buffer, budget))
  return rewards


def group_advantages(batch: dict, num_groups: int, cfg: LossConfig,
                     ref_logp: jax.Array | None = None, kl_beta: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array]:
  """(advantages, sample mask [rows * N]) over each row's whole group: [rows * N] advantages,
  or [rows * N, R] for loss.advantage in TOKEN_ADVANTAGES (whitened over all the batch's
  tokens). The mask is of the samples trained on: with loss.mask_truncated it leaves out
  the truncated ones, after their rewards joined their group's statistics. `ref_logp`: the
  frozen reference's log-probs [rows * N, R], needed by loss.kl_in_reward. `kl_beta`: its
  coefficient as an input (loss.kl_target's, a run state); None: loss.kl_in_reward."""
  n = batch["rewards"].shape[1]
  rewards = sample_scores(batch, cfg)
  mask = batch["sample_mask"].reshape(-1)
  group_ids = jnp.repeat(batch["row_group"], n)
  scaling = dict(std_scaling=cfg.scale_rewards, eps=cfg.std_eps)
  per_token = cfg.advantage in TOKEN_ADVANTAGES or cfg.kl_in_reward > 0
  tokens = token_mask(batch, mask) if per_token else None
  kl = None
  if cfg.kl_in_reward > 0:
    if ref_logp is None:
      raise ValueError("loss.kl_in_reward: the advantages need the frozen reference's "
                       "log-probs (ref_logp), got none")
    kl = reward_kl(batch, ref_logp, tokens, cfg)
  beta = cfg.kl_in_reward if kl_beta is None else kl_beta
  if cfg.advantage == "reinforce_pp":
    token_rewards = adv_lib.token_rewards(rewards, tokens, kl, beta)
    adv = adv_lib.reinforce_pp_advantages(token_rewards, tokens, gamma=cfg.gamma)
    return _without_truncated(adv, mask, batch, cfg)
  if cfg.advantage == "opd":
    return _without_truncated(adv_lib.distillation_advantages(
        batch["behaviour_logp"].reshape(tokens.shape), teacher_logprobs(batch), tokens),
        mask, batch, cfg)
  if cfg.advantage == "gae":  # (the KL penalty above checked; gae_targets applies it)
    adv, _, tokens = gae_targets(batch, cfg, ref_logp, kl_beta)
    return _without_truncated(adv_lib.masked_whiten(adv, tokens) * tokens, mask, batch, cfg)
  if cfg.advantage == "remax" and kl is not None:  # verl's: each token's return less the
    adv = adv_lib.discounted_returns(adv_lib.token_rewards(rewards, tokens, kl, beta), tokens)
    return _without_truncated((adv - _remax_baselines(batch)[:, None]) * tokens, mask, batch,
                              cfg)  # baseline (the KL makes the returns differ by token)
  if kl is not None:  # one number per sample: the sum of its token rewards, as verl's
    rewards = rewards - beta * jnp.sum(kl, axis=-1)
  if cfg.advantage == "reinforce_pp_baseline":
    adv = adv_lib.reinforce_pp_baseline_advantages(rewards, group_ids, num_groups, tokens, mask)
  elif cfg.reward_aggregation == "normalize_then_sum":
    parts, weights = reward_parts(batch, cfg)
    adv = adv_lib.gdpo_advantages(parts, weights, group_ids, num_groups, mask, eps=cfg.std_eps)
  elif cfg.advantage == "grpo":
    adv = adv_lib.grpo_advantages(rewards, group_ids, num_groups, mask, **scaling)
  elif cfg.advantage == "dr_grpo":
    adv = adv_lib.grpo_advantages(rewards, group_ids, num_groups, mask, std_scaling="none")
  elif cfg.advantage == "rloo":
    adv = adv_lib.rloo_advantages(rewards, group_ids, num_groups, mask)
  elif cfg.advantage == "opo":
    trained = jnp.sum(token_mask(batch, mask), axis=-1)  # the tokens whose gradients sum:
    adv = adv_lib.opo_advantages(rewards, trained, group_ids,  # an environment's replies
                                 num_groups, mask)  # have none
  elif cfg.advantage == "passk":
    adv = adv_lib.passk_advantages(rewards, group_ids, num_groups, mask, **scaling)
  elif cfg.advantage == "gpg":
    adv = adv_lib.gpg_advantages(rewards, group_ids, num_groups, mask, eps=cfg.std_eps,
                                 std_scaling=cfg.scale_rewards or "none")
  elif cfg.advantage == "remax":
    adv = adv_lib.remax_advantages(rewards, _remax_baselines(batch), mask)
  else:
    adv, keep = adv_lib.mc_grpo_advantages(rewards, group_ids, num_groups, mask, **scaling)
    mask = mask * keep.astype(mask.dtype)
  return _without_truncated(adv, mask, batch, cfg)


def _remax_baselines(batch: dict) -> jax.Array:
  """[rows * N] each sample's group's greedy sample's reward (ReMax's baseline)."""
  if "baselines" not in batch:
    raise ValueError("loss.advantage: 'remax' needs each group's greedy sample's reward "
                     "(the batch's baselines: workers with worker.greedy_baseline=True)")
  return batch["baselines"].reshape(-1)


def teacher_logprobs(batch: dict) -> jax.Array:
  """[rows * N, R] the teacher's log-probs of the batch's sampled tokens, which the trainer
  adds to the batch (`teacher_logp`, [rows, N, R]) for loss.advantage="opd"."""
  if "teacher_logp" not in batch:
    raise ValueError("loss.advantage: 'opd' needs the teacher's log-probs of the sampled "
                     "tokens (the batch's teacher_logp: set teacher.path)")
  t = batch["teacher_logp"]
  return t.reshape(-1, t.shape[-1])


def teacher_topk(batch: dict) -> tuple[jax.Array, jax.Array]:
  """(ids [rows, N, R, k], log-probs [rows, N, R, k]): the teacher's k most likely next
  tokens at each response position, which the trainer adds to the batch
  (`teacher_topk_ids`, `teacher_topk_logp`) for loss.distill_topk > 0."""
  if "teacher_topk_ids" not in batch:
    raise ValueError("loss.distill_topk: needs the teacher's top tokens at each response "
                     "position (the batch's teacher_topk_ids: set teacher.path)")
  return batch["teacher_topk_ids"], batch["teacher_topk_logp"]


def gae_targets(batch: dict, cfg: LossConfig, ref_logp: jax.Array | None = None,
                kl_beta: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(advantages before whitening, returns, token mask) [rows * N, R] of loss.advantage="gae":
  GAE over the critic's values the batch carries (`values` [rows, N, R]) of the token rewards
  as the other estimators take them (each sample's score on its last token, DAPO's overlong
  punishment, minus the KL-in-reward penalty by `ref_logp` at `kl_beta`, None:
  loss.kl_in_reward); the mask of the tokens its samples drew."""
  if "values" not in batch:
    raise ValueError("loss.advantage: 'gae' needs the critic's values in the batch (the "
                     "trainer's critic adds them), got none")
  tokens = token_mask(batch, batch["sample_mask"].reshape(-1))
  kl = reward_kl(batch, ref_logp, tokens, cfg) if cfg.kl_in_reward > 0 else None
  token_rewards = adv_lib.token_rewards(
      sample_scores(batch, cfg), tokens, kl, cfg.kl_in_reward if kl_beta is None else kl_beta)
  adv, returns = adv_lib.gae(token_rewards, batch["values"].reshape(tokens.shape), tokens,
                             gamma=cfg.gamma, lam=cfg.lam)
  return adv, returns, tokens


def _without_truncated(adv: jax.Array, mask: jax.Array, batch: dict, cfg: LossConfig
                       ) -> tuple[jax.Array, jax.Array]:
  """(adv, mask) with loss.mask_truncated's truncated samples out of the mask."""
  if cfg.mask_truncated:
    mask = mask * (~truncated_samples(batch, cfg)).astype(mask.dtype)
  return adv, mask


def logged_advantages(batch: dict, num_groups: int, cfg: LossConfig
                      ) -> tuple[jax.Array, jax.Array]:
  """(advantages [rows * N], sample mask) the completions log shows, one per sample: those of
  `group_advantages`, a per-token one as its mean over the sample's tokens, loss.kl_in_reward's
  penalty left out (the log runs no reference)."""
  adv, mask = group_advantages(batch, num_groups, dataclasses.replace(
      cfg, kl_in_reward=0.0, kl_target=None, kl_horizon=LossConfig.kl_horizon))
  if adv.ndim == 2:
    tokens = token_mask(batch, mask)
    adv = jnp.sum(adv * tokens, axis=-1) / jnp.maximum(jnp.sum(tokens, axis=-1), 1.0)
  return adv, mask


def reward_parts(batch: dict, cfg: LossConfig) -> tuple[jax.Array, jax.Array]:
  """(parts [rows * N, K], weights [rows * N, K]) for loss.reward_aggregation=
  "normalize_then_sum": the batch's reward parts (NaN where a sample has none) with the
  workers' weights (cfg.reward_parts), and DAPO's overlong punishment as one more part of
  weight 1 (loss.overlong_buffer: TRL's soft overlong punishment reward function)."""
  if "reward_parts" not in batch or not cfg.reward_parts:
    raise ValueError("loss.reward_aggregation: expected 'sum' for a batch without reward "
                     "parts (set worker.reward_terms or worker.reward_model: the parts "
                     "normalize_then_sum normalises apart)")
  k = len(cfg.reward_parts)
  parts = batch["reward_parts"].reshape(-1, batch["reward_parts"].shape[-1])
  if parts.shape[-1] != k:
    raise ValueError(f"loss.reward_parts: expected {parts.shape[-1]} (name, weight) pairs, one "
                     f"per part of the batch, got {k}")
  names = [name for name, _ in cfg.reward_parts]
  weights = jnp.broadcast_to(jnp.asarray([w for _, w in cfg.reward_parts], jnp.float32),
                             parts.shape)
  if "task" in names and "reward_model" in names:  # task reward_model: its score alone, x 1
    task, rm = names.index("task"), names.index("reward_model")
    weights = weights.at[:, rm].set(jnp.where(jnp.isnan(parts[:, task]), 1.0, weights[:, rm]))
  if cfg.overlong_buffer:
    budget = cfg.budget or batch["response_tokens"].shape[-1]
    punish = shaping.soft_overlong_punishment(batch["response_lens"].reshape(-1), budget,
                                              min(cfg.overlong_buffer, budget))
    parts = jnp.concatenate([parts, punish[:, None].astype(parts.dtype)], axis=1)
    weights = jnp.concatenate([weights, jnp.ones_like(weights[:, :1])], axis=1)
  return parts, weights


def router_agreement(picked: jax.Array, replayed: jax.Array) -> jax.Array:
  """The share of the replayed experts [M, B, L, k] (-1: none) that the routers' own top-k
  picks [M, B, L, k] hold too: 1 where the trainer routes as the workers' sampler did."""
  replayed = replayed.astype(jnp.int32)
  hit = functools.reduce(jnp.logical_or, [replayed == picked[..., j:j + 1]
                                          for j in range(picked.shape[-1])])
  have = replayed >= 0
  return jnp.sum(hit & have) / jnp.maximum(jnp.sum(have), 1)


def response_logprobs(params: Any, graphdef: nnx.GraphDef, batch: dict, backend: str = "auto",
                      *, with_stats: bool = False, logits_chunk: int = 0,
                      remat: bool = False, targets: jax.Array | None = None,
                      temperature: float = 1.0):
  """log p(response token) [rows * N, R] under `params`, one packed row per group. A batch
  with routes (routing replay: `prompt_routes`, `response_routes`) sends each token to the
  experts the workers' sampler did. `with_stats`: also a dict of the policy's `entropy` at
  each of those positions and, for a mixture of experts, the `routing` (the model's
  `Routing` record: the load-balancing loss's parts over the packed rows' tokens) and,
  replaying, the `router_agreement`; with `targets` [rows, N, R, k] (with_stats), the
  `target_logp` [rows * N, R, k] of those ids at each response position. `temperature`:
  of softmax(logits / temperature) (LossConfig.temperature)."""
  tokens, layout = pack_group(batch["prompt_tokens"], batch["prompt_lens"],
                              batch["response_tokens"], batch["response_lens"])
  routes = (pack_routes(batch["prompt_routes"], batch["response_routes"])
            if "prompt_routes" in batch else None)
  model = nnx.merge(graphdef, params)
  out = packed_response_logprobs(model, tokens, batch["response_tokens"], layout,
                                 backend=backend, with_entropy=with_stats,
                                 logits_chunk=logits_chunk, remat=remat, routes=routes,
                                 record_routes=with_stats and bool(model.config.moe_layers),
                                 targets=targets if with_stats else None,
                                 temperature=temperature)
  rows = lambda x: x.reshape(-1, x.shape[-1])
  if not with_stats:
    return rows(out)
  logp, entropy, *routing = out
  stats = {"entropy": rows(entropy)}
  if targets is not None:
    target_logp, *routing = routing
    stats["target_logp"] = target_logp.reshape(-1, *target_logp.shape[2:])
  if routing:
    stats["routing"] = routing[0]
  if routes is not None:
    stats["router_agreement"] = router_agreement(routing[0].picks, routes)
  return rows(logp), stats


def token_mask(batch: dict, sample_mask: jax.Array) -> jax.Array:
  """[rows * N, R]: 1 on the real tokens of kept samples that the policy drew."""
  r = batch["response_tokens"].shape[-1]
  lens = batch["response_lens"].reshape(-1)
  mask = (jnp.arange(r)[None, :] < lens[:, None]).astype(jnp.float32) * sample_mask[:, None]
  if "policy_tokens" in batch:  # multi-turn: an environment's replies are not trained on
    mask = mask * batch["policy_tokens"].reshape(-1, r)
  return mask


def reference_logprobs(ref_params: Any, graphdef: nnx.GraphDef, batch: dict, cfg: LossConfig,
                       micro_batches: int = 1) -> jax.Array:
  """The frozen reference's log-probs [rows * N, R] of a batch's responses (no gradient),
  `micro_batches` slices of its rows at a time (a slice's activations), in row order."""
  if micro_batches == 1:
    return jax.lax.stop_gradient(response_logprobs(ref_params, graphdef, batch, cfg.backend,
                                                   logits_chunk=cfg.logits_chunk,
                                                   temperature=cfg.temperature))
  rows, n = batch["row_group"].shape[0], batch["rewards"].shape[1]
  check_micro_batches(micro_batches, rows, cfg)  # (before a KL or PPO step's loss checks it)
  slices = jax.tree.map(  # [rows, ...] -> [M, rows / M, ...]: slice m holds rows m, m + M, ...
      lambda x: jnp.moveaxis(x.reshape(rows // micro_batches, micro_batches, *x.shape[1:]),
                             1, 0), batch)
  ref = jax.lax.map(lambda sub: response_logprobs(ref_params, graphdef, sub, cfg.backend,
                                                  logits_chunk=cfg.logits_chunk,
                                                  temperature=cfg.temperature), slices)
  return jax.lax.stop_gradient(jnp.moveaxis(
      ref.reshape(micro_batches, rows // micro_batches, n, -1), 0, 1).reshape(rows * n, -1))


def rl_loss(params: Any, graphdef: nnx.GraphDef, batch: dict, ref_params: Any, *,
            num_groups: int, cfg: LossConfig, proximal: jax.Array | None = None,
            advantages: tuple[jax.Array, jax.Array] | None = None,
            entropy_coef: jax.Array | None = None, kl_beta: jax.Array | None = None,
            ref_logp: jax.Array | None = None, noise: jax.Array | None = None
            ) -> tuple[jax.Array, dict]:
  """(scalar loss, metrics) of one packed batch; differentiable in `params`. `proximal`:
  the log-probs [rows * N, R] of the weights the batch's updates started from (several
  updates per batch); None: the current ones (one update per batch). `advantages`: the
  (advantages, sample mask) of these rows when computed over a larger batch.
  `entropy_coef`: the entropy bonus's coefficient as an input (loss.adaptive_entropy's, a
  run state); None: loss.entropy_coef. `kl_beta`: as `group_advantages`'. `ref_logp`,
  `noise`: as `rl_loss_terms`'."""
  loss, metrics, routing = rl_loss_terms(params, graphdef, batch, ref_params,
                                         num_groups=num_groups, cfg=cfg, proximal=proximal,
                                         advantages=advantages, entropy_coef=entropy_coef,
                                         kl_beta=kl_beta, ref_logp=ref_logp, noise=noise)
  if cfg.router_aux_coef > 0 and routing is not None:  # MoE load balancing, as transformers'
    loss = loss + cfg.router_aux_coef * routing.load_balance
  metrics["loss"] = loss  # the objective optimized, load-balancing term included
  return loss, metrics


def rl_loss_terms(params: Any, graphdef: nnx.GraphDef, batch: dict, ref_params: Any, *,
                  num_groups: int, cfg: LossConfig, proximal: jax.Array | None = None,
                  advantages: tuple[jax.Array, jax.Array] | None = None,
                  entropy_threshold: jax.Array | None = None,
                  entropy_coef: jax.Array | None = None,
                  ref_logp: jax.Array | None = None,
                  kl_beta: jax.Array | None = None,
                  cov_stats: tuple | None = None,
                  noise: jax.Array | None = None) -> tuple[jax.Array, dict, Any]:
  """`rl_loss` before its load-balancing term: (the policy loss, the metrics, the model's
  `Routing` record or None for a dense model). `entropy_threshold`: the entropy the top
  tokens reach (loss.top_entropy_quantile) over a larger batch these rows are a slice of;
  None: over these rows. `entropy_coef`: as `rl_loss`'s. `ref_logp`: the reference's
  log-probs of these rows when computed already; None: computed here if needed. `kl_beta`:
  as `group_advantages`' (with `advantages` given: unused). `cov_stats`: KL-Cov's or
  Clip-Cov's selection (losses.covariance_stats, losses.clip_cov_stats) over a larger batch;
  None: over these rows. `noise`: Clip-Cov's uniform draws [rows * N, R]
  (loss.policy_loss="clip_cov")."""
  if cfg.policy_loss == "clip_cov" and noise is None:
    raise ValueError("loss.policy_loss: 'clip_cov' draws the tokens it drops: give the loss "
                     "its uniform draws (noise), as make_rl_step does")
  if ref_logp is None and needs_reference(cfg):
    ref_logp = reference_logprobs(ref_params, graphdef, batch, cfg)
  if ref_logp is not None:
    ref_logp = jax.lax.stop_gradient(ref_logp)
  adv, sample_mask = (group_advantages(batch, num_groups, cfg, ref_logp, kl_beta)
                      if advantages is None else advantages)
  mask = token_mask(batch, sample_mask)
  logp, stats = response_logprobs(params, graphdef, batch, cfg.backend, with_stats=True,
                                  logits_chunk=cfg.logits_chunk, remat=cfg.remat,
                                  targets=teacher_topk(batch)[0] if cfg.distill_topk else None,
                                  temperature=cfg.temperature)
  entropy = stats.pop("entropy")
  student_topk = stats.pop("target_logp", None)
  routing = stats.pop("routing", None)
  if routing is not None:
    stats["router_aux_loss"] = routing.load_balance
  behaviour = batch["behaviour_logp"].reshape(logp.shape)
  proximal = jax.lax.stop_gradient(logp if proximal is None else proximal)
  norm = cfg.budget or None  # seq-mean-token-sum-norm: the budget, not the packed length
  common = dict(agg=cfg.agg, norm_const=norm,
                ref_logp=ref_logp if cfg.kl_coef > 0 else None, kl_coef=cfg.kl_coef,
                kl_estimator=cfg.kl_estimator, kl_bias_correction=cfg.kl_bias_correction)
  if cfg.policy_loss not in UNCLIPPED:
    common.update(clip_low=cfg.clip_low, clip_high=cfg.clip_high)
  policy_loss = {"ppo": functools.partial(losses.ppo_clip_loss, dual_clip=cfg.dual_clip),
                 "gspo": losses.gspo_loss,
                 "cispo": losses.cispo_loss,
                 "geo_mean": losses.geo_mean_loss,
                 "clip_cov": functools.partial(
                     losses.clip_cov_loss, noise=noise, cov_stats=cov_stats,
                     **clip_cov_settings(cfg)),
                 "kl_cov": functools.partial(losses.kl_cov_loss, kl_cov_ratio=cfg.kl_cov_ratio,
                                             kl_cov_coef=cfg.kl_cov_coef,
                                             cov_stats=cov_stats),
                 "sapo": functools.partial(losses.sapo_loss, tau_pos=cfg.sapo_tau_pos,
                                           tau_neg=cfg.sapo_tau_neg),
                 "pg": losses.pg_loss}[cfg.policy_loss]
  trained = mask  # the tokens that get policy loss
  if cfg.top_entropy_quantile < 1:  # the others weigh 0 and still count in its mean
    if entropy_threshold is None:
      entropy_threshold = losses.entropy_threshold(entropy, mask, cfg.top_entropy_quantile)
    trained = losses.high_entropy_tokens(entropy, mask, entropy_threshold)
  off_policy = {}
  if cfg.off_policy_mask:  # the policy loss only: the KL term keeps every token, as TRL's
    kept, dropped = corrections.off_policy_sequence_mask(logp, behaviour, adv, mask,
                                                         threshold=cfg.off_policy_mask)
    trained = trained * kept
    off_policy["off_policy_masked_frac"] = jnp.sum(dropped) / jnp.maximum(
        jnp.sum(jnp.sum(mask, axis=-1) > 0), 1.0)

  def selected(weights):  # the correction's token weights (None: 1) on the trained tokens
    if trained is mask:
      return weights
    return trained if weights is None else weights * trained

  if cfg.correction == "none":
    loss, metrics = policy_loss(logp, behaviour, adv, mask, token_weights=selected(None),
                                **common)
  elif cfg.correction == "tis":
    weights = corrections.truncated_importance_weights(proximal, behaviour, mask,
                                                       level=cfg.is_level, cap=cfg.tis_cap)
    loss, metrics = policy_loss(logp, proximal, adv, mask, token_weights=selected(weights),
                                **common)
    metrics["tis_weight_mean"] = jnp.sum(weights) / jnp.maximum(jnp.sum(mask), 1.0)
  elif cfg.correction == "mis":  # dropped tokens weigh 0 and still count in the mean
    weights, kept = corrections.masked_importance_weights(
        proximal, behaviour, mask, level=cfg.is_level, low=cfg.mis_low, high=cfg.mis_high)
    loss, metrics = policy_loss(logp, proximal, adv, mask, token_weights=selected(weights),
                                **common)
    metrics["mis_masked_frac"] = 1.0 - jnp.sum(kept) / jnp.maximum(jnp.sum(mask), 1.0)
  elif cfg.correction == "m2po":
    loss, metrics = corrections.m2po_loss(logp, proximal, behaviour, adv, mask,
                                          threshold=cfg.m2po_threshold, agg=cfg.agg,
                                          norm_const=norm, token_weights=selected(None))
  else:
    loss, metrics = corrections.decoupled_ppo_loss(logp, proximal, behaviour, adv, mask,
                                                   behaviour_cap=cfg.behaviour_cap,
                                                   dual_clip=cfg.dual_clip,
                                                   token_weights=selected(None), **common)
  if cfg.distill_topk:  # forward KL from the teacher's top k (renormalised) to the policy
    teacher = jax.nn.log_softmax(teacher_topk(batch)[1].reshape(student_topk.shape), axis=-1)
    distill = jnp.sum(jnp.exp(teacher) * (teacher - student_topk), axis=-1)
    distill_loss = losses.aggregate(distill, mask, cfg.agg, norm)
    loss = loss + cfg.distill_coef * distill_loss
    metrics["distill_kl"] = distill_loss
  if entropy_coef is not None or cfg.entropy_coef > 0:  # with its gradient: verl's entropy_coeff
    coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
    loss = loss - coef * losses.aggregate(entropy, mask, cfg.agg, norm)
  if cfg.agg == "seq-mean-token-sum-norm":  # Dr. GRPO's "B" is the samples (TRL's batch),
    # not the packed slots: empty ones (unequal groups, rows past the groups) would scale
    # the loss, and its parts, by how the batch was packed
    slots = mask.shape[0] / real_samples(batch)
    loss = loss * slots
    metrics.update({k: v * slots for k, v in metrics.items() if metric_kind(k, cfg) == "agg"})
  # pi_prox / pi_behav per token: how far the workers' policy is from the trainer's.
  n_tok = jnp.maximum(jnp.sum(mask), 1.0)
  iw = jnp.exp(jnp.where(mask > 0, proximal - behaviour, 0.0))
  big = jnp.float32(3.0e38)
  metrics.update(
      iw_mean=jnp.sum(iw * mask) / n_tok,
      iw_max=jnp.max(jnp.where(mask > 0, iw, -big)),
      iw_min=jnp.min(jnp.where(mask > 0, iw, big)),
      behaviour_kl=jnp.sum((behaviour - proximal) * mask) / n_tok,
      advantage_abs_mean=jnp.sum(_sample_abs_advantages(adv, mask) * sample_mask)
      / jnp.maximum(jnp.sum(sample_mask), 1.0),
      response_tokens=jnp.sum(mask),
      entropy=jnp.sum(jax.lax.stop_gradient(entropy) * mask) / n_tok,  # of the trainer's policy
      # with policy loss (top_entropy_quantile, off_policy_mask)
      trained_token_frac=jnp.sum(trained) / n_tok,
      **off_policy,
      **stats,
  )
  if cfg.kl_in_reward > 0 and advantages is None:  # a slice's: the whole batch's is taken
    metrics["reward_kl"] = reward_kl_mean(batch, ref_logp, sample_mask, cfg)
  if cfg.advantage == "opd":  # log pi_sampled - log pi_teacher: the reverse KL distilled away
    metrics["teacher_kl"] = jnp.sum((behaviour - teacher_logprobs(batch)) * mask) / n_tok
  return loss, metrics, routing


def _sample_abs_advantages(adv: jax.Array, mask: jax.Array) -> jax.Array:
  """[B] |advantage| of each sample: a per-token one's mean over its `mask`ed tokens."""
  if adv.ndim == 1:
    return jnp.abs(adv)
  return jnp.sum(jnp.abs(adv) * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def real_samples(batch: dict) -> jax.Array:
  """The batch's samples (sample_mask; truncated ones too, as TRL's batch holds them), at
  least 1: what Dr. GRPO's constant normaliser counts."""
  return jnp.maximum(jnp.sum(batch["sample_mask"].astype(jnp.float32)), 1.0)


def metric_counts(batch: dict, sample_mask: jax.Array, agg: str) -> dict[str, jax.Array]:
  """What the metrics of `rl_loss` on these rows are means over (`metric_kind`): "agg"
  what the aggregation divides by, "tokens" real tokens, "sequences" samples with tokens,
  "samples" kept samples, "routes" the replayed expert slots (routing replay)."""
  mask = token_mask(batch, sample_mask)
  sequences = jnp.sum((jnp.sum(mask, axis=-1) > 0).astype(jnp.float32))
  counts = {"tokens": jnp.sum(mask), "sequences": sequences,
            "samples": jnp.sum(sample_mask.astype(jnp.float32))}
  counts["agg"] = {"token-mean": counts["tokens"],
                   "seq-mean-token-sum-norm": real_samples(batch)}.get(agg, sequences)
  if "prompt_routes" in batch:
    routes = pack_routes(batch["prompt_routes"], batch["response_routes"])
    counts["routes"] = jnp.sum((routes >= 0).astype(jnp.float32))
  return counts


def metric_kind(name: str, cfg: LossConfig) -> str:
  """How metric `name` of `rl_loss` combines over slices of a batch: "max", "min", "sum",
  or the key of `metric_counts` its mean is over. The loss's parts follow the aggregation;
  GSPO's clip fractions are over sequences. (The MoE load-balancing loss, a product of two
  token means, is none of these: it is formed from its parts summed over the slices.)"""
  if name.endswith("_max") or name.endswith("_min"):
    return name[-3:]
  if name == "response_tokens":
    return "sum"
  if name in ("loss", "pg_loss", "kl_ref", "distill_kl"):
    return "agg"
  if name == "advantage_abs_mean":
    return "samples"
  if name == "router_agreement":
    return "routes"
  if cfg.policy_loss == "gspo" and name.startswith("clip_frac"):
    return "sequences"
  if name == "off_policy_masked_frac":
    return "sequences"
  return "tokens"


def check_micro_batches(micro_batches: int, rows: int, cfg: LossConfig) -> None:
  """ValueError naming rl.micro_batches unless slicing `rows` that many ways is exact."""
  if micro_batches < 1 or rows % micro_batches:
    raise ValueError(f"rl.micro_batches: expected a divisor of the batch's {rows} rows "
                     f"(rl.groups_per_step times a power of two), got {micro_batches}")
  if cfg.correction == "m2po" and micro_batches > 1:
    raise ValueError("rl.micro_batches: expected 1 with loss.correction='m2po' (its token "
                     "mask is a statistic of the whole batch)")


def ref_sync_settings(rl, cfg: LossConfig, lora_rank: int = 0) -> tuple[int, float]:
  """(rl.ref_sync_steps, rl.ref_mixup_alpha), checked: TRL's sync_ref_model (TR-DPO), every
  that many steps the frozen reference becomes alpha * policy + (1 - alpha) * reference; 0
  steps: never. ValueError naming the field."""
  steps, alpha = rl.get("ref_sync_steps", 0), rl.get("ref_mixup_alpha", 0.6)
  if not (isinstance(steps, numbers.Integral) and not isinstance(steps, bool) and steps >= 0):
    raise ValueError(f"rl.ref_sync_steps: expected a whole number of steps >= 0 (0: never), "
                     f"got {steps!r}")
  if not (_is_number(alpha) and 0 < alpha <= 1):
    raise ValueError(f"rl.ref_mixup_alpha: expected the policy's share in (0, 1], got {alpha!r}")
  if steps and not needs_reference(cfg):
    raise ValueError(f"rl.ref_sync_steps: expected 0 with loss.kl_coef={cfg.kl_coef} and "
                     f"loss.kl_in_reward={cfg.kl_in_reward} (no KL term: no reference to "
                     f"sync), got {steps}")
  if steps and lora_rank:
    raise ValueError(f"rl.ref_sync_steps: expected 0 with model.lora_rank={lora_rank} (the "
                     f"adapters mixed apart do not mix the models; TRL refuses PEFT too), got "
                     f"{steps}")
  return int(steps), float(alpha)


def clip_cov_settings(cfg: LossConfig) -> dict:
  """losses.clip_cov_loss's and clip_cov_stats' keyword settings from the loss config."""
  return dict(clip_low=cfg.clip_low, clip_high=cfg.clip_high,
              clip_cov_ratio=cfg.clip_cov_ratio, clip_cov_lb=cfg.clip_cov_lb,
              clip_cov_ub=cfg.clip_cov_ub)


def whole_batch_stats(params: Any, graphdef: nnx.GraphDef, slices: dict, keep: jax.Array,
                      adv: jax.Array, cfg: LossConfig, proximal: jax.Array | None = None,
                      noise: jax.Array | None = None) -> dict:
  """What each slice's loss needs of the whole batch before any slice's backward pass, by a
  forward pass of every slice (`slices`: a batch's rows as [slices, rows / slices, ...];
  `keep`: their sample masks [slices, rows / slices * N]; `adv`: their advantages [slices,
  rows / slices * N(, R)]), as constants. With loss.router_aux_coef > 0 and a mixture of
  experts, "routed": the routed token counts [k, E] and token count (`Routing`), the
  load-balancing loss's token shares; with loss.top_entropy_quantile < 1,
  "entropy_threshold": the entropy the batch's top tokens reach; with
  loss.policy_loss="kl_cov" or "clip_cov", "cov_stats": its selection of the batch's tokens
  (losses.covariance_stats, losses.clip_cov_stats; Clip-Cov's from its draws `noise` and,
  with a correction, the `proximal` log-probs, the slices' own where None). Both
  [slices, rows / slices * N, R]. Only what is asked for is live (routes alone: the layers
  up to the last router)."""
  def one(args):
    sub, k, a, prox, draws = args
    logp, stats = response_logprobs(params, graphdef, sub, cfg.backend, with_stats=True,
                                    logits_chunk=cfg.logits_chunk,
                                    temperature=cfg.temperature)
    out = {}
    if cfg.router_aux_coef > 0 and "routing" in stats:
      out["routed"] = (stats["routing"].counts, stats["routing"].tokens)
    if cfg.top_entropy_quantile < 1:
      out["entropy"] = (stats["entropy"], token_mask(sub, k))
    if cfg.policy_loss in ("kl_cov", "clip_cov"):
      per_token = a if a.ndim == 2 else jnp.broadcast_to(a[:, None], logp.shape)
      out["cov"] = (logp, per_token, token_mask(sub, k))
    if cfg.policy_loss == "clip_cov":  # the old log-probs the loss takes its ratio against
      old = (sub["behaviour_logp"].reshape(logp.shape) if cfg.correction == "none"
             else logp if prox is None else prox)
      out["cov"] += (old, draws)
    return out

  out = jax.lax.stop_gradient(jax.lax.map(one, (slices, keep, adv, proximal, noise)))
  if "cov" in out:
    logp, a, mask, *clip_cov = (x.reshape(-1, x.shape[-1]) for x in out.pop("cov"))
    out["cov_stats"] = (losses.covariance_stats(logp, a, mask, cfg.kl_cov_ratio)
                        if cfg.policy_loss == "kl_cov" else
                        losses.clip_cov_stats(logp, clip_cov[0], a, mask, clip_cov[1],
                                              **clip_cov_settings(cfg)))
  if "routed" in out:
    out["routed"] = jax.tree.map(lambda x: jnp.sum(x, axis=0), out["routed"])
  if "entropy" in out:
    entropy, mask = (x.reshape(-1, x.shape[-1]) for x in out.pop("entropy"))
    out["entropy_threshold"] = losses.entropy_threshold(entropy, mask,
                                                        cfg.top_entropy_quantile)
  return out


def micro_batched_loss_and_grad(params: Any, graphdef: nnx.GraphDef, batch: dict,
                                ref_params: Any, *, num_groups: int, cfg: LossConfig,
                                micro_batches: int, proximal: jax.Array | None = None,
                                entropy_coef: jax.Array | None = None,
                                kl_beta: jax.Array | None = None,
                                ref_logp: jax.Array | None = None,
                                noise: jax.Array | None = None
                                ) -> tuple[tuple[jax.Array, dict], Any]:
  """((loss, metrics), gradient) of the whole batch, accumulated over `micro_batches`
  slices of its rows so that only one slice's activations live at a time. Advantages are
  taken over the whole batch first and each slice's loss is weighted by its share of the
  aggregation's count, so the result is the whole batch's loss and gradient (summed in
  float32, returned in the params' dtype). Each metric is weighted by the slice's share of
  what it is a mean over (`metric_kind`), so it is the whole batch's too.

  A mixture of experts' load-balancing loss is E * sum_e f_e P_e over the whole batch's
  tokens (f: the routed shares, constants; P: the mean router probabilities). Its parts
  are summed over the slices and the loss formed from the totals. With
  loss.router_aux_coef > 0 a forward pass of every slice first counts f
  (`whole_batch_stats`), so that each slice adds E * sum_e f_e * (its part of P_e) to the
  objective: these add up to the whole batch's term, value and gradient. The same pass
  finds the entropy that the whole batch's top tokens reach (loss.top_entropy_quantile),
  KL-Cov's most covarying tokens and the tokens Clip-Cov drops, so that every slice trains
  on the tokens the whole batch would. With loss.kl_in_reward > 0
  the reference's log-probs of every slice come first (the advantages need the whole
  batch's), and each slice's KL term reuses its own. `entropy_coef`, `kl_beta`, `ref_logp`
  [rows * N, R], `noise` [rows * N, R]: as `rl_loss`'s."""
  rows = batch["row_group"].shape[0]
  check_micro_batches(micro_batches, rows, cfg)
  trainable = split_trainable(params)[0]  # what takes a gradient (a LoRA run: the adapters)
  n = batch["rewards"].shape[1]

  def split(x):  # [rows, ...] -> [M, rows / M, ...]: slice m holds rows m, m + M, ...
    return jnp.moveaxis(x.reshape(rows // micro_batches, micro_batches, *x.shape[1:]), 1, 0)

  if ref_logp is None and cfg.kl_in_reward > 0:
    ref_logp = reference_logprobs(ref_params, graphdef, batch, cfg, micro_batches)
  adv, sample_mask = group_advantages(batch, num_groups, cfg, ref_logp, kl_beta)
  totals = {k: jnp.maximum(v, 1.0)
            for k, v in metric_counts(batch, sample_mask, cfg.agg).items()}
  per_row = dict(batch, adv=adv.reshape(rows, n, *adv.shape[1:]),
                 keep=sample_mask.reshape(rows, n))
  if proximal is not None:
    per_row["proximal"] = proximal.reshape(rows, n, -1)
  if ref_logp is not None:
    per_row["ref_logp"] = ref_logp.reshape(rows, n, -1)
  if noise is not None:
    per_row["noise"] = noise.reshape(rows, n, -1)
  own = ("adv", "keep", "proximal", "ref_logp", "noise")

  def rows_of(mb):  # a slice's batch rows
    return {k: v for k, v in mb.items() if k not in own}

  def flat(x):  # [..., rows / M, N, R] -> [..., rows / M * N, R]
    return None if x is None else x.reshape(*x.shape[:-3], -1, x.shape[-1])

  slices = jax.tree.map(split, per_row)
  stats = {}
  if (cfg.router_aux_coef > 0 or cfg.top_entropy_quantile < 1
      or cfg.policy_loss in ("kl_cov", "clip_cov")):
    stats = whole_batch_stats(params, graphdef, rows_of(slices),
                              slices["keep"].reshape(micro_batches, -1),
                              slices["adv"].reshape(micro_batches, -1, *adv.shape[1:]), cfg,
                              proximal=flat(slices.get("proximal")),
                              noise=flat(slices.get("noise")))
  whole = stats.get("routed")

  def one(mb):
    sub = rows_of(mb)
    keep = mb["keep"].reshape(-1)
    shares = {k: v / totals[k] for k, v in metric_counts(sub, keep, cfg.agg).items()}
    prox, ref = flat(mb.get("proximal")), flat(mb.get("ref_logp"))
    slice_adv = mb["adv"].reshape(keep.shape[0], *adv.shape[1:])

    def weighted(p):
      loss, metrics, routing = rl_loss_terms(p, graphdef, sub, ref_params,
                                             num_groups=num_groups, cfg=cfg, proximal=prox,
                                             advantages=(slice_adv, keep),
                                             entropy_threshold=stats.get("entropy_threshold"),
                                             entropy_coef=entropy_coef, ref_logp=ref,
                                             cov_stats=stats.get("cov_stats"),
                                             noise=flat(mb.get("noise")))
      loss, parts = loss * shares["agg"], None
      if routing is not None:  # the load-balancing loss: from the slices' summed parts
        del metrics["router_aux_loss"]
        parts = (routing.counts, routing.prob_sums, routing.tokens)
        if whole is not None:  # this slice's part of the whole batch's term
          loss = loss + cfg.router_aux_coef * load_balancing_loss(
              whole[0], routing.prob_sums, whole[1])
      return loss, (metrics, parts)

    (loss, (metrics, parts)), grads = trainable_value_and_grad(weighted)(params)
    return loss, metrics, parts, grads, shares

  def merge(kind, acc, value, shares):
    if kind == "max":
      return jnp.maximum(acc, value)
    if kind == "min":
      return jnp.minimum(acc, value)
    return acc + (value if kind == "sum" else shares[kind] * value)

  def body(acc, mb):
    loss, metrics, parts, grads, shares = one(mb)
    a_loss, a_metrics, a_parts, a_grads = acc
    merged = {k: merge(metric_kind(k, cfg), a_metrics[k], v, shares) for k, v in metrics.items()}
    return (a_loss + loss, merged, jax.tree.map(jnp.add, a_parts, parts),
            jax.tree.map(lambda a, g: a + g.astype(jnp.float32), a_grads, grads)), None

  _, shapes, part_shapes, _, _ = jax.eval_shape(one, jax.tree.map(lambda x: x[0], slices))
  start = {"max": -jnp.inf, "min": jnp.inf}
  init = (jnp.zeros((), jnp.float32),
          {k: jnp.full(v.shape, start.get(metric_kind(k, cfg), 0.0), v.dtype)
           for k, v in shapes.items()},
          jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), part_shapes),
          jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable))  # sums in f32
  (loss, metrics, parts, grads), _ = jax.lax.scan(body, init, slices)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable)
  metrics["loss"] = loss
  if ref_logp is not None:
    metrics["reward_kl"] = reward_kl_mean(batch, ref_logp, sample_mask, cfg)
  if parts is not None:
    counts, prob_sums, tokens = parts
    if whole is not None:  # the shares the loss used
      counts, tokens = whole
    metrics["router_aux_loss"] = load_balancing_loss(counts, prob_sums, tokens)
  return (loss, metrics), grads
