"""RL step memory: the trainer's loss-and-gradient program with the memory settings
(rl.micro_batches, loss.logits_chunk, loss.remat, model.lora_rank) against the same program
without them, and the trainer's resident state of an 8B model trained whole or by LoRA, in
one table (each block's ratios to its first row).

XLA's own accounting of the compiled program (`memory_analysis()`: temporary buffers, the
activations and logits a step holds) for a long-response, large-vocabulary batch, each
setting alone and all together, as a ratio to the whole-batch program (the settings give
the same loss and gradient: tests/train/test_rl_loss.py, tests/kernels/). Compiles only,
runs nothing (the baseline would not fit this machine), so the figures do not depend on
the host's load. The state rows are shapes only (jax.eval_shape of the trainer's init): the
params, AdamW's two moments and one gradient of what trains, in the recipes' dtypes.
  .venv/bin/python benchmarks/rl_step_memory.py            # 8 groups x 8 x 512 tokens, 32k vocab
  .venv/bin/python benchmarks/rl_step_memory.py --scale=2  # responses and vocab halved
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_ps import optim
from rlax_ps.models import ModelConfig, Transformer
from rlax_ps.train.rl_loss import LossConfig, micro_batched_loss_and_grad, rl_loss
from rlax_ps.train.rollouts import BatchShape, Group, build_batch
from rlax_ps.train.state import make_init_fn
from rlax_ps.train.trainable import split_trainable, trainable_value_and_grad


def _batch(groups: int, samples: int, prompt: int, response: int, vocab: int) -> dict:
  rng = np.random.default_rng(0)
  gs = [Group(i, rng.integers(1, vocab, prompt).astype(np.int32),
              tuple(rng.integers(1, vocab, response).astype(np.int32) for _ in range(samples)),
              tuple(np.full(response, -3.0, np.float32) for _ in range(samples)),
              rng.integers(0, 2, samples).astype(np.float32), 0) for i in range(groups)]
  shape = BatchShape(groups=groups, samples=samples, prompt_len=prompt, response_len=response)
  return {k: jnp.asarray(v) for k, v in build_batch(gs, shape).items()}


def _program(graphdef, params, batch, cfg: LossConfig, micro: int):
  if micro == 1:
    fn = trainable_value_and_grad(lambda p: rl_loss(p, graphdef, batch, None, num_groups=len(
        batch["row_group"]), cfg=cfg))
  else:
    def fn(p):
      return micro_batched_loss_and_grad(p, graphdef, batch, None,
                                         num_groups=len(batch["row_group"]), cfg=cfg,
                                         micro_batches=micro)
  return jax.jit(fn).lower(params).compile()


def step_rows(scale: int) -> tuple[str, list[tuple]]:
  """(what was compiled, (setting, XLA temp bytes) per setting) of the loss-and-gradient
  program, the whole-batch baseline first."""
  groups, samples, prompt = 8, 8, 64
  response, vocab = 512 // scale, 32768 // scale
  config = ModelConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_layers=4,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=8192)
  graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  params = state.to_pure_dict()
  batch = _batch(groups, samples, prompt, response, vocab)
  lora_graphdef, lora_state = nnx.split(Transformer(config.replace(lora_rank=16),
                                                    rngs=nnx.Rngs(0)))
  lora = (lora_graphdef, lora_state.to_pure_dict())
  cases = [("whole batch (baseline)", 1, {}, None),
           ("loss.logits_chunk=256", 1, dict(logits_chunk=256), None),
           ("loss.remat", 1, dict(remat=True), None),
           ("rl.micro_batches=8", 8, {}, None),
           ("all three", 8, dict(logits_chunk=256, remat=True), None),
           ("model.lora_rank=16", 1, {}, lora)]
  rows = []
  for name, micro, kw, model in cases:
    g, p = model or (graphdef, params)
    compiled = _program(g, p, batch, LossConfig(backend="xla", **kw), micro)
    rows.append((name, compiled.memory_analysis().temp_size_in_bytes))
  return (f"step temp: {groups} groups x {samples} samples, prompt {prompt}, response "
          f"{response} tokens, vocab {vocab}; model {config.num_params / 1e6:.1f}M params, "
          f"{config.num_layers} layers (XLA temp of the compiled program)"), rows


def state_bytes(config: ModelConfig) -> tuple[int, int, int]:
  """(params, optimizer state, one gradient of the trainable params) in bytes."""
  optimizer = optim.make_optimizer({}, 100)
  state = jax.eval_shape(make_init_fn(config, optimizer), jax.random.PRNGKey(0))
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  return size(state.params), size(state.opt_state), size(split_trainable(state.params)[0])


def state_rows() -> tuple[str, list[tuple]]:
  """(what was measured, (setting, total, params, optimizer, gradient bytes) per setting) of the
  trainer's resident state of a Qwen3-8B-shaped model, trained whole or by LoRA (rank 32 on
  all seven projections), float32 params as configs/rl_instruct.py, and with the frozen base
  in bfloat16 as configs/rl_lora.py (float32 adapters); the whole model first."""
  shape = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                      num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True,
                      architecture="qwen3")
  lora = shape.replace(lora_rank=32)
  rows = []
  for name, config in (("whole model (baseline)", shape), ("LoRA rank 32", lora),
                       ("LoRA rank 32, bf16 base", lora.replace(param_dtype="bfloat16"))):
    params, opt, grad = state_bytes(config)
    rows.append((name, params + opt + grad, params, opt, grad))
  return (f"state: {shape.num_params / 1e9:.1f}B-param Qwen3-8B shape (AdamW moments and one "
          f"gradient of what trains; shapes only)"), rows


def table(blocks: list[tuple[str, str, list[tuple]]]) -> list[str]:
  """The lines of one table of `blocks` (name, unit "MiB" or "GiB", rows of (setting, total
  bytes, and optionally params, optimizer, gradient bytes)), each row's total as a ratio to
  the first row of its block."""
  lines = [f"{'':<11} {'setting':<26} {'total':>13} {'params':>8} {'optimizer':>10} "
           f"{'gradient':>9} {'vs baseline':>12}"]
  for name, unit, rows in blocks:
    div = 2**20 if unit == "MiB" else 2**30
    for setting, total, *parts in rows:
      split = ([f"{parts[0] / div:>8.1f}", f"{parts[1] / div:>10.2f}", f"{parts[2] / div:>9.2f}"]
               if parts else [f"{'-':>8}", f"{'-':>10}", f"{'-':>9}"])
      lines.append(f"{name:<11} {setting:<26} {total / div:>9.1f} {unit} {' '.join(split)} "
                   f"{total / rows[0][1]:>11.3f}x")
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--scale", type=int, default=1, help="divide responses and vocab by this")
  args = parser.parse_args()
  step_what, steps = step_rows(args.scale)
  state_what, states = state_rows()
  print(f"RL step memory; {step_what}; {state_what}")
  print("\n".join(table([("step temp", "MiB", steps), ("state", "GiB", states)])))


if __name__ == "__main__":
  main()
