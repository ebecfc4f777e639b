"""Helpers for parameter-server tests (imported by conftest.py and the tests): configs, clients, tiny models."""

import os
import subprocess
import sys

import numpy as np

from child_env import child_env
from param_server.client import ParamServerClient, RetryPolicy
from param_server.server import ServerConfig
from rlax_ps import sync

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = {"trainer": "trainer-secret", "worker": "worker-secret", "viewer": "viewer-secret"}
CHUNK = 4096  # tiny chunks so tiny models still span several


def small_config(storage_dir, **overrides) -> ServerConfig:
  values = dict(storage_dir=str(storage_dir), port=0, chunk_bytes=CHUNK, max_chunk_bytes=CHUNK,
                max_message_bytes=1 << 20, reap_interval_s=0.05, compact_in_background=False,
                threads=32, trainer_token=TOKENS["trainer"], worker_token=TOKENS["worker"],
                viewer_token=TOKENS["viewer"])
  values.update(overrides)
  return ServerConfig(**values)


def client_for(server_or_address, role, **kwargs):
  address = getattr(server_or_address, "address", server_or_address)
  kwargs.setdefault("retry", RetryPolicy(deadline_s=5.0))
  kwargs.setdefault("chunk_bytes", CHUNK)
  return ParamServerClient(address, token=TOKENS.get(role), role=role, timeout_s=10.0, **kwargs)


def tiny_weights(seed=0):
  rng = np.random.default_rng(seed)
  return {"embed": rng.normal(size=(64, 32)).astype(np.float32),
          "layer0/kernel": rng.normal(size=(32, 48)).astype(np.float32),
          "layer0/bias": rng.normal(size=(48,)).astype(np.float32)}


def perturbed(weights, density, seed):
  """A copy of `weights` with about `density` of the elements moved by a few percent."""
  rng = np.random.default_rng(seed)
  out = {}
  for k, v in weights.items():
    mask = rng.random(v.shape) < density
    out[k] = (v * np.where(mask, 1.05, 1.0)).astype(np.float32)
  return out


def publish_chain(trainer_client, n_versions, fmt="bf16", density=0.05, fingerprints=None,
                  model=None):
  """Publishes a keyframe (v0) and n_versions-1 deltas; returns the float weights of each
  version. `fingerprints`, `model`: encode's arguments (True: seal device fingerprints; the
  publishing model's config fields, on the keyframe alone, as the trainer's publisher
  sends them)."""
  versions = [tiny_weights()]
  trainer_client.publish(sync.encode(None, versions[0], fmt, version=0,
                                     fingerprints=fingerprints, model=model).to_bytes())
  for v in range(1, n_versions):
    versions.append(perturbed(versions[-1], density, seed=v))
    trainer_client.publish(sync.encode(versions[-2], versions[-1], fmt, version=v,
                                       fingerprints=fingerprints).to_bytes())
  return versions


def apply_blobs(blobs, held=None):
  for b in blobs:
    held = sync.apply(held, sync.Update.from_bytes(b))
  return held


def spawn_server(storage_dir, *extra_flags):
  """`rlax-ps serve` in a subprocess; returns (process, address) once it listens."""
  flags = ["--config=configs/param_server.py:tiny", f"--storage_dir={storage_dir}", "--port=0", f"--chunk_bytes={CHUNK}",
           f"--max_chunk_bytes={CHUNK}", "--reap_interval_s=0.05", "--threads=32",
           "--nocompact_in_background"]
  env = dict(child_env(), **{f"RLAX_PS_{r.upper()}_TOKEN": t for r, t in TOKENS.items()})
  proc = subprocess.Popen([sys.executable, "-m", "rlax_ps", "serve", *flags, *extra_flags], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  line = proc.stdout.readline()
  if "listening on" not in line:
    proc.kill()
    raise RuntimeError(f"server did not start: {line!r}")
  return proc, line.rsplit(" ", 1)[1].strip()
