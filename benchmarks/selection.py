"""Selective rollouts on a simulated dataset: rollouts spent per point of accuracy, feeding
every record each epoch vs revisiting records whose groups keep coming back uniform.

    .venv/bin/python benchmarks/selection.py                  # 512 records, 8 samples, 5 trials
    .venv/bin/python benchmarks/selection.py --records=128 --trials=2

Each record succeeds with probability p (reward 1, else 0), drawn as in allocation.py: most
records hard, a few easy or solved. Learning is modelled by one rule: a group with a signal
(rewards not all equal) moves its record's logit by `eta` towards success; a uniform group
moves nothing. Every method gets the same rollout budget (`epochs` full passes) and feeds
records in the same shuffled order through the trainer's own decision
(`algorithms.selection.fed`). The table gives, per method, the share of rollouts in groups
with a signal, the mean success probability over the dataset at the end (the "accuracy"),
and the rollouts each method needed to reach the accuracy that feeding everything reaches
with the whole budget (fewer is better; the ratio is against feeding everything). A toy
model: real prompts also learn from each other, so take the ratios, not the levels.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from algorithms.selection import fed, next_streak  # noqa: E402

_RECORDS = flags.DEFINE_integer("records", 512, "records in the dataset")
_SAMPLES = flags.DEFINE_integer("samples", 8, "samples per prompt")
_EPOCHS = flags.DEFINE_integer("epochs", 6, "budget: this many full passes over the dataset")
_ETA = flags.DEFINE_float("eta", 0.4, "logit step towards success per group with a signal")
_TRIALS = flags.DEFINE_integer("trials", 5, "independent datasets averaged")

# (name, revisit_solved, revisit_failed)
METHODS = (("feed everything", 1.0, 1.0), ("retire solved", 0.0, 1.0),
           ("revisit 0.5 / 0.5", 0.5, 0.5), ("revisit 0.25 / 0.5", 0.25, 0.5))


def _run(p0: np.ndarray, budget: int, revisit_solved: float, revisit_failed: float,
         seed: int) -> tuple[float, np.ndarray, np.ndarray]:
  """(share of rollouts with a signal, rollouts spent after each group, mean p after it)."""
  rng = np.random.default_rng(seed)
  logit = np.log(np.clip(p0, 1e-4, 1 - 1e-4) / np.clip(1 - p0, 1e-4, 1))
  streaks = np.zeros(len(p0), np.int64)
  n, spent, signal, position = _SAMPLES.value, 0, 0, 0
  spent_at, mean_at = [], []
  order_rng = np.random.default_rng(seed + 1)
  while spent < budget:
    passed = 0
    for record in order_rng.permutation(len(p0)):
      if spent >= budget:
        break
      position += 1
      if streaks[record] and not fed(int(streaks[record]), seed, position, revisit_solved,
                                     revisit_failed) and passed < len(p0):
        passed += 1
        continue
      p = 1.0 / (1.0 + np.exp(-logit[record]))
      rewards = (rng.random(n) < p).astype(np.float64)
      spent += n
      streaks[record] = next_streak(int(streaks[record]), rewards)
      if np.ptp(rewards) > 0:
        signal += n
        logit[record] += _ETA.value
      spent_at.append(spent)
      mean_at.append(float(np.mean(1.0 / (1.0 + np.exp(-logit)))))
  return signal / spent, np.asarray(spent_at), np.asarray(mean_at)


def _rollouts_to(target: float, spent_at: np.ndarray, mean_at: np.ndarray) -> float:
  hit = np.nonzero(mean_at >= target - 1e-12)[0]
  return float(spent_at[hit[0]]) if hit.size else float("inf")


def main(argv) -> None:
  del argv
  budget = _RECORDS.value * _SAMPLES.value * _EPOCHS.value
  rows = {name: [] for name, *_ in METHODS}
  for trial in range(_TRIALS.value):
    rng = np.random.default_rng(1000 + trial)
    p0 = np.minimum(1.0, 0.15 * rng.pareto(1.5, size=_RECORDS.value))
    runs = {name: _run(p0, budget, s, f, seed=trial) for name, s, f in METHODS}
    target = runs[METHODS[0][0]][2][-1]  # feeding everything, at the whole budget
    for name, (share, spent_at, mean_at) in runs.items():
      rows[name].append((share, mean_at[-1], _rollouts_to(target, spent_at, mean_at)))
  base = np.mean([r[2] for r in rows[METHODS[0][0]]])
  print(f"{_RECORDS.value} records x {_SAMPLES.value} samples, budget {_EPOCHS.value} epochs "
        f"({budget} rollouts), eta {_ETA.value}, {_TRIALS.value} trials")
  print(f"{'method':<22}| {'signal share':>12} | {'accuracy':>8} | {'rollouts to reach':>17} | "
        f"vs everything")
  for name, values in rows.items():
    share, acc, need = (np.mean([v[i] for v in values]) for i in range(3))
    ratio = base / need if np.isfinite(need) else 0.0
    need_s = f"{need:>17.0f}" if np.isfinite(need) else f"{'not reached':>17}"
    print(f"{name:<22}| {share:>12.2f} | {acc:>8.3f} | {need_s} | {ratio:.2f}x fewer")


if __name__ == "__main__":
  app.run(main)
