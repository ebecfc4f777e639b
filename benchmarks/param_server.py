"""Parameter server on loopback: pull throughput vs raw gRPC, fan-out, server memory, delta pulls, load.

  .venv/bin/python benchmarks/param_server.py --size_mb=512            # the pull table
  .venv/bin/python benchmarks/param_server.py --seconds=60 --workers=32 --skip_pull   # the load test

The server and the raw-gRPC baseline each run in their own process (`rlax-ps
serve`; this file with --mode=raw_server); the 8 concurrent pullers are 8
processes. One table of side-by-side ratios is printed.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import ml_dtypes
import numpy as np
from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from param_server.client import ParamServerClient, RetryPolicy, make_sample  # noqa: E402
from param_server.protos import param_server_pb2 as pb  # noqa: E402
from rlax_ps import sync  # noqa: E402

_MODE = flags.DEFINE_enum("mode", "bench", ["bench", "raw_server", "puller"], "internal: process role")
_SIZE_MB = flags.DEFINE_integer("size_mb", 256, "keyframe size in MiB (bf16 weights)")
_CHUNK_MB = flags.DEFINE_float("chunk_mb", 4, "chunk size in MiB, for the server and the raw stream")
_PULLERS = flags.DEFINE_integer("pullers", 8, "concurrent pullers for the fan-out row")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed pulls per single-puller row (median reported)")
_DENSITY = flags.DEFINE_float("density", 0.01, "fraction of elements changed in the delta row")
_SECONDS = flags.DEFINE_float("seconds", 60, "load test duration")
_WORKERS = flags.DEFINE_integer("workers", 32, "simulated workers in the load test")
_SERVE_ARGS = flags.DEFINE_list("serve_args", [], "extra `rlax-ps serve` flags for the pull rows, e.g. --cache_bytes=0")
_SKIP_PULL = flags.DEFINE_bool("skip_pull", False, "skip the pull rows")
_SKIP_LOAD = flags.DEFINE_bool("skip_load", False, "skip the load test")
_ADDRESS = flags.DEFINE_string("address", "", "internal: server for --mode=puller")
_PORT = flags.DEFINE_integer("port", 0, "internal: port for --mode=raw_server")

TOKENS = {"trainer": "bench-trainer", "worker": "bench-worker", "viewer": "bench-viewer"}
RAW_METHOD = "/bench.Raw/Stream"


# ---------------------------------------------------------------- processes

def spawn_param_server(storage_dir: str, chunk_bytes: int, *extra: str):
  env = dict(os.environ, **{f"RLAX_PS_{r.upper()}_TOKEN": t for r, t in TOKENS.items()})
  proc = subprocess.Popen(
      [sys.executable, "-m", "rlax_ps", "serve", f"--storage_dir={storage_dir}", "--port=0",
       f"--chunk_bytes={chunk_bytes}", f"--max_chunk_bytes={chunk_bytes}", *extra],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  line = proc.stdout.readline()
  if "listening on" not in line:
    proc.kill()
    raise RuntimeError(f"server did not start: {line!r}")
  return proc, line.rsplit(" ", 1)[1].strip()


def spawn_self(*args: str):
  return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], cwd=REPO,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def rss_mb(pid: int, field: str = "VmRSS") -> float:
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024
  return float("nan")


class PeakSampler:
  """Samples a process's resident memory every 10 ms while active."""

  def __init__(self, pid: int):
    self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.wait(0.01):
      self.peak = max(self.peak, rss_mb(self.pid))

  def __enter__(self):
    self.peak = rss_mb(self.pid)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


# ---------------------------------------------------------------- raw gRPC baseline

def raw_server_main(size: int, chunk: int) -> None:
  import grpc
  from concurrent import futures
  payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
  view = memoryview(payload)

  def stream(request, context):
    for off in range(0, size, chunk):
      yield bytes(view[off:off + chunk])

  handler = grpc.method_handlers_generic_handler("bench.Raw", {"Stream": grpc.unary_stream_rpc_method_handler(
      stream, request_deserializer=lambda b: b, response_serializer=lambda b: b)})
  limit = chunk + (64 << 10)
  server = grpc.server(futures.ThreadPoolExecutor(16), options=[
      ("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)])
  server.add_generic_rpc_handlers((handler,))
  port = server.add_insecure_port("127.0.0.1:0")
  server.start()
  print(f"raw server listening on 127.0.0.1:{port}", flush=True)
  server.wait_for_termination()


def raw_pull(address: str, chunk: int) -> int:
  """Receives the raw stream into one preallocated buffer, as ParamServerClient.pull does."""
  import grpc
  limit = chunk + (64 << 10)
  with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", limit)]) as ch:
    call = ch.unary_stream(RAW_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    buf, filled = None, 0
    for data in call(b"", timeout=600):
      if buf is None:
        buf = memoryview(bytearray(_SIZE_MB.value << 20))
      buf[filled:filled + len(data)] = data
      filled += len(data)
    return filled


# ---------------------------------------------------------------- pull rows

def make_weights(size_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
  """bf16 weights totalling `size_bytes`, in tensors of at most 16 Mi elements."""
  rng = np.random.default_rng(seed)
  n, out, i = size_bytes // 2, {}, 0
  while n > 0:
    k = min(n, 16 << 20)
    out[f"layer{i:03d}/kernel"] = rng.standard_normal(k, dtype=np.float32).astype(ml_dtypes.bfloat16)
    n -= k
    i += 1
  return out


def perturb(weights: dict[str, np.ndarray], density: float, seed: int = 1) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  out = {}
  for k, v in weights.items():
    idx = np.flatnonzero(rng.random(v.size, dtype=np.float32) < density)
    w = v.copy()
    w[idx] = (w[idx].astype(np.float32) * 1.5 + 0.01).astype(v.dtype)
    out[k] = w
  return out


def timed(fn):
  t = time.perf_counter()
  out = fn()
  return time.perf_counter() - t, out


def puller_main(address: str) -> None:
  client = ParamServerClient(address, token=TOKENS["worker"], chunk_bytes=int(_CHUNK_MB.value * (1 << 20)))
  client.latest_version()  # connect before the start signal
  print("ready", flush=True)
  sys.stdin.readline()
  start = time.time()
  blobs = client.pull(None)
  end = time.time()
  print(f"{start} {end} {sum(len(b) for b in blobs)}", flush=True)


def pull_rows(rows: list) -> None:
  size, chunk = _SIZE_MB.value << 20, int(_CHUNK_MB.value * (1 << 20))
  mib = lambda n: n / (1 << 20)  # noqa: E731
  storage = tempfile.mkdtemp(prefix="ps_bench_")
  raw = spawn_self("--mode=raw_server", f"--size_mb={_SIZE_MB.value}", f"--chunk_mb={_CHUNK_MB.value}")
  raw_address = raw.stdout.readline().rsplit(" ", 1)[1].strip()
  server, address = spawn_param_server(storage, chunk, *_SERVE_ARGS.value)
  try:
    idle_mb = rss_mb(server.pid)
    weights = make_weights(size)
    keyframe = sync.encode(None, weights, "bf16", version=0).to_bytes()
    trainer = ParamServerClient(address, token=TOKENS["trainer"], chunk_bytes=chunk, timeout_s=600)
    t_pub, _ = timed(lambda: trainer.publish(keyframe))
    publish_peak = rss_mb(server.pid, "VmHWM")
    worker = ParamServerClient(address, token=TOKENS["worker"], chunk_bytes=chunk,
                               retry=RetryPolicy(deadline_s=600))
    kf = len(keyframe)
    raw_pull(raw_address, chunk)
    worker.pull(None)  # warm-up: page cache, connections
    raw_times = [timed(lambda: raw_pull(raw_address, chunk))[0] for _ in range(_REPEATS.value)]
    with PeakSampler(server.pid) as single_mem:
      ps_times = [timed(lambda: worker.pull(None))[0] for _ in range(_REPEATS.value)]
    raw_tp, ps_tp = mib(size) / statistics.median(raw_times), mib(kf) / statistics.median(ps_times)
    rows.append(("keyframe pull, 1 puller", f"{mib(kf):.0f} MiB", f"{ps_tp:,.0f} MiB/s",
                 f"raw gRPC stream {raw_tp:,.0f} MiB/s", f"{ps_tp / raw_tp:.2f}x"))

    procs = [spawn_self("--mode=puller", f"--address={address}", f"--chunk_mb={_CHUNK_MB.value}")
             for _ in range(_PULLERS.value)]
    for p in procs:
      assert p.stdout.readline().strip() == "ready"
    with PeakSampler(server.pid) as fan_mem:
      for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
      results = [p.stdout.readline().split() for p in procs]
      for p in procs:
        p.wait()
    starts, ends, got = zip(*[(float(a), float(b), int(c)) for a, b, c in results])
    agg = mib(sum(got)) / (max(ends) - min(starts))
    rows.append((f"keyframe pull, {_PULLERS.value} pullers", f"{mib(kf):.0f} MiB each", f"{agg:,.0f} MiB/s total",
                 f"1 puller {ps_tp:,.0f} MiB/s", f"{agg / ps_tp:.2f}x"))
    peak_pull = max(single_mem.peak, fan_mem.peak)
    rows.append(("server memory while serving", f"{mib(kf):.0f} MiB keyframe",
                 f"peak {peak_pull:,.0f} MiB RSS (+{peak_pull - idle_mb:,.0f} over idle)",
                 f"keyframe {mib(kf):,.0f} MiB", f"{(peak_pull - idle_mb) / mib(kf):.2f}x"))
    rows.append(("server memory, peak after publish", "publish + verify", f"peak {publish_peak:,.0f} MiB RSS",
                 f"keyframe {mib(kf):,.0f} MiB", f"{publish_peak / mib(kf):.2f}x"))

    t_enc, delta = timed(lambda: sync.encode(weights, perturb(weights, _DENSITY.value), "bf16",
                                             version=1, base_version=0).to_bytes())
    trainer.publish(delta)
    delta_times = [timed(lambda: worker.pull(0))[0] for _ in range(_REPEATS.value)]
    t_delta = statistics.median(delta_times)
    rows.append((f"{_DENSITY.value:.0%}-density delta pull", f"{mib(len(delta)):.1f} MiB delta",
                 f"{t_delta * 1e3:,.0f} ms", f"keyframe pull {mib(kf) / ps_tp * 1e3:,.0f} ms",
                 f"{t_delta / (mib(kf) / ps_tp):.3f}x"))
    lifetime = rss_mb(server.pid, "VmHWM")
    rows.append(("server memory, lifetime peak", "publish, verify, all pulls", f"peak {lifetime:,.0f} MiB RSS",
                 f"keyframe {mib(kf):,.0f} MiB", f"{lifetime / mib(kf):.2f}x"))
    rows.append(("(context)", "", f"publish keyframe {t_pub:.1f} s", f"encode delta {t_enc:.1f} s", ""))
    trainer.close()
    worker.close()
  finally:
    for p in (server, raw):
      p.kill()
      p.wait()
    shutil.rmtree(storage, ignore_errors=True)  # the server's copy of the keyframe


# ---------------------------------------------------------------- load test

def _percentiles(xs):
  if not xs:
    return "-", "-"
  xs = sorted(xs)
  return f"{xs[len(xs) // 2] * 1e3:.1f}", f"{xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e3:.1f}"


def run_load(address: str, seconds: float, n_workers: int) -> dict:
  """`n_workers` simulated workers pull, lease and submit while a trainer publishes and takes.

  Returns latencies per RPC, error count, and the rollout accounting (lost / duplicated)."""
  latencies = collections.defaultdict(list)
  errors, acked, taken = [], [], []
  lock = threading.Lock()
  stop = threading.Event()
  rng = np.random.default_rng(0)
  weights = {"embed": rng.standard_normal((256, 64)).astype(np.float32),
             "kernel": rng.standard_normal((64, 64)).astype(np.float32)}

  def timed_call(name, fn):
    t = time.perf_counter()
    out = fn()
    with lock:
      latencies[name].append(time.perf_counter() - t)
    return out

  def trainer_loop():
    nonlocal weights
    c = ParamServerClient(address, token=TOKENS["trainer"], retry=RetryPolicy(deadline_s=30))
    version, next_prompt, last_pub = 0, 0, time.monotonic()
    try:
      timed_call("Publish", lambda: c.publish(sync.encode(None, weights, version=0).to_bytes()))
      while not stop.is_set():
        depth = c.stats().prompts_queued
        if depth < 16 * n_workers:
          batch = [pb.Prompt(id=f"q{next_prompt + i}", text="x", token_ids=[1, 2, 3]) for i in range(256)]
          next_prompt += 256
          timed_call("EnqueuePrompts", lambda: c.enqueue_prompts(batch))
        take = timed_call("TakeRollouts", lambda: c.take_rollouts(0, 256, wait_s=0.2))
        if take.take_id:
          timed_call("AckRollouts", lambda: c.ack(take))
          with lock:
            taken.extend(r.rollout_id for r in take.rollouts)
        if time.monotonic() - last_pub > 1.0:
          new = {k: (v * np.where(rng.random(v.shape) < 0.02, 1.01, 1.0)).astype(np.float32)
                 for k, v in weights.items()}
          version += 1
          timed_call("Publish", lambda: c.publish(sync.encode(weights, new, version=version).to_bytes()))
          weights, last_pub = new, time.monotonic()
      while True:  # drain
        take = c.take_rollouts(0, 1024, wait_s=0.5)
        if not take.take_id:
          break
        c.ack(take)
        with lock:
          taken.extend(r.rollout_id for r in take.rollouts)
    except Exception as e:  # noqa: BLE001  counted, reported
      errors.append(f"trainer: {e!r}")
    finally:
      c.close()

  def worker_loop(k):
    c = ParamServerClient(address, token=TOKENS["worker"], retry=RetryPolicy(deadline_s=30))
    held, held_version = None, None
    try:
      c.register(f"sim{k}")
      while not stop.is_set():
        latest = timed_call("Heartbeat", lambda: c.heartbeat(-1 if held_version is None else held_version, 100.0)).latest_version
        if latest >= 0 and latest != held_version:
          blobs = timed_call("Pull", lambda: c.pull(held_version))
          for b in blobs:
            update = sync.Update.from_bytes(bytes(b))
            held = sync.apply(held, update, base_version=held_version)
            held_version = update.version
        lease = timed_call("LeasePrompts", lambda: c.lease(4, deadline_s=30, wait_s=0.2))
        for p in lease.prompts:
          group = pb.RolloutGroup(prompt_id=p.id, policy_version=max(held_version or 0, 0), samples=[
              make_sample([5, 6, 7, 8], random.random(), logprobs=[-0.5] * 4, finish_reason="stop")
              for _ in range(4)])
          reply = timed_call("SubmitRollouts", lambda: c.submit_rollouts(lease.lease_id, group))
          with lock:
            acked.append(reply.rollout_id)
        if lease.lease_id:
          timed_call("CompleteLease", lambda: c.complete(lease))
    except Exception as e:  # noqa: BLE001  counted, reported
      errors.append(f"worker {k}: {e!r}")
    finally:
      c.close()

  threads = [threading.Thread(target=worker_loop, args=(k,)) for k in range(n_workers)]
  trainer = threading.Thread(target=trainer_loop)
  trainer.start()
  for t in threads:
    t.start()
  time.sleep(seconds)
  stop.set()
  for t in threads:
    t.join()
  trainer.join()
  return dict(latencies=latencies, errors=errors, acked=acked, taken=taken,
              lost=len(set(acked) - set(taken)), duplicated=len(taken) - len(set(taken)))


def load_rows(rows: list) -> None:
  storage = tempfile.mkdtemp(prefix="ps_load_")
  server, address = spawn_param_server(storage, 4 << 20)
  try:
    result = run_load(address, _SECONDS.value, _WORKERS.value)
  finally:
    server.kill()
    server.wait()
    shutil.rmtree(storage, ignore_errors=True)
  lat = result["latencies"]
  rows.append((f"load: {_WORKERS.value} workers, {_SECONDS.value:.0f} s", f"{len(result['acked'])} groups acked",
               f"{len(result['errors'])} errors", f"lost {result['lost']}, duplicated {result['duplicated']}",
               f"{len(result['taken']) / _SECONDS.value:,.0f} groups/s"))
  for name in sorted(lat):
    p50, p99 = _percentiles(lat[name])
    rows.append((f"  {name}", f"{len(lat[name])} calls", f"p50 {p50} ms", f"p99 {p99} ms", ""))
  for e in result["errors"][:5]:
    print("error:", e)


def main(argv) -> None:
  if _MODE.value == "raw_server":
    return raw_server_main(_SIZE_MB.value << 20, int(_CHUNK_MB.value * (1 << 20)))
  if _MODE.value == "puller":
    return puller_main(_ADDRESS.value)
  rows = [("what", "size", "measured", "compared with", "ratio")]
  if not _SKIP_PULL.value:
    pull_rows(rows)
  if not _SKIP_LOAD.value:
    load_rows(rows)
  widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
  print(f"parameter server on loopback, chunk {_CHUNK_MB.value:g} MiB, {os.cpu_count()} CPUs")
  for r in rows:
    print("  ".join(f"{str(c):<{w}}" for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
  app.run(main)
