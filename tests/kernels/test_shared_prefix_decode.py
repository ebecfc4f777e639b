"""Shared-prefix decode attention: XLA two-pass and Pallas (interpret) vs N copies; T tokens
a sample at once (extend): Pallas (interpret) vs the XLA path, itself checked against T
decode steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_ps.kernels import reference
from rlax_ps.kernels.dispatch import (shared_prefix_decode_attention,
                                      shared_prefix_extend_attention)
from rlax_ps.kernels.kv_quant import kv_widen, kv_write, kv_zeros, quantize

B, N, H, HKV, D = 2, 3, 4, 2, 16
PREFIX, SUFFIX = 20, 12  # not multiples of the block (8)
PREFIX_LENS = np.array([20, 5], np.int32)
SUFFIX_LENS = np.array([[1, 12, 0], [3, 0, 7]], np.int32)  # includes empty suffixes


def _inputs(dtype):
  ks = jax.random.split(jax.random.key(7), 5)
  q = jax.random.normal(ks[0], (B, N, H, D), dtype)
  pk = jax.random.normal(ks[1], (B, PREFIX, HKV, D), dtype)
  pv = jax.random.normal(ks[2], (B, PREFIX, HKV, D), dtype)
  sk = jax.random.normal(ks[3], (B, N, SUFFIX, HKV, D), dtype)
  sv = jax.random.normal(ks[4], (B, N, SUFFIX, HKV, D), dtype)
  return q, pk, pv, PREFIX_LENS, sk, sv, SUFFIX_LENS


@pytest.fixture(scope="module")
def truth():
  return jax.jit(reference.decode_n_copies)(*_inputs(jnp.float32))


@pytest.mark.parametrize("backend,kw", [("xla", {}), ("pallas_tpu", dict(interpret=True,
                                                                        block_s=8))],
                         ids=["xla", "pallas"])
def test_decode_f32_matches_n_copies(truth, backend, kw):
  fn = jax.jit(functools.partial(shared_prefix_decode_attention, backend=backend, **kw))
  o, lse = fn(*_inputs(jnp.float32))
  np.testing.assert_allclose(o, truth[0], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, truth[1], atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # a second interpret-mode compile of the decode kernel (~20 s cold)
def test_decode_pallas_bf16_matches_n_copies():
  args = _inputs(jnp.bfloat16)
  want = jax.jit(reference.decode_n_copies)(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                                     for a in args])
  o, lse = jax.jit(functools.partial(shared_prefix_decode_attention, backend="pallas_tpu",
                                     interpret=True, block_s=8))(*args)
  assert o.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(o, np.float32), want[0], atol=3e-2, rtol=3e-2)
  np.testing.assert_allclose(lse, want[1], atol=3e-2, rtol=3e-2)


def test_decode_rejects_mismatched_suffix_shape():
  q, pk, pv, pl, sk, sv, sl = _inputs(jnp.float32)
  with pytest.raises(ValueError, match="suffix_k and suffix_v must both be"):
    shared_prefix_decode_attention(q, pk, pv, pl, sk[:, :2], sv[:, :2], sl, backend="xla")


@pytest.mark.parametrize("window,softcap", [(None, None), (4, 30.0)])
def test_t_tokens_at_once_attend_as_t_decode_steps(window, softcap):
  """extend_two_pass (a reply fed in one step): query t of a sample sees what a decode step
  at suffix length index + t + 1 sees, window and soft-cap included."""
  t = 4
  q, pk, pv, pl, sk, sv, _ = _inputs(jnp.float32)
  qs = jax.random.normal(jax.random.key(3), (B, N, t, H, D), jnp.float32)
  index = np.array([[0, 8, 3], [2, 5, 0]], np.int32)  # + t fits the 12 suffix slots
  o, lse = jax.jit(functools.partial(reference.extend_two_pass, window=window,
                                     softcap=softcap))(qs, pk, pv, pl, sk, sv, index)
  assert o.shape == (B, N, t, H, D) and lse.shape == (B, N, t, H)
  for i in range(t):
    want = reference.decode_n_copies(qs[:, :, i], pk, pv, pl, sk, sv, index + i + 1,
                                     window=window, softcap=softcap)
    np.testing.assert_allclose(o[:, :, i], want[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse[:, :, i], want[1], atol=1e-5, rtol=1e-5)


def _extend_inputs(t=6):
  q, pk, pv, pl, sk, sv, _ = _inputs(jnp.float32)
  qs = jax.random.normal(jax.random.key(3), (B, N, t, H, D), jnp.float32)
  index = np.array([[0, 6, 3], [2, 5, 0]], np.int32)  # + t fits the 12 suffix slots
  return qs, pk, pv, pl, sk, sv, index


@pytest.mark.parametrize("window,softcap,block_m", [(None, None, 8), (4, 30.0, 8),
                                                    (None, None, 4)])
def test_extend_pallas_matches_the_xla_path(window, softcap, block_m):
  """The Pallas extend kernel equals the XLA path with its query rows blocked 8 at a time:
  the prefix pass's N*T*G = 36 rows in 5 blocks, each sample's T*G = 12 in 2 (the last
  padded), every block skipping the key blocks past its rows' last suffix keys. A block_m
  below 8 sublanes blocks by 8 (it divided by zero)."""
  args = _extend_inputs()
  want = jax.jit(functools.partial(shared_prefix_extend_attention, backend="xla",
                                   window=window, softcap=softcap))(*args)
  got = jax.jit(functools.partial(shared_prefix_extend_attention, backend="pallas_tpu",
                                  interpret=True, block_s=8, block_m=block_m, window=window,
                                  softcap=softcap))(*args)
  np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("held", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("extend", [False, True], ids=["decode", "extend"])
def test_narrow_caches_are_widened_alike_by_the_kernel_and_the_xla_path(extend, held):
  """Caches held in fp8, or int8 codes with a scale per token and head
  (worker.kv_cache_dtype): the Pallas kernel widens each block as it reads it, XLA the whole
  cache first; both give what the widened caches give."""
  if extend:
    q, pk, pv, pl, sk, sv, lens = _extend_inputs()
    attend = shared_prefix_extend_attention
  else:
    q, pk, pv, pl, sk, sv, lens = _inputs(jnp.float32)
    attend = shared_prefix_decode_attention
  if held == "int8":
    narrow = [quantize(x) for x in (pk, pv, sk, sv)]
  else:
    narrow = [x.astype(held) for x in (pk, pv, sk, sv)]
  widened = [kv_widen(x, jnp.float32) for x in narrow]
  want = jax.jit(functools.partial(attend, backend="xla"))(
      q, widened[0], widened[1], pl, widened[2], widened[3], lens)
  for kw in (dict(backend="xla"), dict(backend="pallas_tpu", interpret=True, block_s=8)):
    got = jax.jit(functools.partial(attend, **kw))(q, narrow[0], narrow[1], pl, narrow[2],
                                                   narrow[3], lens)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-5)
  if held == "int8":  # and the scales matter: codes read as they are would differ
    raw = [x.values.astype(jnp.float32) for x in narrow]
    off = jax.jit(functools.partial(attend, backend="xla"))(q, raw[0], raw[1], pl, raw[2],
                                                            raw[3], lens)
    assert np.abs(np.asarray(off[0]) - np.asarray(want[0])).max() > 1e-2


def test_int8_codes_keep_each_token_within_half_a_level_of_its_range():
  x = jax.random.normal(jax.random.key(0), (3, 5, 2, 16)) * jnp.arange(1, 4)[:, None, None, None]
  x = x.at[0, 0, 0].set(0.0)  # a token of zeros: scale 1, codes 0
  held = quantize(x)
  assert held.values.dtype == jnp.int8 and held.scales.shape == (3, 5, 2)
  err = np.abs(np.asarray(kv_widen(held, jnp.float32) - x))
  half_level = np.asarray(jnp.max(jnp.abs(x), axis=-1) / 127 / 2)[..., None]
  assert (err <= half_level + 1e-6).all()
  assert np.asarray(held.values).max() == 127 or np.asarray(held.values).min() == -127
  assert float(held.scales[0, 0, 0]) == 1.0 and not np.asarray(held.values[0, 0, 0]).any()
  buf = kv_zeros((3, 5, 2, 16), "int8")
  buf = kv_write(buf, (jnp.arange(3), 1), x[:, 1])
  np.testing.assert_array_equal(buf.values[:, 1], held.values[:, 1])
  assert buf[1].shape == (5, 2, 16) and buf.nbytes == 3 * 5 * 2 * (16 + 4)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_a_head_of_tiny_values_widens_to_finite_values_near_them(dtype):
  """Values below ~1e-36 (normal float32) had their scale flushed to 0: fp8 codes of x / 0
  were NaN, int8 ones widened to 0."""
  x = jnp.array([[[0.0, 1e-36, -1e-36, 3e-37]]], jnp.float32)
  widened = np.asarray(kv_widen(quantize(x, dtype), jnp.float32))
  assert np.isfinite(widened).all()
  np.testing.assert_allclose(widened, np.asarray(x), rtol=0.1, atol=1e-38)


def _pallas_operands(fn, *args):
  """How many arrays each pallas_call of jitted `fn` reads (its operands, scalars included)."""
  def find(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        yield len(eqn.invars)
      for sub in jax.core.jaxprs_in_params(eqn.params):
        yield from find(sub)
  return list(find(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("extend,held", [(False, None), (True, "int8")],
                         ids=["decode", "extend_int8"])
def test_a_cache_passed_as_keys_and_values_is_read_once(extend, held):
  """Latent attention's one cache (the keys are the values): the TPU kernel takes it once,
  each block read from HBM for both, with the outputs of it passed twice as two arrays."""
  q, pk, _, pl, sk, _, lens = _extend_inputs() if extend else _inputs(jnp.float32)
  if held:
    pk, sk = quantize(pk), quantize(sk)
  attend = functools.partial(
      shared_prefix_extend_attention if extend else shared_prefix_decode_attention,
      backend="pallas_tpu", interpret=True, block_s=8)
  once = jax.jit(lambda q, pk, pl, sk, lens: attend(q, pk, pk, pl, sk, sk, lens))
  twice = jax.jit(lambda q, pk, pl, sk, lens: attend(
      q, pk, jax.tree.map(lambda x: x + 0, pk), pl, sk, jax.tree.map(lambda x: x + 0, sk), lens))
  for got, want in zip(once(q, pk, pl, sk, lens), twice(q, pk, pl, sk, lens)):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
  per_cache = 2 if held else 1  # codes and scales
  assert [n + per_cache for n in _pallas_operands(once, q, pk, pl, sk, lens)] == (
      _pallas_operands(twice, q, pk, pl, sk, lens))


@pytest.mark.parametrize("held,step", [("float8_e4m3fn", 2.0 ** -4), ("int8", 1 / 127)])
def test_a_narrow_cache_scales_each_tokens_keys_so_that_none_overflows(held, step):
  """An int8 or fp8 cache scales each token's keys of a head to the codes' range: keys of
  1e4 and 1e-3 come back within the codes' precision of their own magnitude, where a bare
  e4m3 cast turns every key past 448 into NaN."""
  rng = np.random.default_rng(0)
  magnitude = np.array([1e4, 1.0, 1e-3, 0.0], np.float32)[:, None, None]  # per token
  new = (rng.normal(size=(4, 2, 8)) * magnitude).astype(np.float32)
  got = np.asarray(kv_widen(kv_write(kv_zeros((4, 2, 8), held), slice(None), new),
                            jnp.float32))
  amax = np.abs(new).max(axis=-1, keepdims=True)
  assert np.all(np.abs(got - new) <= step * amax + 1e-30)
  assert np.isnan(np.asarray(jnp.asarray(new[0]).astype(jnp.float8_e4m3fn),
                             np.float32)).any()
