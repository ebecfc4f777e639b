r"""Weight-sync codec: payload vs full bf16, vs the information bound and vs int32+bf16 deltas;
encode/apply throughput vs a plain memory copy, all measured in one run.

  .venv/bin/python benchmarks/weight_sync.py                      # 100M bf16 elements
  .venv/bin/python benchmarks/weight_sync.py --elements=10000000 --real=false

Synthetic rows: weights ~ N(0, 0.02) in float32, rounded to bf16, then one Adam-like step
w -= lr * m / (sqrt(v) + eps) (direction of unit-ish size per element) with lr calibrated
so that 0.1%, 1%, 3%, 10% of the bf16 elements change. Real rows: the SFT trainer
(configs/sft_tiny.py) after warm-up steps at an RL-like learning rate, one more step, on
the tiny model (0.4M parameters: its throughput shows the fixed cost of an update) and on
the same model at 38M parameters (76 MB of bf16, past the caches; ~3 minutes of CPU
training for both learning rates).
Bound = sum over tensors of N*H(d) + nnz*H_v (H_v: zeroth-order entropy of the wrapping
bit-pattern offsets of the changed elements). Throughput is in GB/s of held model bytes,
over that of a plain memory copy of the same bytes: np.copyto of the row's held base state,
tensor by tensor, into a spare one, timed before each run of the row (the machine's memory
bandwidth drifts by tens of percent) right after a 200 MB copy that evicts the caches, as
every timed run is; each side keeps its best. On the tiny model that copy is 2-4x slower
per byte than the 200 MB one (0.8 MB from memory in 21 calls), so the table also shows the
ratios against the 200 MB copy's rate ("bulk e/a").
"""

import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from absl import app, flags

from rlax_ps import sync
from rlax_ps.sync import device, intrinsics, joint, parallel
from rlax_ps.sync.bits import BF16, bit_view

FLAGS = flags.DEFINE_integer("elements", 100_000_000, "bf16 elements of the synthetic model")
_DENSITIES = flags.DEFINE_list("densities", ["0.001", "0.01", "0.03", "0.1"],
                               "fractions of bf16 elements changed by the synthetic step")
_REAL = flags.DEFINE_boolean("real", True, "add the row of a real update from the SFT trainer")
_REAL_LR = flags.DEFINE_list("real_lr", ["1e-6", "1e-5"],
                             "learning rates of the real trainer steps (one row pair each)")
_REAL_SIZES = flags.DEFINE_list(
    "real_sizes", ["tiny", "38m"],
    "models of the real rows: tiny (configs/sft_tiny.py, 0.4M parameters, fixed per-update "
    "costs dominate) and 38m (the same trainer and data at 38M parameters, 76 MB of bf16: "
    "past the caches, where throughput is memory-bound as on real models)")
# Model fields of the larger real model (configs/sft_tiny.py otherwise).
_SIZES = {"tiny": {}, "38m": dict(hidden_size=768, intermediate_size=2048, num_layers=6,
                                  num_heads=12, num_kv_heads=4, head_dim=64)}
_REPS = flags.DEFINE_integer(
    "reps", 5, "timed repetitions (best is reported); smaller models run more (--max_reps)")
_MAX_REPS = flags.DEFINE_integer(
    "max_reps", 80, "most timed rounds of a smaller model's row: it runs about 2 GB of model "
    "bytes in all, up to this many rounds")
_SEED = flags.DEFINE_integer("seed", 0, "synthetic data seed")
_THREADS = flags.DEFINE_integer(
    "threads", 0, "threads of the wall-time columns (0: parallel.default_threads())")
_DECODE_STREAMS = flags.DEFINE_enum(
    "decode_streams", "auto", ["auto", "2", "4"],
    "joint sections' decoder: streams decoded in lockstep (auto: joint.QUAD, four on hosts "
    "with AVX-512 VBMI2); to measure the other choice on a given host (e.g. Zen 3)")
_PROBE_MB = flags.DEFINE_integer(
    "probe_mb", 200, "MB of the cache-evicting copy before each timed run (the synthetic "
    "model's bf16 weights where they are as large; L3 caches hold tens of MB)")
_COLS = 4096


def best_time(fn, reps, setup=None, probe=None):
  """(best CPU seconds, best wall seconds, result) over `reps` runs of fn(setup()); `probe`
  (the memory copy) runs before each, so that both see the machine in the same state."""
  return best_times([(fn, setup)], reps, probe)[0]


def best_times(runs, reps, probe=None):
  """best_time of each (fn, setup) of `runs`, measured round-robin: each round runs every
  one once (probe before each), so that all of them and the probe's copy baseline see the
  same stretch of time. A shared host slows for seconds at a time (another tenant on the
  core's sibling thread); measured one after the other, a row's encode could fall in such
  a stretch while its baseline, whose best is kept over the whole row, does not."""
  best = [[float("inf"), float("inf"), None] for _ in runs]
  for _ in range(reps):
    for (fn, setup), kept in zip(runs, best):
      if probe:
        probe()
      arg = setup() if setup else None
      t, c = time.perf_counter(), time.process_time()
      kept[2] = fn(arg) if setup else fn()
      kept[0] = min(kept[0], time.process_time() - c)
      kept[1] = min(kept[1], time.perf_counter() - t)
  return [tuple(kept) for kept in best]


class CopyProbe:
  """np.copyto of a fixed buffer, timed every call; rate() is the best seconds per byte
  (CPU, wall) seen since the last reset: the baseline of the row being measured."""

  def __init__(self, src):
    self.src = src.reshape(-1)  # flat: threaded() cuts it by elements
    self.dst = np.empty_like(self.src)
    self.reset()

  def reset(self):
    self.best = [float("inf"), float("inf")]

  def __call__(self):
    t, c = time.perf_counter(), time.process_time()
    np.copyto(self.dst, self.src)
    self.best = [min(self.best[0], time.process_time() - c), min(self.best[1], time.perf_counter() - t)]

  def rate(self):
    return self.best[0] / self.src.nbytes, self.best[1] / self.src.nbytes

  def threaded(self, threads):
    """The same copy split into `threads` slices copied side by side (numpy releases the
    GIL while it copies)."""
    cut = [self.src.size * i // threads for i in range(threads + 1)]

    def run(i):
      np.copyto(self.dst[cut[i]:cut[i + 1]], self.src[cut[i]:cut[i + 1]])

    workers = [threading.Thread(target=run, args=(i,)) for i in range(1, threads)]
    for w in workers:
      w.start()
    run(0)
    for w in workers:
      w.join()


def entropy_bits(values) -> float:
  _, counts = np.unique(values, return_counts=True)
  p = counts / counts.sum()
  return float(-(p * np.log2(p)).sum())


def tensor_bound(old, new) -> tuple[float, int, int, int]:
  """(bound in bytes, changed, within 2 codes/ulps, elements) of one held tensor."""
  a, b = bit_view(old), bit_view(new)
  idx = np.flatnonzero(a != b)
  n, k = a.size, idx.size
  if k == 0:
    return 0.0, 0, 0, n
  off = (b[idx] - a[idx]).view(np.dtype(f"i{a.itemsize}"))
  d = k / n
  h = 0.0 if d >= 1 else -(d * np.log2(d) + (1 - d) * np.log2(1 - d))
  return (n * h + k * entropy_bits(off)) / 8, k, int((np.abs(off.astype(np.int64)) <= 2).sum()), n


def state_bound(old, new):
  parts = [tensor_bound(old[k], new[k]) for k in new]
  return (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts),
          sum(p[3] for p in parts))


def held_bytes(state) -> int:
  return sum(np.asarray(a).nbytes for a in state.values())


class StateCopy:
  """The baseline of a row: the 200 MB probe (which evicts the caches, as before every
  timed run), then np.copyto of the row's held state, tensor by tensor, into a spare one,
  timed; best() is the best (CPU, wall) seconds of that copy since construction."""

  def __init__(self, state, probe):
    self.pairs = [(np.asarray(v), np.empty_like(np.asarray(v))) for v in state.values()]
    self.probe, self.times = probe, [float("inf"), float("inf")]

  def __call__(self):
    self.probe()
    t, c = time.perf_counter(), time.process_time()
    for src, dst in self.pairs:
      np.copyto(dst, src)
    self.times = [min(self.times[0], time.process_time() - c),
                  min(self.times[1], time.perf_counter() - t)]

  def best(self):
    return tuple(self.times)


def measure(label, fmt, base_held, target, probe, reps, full_bf16_bytes, keyframe):
  """One table row: encode base_held -> target, apply it (new arrays, then in place),
  compare with the bound. keyframe: the update that published base_held (its checksums are
  the publisher's base_checksums). probe: the 200 MB memory copy; it and a copy of
  base_held (the row's baseline, StateCopy) run before each timed run of this row, and the
  row's runs go round-robin (best_times). Each apply gets a fresh Update of the same bytes,
  so that it decodes (and parses its code tables anew)."""
  keyframe_bytes = keyframe.nbytes
  # Smaller models run more often (a noisy machine's best of a few short runs is luck): up
  # to 80 rounds, about 2 GB of model bytes a run in all (the 38M model: 26 rounds, the
  # 100M-element synthetic one 10); the row's copy baseline runs as often, in the same rounds.
  reps = max(reps, min(_MAX_REPS.value, int(2e9 // held_bytes(base_held))))
  target_held = sync.held_state(target, fmt)
  bound, nnz, small, n = state_bound(base_held, target_held)
  # The publisher rounds or quantizes on device (int8_device for int8) and copies the held
  # state to the host: encode starts from it. Again from the float32 target: the host
  # rounds or quantizes first (2x or 4x the bytes to read).
  probe.reset()
  bulk_probe, probe = probe, StateCopy(base_held, probe)
  known = keyframe.checksums
  update = sync.encode(base_held, target_held, fmt, version=1, base_version=0,
                       base_checksums=known, threads=1)
  assert sync.encode(base_held, target_held, fmt, version=1).to_bytes() == update.to_bytes()

  def fresh():
    """An undecoded Update of the same bytes, and no decoder tables kept from earlier
    runs: each apply parses its update as the first one would."""
    joint.forget_tables()
    return sync.Update(update.to_bytes(), update.header)

  spare = sync.spare_state(base_held)  # a double buffer's other half (pages touched once)
  # A worker's host part: every tensor's changes, decoded into its device scatter's arrays,
  # which it takes from its HostBuffers and gives back once the scatters are done (here:
  # before the next run, untimed).
  pool, held_back = device.HostBuffers(), []

  def fresh_for_worker():
    for ch in held_back:
      pool.give(ch.indices, ch.offsets)
    held_back.clear()
    return fresh()

  def decode_all(u, each):
    held_back.extend(ch for _, ch in each(u) if ch.kind == "sparse")

  enc, enc_host, app, into, inplace, worker = best_times([
      (lambda: sync.encode(base_held, target_held, fmt, version=1, base_version=0,
                           base_checksums=known, threads=1), None),
      (lambda: sync.encode(base_held, target, fmt, version=1, base_version=0,
                           base_checksums=known, threads=1), None),
      (lambda u: sync.apply(base_held, u, threads=1), fresh),
      (lambda u: sync.apply(base_held, u, out=spare, threads=1), fresh),
      (lambda a: sync.apply(a[0], a[1], inplace=True, threads=1),
       lambda: ({k: v.copy() for k, v in base_held.items()}, fresh())),
      (lambda u: decode_all(u, lambda u: (
          (name, device.padded_changes(u, name, pool)) for name in u.tensors)),
       fresh_for_worker)], reps, probe=probe)
  for got in (enc, enc_host):
    assert got[2].to_bytes() == update.to_bytes()
  for got in (app, into):
    for k, v in target_held.items():
      assert np.array_equal(bit_view(got[2][k]), bit_view(v)), k
  copy_s = probe.best()  # seconds of the same bytes' copy
  bulk_s = bulk_probe.rate()  # seconds per byte of the 200 MB copy
  # Wall time on `threads` threads (tensors side by side) against a copy on as many.
  threads = _THREADS.value or parallel.default_threads()
  copy_t, enc_t, app_t, work_t = best_times([
      (lambda: bulk_probe.threaded(threads), None),
      (lambda: sync.encode(base_held, target_held, fmt, version=1, base_version=0,
                           base_checksums=known, threads=threads), None),
      (lambda u: sync.apply(base_held, u, threads=threads), fresh),
      (lambda u: decode_all(u, lambda u: device.each_padded_changes(
          u, u.tensors, threads, pool)), fresh_for_worker)], reps)
  copy_t = copy_t[1] / bulk_probe.src.nbytes
  assert enc_t[2].to_bytes() == update.to_bytes()
  for k, v in target_held.items():
    assert np.array_equal(bit_view(inplace[2][k]), bit_view(v)), k
  model = held_bytes(base_held)
  value_bytes = 2 if fmt == "bf16" else 1
  baseline = nnz * (4 + value_bytes)
  vs_copy = lambda t, i: f"{copy_s[i] / t[i]:.0%}"  # noqa: E731
  vs_bulk = lambda t: f"{model * bulk_s[0] / t[0]:.0%}"  # noqa: E731
  modes = sorted({m.mode for m in update.tensors.values()} - {"unchanged"})
  return [label, fmt, f"{nnz / n:.4%}", f"{small / max(nnz, 1):.0%}", f"{update.nbytes:,}",
          f"{full_bf16_bytes / update.nbytes:.1f}x", f"{update.nbytes / max(bound, 1):.3f}",
          f"{(update.nbytes - sum(m.nbytes for m in update.tensors.values())):,}",
          f"{full_bf16_bytes / max(baseline, 1):.1f}x", f"{update.nbytes / keyframe_bytes:.2%}",
          f"{model / enc[0] / 1e9:.2f}", vs_copy(enc, 0), vs_copy(enc_host, 0),
          f"{model / app[0] / 1e9:.2f}",
          vs_copy(app, 0), vs_copy(into, 0), vs_copy(inplace, 0), vs_copy(worker, 0),
          f"{vs_copy(enc, 1)}/{vs_copy(app, 1)}/{vs_copy(inplace, 1)}",
          f"{model / copy_s[0] / 1e9:.2f}", f"{vs_bulk(enc)}/{vs_bulk(app)}",
          f"{model * copy_t / enc_t[1]:.0%}/{model * copy_t / app_t[1]:.0%}/"
          f"{model * copy_t / work_t[1]:.0%}",
          "+".join(modes) or "-"]


def adam_direction(rng, n):
  """Per-element m / (sqrt(v) + eps) of an Adam step: sign-like, magnitude near 1."""
  g = rng.standard_normal(n, dtype=np.float32)
  return g / np.sqrt(0.5 * g * g + 0.5)


def calibrate_lr(w, u, density):
  """lr whose step changes `density` of the bf16 elements of w (bisection on a sample)."""
  s = slice(0, min(w.size, 1 << 20))
  wb = w[s].astype(BF16)
  lo, hi = 1e-9, 1e-1
  for _ in range(40):
    mid = np.sqrt(lo * hi)
    d = np.mean((w[s] - mid * u[s]).astype(BF16) != wb)
    lo, hi = (mid, hi) if d < density else (lo, mid)
  return np.sqrt(lo * hi)


def flat_params(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    name = f"{prefix}{k}"
    out.update(flat_params(v, name + ".") if isinstance(v, dict) else {name: np.asarray(v)})
  return out


def real_update(lr, size="tiny"):
  """(float params before, after) one real AdamW step of the SFT trainer at `lr` (model
  fields from _SIZES[size])."""
  import jax
  from configs.sft_tiny import get_config
  from rlax_ps.train.sft import SFTTrainer
  c = get_config()
  for field, value in _SIZES[size].items():
    setattr(c.model, field, value)
  c.export.hf = False
  c.optimizer.lr = lr
  c.optimizer.warmup_steps = 0
  c.optimizer.min_lr_ratio = 1.0
  c.train.steps = 12
  c.checkpoint.every_steps = 0
  c.checkpoint.async_save = False
  with tempfile.TemporaryDirectory() as workdir, SFTTrainer(c, workdir) as trainer:
    trainer.train(until=10, progress=False)
    before = flat_params(jax.device_get(trainer.state.params))
    trainer.train(until=11, progress=False)
    after = flat_params(jax.device_get(trainer.state.params))
  return before, after


def main(argv):
  del argv
  if _DECODE_STREAMS.value != "auto":
    joint.QUAD = _DECODE_STREAMS.value == "4"
  ways = {intrinsics.WALK: "walk", intrinsics.COMPRESS: "compress", intrinsics.SHUFFLE: "shuffle"}
  print(f"joint decoder: {4 if joint.QUAD else 2} streams in lockstep; encoder listing: bf16 "
        f"{ways[joint.LISTING[16]]}, int8 {ways[joint.LISTING[8]]}")
  reps = _REPS.value
  n = FLAGS.value // _COLS * _COLS
  rng = np.random.default_rng(_SEED.value)
  w = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
  u = adam_direction(rng, n)
  base = {"w.kernel": w.astype(BF16).reshape(-1, _COLS)}
  full = base["w.kernel"].nbytes
  # The probe evicts the caches before every timed run: at least --probe_mb whatever
  # --elements (a smaller model's copy would leave the rows' data and code in cache).
  probe_bytes = _PROBE_MB.value * 1_000_000
  probe = CopyProbe(bit_view(base["w.kernel"]) if full >= probe_bytes
                    else np.ones(probe_bytes // 2, np.uint16))
  for _ in range(reps + 3):
    probe()
  copy_s = probe.rate()
  fresh = best_time(lambda: bit_view(base["w.kernel"]).copy(), reps + 1)
  base_float = {"w.kernel": w.reshape(-1, _COLS)}
  kf_bf16 = sync.encode(None, base, "bf16", version=0)
  base_int8 = sync.held_state(base_float, "int8")
  kf_int8 = sync.encode(None, base_int8, "int8", version=0)
  threads = _THREADS.value or parallel.default_threads()
  rows = []
  for d in map(float, _DENSITIES.value):
    lr = calibrate_lr(w, u, d)
    target = {"w.kernel": (w - np.float32(lr) * u).reshape(-1, _COLS)}
    label = f"synthetic {d:g} lr={lr:.2g}"
    rows.append(measure(label, "bf16", base, target, probe, reps, full, kf_bf16))
    rows.append(measure(label, "int8", base_int8, target, probe, reps, full, kf_int8))
    del target
  real_notes = []
  for size in _REAL_SIZES.value if _REAL.value else []:
    if size not in _SIZES:
      raise app.UsageError(f"--real_sizes: expected some of {sorted(_SIZES)}, got {size!r}")
    for lr in map(float, _REAL_LR.value):
      before, after = real_update(lr, size)
      rb = sync.held_state(before, "bf16")
      ri = sync.held_state(before, "int8")
      full_r = held_bytes(rb)
      kf_rb = sync.encode(None, rb, "bf16", version=0)
      kf_ri = sync.encode(None, ri, "int8", version=0)
      kfr, kfi = kf_rb.nbytes, kf_ri.nbytes
      label = f"real {size} lr={lr:g}"
      rows.append(measure(label, "bf16", rb, after, probe, reps, full_r, kf_rb))
      rows.append(measure(label, "int8", ri, after, probe, reps, full_r, kf_ri))
      del before, after, rb, ri
    fields = f" with {_SIZES[size]}" if _SIZES[size] else ""
    real_notes.append(
        f"real {size}: SFT trainer (configs/sft_tiny.py{fields}, AdamW, 10 steps then 1): "
        f"{full_r // 2:,} params in {len(kf_rb.tensors)} tensors; "
        f"int8 keyframe {kfi:,} B = {kfi / kfr:.2%} of bf16 keyframe {kfr:,} B")
  header = ["update", "fmt", "density", "<=2 ulp", "payload B", "vs bf16", "/bound", "hdr B",
            "int32+val", "vs kf", "enc GB/s", "enc/copy", "f32 enc/copy", "apply GB/s", "apply/copy",
            "spare/copy", "inplace/copy", "worker/copy", "wall e/a/i", "copy GB/s", "bulk e/a",
            f"{threads}T wall e/a/w", "modes"]
  widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
  print(f"synthetic model: {n:,} bf16 elements ({full / 1e6:.0f} MB); memory copy "
        f"(np.copyto) {1 / copy_s[0] / 1e9:.2f} GB/s CPU time, "
        f"{1 / copy_s[1] / 1e9:.2f} GB/s wall; "
        f"into fresh memory (.copy(), page faults included) {full / fresh[0] / 1e9:.2f} GB/s CPU")
  print(f"keyframes: bf16 {kf_bf16.nbytes:,} B, int8 {kf_int8.nbytes:,} B = "
        f"{kf_int8.nbytes / kf_bf16.nbytes:.2%} of bf16")
  for note in real_notes:
    print(note)
  print("vs bf16 / int32+val: full bf16 bytes over the payload / over 6 (bf16) or 5 (int8) "
        "bytes per change; /bound: payload (header included) over the bound; hdr B: header "
        "bytes (names, shapes, modes, seals); vs kf: payload over the keyframe;")
  print("GB/s of held model bytes by best CPU time (the machine may be shared); x/copy: "
        "throughput over that of a plain copy of the same bytes (np.copyto of the row's held "
        "base state, tensor by tensor, into a spare one, timed right after the 200 MB copy that "
        "runs before each timed run; best); copy GB/s: that copy's throughput; bulk e/a: "
        "encode/apply over the 200 MB copy's throughput (best per byte); enc: from the held target (bf16, "
        "or int8 quantized on device by int8_device), with the base's checksums from the "
        "update that published it (the publisher's path); f32 enc: from the float32 target, "
        "rounded or quantized on the host; apply: from an undecoded Update, into new arrays "
        "(once the loop has dropped a result, in its memory: arena.py's "
        "spares, as in a worker that drops each older state; a first apply of a model's "
        "size pays its fresh pages' faults); spare: apply(..., out=spare) into "
        "a held state kept for it (a double buffer); inplace: apply(..., inplace=True); "
        "worker: a worker's host part (device.padded_changes of every tensor, arrays from "
        "a HostBuffers given back between runs: the changes "
        "decoded into the arrays of its on-device scatter, which is not timed); "
        "wall e/a/i: "
        "the encode/apply/inplace ratios by wall time; (all single-threaded: threads=1); "
        f"{threads}T wall e/a/w: encode/apply/worker with threads={threads} (tensors side by "
        "side; the worker's decoded ahead of its consumer: device.each_padded_changes) by "
        f"wall time, over a copy split across {threads} threads; modes: the sections' layouts")
  for r in [header] + rows:
    print(" | ".join(str(c).rjust(wd) for c, wd in zip(r, widths)))


if __name__ == "__main__":
  app.run(main)
