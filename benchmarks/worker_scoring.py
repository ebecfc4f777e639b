"""Worker throughput with a slow verifier (a code task's tests): finished groups scored on
threads beside decoding, samples and groups side by side (the worker's default), against
scoring in line with decoding, one sample at a time; same prompts, seeds and model, one run.

    python benchmarks/worker_scoring.py                    # 20 ms of tests a sample
    python benchmarks/worker_scoring.py --verify_ms=200 --prompts=32
    python benchmarks/worker_scoring.py --allocator=vigor  # VIGOR's rounds
    python benchmarks/worker_scoring.py --straggler_ms=500  # one slow test a group

A random-weight model (the char tokenizer's vocabulary) samples --samples answers to each of
--prompts prompts, --slots prompts at a time, through a parameter server on loopback; the
verifier sleeps --verify_ms a sample (a subprocess running tests waits so). Rows: wall
seconds from the first lease to the last group sent, and sampled tokens a second
(compiles excluded: a warm-up run first); the ratio is against the in-line row. With
--allocator=vigor the prompts are sampled in rounds: each prompt's samples of a round
scored as they finish, beside the round's decoding, against after the round. With
--straggler_ms one sample of each group takes that long instead (a test near its
timeout): groups scored side by side, against one group at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import sys
import tempfile
import time

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from algorithms.verifiers.base import Guarded, VerifierResult  # noqa: E402
from inference_workers.loop import Worker  # noqa: E402
from inference_workers.worker_config import WorkerConfig  # noqa: E402
from param_server.client import ParamServerClient, RetryPolicy  # noqa: E402
from param_server.protos import param_server_pb2 as pb  # noqa: E402
from param_server.server import ParamServer, ServerConfig  # noqa: E402
from rlax_ps import sync  # noqa: E402
from rlax_ps.models import ModelConfig, Transformer, flatten_params  # noqa: E402
from rlax_ps.tokenizers import CharTokenizer  # noqa: E402

TOKENS = {"trainer": "bench-trainer", "worker": "bench-worker", "viewer": "bench-viewer"}


def _client(server, role):
  return ParamServerClient(server.address, token=TOKENS[role], role=role, timeout_s=60.0,
                           retry=RetryPolicy(deadline_s=30.0))


def _run(args, config, weights, tokenizer, beside: bool, threads: int,
         one_group: bool = False) -> tuple[float, int]:
  """(seconds, tokens) of one worker serving --prompts prompts (`one_group`: groups scored
  one at a time, as before they were side by side)."""
  calls = itertools.count()

  def verifier(completion, reference):
    slow = args.straggler_ms and next(calls) % args.samples == 0
    time.sleep((args.straggler_ms if slow else args.verify_ms) / 1000)
    return VerifierResult(float(len(completion) % 2), True)

  with tempfile.TemporaryDirectory() as tmp:
    server = ParamServer(ServerConfig(
        storage_dir=f"{tmp}/ps", port=0, wal_fsync=False, trainer_token=TOKENS["trainer"],
        worker_token=TOKENS["worker"], viewer_token=TOKENS["viewer"])).start()
    try:
      with _client(server, "trainer") as trainer, _client(server, "worker") as wc:
        trainer.publish(sync.encode(None, weights, "bf16", version=0).to_bytes())
        trainer.enqueue_prompts([pb.Prompt(id=f"p{i}", text=f"{i} + {2 * i} = ", task="mine")
                                 for i in range(args.prompts)])
        worker = Worker(wc, config, tokenizer, WorkerConfig(
            samples_per_prompt=args.samples, prompts_per_call=args.slots,
            prompts_per_lease=args.slots, max_new_tokens=args.max_new_tokens,
            max_leases=-(-args.prompts // args.slots), scoring_threads=threads,
            lease_wait_s=0.2, seed=0, allocator=args.allocator),
                        verifier_for=lambda task: Guarded(task, verifier))
        if one_group:
          worker._submitter = concurrent.futures.ThreadPoolExecutor(1)
        if not beside and args.allocator != "fixed":  # a round's prompts scored after it
          draw = worker._draw
          worker._draw = lambda *a: draw(*a[:5])
        elif not beside:  # the decode loop waits for each group's scoring and sending
          hand_off = worker._submit_group

          def in_line(*a):
            hand_off(*a)
            worker._harvest(block=True)
          worker._submit_group = in_line
        start = time.monotonic()
        stats = worker.run()
        return time.monotonic() - start, stats.tokens
    finally:
      server.stop(grace=0)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--slots", type=int, default=4)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--max_new_tokens", type=int, default=48)
  ap.add_argument("--verify_ms", type=float, default=20.0)
  ap.add_argument("--straggler_ms", type=float, default=0.0)
  ap.add_argument("--hidden", type=int, default=128)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--allocator", default="fixed", choices=("fixed", "vigor"))
  args = ap.parse_args()
  tokenizer = CharTokenizer()
  config = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=args.hidden,
                       intermediate_size=3 * args.hidden, num_layers=args.layers,
                       num_heads=max(1, args.hidden // 32), num_kv_heads=1,
                       max_position_embeddings=64 + args.max_new_tokens)
  weights = {k: np.asarray(v) for k, v in
             flatten_params(Transformer(config, rngs=nnx.Rngs(0))).items()}
  rows = [("in line, one sample at a time (before)", False, 1, False),
          ("in line, samples side by side", False, 8, False),
          ("beside decoding, samples side by side", True, 8, False)]
  if args.straggler_ms:
    rows = [("beside decoding, one group at a time (before)", True, 8, True),
            ("beside decoding, groups side by side", True, 8, False)]
  if args.allocator == "vigor":
    rows = [("after each round, side by side (before)", False, 8, False),
            ("as each prompt's finish, beside the round", True, 8, False)]
  _run(args, config, weights, tokenizer, True, 8)  # compiles
  print(f"{args.prompts} prompts x {args.samples} samples, {args.slots} at a time, "
        f"{args.verify_ms:g} ms of tests a sample"
        + (f" ({args.straggler_ms:g} ms for one a group)" if args.straggler_ms else "")
        + f", allocator {args.allocator}")
  print(f"{'scoring':42s} {'seconds':>8s} {'tokens/s':>9s} {'speed-up':>9s}")
  base = None
  for name, beside, threads, one_group in rows:
    seconds, tokens = _run(args, config, weights, tokenizer, beside, threads, one_group)
    base = base or seconds
    print(f"{name:42s} {seconds:8.2f} {tokens / seconds:9.0f} {base / seconds:8.2f}x")


if __name__ == "__main__":
  main()
