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
    assert got.keyframe == sent.keyframe == (version in (0, 3))
    assert (got.version, got.bytes, got.digest) == (version, 0, 0)
    assert follower._host is None
    held = sync.apply(held, sync.Update.from_bytes(client.sent[-1]))
    assert sync.state_digest({k: sync.checksum(v) for k, v in held.items()}) == sent.digest
  want = sync.held_state(jax.device_get(publisher_lib.flat_params(_params(4))), fmt)
  for name in want:
    np.testing.assert_array_equal(held[name].view(np.uint8), want[name].view(np.uint8), name)
