"""Multi-turn sampling: an environment's reply joining its row in one step (the worker's
default) against one token a decode step (`feed_tokens=1`), same prompts, seeds and
replies, measured in one run.

    python benchmarks/multi_turn.py                        # replies of 64 tokens
    python benchmarks/multi_turn.py --reply_tokens=256 --max_new_tokens=1024

A random-weight Qwen2-shaped model samples --samples answers for each of --prompts prompts,
--slots prompts at a time (continuous batching, a row per sample); --stop_frac of the
vocabulary are stop tokens, so turns end after about 1/stop_frac tokens, and each gets a
reply of --reply_tokens tokens (a tool's output), up to --max_turns. Rows: policy tokens
per second (compile excluded, best of --reps, the two alternated) and decode steps; the
header gives the share of samples identical under both (they differ only where float
rounding flips a draw).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from inference_workers import continuous  # noqa: E402
from inference_workers.continuous import ContinuousBatch  # noqa: E402
from random_model import add_flags, model_prompts_params  # noqa: E402 (benchmarks/)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--slots", type=int, default=4)
  ap.add_argument("--samples", type=int, default=4)
  ap.add_argument("--reply_tokens", type=int, default=64)
  ap.add_argument("--max_turns", type=int, default=3)
  add_flags(ap, max_new_tokens=512)
  args = ap.parse_args()
  n = args.samples
  model, prompts, params = model_prompts_params(args)
  low = len(params.stop_tokens)  # replies hold no stop token

  def respond(key, j, tokens, observed):
    turn = int(np.sum(np.diff(np.concatenate([[0], observed.astype(int)])) == 1))
    return np.random.default_rng([key, j, turn]).integers(low, args.vocab,
                                                          args.reply_tokens).tolist()

  steps = {}
  chunk = continuous._chunk

  def run(feed_tokens):
    def go():
      def counted(*a, **k):
        out = chunk(*a, **k)
        steps[feed_tokens] += int(out[2])
        return out
      steps[feed_tokens] = 0
      continuous._chunk = counted
      try:
        batch = ContinuousBatch(model, n, args.slots, params, respond=respond,
                                max_turns=args.max_turns, feed_tokens=feed_tokens)
        for i, p in enumerate(prompts):
          batch.add(i, p, [i * n + j for j in range(n)])
        done = dict(batch.run())
        batch.close()
      finally:
        continuous._chunk = chunk
      return [s for i in range(args.prompts) for s in done[i]]
    return go

  schedules = {"reply in one step": run(256), "a token a step": run(1)}
  results = {name: fn() for name, fn in schedules.items()}  # compiles
  best = {name: float("inf") for name in schedules}
  for _ in range(args.reps):  # alternated, so a shared machine's drift hits both alike
    for name, fn in schedules.items():
      t0 = time.perf_counter()
      fn()
      best[name] = min(best[name], time.perf_counter() - t0)
  ours, theirs = results.values()
  same = np.mean([a.tokens.tolist() == b.tokens.tolist() for a, b in zip(ours, theirs)])
  policy = {name: sum(int((~s.observed).sum()) for s in got) for name, got in results.items()}
  replies = sum(int(s.observed.sum()) for s in ours)
  print(f"multi-turn: {args.prompts} prompts x {n} samples on {args.slots * n} rows, replies "
        f"of {args.reply_tokens} tokens (up to {args.max_turns}), up to {args.max_new_tokens} "
        f"tokens a sample; "
        f"{replies} reply tokens, {policy['reply in one step']} policy tokens; "
        f"{args.layers} layers x {args.hidden}, backend {jax.default_backend()}; "
        f"{same:.0%} of samples identical")
  names = list(schedules)
  print(f"{'':24}" + "".join(f"{k:>20}" for k in names))
  base = policy[names[1]] / best[names[1]]
  print(f"{'policy tokens/s':24}" + "".join(
      f"{policy[k] / best[k]:>13.0f} ({policy[k] / best[k] / base:.2f}x)" for k in names))
  print(f"{'decode steps':24}" + "".join(f"{steps[feed]:>20d}" for feed in (256, 1)))


if __name__ == "__main__":
  main()
