"""Flags that join the hosts of a multi-host slice into one JAX job (jax.distributed), for
`rlax-ps train` and `rlax-ps sft`: run the same command on every host."""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from typing import Callable

from absl import app, flags

COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "Multi-host: process 0's HOST:PORT for jax.distributed, or "
    "'auto' to detect the slice (TPU VMs). '' = one process.")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: processes in all "
                                     "(with a HOST:PORT coordinator).")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index, 0 "
                                  "to num_processes - 1 (with a HOST:PORT coordinator).")
JOIN_TIMEOUT = flags.DEFINE_integer(
    "coordinator_timeout_s", 300, "Multi-host: how long each process waits for every "
    "process of the job to join; then it stops, naming the flags to check.")
_JAX_JOIN_SLACK_S = 30  # jax's own join timeout is this much later: ours speaks first


def check_flags(coordinator: str, num_processes: int | None, process_id: int | None) -> None:
  """Refuse (app.UsageError: one line, exit 2) a combination jax.distributed would fail on
  with a traceback, or one that would leave each host training alone on the same workdir."""
  if not coordinator:
    if (num_processes or 1) != 1 or (process_id or 0) != 0:
      raise app.UsageError(
          f"--num_processes={num_processes}, --process_id={process_id}: a multi-host job "
          f"needs --coordinator_address (process 0's HOST:PORT, or auto on TPU VMs); got "
          f"none, so each host would train alone")
    return
  if coordinator == "auto":
    return
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise app.UsageError(f"--coordinator_address: expected HOST:PORT (e.g. 10.0.0.2:8476) or "
                         f"auto, got {coordinator!r}")
  if num_processes is None or num_processes < 1:
    raise app.UsageError(f"--num_processes: expected the number of processes (>= 1) with "
                         f"--coordinator_address={coordinator}, got {num_processes}")
  if process_id is None or not 0 <= process_id < num_processes:
    raise app.UsageError(f"--process_id: expected this process's index, 0 to "
                         f"{num_processes - 1} (--num_processes={num_processes}), got "
                         f"{process_id}")


def port_free(port: int) -> bool:
  """Whether this host can listen on `port` on every address, as process 0's coordinator does."""
  families = [(socket.AF_INET, "0.0.0.0")] + ([(socket.AF_INET6, "::")] if socket.has_ipv6 else [])
  for family, address in families:
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        return False
  return True


def _leave(message: str) -> None:
  print(message, file=sys.stderr, flush=True)
  os._exit(1)  # the main thread is inside jax's join: nothing else can end the process


def join_within(join: Callable[[], None], timeout_s: float, message: str,
                leave: Callable[[str], None] = _leave) -> None:
  """join(), or `leave(message)` if it has not returned within `timeout_s`: jax's own join
  timeout aborts the process with a message that blames a task that died."""
  done = threading.Event()

  def watch():
    if not done.wait(timeout_s):
      leave(message)

  threading.Thread(target=watch, name="join-watchdog", daemon=True).start()
  try:
    join()
  finally:
    done.set()


def not_joined_message(prog: str, coordinator: str, num_processes: int | None,
                       process_id: int | None, timeout_s: int) -> str:
  """What a process says when the job's other processes did not all join in time."""
  if coordinator == "auto":
    return (f"{prog}: --coordinator_address=auto: not every host of the slice joined within "
            f"--coordinator_timeout_s={timeout_s}; run the same command on every host")
  return (f"{prog}: --num_processes={num_processes}: not all {num_processes} processes joined "
          f"the job at --coordinator_address={coordinator} within --coordinator_timeout_s="
          f"{timeout_s} (this is --process_id={process_id}); start the same command on every "
          f"host with the same --coordinator_address and --num_processes and each its own "
          f"--process_id, 0 to {num_processes - 1} (a host not started, or two given one id)")


_joined = False  # this process joined a job of several (initialize)


def joined_others() -> bool:
  """Whether this process is one of a multi-host job's: one that fails must leave at once
  (rlax_ps.hard_exit), its peers then leaving their collectives too."""
  return _joined


def initialize(prog: str = "rlax-ps") -> bool:
  """Join the job the flags name, before any JAX backend starts; True on process 0 (the
  one that talks to servers and writes logs and exports), and when there is one process.
  A job whose processes do not all join within --coordinator_timeout_s ends (exit 1) with a
  line from `prog` naming the flags."""
  import jax
  check_flags(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)
  if COORDINATOR.value:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts' collectives
    timeout = JOIN_TIMEOUT.value
    if timeout < 1:
      raise app.UsageError(f"--coordinator_timeout_s: expected a number of seconds >= 1, got "
                           f"{timeout}")
    message = not_joined_message(prog, COORDINATOR.value, NUM_PROCESSES.value,
                                 PROCESS_ID.value, timeout)
    if COORDINATOR.value == "auto":
      try:
        join_within(lambda: jax.distributed.initialize(
            None, NUM_PROCESSES.value, PROCESS_ID.value,
            initialization_timeout=timeout + _JAX_JOIN_SLACK_S), timeout, message)
      except ValueError as e:  # no cluster detected: nothing started yet
        raise app.UsageError(
            f"--coordinator_address=auto: found no multi-host environment to join on this "
            f"host (TPU VM metadata, SLURM, ...; jax: {e}); pass process 0's HOST:PORT with "
            f"--num_processes and --process_id, or no --coordinator_address for one "
            f"process") from e
    else:
      port = int(COORDINATOR.value.rpartition(":")[2])
      if PROCESS_ID.value == 0 and not port_free(port):  # jax fails on it, at times crashing
        raise app.UsageError(
            f"--coordinator_address={COORDINATOR.value}: process 0 cannot listen on port "
            f"{port} (another program holds it); pick a free port, the same on every host")
      # Every setting given: no cluster detection, which under SLURM or Open MPI would
      # also pin this process to one GPU (JAX_LOCAL_DEVICE_IDS still chooses, if set).
      join_within(lambda: jax.distributed.initialize(
          COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value,
          cluster_detection_method="deactivate",
          initialization_timeout=timeout + _JAX_JOIN_SLACK_S), timeout, message)
    global _joined
    _joined = jax.process_count() > 1
  return jax.process_index() == 0
