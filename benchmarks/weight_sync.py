r"""Weight-sync codec: payload against full bf16 and against the information bound; encode,
apply and the trainer's publish path against a plain memory copy, all in one run.

  .venv/bin/python benchmarks/weight_sync.py                      # 100M bf16 elements
  .venv/bin/python benchmarks/weight_sync.py --elements=10000000 --real_sizes=tiny

Synthetic rows: weights ~ N(0, 0.02) in float32, rounded to bf16, then one Adam-like step
w -= lr * m / (sqrt(v) + eps) with lr calibrated so that 0.1%, 1%, 3%, 10% of the bf16
elements change. Real rows: the SFT trainer (configs/sft_tiny.py) after 10 steps at an
RL-like learning rate, one more step, on the tiny model (0.4M parameters: fixed costs
show) and at 38M parameters (76 MB of bf16).
Bound = sum over tensors of N*H(d) + nnz*H(v) (d: the share of changed elements; H(v): the
zeroth-order entropy of the changed elements' wrapping bit-pattern offsets).
Throughput columns are a copy's time over the operation's, for the same held bytes
(np.copyto of the row's base state into a spare one), best of --reps, round-robin, a
200 MB copy before each run to evict the caches. publish/copy: the trainer's path, the
held state on (CPU) devices: device.publish_state (which copies the new state from host
memory and fingerprints it) plus encode of the result. device diff/copy: the same with
the accelerators' path forced (a jitted compare and nonzero where the arrays are, then
only the changes fetched), here run by XLA:CPU.
"""

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from absl import app, flags

from rlax_ps import sync
from rlax_ps.sync.bits import BF16, bit_view

_ELEMENTS = flags.DEFINE_integer("elements", 100_000_000, "bf16 elements of the synthetic model "
                                 "(rows of 4096)", lower_bound=4096)
_DENSITIES = flags.DEFINE_list("densities", ["0.001", "0.01", "0.03", "0.1"],
                               "fractions of bf16 elements changed by the synthetic step")
_REAL_LR = flags.DEFINE_list("real_lr", ["1e-6", "1e-5"], "learning rates of the real rows")
_REAL_SIZES = flags.DEFINE_list("real_sizes", ["tiny", "38m"], "models of the real rows "
                                "(tiny: configs/sft_tiny.py; 38m: the same at 38M parameters)")
_SIZES = {"tiny": {}, "38m": dict(hidden_size=768, intermediate_size=2048, num_layers=6,
                                  num_heads=12, num_kv_heads=4, head_dim=64)}
_REPS = flags.DEFINE_integer("reps", 5, "timed rounds (best kept); small models run more")
_SEED = flags.DEFINE_integer("seed", 0, "synthetic data seed")
_COLS = 4096
flags.register_validator("real_sizes", lambda sizes: set(sizes) <= set(_SIZES),
                         f"--real_sizes: expected some of {sorted(_SIZES)}")


def best_times(runs, reps, before):
  """Best wall seconds of each (fn, setup) of `runs`, round-robin over `reps` rounds,
  `before()` (the cache-evicting copy) ahead of each run."""
  best = [float("inf")] * len(runs)
  for _ in range(reps):
    for i, (fn, setup) in enumerate(runs):
      before()
      arg = setup() if setup else None
      t = time.perf_counter()
      fn(arg) if setup else fn()
      best[i] = min(best[i], time.perf_counter() - t)
  return best


def entropy_bits(values) -> float:
  _, counts = np.unique(values, return_counts=True)
  p = counts / counts.sum()
  return float(-(p * np.log2(p)).sum())


def bound_bytes(old: dict, new: dict) -> tuple[float, int, int]:
  """(bound in bytes, changed elements, elements) of a held state's update."""
  total, changed, elements = 0.0, 0, 0
  for name in new:
    a, b = bit_view(old[name]), bit_view(new[name])
    idx = np.flatnonzero(a != b)
    n, k = a.size, idx.size
    elements, changed = elements + n, changed + k
    if k:
      d = k / n
      h = 0.0 if d >= 1 else -(d * np.log2(d) + (1 - d) * np.log2(1 - d))
      total += (n * h + k * entropy_bits(b[idx] - a[idx])) / 8
  return total, changed, elements



def _share(ratio: float) -> str:
  """A time ratio as a percentage, with two significant digits below 10% (a small one must
  not read as 0%)."""
  return f"{ratio:.0%}" if ratio >= 0.1 else f"{100 * ratio:.2g}%"

def measure(label, fmt, base_held, target, reps, full_bf16, evict):
  import jax  # noqa: PLC0415 (the publish column only)
  from rlax_ps.sync import device  # noqa: PLC0415
  target_held = sync.held_state(target, fmt)
  bound, nnz, n = bound_bytes(base_held, target_held)
  keyframe = sync.encode(None, base_held, fmt, version=0)
  known = keyframe.checksums
  update = sync.encode(base_held, target_held, fmt, version=1, base_checksums=known, threads=1)
  got = sync.apply(base_held, sync.Update.from_bytes(update.to_bytes()), threads=1)
  assert all(np.array_equal(bit_view(got[k]), bit_view(v)) for k, v in target_held.items())
  model = sum(a.nbytes for a in base_held.values())
  reps = max(reps, min(60, int(2e9 // model)))
  spare = {k: np.empty_like(v) for k, v in base_held.items()}
  on_device = [{k: jax.device_put(v) for k, v in s.items()} for s in (base_held, target_held)]

  def copy():
    for k, v in base_held.items():
      np.copyto(spare[k], v)

  def publish(on_device_diff=False):
    device.HOST_MEMORY_DIRECT = not on_device_diff
    try:
      host, prints = device.publish_state(base_held, *on_device)
    finally:
      device.HOST_MEMORY_DIRECT = True
    sync.encode(base_held, host, fmt, version=1, base_checksums=known, fingerprints=prints,
                threads=1)

  wire = update.to_bytes()
  t_copy, t_enc, t_app, t_inplace, t_pub, t_diff = best_times([
      (copy, None),
      (lambda: sync.encode(base_held, target_held, fmt, version=1, base_checksums=known,
                           threads=1), None),
      (lambda u: sync.apply(base_held, u, threads=1), lambda: sync.Update.from_bytes(wire)),
      (lambda a: sync.apply(a[0], a[1], inplace=True, threads=1),
       lambda: ({k: v.copy() for k, v in base_held.items()}, sync.Update.from_bytes(wire))),
      (publish, None), (lambda: publish(on_device_diff=True), None)], reps, evict)
  modes = sorted({m.mode for m in update.tensors.values()} - {"unchanged"})
  return [label, fmt, f"{nnz / n:.2%}", f"{update.nbytes:,}", f"{full_bf16 / update.nbytes:.1f}x",
          f"{update.nbytes / max(bound, 1):.3f}", f"{update.nbytes / keyframe.nbytes:.2%}",
          *(_share(t_copy / t) for t in (t_enc, t_app, t_inplace, t_pub, t_diff)),
          f"{model / t_copy / 1e9:.1f}",
          "+".join(modes) or "-"]


def adam_direction(rng, n):
  g = rng.standard_normal(n, dtype=np.float32)
  return g / np.sqrt(0.5 * g * g + 0.5)


def calibrate_lr(w, u, density):
  """lr whose step changes `density` of the bf16 elements of w (bisection on a sample)."""
  s = slice(0, min(w.size, 1 << 20))
  wb = w[s].astype(BF16)
  lo, hi = 1e-9, 1e-1
  for _ in range(40):
    mid = np.sqrt(lo * hi)
    lo, hi = (mid, hi) if np.mean((w[s] - mid * u[s]).astype(BF16) != wb) < density else (lo, mid)
  return np.sqrt(lo * hi)


def flat_params(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    out.update(flat_params(v, f"{prefix}{k}.") if isinstance(v, dict)
               else {f"{prefix}{k}": np.asarray(v)})
  return out


def real_update(lr, size):
  """(float params before, after) one real AdamW step of the SFT trainer at `lr`."""
  import jax  # noqa: PLC0415
  from configs.sft_tiny import get_config  # noqa: PLC0415
  from rlax_ps.train.sft import SFTTrainer  # noqa: PLC0415
  c = get_config()
  for field, value in _SIZES[size].items():
    setattr(c.model, field, value)
  c.export.hf = False
  c.optimizer.lr, c.optimizer.warmup_steps, c.optimizer.min_lr_ratio = lr, 0, 1.0
  c.train.steps, c.checkpoint.every_steps, c.checkpoint.async_save = 12, 0, False
  with tempfile.TemporaryDirectory() as workdir, SFTTrainer(c, workdir) as trainer:
    trainer.train(until=10, progress=False)
    before = flat_params(jax.device_get(trainer.state.params))
    trainer.train(until=11, progress=False)
    return before, flat_params(jax.device_get(trainer.state.params))


def main(argv):
  del argv
  reps = _REPS.value
  n = _ELEMENTS.value // _COLS * _COLS
  rng = np.random.default_rng(_SEED.value)
  w = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
  u = adam_direction(rng, n)
  probe = np.ones(100_000_000, np.uint16)
  probe_dst = np.empty_like(probe)
  evict = lambda: np.copyto(probe_dst, probe)  # noqa: E731
  base = {"w.kernel": w.astype(BF16).reshape(-1, _COLS)}
  base_int8 = sync.held_state({"w.kernel": w.reshape(-1, _COLS)}, "int8")
  full = base["w.kernel"].nbytes
  kf_bf16, kf_int8 = (sync.encode(None, s, f, version=0).nbytes
                      for s, f in ((base, "bf16"), (base_int8, "int8")))
  rows, notes = [], [f"synthetic model: {n:,} bf16 elements; keyframes: bf16 {kf_bf16:,} B, "
                     f"int8 {kf_int8:,} B = {kf_int8 / kf_bf16:.2%} of bf16"]
  for d in map(float, _DENSITIES.value):
    lr = calibrate_lr(w, u, d)
    target = {"w.kernel": (w - np.float32(lr) * u).reshape(-1, _COLS)}
    rows.append(measure(f"synthetic {d:g}", "bf16", base, target, reps, full, evict))
    rows.append(measure(f"synthetic {d:g}", "int8", base_int8, target, reps, full, evict))
    del target
  for size in _REAL_SIZES.value:
    for lr in map(float, _REAL_LR.value):
      before, after = real_update(lr, size)
      rb, ri = sync.held_state(before, "bf16"), sync.held_state(before, "int8")
      full_r = sum(a.nbytes for a in rb.values())
      rows.append(measure(f"real {size} lr={lr:g}", "bf16", rb, after, reps, full_r, evict))
      rows.append(measure(f"real {size} lr={lr:g}", "int8", ri, after, reps, full_r, evict))
    kb, ki = (sync.encode(None, s, f, version=0).nbytes for s, f in ((rb, "bf16"), (ri, "int8")))
    notes.append(f"real {size}: {full_r // 2:,} params in {len(rb)} tensors; keyframes: bf16 "
                 f"{kb:,} B, int8 {ki:,} B = {ki / kb:.2%} of bf16")
  header = ["update", "fmt", "changed", "payload B", "vs bf16", "/bound", "vs kf", "enc/copy",
            "apply/copy", "inplace/copy", "publish/copy", "device diff/copy", "copy GB/s", "modes"]
  widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
  print("\n".join(notes))
  for r in [header] + rows:
    print(" | ".join(str(c).rjust(wd) for c, wd in zip(r, widths)))


if __name__ == "__main__":
  app.run(main)
