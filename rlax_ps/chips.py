"""One host's GPUs or TPU chips split between `rlax-ps local`'s trainer and workers.

The kind of host and its chip count come from device files, so the supervisor never starts
a JAX backend. Each process is given its own chips by environment: CUDA_VISIBLE_DEVICES on
a GPU host; on a TPU host the settings libtpu reads for a process that owns a sub-slice of
the host (a TPU host's chips can otherwise be opened by one process only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import socket

FIELDS = "local.trainer_chips, local.chips_per_worker"
TPU_FILES = ("accel[0-9]*", "vfio/[0-9]*")  # v2-v4, v5p: /dev/accelN; v5e, v6e: /dev/vfio/N
GPU_FILES = ("nvidia[0-9]*",)
# A sub-slice's shape by its chip count: libtpu's TPU_CHIPS_PER_PROCESS_BOUNDS.
TPU_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1"}


@dataclasses.dataclass(frozen=True)
class Host:
  """This machine's accelerators: kind "tpu", "gpu" or "" (none found), and how many."""
  kind: str
  chips: int


def _count(dev: str, patterns: tuple[str, ...]) -> int:
  return sum(len(glob.glob(os.path.join(dev, p))) for p in patterns)


def detect_host(dev: str = "/dev") -> Host:
  """The host's TPU chips (one /dev/accelN or /dev/vfio/N each), else its GPUs
  (/dev/nvidiaN), from the device folder `dev`."""
  for kind, patterns in (("tpu", TPU_FILES), ("gpu", GPU_FILES)):
    if n := _count(dev, patterns):
      return Host(kind, n)
  return Host("", 0)


def chip_ranges(counts: list[int]) -> list[range]:
  """Consecutive chips for processes that take `counts` chips each, in order from chip 0."""
  starts = [sum(counts[:i]) for i in range(len(counts))]
  return [range(s, s + n) for s, n in zip(starts, counts)]


def check_split(host: Host, trainer_chips: int, chips_per_worker: int, workers: int) -> None:
  """ValueError naming the fields unless the trainer's and each worker's chips fit the host:
  on a TPU host, 1, 2 or 4 chips a process, each sub-slice starting at a multiple of its
  size."""
  asked = f"{FIELDS}: {trainer_chips} and {chips_per_worker}"
  if not host.kind:
    raise ValueError(f"{asked} (a split of this host's chips), but no GPU or TPU chip was "
                     f"found (no /dev/nvidia[0-9]*, /dev/accel[0-9]* or /dev/vfio/[0-9]*); "
                     f"set both to 0")
  tpu = host.kind == "tpu"
  if tpu and not {trainer_chips, chips_per_worker} <= TPU_BOUNDS.keys():
    raise ValueError(f"{asked}: a TPU process takes 1, 2 or 4 chips (the whole host is the "
                     f"trainer's with both at 0)")
  total = trainer_chips + workers * chips_per_worker
  if total > host.chips:
    raise ValueError(f"{asked}: the trainer's {trainer_chips} + {workers} workers (local.workers)"
                     f" x {chips_per_worker} = {total} chips, more than this host's "
                     f"{host.chips} {host.kind.upper()} chips")
  if not tpu:
    return
  names = ["the trainer", *(f"worker-{i}" for i in range(workers))]
  for name, chips in zip(names, chip_ranges([trainer_chips] + [chips_per_worker] * workers)):
    if chips.start % len(chips):
      raise ValueError(f"{asked}: {name}'s {len(chips)} chips would start at chip "
                       f"{chips.start}, not a multiple of {len(chips)} (a TPU sub-slice "
                       f"starts at a multiple of its size); give the trainer a multiple of "
                       f"{len(chips)} chips")


def tpu_env(chips: range, host_chips: int, port: int) -> dict[str, str]:
  """libtpu's settings for a process that owns `chips` of a host's `host_chips`, with
  `port` its own; none for one that owns them all (libtpu's defaults)."""
  if len(chips) == host_chips:
    return {}
  return {"TPU_VISIBLE_CHIPS": ",".join(map(str, chips)), "TPU_PROCESS_BOUNDS": "1,1,1",
          "TPU_CHIPS_PER_PROCESS_BOUNDS": TPU_BOUNDS[len(chips)],
          "TPU_PROCESS_PORT": str(port), "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
          "CLOUD_TPU_TASK_ID": "0", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def free_ports(n: int) -> list[int]:
  """`n` distinct TCP ports free on this host now (held together while chosen)."""
  with contextlib.ExitStack() as stack:
    sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
    for s in sockets:
      s.bind(("", 0))  # free on every address: libtpu may listen on any
    return [s.getsockname()[1] for s in sockets]


def split_envs(trainer_chips: int, chips_per_worker: int, workers: int,
               dev: str = "/dev", env=os.environ) -> list[dict[str, str]]:
  """The environment of the trainer, then of each worker, that gives each its own chips of
  this host (ValueError naming the fields where they do not fit). GPUs this process was
  given (CUDA_VISIBLE_DEVICES, set by a scheduler or a user sharing the host) are the ones
  split; TPU chips it was given alone (TPU_VISIBLE_CHIPS) are refused."""
  host = detect_host(dev)
  given = env.get("CUDA_VISIBLE_DEVICES") if host.kind == "gpu" else None
  gpus = None if given is None else [g.strip() for g in given.split(",") if g.strip()]
  if gpus is not None:
    host = Host("gpu", len(gpus))
  if host.kind == "tpu" and env.get("TPU_VISIBLE_CHIPS"):
    raise ValueError(f"{FIELDS}: {trainer_chips} and {chips_per_worker} split this host's TPU "
                     f"chips, but this process was given chips {env['TPU_VISIBLE_CHIPS']} "
                     f"alone (TPU_VISIBLE_CHIPS); unset it, or set both to 0")
  check_split(host, trainer_chips, chips_per_worker, workers)
  ranges = chip_ranges([trainer_chips] + [chips_per_worker] * workers)
  if host.kind == "gpu":
    names = gpus or [str(i) for i in range(host.chips)]
    return [{"CUDA_VISIBLE_DEVICES": ",".join(names[i] for i in r)} for r in ranges]
  return [tpu_env(r, host.chips, port) for r, port in zip(ranges, free_ports(len(ranges)))]
