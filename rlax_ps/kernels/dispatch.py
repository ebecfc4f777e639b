"""Public entry points with backend dispatch for shared-prompt attention.

backend="auto" picks per platform at lowering time (jax.lax.platform_dependent):
the Pallas TPU (Mosaic) kernels on TPU, the Pallas GPU (Triton) training kernel
on CUDA, the XLA two-pass LSE-merge path elsewhere (CPU, ROCm) and for decode on
GPU. Explicit backends: "pallas_tpu", "pallas_gpu" (with interpret=True both run
anywhere, for tests), "xla" (two-pass), "xla_dense" (packed dense mask),
"reference" (N copies).
"""

from __future__ import annotations

import functools

import jax

from rlax_ps.kernels import decode_tpu, reference, shared_prompt_gpu, shared_prompt_tpu
from rlax_ps.kernels.layout import SharedPromptLayout
from rlax_ps.kernels.schedule import BlockSizes

TRAIN_BACKENDS = ("auto", "pallas_tpu", "pallas_gpu", "xla", "xla_dense", "reference")
DECODE_BACKENDS = ("auto", "pallas_tpu", "xla", "reference")


def _check_backend(backend: str, allowed) -> None:
  if backend not in allowed:
    raise ValueError(f"backend must be one of {allowed}, got {backend!r}")


def shared_prompt_attention(q, k, v, layout: SharedPromptLayout, *, sm_scale=None,
                            window: int | None = None, softcap: float | None = None,
                            backend: str = "auto", block_sizes: BlockSizes | None = None,
                            interpret: bool = False):
  """Attention over a packed [P + N*R] group: q [B, L, H, D], k/v [B, L, Hkv, D]
  -> (o [B, L, H, D], lse [B, L, H] float32). Differentiable (q, k, v).

  sm_scale multiplies the logits (None: head_dim ** -0.5). window (None: full causal)
  limits a query at RoPE position p (layout.positions()) to keys at positions > p - window.
  softcap (None: none) caps the scaled logits s to softcap * tanh(s / softcap) (Gemma 2)."""
  _check_backend(backend, TRAIN_BACKENDS)
  window = reference.check_window(window)
  softcap = reference.check_softcap(softcap)
  pallas = functools.partial(shared_prompt_tpu.shared_prompt_attention_pallas_tpu,
                             layout=layout, sm_scale=sm_scale, block_sizes=block_sizes,
                             interpret=interpret, window=window, softcap=softcap)
  triton = functools.partial(shared_prompt_gpu.shared_prompt_attention_pallas_gpu,
                             layout=layout, sm_scale=sm_scale, block_sizes=block_sizes,
                             interpret=interpret, window=window, softcap=softcap)
  xla = functools.partial(reference.two_pass_attention, layout=layout, sm_scale=sm_scale,
                          window=window, softcap=softcap)
  if backend == "pallas_tpu":
    return pallas(q, k, v)
  if backend == "pallas_gpu":
    return triton(q, k, v)
  if backend == "xla":
    return xla(q, k, v)
  if backend == "xla_dense":
    return reference.packed_dense_attention(q, k, v, layout, sm_scale, window, softcap)
  if backend == "reference":
    return reference.n_copies_attention(q, k, v, layout, sm_scale, window, softcap)
  if interpret:
    return pallas(q, k, v)
  return jax.lax.platform_dependent(q, k, v, tpu=pallas, cuda=triton, default=xla)


def shared_prefix_decode_attention(q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v,
                                   suffix_lens, *, sm_scale=None, window: int | None = None,
                                   softcap: float | None = None, backend: str = "auto",
                                   block_s: int = 512, interpret: bool = False):
  """One decode step of N samples sharing a prefix cache: q [B, N, H, D];
  prefix_k/v [B, S, Hkv, D] valid up to prefix_lens [B]; suffix_k/v
  [B, N, Ss, Hkv, D] valid up to suffix_lens [B, N] -> (o [B, N, H, D], lse [B, N, H]).

  The query of sample (b, n) sits at position prefix_lens[b] + suffix_lens[b, n] - 1,
  prefix key j at j, suffix key s at prefix_lens[b] + s; window (None: all) keeps the keys
  fewer than `window` positions back; softcap: see shared_prompt_attention."""
  _check_backend(backend, DECODE_BACKENDS)
  window = reference.check_window(window)
  softcap = reference.check_softcap(softcap)
  args = (q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v, suffix_lens)
  pallas = functools.partial(decode_tpu.shared_prefix_decode_pallas_tpu, sm_scale=sm_scale,
                             block_s=block_s, interpret=interpret, window=window,
                             softcap=softcap)
  xla = functools.partial(reference.decode_two_pass, sm_scale=sm_scale, window=window,
                          softcap=softcap)
  if backend == "pallas_tpu":
    return pallas(*args)
  if backend == "xla":
    return xla(*args)
  if backend == "reference":
    return reference.decode_n_copies(*args, sm_scale=sm_scale, window=window,
                                     softcap=softcap)
  if interpret:
    return pallas(*args)
  return jax.lax.platform_dependent(*args, tpu=pallas, default=xla)
