"""Routing replay: how far the trainer's log-probs of sampled tokens sit from the workers'
own, with the trainer's routers picking each token's experts against replaying the workers'
picks, measured in one run on the same samples.

    python benchmarks/routing_replay.py                  # int8 workers (publish.format=int8)
    python benchmarks/routing_replay.py --format bf16    # bf16 workers
    python benchmarks/routing_replay.py --layers 4 --prompts 8

A mixture-of-experts model (random weights, float32 trainer) is published to a worker
(`HeldPolicy`) in the chosen format; the worker samples `--samples` answers per prompt at
temperature 1 and records its routes; the trainer's packed forward (`rl_loss.response_logprobs`)
scores them both ways. Rows: the token-mean |log pi_trainer - log pi_worker|, the behaviour
KL estimate, the share of tokens whose ratio pi_trainer / pi_worker leaves [0.8, 1.25] and
[0.5, 2] (what masked importance sampling would drop), the largest |difference|, and the share
of replayed experts the trainer's routers pick themselves.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from inference_workers.sampler import generate_shared  # noqa: E402
from inference_workers.sampling import SamplingParams  # noqa: E402
from inference_workers.weights import HeldPolicy  # noqa: E402
from rlax_ps import sync  # noqa: E402
from rlax_ps.models import ModelConfig, Transformer, flatten_params  # noqa: E402
from rlax_ps.train.rl_loss import response_logprobs  # noqa: E402
from rlax_ps.train.rollouts import BatchShape, Group, build_batch  # noqa: E402


def mismatch(trainer: np.ndarray, worker: np.ndarray) -> dict[str, float]:
  """Statistics of log pi_trainer - log pi_worker over the sampled tokens (flat arrays)."""
  d = trainer - worker
  ratio = np.exp(d)
  return {"mean |dlogp|": float(np.abs(d).mean()),
          "behaviour KL (k1)": float(-d.mean()),
          "ratio outside [0.8, 1.25]": float(np.mean((ratio < 0.8) | (ratio > 1.25))),
          "ratio outside [0.5, 2]": float(np.mean((ratio < 0.5) | (ratio > 2.0))),
          "max |dlogp|": float(np.abs(d).max())}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--format", choices=("int8", "bf16"), default="int8")
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--experts", type=int, default=32)
  ap.add_argument("--top_k", type=int, default=4)
  ap.add_argument("--prompts", type=int, default=16)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=32)
  ap.add_argument("--new_tokens", type=int, default=64)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()

  h = args.hidden
  config = ModelConfig(vocab_size=1024, hidden_size=h, intermediate_size=2 * h,
                       num_layers=args.layers, num_heads=h // 32, num_kv_heads=h // 64,
                       head_dim=32, qk_norm=True, architecture="qwen3_moe",
                       num_experts=args.experts, num_experts_per_tok=args.top_k,
                       moe_intermediate_size=h // 2, norm_topk_prob=True,
                       max_position_embeddings=args.prompt_len + args.new_tokens)
  model = Transformer(config, rngs=nnx.Rngs(args.seed))
  params = {k: np.asarray(v) for k, v in flatten_params(model).items()}
  policy = HeldPolicy(config, args.format)
  policy.apply(sync.encode(None, params, args.format, version=0))

  rng = np.random.default_rng(args.seed)
  prompts = rng.integers(3, config.vocab_size, (args.prompts, args.prompt_len)).tolist()
  seeds = rng.integers(0, 2 ** 31, (args.prompts, args.samples)).tolist()
  sampled = generate_shared(policy.model, prompts, args.samples, seeds,
                            SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens),
                            record_routes=True)

  shape = BatchShape(groups=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                     response_len=args.new_tokens, moe_layers=len(config.moe_layers),
                     top_k=args.top_k, num_experts=args.experts)

  def batch(replay: bool):
    groups = []
    for i, (prompt, got) in enumerate(zip(prompts, sampled)):
      routes = dict(prompt_routes=got[0].prompt_routes,
                    response_routes=tuple(s.routes for s in got)) if replay else {}
      groups.append(Group(i, np.asarray(prompt, np.int32), tuple(s.tokens for s in got),
                          tuple(s.logprobs for s in got), np.zeros(len(got), np.float32), 0,
                          **routes))
    return build_batch(groups, shape)

  graphdef, state = nnx.split(model)
  score = jax.jit(lambda st, b: response_logprobs(st, graphdef, b, with_stats=True))
  worker = np.concatenate([s.logprobs for got in sampled for s in got])
  columns = {}
  for name, replay in (("own routers", False), ("replayed", True)):
    b = batch(replay)
    logp, stats = jax.device_get(score(state, b))
    lens = b["response_lens"].reshape(-1)
    trainer = np.concatenate([logp[row, :n] for row, n in enumerate(lens) if n])
    columns[name] = mismatch(trainer, worker)
    if replay:
      columns[name]["router agreement"] = float(stats["router_agreement"])
  columns["own routers"]["router agreement"] = float("nan")

  print(f"routing replay: {args.format} workers, {args.layers} layers x {args.experts} experts "
        f"top-{args.top_k}, hidden {h} (random weights); {len(worker)} sampled tokens of "
        f"{args.prompts} prompts x {args.samples} samples at T=1; backend {jax.default_backend()}")
  print(f"{'log pi_trainer - log pi_worker':28} {'own routers':>12} {'replayed':>12} "
        f"{'own / replayed':>15}")
  for key in columns["replayed"]:
    own, rep = columns["own routers"][key], columns["replayed"][key]
    ratio = f"{own / rep:.1f}x" if rep > 0 and own > 0 else "-"
    print(f"{key:28} {own:12.3g} {rep:12.3g} {ratio:>15}")


if __name__ == "__main__":
  main()
