"""The RL step on rows packed to the batch's response bucket vs to the whole budget.

  .venv/bin/python benchmarks/response_buckets.py --budget=512 --longest=120

Groups of N responses of up to --longest tokens under a budget of --budget
(worker.max_new_tokens): rl.response_buckets packs them to the smallest capacity of
budget / 2**k (k < 4) that holds the longest; with 1 bucket they pack to the budget. One jitted
loss-and-gradient of the same groups, timed (median of --reps) each way, same loss.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rlax_ps.models import ModelConfig, Transformer  # noqa: E402
from rlax_ps.train.rl_loss import LossConfig, rl_loss  # noqa: E402
from rlax_ps.train.rollouts import BatchShape, Group, build_batch, fit_response_len  # noqa: E402

_BUDGET = flags.DEFINE_integer("budget", 512, "response budget (worker.max_new_tokens)")
_LONGEST = flags.DEFINE_integer("longest", 120, "longest response in the batch")
_GROUPS = flags.DEFINE_integer("groups", 4, "groups per step")
_SAMPLES = flags.DEFINE_integer("samples", 8, "responses per group")
_REPS = flags.DEFINE_integer("reps", 5, "timed steps each way")


def _groups(rng, vocab: int) -> list[Group]:
  out = []
  for g in range(_GROUPS.value):
    lens = rng.integers(_LONGEST.value // 4, _LONGEST.value + 1, _SAMPLES.value)
    lens[0] = _LONGEST.value
    responses = tuple(rng.integers(3, vocab, n).astype(np.int32) for n in lens)
    out.append(Group(rollout_id=g, prompt_tokens=rng.integers(3, vocab, 48).astype(np.int32),
                     responses=responses,
                     behaviour_logp=tuple(np.full(len(r), -2.0, np.float32) for r in responses),
                     rewards=rng.integers(0, 2, _SAMPLES.value).astype(np.float32),
                     policy_version=0))
  return out


def main(argv) -> None:
  del argv
  config = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4,
                       num_heads=8, num_kv_heads=4, max_position_embeddings=4096)
  graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  params = state.to_pure_dict()
  groups = _groups(np.random.default_rng(0), config.vocab_size)
  full = BatchShape(groups=_GROUPS.value, samples=_SAMPLES.value, prompt_len=64,
                    response_len=_BUDGET.value)
  cfg = LossConfig(budget=_BUDGET.value)
  rows = {}
  for name, shape in (("bucket", fit_response_len(groups, full, 4)), ("budget", full)):
    batch = {k: jnp.asarray(v) for k, v in build_batch(groups, shape).items()}
    step = jax.jit(jax.value_and_grad(functools.partial(
        rl_loss, graphdef=graphdef, batch=batch, ref_params=None, num_groups=_GROUPS.value,
        cfg=cfg), has_aux=True))
    (loss, _), _ = jax.block_until_ready(step(params))  # compile
    times = []
    for _ in range(_REPS.value):
      t0 = time.perf_counter()
      jax.block_until_ready(step(params))
      times.append(time.perf_counter() - t0)
    rows[name] = (shape.response_len, statistics.median(times), float(loss))
  (rb, tb, lb), (rf, tf, lf) = rows["bucket"], rows["budget"]
  assert abs(lb - lf) <= 1e-4 * max(1.0, abs(lf)), (lb, lf)
  print(f"{_GROUPS.value} groups x {_SAMPLES.value} responses of up to {_LONGEST.value} tokens, "
        f"budget {_BUDGET.value}; {os.cpu_count()} cores, {jax.default_backend()}")
  print(f"{'measurement':<38}| {'bucket':>8} | {'budget':>8} | ratio")
  print(f"{'response positions per row slot':<38}| {rb:>8} | {rf:>8} | {rf / rb:.2f}x fewer")
  print(f"{'loss + gradient ms (median)':<38}| {1e3 * tb:>8.1f} | {1e3 * tf:>8.1f} | "
        f"{tf / tb:.2f}x faster")
  print(f"{'loss (equal)':<38}| {lb:>8.4f} | {lf:>8.4f} |")


if __name__ == "__main__":
  app.run(main)
