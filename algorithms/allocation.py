"""Rollout allocation: how many samples each prompt gets (fixed N, VIGOR) and DAPO dynamic
sampling (which groups to keep, how many more to draw).

An allocator is a stateless policy; its progress lives in a small state value, and
planning is a pure function of it (a round planned again from the same state asks for the
same samples). The protocol, for a batch of prompts:

    state = allocator.start(num_prompts, budget)
    while not state.done:
      counts = allocator.requests(state)          # new samples per prompt this round
      rewards = [sample(prompt_i, counts[i]) ...] # one array per prompt, len counts[i]
      state = allocator.observe(state, rewards)

Budget-exact: the counts over all rounds sum to `budget`, never more. Numpy only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, Sequence

import numpy as np


class Allocator(Protocol):
  """A rollout allocation policy over a batch of prompts (see the module docstring)."""

  def start(self, num_prompts: int, budget: int | None = None) -> "AllocationState": ...

  def requests(self, state: "AllocationState") -> np.ndarray: ...

  def observe(self, state: "AllocationState",
              rewards: Sequence[np.ndarray]) -> "AllocationState": ...


@dataclasses.dataclass
class AllocationState:
  """Progress of one batch: samples and reward sums per prompt, round, and the active set."""

  budget: int
  round: int
  num_rounds: int
  counts: np.ndarray  # [P] int: samples observed so far
  sums: np.ndarray  # [P] float: sum of rewards
  sumsq: np.ndarray  # [P] float: sum of squared rewards
  active: np.ndarray  # [P] bool: prompts still eligible for new samples

  @property
  def num_prompts(self) -> int:
    return int(self.counts.shape[0])

  @property
  def spent(self) -> int:
    return int(self.counts.sum())

  @property
  def remaining(self) -> int:
    return self.budget - self.spent

  @property
  def done(self) -> bool:
    return self.round >= self.num_rounds

  def variances(self) -> np.ndarray:
    """Unbiased reward variance per prompt over all its samples (0 below two samples)."""
    n = self.counts.astype(np.float64)
    mean = self.sums / np.maximum(n, 1.0)
    var = (self.sumsq - n * mean * mean) / np.maximum(n - 1.0, 1.0)
    return np.where(n > 1, np.maximum(var, 0.0), 0.0)


def _new_state(num_prompts: int, budget: int, num_rounds: int) -> AllocationState:
  if not isinstance(num_prompts, (int, np.integer)) or num_prompts < 1:
    raise ValueError(f"num_prompts: expected an int >= 1, got {num_prompts!r}")
  return AllocationState(budget=int(budget), round=0, num_rounds=num_rounds,
                         counts=np.zeros(num_prompts, np.int64),
                         sums=np.zeros(num_prompts, np.float64),
                         sumsq=np.zeros(num_prompts, np.float64),
                         active=np.ones(num_prompts, bool))


def _record(state: AllocationState, requested: np.ndarray,
            rewards: Sequence[np.ndarray]) -> AllocationState:
  """Add one round's rewards, checking each prompt got exactly what was requested."""
  if state.done:
    raise ValueError(f"observe: all {state.num_rounds} rounds are done; nothing was requested")
  if len(rewards) != state.num_prompts:
    raise ValueError(f"rewards: expected one array per prompt ({state.num_prompts}), got "
                     f"{len(rewards)}")
  counts, sums, sumsq = state.counts.copy(), state.sums.copy(), state.sumsq.copy()
  for i, r in enumerate(rewards):
    r = np.asarray(r, np.float64).reshape(-1)
    if r.shape[0] != requested[i]:
      raise ValueError(f"rewards[{i}]: expected {requested[i]} rewards (requested this round "
                       f"{state.round}), got {r.shape[0]}")
    if not np.all(np.isfinite(r)):
      raise ValueError(f"rewards[{i}]: expected finite values, got {r.tolist()}")
    counts[i] += r.shape[0]
    sums[i] += r.sum()
    sumsq[i] += (r * r).sum()
  return dataclasses.replace(state, round=state.round + 1, counts=counts, sums=sums,
                             sumsq=sumsq)


@dataclasses.dataclass(frozen=True)
class FixedAllocator:
  """GRPO: n samples for every prompt, in one round; budget must be n * num_prompts."""

  n: int = 8

  def __post_init__(self):
    if not isinstance(self.n, int) or self.n < 1:
      raise ValueError(f"FixedAllocator.n: expected an int >= 1, got {self.n!r}")

  def start(self, num_prompts: int, budget: int | None = None) -> AllocationState:
    expected = self.n * int(num_prompts)
    if budget is not None and budget != expected:
      raise ValueError(f"budget: fixed N={self.n} over {num_prompts} prompts spends exactly "
                       f"{expected}, got {budget}")
    return _new_state(num_prompts, expected, num_rounds=1)

  def requests(self, state: AllocationState) -> np.ndarray:
    if state.done:
      return np.zeros(state.num_prompts, np.int64)
    return np.full(state.num_prompts, self.n, np.int64)

  def observe(self, state: AllocationState, rewards: Sequence[np.ndarray]) -> AllocationState:
    return _record(state, self.requests(state), rewards)


@dataclasses.dataclass(frozen=True)
class VigorAllocator:
  """VIGOR: m0 samples per prompt, then rounds that keep the top `alpha` fraction of the
  still-active prompts by reward variance (over all their samples so far) and give each
  `gamma` times more new samples than the round before, until the budget is spent.

  Round t >= 1 plans k_t = ceil(alpha * k_{t-1}) prompts x m0 * gamma^t samples (k_0 =
  num_prompts); the last round spends whatever budget remains, so the total is exactly
  the budget (default: the schedule's own total, 8 per prompt for m0=2, rounds=4,
  alpha=0.5, gamma=2). A round's samples are k_t equal shares: one to each active prompt
  whose variance is above the k_t-th highest, and the shares left split evenly among
  the prompts tied at that value (all of them stay active); integer leftovers go to the
  prompts with the fewest samples, then highest variance, then lowest index. So when
  all variances are equal every prompt gets budget / num_prompts: fixed N.
  """

  m0: int = 2
  rounds: int = 4
  alpha: float = 0.5
  gamma: float = 2.0

  def __post_init__(self):
    if not isinstance(self.m0, int) or self.m0 < 1:
      raise ValueError(f"VigorAllocator.m0: expected an int >= 1, got {self.m0!r}")
    if not isinstance(self.rounds, int) or self.rounds < 1:
      raise ValueError(f"VigorAllocator.rounds: expected an int >= 1, got {self.rounds!r}")
    if not 0.0 < self.alpha <= 1.0:
      raise ValueError(f"VigorAllocator.alpha: expected a fraction in (0, 1], got "
                       f"{self.alpha!r}")
    if not self.gamma >= 1.0:
      raise ValueError(f"VigorAllocator.gamma: expected >= 1, got {self.gamma!r}")

  def _kept(self, num_prompts: int, t: int) -> int:
    k = num_prompts
    for _ in range(t):
      k = max(1, math.ceil(self.alpha * k - 1e-9))
    return k

  def _per_prompt(self, t: int) -> int:
    return max(1, int(round(self.m0 * self.gamma**t)))

  def default_budget(self, num_prompts: int) -> int:
    return sum(self._kept(num_prompts, t) * self._per_prompt(t) for t in range(self.rounds))

  def start(self, num_prompts: int, budget: int | None = None) -> AllocationState:
    if budget is None:
      budget = self.default_budget(int(num_prompts))
    if not isinstance(budget, (int, np.integer)) or budget < self.m0 * num_prompts:
      raise ValueError(f"budget: expected an int >= m0 * num_prompts = "
                       f"{self.m0 * num_prompts}, got {budget!r}")
    return _new_state(num_prompts, int(budget), num_rounds=self.rounds)

  def requests(self, state: AllocationState) -> np.ndarray:
    """New samples per prompt for the state's current round (zeros once done)."""
    p = state.num_prompts
    out = np.zeros(p, np.int64)
    if state.done:
      return out
    t = state.round
    if t == 0:
      out[:] = self.m0
      if state.num_rounds == 1:
        out += _proportional_split(state.budget - self.m0 * p, np.ones(p), state.counts + out,
                                   np.zeros(p))
      return out
    var = state.variances()
    weights = _selection_weights(var, state.active, self._kept(p, t))
    round_budget = (state.remaining if t == state.num_rounds - 1 else
                    min(state.remaining, self._kept(p, t) * self._per_prompt(t)))
    return _proportional_split(round_budget, weights, state.counts, var)

  def observe(self, state: AllocationState, rewards: Sequence[np.ndarray]) -> AllocationState:
    requested = self.requests(state)
    new = _record(state, requested, rewards)
    if state.round > 0:
      new.active = _selection_weights(state.variances(), state.active,
                                      self._kept(state.num_prompts, state.round)) > 0
    return new


def _selection_weights(var: np.ndarray, active: np.ndarray, k: int) -> np.ndarray:
  """Shares of a round: 1 for each active prompt above the k-th highest variance; the
  remaining k - (those) shares split evenly over the prompts tied at the k-th value."""
  weights = np.zeros(var.shape[0])
  cand = var[active]
  if cand.size <= k:
    weights[active] = 1.0
    return weights
  kth = np.sort(cand)[::-1][k - 1]
  tol = 1e-12 * max(1.0, abs(kth))
  above = active & (var > kth + tol)
  tied = active & ~above & (var >= kth - tol)
  weights[above] = 1.0
  weights[tied] = (k - above.sum()) / tied.sum()
  return weights


def _proportional_split(total: int, weights: np.ndarray, counts: np.ndarray,
                        var: np.ndarray) -> np.ndarray:
  """`total` samples in proportion to `weights`, in integers summing exactly to `total`:
  floors first, then one more each by largest remainder, then fewest samples so far,
  then highest variance, then lowest index."""
  out = np.zeros(weights.shape[0], np.int64)
  idx = np.flatnonzero(weights > 0)
  if total <= 0 or idx.size == 0:
    return out
  exact = total * weights[idx] / weights[idx].sum()
  base = np.floor(exact + 1e-9).astype(np.int64)
  out[idx] = base
  left = int(total - base.sum())
  if left > 0:
    frac = np.round(exact - base, 9)
    order = np.lexsort((idx, -var[idx], counts[idx], -frac))
    out[idx[order[:left]]] += 1
  return out


class DynamicSamplingExhausted(RuntimeError):
  """DAPO dynamic sampling reached its cap without enough informative groups."""


@dataclasses.dataclass
class DynamicSamplingState:
  """Groups kept so far (indices into the stream of drawn groups) and groups drawn."""

  target_groups: int
  group_size: int
  max_groups: int
  drawn: int = 0
  kept: list = dataclasses.field(default_factory=list)

  @property
  def done(self) -> bool:
    return len(self.kept) >= self.target_groups

  @property
  def samples_drawn(self) -> int:
    return self.drawn * self.group_size


@dataclasses.dataclass(frozen=True)
class DynamicSampler:
  """DAPO dynamic sampling: draw groups of `group_size` for new prompts, drop groups whose
  rewards are all equal (zero advantage), and keep drawing until `target_groups`
  informative groups are kept. `max_groups` caps the groups drawn (budget
  max_groups * group_size samples); reaching it short of the target raises
  `DynamicSamplingExhausted`, whose message says to raise `cap_setting`.
  """

  group_size: int = 8
  max_groups_factor: float = 3.0  # default cap: this many times target_groups
  cap_setting: str = "max_groups"  # the setting a user raises for a higher cap

  def __post_init__(self):
    if not isinstance(self.group_size, int) or self.group_size < 2:
      raise ValueError(f"DynamicSampler.group_size: expected an int >= 2, got "
                       f"{self.group_size!r}")
    if not self.max_groups_factor >= 1.0:
      raise ValueError(f"DynamicSampler.max_groups_factor: expected >= 1, got "
                       f"{self.max_groups_factor!r}")

  def start(self, target_groups: int, max_groups: int | None = None) -> DynamicSamplingState:
    if not isinstance(target_groups, (int, np.integer)) or target_groups < 1:
      raise ValueError(f"target_groups: expected an int >= 1, got {target_groups!r}")
    if max_groups is None:
      max_groups = math.ceil(self.max_groups_factor * target_groups)
    if max_groups < target_groups:
      raise ValueError(f"max_groups: expected >= target_groups={target_groups}, got "
                       f"{max_groups}")
    return DynamicSamplingState(int(target_groups), self.group_size, int(max_groups))

  def requests(self, state: DynamicSamplingState) -> int:
    """How many new groups (prompts x group_size samples) to draw next: the shortfall,
    within the cap. 0 when done; raises when the cap is spent short of the target."""
    if state.done:
      return 0
    left = state.max_groups - state.drawn
    if left <= 0:
      raise DynamicSamplingExhausted(
          f"dynamic sampling: {len(state.kept)} of target_groups={state.target_groups} "
          f"informative groups after drawing max_groups={state.max_groups} groups of "
          f"{state.group_size}; the others had all-equal rewards. Raise {self.cap_setting}, or "
          f"the prompts are all too easy or too hard for the policy.")
    return min(state.target_groups - len(state.kept), left)

  def observe(self, state: DynamicSamplingState,
              group_rewards: Sequence[np.ndarray]) -> DynamicSamplingState:
    """Record newly drawn groups (in draw order; fewer than requested when a draw came back
    short); keeps those with unequal rewards."""
    expected = self.requests(state)
    if len(group_rewards) > expected:
      raise ValueError(f"group_rewards: expected at most {expected} groups (as requested), "
                       f"got {len(group_rewards)}")
    kept = list(state.kept)
    for j, r in enumerate(group_rewards):
      r = np.asarray(r, np.float64).reshape(-1)
      if r.shape[0] != state.group_size:
        raise ValueError(f"group_rewards[{j}]: expected {state.group_size} rewards, got "
                         f"{r.shape[0]}")
      if np.ptp(r) > 0:
        kept.append(state.drawn + j)
    kept = kept[:state.target_groups]
    return dataclasses.replace(state, drawn=state.drawn + len(group_rewards), kept=kept)
