"""Parameter-server settings for `rlax-ps serve` (every `ServerConfig` field may appear).

  rlax-ps serve --config=configs/param_server.py --storage_dir=runs/ps --port=50051
  rlax-ps serve --config=configs/param_server.py:tiny   # short deadlines, small chunks, for tests
"""

import dataclasses

import ml_collections

from param_server.server import ServerConfig


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict({"param_server": dataclasses.asdict(ServerConfig())})
  if arg == "tiny":
    config.param_server.chunk_bytes = 64 << 10
    config.param_server.max_chunk_bytes = 64 << 10
    config.param_server.heartbeat_interval_s = 1.0
    config.param_server.reap_interval_s = 0.05
    config.param_server.threads = 32
  elif arg:
    raise ValueError(f"config arg: expected '' or 'tiny', got {arg!r}")
  return config
