"""How a serving command (`rlax-ps serve`, `rlax-ps relay`) waits out its lifetime."""

from __future__ import annotations

import signal
import threading


def wait_for_stop() -> None:
  """Return on the first SIGINT or SIGTERM (Ctrl-C, a pod's or VM's stop)."""
  done = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: done.set())
  done.wait()
