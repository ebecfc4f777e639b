"""Host int8 quantizer (int8_loops via int8.quantize_tensor) against a slow float64 reference:
ties, bf16 scale boundaries, zero channels, subnormal and huge weights, every input dtype."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_ps.sync import int8
from rlax_ps.sync.bits import BF16
from rlax_ps.sync.errors import CodecError

# Every finite bf16 value >= 0 in increasing order, times 127 (exact in float64).
_BF16_POS = np.arange(0x7F80, dtype=np.uint16).view(BF16)
_BF16_X127 = _BF16_POS.astype(np.float64) * 127


def reference(name, w):
  """(codes, scales) in float64: scale = smallest bf16 b with 127 b >= absmax (exact),
  codes = clip(round_half_even(w / scale), -127, 127)."""
  w = np.asarray(w).astype(np.float64)
  axis = 0 if name.endswith("embedding") else w.ndim - 1
  wm = np.moveaxis(w, axis, -1)
  absmax = np.abs(wm.reshape(-1, wm.shape[-1])).max(axis=0, initial=0.0)
  scale = _BF16_POS[np.searchsorted(_BF16_X127, absmax, side="left")]
  s = scale.astype(np.float64)
  codes = np.clip(np.round(wm / np.where(s > 0, s, 1.0)), -127, 127).astype(np.int8)
  return np.moveaxis(codes, -1, axis), scale


def assert_matches_reference(name, w):
  codes, scale = int8.quantize_tensor(name, w)
  want_codes, want_scale = reference(name, w)
  assert np.array_equal(scale.view(np.uint16), want_scale.view(np.uint16)), name
  assert codes.dtype == np.int8 and codes.shape == np.shape(w)
  assert np.array_equal(codes, want_codes), (name, np.argwhere(codes != want_codes)[:4])


def bf16_scales(rng, n, lo=-133, hi=120):
  """n random bf16 values (normal and subnormal) with exponents in [lo, hi]."""
  e = rng.integers(lo, hi, n)
  m = rng.integers(128, 256, n).astype(np.float64)
  return np.maximum(np.ldexp(m, e - 7), 2.0**-133).astype(BF16).astype(np.float64)


def tie_tensor(rng, n_cols=24, n_rows=40, lo=-133, hi=120):
  """[n_rows, n_cols] float32: column c has absmax 127 * b_c (scale exactly b_c) and holds
  exact ties (k + 1/2) b_c of both signs, their float32 neighbours and exact multiples."""
  b = bf16_scales(rng, n_cols, lo, hi)
  k = rng.integers(0, 127, (n_rows, n_cols)) + 0.5
  sign = rng.choice([-1.0, 1.0], (n_rows, n_cols))
  w = (sign * k * b).astype(np.float32)  # 16 significant bits: exact
  w[0] = 127 * b
  third = n_rows // 3
  w[1:third] = np.nextafter(w[1:third], np.float32(0))
  w[third:2 * third] = np.round(w[third:2 * third] / b.astype(np.float32)) * b
  return w


def test_random_normal_weights_match_the_float64_reference_in_every_dtype_and_layout():
  rng = np.random.default_rng(0)
  for dtype in [np.float32, BF16, np.float16, np.float64]:
    for shape in [(33, 17), (3, 5, 7), (1, 9), (9, 1)]:
      w = (rng.standard_normal(shape) * 0.02).astype(dtype)
      assert_matches_reference("a.kernel", w)
      assert_matches_reference("a.embedding", w)


def test_exact_ties_go_to_the_even_code_at_every_scale():
  rng = np.random.default_rng(1)
  for lo, hi in [(-20, 5), (-133, -110), (100, 120)]:
    w = tie_tensor(rng, lo=lo, hi=hi)
    assert_matches_reference("a.kernel", w)
    assert_matches_reference("a.embedding", np.ascontiguousarray(w.T))
    codes, _ = int8.quantize_tensor("a.kernel", w)
    assert np.any(codes % 2 == 0) and np.any(codes % 2 != 0)


def test_absmax_at_and_next_to_bf16_boundaries_of_absmax_over_127():
  rng = np.random.default_rng(2)
  b = bf16_scales(rng, 64)
  top = (127 * b).astype(np.float32)  # exactly 127 times a bf16: scale b
  for absmax in [top, np.nextafter(top, np.float32(np.inf)), np.nextafter(top, np.float32(0))]:
    w = (rng.uniform(-1, 1, (5, 64)) * absmax).astype(np.float32)
    w[2] = -absmax
    assert_matches_reference("a.kernel", w)
  _, scale = int8.quantize_tensor("a.kernel", np.stack([top, -top]))
  assert np.array_equal(scale.astype(np.float64), b)


def test_zero_channels_get_scale_zero_and_zero_codes():
  w = np.random.default_rng(3).standard_normal((6, 5)).astype(np.float32)
  w[:, 1] = 0.0
  w[:, 3] = -0.0
  codes, scale = int8.quantize_tensor("a.kernel", w)
  assert np.all(scale.view(np.uint16)[[1, 3]] == 0) and np.all(codes[:, [1, 3]] == 0)
  assert_matches_reference("a.kernel", w)
  assert_matches_reference("a.embedding", np.ascontiguousarray(w.T))
  assert_matches_reference("a.kernel", np.zeros((0, 4), np.float32))
  assert_matches_reference("a.embedding", np.zeros((3, 0), np.float32))


def test_subnormal_and_huge_weights():
  rng = np.random.default_rng(4)
  tiny = np.ldexp(rng.standard_normal((16, 12)), rng.integers(-149, -118, (1, 12)))
  assert_matches_reference("a.kernel", tiny.astype(np.float32))
  assert_matches_reference("a.embedding", tiny.T.astype(np.float32))
  fmax = np.finfo(np.float32).max
  huge = (rng.uniform(-1, 1, (16, 12)) * fmax).astype(np.float32)
  huge[0, :6], huge[1, 6:] = fmax, -fmax
  assert_matches_reference("a.kernel", huge)
  assert_matches_reference("a.embedding", np.ascontiguousarray(huge.T))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), exponent=st.integers(-149, 120),
       seed=st.integers(0, 2**32 - 1), embedding=st.booleans(),
       dtype=st.sampled_from([np.float32, ml_dtypes.bfloat16]))
def test_any_shape_and_magnitude_matches_the_reference(rows, cols, exponent, seed, embedding, dtype):
  rng = np.random.default_rng(seed)
  w = np.ldexp(rng.standard_normal((rows, cols)), exponent + rng.integers(-8, 8, (1, cols)))
  w = np.clip(w, -3e38, 3e38).astype(dtype)
  if rng.random() < 0.5:  # plant ties of each column's scale
    _, scale = reference("a.kernel", w)
    k = rng.integers(-126, 126, (rows, cols)) + 0.5
    ties = (k * scale.astype(np.float64)).astype(dtype)
    keep = rng.random((rows, cols)) < 0.5
    w = np.where(keep & (np.abs(ties) <= np.abs(w).max(axis=0)), ties, w)
  assert_matches_reference("a.embedding" if embedding else "a.kernel", w)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_raise_naming_the_tensor_in_both_layouts(bad):
  w = np.ones((3, 4), np.float32)
  w[1, 2] = bad
  for name in ["w.kernel", "w.embedding"]:
    with pytest.raises(CodecError, match=f"'{name}'.*finite"):
      int8.quantize_tensor(name, w)
  with pytest.raises(CodecError, match="'w.kernel'.*finite"):
    int8.quantize_tensor("w.kernel", w.astype(BF16))
