"""Weight relays: the server's egress and the time until every worker holds a new keyframe,
W workers pulling from the server directly vs through R relays, across a long link.

  .venv/bin/python benchmarks/relay.py --size_mb=64 --workers=8 --relays=2 --link_mb_s=100

The server (`rlax-ps serve`) and each relay (`rlax-ps relay`) run in processes of their own;
the workers are pulling threads here. Everything that reaches the server from the workers'
side (direct workers, relays) crosses one link of `link_mb_s` MB/s, shared (a TCP proxy
here): the link between the server's region and the workers' zone. Relays and their workers
talk over loopback. The lower bound for the relayed time is the relays' R copies crossing
the link; a relay streams a version on as it arrives (cut-through), so it comes close.
`--link_mb_s=0`: no link, loopback only (the extra hop's cost where bandwidth is free).
"""

from __future__ import annotations

import contextlib
import os
import socket
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
_RELAYS = flags.DEFINE_integer("relays", 2, "relays the workers are spread over",
                               lower_bound=1)
_LINK = flags.DEFINE_float("link_mb_s", 100.0, "bandwidth of the link to the server, MB/s "
                           "(shared by every connection crossing it); 0: loopback only")

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


class _Link:
  """A TCP proxy to `target` whose bytes towards the client share `rate` bytes/s (first come,
  first served): the long link between the server and the workers' zone."""

  def __init__(self, target: str, rate: float):
    self.target, self.rate = target.rsplit(":", 1), rate
    self._listener = socket.create_server(("127.0.0.1", 0))
    self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
    self._lock = threading.Lock()
    self._free_at = time.monotonic()
    threading.Thread(target=self._accept, daemon=True).start()

  def _spend(self, n: int) -> None:
    with self._lock:
      start = max(time.monotonic(), self._free_at)
      self._free_at = start + n / self.rate
      until = self._free_at
    time.sleep(max(0.0, until - time.monotonic()))

  def _pump(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
    with contextlib.suppress(OSError):  # either side closed: the connection is over
      while data := src.recv(256 << 10):
        if throttled:
          self._spend(len(data))
        dst.sendall(data)
    for s in (src, dst):
      with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)

  def _accept(self) -> None:
    while True:
      try:
        client, _ = self._listener.accept()
      except OSError:
        return
      try:
        upstream = socket.create_connection((self.target[0], int(self.target[1])))
      except OSError:  # the server has stopped
        client.close()
        continue
      threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
      threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

  def close(self) -> None:
    self._listener.close()


def _run(workers: int, relays: int, update: bytes, link_rate: float) -> tuple[int, float]:
  """(bytes the server sent, seconds from the server holding a version until every worker
  holds it)."""
  with tempfile.TemporaryDirectory() as tmp:
    server, address = _spawn("serve", f"--storage_dir={tmp}/ps", "--port=0")
    procs = [server]
    link = _Link(address, link_rate) if link_rate else None
    far = link.address if link else address  # the server as the workers' zone reaches it
    try:
      targets = [far]
      for r in range(relays):
        proc, relay = _spawn("relay", f"--address={far}", "--port=0",
                             f"--storage_dir={tmp}/relay{r}")
        procs.append(proc)
        targets.append(relay)
      pullers = targets[1:] or targets
      with _client(address, "trainer") as trainer:
        trainer.publish(update)
        start = time.perf_counter()  # the server holds it
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
      if link:
        link.close()


def main(argv) -> None:
  del argv
  update = sync.encode(None, _weights(_SIZE_MB.value), "bf16", version=0).to_bytes()
  w, r, rate = _WORKERS.value, _RELAYS.value, _LINK.value * 1e6
  direct_bytes, direct_s = _run(w, 0, update, rate)
  relay_bytes, relay_s = _run(w, r, update, rate)
  mib = 1 << 20
  where = f"a {_LINK.value:g} MB/s link to the server" if rate else "loopback"
  print(f"{len(update) / mib:.0f} MiB keyframe, {w} workers, {r} relays; {where}, "
        f"{os.cpu_count()} cores")
  print(f"{'measurement':<44}| {'via relays':>12} | {'direct':>10} | ratio")
  print(f"{'server egress MiB':<44}| {relay_bytes / mib:>12.0f} | "
        f"{direct_bytes / mib:>10.0f} | {direct_bytes / max(relay_bytes, 1):.2f}x less")
  print(f"{'seconds until every worker holds it':<44}| {relay_s:>12.2f} | {direct_s:>10.2f} | "
        f"{direct_s / relay_s:.2f}x faster")
  if rate:
    bound = r * len(update) / rate
    print(f"{'  the relays copies over the link (bound)':<44}| {bound:>12.2f} | "
          f"{w * len(update) / rate:>10.2f} | relayed time {relay_s / bound:.2f}x the bound")


if __name__ == "__main__":
  app.run(main)
