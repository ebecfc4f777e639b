"""The random-weight Qwen2-shaped model, prompts and stop tokens the sampling benchmarks
draw with (continuous_batching.py, multi_turn.py), and their flags. A random model's
next-token distribution is broad, so making --stop_frac of the vocabulary stop tokens gives
each token that chance of ending a response (or a turn)."""

from __future__ import annotations

import argparse

import numpy as np
from flax import nnx

from inference_workers.sampling import SamplingParams
from rlax_ps.models import ModelConfig, Transformer


def add_flags(ap: argparse.ArgumentParser, max_new_tokens: int) -> None:
  ap.add_argument("--prompt_len", type=int, default=48)
  ap.add_argument("--max_new_tokens", type=int, default=max_new_tokens)
  ap.add_argument("--stop_frac", type=float, default=1 / 48)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--reps", type=int, default=2)


def model_prompts_params(args) -> tuple[Transformer, list[list[int]], SamplingParams]:
  """The model (float32), args.prompts random prompts, and T=1 sampling to the budget."""
  config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=3 * args.hidden, num_layers=args.layers,
                       num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 256),
                       architecture="qwen2", qkv_bias=True, dtype="float32",
                       param_dtype="float32",
                       max_position_embeddings=args.prompt_len + args.max_new_tokens)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, args.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
  stops = tuple(range(int(round(args.stop_frac * args.vocab))))
  return (Transformer(config, rngs=nnx.Rngs(0)), prompts,
          SamplingParams(max_new_tokens=args.max_new_tokens, stop_tokens=stops))
