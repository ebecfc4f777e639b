"""Rollout allocators: fixed N, VIGOR (budget, variance targeting, fixed-N limit, resume),
DAPO dynamic sampling (filtering, cap, error)."""

import numpy as np
import pytest

from algorithms.allocation import (DynamicSampler, DynamicSamplingExhausted, FixedAllocator,
                                   VigorAllocator)
from algorithms.allocation import VigorAllocator


def _run(allocator, state, reward_fn):
  """Drive an allocator to the end; reward_fn(round, prompt, n) -> n rewards."""
  plans = []
  while not state.done:
    req = allocator.requests(state)
    plans.append(req)
    state = allocator.observe(state, [reward_fn(state.round, i, int(n))
                                      for i, n in enumerate(req)])
  return state, plans


def test_fixed_allocator_gives_n_each_in_one_round():
  alloc = FixedAllocator(4)
  state = alloc.start(3)
  np.testing.assert_array_equal(alloc.requests(state), [4, 4, 4])
  state = alloc.observe(state, [np.ones(4)] * 3)
  assert state.done and state.spent == 12 == state.budget
  np.testing.assert_array_equal(alloc.requests(state), [0, 0, 0])


def test_fixed_allocator_rejects_wrong_budget_and_wrong_reward_counts():
  with pytest.raises(ValueError, match="budget: fixed N=4 over 3 prompts spends exactly 12"):
    FixedAllocator(4).start(3, budget=13)
  state = FixedAllocator(4).start(2)
  with pytest.raises(ValueError, match="rewards\\[1\\]: expected 4 rewards"):
    FixedAllocator(4).observe(state, [np.ones(4), np.ones(3)])
  with pytest.raises(ValueError, match="rewards: expected one array per prompt \\(2\\)"):
    FixedAllocator(4).observe(state, [np.ones(4)])


def test_vigor_default_budget_is_eight_per_prompt():
  # rounds 0..3: 8 prompts x 2, 4 x 4, 2 x 8, 1 x 16 = 16 each = 64 = 8 per prompt
  assert VigorAllocator().default_budget(8) == 64
  assert VigorAllocator().start(8).budget == 64


def test_vigor_gives_new_samples_to_highest_variance_prompts():
  alloc = VigorAllocator()
  state = alloc.start(8)
  np.testing.assert_array_equal(alloc.requests(state), [2] * 8)
  # round 0: prompts 0-3 see [0, 1] (variance 0.5), prompts 4-7 see [1, 1] (variance 0)
  state = alloc.observe(state, [np.array([0.0, 1.0])] * 4 + [np.array([1.0, 1.0])] * 4)
  # round 1: keep ceil(8 / 2) = 4 prompts, 2 * 2 = 4 new samples each
  np.testing.assert_array_equal(alloc.requests(state), [4, 4, 4, 4, 0, 0, 0, 0])
  state = alloc.observe(state, [np.array(r, float) for r in
                                ([0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0])]
                        + [np.zeros(0)] * 4)
  # variances over 6 samples (unbiased): p0 3 ones: 6 * .25 / 5 = .3; p1 5 ones: 1/6;
  # p2 2 ones: (2 * 4/9 + 4 * 1/9) / 5 = 4/15 = .267; p3 1 one: 1/6
  np.testing.assert_allclose(state.variances()[:4], [0.3, 1 / 6, 4 / 15, 1 / 6])
  # round 2: top 2 of the 4 active -> p0 and p2, 8 new samples each
  np.testing.assert_array_equal(alloc.requests(state), [8, 0, 8, 0, 0, 0, 0, 0])
  state = alloc.observe(state, [np.ones(8), np.zeros(0), np.array([0, 1] * 4, float)]
                        + [np.zeros(0)] * 5)
  # p0: 11 ones of 14 -> var (11/14)(3/14)(14/13) = .181; p2: 6 of 14 -> (6/14)(8/14)(14/13)
  # = .264; round 3 (last) spends the rest, 64 - 48 = 16, on p2
  np.testing.assert_array_equal(alloc.requests(state), [0, 0, 16, 0, 0, 0, 0, 0])
  state = alloc.observe(state, [np.zeros(0)] * 2 + [np.ones(16)] + [np.zeros(0)] * 5)
  assert state.done
  np.testing.assert_array_equal(state.counts, [14, 6, 30, 6, 2, 2, 2, 2])
  assert state.spent == state.budget == 64


def test_vigor_splits_the_boundary_share_among_tied_prompts():
  # round 0: p0 sees [0, 1] (variance 0.5), p1-p3 see [0, 0] (variance 0)
  alloc = VigorAllocator()
  state = alloc.start(4, budget=24)
  state = alloc.observe(state, [np.array([0.0, 1.0])] + [np.zeros(2)] * 3)
  # round 1: k = 2 shares of 4 samples = 8. p0 is above the 2nd-highest variance (0): one
  # share, 4. The other share (4) goes to the 3 prompts tied at 0: 4/3 each -> 1 each,
  # and the leftover 1 to the first of them (equal counts and variances: lowest index)
  np.testing.assert_array_equal(alloc.requests(state), [4, 2, 1, 1])
  state = alloc.observe(state, [np.array([1.0, 0, 1, 0]), np.zeros(2), np.ones(1), np.zeros(1)])
  # round 2: k = 1 share of 2 * 2^2 = 8 samples. p0 = [0, 1, 1, 0, 1, 0]: variance
  # 6 * .25 / 5 = 0.3; p2 = [0, 0, 1]: (2 * (1/3)^2 + (2/3)^2) / 2 = 1/3 > 0.3: p2 gets it
  np.testing.assert_array_equal(alloc.requests(state), [0, 0, 8, 0])


@pytest.mark.parametrize("num_prompts,budget", [(8, 64), (4, 32)])
def test_vigor_reduces_to_fixed_n_when_variances_are_equal(num_prompts, budget):
  # every prompt sees the same alternating rewards and (budget divides evenly in every
  # round) the same counts, so all variances tie in every round
  alloc = VigorAllocator()
  state, plans = _run(alloc, alloc.start(num_prompts, budget),
                      lambda t, i, n: np.arange(n, dtype=float) % 2)
  assert state.variances().min() == state.variances().max() > 0
  np.testing.assert_array_equal(state.counts, [budget // num_prompts] * num_prompts)
  assert len(plans) == 4


@pytest.mark.parametrize("num_prompts,budget", [(8, 64), (5, 40), (3, 24), (7, 63)])
def test_vigor_reduces_to_fixed_n_when_all_variances_are_zero(num_prompts, budget):
  # each prompt always gets its own constant reward: variance 0 everywhere, even when a
  # round's samples do not split evenly (the leftovers go to the prompts with fewest)
  alloc = VigorAllocator()
  state, _ = _run(alloc, alloc.start(num_prompts, budget), lambda t, i, n: np.full(n, i / 10))
  np.testing.assert_array_equal(state.counts, [budget // num_prompts] * num_prompts)


def test_vigor_is_budget_exact_for_any_budget():
  rng = np.random.default_rng(0)
  for _ in range(40):
    p = int(rng.integers(1, 20))
    cfg = VigorAllocator(m0=int(rng.integers(1, 4)), rounds=int(rng.integers(1, 6)),
                         alpha=float(rng.uniform(0.2, 1.0)), gamma=float(rng.uniform(1.0, 3.0)))
    budget = int(rng.integers(cfg.m0 * p, 20 * p + 1))
    probs = rng.uniform(size=p)
    state = cfg.start(p, budget)
    while not state.done:
      req = cfg.requests(state)
      assert req.min() >= 0 and state.spent + req.sum() <= budget
      state = cfg.observe(state, [(rng.uniform(size=n) < probs[i]).astype(float)
                                  for i, n in enumerate(req)])
    assert state.spent == budget, (p, cfg, budget)


def test_vigor_plans_a_round_again_from_the_same_state():
  alloc = VigorAllocator()
  rng = np.random.default_rng(1)
  probs = rng.uniform(size=10)
  reward_fn = lambda t, i, n: (np.random.default_rng([t, i]).uniform(size=n) < probs[i]) * 1.0
  straight, straight_plans = _run(alloc, alloc.start(10), reward_fn)
  # same run, each round planned twice: planning is a pure function of the state
  state, plans = alloc.start(10), []
  while not state.done:
    req = alloc.requests(state)
    np.testing.assert_array_equal(alloc.requests(state), req)
    plans.append(req)
    state = alloc.observe(state, [reward_fn(state.round, i, int(n)) for i, n in enumerate(req)])
  np.testing.assert_array_equal(state.counts, straight.counts)
  for a, b in zip(plans, straight_plans):
    np.testing.assert_array_equal(a, b)


def test_vigor_rejects_bad_config_budget_and_late_observe():
  with pytest.raises(ValueError, match="VigorAllocator.alpha: expected a fraction in \\(0, 1\\]"):
    VigorAllocator(alpha=1.5)
  with pytest.raises(ValueError, match="budget: expected an int >= m0 \\* num_prompts = 16"):
    VigorAllocator().start(8, budget=10)
  alloc = FixedAllocator(1)
  state = alloc.observe(alloc.start(1), [np.ones(1)])
  with pytest.raises(ValueError, match="observe: all 1 rounds are done"):
    alloc.observe(state, [np.ones(0)])


def test_dynamic_sampling_keeps_only_informative_groups():
  sampler = DynamicSampler(group_size=4)
  state = sampler.start(target_groups=2, max_groups=10)
  assert sampler.requests(state) == 2
  # group 0 all ones (dropped), group 1 mixed (kept)
  state = sampler.observe(state, [np.ones(4), np.array([0, 1, 0, 0.0])])
  assert state.kept == [1] and sampler.requests(state) == 1
  state = sampler.observe(state, [np.array([0.5, 0.5, 0.2, 0.5])])
  assert state.done and state.kept == [1, 2] and state.samples_drawn == 12
  assert sampler.requests(state) == 0


def test_dynamic_sampling_cap_raises_a_clear_error_and_never_overdraws():
  sampler = DynamicSampler(group_size=2)
  state = sampler.start(target_groups=3, max_groups=4)
  state = sampler.observe(state, [np.zeros(2), np.array([0.0, 1.0]), np.ones(2)])
  assert sampler.requests(state) == 1  # shortfall 2, but only 1 group left under the cap
  state = sampler.observe(state, [np.zeros(2)])
  assert state.drawn == 4
  with pytest.raises(DynamicSamplingExhausted,
                     match="1 of target_groups=3 informative groups after drawing max_groups=4"):
    sampler.requests(state)


def test_dynamic_sampling_state_counts_and_validates():
  sampler = DynamicSampler(group_size=2, max_groups_factor=2.0)
  state = sampler.start(target_groups=3)
  assert state.max_groups == 6
  state = sampler.observe(state, [np.array([0.0, 1.0]), np.ones(2), np.zeros(2)])
  assert sampler.requests(state) == 2
  with pytest.raises(ValueError, match="group_rewards\\[0\\]: expected 2 rewards, got 3"):
    sampler.observe(state, [np.ones(3), np.ones(2)])
  with pytest.raises(ValueError, match="group_rewards: expected at most 2 groups"):
    sampler.observe(state, [np.ones(2)] * 3)
  short = sampler.observe(state, [np.array([1.0, 0.0])])  # a draw that came back short
  assert short.drawn == 4 and short.kept == [0, 3] and sampler.requests(short) == 1


def test_vigor_keeps_the_ceiling_of_alpha_times_the_active_prompts():
  alloc = VigorAllocator(m0=2, rounds=2, alpha=0.5, gamma=2.0)
  # k_1 = ceil(0.5 * 3) = 2 prompts x 4 samples after 3 x 2
  assert alloc.default_budget(3) == 3 * 2 + 2 * 4
  state = alloc.start(3)
  state = alloc.observe(state, [np.array([0.0, 4.0]), np.array([0.0, 2.0]), np.array([0.0, 0.0])])
  np.testing.assert_array_equal(alloc.requests(state), [4, 4, 0])


def test_a_prompt_dropped_earlier_stays_dropped_when_its_variance_ties_the_boundary():
  alloc = VigorAllocator(m0=2, rounds=3, alpha=0.5, gamma=2.0)
  state = alloc.start(4)
  state = alloc.observe(state, [np.array([0.0, 4.0]), np.array([0.0, 4.0]),
                                np.array([0.0, 2.0]), np.array([0.0, 0.0])])  # var 8, 8, 2, 0
  np.testing.assert_array_equal(alloc.requests(state), [4, 4, 0, 0])
  state = alloc.observe(state, [np.array([3.0, 1.0, 2.0, 2.0]), np.array([2.0] * 4),
                                np.zeros(0), np.zeros(0)])  # p0 var now 2.0 == dropped p2's
  assert not state.active[2]
  np.testing.assert_array_equal(alloc.requests(state), [8, 0, 0, 0])


def test_an_odd_leftover_sample_goes_to_the_higher_variance_prompt():
  alloc = VigorAllocator(m0=2, rounds=2, alpha=0.5, gamma=2.0)
  state = alloc.start(4, budget=13)
  state = alloc.observe(state, [np.array([0.0, 2.0]), np.array([0.0, 4.0]),
                                np.array([0.0, 0.0]), np.array([0.0, 0.0])])  # var 2, 8, 0, 0
  # 5 left for 2 prompts with 2 samples each: 2.5 each, the odd one to the higher variance
  np.testing.assert_array_equal(alloc.requests(state), [2, 3, 0, 0])
