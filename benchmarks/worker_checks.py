r"""A worker's check of the weights it holds: pull + xxh3 (the result seal) vs device
fingerprints (the fingerprint seal), on the default JAX backend, one run, side by side.

  .venv/bin/python benchmarks/worker_checks.py                          # 100M bf16 elements
  .venv/bin/python benchmarks/worker_checks.py --elements=4000000 --fmt=int8

Rows (seconds per check of the whole held state; every tensor changed, as after a dense
enough update):
  pull+xxh3        what HeldPolicy does without fingerprints: every tensor copied to the
                   host (jax.device_get) and hashed, tensors side by side on host threads;
  device fprint    device.fingerprints_of: one fused pass per tensor where it lives, 8 bytes
                   per tensor to the host;
  host fprint      fingerprints.of_state on host arrays (what encode(fingerprints=True) or
                   the server's compaction pays), against host xxh3 of the same arrays.
On the CPU backend a pull is a view and xxh3 runs at memory speed, so pulling wins there
(HeldPolicy's default keeps it); on TPU/GPU the pull is a device-to-host copy of the model.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from rlax_ps.sync import checksum, device, fingerprints, parallel  # noqa: E402
from rlax_ps.sync.bits import BF16, INT8  # noqa: E402

_ELEMENTS = flags.DEFINE_integer("elements", 100_000_000, "held elements in all")
_FMT = flags.DEFINE_enum("fmt", "bf16", ["bf16", "int8"], "held dtype of the tensors")
_REPS = flags.DEFINE_integer("reps", 3, "timed repetitions (best is reported)")
_THREADS = flags.DEFINE_integer("threads", 0, "host threads (0: parallel.default_threads())")


def model_shapes(elements: int) -> list[tuple[int, int]]:
  """Transformer-like 2-D tensors (hidden h, MLP 4h) totalling about `elements`."""
  h = 256
  while 12 * (2 * h) ** 2 * 4 <= elements:  # at least four layers of 12 h^2
    h *= 2
  layers = max(1, elements // (12 * h * h))
  return [s for _ in range(layers) for s in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h))]


def best(fn, reps):
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return min(times)


def main(argv):
  del argv
  dtype = BF16 if _FMT.value == "bf16" else INT8
  threads = _THREADS.value or parallel.default_threads()
  rng = np.random.default_rng(0)
  host = {}
  for i, shape in enumerate(model_shapes(_ELEMENTS.value)):
    bits = rng.integers(0, 256 if dtype == INT8 else 1 << 16, shape,
                        dtype=np.uint8 if dtype == INT8 else np.uint16)
    host[f"t{i}"] = bits.view(dtype)
  held = {k: jax.device_put(v) for k, v in host.items()}
  jax.block_until_ready(held)
  nbytes = sum(v.nbytes for v in host.values())

  def pulled():
    tasks = [(v.size, lambda v=v: checksum(np.asarray(jax.device_get(v)))) for v in held.values()]
    return parallel.run(tasks, threads)

  def on_device():
    return device.fingerprints_of(held)

  want = fingerprints.of_state(host, threads)
  assert on_device() == want, "device and host fingerprints differ"
  pulled()  # compiles and warms both
  rows = [("pull+xxh3", best(pulled, _REPS.value)), ("device fprint", best(on_device, _REPS.value)),
          ("host xxh3", best(lambda: [checksum(v) for v in host.values()], _REPS.value)),
          ("host fprint", best(lambda: fingerprints.of_state(host, 1), _REPS.value))]
  t = dict(rows)
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), {len(host)} "
        f"tensors, {nbytes / 1e6:.0f} MB of {_FMT.value}, {threads} host threads")
  print(" | ".join(["check", "ms", "GB/s", "speed vs"]))
  against = {"device fprint": "pull+xxh3", "host fprint": "host xxh3"}
  for name, s in rows:
    vs = f"{t[against[name]] / s:.2f}x {against[name]}" if name in against else "baseline"
    print(" | ".join([name, f"{s * 1e3:.2f}", f"{nbytes / s / 1e9:.1f}", vs]))
  print("worker side: pull+xxh3 vs device fprint (threads as HeldPolicy); publisher side "
        "(encode(fingerprints=True), the server's compaction): host xxh3 vs host fprint, "
        "one thread each")


if __name__ == "__main__":
  app.run(main)
