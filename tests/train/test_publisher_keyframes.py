"""The publisher's scheduled keyframes: every keyframe_every versions the version goes as a
delta and as a keyframe, so a worker one version behind pulls the delta while a new worker
pulls the keyframe, not the chain before it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_testlib import client, start_server
from rlax_ps import sync
from rlax_ps.models.config import ModelConfig
from rlax_ps.train import publisher as publisher_lib

K = 4  # keyframe_every


def _params(step):
  """Params of which about 1% of the elements move at each step."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((256, 256)).astype(np.float32)
  for s in range(1, step + 1):
    w = np.where(np.random.default_rng(s).random(w.shape) < 0.01, w * 1.1, w)
  return {"layers": {"0": {"kernel": jnp.asarray(w)}}, "norm": {"scale": jnp.ones(256)}}


def _want(step, fmt):
  return sync.held_state(jax.device_get(publisher_lib.flat_params(_params(step))), fmt)


def _pull(wc, have, held):
  """(the held state after pulling from `have`, the updates pulled)."""
  updates = [sync.Update.from_bytes(bytes(b)) for b in wc.pull(have)]
  for update in updates:
    held = sync.apply(None if update.is_keyframe else held, update)
  return held, updates


def _assert_equal(held, want):
  assert sorted(held) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(held[name].view(np.uint8), want[name].view(np.uint8), name)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_worker_one_version_behind_a_scheduled_keyframe_pulls_the_delta(tmp_path, fmt):
  server = start_server(tmp_path / "ps")
  try:
    with client(server.address, "trainer") as tc, client(server.address, "worker") as wc:
      pub = publisher_lib.Publisher(tc, fmt, keyframe_every=K)
      held = None
      for version in range(K):
        assert pub.publish(_params(version), version).keyframe == (version == 0)
        held, _ = _pull(wc, None if held is None else version - 1, held)
      sent = pub.publish(_params(K), K)  # a delta, and the keyframe beside it
      assert not sent.keyframe and sent.keyframe_bytes > 20 * sent.bytes
      behind, updates = _pull(wc, K - 1, held)
      assert [(u.version, u.base_version) for u in updates] == [(K, K - 1)]
      fresh, fresh_updates = _pull(wc, None, None)
      assert [(u.version, u.is_keyframe) for u in fresh_updates] == [(K, True)]
      assert updates[0].nbytes * 20 < fresh_updates[0].nbytes
      for state in (behind, fresh):
        _assert_equal(state, _want(K, fmt))
        assert sync.state_digest({k: sync.checksum(v) for k, v in state.items()}) == sent.digest
      assert not pub.publish(_params(K + 1), K + 1).keyframe  # deltas go on from it
      later, updates = _pull(wc, K - 1, held)
      assert [u.base_version for u in updates] == [K - 1, K]
      _assert_equal(later, _want(K + 1, fmt))
  finally:
    server.stop(grace=0)


def test_each_version_a_keyframe_sends_no_delta_beside_it(tmp_path):
  """keyframe_every=1: every version's keyframe alone (it sent a delta and a keyframe)."""
  sent = []

  class Client:
    def publish(self, wire, run=""):
      sent.append(sync.Update.from_bytes(wire))

  pub = publisher_lib.Publisher(Client(), "bf16", keyframe_every=1)
  pubs = [pub.publish(_params(v), v) for v in range(3)]
  assert [p.keyframe for p in pubs] == [True] * 3
  assert [(u.version, u.is_keyframe) for u in sent] == [(0, True), (1, True), (2, True)]
  assert all(p.keyframe_bytes == 0 for p in pubs)


def test_a_restart_keyframe_goes_alone(tmp_path):
  """A keyframe asked (the trainer's restored weights, as the next version) is the version's
  only update: the server holds no version before it from this publisher."""
  sent = []

  class Client:
    def publish(self, wire, run=""):
      sent.append(sync.Update.from_bytes(wire))

  pub = publisher_lib.Publisher(Client(), "bf16", keyframe_every=K)
  pub.publish(_params(0), 0)
  pub.publish(_params(1), 1)
  assert pub.publish(_params(2), 2, keyframe=True).keyframe
  assert [(u.version, u.is_keyframe) for u in sent] == [(0, True), (1, False), (2, True)]


def test_every_keyframe_carries_the_models_fields():
  """The first keyframe and each scheduled one name the model (its forward fields), so that a
  worker of another model refuses the weights instead of sampling with them."""
  model = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1,
                      num_heads=2, num_kv_heads=1)

  class Sent:
    updates = []

    def publish(self, wire, run=""):
      self.updates.append(sync.Update.from_bytes(bytes(wire)))

  publisher = publisher_lib.Publisher(Sent(), "bf16", keyframe_every=2, model=model)
  for version in (1, 2, 3):
    publisher.publish(_params(version), version)
  keyframes = [u for u in Sent.updates if u.is_keyframe]
  assert len(keyframes) >= 2 and len(Sent.updates) > len(keyframes)
  for update in keyframes:
    assert update.model is not None and dict(update.model) == dict(model.forward_fields())
