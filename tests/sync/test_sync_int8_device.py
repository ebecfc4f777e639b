"""The JAX int8 quantizer equals the host one bit for bit (ties, bf16 scale boundaries, zero
channels, subnormal and huge weights, bf16 inputs, sharded arrays) and flags non-finite weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlax_ps.sync import int8, int8_device
from rlax_ps.sync.bits import BF16
from rlax_ps.sync.errors import CodecError

SHAPE = (24, 16)  # every tensor below is padded into this shape: one compile per layout and dtype
_quantize = jax.jit(int8_device.quantize_tensor_jax, static_argnums=0)


def assert_same_as_host(name, w):
  want_codes, want_scale = int8.quantize_tensor(name, w)
  codes, scale = jax.device_get(_quantize(name, jnp.asarray(w)))
  assert scale.dtype == BF16 and codes.dtype == np.int8 and codes.shape == w.shape
  assert np.array_equal(scale.view(np.uint16), want_scale.view(np.uint16)), (name, w.dtype)
  assert np.array_equal(codes, want_codes), (name, np.argwhere(codes != want_codes)[:4])


def assert_both_layouts(w):
  assert_same_as_host("a.kernel", w)
  assert_same_as_host("a.embedding", np.ascontiguousarray(w.T))


def channel_scales(rng, n, lo, hi):
  """n random bf16 values (subnormal ones too) with exponents in [lo, hi), as float64."""
  m = rng.integers(128, 256, n).astype(np.float64)
  return np.ldexp(m, rng.integers(lo, hi, n) - 7).astype(BF16).astype(np.float64)


def test_params_of_every_layout_and_dtype_equal_quantize_params():
  rng = np.random.default_rng(0)
  params = {
      "embed.embedding": rng.standard_normal((24, 16)) * 0.02,
      "mlp.kernel": rng.standard_normal(SHAPE) * 0.02,
      "attn.qkv.kernel": rng.standard_normal((4, 6, 16)) * 0.02,
      "mlp.experts.gate_proj": (rng.standard_normal((3, 6, 16))
                                * np.array([0.02, 2e-30, 3.0])[:, None, None]),
      "norm.scale": 1 + rng.standard_normal(16) * 0.02,
  }
  for dtype in [np.float32, BF16]:
    p = {k: v.astype(dtype) for k, v in params.items()}
    want = int8.quantize_params(p)
    got = int8_device.quantize_params_device(p)
    assert got.keys() == want.keys()
    for k in want:
      assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
      assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), (dtype, k)


def test_exact_ties_and_their_neighbours_at_every_scale():
  rng = np.random.default_rng(1)
  for lo, hi in [(-20, 5), (-133, -112), (-112, -60), (100, 120)]:
    b = channel_scales(rng, SHAPE[1], lo, hi)
    w = (rng.choice([-1.0, 1.0], SHAPE) * (rng.integers(0, 127, SHAPE) + 0.5) * b)
    w = w.astype(np.float32)  # (k + 1/2) * b has 16 significant bits: exact
    w[0] = 127 * b  # absmax / 127 == b: the scale is b
    w[1:8] = np.nextafter(w[1:8], np.float32(0))
    w[8:12] = np.nextafter(w[8:12], np.float32(np.inf))
    assert_both_layouts(w)
    codes, _ = int8.quantize_tensor("a.kernel", w)
    assert np.any(codes[12:] % 2 == 0), "ties present"


def test_absmax_exactly_at_and_next_to_bf16_boundaries():
  rng = np.random.default_rng(2)
  for lo, hi in [(-30, 10), (-133, -100), (110, 120)]:
    top = (127 * channel_scales(rng, SHAPE[1], lo, hi)).astype(np.float32)
    for absmax in [top, np.nextafter(top, np.float32(np.inf)), np.nextafter(top, np.float32(0))]:
      w = (rng.uniform(-1, 1, SHAPE) * absmax).astype(np.float32)
      w[3] = absmax
      assert_both_layouts(w)


def test_zero_channels_subnormal_and_huge_weights():
  rng = np.random.default_rng(3)
  w = rng.standard_normal(SHAPE).astype(np.float32)
  w[:, 2], w[:, 5] = 0.0, -0.0
  assert_both_layouts(w)
  tiny = np.ldexp(rng.standard_normal(SHAPE), rng.integers(-149, -110, (1, SHAPE[1])))
  assert_both_layouts(tiny.astype(np.float32))
  assert_both_layouts(tiny.astype(BF16))
  fmax = np.finfo(np.float32).max
  huge = (rng.uniform(-1, 1, SHAPE) * fmax).astype(np.float32)
  huge[0, ::2], huge[1, 1::2] = fmax, -fmax
  assert_both_layouts(huge)


@settings(max_examples=30, deadline=None)
@given(exponent=st.integers(-149, 120), seed=st.integers(0, 2**32 - 1),
       bf16=st.booleans(), ties=st.booleans())
def test_random_magnitudes_and_planted_ties_equal_the_host(exponent, seed, bf16, ties):
  rng = np.random.default_rng(seed)
  w = np.ldexp(rng.standard_normal(SHAPE), exponent + rng.integers(-10, 10, (1, SHAPE[1])))
  w = np.clip(w, -3e38, 3e38).astype(np.float32)
  if ties:
    _, scale = int8.quantize_tensor("a.kernel", w)
    planted = (rng.integers(-126, 126, SHAPE) + 0.5) * scale.astype(np.float64)
    w = np.where(rng.random(SHAPE) < 0.5, planted.astype(np.float32), w)
  assert_both_layouts(w.astype(BF16) if bf16 else w)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_flag_their_channel_and_raise_naming_the_tensor(bad):
  w = np.ones(SHAPE, np.float32)
  w[4, 7] = bad
  codes, scale = jax.device_get(_quantize("w.kernel", jnp.asarray(w)))
  assert np.isnan(scale[7]) and not np.isnan(np.delete(scale, 7)).any()
  assert np.all(codes[:, 7] == 0)
  with pytest.raises(CodecError, match="'w.kernel'.*finite"):
    int8_device.quantize_params_device({"w.kernel": w, "b.bias": np.ones(16, np.float32)})
  with pytest.raises(CodecError, match="'w.embedding'.*finite"):
    int8_device.quantize_params_device({"w.embedding": np.ascontiguousarray(w.T)})


def test_bad_tensors_are_named():
  with pytest.raises(CodecError, match="'w.kernel'.*dtype expected a floating type, got int32"):
    int8_device.quantize_params_jax({"w.kernel": jnp.ones((2, 2), jnp.int32)})
  with pytest.raises(CodecError, match="'w.kernel.scale'.*collides"):
    int8_device.quantize_params_jax({"w.kernel": jnp.ones((2, 2)), "w.kernel.scale": jnp.ones(2)})
  with pytest.raises(CodecError, match="'b'.*ndim >= 2 and no 'router'.*got shape"):
    int8_device.quantize_tensor_jax("b", jnp.ones(3))
  with pytest.raises(CodecError, match="'m.router.kernel'.*no 'router' in the name"):
    int8_device.quantize_tensor_jax("m.router.kernel", jnp.ones((3, 2)))


def test_sharded_inputs_give_the_same_codes_and_scales():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  w = (np.random.default_rng(5).standard_normal(SHAPE) * 0.02).astype(np.float32)
  for name, spec, shape in [("a.kernel", PartitionSpec("data", "model"), SHAPE),
                            ("a.embedding", PartitionSpec("model", "data"), SHAPE),
                            ("a.experts.up", PartitionSpec(None, "data", "model"), (3, 8, 16))]:
    w = w.reshape(shape)
    x = jax.device_put(w, NamedSharding(mesh, spec))
    codes, scale = _quantize(name, x)
    assert len(codes.sharding.device_set) == 8
    want_codes, want_scale = int8.quantize_tensor(name, w)
    assert np.array_equal(np.asarray(codes), want_codes), name
    assert np.array_equal(np.asarray(scale).view(np.uint16), want_scale.view(np.uint16)), name
