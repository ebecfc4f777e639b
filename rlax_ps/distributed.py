"""Flags that join the hosts of a multi-host slice into one JAX job (jax.distributed), for
`rlax-ps train` and `rlax-ps sft`: run the same command on every host."""

from __future__ import annotations

from absl import flags

COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "Multi-host: process 0's HOST:PORT for jax.distributed, or "
    "'auto' to detect the slice (TPU VMs). '' = one process.")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-host: processes in all "
                                     "(with a HOST:PORT coordinator).")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index, 0 "
                                  "to num_processes - 1 (with a HOST:PORT coordinator).")


def initialize() -> bool:
  """Join the job the flags name, before any JAX backend starts; True on process 0 (the
  one that talks to servers and writes logs and exports), and when there is one process."""
  import jax
  if COORDINATOR.value:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts' collectives
    if COORDINATOR.value == "auto":
      jax.distributed.initialize()
    else:
      jax.distributed.initialize(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)
  return jax.process_index() == 0
