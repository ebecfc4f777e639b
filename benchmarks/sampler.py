r"""Inference-worker sampler: decode throughput vs HF transformers, shared vs copied prefill,
int8 vs bf16 held weights, in-place 1% update vs full reload, all measured in one run.

  .venv/bin/python benchmarks/sampler.py                               # ~40M Qwen2, CPU
  .venv/bin/python benchmarks/sampler.py --torch_python=/work/torchenv/bin/python
  .venv/bin/python benchmarks/sampler.py --hidden=256 --layers=4 --vocab=16000   # quicker
  python3 benchmarks/sampler.py --dtype=bfloat16 --hidden=2048 --layers=16 --heads=16 \
      --intermediate=5632 --densities=0.01   # ~0.9B, on a GPU (HF generate on it too)

Model: a random Qwen2-family config (tied embeddings, GQA, q/k/v biases). Rows:
  machine: the default device's memory bandwidth (a jitted copy: bytes read + written per
    second) and matmul FLOP/s (a jitted --dtype matmul), measured first in the same run.
  decode, one row per --batches B: greedy generation of B prompts x --prompt_len tokens ->
    --new_tokens tokens; new tokens per second over the whole call (prefill included,
    compile excluded; ours measured before and after HF, best kept, since a shared
    machine's load drifts), ours (--dtype weights, jitted while-loop decode) vs
    `transformers` generate with its KV cache on the same weights (exported with
    save_hf_checkpoint) on the same device kind (CUDA when JAX runs on a GPU), same
    prompts; greedy tokens are compared. torch is used when
    importable here, else through --torch_python (a separate interpreter), else the
    column is skipped with the reason.
  roofline, per decode row: the tokens/s the machine allows: prefill at the matmul rate,
    then each step at the slower of reading the weights and the KV cache at the copy
    bandwidth and its FLOPs at the matmul rate; ours as a fraction of it.
  shared prefill: N=--samples samples of one --shared_prompt_len prompt; prefill once
    (batch 1) vs prefill N copies (batch N), jitted, best of --reps.
  shared end-to-end: the same N samples with --shared_new_tokens new tokens each,
    generate_shared vs generate on N copies of the prompt.
  int8 vs bf16: bytes of held weights, and decode throughput of each held policy.
  update, one pair per --densities d: apply a delta changing ~d of the bf16 elements in
    place (decoded, one donated scatter of the held bits) vs applying the full keyframe
    (reload: copied to the device), best of --reps, each verified as a worker verifies a
    trainer's update: the sealed fingerprints checked on an accelerator, the tensors'
    checksums on the CPU (where a reload is a host alias and a delta costs its decode more);
    and the bytes a worker pulls for each. Both start from bytes in memory: the network
    time of a reload's far larger pull is not counted.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from inference_workers.decoding import prefill
from inference_workers.sampler import generate, generate_shared
from inference_workers.sampling import SamplingParams
from inference_workers.weights import HeldPolicy
from rlax_ps import sync
from rlax_ps.models import ModelConfig, Transformer, flatten_params, save_hf_checkpoint
from roofline import machine_limits, roofline_rate  # noqa: E402 (benchmarks/)

_HIDDEN = flags.DEFINE_integer("hidden", 512, "hidden size")
_LAYERS = flags.DEFINE_integer("layers", 8, "decoder layers")
_HEADS = flags.DEFINE_integer("heads", 8, "query heads (kv heads = heads / 4)")
_INTER = flags.DEFINE_integer("intermediate", 1408, "SwiGLU width")
_VOCAB = flags.DEFINE_integer("vocab", 32000, "vocabulary size")
_BATCHES = flags.DEFINE_list("batches", ["8", "64", "256"], "decode rows: prompts per call")
_PROMPT = flags.DEFINE_integer("prompt_len", 64, "decode row: prompt tokens")
_NEW = flags.DEFINE_integer("new_tokens", 64, "decode row: new tokens per prompt")
_SAMPLES = flags.DEFINE_integer("samples", 16, "shared rows: samples of the one prompt")
_SHARED_PROMPT = flags.DEFINE_integer("shared_prompt_len", 512, "shared rows: prompt tokens")
_SHARED_NEW = flags.DEFINE_integer("shared_new_tokens", 32, "shared end-to-end: new tokens")
_DENSITIES = flags.DEFINE_list("densities", ["0.01", "0.001"],
                               "update rows: fraction of elements changed, one row each")
_REPS = flags.DEFINE_integer("reps", 3, "timed repetitions (best is reported)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "weights and activations (bfloat16 on an accelerator)")
_TORCH_PY = flags.DEFINE_string("torch_python", "", "python with torch + transformers, for the "
                                "HF column when torch is not importable here")


def best_time(fn, reps):
  best, out = float("inf"), None
  for _ in range(reps):
    t = time.perf_counter()
    out = fn()
    jax.block_until_ready(out) if isinstance(out, jax.Array) else None
    best = min(best, time.perf_counter() - t)
  return best, out


HF_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch
    from transformers import AutoModelForCausalLM
    path, prompts, new, reps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dtype, device = getattr(torch, sys.argv[5]), sys.argv[6]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True,
              pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
      model.generate(ids, **kw)
      best = float("inf")
      for _ in range(reps):
        sync(); t = time.perf_counter(); out = model.generate(ids, **kw); sync()
        best = min(best, time.perf_counter() - t)
    print(json.dumps({"seconds": best, "tokens": out[:, ids.shape[1]:].tolist(),
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))
    """)


def hf_generate(path, prompts, new, reps):
  """(result dict, None) from transformers generate, or (None, reason) when unavailable."""
  device = "cuda" if jax.default_backend() == "gpu" else "cpu"
  args = [path, json.dumps(prompts), str(new), str(reps), _DTYPE.value, device]
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    python = sys.executable
  except ImportError as e:
    if not _TORCH_PY.value:
      return None, (f"torch/transformers not importable here ({e}); install the `bench` extra or "
                    f"pass --torch_python")
    python = _TORCH_PY.value
  proc = subprocess.run([python, "-c", HF_SCRIPT, *args], capture_output=True, text=True)
  if proc.returncode:
    return None, f"transformers run failed: {proc.stderr.strip().splitlines()[-1:]}"
  return json.loads(proc.stdout.strip().splitlines()[-1]), None


def decode_rate(model, prompts, new, reps):
  params = SamplingParams(greedy=True, max_new_tokens=new)
  seeds = list(range(len(prompts)))
  generate(model, prompts, seeds, params)  # compile
  t, out = best_time(lambda: generate(model, prompts, seeds, params), reps)
  return len(prompts) * new / t, out


def decode_rows(model, hf_path, prompts, config, bandwidth, flops, reps):
  """The decode rows of one batch size: ours vs HF generate, ours vs the roofline."""
  batch, new = len(prompts), _NEW.value
  ours_rate, ours_out = decode_rate(model, prompts, new, reps)
  hf, reason = hf_generate(hf_path, prompts, new, reps)
  ours_rate = max(ours_rate, decode_rate(model, prompts, new, reps)[0])  # after HF too
  roof = roofline_rate(config, batch, _PROMPT.value, new, bandwidth, flops)
  rows = []
  if hf is None:
    rows.append((f"decode tok/s, batch {batch} (ours vs HF generate)", f"{ours_rate:.0f}",
                 "skipped", "-", ">= 1x"))
    print(f"HF column skipped: {reason}")
  else:
    hf_rate = batch * new / hf["seconds"]
    same = sum(o.tokens.tolist() == h for o, h in zip(ours_out, hf["tokens"]))
    rows.append((f"decode tok/s, batch {batch} (ours vs HF generate)", f"{ours_rate:.0f}",
                 f"{hf_rate:.0f}", f"{ours_rate / hf_rate:.2f}x", ">= 1x"))
    print(f"batch {batch}: HF torch {hf['torch']} ({hf['threads']} threads); greedy rows "
          f"identical to ours: {same}/{batch}", flush=True)
  rows.append((f"decode tok/s, batch {batch} (ours vs roofline)", f"{ours_rate:.0f}",
               f"{roof:.0f}", f"{ours_rate / roof:.2f}", ">= 0.6"))
  return rows


def prefill_time(model, batch, length, reps):
  """Best seconds of the jitted prefill of `batch` rows of `length` tokens."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens, lens):
    logits, _, _ = prefill(nnx.merge(graphdef, state), tokens, lens, length)
    return logits

  tokens = jnp.ones((batch, length), jnp.int32)
  lens = jnp.full((batch,), length, jnp.int32)
  run(state, tokens, lens).block_until_ready()
  t, _ = best_time(lambda: run(state, tokens, lens).block_until_ready(), reps)
  return t


def changed_elements(ch) -> int:
  if ch.kind == "sparse":
    return int(ch.indices.size)
  return 0 if ch.kind == "unchanged" else int(np.prod(ch.shape))


def update_rows(policy, base, keyframe, density, rng, reps):
  """Applying a delta changing ~density of the elements in place vs reloading the
  keyframe (both verified), and the bytes pulled for each."""
  target = {k: np.where(rng.random(v.shape) < density, v * 1.05 + 1e-3, v).astype(np.float32)
            for k, v in base.items()}
  delta = sync.encode(base, target, "bf16", version=1, fingerprints=True)  # as publishers seal
  changed = sum(changed_elements(delta.changes(k)) for k in delta.tensors)

  def in_place():
    policy.apply(keyframe)  # back to v0 (not timed separately: see the reload column)
    t = time.perf_counter()
    policy.apply(delta)
    jax.block_until_ready(list(policy.held_state().values()))
    return time.perf_counter() - t

  def reload():
    t = time.perf_counter()
    policy.apply(keyframe)
    jax.block_until_ready(list(policy.held_state().values()))
    return time.perf_counter() - t

  in_place()  # compiles this size's scatter program
  t_delta, t_full = float("inf"), float("inf")
  for _ in range(reps):  # interleaved: the machine's load drifts
    t_delta, t_full = min(t_delta, in_place()), min(t_full, reload())
  total = sum(int(np.prod(m.shape)) for m in delta.tensors.values())
  share = f"{changed / total:.1%} changed"
  return [(f"apply update ms ({share}: in place vs full reload)", f"{t_delta * 1e3:.1f}",
           f"{t_full * 1e3:.1f}", f"{t_full / t_delta:.2f}x faster", ">= 1x"),
          (f"update MB pulled ({share}: delta vs keyframe)", f"{delta.nbytes / 1e6:.2f}",
           f"{keyframe.nbytes / 1e6:.1f}", f"{keyframe.nbytes / delta.nbytes:.0f}x smaller", "-")]


def main(argv):
  del argv
  reps = _REPS.value
  heads = _HEADS.value
  config = ModelConfig(vocab_size=_VOCAB.value, hidden_size=_HIDDEN.value,
                       intermediate_size=_INTER.value, num_layers=_LAYERS.value, num_heads=heads,
                       num_kv_heads=max(1, heads // 4), qkv_bias=True, tie_word_embeddings=True,
                       max_position_embeddings=4096, rope_theta=1e6, architecture="qwen2",
                       param_dtype=_DTYPE.value, dtype=_DTYPE.value)
  print(f"model: Qwen2-style, {config.num_params / 1e6:.1f}M params (hidden {config.hidden_size}, "
        f"{config.num_layers} layers, {heads}/{config.num_kv_heads} heads, vocab "
        f"{config.vocab_size}, {_DTYPE.value}); {jax.devices()[0].device_kind}, "
        f"{os.cpu_count()} cpus", flush=True)
  model = Transformer(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  bandwidth, flops = machine_limits(reps, best_time, _DTYPE.value)
  print(f"machine: memory {bandwidth / 1e9:.1f} GB/s (the fastest copy or read), {_DTYPE.value} matmul "
        f"{flops / 1e9:.1f} GFLOP/s", flush=True)
  rows = []

  # 1. decode throughput vs transformers, and against the machine's roofline.
  batches = [int(b) for b in _BATCHES.value]
  prompts = rng.integers(3, config.vocab_size, (max(batches), _PROMPT.value)).tolist()
  with tempfile.TemporaryDirectory() as tmp:
    save_hf_checkpoint(model, tmp)
    for batch in batches:
      rows += decode_rows(model, tmp, prompts[:batch], config, bandwidth, flops, reps)
  print(f"decode shape: prompt {_PROMPT.value}, new {_NEW.value}", flush=True)
  prompts = prompts[:batches[0]]

  # 2. shared prefill: one prompt once vs N copies.
  n, plen = _SAMPLES.value, _SHARED_PROMPT.value
  t_one = prefill_time(model, 1, plen, reps)
  t_copies = prefill_time(model, n, plen, reps)
  rows.append((f"prefill ms, N={n} x {plen}-token prompt (shared vs copies)", f"{t_one * 1e3:.0f}",
               f"{t_copies * 1e3:.0f}", f"{t_copies / t_one:.1f}x less", f">= {0.8 * n:.1f}x"))
  print("shared prefill done", flush=True)

  # 3. shared end-to-end.
  prompt = rng.integers(3, config.vocab_size, (plen,)).tolist()
  params = SamplingParams(max_new_tokens=_SHARED_NEW.value)
  seeds = [list(range(n))]
  generate_shared(model, [prompt], n, seeds, params)
  t_shared, _ = best_time(lambda: generate_shared(model, [prompt], n, seeds, params), reps)
  generate(model, [prompt] * n, seeds[0], params)
  t_unshared, _ = best_time(lambda: generate(model, [prompt] * n, seeds[0], params), reps)
  rows.append((f"N={n} samples end-to-end ms, {_SHARED_NEW.value} new (shared vs copies)",
               f"{t_shared * 1e3:.0f}", f"{t_unshared * 1e3:.0f}",
               f"{t_unshared / t_shared:.1f}x faster", "-"))
  print("shared end-to-end done", flush=True)

  # 4. int8 vs bf16 held weights; 5. in-place updates vs reload.
  base = {k: np.asarray(v, np.float32) for k, v in flatten_params(model).items()}
  del model
  policies, rates = {}, {"bf16": 0.0, "int8": 0.0}
  for fmt in ("bf16", "int8"):
    policies[fmt] = HeldPolicy(config, fmt)
    policies[fmt].apply(sync.encode(None, base, fmt, version=0))
  for fmt in ("bf16", "int8", "bf16", "int8"):  # interleaved: the machine's load drifts
    rates[fmt] = max(rates[fmt], decode_rate(policies[fmt].model, prompts, _NEW.value, reps)[0])
  b16, i8 = policies["bf16"].nbytes, policies["int8"].nbytes
  rows.append(("held weights MB (int8 vs bf16)", f"{i8 / 1e6:.1f}", f"{b16 / 1e6:.1f}",
               f"{b16 / i8:.2f}x smaller", "~2x"))
  rows.append(("decode tok/s (int8 vs bf16 held)", f"{rates['int8']:.0f}", f"{rates['bf16']:.0f}",
               f"{rates['int8'] / rates['bf16']:.2f}x", "-"))
  print("int8/bf16 done", flush=True)

  policy = policies["bf16"]
  del policies["int8"]
  keyframe = sync.encode(None, base, "bf16", version=0, fingerprints=True)
  for density in map(float, _DENSITIES.value):
    rows += update_rows(policy, base, keyframe, density, rng, reps)

  widths = [max(len(str(r[i])) for r in rows + [HEADER]) for i in range(5)]
  print()
  for r in [HEADER] + rows:
    print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


HEADER = ("measurement", "ours", "baseline", "ratio", "target")

if __name__ == "__main__":
  app.run(main)
