"""On-device application of TensorChanges equals the host apply, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import device
from rlax_ps.sync.bits import BF16


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_device_apply_matches_host_apply_for_every_kind(fmt):
  rng = np.random.default_rng(0)
  base = {
      "sparse.kernel": rng.standard_normal((64, 48)).astype(np.float32) * 0.02,
      "dense.kernel": rng.standard_normal((32, 16)).astype(np.float32) * 0.02,
      "same.kernel": rng.standard_normal((8, 8)).astype(np.float32),
      "norm": np.ones(16, np.float32),
  }
  target = dict(base)
  target["sparse.kernel"] = base["sparse.kernel"].copy()
  target["sparse.kernel"][rng.random((64, 48)) < 0.05] *= 1.1
  target["dense.kernel"] = base["dense.kernel"] * np.float32(1.03)
  target["norm"] = base["norm"] + rng.standard_normal(16).astype(np.float32)
  held = sync.held_state(base, fmt)
  update = sync.encode(held, target, fmt, version=1)
  want = sync.apply(held, update)
  kinds, results = set(), {}
  for name, meta in update.tensors.items():
    ch = update.changes(name)
    kinds.add(ch.kind)
    out = device.apply_changes(jnp.asarray(held[name]), ch)
    got = np.asarray(jax.device_get(out))
    assert got.dtype == want[name].dtype and np.array_equal(
        got.view(np.uint8), want[name].view(np.uint8)), name
    results[name] = got
  update.verify_all(results)
  assert {"sparse", "unchanged"} <= kinds


def test_device_apply_rejects_a_mismatched_buffer():
  base = {"w": np.zeros((4, 4), BF16)}
  update = sync.encode(base, {"w": np.ones((4, 4), np.float32)}, version=1)
  with pytest.raises(sync.CodecError, match="'w'.*expected bfloat16\\[4, 4\\]"):
    device.apply_changes(jnp.zeros((4, 5), jnp.bfloat16), update.changes("w"))
