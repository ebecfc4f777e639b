"""`rlax-ps serve`: run the parameter server until interrupted.

  rlax-ps serve --port=50051 --storage_dir=runs/ps [--config=configs/param_server.py]

Settings come from `ServerConfig` defaults, then the `--config` file (its
`param_server` section, or its top level), then any flag given explicitly.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from param_server.auth import TokenStoreError, check_tls_files
from param_server.server import ParamServer, ServerConfig
from param_server.signals import wait_for_stop
from rlax_ps.dataclass_flags import define_flags, resolve

_CONFIG = config_flags.DEFINE_config_file("config", None, "optional ml_collections file with server settings")

define_flags(ServerConfig)
for _field in dataclasses.fields(ServerConfig):  # listed by `rlax-ps serve --help`
  flags.declare_key_flag(_field.name)


def config_from_flags() -> ServerConfig:
  """Defaults, overridden by the config file, overridden by explicit flags."""
  section = None
  if _CONFIG.value is not None:
    section = _CONFIG.value.get("param_server", _CONFIG.value)
  return resolve(ServerConfig, section, "--config server settings")


def bound_malloc_arenas() -> None:
  """Keeps glibc from hoarding freed chunk buffers, without unmapping them on every free.

  By default glibc gives each thread its own arena and raises its mmap threshold after the
  first freed 4 MiB buffer, so RSS grows with the number of streams ever served. Two
  arenas and a fixed 64 MiB threshold keep chunk buffers reused from a small pool (an
  mmap per chunk would zero-fill fresh pages and halve pull throughput), while anything of
  64 MiB or more (a publication) is returned to the OS when freed."""
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return
  libc.mallopt(-8, 2)  # M_ARENA_MAX
  libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD (setting it also stops its dynamic growth)
  libc.mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD


def main(argv) -> None:
  bound_malloc_arenas()
  try:
    config = config_from_flags()
    check_tls_files(config.tls_cert, config.tls_key)
  except (ValueError, TypeError) as e:
    raise app.UsageError(str(e)) from None
  try:
    server = ParamServer(config)
  except (OSError, TokenStoreError) as e:  # a read-only, full or misnamed folder; bad tokens
    print(f"rlax-ps serve: --storage_dir {config.storage_dir}: cannot serve from it: {e}",
          file=sys.stderr, flush=True)
    sys.exit(1)
  server.start()
  print(f"parameter server listening on {server.address}", flush=True)
  if server.metrics_port is not None:
    print(f"metrics on http://{config.host}:{server.metrics_port}/metrics", flush=True)
  wait_for_stop()
  logging.info("shutting down")
  server.stop(grace=2.0)
