"""Turn a cloud VM's preemption notice into SIGTERM for the process it guards.

Spot/preemptible TPU VMs get about 30 s of notice through the GCE metadata server
(`instance/preempted` flips to TRUE). The worker already treats SIGTERM as "stop leasing,
release what is in flight, exit"; this watchdog runs the worker as a child, watches the
metadata server, and forwards the notice (and any SIGTERM/SIGINT it receives itself).
With --restart a child that fails (a non-zero exit not caused by a stop or a preemption)
is started again after an exponential backoff, so a VM does not sit idle after a crash.

  python -m inference_workers.preemption_watchdog --restart -- rlax-ps worker --address=...
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

GCE_PREEMPTED_URL = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"
USAGE_ERROR = 2  # every rlax-ps command's exit status for flags or settings it refuses

log = logging.getLogger("rlax_ps.preemption")


def poll_preempted(url: str, timeout_s: float,
                   etag: str | None = None) -> tuple[bool | None, str | None]:
  """(True/False, the value's ETag) of the metadata endpoint, or (None, None) when it cannot
  be reached. Without `etag` it answers at once; with the ETag of the value last read it
  long-polls until the value differs from that one (a notice given between two polls is
  answered at once, not missed until the next change or timeout)."""
  query = ("" if etag is None else "?wait_for_change=true&timeout_sec=%d&last_etag=%s"
           % (max(1, int(timeout_s)), urllib.parse.quote(etag)))
  request = urllib.request.Request(url + query, headers={"Metadata-Flavor": "Google"})
  try:
    with urllib.request.urlopen(request, timeout=timeout_s + 5) as response:
      return (response.read().decode().strip().upper() == "TRUE",
              response.headers.get("ETag"))
  except (urllib.error.URLError, OSError, TimeoutError):
    return None, None


class PreemptionWatchdog:
  """Runs `command`, sends it SIGTERM on a preemption notice, SIGKILL after `grace_s`; with
  `restart`, runs it again after a failure, waiting `backoff_s` doubling to `max_backoff_s`
  (back to `backoff_s` once a child has run for `max_backoff_s` or longer)."""

  def __init__(self, command: list[str], *, url: str = GCE_PREEMPTED_URL,
               poll_timeout_s: float = 30.0, grace_s: float = 25.0,
               unreachable_backoff_s: float = 5.0, restart: bool = False,
               backoff_s: float = 1.0, max_backoff_s: float = 60.0):
    if not command:
      raise ValueError("command: expected the program to guard after '--', got nothing")
    self.command = command
    self.url = url
    self.poll_timeout_s = poll_timeout_s
    self.grace_s = grace_s
    self.unreachable_backoff_s = unreachable_backoff_s
    self.restart, self.backoff_s, self.max_backoff_s = restart, backoff_s, max_backoff_s
    self.preempted = threading.Event()
    self.stopping = threading.Event()  # a stop or a preemption: no restart
    self.starts = 0
    self._child: subprocess.Popen | None = None

  def _watch(self, child: subprocess.Popen) -> None:
    etag = None  # none: read the value at once (after a start, or the server unreachable)
    while child.poll() is None and not self.preempted.is_set():
      state, etag = poll_preempted(self.url, self.poll_timeout_s, etag)
      if state:
        log.warning("preemption notice from %s: sending SIGTERM to pid %d", self.url,
                    child.pid)
        self.preempted.set()
        self.terminate()
        return
      if state is None:
        time.sleep(self.unreachable_backoff_s)

  def terminate(self) -> None:
    """SIGTERM now, SIGKILL if the child is still alive after the grace period; no restart."""
    self.stopping.set()
    child = self._child
    if child is None or child.poll() is not None:
      return
    child.send_signal(signal.SIGTERM)

    def kill_later():
      try:
        child.wait(timeout=self.grace_s)
      except subprocess.TimeoutExpired:
        log.error("pid %d ignored SIGTERM for %.0f s: SIGKILL", child.pid, self.grace_s)
        child.kill()

    threading.Thread(target=kill_later, daemon=True).start()

  def run(self) -> int:
    """Start the child and watch it until it exits (and, with `restart`, until one exits
    cleanly or is stopped); return the last exit code. Our own SIGTERM and SIGINT are
    forwarded to the child meanwhile (from the main thread); the handlers before are put
    back on return."""
    before = {}
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        before[sig] = signal.signal(sig, lambda *_: self.terminate())
    try:
      return self._run()
    finally:
      for sig, handler in before.items():
        signal.signal(sig, handler)

  def _run(self) -> int:
    delay = self.backoff_s
    while True:
      started = time.monotonic()
      self._child = child = subprocess.Popen(self.command)
      self.starts += 1
      if self.stopping.is_set():  # a stop that came while it was being started
        self.terminate()
      threading.Thread(target=self._watch, args=(child,), daemon=True).start()
      code = child.wait()
      if code == 0 or not self.restart or self.stopping.is_set():
        return code
      if code == USAGE_ERROR:  # a bad flag or setting: every restart would repeat it
        log.error("pid %d exited with status %d (bad flags or settings: see its last lines); "
                  "not starting it again", child.pid, code)
        return code
      if time.monotonic() - started >= self.max_backoff_s:
        delay = self.backoff_s  # it ran a while: a new failure, not a crash loop
      log.warning("pid %d exited with status %d: starting it again in %.0f s", child.pid,
                  code, delay)
      if self.stopping.wait(delay):
        return code
      delay = min(2 * delay, self.max_backoff_s)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--metadata_url", default=os.environ.get("RLAX_PS_PREEMPTED_URL",
                                                               GCE_PREEMPTED_URL))
  parser.add_argument("--grace_s", type=float, default=25.0,
                      help="seconds between SIGTERM and SIGKILL (GCE gives ~30 s)")
  parser.add_argument("--poll_timeout_s", type=float, default=30.0)
  parser.add_argument("--restart", action="store_true",
                      help="start the command again when it fails (not after a stop)")
  parser.add_argument("--max_backoff_s", type=float, default=60.0,
                      help="longest wait before a restart (the first is 1 s, then doubling)")
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
  watchdog = PreemptionWatchdog(command, url=args.metadata_url, grace_s=args.grace_s,
                                poll_timeout_s=args.poll_timeout_s, restart=args.restart,
                                max_backoff_s=args.max_backoff_s)
  sys.exit(watchdog.run())


if __name__ == "__main__":
  main()
