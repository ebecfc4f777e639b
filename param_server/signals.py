"""How a serving command (`rlax-ps serve`, `rlax-ps relay`) waits out its lifetime."""

from __future__ import annotations

import faulthandler
import signal
import time

STOP_LIMIT_S = 30.0  # from the stop signal to the process's exit, whatever its threads do


def wait_for_stop(limit_s: float = STOP_LIMIT_S) -> None:
  """Return on the first SIGINT or SIGTERM (Ctrl-C, a pod's or VM's stop). From then on the
  process exits within `limit_s`: past it, every thread's stack goes to stderr and it exits 1
  (a thread stuck in a call must not keep a stopped server's port and storage lock)."""
  asked: list[int] = []  # no lock in the handler: it runs on this thread, maybe while the
  for sig in (signal.SIGINT, signal.SIGTERM):  # wait below holds one (Event.set deadlocked)
    signal.signal(sig, lambda signum, _: asked.append(signum))
  # Waking often: a signal the kernel gave another thread (gRPC's) runs its Python handler
  # only once the main thread runs again, and a sleep goes on after a handler (PEP 475).
  while not asked:
    time.sleep(0.1)
  faulthandler.dump_traceback_later(limit_s, exit=True)
