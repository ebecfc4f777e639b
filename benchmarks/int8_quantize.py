"""int8 quantizer speed: host loops (int8.quantize_tensor) and the jitted JAX version
(int8_device) against np.copyto of the same float32 bytes, measured in the same run.

    python benchmarks/int8_quantize.py                   # float32 [4883, 4096]: 20M elements
    python benchmarks/int8_quantize.py --rows 1024 --reps 3

Times are CPU seconds (time.process_time, best of --reps), so a multi-threaded XLA run
counts every thread's time; "x copy" is the time over the copy's (lower is better).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rlax_ps.sync import int8, int8_device  # noqa: E402
from rlax_ps.sync.bits import BF16  # noqa: E402


def best_ms(fn, reps: int) -> float:
  fn()  # compile / warm caches
  times = []
  for _ in range(reps):
    t0 = time.process_time()
    fn()
    times.append(time.process_time() - t0)
  return min(times) * 1e3


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", type=int, default=4883)
  ap.add_argument("--cols", type=int, default=4096)
  ap.add_argument("--reps", type=int, default=5)
  args = ap.parse_args()
  w = (np.random.default_rng(0).standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
  dst = np.empty_like(w)
  copy = best_ms(lambda: np.copyto(dst, w), args.reps)
  quantize = jax.jit(int8_device.quantize_tensor_jax, static_argnums=0)
  wd = jnp.asarray(w)
  rows = [("np.copyto float32", "-", copy)]
  for name, layout in [("w.kernel", "channels_last"), ("w.embedding", "rows")]:
    rows.append((f"host f32 {layout}", name, best_ms(lambda: int8.quantize_tensor(name, w), args.reps)))
  wb = w.astype(BF16)
  rows.append(("host bf16 channels_last", "w.kernel",
               best_ms(lambda: int8.quantize_tensor("w.kernel", wb), args.reps)))
  for name, layout in [("w.kernel", "channels_last"), ("w.embedding", "rows")]:
    rows.append((f"jax jit ({jax.default_backend()}) {layout}", name,
                 best_ms(lambda: jax.block_until_ready(quantize(name, wd)), args.reps)))
  print(f"int8 quantize of float32 [{args.rows}, {args.cols}] ({w.size / 1e6:.1f}M elements, "
        f"{w.nbytes / 1e6:.0f} MB)")
  print(f"{'what':34} {'ms':>8} {'x copy':>7}")
  for what, _, ms in rows:
    print(f"{what:34} {ms:8.1f} {ms / copy:7.2f}")


if __name__ == "__main__":
  main()
