"""Lowering for real accelerators from CPU: jax.export runs the Pallas->Mosaic lowering
(block shapes, index maps, scalar prefetch, dimension semantics) for TPU and the
Pallas->Triton lowering for CUDA, through the same `auto` dispatch a model uses."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from rlax_ps.kernels.dispatch import (shared_prefix_decode_attention,
                                      shared_prefix_extend_attention, shared_prompt_attention)
from rlax_ps.kernels.kv_quant import QuantizedKV
from rlax_ps.kernels.layout import make_layout

B, N, P, R, H, HKV, D = 1, 3, 200, 100, 4, 2, 128  # P, R not block multiples


def _train_fn(backend, window=None, softcap=None):
  def loss_and_grads(q, k, v, prompt_lens, response_lens):
    lay = make_layout(prompt_lens, response_lens, P, R)
    attn = lambda q, k, v: shared_prompt_attention(q, k, v, lay, backend=backend, window=window,
                                                   softcap=softcap)
    (o, lse), pullback = jax.vjp(attn, q, k, v)
    return o, lse, pullback((o, lse))
  return loss_and_grads


def _train_args(dtype, d=D):
  length = P + N * R
  return (jax.ShapeDtypeStruct((B, length, H, d), dtype),
          jax.ShapeDtypeStruct((B, length, HKV, d), dtype),
          jax.ShapeDtypeStruct((B, length, HKV, d), dtype),
          jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, N), jnp.int32))


def _decode_args(dtype):
  return (jax.ShapeDtypeStruct((B, N, H, D), dtype),
          *[jax.ShapeDtypeStruct((B, 1024, HKV, D), dtype)] * 2,
          jax.ShapeDtypeStruct((B,), jnp.int32),
          *[jax.ShapeDtypeStruct((B, N, 256, HKV, D), dtype)] * 2,
          jax.ShapeDtypeStruct((B, N), jnp.int32))


def _extend_args(dtype, t=64):
  return (jax.ShapeDtypeStruct((B, N, t, H, D), dtype), *_decode_args(dtype)[1:])


def _kernel_names(exported):
  return set(re.findall(r'kernel_name = "([a-z_]+)"', exported.mlir_module()))


# With a window shorter than the prompt and a logit softcap: the window masks, the liveness,
# the decode kernel's per-row starts and block clamp, and the tanh cap lower too.
DTYPE_WINDOW = pytest.mark.parametrize(
    "dtype,window,softcap",
    [(jnp.float32, None, None), (jnp.bfloat16, None, None), (jnp.bfloat16, 64, 50.0)],
    ids=["f32", "bf16", "bf16-window-softcap"])


@DTYPE_WINDOW
def test_training_kernels_lower_for_tpu(dtype, window, softcap):
  exp = export.export(jax.jit(_train_fn("auto", window, softcap)), platforms=["tpu"])(
      *_train_args(dtype))
  assert _kernel_names(exp) == {"shared_prompt_fwd", "shared_prompt_dq", "shared_prompt_dkv"}


@DTYPE_WINDOW
def test_decode_kernel_lowers_for_tpu(dtype, window, softcap):
  fn = jax.jit(functools.partial(shared_prefix_decode_attention, block_s=256, window=window,
                                 softcap=softcap))
  exp = export.export(fn, platforms=["tpu"])(*_decode_args(dtype))
  assert _kernel_names(exp) == {"shared_prefix_decode"}


@pytest.mark.parametrize("scaled", [False, True], ids=["bf16", "int8"])
def test_decode_kernel_lowers_for_tpu_over_a_one_slot_cache(scaled):
  """worker.max_new_tokens=1: the suffix cache holds one slot, and Mosaic refused a bf16
  block of one key ('vector.broadcast' op failed to verify): every decode step of a bf16
  model on TPU. A cache under 8 slots is padded to 8 (its lengths mask the padding)."""
  q, pk, pv, lens, sk, sv, slens = _decode_args(jnp.bfloat16)
  sk = sv = jax.ShapeDtypeStruct((B, N, 1, HKV, D), jnp.bfloat16)
  if scaled:
    sk = sv = QuantizedKV(jax.ShapeDtypeStruct(sk.shape, jnp.int8),
                          jax.ShapeDtypeStruct(sk.shape[:-1], jnp.float32))
  fn = jax.jit(functools.partial(shared_prefix_decode_attention, block_s=256))
  exp = export.export(fn, platforms=["tpu"])(q, pk, pv, lens, sk, sv, slens)
  assert _kernel_names(exp) == {"shared_prefix_decode"}
  # and in interpret mode it computes the reference's attention
  shapes = [(1, 4, 4, 128)] + [(1, 16, 2, 128)] * 2 + [(1, 4, 1, 2, 128)] * 2
  q, pk, pv, sk, sv = (jax.random.normal(key, shape).astype(jnp.bfloat16) for key, shape in
                       zip(jax.random.split(jax.random.key(0), 5), shapes))
  args = (q, pk, pv, jnp.array([11]), sk, sv, jnp.ones((1, 4), jnp.int32))
  got = shared_prefix_decode_attention(*args, backend="pallas_tpu", interpret=True)
  want = shared_prefix_decode_attention(*args, backend="reference")
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2)


def test_decode_kernel_lowers_for_tpu_reading_fp8_caches():
  """worker.kv_cache_dtype=float8_e4m3fn: the kernel takes the fp8 caches and widens each
  block in VMEM (no widened copy of the cache in HBM)."""
  q, *rest = _decode_args(jnp.bfloat16)
  caches = {1, 2, 4, 5}
  args = [q] + [jax.ShapeDtypeStruct(a.shape, jnp.float8_e4m3fn) if i + 1 in caches else a
                for i, a in enumerate(rest)]
  fn = jax.jit(functools.partial(shared_prefix_decode_attention, block_s=256))
  exp = export.export(fn, platforms=["tpu"])(*args)
  assert _kernel_names(exp) == {"shared_prefix_decode"}
  calls = [l for l in exp.mlir_module().splitlines() if "tpu_custom_call" in l]
  assert len(calls) == 2  # prefix and suffix passes, each reading its fp8 cache as it is
  assert all(re.search(r": \(tensor<\d+xi32>, tensor<[0-9x]+bf16>(, tensor<[0-9x]+xf8E4M3FN>){2}\)",
                       l) for l in calls), calls


@pytest.mark.parametrize("codes,mlir", [(jnp.int8, "i8"), (jnp.float8_e4m3fn, "f8E4M3FN")],
                         ids=["int8", "fp8"])
@pytest.mark.parametrize("extend", [False, True], ids=["decode", "extend"])
def test_decode_kernels_lower_for_tpu_reading_narrow_caches_with_scales(extend, codes, mlir):
  """worker.kv_cache_dtype=int8 or float8_e4m3fn: the kernels take the codes and their
  float32 scales per token and head as held, block by block (no widened copy in HBM)."""
  q, *rest = (_extend_args if extend else _decode_args)(jnp.bfloat16)

  def held(a):
    return QuantizedKV(jax.ShapeDtypeStruct(a.shape, codes),
                       jax.ShapeDtypeStruct(a.shape[:-1], jnp.float32))

  args = [q] + [held(a) if i in (0, 1, 3, 4) else a for i, a in enumerate(rest)]
  attend = shared_prefix_extend_attention if extend else shared_prefix_decode_attention
  exp = export.export(jax.jit(functools.partial(attend, block_s=256)), platforms=["tpu"])(*args)
  assert _kernel_names(exp) == {"shared_prefix_decode"}
  calls = [l for l in exp.mlir_module().splitlines() if "tpu_custom_call" in l]
  assert len(calls) == 2
  assert all(re.search(rf"(, tensor<[0-9x]+x{mlir}>){{2}}(, tensor<[0-9x]+xf32>){{2}}\)", l)
             for l in calls), calls


# Triton calls carry no serialization-compatibility guarantee; we only need the lowering.
_TRITON_OK = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]


@DTYPE_WINDOW
def test_training_kernels_lower_for_cuda_triton(dtype, window, softcap):
  exp = export.export(jax.jit(_train_fn("auto", window, softcap)), platforms=["cuda"],
                      disabled_checks=_TRITON_OK)(*_train_args(dtype))
  names = set(re.findall(r'name = "(shared_prompt_[a-z_]+)"', exp.mlir_module()))
  assert names == {"shared_prompt_fwd_gpu", "shared_prompt_dq_gpu", "shared_prompt_dkv_gpu"}
  assert ("tanh" in exp.mlir_module()) == (softcap is not None)  # the cap is in the kernels


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("d", [96, 192])
def test_training_kernels_lower_for_heads_of_no_power_of_two_width(platform, d):
  """Phi-3-mini's heads of 96, DeepSeek's q/k of 192: the Triton kernel pads them to 128 and
  256; the TPU kernel takes them as they are."""
  checks = _TRITON_OK if platform == "cuda" else []
  exp = export.export(jax.jit(_train_fn("auto")), platforms=[platform],
                      disabled_checks=checks)(*_train_args(jnp.bfloat16, d))
  assert re.findall(r'name = "(shared_prompt_[a-z_]+)"', exp.mlir_module())
  assert exp.out_avals[0].shape[-1] == d


def test_decode_lowers_for_cuda_through_xla_path():
  exp = export.export(jax.jit(shared_prefix_decode_attention), platforms=["cuda"])(
      *_decode_args(jnp.bfloat16))
  assert exp.platforms == ("cuda",)
  assert "custom_call" not in exp.mlir_module()
  assert "dot_general" in exp.mlir_module()


@DTYPE_WINDOW
def test_extend_kernel_lowers_for_tpu(dtype, window, softcap):
  """T = 64 tokens of 3 samples: 384 prefix-pass rows in blocks of 256 (the second padded),
  each sample's 128 rows in one; per-row last keys, starts and block clamps lower."""
  fn = jax.jit(functools.partial(shared_prefix_extend_attention, block_s=256, block_m=256,
                                 window=window, softcap=softcap))
  exp = export.export(fn, platforms=["tpu"])(*_extend_args(dtype))
  assert _kernel_names(exp) == {"shared_prefix_decode"}


def test_extend_lowers_for_cuda_through_xla_path():
  exp = export.export(jax.jit(shared_prefix_extend_attention), platforms=["cuda"])(
      *_extend_args(jnp.bfloat16))
  assert "custom_call" not in exp.mlir_module() and "dot_general" in exp.mlir_module()


@pytest.mark.parametrize("extend", [False, True], ids=["decode", "extend"])
@pytest.mark.parametrize("held", ["bf16", "int8"])
def test_decode_kernels_lower_for_tpu_on_deepseek_v3s_latent_cache(extend, held):
  """Latent attention's cache (ModelConfig.kv_cache_layout): DeepSeek-V3's 128 query heads
  read one kv head of 512 + 64 dims, the same cache array as keys and values, with the
  model's softmax scale (192**-0.5), held bf16 or int8 with scales."""
  width, heads = 512 + 64, 128

  def cache(*shape):
    if held == "int8":
      return QuantizedKV(jax.ShapeDtypeStruct(shape, jnp.int8),
                         jax.ShapeDtypeStruct(shape[:-1], jnp.float32))
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16)

  q = jax.ShapeDtypeStruct((B, N) + ((64,) if extend else ()) + (heads, width), jnp.bfloat16)
  attend = shared_prefix_extend_attention if extend else shared_prefix_decode_attention

  def fn(q, prefix, prefix_lens, suffix, lens):
    return attend(q, prefix, prefix, prefix_lens, suffix, suffix, lens, block_s=256,
                  sm_scale=192 ** -0.5)

  exp = export.export(jax.jit(fn), platforms=["tpu"])(
      q, cache(B, 1024, 1, width), jax.ShapeDtypeStruct((B,), jnp.int32),
      cache(B, N, 256, 1, width), jax.ShapeDtypeStruct((B, N), jnp.int32))
  assert _kernel_names(exp) == {"shared_prefix_decode"}
  # Each pass reads the one cache once, as keys and values: one [S, 576] operand (codes).
  code = "i8" if held == "int8" else "bf16"
  calls = [l for l in exp.mlir_module().splitlines() if "tpu_custom_call" in l]
  assert len(calls) == 2 and all(
      len(re.findall(rf"tensor<\d+x\d+x{width}x{code}>", l.split(") ->")[0])) == 1
      for l in calls), calls
