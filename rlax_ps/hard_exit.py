"""Leave the process at once, output flushed, without finalizing the interpreter.

A worker's last act is to exit within its grace period. Python's finalization can abort
the process instead: a daemon thread, or a native thread of gRPC or XLA, that wakes up
inside C++ while the interpreter shuts down is stopped with pthread_exit, and a C++
`catch (...)` on its stack turns that into "FATAL: exception not rethrown" and SIGABRT
(CPython bpo-42969). By the time a worker exits, its leases are released, its stream is
cancelled and nothing is buffered but stdio and logs, so nothing is lost by skipping it.
A process of a multi-host job that failed leaves so too: jax.distributed.shutdown at exit
waits (5 minutes) for the other processes, which wait for this one in a collective.
"""

from __future__ import annotations

import os
import sys

from absl import logging


def exit_now(code: int = 0) -> None:
  """Flush logs and stdio, then `os._exit(code)`: no atexit handlers, no finalization."""
  try:
    logging.flush()
    for stream in (sys.stdout, sys.stderr):
      if stream is not None:
        stream.flush()
  finally:
    os._exit(code)
