"""RL step memory: the trainer's loss-and-gradient program with the memory settings
(rl.micro_batches, loss.logits_chunk, loss.remat, model.lora_rank) against the same program
without them, and the trainer's resident state of an 8B model trained whole or by LoRA.

XLA's own accounting of the compiled program (`memory_analysis()`: temporary buffers, the
activations and logits a step holds) for a long-response, large-vocabulary batch, each
setting alone and all together, as a ratio to the whole-batch program (the settings give
the same loss and gradient: tests/train/test_rl_loss.py, tests/kernels/). Compiles only,
runs nothing (the baseline would not fit this machine), so the figures do not depend on
the host's load. The state table is shapes only (jax.eval_shape of the trainer's init): the
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--scale", type=int, default=1, help="divide responses and vocab by this")
  args = parser.parse_args()
  groups, samples, prompt = 8, 8, 64
  response, vocab = 512 // args.scale, 32768 // args.scale
  config = ModelConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_layers=4,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=8192)
  graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
  params = state.to_pure_dict()
  batch = _batch(groups, samples, prompt, response, vocab)
  print(f"batch: {groups} groups x {samples} samples, prompt {prompt}, response {response} "
        f"tokens, vocab {vocab}; model {config.num_params / 1e6:.1f}M params, "
        f"{config.num_layers} layers")
  lora_graphdef, lora_state = nnx.split(Transformer(config.replace(lora_rank=16),
                                                    rngs=nnx.Rngs(0)))
  lora = (lora_graphdef, lora_state.to_pure_dict())
  cases = [("whole batch (baseline)", 1, {}, None),
           ("loss.logits_chunk=256", 1, dict(logits_chunk=256), None),
           ("loss.remat", 1, dict(remat=True), None),
           ("rl.micro_batches=8", 8, {}, None),
           ("all three", 8, dict(logits_chunk=256, remat=True), None),
           ("model.lora_rank=16", 1, {}, lora)]
  base = None
  print(f"{'setting':<26} {'temp MiB':>10} {'vs baseline':>12}")
  for name, micro, kw, model in cases:
    g, p = model or (graphdef, params)
    compiled = _program(g, p, batch, LossConfig(backend="xla", **kw), micro)
    temp = compiled.memory_analysis().temp_size_in_bytes
    base = base or temp
    print(f"{name:<26} {temp / 2**20:>10.1f} {temp / base:>11.3f}x")
  state_table()


def state_bytes(config: ModelConfig) -> tuple[int, int, int]:
  """(params, optimizer state, one gradient of the trainable params) in bytes."""
  optimizer = optim.make_optimizer({}, 100)
  state = jax.eval_shape(make_init_fn(config, optimizer), jax.random.PRNGKey(0))
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  return size(state.params), size(state.opt_state), size(split_trainable(state.params)[0])


def state_table() -> None:
  """The trainer's resident state of a Qwen3-8B-shaped model, trained whole or by LoRA
  (rank 32 on all seven projections), float32 params as configs/rl_instruct.py, and with the
  frozen base in bfloat16 as configs/rl_lora.py (float32 adapters)."""
  shape = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                      num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True,
                      architecture="qwen3")
  print(f"\ntrainer state, {shape.num_params / 1e9:.1f}B-param Qwen3-8B shape (GiB; AdamW "
        f"moments and one gradient of what trains):")
  print(f"{'':<26} {'params':>8} {'optimizer':>10} {'gradient':>9} {'total':>8} {'vs whole':>9}")
  whole = None
  lora = shape.replace(lora_rank=32)
  for name, config in (("whole model", shape), ("LoRA rank 32", lora),
                       ("LoRA rank 32, bf16 base", lora.replace(param_dtype="bfloat16"))):
    params, opt, grad = state_bytes(config)
    total = params + opt + grad
    whole = whole or total
    print(f"{name:<26} {params / 2**30:>8.1f} {opt / 2**30:>10.2f} {grad / 2**30:>9.2f} "
          f"{total / 2**30:>8.1f} {total / whole:>8.3f}x")


if __name__ == "__main__":
  main()
