"""Publishing the trainer's weights as versions: the held state (bf16 rounding or int8
quantization) is made on device, only the elements that changed since the last publication
are fetched (`rlax_ps.sync.device.publish_state`), and the host encodes a delta against the
last published version. Every `keyframe_every` versions a keyframe of the version, encoded
from the host copy, follows its delta: it bounds the chain a new worker applies, while a
worker one version behind still pulls the delta. A delta the server cannot apply (it lost
the base: a new storage folder) goes again as a keyframe.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable

import grpc
import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from param_server.client import ParamServerError
from rlax_ps import sync
from rlax_ps.models.config import ModelConfig
from rlax_ps.sharding import to_host
from rlax_ps.sync import device as sync_device
from rlax_ps.sync import int8_device

FORMATS = ("bf16", "int8")


def flat_params(params: Any) -> dict[str, jax.Array]:
  """Nested params dict -> {"layers.0.attn.q_proj.kernel": array}, the codec's names."""
  return {".".join(map(str, k)): v for k, v in nnx.traversals.flatten_mapping(params).items()}


def _held_bf16(params: Any) -> dict[str, jax.Array]:
  return {k: v.astype(jnp.bfloat16) for k, v in flat_params(params).items()}


def _held_int8(params: Any) -> dict[str, jax.Array]:
  return int8_device.quantize_params_jax(flat_params(params))


@functools.lru_cache(maxsize=None)
def held_state_fn(fmt: str) -> Callable[[Any], dict[str, jax.Array]]:
  """jit(params -> the workers' held state in `fmt`), computed where the params live."""
  if fmt not in FORMATS:
    raise ValueError(f"publish.format: expected one of {FORMATS}, got {fmt!r}")
  return jax.jit(_held_bf16 if fmt == "bf16" else _held_int8)


@dataclasses.dataclass(frozen=True)
class Publication:
  version: int
  keyframe: bool  # sent as a keyframe alone (the first, a restart's, one asked for)
  bytes: int  # the encoded update's size (the delta's, or that keyframe's)
  seconds: float  # device diff + fetch + encode + send (a keyframe beside it included)
  digest: int  # sync.state_digest of the published held state
  keyframe_bytes: int = 0  # a scheduled keyframe's, sent beside the delta (else 0)


class Publisher:
  """Publishes successive versions of one parameter stream to a parameter server. On a
  multi-host slice every process runs it on the same params, since the device work and
  the gathers are collective; only the process with a `client` keeps a host copy, encodes
  and sends. The others (client None) keep nothing on the host and return Publications
  with bytes 0 and digest 0. `model`: the trainer's model config, whose forward fields every
  keyframe carries (a keyframe a server compacts from deltas keeps them, and every worker
  starts from a keyframe), so that a worker of another model refuses the weights instead of
  sampling wrong."""

  def __init__(self, client, fmt: str = "bf16", keyframe_every: int = 50,
               model: ModelConfig | None = None):
    if keyframe_every < 1:
      raise ValueError(f"publish.keyframe_every: expected >= 1, got {keyframe_every}")
    self.client, self.fmt, self.keyframe_every = client, fmt, int(keyframe_every)
    self.model_fields = None if model is None else model.forward_fields()
    self._held = held_state_fn(fmt)
    self._device: dict | None = None  # the last published held state, on device
    self._host: dict | None = None  # the same, on the host
    self._checksums: dict | None = None
    self.version: int | None = None
    self._since_keyframe = 0
    self.run = ""  # the publishing run's id, sent with each publication (the server checks it)

  def publish(self, params: Any, version: int, *, keyframe: bool = False) -> Publication:
    """Encode and send `params` as `version`: a keyframe alone if this is the first, one is
    asked (a restart's) or a version was skipped; else a delta from the last publication,
    followed by a keyframe of `version` once keyframe_every versions passed since one."""
    if self.version is not None and version <= self.version:
      raise ValueError(f"version: expected > the last published {self.version}, got {version}")
    t0 = time.perf_counter()
    new_device = self._held(params)
    keyframe = (keyframe or self._device is None or version != self.version + 1
                or self.keyframe_every == 1)  # (each version a keyframe: no delta beside)
    # The schedule every process of a multi-host slice keeps alike (their device paths must
    # match): a keyframe the sender alone falls back to does not reset it.
    scheduled = keyframe or self._since_keyframe + 1 >= self.keyframe_every
    sends = self.client is not None  # None: a follower process of a multi-host trainer
    if keyframe:
      host = to_host(new_device, keep=sends)
      prints, base, checksums = sync_device.fingerprints_of(new_device), None, None
    else:
      host, prints = sync_device.publish_state(self._host, self._device, new_device, host=sends)
      base, checksums = self._host, self._checksums
    size, digest = 0, 0
    if sends:
      if self.fmt == "int8":  # (non-finite weights quantize to NaN scales on device)
        int8_device.check_finite(host)
      update = sync.encode(base, host, self.fmt, version=version, fingerprints=prints,
                           base_checksums=checksums,
                           model=self.model_fields if keyframe else None)
      wire = update.to_bytes()
      try:
        self.client.publish(wire, run=self.run)
      except ParamServerError as e:
        if keyframe or not lacks_base(e):
          raise
        logging.warning("publish: sending v%d as a keyframe: the server lacks its base (it "
                        "lost its weights)", version)
        update, wire = self._send_keyframe(host, version)
        keyframe = True
      self._host, self._checksums = host, update.checksums
      size, digest = len(wire), sync.state_digest(update.checksums)
      del update, wire
    self._device, self.version = new_device, version
    self._since_keyframe = 0 if scheduled else self._since_keyframe + 1
    beside = 0
    if sends and scheduled and not keyframe:
      # The version's keyframe, stored beside its delta: a new worker pulls it, one a
      # version behind still the delta.
      beside = len(self._send_keyframe(host, version, prints)[1])
    return Publication(version, keyframe, size, time.perf_counter() - t0, digest, beside)

  def resend_keyframe(self) -> Publication:
    """The last published version again, as a keyframe encoded from the host copy (no device
    work, so one process of a multi-host slice may do it, leaving the keyframe schedule as
    the others keep it): for a server that lost it."""
    if self.client is None or self._host is None:
      raise ValueError("resend_keyframe: expected a publisher that sent a version before")
    t0 = time.perf_counter()
    logging.warning("publish: sending v%d as a keyframe: the server lacks its base (it lost "
                    "its weights)", self.version)
    update, wire = self._send_keyframe(self._host, self.version)
    return Publication(self.version, True, len(wire), time.perf_counter() - t0,
                       sync.state_digest(update.checksums))

  def _send_keyframe(self, host: dict, version: int, fingerprints: dict | bool = True
                     ) -> tuple[sync.Update, bytes]:
    """Sends the host copy `host` as a keyframe of `version` (`fingerprints`: its device
    fingerprints, or True to compute them on the host)."""
    update = sync.encode(None, host, self.fmt, version=version, fingerprints=fingerprints,
                         model=self.model_fields)
    wire = update.to_bytes()
    self.client.publish(wire, run=self.run)
    return update, wire


def lacks_base(e: ParamServerError) -> bool:
  """Whether a publication was refused for its base version (the server does not hold it)."""
  return e.code == grpc.StatusCode.FAILED_PRECONDITION and e.details.startswith("base_version")
