"""Shared inputs for the kernel tests: small packed groups that cover odd lengths,
N = 1, GQA and padding rows (kept tiny: Pallas interpret mode is slow on CPU)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rlax_ps.kernels.layout import make_layout


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  prompt_lens: tuple
  response_lens: tuple  # [B][N]
  prompt_capacity: int
  response_capacity: int
  num_heads: int
  num_kv_heads: int
  head_dim: int

  def layout(self):
    return make_layout(np.array(self.prompt_lens), np.array(self.response_lens),
                       self.prompt_capacity, self.response_capacity)

  def inputs(self, dtype=jnp.float32, seed=0):
    lay = self.layout()
    b, length = len(self.prompt_lens), lay.total_len
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, length, self.num_heads, self.head_dim), dtype)
    k = jax.random.normal(ks[1], (b, length, self.num_kv_heads, self.head_dim), dtype)
    v = jax.random.normal(ks[2], (b, length, self.num_kv_heads, self.head_dim), dtype)
    do = jax.random.normal(ks[3], (b, length, self.num_heads, self.head_dim), dtype)
    return lay, q, k, v, do


# P, R not multiples of the block (8); GQA 4:2; padding rows in both regions and
# an empty response.
ODD_GQA_PADDED = Case("odd_gqa_padded", (13, 5), ((7, 2, 0), (1, 7, 4)), 13, 7, 4, 2, 16)
# One response: the packed row is a plain causal sequence.
SINGLE_RESPONSE = Case("single_response", (16,), ((8,),), 16, 8, 2, 2, 8)
# Block-aligned, full lengths, MHA, longer than one block per region.
ALIGNED_FULL = Case("aligned_full", (16,), ((16, 16),), 16, 16, 2, 2, 8)

# Smallest case with odd lengths, GQA and padding, for the (slower) Triton interpreter.
SMALL_GQA_PADDED = Case("small_gqa_padded", (11,), ((7, 3),), 13, 7, 2, 1, 16)

CASES = (ODD_GQA_PADDED, SINGLE_RESPONSE, ALIGNED_FULL)


def valid_lse(lse, ref_lse):
  """Replaces -inf (rows that attend nothing) by 0 in both, after checking they agree."""
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  return np.where(np.isneginf(lse), 0.0, lse), np.where(np.isneginf(ref_lse), 0.0, ref_lse)


def vjp_outputs(attn, q, k, v, do, ref_lse):
  """(o, lse, dq, dk, dv) with the cotangent `do` on o and a unit cotangent on finite lse;
  one jitted computation (attn is traced, not called eagerly)."""

  def run(q, k, v, do, ref_lse):
    (o, lse), pullback = jax.vjp(attn, q, k, v)
    dlse = jnp.where(jnp.isneginf(ref_lse), 0.0, 1.0).astype(jnp.float32)
    return (o, lse, *pullback((do, dlse)))

  return jax.jit(run)(q, k, v, do, ref_lse)


@functools.cache
def reference_outputs(case: Case, dtype=jnp.float32):
  """N-copies ground truth (f32 math on the dtype-rounded inputs), computed once per case."""
  from rlax_ps.kernels.reference import n_copies_attention
  lay, q, k, v, do = case.inputs(dtype)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  ref = lambda q, k, v: n_copies_attention(q, k, v, lay)
  ref_lse = jax.jit(ref)(*f32[:3])[1]
  return vjp_outputs(ref, *f32, ref_lse)
