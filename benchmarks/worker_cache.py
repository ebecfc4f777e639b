"""A worker's KV cache per token: what the decoding caches hold for the Hub's DeepSeek-V3 and
DeepSeek-V2-Lite configs (no weights) against the decompressed per-head keys and values, and
per chip of a tensor-parallel worker for models with fewer kv heads than chips.

    python benchmarks/worker_cache.py
    python benchmarks/worker_cache.py --gib 40 --tensor 8  # tokens 40 GiB holds; 8 chips

Latent attention caches one head per token and layer, [normed latent, rotary key]
(ModelConfig.kv_cache_layout), read as keys and, in its first kv_lora_rank dims, as values;
the decompressed form held num_heads keys and as many values of the q/k width. On a tensor
axis wider than a model's kv heads, each head is repeated to one per chip (`cache_heads`),
where every chip held them all. Bytes come from the shapes `SharedPrefixCache.empty` makes
(jax.eval_shape), int8's scales included.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from inference_workers.shared_prefix import SharedPrefixCache, cache_heads  # noqa: E402
from rlax_ps.models import config_from_hf  # noqa: E402

# The Hub's config.json (4.x layout; DeepSeek-V3's fp8 quantization_config left out).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "attention_bias": False, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 1408, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400}
HUB_CONFIGS = {"DeepSeek-V3": DEEPSEEK_V3, "DeepSeek-V2-Lite": DEEPSEEK_V2_LITE}


def _gqa(arch: str, hidden: int, heads: int, kv_heads: int, layers: int, **extra) -> dict:
  """A Hub config.json's attention fields (what the cache's shape depends on)."""
  return {"architectures": [arch], "hidden_size": hidden, "num_attention_heads": heads,
          "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "head_dim": 128,
          "intermediate_size": 4 * hidden, "vocab_size": 151936,
          "max_position_embeddings": 40960, "rope_theta": 1e6, **extra}


# Models with fewer kv heads than a worker's chips (their Hub configs' attention fields).
FEW_KV_HEADS = {
    "Qwen3-30B-A3B": _gqa("Qwen3MoeForCausalLM", 2048, 32, 4, 48, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768),
    "Qwen3-235B-A22B": _gqa("Qwen3MoeForCausalLM", 4096, 64, 4, 94, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=1536),
    "Qwen2.5-7B": _gqa("Qwen2ForCausalLM", 3584, 28, 4, 28),  # 28 heads: no split in 8
}


def cache_bytes_per_token_layer(config, kv_dtype: str, heads: int | None = None) -> int:
  """Bytes a worker's cache takes per generated token and layer (one sample's suffix slot,
  keys and values, int8's and fp8's scales included, `heads` kv heads: default the model's), from the
  shapes the cache is made with."""
  shapes = jax.eval_shape(lambda: SharedPrefixCache.empty(config, 1, 1, 1, 1,
                                                          dtype=kv_dtype, heads=heads))
  per_layer = [x for x in jax.tree.leaves((shapes.suffix_k[0],
                                           shapes.suffix_v[0] if shapes.suffix_v else ()))]
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in per_layer))


def decompressed_bytes_per_token_layer(config, kv_dtype: str) -> int:
  """The same for per-head keys (the q/k width) and values (v_head_dim wide), num_heads of
  each: a decompressed cache as an engine that does not pad the values holds it."""
  values = config.num_heads * (config.head_dim + (config.v_head_dim or config.head_dim))
  scales = 2 * config.num_heads * 4 if kv_dtype in ("int8", "float8_e4m3fn") else 0
  return values * jnp.dtype(kv_dtype).itemsize + scales


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gib", type=float, default=16.0, help="cache memory for the tokens column")
  ap.add_argument("--tensor", type=int, default=8, help="chips of a tensor-parallel worker")
  args = ap.parse_args()
  print(f"worker KV cache per token and layer; tokens: how many {args.gib:g} GiB holds over "
        "all layers")
  print(f"{'model':<18}{'kv dtype':<10}{'decompressed B':>16}{'latent B':>10}{'ratio':>8}"
        f"{'tokens before':>15}{'tokens now':>12}")
  for name, fields in HUB_CONFIGS.items():
    config = config_from_hf(fields)
    for kv_dtype in ("bfloat16", "int8"):
      before = decompressed_bytes_per_token_layer(config, kv_dtype)
      now = cache_bytes_per_token_layer(config, kv_dtype)
      budget = args.gib * 2 ** 30
      print(f"{name:<18}{kv_dtype:<10}{before:>16,}{now:>10,}{before / now:>7.1f}x"
            f"{int(budget // (before * config.num_layers)):>15,}"
            f"{int(budget // (now * config.num_layers)):>12,}")
  mesh = jax.sharding.AbstractMesh((1, 1, args.tensor), ("data", "fsdp", "tensor"))
  print(f"\nper chip of a tensor-{args.tensor} worker (bfloat16); tokens: how many "
        f"{args.gib:g} GiB a chip holds over all layers")
  print(f"{'model':<18}{'kv heads':>9}{'held':>6}{'replicated B':>14}{'split B':>10}"
        f"{'ratio':>8}{'tokens before':>15}{'tokens now':>12}")
  for name, fields in FEW_KV_HEADS.items():
    config = config_from_hf(fields)
    heads = cache_heads(config, mesh)
    before = cache_bytes_per_token_layer(config, "bfloat16")  # whole on every chip
    held = cache_bytes_per_token_layer(config, "bfloat16", heads)
    now = held // args.tensor if heads % args.tensor == 0 else held  # else whole on each
    budget = args.gib * 2 ** 30
    print(f"{name:<18}{config.num_kv_heads:>9}{heads:>6}{before:>14,}{now:>10,}"
          f"{before / now:>7.1f}x{int(budget // (before * config.num_layers)):>15,}"
          f"{int(budget // (now * config.num_layers)):>12,}")


if __name__ == "__main__":
  main()
