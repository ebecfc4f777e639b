"""Flags that join the hosts of a multi-host slice into one JAX job (jax.distributed), for
`rlax-ps train` and `rlax-ps sft`: run the same command on every host."""

from __future__ import annotations

from absl import app, flags

COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "Multi-host: process 0's HOST:PORT for jax.distributed, or "
    "'auto' to detect the slice (TPU VMs). '' = one process.")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: processes in all "
                                     "(with a HOST:PORT coordinator).")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index, 0 "
                                  "to num_processes - 1 (with a HOST:PORT coordinator).")


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


def initialize() -> bool:
  """Join the job the flags name, before any JAX backend starts; True on process 0 (the
  one that talks to servers and writes logs and exports), and when there is one process."""
  import jax
  check_flags(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)
  if COORDINATOR.value:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts' collectives
    if COORDINATOR.value == "auto":
      try:
        jax.distributed.initialize(None, NUM_PROCESSES.value, PROCESS_ID.value)
      except ValueError as e:  # no cluster detected: nothing started yet
        raise app.UsageError(
            f"--coordinator_address=auto: found no multi-host environment to join on this "
            f"host (TPU VM metadata, SLURM, ...; jax: {e}); pass process 0's HOST:PORT with "
            f"--num_processes and --process_id, or no --coordinator_address for one "
            f"process") from e
    else:
      jax.distributed.initialize(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)
  return jax.process_index() == 0
