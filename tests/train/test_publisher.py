"""The trainer's Publisher, as the process that sends and as a multi-host follower (no
client): both must make the same collective gathers, and only the sender keeps a host copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import device as sync_device
from rlax_ps.train import publisher as publisher_lib


class _Client:
  def __init__(self):
    self.sent = []

  def publish(self, wire, run=""):
    self.sent.append(wire)


def _params(step):
  """Nested params whose kernels change a little at every step (the norm only sometimes)."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((64, 32)).astype(np.float32)
  moved = rng.random((64, 32)) < 0.05 * step
  return {"layers": {"0": {"kernel": jnp.asarray(np.where(moved, w * 1.1, w))}},
          "norm": {"scale": jnp.ones(32, jnp.float32) * (1 + 0.01 * (step // 2))}}


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_follower_makes_the_senders_gathers_and_keeps_nothing(fmt, monkeypatch):
  monkeypatch.setattr(sync_device, "HOST_MEMORY_DIRECT", False)  # the accelerators' path
  calls, real = [], sync_device.to_host

  def recording(tree, keep=True):
    calls.append(jax.tree.map(lambda x: (x.shape, str(x.dtype)), tree))
    return real(tree, keep)

  monkeypatch.setattr(sync_device, "to_host", recording)
  monkeypatch.setattr(publisher_lib, "to_host", recording)
  client = _Client()
  sender = publisher_lib.Publisher(client, fmt, keyframe_every=3)
  follower = publisher_lib.Publisher(None, fmt, keyframe_every=3)
  held = None
  for version in range(5):
    calls.clear()
    sent = sender.publish(_params(version), version)
    sender_calls, calls[:] = list(calls), []
    got = follower.publish(_params(version), version)
    assert calls == sender_calls, version
    # v3: scheduled, a delta and the keyframe the sender alone sends beside it
    assert got.keyframe == sent.keyframe == (version == 0)
    assert (sent.keyframe_bytes > 0, got.keyframe_bytes) == (version == 3, 0)
    assert (got.version, got.bytes, got.digest) == (version, 0, 0)
    assert follower._host is None
    held = sync.apply(held, sync.Update.from_bytes(client.sent[-1]))
    assert sync.state_digest({k: sync.checksum(v) for k, v in held.items()}) == sent.digest
  want = sync.held_state(jax.device_get(publisher_lib.flat_params(_params(4))), fmt)
  for name in want:
    np.testing.assert_array_equal(held[name].view(np.uint8), want[name].view(np.uint8), name)


def test_a_senders_fallback_keyframe_leaves_the_schedule_the_followers_keep():
  """The server lacks a delta's base (it lost its weights): the sender alone sends a
  keyframe, and resends one; the processes of a multi-host slice must still pick the same
  device path for every later version, so neither resets the schedule they share."""
  from param_server.client import ParamServerError
  import grpc

  class LostBaseOnce(_Client):
    def publish(self, wire, run=""):
      if len(self.sent) == 2 and not getattr(self, "refused", False):
        self.refused = True
        raise ParamServerError("Publish", grpc.StatusCode.FAILED_PRECONDITION,
                               "base_version: the server holds no v1")
      super().publish(wire, run)

  client = LostBaseOnce()
  sender = publisher_lib.Publisher(client, "bf16", keyframe_every=4)
  follower = publisher_lib.Publisher(None, "bf16", keyframe_every=4)
  for version in range(9):
    sent = sender.publish(_params(version), version)
    got = follower.publish(_params(version), version)
    if version == 5:
      sender.resend_keyframe()
    assert got.keyframe == (version == 0), version
    assert sender._since_keyframe == follower._since_keyframe, version  # the schedule, alike
    assert sent.keyframe == (version in (0, 2)), version  # v2: the fallback
    assert (sent.keyframe_bytes > 0) == (version in (4, 8)), version  # beside the delta
  held = None
  for wire in client.sent:
    held = sync.apply(held if sync.Update.from_bytes(wire).base_version is not None else None,
                      sync.Update.from_bytes(wire))
  assert sync.state_digest({k: sync.checksum(v) for k, v in held.items()}) == sent.digest


def test_a_version_not_past_the_last_published_is_refused():
  sender = publisher_lib.Publisher(_Client(), "bf16", keyframe_every=4)
  sender.publish(_params(0), 3)
  for again in (3, 2):
    with pytest.raises(ValueError, match=f"version: expected > the last published 3, got "
                                         f"{again}"):
      sender.publish(_params(1), again)


def test_a_delta_refused_for_another_reason_is_raised_not_sent_as_a_keyframe():
  """Only a server that lacks the delta's base gets the version as a keyframe: another
  failure (the server away, a wrong token) is the caller's to retry, with no keyframe sent
  and no false "lost its weights" said."""
  from param_server.client import ParamServerError
  import grpc

  class Away(_Client):  # for the one call after the first
    def publish(self, wire, run=""):
      if self.sent and not getattr(self, "refused", False):
        self.refused = True
        raise ParamServerError("Publish", grpc.StatusCode.UNAVAILABLE, "connection refused")
      super().publish(wire, run)

  client = Away()
  sender = publisher_lib.Publisher(client, "bf16", keyframe_every=4)
  sender.publish(_params(0), 0)
  with pytest.raises(ParamServerError, match="UNAVAILABLE"):
    sender.publish(_params(1), 1)
  assert len(client.sent) == 1


def _held_from(server):
  """The held state a worker pulls from `server`, and its latest version."""
  from rl_testlib import client
  with client(server.address, "worker") as wc:
    held = None
    for blob in wc.pull(None):
      held = sync.apply(held, sync.Update.from_bytes(bytes(blob)))
    return held, wc.latest_version()


def test_a_server_that_lost_its_weights_gets_the_version_as_a_keyframe(tmp_path):
  """A delta to a server without its base (a new storage folder) goes again as a keyframe of
  the same version; resend_keyframe sends the last version to another such server. What the
  workers pull there is the trainer's held state."""
  from rl_testlib import client, start_server
  servers = [start_server(tmp_path / name) for name in "abc"]
  clients = [client(s.address, "trainer") for s in servers]
  try:
    pub = publisher_lib.Publisher(clients[0], "bf16", keyframe_every=50)
    pub.publish(_params(0), 0)
    assert not pub.publish(_params(1), 1).keyframe
    pub.client = clients[1]  # the same address, its storage lost
    sent = pub.publish(_params(2), 2)
    assert sent.keyframe and sent.version == 2
    want = sync.held_state(jax.device_get(publisher_lib.flat_params(_params(2))), "bf16")
    held, latest = _held_from(servers[1])
    assert latest == 2
    for name in want:
      np.testing.assert_array_equal(held[name].view(np.uint8), want[name].view(np.uint8), name)
    assert not pub.publish(_params(3), 3).keyframe  # deltas go on from it
    pub.client = clients[2]
    again = pub.resend_keyframe()
    held, latest = _held_from(servers[2])
    assert (again.version, again.keyframe, latest) == (3, True, 3)
    assert sync.state_digest({k: sync.checksum(v) for k, v in held.items()}) == again.digest
  finally:
    for c in clients:
      c.close()
    for s in servers:
      s.stop(grace=0)


@pytest.mark.parametrize("keyframe", [True, False])
def test_non_finite_weights_are_not_published_in_int8(keyframe):
  """Non-finite weights quantize to NaN scales on device: the publisher refuses them, naming
  the tensor, and sends nothing (the workers would sample from NaN weights)."""
  client = _Client()
  pub = publisher_lib.Publisher(client, "int8", keyframe_every=50)
  pub.publish(_params(0), 0)
  bad = _params(1)
  bad["layers"]["0"]["kernel"] = bad["layers"]["0"]["kernel"].at[3, 5].set(jnp.inf)
  with pytest.raises(sync.CodecError, match="'layers.0.kernel'.*finite"):
    pub.publish(bad, 1, keyframe=keyframe)
  assert len(client.sent) == 1 and pub.version == 0
  assert not pub.publish(_params(1), 1).keyframe  # the good next version is still a delta
