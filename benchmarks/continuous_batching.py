"""Continuous batching: sampling throughput of the worker's ContinuousBatch against static
calls over the same decode rows, the same prompts and seeds, measured in one run.

    python benchmarks/continuous_batching.py                     # stops: ~1/48 per token
    python benchmarks/continuous_batching.py --stop_frac=0       # every response full length

A random-weight Qwen2-shaped model samples --samples answers for each of --prompts prompts at
temperature 1 on --rows decode rows. A random model's next-token distribution is broad, so
making --stop_frac of the vocabulary stop tokens gives each token that chance of ending its
response: lengths spread geometrically up to --max_new_tokens, as in RL on reasoning tasks,
where a few long answers outlast the rest. Columns: static calls of rows/N prompts (the next
call starts when the longest response of the last ends); continuous batching with all N
samples of a prompt at once (a slot is refilled when its prompt's longest sample ends); with
--rows_per_prompt rows per prompt (rows / that many slots; a row takes its prompt's next
sample as soon as its own ends); and with the rows shared by every prompt's samples
(`SampleBatch`, a worker's `sample_rows`: a row takes the next queued sample of any prompt).
Rows: new tokens per second (compile excluded, best of --reps, the schedules alternated),
the share of decoded row-steps that drew a token, the decode steps of each schedule and the
mean steps from a group's first token to its last (what its staleness grows with), these
computed from the measured lengths. Every schedule gives the same samples (checked).
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from inference_workers.continuous import ContinuousBatch  # noqa: E402
from inference_workers.sample_batch import SampleBatch  # noqa: E402
from inference_workers.sampler import generate_shared  # noqa: E402
from random_model import add_flags, model_prompts_params  # noqa: E402 (benchmarks/)


def static_steps(sample_lengths, rows: int) -> tuple[int, float]:
  """(decode steps, mean steps a group takes from its first token to its last) of static
  calls of rows // N groups (in queue order) of N samples whose lengths are given: each
  call lasts as long as its longest sample (the first token of each comes from the
  prefill), and so does each of its groups."""
  per_call = rows // len(sample_lengths[0])
  longest = [max(max(int(x) - 1, 0) for x in g) for g in sample_lengths]
  calls = [max(longest[i:i + per_call]) for i in range(0, len(longest), per_call)]
  return sum(calls), float(np.mean([calls[i // per_call] for i in range(len(longest))]))


def continuous_steps(sample_lengths, rows: int, rows_per_prompt: int) -> tuple[int, float]:
  """(decode steps, mean group latency) of continuous batching: rows // rows_per_prompt
  slots; a group takes the slot that frees first, its samples the row of the slot that
  frees first; a slot frees when its group's last sample ends."""
  slots = [(0, s) for s in range(rows // rows_per_prompt)]
  end, latency = 0, []
  for group in sample_lengths:
    start, slot = heapq.heappop(slots)
    ends = [start] * rows_per_prompt
    for x in group:
      heapq.heapreplace(ends, ends[0] + max(int(x) - 1, 0))
    end = max(end, max(ends))
    latency.append(max(ends) - start)
    heapq.heappush(slots, (max(ends), slot))
  return end, float(np.mean(latency))


def shared_row_steps(sample_lengths, rows: int) -> tuple[int, float]:
  """(decode steps, mean group latency) when every sample, in queue order, takes the row
  that frees first."""
  ends, latency = [0] * rows, []
  for group in sample_lengths:
    first, last = ends[0], 0
    for x in group:
      last = max(last, ends[0] + max(int(x) - 1, 0))
      heapq.heapreplace(ends, ends[0] + max(int(x) - 1, 0))
    latency.append(last - first)
  return max(ends), float(np.mean(latency))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=32)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--rows", type=int, default=64)
  ap.add_argument("--rows_per_prompt", type=int, default=2)
  add_flags(ap, max_new_tokens=256)
  args = ap.parse_args()
  if args.rows < args.samples:
    ap.error(f"--rows: expected at least --samples ({args.samples}): a static call holds "
             f"whole groups, got {args.rows}")
  n, r = args.samples, args.rows_per_prompt
  model, prompts, params = model_prompts_params(args)
  seeds = [[i * n + j for j in range(n)] for i in range(args.prompts)]
  per_call = args.rows // n

  def static():
    out = []
    for i in range(0, args.prompts, per_call):
      out += generate_shared(model, prompts[i:i + per_call], n, seeds[i:i + per_call], params)
    return out

  def continuous(rows_per_prompt):
    def run():
      batch = (SampleBatch(model, n, args.rows, params) if rows_per_prompt == 0 else
               ContinuousBatch(model, n, args.rows // rows_per_prompt, params,
                               rows_per_prompt=rows_per_prompt))
      for i, (p, s) in enumerate(zip(prompts, seeds)):
        batch.add(i, p, s)
      done = dict(batch.run())
      return [done[i] for i in range(args.prompts)]
    return run

  schedules = {"static": static, "per prompt": continuous(n),
               f"{r} rows/prompt": continuous(r), "shared rows": continuous(0)}
  results = {name: fn() for name, fn in schedules.items()}  # compiles
  best = {name: float("inf") for name in schedules}
  for _ in range(args.reps):  # alternated, so a shared machine's drift hits all alike
    for name, fn in schedules.items():
      best[name] = min(best[name], _timed(fn))
  same = all(a.tokens.tolist() == b.tokens.tolist()
             for other in results.values()
             for ga, gb in zip(results["static"], other) for a, b in zip(ga, gb))
  if not same:
    raise SystemExit("continuous batching sampled differently from static calls")
  lengths = [[len(s.tokens) for s in g] for g in results["static"]]
  flat = np.concatenate(lengths)
  tokens = float(flat.sum())
  steps = {"static": static_steps(lengths, args.rows),
           "per prompt": continuous_steps(lengths, args.rows, n),
           f"{r} rows/prompt": continuous_steps(lengths, args.rows, r),
           "shared rows": shared_row_steps(lengths, args.rows)}
  useful = float(np.sum(flat - 1))
  steps, latency = {k: v[0] for k, v in steps.items()}, {k: v[1] for k, v in steps.items()}

  print(f"continuous batching: {args.prompts} prompts x {n} samples on {args.rows} rows, "
        f"prompt {args.prompt_len}, up to {args.max_new_tokens} new tokens; response length "
        f"mean {flat.mean():.0f}, median {np.median(flat):.0f}, max {flat.max()}; "
        f"{args.layers} layers x {args.hidden}, backend {jax.default_backend()}; same samples")
  names = list(schedules)
  print(f"{'':28}" + "".join(f"{k:>16}" for k in names))
  base = tokens / best["static"]
  print(f"{'new tokens/s':28}" + "".join(
      f"{tokens / best[k]:>9.0f} ({tokens / best[k] / base:.2f}x)" for k in names))
  print(f"{'row-steps that drew a token':28}" + "".join(
      f"{useful / (args.rows * max(steps[k], 1)):>16.2f}" for k in names))
  print(f"{'decode steps':28}" + "".join(f"{steps[k]:>16d}" for k in names))
  print(f"{'group latency (steps)':28}" + "".join(f"{latency[k]:>16.0f}" for k in names))


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


if __name__ == "__main__":
  main()
