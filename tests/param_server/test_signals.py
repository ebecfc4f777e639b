"""`wait_for_stop`: a serving command stops on a signal whichever thread the kernel gives it
to, and exits within its limit even with a thread stuck."""

import subprocess
import sys
import textwrap

from ps_testlib import REPO

_CHILD = textwrap.dedent("""
    import signal, sys, threading, time
    from param_server.signals import wait_for_stop
    ready = threading.Event()
    def busy():  # stands for a gRPC thread: the signal is sent to it, not to the main thread
      ready.set()
      time.sleep(600)
    other = threading.Thread(target=busy, daemon=True)
    other.start()
    ready.wait()
    threading.Timer(0.2, lambda: signal.pthread_kill(other.ident, signal.SIGTERM)).start()
    wait_for_stop(limit_s=float(sys.argv[1]))
    print("stopping", flush=True)
    if sys.argv[2] == "stuck":  # a non-daemon thread that never ends holds the exit
      threading.Thread(target=time.sleep, args=(600,), name="stuck-call").start()
""")


def _run(limit_s: float, how: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", _CHILD, str(limit_s), how], cwd=REPO,
                        capture_output=True, text=True, timeout=20)


def test_a_signal_given_to_another_thread_stops_the_wait():
  done = _run(30.0, "clean")
  assert done.returncode == 0 and done.stdout == "stopping\n", done.stderr


def test_a_stuck_thread_cannot_hold_the_exit_past_the_limit():
  done = _run(1.0, "stuck")
  assert done.returncode == 1 and done.stdout == "stopping\n"
  assert done.stderr.startswith("Timeout (0:00:01)!")  # then every thread's stack
  assert "in busy" in done.stderr and "in _shutdown" in done.stderr


_DURING_WAIT = textwrap.dedent("""
    import os, signal, threading, time
    class Signalled(threading.Event):  # the signal lands while the wait holds its lock
      def wait(self, timeout=None):
        with self._cond:
          os.kill(os.getpid(), signal.SIGTERM)
          time.sleep(0.05)  # the handler runs here, on this thread
        return self.is_set()
    threading.Event = Signalled
    real_sleep = time.sleep
    def sleep(s):  # likewise for a wait that sleeps
      os.kill(os.getpid(), signal.SIGTERM)
      real_sleep(min(s, 0.05))
    time.sleep = sleep
    from param_server.signals import wait_for_stop
    wait_for_stop(limit_s=30.0)
    print("stopping", flush=True)
""")


def test_a_signal_that_lands_while_the_wait_holds_a_lock_still_stops_it():
  """The handler set an Event, taking the lock the main thread's wait held while the
  handler ran on it: a stop signal at that moment hung the server until SIGKILL."""
  done = subprocess.run([sys.executable, "-c", _DURING_WAIT], cwd=REPO, capture_output=True,
                        text=True, timeout=20)
  assert done.returncode == 0 and done.stdout == "stopping\n", done.stderr
