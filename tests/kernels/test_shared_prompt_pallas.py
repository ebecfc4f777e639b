"""Pallas TPU training kernel in interpret mode against the N-copies reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (ALIGNED_FULL, CASES, ODD_GQA_PADDED, SMALL_GQA_PADDED,
                          reference_outputs, valid_lse, vjp_outputs)
from rlax_ps.kernels import reference, schedule
from rlax_ps.kernels.dispatch import shared_prompt_attention
from rlax_ps.kernels.layout import make_layout
from rlax_ps.kernels.pallas_common import aligned_geometry

BLOCKS = schedule.BlockSizes(block_q=8, block_kv=8)


def _pallas(lay, blocks=BLOCKS, backend="pallas_tpu"):
  return functools.partial(shared_prompt_attention, layout=lay, backend=backend,
                           block_sizes=blocks, interpret=True)


def _compare(case, dtype, blocks, tol, backend="pallas_tpu"):
  lay, q, k, v, do = case.inputs(dtype)
  want = reference_outputs(case, dtype)  # f32 math on the same (possibly bf16-rounded) inputs
  got = vjp_outputs(_pallas(lay, blocks, backend), q, k, v, do, want[1])
  assert got[0].dtype == dtype and got[2].dtype == dtype and got[1].dtype == jnp.float32
  lse, ref_lse = valid_lse(got[1], want[1])
  np.testing.assert_allclose(lse, ref_lse, **tol)
  for name, g, w in zip(["o", "dq", "dk", "dv"], [got[0], *got[2:]], [want[0], *want[2:]]):
    np.testing.assert_allclose(np.asarray(g, np.float32), w, err_msg=name, **tol)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pallas_f32_matches_n_copies(case):
  _compare(case, jnp.float32, BLOCKS, dict(atol=1e-5, rtol=1e-5))


def test_pallas_bf16_matches_n_copies():
  # bf16 inputs, f32 accumulation: tolerances of the order JAX's splash tests use for bf16.
  _compare(ODD_GQA_PADDED, jnp.bfloat16, BLOCKS, dict(atol=3e-2, rtol=3e-2))


def test_pallas_gpu_triton_kernel_matches_n_copies():
  # The Triton kernel (loops instead of grid steps) under the Pallas interpreter.
  _compare(SMALL_GQA_PADDED, jnp.float32, BLOCKS, dict(atol=1e-5, rtol=1e-5),
           backend="pallas_gpu")


def test_pallas_gpu_pads_a_head_width_that_is_not_a_power_of_two():
  # Heads of 12 go through the Triton kernel as 16 (Phi-3-mini's 96, DeepSeek's 192).
  _compare(dataclasses.replace(SMALL_GQA_PADDED, head_dim=12), jnp.float32, BLOCKS,
           dict(atol=1e-5, rtol=1e-5), backend="pallas_gpu")


def test_pallas_gpu_rejects_non_power_of_two_blocks():
  lay, q, k, v, _ = SMALL_GQA_PADDED.inputs()
  with pytest.raises(ValueError, match="block_q must be a power of two for the GPU kernel, got 24"):
    shared_prompt_attention(q, k, v, lay, backend="pallas_gpu",
                            block_sizes=schedule.BlockSizes(24, 8), interpret=True)


def test_pallas_unequal_blocks_match_n_copies():
  # block_q != block_kv: regions are re-padded to their lcm, several q blocks per k block.
  _compare(ALIGNED_FULL, jnp.float32, schedule.BlockSizes(block_q=8, block_kv=16),
           dict(atol=1e-5, rtol=1e-5))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_schedules_visit_exactly_the_structurally_nonzero_blocks(case):
  lay = case.layout()
  g = aligned_geometry(lay, BLOCKS)
  full = make_layout(np.full(lay.batch, g.prompt_capacity),
                     np.full((lay.batch, lay.num_responses), g.response_capacity),
                     g.prompt_capacity, g.response_capacity)
  nb = g.total_len // 8
  dense = np.asarray(full.dense_mask()[0]).reshape(nb, 8, nb, 8).any(axis=(1, 3))
  for sched in (schedule.forward_schedule(g), schedule.dkv_schedule(g)):
    visited = np.zeros_like(dense)
    visited[sched.q_block, sched.k_block] = True
    np.testing.assert_array_equal(visited, dense)
    assert sched.length == dense.sum()  # each pair once
  # Fewer steps than the dense [L/b]^2 grid: that is the shared-prompt saving.
  assert schedule.forward_schedule(g).length < nb * nb


def test_dead_pairs_repeat_the_last_live_block():
  blocks = np.array([4, 5, 6, 7, 8], np.int32)
  live = jnp.array([[False, True, False, True, False], [False, False, False, False, False]])
  fetch = schedule.fill_dead(blocks, live)
  np.testing.assert_array_equal(fetch, [[5, 5, 5, 7, 7], [4, 4, 4, 4, 4]])


def test_dkv_schedule_sums_prompt_block_over_all_responses():
  g = schedule.Geometry(num_responses=3, prompt_capacity=8, response_capacity=8, block_q=8,
                        block_kv=8)
  sched = schedule.dkv_schedule(g)
  prompt_pairs = sched.q_block[sched.k_block == 0]
  np.testing.assert_array_equal(prompt_pairs, [0, 1, 2, 3])  # prompt, then responses 0..2
  # One accumulator run per key block: init at its first pair, write at its last.
  assert sched.first.sum() == sched.last.sum() == 4


def test_block_sizes_reject_bad_values():
  with pytest.raises(ValueError, match="BlockSizes.block_q must be a positive int, got 0"):
    schedule.BlockSizes(block_q=0)


def test_dispatch_rejects_unknown_backend():
  lay, q, k, v, _ = ODD_GQA_PADDED.inputs()
  with pytest.raises(ValueError, match="backend must be one of .* got 'cuda_magic'"):
    shared_prompt_attention(q, k, v, lay, backend="cuda_magic")


@pytest.mark.parametrize("blocks", [None, schedule.BlockSizes(24, 24)], ids=["default", "tpu"])
def test_auto_backend_on_cpu_equals_two_pass(blocks):
  """Block sizes for the TPU kernel (not powers of two) are no error on a platform whose
  branch ignores them: auto traces the GPU branch too, which takes its own then."""
  lay, q, k, v, _ = ODD_GQA_PADDED.inputs()

  @jax.jit
  def both(q, k, v):
    return (shared_prompt_attention(q, k, v, lay, block_sizes=blocks),
            reference.two_pass_attention(q, k, v, lay))

  (o, lse), (o2, lse2) = both(q, k, v)
  np.testing.assert_allclose(o, o2, atol=1e-6)
  np.testing.assert_allclose(*valid_lse(lse, lse2), atol=1e-6)
