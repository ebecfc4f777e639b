"""Expert parallelism: the result bytes of the collectives one device takes part in for
one MoE layer's forward and backward (what each op leaves on the device: not its ring
traffic), experts split along their matrices over fsdp (the sorted rows replicated, their
partial products all-reduced) against whole experts per device (`model.expert_parallel`:
the group's tokens gathered, the outputs reduce-scattered back), in one run.

    .venv/bin/python benchmarks/expert_parallel.py                 # Qwen3-30B-A3B's layer
    .venv/bin/python benchmarks/expert_parallel.py --tokens 512,2048

A Qwen3-30B-A3B-shaped layer (128 experts of 2048 x 768, top-8; float32 params, bfloat16
compute as configs/rl_moe.py) on a (data 1, fsdp 8, tensor 1) mesh of 8 host devices,
compiled, not run: the collectives' per-device result shapes in the partitioned program
(all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute) give the bytes.
Both dispatch tokens as on TPU (sorted rows, grouped matmuls). The figures are the
program's, whatever the host: weights cost the same at any batch, tokens grow with it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from rlax_ps import sharding as shd  # noqa: E402
from rlax_ps.models import ModelConfig  # noqa: E402
from rlax_ps.models.transformer import MoE  # noqa: E402

QWEN3_30B = ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                        num_layers=1, num_heads=32, num_kv_heads=4, head_dim=128,
                        architecture="qwen3_moe", qk_norm=True, num_experts=128,
                        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                        param_dtype="float32", dtype="bfloat16")
# A collective's result: one shape, or a tuple of them (XLA merges all-reduces into one).
_COLLECTIVE = re.compile(r"= (\([^()]*\)|\w+\[[\d,]*\]\S*) (all-gather|reduce-scatter|"
                         r"all-reduce|all-to-all|collective-permute)(?:-start)?\((.*)$", re.M)
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
# Groups of one device each (listed, or as an iota [groups,1]): the op moves nothing.
_ALONE = re.compile(r"replica_groups=(\{\{\d+\}(,\{\d+\})*\}|\[\d+,1\]<=)")
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


def collective_bytes(hlo: str) -> int:
  """Bytes of every collective's per-device result (each shape of a tuple) in a compiled
  (partitioned) program, but those of groups of one device."""
  total = 0
  for result, _, rest in _COLLECTIVE.findall(hlo):
    if _ALONE.search(rest):
      continue
    for dtype, dims in _SHAPE.findall(result):
      total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
  return total


def layer_program(config: ModelConfig, mesh, tokens: int) -> str:
  """The compiled forward and backward of one MoE layer on `tokens` tokens a device."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0))))
  specs = shd.named(mesh, shd.param_specs(state, nnx.get_partition_spec(state), mesh))
  rows = NamedSharding(mesh, P(("data", "fsdp")))

  def loss(state, x):
    moe = nnx.merge(graphdef, state)
    weights, chosen, *_ = moe.route(x)
    if config.expert_parallel:
      out = moe.parallel(x, weights, chosen, mesh.abstract_mesh, grouped=True)
    else:
      out = moe.grouped(x, weights, chosen)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  x = jax.ShapeDtypeStruct((tokens * mesh.size, config.hidden_size), jnp.dtype(config.dtype))
  fn = jax.jit(jax.grad(loss), in_shardings=(specs, rows), out_shardings=specs)
  return fn.lower(state, x).compile().as_text()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", default="1024,4096,16384",
                      help="tokens a device holds, comma-separated")
  args = parser.parse_args()
  mesh = shd.make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
  c = QWEN3_30B
  print(f"one MoE layer, forward + backward: {c.num_experts} experts of {c.hidden_size} x "
        f"{c.moe_intermediate_size}, top-{c.num_experts_per_tok}, mesh fsdp=8; collective "
        f"bytes a device")
  print("| tokens a device | experts split (fsdp) | whole experts (expert_parallel) | ratio |")
  print("| --- | --- | --- | --- |")
  for tokens in (int(t) for t in args.tokens.split(",")):
    split = collective_bytes(layer_program(c, mesh, tokens))
    whole = collective_bytes(layer_program(c.replace(expert_parallel=True), mesh, tokens))
    print(f"| {tokens:,} | {split / 2**20:,.1f} MiB | {whole / 2**20:,.1f} MiB | "
          f"{whole / split:.3f}x |", flush=True)


if __name__ == "__main__":
  main()
