"""Continuous batching: sampling throughput of the worker's ContinuousBatch against static
calls of the same slots (the next call starts when the longest response of the last ends),
the same prompts and seeds, measured in one run.

    python benchmarks/continuous_batching.py                     # stops: ~1/48 per token
    python benchmarks/continuous_batching.py --stop_frac=0       # every response full length

A random-weight Qwen2-shaped model samples --samples answers for each of --prompts prompts at
temperature 1, --slots prompts at a time. A random model's next-token distribution is broad,
so making --stop_frac of the vocabulary stop tokens gives each token that chance of ending
its response: lengths spread geometrically up to --max_new_tokens, as in RL on reasoning
tasks, where a few long answers outlast the rest. Rows: new tokens per second (compile
excluded, best of --reps, the two alternated), the share of decoded row-steps that produced a token (the
schedule's utilization, computed from the measured lengths) and the decode steps each
schedule takes. Both schedules give the same samples (checked).
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
from flax import nnx  # noqa: E402

from inference_workers.continuous import ContinuousBatch  # noqa: E402
from inference_workers.sampler import generate_shared  # noqa: E402
from inference_workers.sampling import SamplingParams  # noqa: E402
from rlax_ps.models import ModelConfig, Transformer  # noqa: E402


def schedule_steps(group_lengths, slots: int) -> dict[str, int]:
  """Decode steps of each schedule for groups (in queue order) whose longest sample has
  that many tokens: static calls of `slots` groups last as long as their longest; continuous
  slots take the next group as soon as theirs ends (the first token comes from the prefill)."""
  lengths = [max(int(g) - 1, 0) for g in group_lengths]
  static = sum(max(lengths[i:i + slots]) for i in range(0, len(lengths), slots))
  ends = [0] * min(slots, len(lengths))
  for n in lengths:  # each group goes to the slot that frees first
    heapq.heapreplace(ends, ends[0] + n)
  return {"static": static, "continuous": max(ends)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=32)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=48)
  ap.add_argument("--max_new_tokens", type=int, default=256)
  ap.add_argument("--stop_frac", type=float, default=1 / 48)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--reps", type=int, default=2)
  args = ap.parse_args()

  config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=3 * args.hidden, num_layers=args.layers,
                       num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 256),
                       architecture="qwen2", qkv_bias=True, dtype="float32",
                       param_dtype="float32",
                       max_position_embeddings=args.prompt_len + args.max_new_tokens)
  model = Transformer(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, args.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
  seeds = [[i * args.samples + j for j in range(args.samples)] for i in range(args.prompts)]
  stops = tuple(range(int(round(args.stop_frac * args.vocab))))
  params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_tokens=stops)

  def static():
    out = []
    for i in range(0, args.prompts, args.slots):
      out += generate_shared(model, prompts[i:i + args.slots], args.samples,
                             seeds[i:i + args.slots], params)
    return out

  def continuous():
    batch = ContinuousBatch(model, args.samples, args.slots, params)
    for i, (p, s) in enumerate(zip(prompts, seeds)):
      batch.add(i, p, s)
    done = dict(batch.run())
    return [done[i] for i in range(args.prompts)]

  schedules = {"static": static, "continuous": continuous}
  results = {name: fn() for name, fn in schedules.items()}  # compiles
  best = {name: float("inf") for name in schedules}
  for _ in range(args.reps):  # alternated, so a shared machine's drift hits both alike
    for name, fn in schedules.items():
      best[name] = min(best[name], _timed(fn))
  rates = {name: sum(len(s.tokens) for g in results[name] for s in g) / best[name]
           for name in schedules}
  same = all(a.tokens.tolist() == b.tokens.tolist()
             for ga, gb in zip(results["static"], results["continuous"]) for a, b in zip(ga, gb))
  if not same:
    raise SystemExit("continuous batching sampled differently from static calls")
  lengths = [[len(s.tokens) for s in g] for g in results["static"]]
  flat = np.concatenate(lengths)
  steps = schedule_steps([max(g) for g in lengths], args.slots)
  useful = float(np.sum(flat - 1))
  rows = args.slots * args.samples

  print(f"continuous batching: {args.prompts} prompts x {args.samples} samples, {args.slots} "
        f"slots ({rows} rows), prompt {args.prompt_len}, up to {args.max_new_tokens} new "
        f"tokens; response length mean {flat.mean():.0f}, median {np.median(flat):.0f}, "
        f"max {flat.max()}; {args.layers} layers x {args.hidden}, backend "
        f"{jax.default_backend()}; same samples: {same}")
  print(f"{'':28} {'static':>10} {'continuous':>11} {'ratio':>7}")
  print(f"{'new tokens/s':28} {rates['static']:10.0f} {rates['continuous']:11.0f} "
        f"{rates['continuous'] / rates['static']:6.2f}x")
  util = {k: useful / (rows * max(v, 1)) for k, v in steps.items()}
  print(f"{'row-steps that made a token':28} {util['static']:10.2f} {util['continuous']:11.2f} "
        f"{util['continuous'] / util['static']:6.2f}x")
  print(f"{'decode steps':28} {steps['static']:10d} {steps['continuous']:11d} "
        f"{steps['static'] / max(steps['continuous'], 1):6.2f}x fewer")


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


if __name__ == "__main__":
  main()
