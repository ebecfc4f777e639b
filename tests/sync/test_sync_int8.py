"""int8 format: layout, exact quantizer invariants, and exact held state after any deltas."""

import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import int8
from rlax_ps.sync.bits import BF16


def model(rng, scale=0.02):
  return {
      "embed.embedding": (rng.standard_normal((24, 16)) * scale).astype(np.float32),
      "layers.0.mlp.up_proj.kernel": (rng.standard_normal((16, 40)) * scale).astype(np.float32),
      "layers.0.attn.qkv.kernel": (rng.standard_normal((16, 3, 8)) * scale).astype(np.float32),
      "layers.0.input_norm.scale": (1 + rng.standard_normal(16) * scale).astype(np.float32),
      "layers.1.mlp.router.kernel": (rng.standard_normal((16, 3)) * scale).astype(np.float32),
      # Stacked experts [E, in, out], expert 1 ten times larger than the others.
      "layers.1.mlp.experts.down_proj": (rng.standard_normal((3, 8, 16)) * scale
                                         * np.array([1, 10, 1])[:, None, None]).astype(np.float32),
  }


def broadcast_axes(name, ndim):
  """The axes int8.py keeps for a tensor's scales."""
  if name.endswith("embedding"):
    return (0,)
  return (0, ndim - 1) if ".experts." in name else (ndim - 1,)


def test_layout_scales_per_output_channel_per_row_and_keeps_1d_in_bf16():
  held = sync.quantize_params(model(np.random.default_rng(0)))
  assert held["layers.0.mlp.up_proj.kernel"].dtype == np.int8
  assert held["layers.0.mlp.up_proj.kernel.scale"].shape == (40,)  # last axis of [in, out]
  assert held["layers.0.attn.qkv.kernel.scale"].shape == (8,)
  assert held["embed.embedding.scale"].shape == (24,)  # one per row of [V, H]
  assert held["layers.1.mlp.experts.down_proj.scale"].shape == (3, 16)  # [E, out] of [E, in, out]
  assert held["embed.embedding.scale"].dtype == BF16
  assert held["layers.0.input_norm.scale"].dtype == BF16
  assert held["layers.1.mlp.router.kernel"].dtype == BF16  # routing as the trainer's
  assert "layers.1.mlp.router.kernel.scale" not in held
  assert "layers.0.input_norm.scale.scale" not in held


def test_error_is_within_half_a_step_and_scales_are_the_bf16_ceiling():
  rng = np.random.default_rng(1)
  params = model(rng)
  params["layers.0.mlp.up_proj.kernel"][:, 3] = 0.0  # an all-zero channel
  params["layers.0.mlp.up_proj.kernel"][0, 5] = 1e-30  # a tiny channel max
  held = sync.quantize_params(params)
  for name in ["embed.embedding", "layers.0.mlp.up_proj.kernel", "layers.0.attn.qkv.kernel",
               "layers.1.mlp.experts.down_proj"]:
    w = params[name].astype(np.float64)
    kept = broadcast_axes(name, w.ndim)
    shape = [w.shape[i] if i in kept else 1 for i in range(w.ndim)]
    s = held[name + ".scale"].astype(np.float64).reshape(shape)
    codes = held[name].astype(np.float64)
    assert np.all(np.abs(w - codes * s) <= s / 2), name
    assert np.all(np.abs(codes) <= 127)
    absmax = np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i not in kept)).reshape(shape)
    assert np.all(s >= absmax / 127)
    below = (held[name + ".scale"].view(np.uint16) - 1).view(BF16).astype(np.float64)
    nonzero = held[name + ".scale"].view(np.uint16) > 0
    assert np.all(below[nonzero] < (absmax.reshape(below.shape) / 127)[nonzero]), name
  # The large expert does not coarsen the others' steps: each has its own scales.
  experts = held["layers.1.mlp.experts.down_proj.scale"].astype(np.float64)
  assert experts[1].mean() > 5 * max(experts[0].mean(), experts[2].mean())
  np.testing.assert_array_equal(
      sync.dequantize(held)["layers.1.mlp.experts.down_proj"],
      held["layers.1.mlp.experts.down_proj"] * experts.astype(np.float32)[:, None, :])
  deq = sync.dequantize(held)
  assert np.all(deq["layers.0.mlp.up_proj.kernel"][:, 3] == 0)


def test_held_state_equals_quantized_target_after_every_delta():
  rng = np.random.default_rng(2)
  weights = model(rng)
  update = sync.encode(None, weights, "int8", version=0)
  held = sync.apply(None, sync.Update.from_bytes(update.to_bytes()))
  prev = weights
  for version in range(1, 7):
    lr = 10.0 ** rng.uniform(-6, -2)
    weights = {k: (v - lr * np.sign(rng.standard_normal(v.shape))).astype(np.float32)
               for k, v in prev.items()}
    base = prev if version % 2 else held  # float base or the held state: same update
    update = sync.encode(base, weights, "int8", version=version)
    held = sync.apply(held, sync.Update.from_bytes(update.to_bytes()), base_version=version - 1)
    want = sync.quantize_params(weights)
    assert held.keys() == want.keys()
    for k in want:
      assert held[k].dtype == want[k].dtype and np.array_equal(held[k], want[k]), (version, k)
    prev = weights


def test_float_and_held_bases_give_identical_updates():
  rng = np.random.default_rng(3)
  a = model(rng)
  b = {k: v * np.float32(1.001) for k, v in a.items()}
  from_float = sync.encode(a, b, "int8", version=1)
  from_held = sync.encode(sync.quantize_params(a), b, "int8", version=1)
  assert from_float.to_bytes() == from_held.to_bytes()


def test_int8_keyframe_is_about_half_of_bf16():
  params = {"w.kernel": np.random.default_rng(4).standard_normal((256, 512)).astype(np.float32)}
  bf16 = sync.encode(None, params, "bf16", version=0).nbytes
  q = sync.encode(None, params, "int8", version=0).nbytes
  assert q <= 0.52 * bf16


def test_non_finite_weights_and_name_collisions_are_named():
  with pytest.raises(sync.CodecError, match="'w.kernel'.*finite"):
    sync.quantize_params({"w.kernel": np.array([[1.0, np.nan]], np.float32)})
  with pytest.raises(sync.CodecError, match="'w.kernel.scale'.*collides"):
    sync.quantize_params({"w.kernel": np.ones((2, 2), np.float32),
                          "w.kernel.scale": np.ones(2, np.float32)})
  with pytest.raises(sync.CodecError, match="'w.kernel'.*need bf16 scales 'w.kernel.scale'"):
    int8.check_held({"w.kernel": np.ones((2, 2), np.int8)})
  with pytest.raises(sync.CodecError, match=r"'m.experts.up.scale': shape expected \(2, 4\)"):
    int8.check_held({"m.experts.up": np.ones((2, 3, 4), np.int8),
                     "m.experts.up.scale": np.ones(4, BF16)})


def test_scales_of_the_right_rank_but_another_size_are_refused_naming_them():
  """Each of a channel's codes needs its scale: scales of the codes' rank but too few (one
  would broadcast over every channel) are refused by check_held and encode, not dequantized
  or published."""
  codes = np.ones((2, 3), np.int8)  # "w.kernel": channels last, 3 scales
  for scales in (np.ones(2, BF16), np.ones(1, BF16)):
    held = {"w.kernel": codes, "w.kernel.scale": scales}
    with pytest.raises(sync.CodecError, match=r"'w.kernel.scale': shape expected \(3,\)"):
      int8.check_held(held)
    with pytest.raises(sync.CodecError, match=r"'w.kernel.scale': shape expected \(3,\)"):
      sync.encode(None, held, "int8", version=0)
  with pytest.raises(sync.CodecError, match=r"'m.experts.up.scale': shape expected \(2, 4\)"):
    int8.check_held({"m.experts.up": np.ones((2, 3, 4), np.int8),
                     "m.experts.up.scale": np.ones((2, 3), BF16)})


def test_quantizer_matches_float64_division_with_ties_to_even():
  rng = np.random.default_rng(7)
  w = (rng.standard_normal((64, 48)) * 0.02).astype(np.float32)
  _, scale = int8.quantize_tensor("x.kernel", w[4:])  # rows 0-3 are planted below
  s = scale.astype(np.float64)
  k = rng.integers(-100, 100, w.shape[1])  # below every channel max: scales stay put
  w[0] = ((k + 0.5) * s).astype(np.float32)  # exact ties (16 significant bits fit float32)
  w[1] = np.nextafter(w[0], np.float32(1))
  w[2] = np.nextafter(w[0], np.float32(-1))
  w[3] = (k * s).astype(np.float32)
  codes, scale2 = int8.quantize_tensor("x.kernel", w)
  assert np.array_equal(scale2.view(np.uint16), scale.view(np.uint16))
  want = np.clip(np.rint(w.astype(np.float64) / s), -127, 127).astype(np.int8)
  assert np.array_equal(codes, want)
  assert np.all(codes[0] % 2 == 0)  # every tie went to the even code
  codes64, _ = int8.quantize_tensor("x.kernel", w.astype(np.float64))  # the dividing path
  assert np.array_equal(codes64, want)
