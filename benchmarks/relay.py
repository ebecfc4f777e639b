"""Weight relays on loopback: the server's egress and the time until every worker holds a new
keyframe, W workers pulling from the server directly vs through R relays.

  .venv/bin/python benchmarks/relay.py --size_mb=128 --workers=8 --relays=2

The server (`rlax-ps serve`) and each relay (`rlax-ps relay`) run in processes of their own;
the workers are pulling threads here. Loopback has no link to save: the egress column is
the point (each version leaves the server R times instead of W), the time column shows what
the extra hop costs where bandwidth is free.
"""

from __future__ import annotations

import os
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

from param_server.client import ParamServerClient, RetryPolicy  # noqa: E402
from rlax_ps import sync  # noqa: E402

_SIZE_MB = flags.DEFINE_integer("size_mb", 128, "keyframe size in MiB (bf16 weights)")
_WORKERS = flags.DEFINE_integer("workers", 8, "pulling workers")
_RELAYS = flags.DEFINE_integer("relays", 2, "relays the workers are spread over")

TOKENS = {"trainer": "bench-trainer", "worker": "bench-worker", "viewer": "bench-viewer"}
ENV = dict(os.environ, **{f"RLAX_PS_{r.upper()}_TOKEN": t for r, t in TOKENS.items()})


def _spawn(*args: str) -> tuple[subprocess.Popen, str]:
  proc = subprocess.Popen([sys.executable, "-m", "rlax_ps", *args], cwd=REPO, env=ENV,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  line = proc.stdout.readline()
  if "listening on" not in line:
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start: {line!r}")
  return proc, line.split("listening on ")[1].split()[0].rstrip(",")


def _client(address: str, role: str) -> ParamServerClient:
  return ParamServerClient(address, token=TOKENS[role], role=role, timeout_s=120.0,
                           retry=RetryPolicy(deadline_s=60.0))


def _weights(size_mb: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  n = size_mb * (1 << 20) // 2 // 4
  return {f"w{i}": rng.normal(size=(n,)).astype(ml_dtypes.bfloat16) for i in range(4)}


def _run(workers: int, relays: int, update: bytes) -> tuple[int, float]:
  """(bytes the server sent, seconds from publication until every worker holds it)."""
  with tempfile.TemporaryDirectory() as tmp:
    server, address = _spawn("serve", f"--storage_dir={tmp}/ps", "--port=0")
    procs = [server]
    try:
      targets = [address]
      for r in range(relays):
        proc, relay = _spawn("relay", f"--address={address}", "--port=0",
                             f"--storage_dir={tmp}/relay{r}")
        procs.append(proc)
        targets.append(relay)
      pullers = targets[1:] or targets
      with _client(address, "trainer") as trainer:
        start = time.perf_counter()
        trainer.publish(update)
        done = []

        def pull(target: str) -> None:
          with _client(target, "worker") as w:
            done.append(sum(len(b) for b in w.pull()))

        threads = [threading.Thread(target=pull, args=(pullers[i % len(pullers)],))
                   for i in range(workers)]
        for t in threads:
          t.start()
        for t in threads:
          t.join()
        seconds = time.perf_counter() - start
        assert len(done) == workers and set(done) == {len(update)}, done
        with _client(address, "viewer") as viewer:
          sent = viewer.stats().bytes_served
      return sent, seconds
    finally:
      for p in procs:
        p.terminate()
        p.wait(timeout=30)


def main(argv) -> None:
  del argv
  update = sync.encode(None, _weights(_SIZE_MB.value), "bf16", version=0).to_bytes()
  w, r = _WORKERS.value, _RELAYS.value
  direct_bytes, direct_s = _run(w, 0, update)
  relay_bytes, relay_s = _run(w, r, update)
  mib = 1 << 20
  print(f"{len(update) / mib:.0f} MiB keyframe, {w} workers; loopback, {os.cpu_count()} cores")
  print(f"{'measurement':<44}| {'via relays':>12} | {'direct':>10} | ratio")
  print(f"{f'server egress MiB ({r} relays vs none)':<44}| {relay_bytes / mib:>12.0f} | "
        f"{direct_bytes / mib:>10.0f} | {direct_bytes / max(relay_bytes, 1):.2f}x less")
  print(f"{'seconds until every worker holds it':<44}| {relay_s:>12.2f} | {direct_s:>10.2f} | "
        f"{direct_s / relay_s:.2f}x")


if __name__ == "__main__":
  app.run(main)
