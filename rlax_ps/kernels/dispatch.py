"""Public entry points with backend dispatch for shared-prompt attention.

backend="auto" picks per platform at lowering time (jax.lax.platform_dependent):
the Pallas TPU (Mosaic) kernels on TPU, the Pallas GPU (Triton) training kernel
on CUDA, the XLA two-pass LSE-merge path elsewhere (CPU, ROCm) and for decode on
GPU. Explicit backends: "pallas_tpu", "pallas_gpu" (with interpret=True both run
anywhere, for tests), "xla" (two-pass), "xla_dense" (packed dense mask),
"reference" (N copies).

Traced with a mesh in context (the train step's), each call runs per device under
shard_map, rows split over the batch axes (data, fsdp) and heads over tensor as far as
they divide (a decode cache of one kv head, multi-query or latent, is read whole by every
device): XLA cannot split a Pallas kernel itself, and would otherwise gather every row
and head onto every device and run the whole batch there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rlax_ps.kernels import decode_tpu, reference, shared_prompt_gpu, shared_prompt_tpu
from rlax_ps.kernels.kv_quant import kv_widen
from rlax_ps.kernels.layout import SharedPromptLayout
from rlax_ps.kernels.schedule import BlockSizes

TRAIN_BACKENDS = ("auto", "pallas_tpu", "pallas_gpu", "xla", "xla_dense", "reference")
DECODE_BACKENDS = ("auto", "pallas_tpu", "xla", "reference")
EXTEND_BACKENDS = ("auto", "pallas_tpu", "xla")


def _per_device(fn, args, heads: tuple[int, ...], head_dims: tuple[int | None, ...],
                out_head_dims: tuple[int, ...], kv_args: tuple[int, ...] = ()):
  """fn(*args) under shard_map over the mesh in context (none, or all axes of size 1: fn
  as it is). Every arg and output has the rows first; arg i has heads at head_dims[i]
  (None: no heads dim), output j at out_head_dims[j]; `heads`: the head counts that the
  tensor axis must divide (q's and k/v's). The args `kv_args` name (inference only: no
  gradient) may instead have one head, which every device then reads whole while the
  query heads split (multi-query, and latent attention's one cached head)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1 or jax.sharding.AxisType.Manual in mesh.axis_types:
    return fn(*args)  # no mesh, one device, or per device already (inside a shard_map)
  shape = dict(mesh.shape)
  rows, size = [], 1
  for axis in ("data", "fsdp"):  # as far as they divide the rows, as the batch is split
    if shape.get(axis, 1) > 1 and args[0].shape[0] % (size * shape[axis]) == 0:
      rows.append(axis)
      size *= shape[axis]
  t = shape.get("tensor", 1)
  one_kv = bool(kv_args) and heads[1] == 1
  tensor = "tensor" if t > 1 and all(h % t == 0 for h in heads[:1 if one_kv else 2]) else None
  if not rows and tensor is None:
    return fn(*args)
  row = tuple(rows) or None

  def spec(ndim, head_dim, split=True):
    entries = [row] + [None] * (ndim - 1)
    if head_dim is not None and split:
      entries[head_dim] = tensor
    return P(*entries)

  # An int8 or fp8 cache (kv_quant.QuantizedKV): its scales have the heads where its codes do.
  in_specs = tuple(jax.tree.map(lambda leaf, h=h, i=i: spec(
      leaf.ndim, h, not (one_kv and i in kv_args)), a)
                   for i, (a, h) in enumerate(zip(args, head_dims)))
  out_shapes = jax.eval_shape(fn, *args)
  out_specs = tuple(spec(o.ndim, h) for o, h in zip(out_shapes, out_head_dims))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*args)


def _kv_repeat(q_heads: int, kv_heads: int) -> int:
  """How many times to repeat each kv head so that the mesh in context's tensor axis, wider
  than them, splits them one per device along with the query heads (1: as they are)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types:
    return 1
  t = dict(mesh.shape).get("tensor", 1)
  return t // kv_heads if kv_heads < t and t % kv_heads == 0 and q_heads % t == 0 else 1


def _values_are_keys(prefix_k, prefix_v, suffix_k, suffix_v) -> bool:
  """Whether the caller passed its key caches as the values too (latent attention's one
  cache), which the TPU kernel then reads once."""
  return prefix_v is prefix_k and suffix_v is suffix_k


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
  # auto traces every platform's branch: sizes the GPU kernel cannot take (it tiles by
  # powers of two; TPU's are multiples of 128) give it its own, not an error on every platform
  gpu_blocks = block_sizes
  if backend == "auto" and block_sizes is not None and any(
      b & (b - 1) for b in (block_sizes.block_q, block_sizes.block_kv)):
    gpu_blocks = None
  triton = functools.partial(shared_prompt_gpu.shared_prompt_attention_pallas_gpu,
                             layout=layout, sm_scale=sm_scale, block_sizes=gpu_blocks,
                             interpret=interpret, window=window, softcap=softcap)
  xla = functools.partial(reference.two_pass_attention, layout=layout, sm_scale=sm_scale,
                          window=window, softcap=softcap)
  if backend == "pallas_tpu" or (backend == "auto" and interpret):
    run = pallas
  elif backend == "pallas_gpu":
    run = triton
  elif backend == "xla":
    run = xla
  elif backend == "xla_dense":
    run = functools.partial(reference.packed_dense_attention, layout=layout,
                            sm_scale=sm_scale, window=window, softcap=softcap)
  elif backend == "reference":
    run = functools.partial(reference.n_copies_attention, layout=layout, sm_scale=sm_scale,
                            window=window, softcap=softcap)
  else:
    def run(q, k, v, layout):
      return jax.lax.platform_dependent(
          q, k, v, tpu=functools.partial(pallas, layout=layout),
          cuda=functools.partial(triton, layout=layout),
          default=functools.partial(xla, layout=layout))
  per_row = lambda q, k, v, prompt_lens, response_lens: run(  # noqa: E731
      q, k, v, layout=dataclasses.replace(layout, prompt_lens=prompt_lens,
                                          response_lens=response_lens))
  repeat = _kv_repeat(q.shape[2], k.shape[2])
  if repeat > 1:  # fewer kv heads than the tensor axis: one per device, its gradient summed
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
  return _per_device(per_row, (q, k, v, layout.prompt_lens, layout.response_lens),
                     heads=(q.shape[2], k.shape[2]), head_dims=(2, 2, 2, None, None),
                     out_head_dims=(2, 2))


def _widened(fn):
  """fn with the caches (prefix_k, prefix_v, suffix_k, suffix_v) in the queries' dtype: a
  cache may be held narrower (fp8, int8 with scales); XLA widens it whole, the Pallas
  kernel a block at a time."""
  def run(q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v, lens):
    prefix_k, prefix_v, suffix_k, suffix_v = (
        kv_widen(x, q.dtype) for x in (prefix_k, prefix_v, suffix_k, suffix_v))
    return fn(q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v, lens)
  return run


def _tpu_or_xla(backend: str, interpret: bool, pallas, xla, reference=None):
  """The decode-time attention a backend names: the Pallas TPU kernel, XLA, the N-copies
  reference, or (auto) the kernel on TPU and XLA elsewhere."""
  if backend == "pallas_tpu" or (backend == "auto" and interpret):
    return pallas
  if backend == "xla":
    return xla
  if backend == "reference":
    return reference

  def run(*args):
    return jax.lax.platform_dependent(*args, tpu=pallas, default=xla)
  return run


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
                             softcap=softcap,
                             values_are_keys=_values_are_keys(prefix_k, prefix_v, suffix_k,
                                                              suffix_v))
  xla = _widened(functools.partial(reference.decode_two_pass, sm_scale=sm_scale,
                                   window=window, softcap=softcap))
  run = _tpu_or_xla(backend, interpret, pallas, xla, reference=_widened(functools.partial(
      reference.decode_n_copies, sm_scale=sm_scale, window=window, softcap=softcap)))
  return _per_device(run, args, heads=(q.shape[2], prefix_k.shape[2]),
                     head_dims=(2, 2, 2, None, 3, 3, None), out_head_dims=(2, 2),
                     kv_args=(1, 2, 4, 5))


def shared_prefix_extend_attention(q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v,
                                   index, *, sm_scale=None, window: int | None = None,
                                   softcap: float | None = None, backend: str = "auto",
                                   block_s: int = 512, block_m: int = 512,
                                   interpret: bool = False):
  """T tokens of each of N samples sharing a prefix cache in one step (a tool's reply, or
  a resumed sample's tokens): q [B, N, T, H, D]; their keys already written at suffix slots
  [index, index + T) (index [B, N]) -> (o [B, N, T, H, D], lse [B, N, T, H]). Query t of
  sample (b, n) sits at position prefix_lens[b] + index[b, n] + t and sees the prefix and
  its suffix up to its own slot; window and softcap as in the decode step. The Pallas
  kernel on TPU (query rows blocked `block_m` at a time), XLA elsewhere."""
  _check_backend(backend, EXTEND_BACKENDS)
  window = reference.check_window(window)
  softcap = reference.check_softcap(softcap)
  args = (q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v, index)
  pallas = functools.partial(decode_tpu.shared_prefix_extend_pallas_tpu, sm_scale=sm_scale,
                             block_s=block_s, block_m=block_m, interpret=interpret,
                             window=window, softcap=softcap,
                             values_are_keys=_values_are_keys(prefix_k, prefix_v, suffix_k,
                                                              suffix_v))
  xla = _widened(functools.partial(reference.extend_two_pass, sm_scale=sm_scale,
                                   window=window, softcap=softcap))
  run = _tpu_or_xla(backend, interpret, pallas, xla)
  return _per_device(run, args, heads=(q.shape[3], prefix_k.shape[2]),
                     head_dims=(3, 2, 2, None, 3, 3, None), out_head_dims=(3, 3),
                     kv_args=(1, 2, 4, 5))
