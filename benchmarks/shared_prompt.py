"""Shared-prompt packing: whole-model training step, packed [P + N*R] vs N copies.

CPU (default): a small Llama-style model, forward+backward of the summed response
log-probs; FLOPs from XLA's cost analysis and measured wall time, each as the ratio
N-copies / packed, printed next to rho = N(P+R)/(P+NR). Targets: FLOP ratio >= 0.9 rho,
time ratio >= 0.7 rho.
  .venv/bin/python benchmarks/shared_prompt.py              # the default sizes
  .venv/bin/python benchmarks/shared_prompt.py --scale=4    # P and R divided by 4
Accelerator: --backend=tpu|gpu adds attention-kernel timings (fwd+bwd): the packed
kernel (Pallas on TPU, XLA two-pass on GPU) against JAX's own splash (TPU) / cuDNN
flash (GPU) attention on N copies, and runs the model step with a larger bf16 model.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_ps.kernels.dispatch import shared_prompt_attention
from rlax_ps.kernels.layout import make_layout
from rlax_ps.kernels.packing import pack_group, packed_response_logprobs
from rlax_ps.models import ModelConfig, Transformer

SIZES = ((8, 512, 128), (16, 1024, 256), (16, 2048, 128))


def _time(fn, *args, reps):
  return _time_pair(fn, None, *args, reps=reps)[0]


def _time_pair(fn_a, fn_b, *args, reps):
  """Best-of-reps wall time of fn_a (and fn_b), runs interleaved so that load from
  other processes on a shared machine hits both alike."""
  fns = [f for f in (fn_a, fn_b) if f is not None]
  for f in fns:
    jax.block_until_ready(f(*args))  # compile + warm up
  times = [[] for _ in fns]
  for _ in range(reps):
    for f, ts in zip(fns, times):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      ts.append(time.perf_counter() - t0)
  return [min(ts) for ts in times] + [None] * (2 - len(fns))


def _compile(fn, *args):
  """Ahead-of-time compile once: FLOPs from XLA's cost analysis and the callable to time."""
  compiled = fn.lower(*args).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return compiled, float(cost["flops"])


def _model_config(size):
  if size == "small":
    return ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=32)
  return ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=4,
                     num_heads=8, num_kv_heads=8, head_dim=128, param_dtype="bfloat16",
                     dtype="bfloat16")


def _step_fns(graphdef, n, p, r, attn_backend):
  """Jitted grad-of-log-prob steps: packed and N copies (the stock model, dense mask)."""
  plen = np.array([p], np.int32)
  rlen = np.full((1, n), r, np.int32)

  def packed_loss(state, prompt, responses):
    tokens, lay = pack_group(prompt, plen, responses, rlen)
    model = nnx.merge(graphdef, state)
    return packed_response_logprobs(model, tokens, responses, lay, backend=attn_backend).sum()

  def copies_loss(state, prompt, responses):
    rows = jnp.concatenate([jnp.broadcast_to(prompt, (n, p)), responses[0]], axis=1)
    logits = nnx.merge(graphdef, state)(rows)
    logp = jax.nn.log_softmax(logits[:, p - 1:p + r - 1], axis=-1)
    return jnp.take_along_axis(logp, responses[0][..., None], axis=-1).sum()

  return jax.jit(jax.grad(packed_loss)), jax.jit(jax.grad(copies_loss))


def model_rows(size, scale, reps):
  cfg = _model_config(size)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  attn_backend = "auto"
  rows = []
  for n, p, r in SIZES:
    p, r = max(p // scale, 1), max(r // scale, 1)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (1, p)), jnp.int32)
    responses = jnp.asarray(rng.integers(1, cfg.vocab_size, (1, n, r)), jnp.int32)
    packed, copies = _step_fns(graphdef, n, p, r, attn_backend)
    args = (state, prompt, responses)
    rho = n * (p + r) / (p + n * r)
    try:
      packed, f_packed = _compile(packed, *args)
      copies, f_copies = _compile(copies, *args)
      f_ratio = f_copies / f_packed
      t_packed, t_copies = _time_pair(packed, copies, *args, reps=reps)
    except Exception as e:  # report and keep going: device time is scarce
      print(f"  model step failed at N={n} P={p} R={r}: {type(e).__name__}: {str(e)[:300]}")
      f_ratio = t_packed = t_copies = float("nan")
    rows.append((n, p, r, rho, f_ratio, t_copies, t_packed))
    print(f"  done N={n} P={p} R={r}", flush=True)
  return rows


def _attention_inputs(n, p, r, h, d, dtype):
  ks = jax.random.split(jax.random.key(0), 3)
  length = p + n * r
  return [jax.random.normal(kk, (1, length, h, d), dtype) for kk in ks]


def _pallas_backend(backend):
  return "pallas_tpu" if backend == "tpu" else "pallas_gpu"


def _flash_on_copies(backend, n, p, r, h, d):
  """JAX's own fused attention on N causal [P+R] rows: splash (TPU) or cuDNN (GPU)."""
  if backend == "tpu":
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    mask = sm.MultiHeadMask([sm.CausalMask((p + r, p + r)) for _ in range(h)])
    splash = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1)

    def loss(q, k, v):
      fn = jax.vmap(lambda a, b, c: splash(a * d ** -0.5, b, c))
      tr = lambda x: jnp.swapaxes(x, 1, 2)
      return fn(tr(q), tr(k), tr(v)).astype(jnp.float32).sum()
    return "splash", loss

  def loss(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                        implementation="cudnn").astype(jnp.float32).sum()
  return "cudnn", loss


def kernel_rows(backend, scale, reps):
  """Attention only, fwd+bwd: packed Pallas kernel and packed XLA two-pass vs JAX's
  flash/splash on N copies."""
  h, d, dtype = 8, 128, jnp.bfloat16
  rows = []
  for n, p, r in SIZES:
    p, r = max(p // scale, 1), max(r // scale, 1)
    q, k, v = _attention_inputs(n, p, r, h, d, dtype)
    lay = make_layout(np.array([p]), np.full((1, n), r), p, r)
    times = {}
    for name in (_pallas_backend(backend), "xla"):
      loss = lambda q, k, v, name=name: shared_prompt_attention(
          q, k, v, lay, backend=name)[0].astype(jnp.float32).sum()
      try:
        times[name] = _time(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, reps=reps)
      except Exception as e:  # keep the other columns when one path fails on this device
        print(f"  {name} failed at N={n} P={p} R={r}: {type(e).__name__}: {str(e)[:300]}")
        times[name] = float("nan")
    ref_name, ref_loss = _flash_on_copies(backend, n, p, r, h, d)
    qc, kc, vc = (jnp.broadcast_to(x[:, :p + r], (n, p + r, h, d)) for x in (q, k, v))
    try:
      t_ref = _time(jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2))), qc, kc, vc, reps=reps)
    except Exception as e:
      print(f"  {ref_name} failed at N={n} P={p} R={r}: {type(e).__name__}: {str(e)[:300]}")
      t_ref = float("nan")
    rho = n * (p + r) / (p + n * r)
    rows.append((n, p, r, rho, ref_name, t_ref, times[_pallas_backend(backend)], times["xla"]))
    print(f"  kernels done N={n} P={p} R={r}", flush=True)
  return rows


def accelerator_check(backend):
  """Packed attention (Pallas kernel and XLA two-pass) on this device vs the N-copies
  reference computed in f32: max |error| of o, lse, dq, dk, dv."""
  from rlax_ps.kernels.reference import n_copies_attention
  n, p, r, h, hkv, d = 4, 200, 100, 8, 2, 128
  lay = make_layout(np.array([200, 77]), np.array([[100, 1, 50, 0], [3, 100, 99, 64]]), p, r)
  ks = jax.random.split(jax.random.key(1), 4)
  length = p + n * r
  base = [jax.random.normal(ks[0], (2, length, h, d)), jax.random.normal(ks[1], (2, length, hkv, d)),
          jax.random.normal(ks[2], (2, length, hkv, d))]
  do = jax.random.normal(ks[3], (2, length, h, d))
  valid = np.asarray(lay.valid())

  def run(fn, *a):
    (o, lse), pull = jax.vjp(fn, *a)
    return (o, lse, *pull((do.astype(o.dtype), jnp.where(jnp.isneginf(lse), 0.0, 1.0))))

  out = []
  for dtype in (jnp.float32, jnp.bfloat16):
    args = [x.astype(dtype) for x in base]
    with jax.default_matmul_precision("highest"):
      want = jax.jit(functools.partial(run, lambda q, k, v: n_copies_attention(q, k, v, lay)))(
          *[a.astype(jnp.float32) for a in args])
    for name in (_pallas_backend(backend), "xla"):
      try:
        with jax.default_matmul_precision("highest"):
          got = jax.jit(functools.partial(run, lambda q, k, v, name=name: shared_prompt_attention(
              q, k, v, lay, backend=name)))(*args)
      except Exception as e:
        print(f"  {name} {jnp.dtype(dtype).name} failed: {type(e).__name__}: {str(e)[:400]}")
        continue
      errs = []
      for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if i == 1:
          g, w = g[valid], w[valid]
        errs.append(float(np.max(np.abs(g - w))))
      out.append((name, jnp.dtype(dtype).name, errs))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--backend", choices=("cpu", "tpu", "gpu"), default="cpu")
  parser.add_argument("--scale", type=int, default=1, help="divide P and R by this")
  parser.add_argument("--reps", type=int, default=3, help="timed runs; the best is reported")
  parser.add_argument("--model", choices=("auto", "small", "large"), default="auto",
                      help="small: 2x128 Llama (CPU default); large: 4x1024 bf16 (accelerators)")
  args = parser.parse_args()
  if args.backend == "cpu":
    jax.config.update("jax_platforms", "cpu")
  print(f"devices: {jax.devices()}  scale={args.scale}")
  if args.backend != "cpu":
    print("\npacked attention on this device vs N-copies reference (f32 math), max |error|")
    print(f"{'path':>10} {'dtype':>8} {'o':>9} {'lse':>9} {'dq':>9} {'dk':>9} {'dv':>9}")
    for path, name, errs in accelerator_check(args.backend):
      print(f"{path:>10} {name:>8} " + " ".join(f"{e:>9.2e}" for e in errs), flush=True)
    krows = kernel_rows(args.backend, args.scale, args.reps)
    print("\nattention only (fwd+bwd, bf16, 8 heads x 128, 1 group): JAX's fused attention on "
          "N copies vs the packed Pallas kernel and the packed XLA two-pass path")
    print(f"{'N':>3} {'P':>5} {'R':>4} {'rho':>6} | {'ref':>6} {'t ref ms':>9} "
          f"{'t pallas ms':>11} {'ref/pallas':>10} {'/rho':>5} | {'t xla ms':>9} {'ref/xla':>7}")
    for n, p, r, rho, name, tr, tp, tx in krows:
      print(f"{n:>3} {p:>5} {r:>4} {rho:>6.2f} | {name:>6} {tr * 1e3:>9.3f} {tp * 1e3:>11.3f} "
            f"{tr / tp:>10.2f} {tr / tp / rho:>5.2f} | {tx * 1e3:>9.3f} {tr / tx:>7.2f}")

  size = args.model if args.model != "auto" else ("small" if args.backend == "cpu" else "large")
  rows = model_rows(size, args.scale, args.reps)
  print("\nwhole-model train step (fwd+bwd of response log-probs), N copies / packed")
  print(f"{'N':>3} {'P':>5} {'R':>4} {'rho':>6} | {'FLOP ratio':>10} {'/rho':>5} | "
        f"{'t copies s':>10} {'t packed s':>10} {'t ratio':>7} {'/rho':>5}")
  for n, p, r, rho, fr, tc, tp in rows:
    print(f"{n:>3} {p:>5} {r:>4} {rho:>6.2f} | {fr:>10.2f} {fr / rho:>5.2f} | "
          f"{tc:>10.4f} {tp:>10.4f} {tc / tp:>7.2f} {tc / tp / rho:>5.2f}")
  print("targets: FLOP ratio/rho >= 0.9, time ratio/rho >= 0.7")


if __name__ == "__main__":
  main()
