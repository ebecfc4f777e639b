"""Turn a cloud VM's preemption notice into SIGTERM for the process it guards.

Spot/preemptible TPU VMs get about 30 s of notice through the GCE metadata server
(`instance/preempted` flips to TRUE). The worker already treats SIGTERM as "stop leasing,
release what is in flight, exit"; this watchdog runs the worker as a child, watches the
metadata server, and forwards the notice (and any SIGTERM/SIGINT it receives itself).

  python -m inference_workers.preemption_watchdog -- rlax-ps worker --address=...
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
import urllib.request

GCE_PREEMPTED_URL = "http://metadata.google.internal/computeMetadata/v1/instance/preempted"

log = logging.getLogger("rlax_ps.preemption")


def poll_preempted(url: str, timeout_s: float) -> bool | None:
  """One long-poll of the metadata endpoint: True/False, or None when it cannot be reached."""
  query = "?wait_for_change=true&timeout_sec=%d" % max(1, int(timeout_s))
  request = urllib.request.Request(url + query, headers={"Metadata-Flavor": "Google"})
  try:
    with urllib.request.urlopen(request, timeout=timeout_s + 5) as response:
      return response.read().decode().strip().upper() == "TRUE"
  except (urllib.error.URLError, OSError, TimeoutError):
    return None


class PreemptionWatchdog:
  """Runs `command`, sends it SIGTERM on a preemption notice, SIGKILL after `grace_s`."""

  def __init__(self, command: list[str], *, url: str = GCE_PREEMPTED_URL,
               poll_timeout_s: float = 30.0, grace_s: float = 25.0,
               unreachable_backoff_s: float = 5.0):
    if not command:
      raise ValueError("command: expected the program to guard after '--', got nothing")
    self.command = command
    self.url = url
    self.poll_timeout_s = poll_timeout_s
    self.grace_s = grace_s
    self.unreachable_backoff_s = unreachable_backoff_s
    self.preempted = threading.Event()
    self._child: subprocess.Popen | None = None

  def _watch(self) -> None:
    while self._child is not None and self._child.poll() is None:
      state = poll_preempted(self.url, self.poll_timeout_s)
      if state:
        log.warning("preemption notice from %s: sending SIGTERM to pid %d", self.url,
                    self._child.pid)
        self.preempted.set()
        self.terminate()
        return
      if state is None:
        time.sleep(self.unreachable_backoff_s)

  def terminate(self) -> None:
    """SIGTERM now, SIGKILL if the child is still alive after the grace period."""
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
    """Start the child, watch until it exits, return its exit code."""
    self._child = subprocess.Popen(self.command)
    if threading.current_thread() is threading.main_thread():  # forward our own SIGTERM too
      for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: self.terminate())
    threading.Thread(target=self._watch, daemon=True).start()
    return self._child.wait()


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--metadata_url", default=os.environ.get("RLAX_PS_PREEMPTED_URL",
                                                               GCE_PREEMPTED_URL))
  parser.add_argument("--grace_s", type=float, default=25.0,
                      help="seconds between SIGTERM and SIGKILL (GCE gives ~30 s)")
  parser.add_argument("--poll_timeout_s", type=float, default=30.0)
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
  watchdog = PreemptionWatchdog(command, url=args.metadata_url, grace_s=args.grace_s,
                                poll_timeout_s=args.poll_timeout_s)
  sys.exit(watchdog.run())


if __name__ == "__main__":
  main()
