"""Sliding-window attention: every training and decode backend against the N-copies reference
under a window, and that reference against a brute-force softmax over each separate sequence."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (ALIGNED_FULL, ODD_GQA_PADDED, SMALL_GQA_PADDED, Case,
                          reference_outputs, valid_lse, vjp_outputs)
from rlax_ps.kernels import reference, schedule
from rlax_ps.kernels.dispatch import shared_prefix_decode_attention, shared_prompt_attention
from rlax_ps.kernels.layout import make_layout
from rlax_ps.kernels.packing import packed_attention_fn
from rlax_ps.kernels.pallas_common import aligned_geometry

# Four 8-blocks of prompt, three of response: pairs wholly outside a small window exist.
LONG = Case("long", (29, 20), ((24, 3), (17, 24)), 29, 24, 4, 2, 8)
BLOCKS = schedule.BlockSizes(block_q=8, block_kv=8)
BIG = 100  # longer than every sequence: must equal no window

# (case, window): 1; inside the prompt; across the prompt/response boundary; larger than all.
WINDOWS = [(ODD_GQA_PADDED, 1), (ODD_GQA_PADDED, 4), (ODD_GQA_PADDED, 9),
           (ODD_GQA_PADDED, BIG), (ALIGNED_FULL, 5), (LONG, 10)]
_ids = lambda pairs: [f"{case.name}-w{window}" for case, window in pairs]
TOL = dict(atol=1e-5, rtol=1e-5)


@functools.cache
def windowed_reference(case: Case, window: int):
  """N-copies outputs (o, lse, dq, dk, dv) under `window`, computed once per (case, window)."""
  lay, q, k, v, do = case.inputs()
  ref = lambda q, k, v: reference.n_copies_attention(q, k, v, lay, window=window)
  ref_lse = jax.jit(ref)(q, k, v)[1]
  return vjp_outputs(ref, q, k, v, do, ref_lse)


def _assert_matches(got, want, tol=TOL):
  lse, ref_lse = valid_lse(got[1], want[1])
  np.testing.assert_allclose(lse, ref_lse, err_msg="lse", **tol)
  for name, g, w in zip(["o", "dq", "dk", "dv"], [got[0], *got[2:]], [want[0], *want[2:]]):
    np.testing.assert_allclose(np.asarray(g, np.float32), w, err_msg=name, **tol)


def _softmax_rows(q, k, v, visible, scale, softcap=None):
  """float64 brute force: q [T, H, D], k/v [S, Hkv, D], visible [T, S] -> (o [T, H, D],
  lse [T, H]); rows that see nothing get 0 and -inf. softcap: logits softcap * tanh(s / softcap)."""
  h, hkv = q.shape[1], k.shape[1]
  kh = np.repeat(k, h // hkv, axis=1)
  vh = np.repeat(v, h // hkv, axis=1)
  s = np.einsum("thd,shd->hts", q, kh) * scale
  if softcap is not None:
    s = softcap * np.tanh(s / softcap)
  s = np.where(visible[None], s, -np.inf)
  mx = s.max(-1, keepdims=True)
  p = np.where(visible[None], np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
  l = p.sum(-1)
  o = np.einsum("hts,shd->thd", p / np.where(l > 0, l, 1.0)[..., None], vh)
  lse = np.where(l > 0, np.log(np.where(l > 0, l, 1.0)) + mx[..., 0], -np.inf)
  return o, lse.T


@pytest.mark.parametrize("case,window", WINDOWS, ids=_ids(WINDOWS))
def test_n_copies_window_equals_brute_force_per_sequence(case, window):
  lay, q, k, v, _ = case.inputs()
  o, lse = (np.asarray(x) for x in windowed_reference(case, window)[:2])
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  pc, rc = case.prompt_capacity, case.response_capacity
  want_o, want_lse = np.zeros_like(o), np.full_like(lse, -np.inf)
  for b, plen in enumerate(case.prompt_lens):
    for i, rlen in enumerate(case.response_lens[b]):
      rows = np.r_[np.arange(plen), pc + i * rc + np.arange(rlen)]  # packed index of each token
      pos = np.arange(plen + rlen)  # one plain sequence: positions are its indices
      visible = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
      so, slse = _softmax_rows(q[b, rows], k[b, rows], v[b, rows], visible,
                               case.head_dim ** -0.5)
      # Prompt rows are written by every copy: they must all agree with the packed output.
      np.testing.assert_allclose(o[b, rows], so, atol=1e-5, err_msg=f"b={b} response {i}")
      want_o[b, rows], want_lse[b, rows] = so, slse
  np.testing.assert_allclose(o, want_o, atol=1e-5)
  np.testing.assert_allclose(*valid_lse(lse, want_lse), atol=1e-5)


def test_window_larger_than_every_sequence_equals_no_window():
  _assert_matches(windowed_reference(ODD_GQA_PADDED, BIG), reference_outputs(ODD_GQA_PADDED),
                  dict(atol=1e-6, rtol=1e-6))
  # ... while a window that cuts does change the result.
  assert not np.allclose(windowed_reference(ODD_GQA_PADDED, 9)[0],
                         reference_outputs(ODD_GQA_PADDED)[0], atol=1e-3)


XLA_WINDOWS = [(*cw, "xla") for cw in WINDOWS] + [
    (ODD_GQA_PADDED, 4, "xla_dense"), (ODD_GQA_PADDED, 9, "xla_dense"), (LONG, 10, "xla_dense")]


@pytest.mark.parametrize("case,window,backend", XLA_WINDOWS,
                         ids=[f"{c.name}-w{w}-{b}" for c, w, b in XLA_WINDOWS])
def test_xla_backends_match_n_copies_under_window(case, window, backend):
  lay, q, k, v, do = case.inputs()
  want = windowed_reference(case, window)
  attn = functools.partial(shared_prompt_attention, layout=lay, window=window, backend=backend)
  _assert_matches(vjp_outputs(attn, q, k, v, do, want[1]), want)


PALLAS_WINDOWS = [("pallas_tpu", ODD_GQA_PADDED, 4), ("pallas_tpu", ODD_GQA_PADDED, 9),
                  ("pallas_tpu", LONG, 10),  # the Triton interpreter is slower: two cases
                  ("pallas_gpu", SMALL_GQA_PADDED, 4), ("pallas_gpu", LONG, 10)]


# pallas_gpu on small_gqa_padded slow (~3 s, suite time): test_shared_prompt_softcap's
# [small_gqa_padded-c5.0-w4-s0.5-pallas_gpu] runs that kernel and case under the same window.
@pytest.mark.parametrize("backend,case,window", [
    pytest.param(b, c, w, id=f"{b}-{c.name}-w{w}",
                 marks=[pytest.mark.slow] if c is SMALL_GQA_PADDED else [])
    for b, c, w in PALLAS_WINDOWS])
def test_pallas_kernels_match_n_copies_under_window(backend, case, window):
  lay, q, k, v, do = case.inputs()
  want = windowed_reference(case, window)
  attn = functools.partial(shared_prompt_attention, layout=lay, window=window,
                           backend=backend, block_sizes=BLOCKS, interpret=True)
  _assert_matches(vjp_outputs(attn, q, k, v, do, want[1]), want)


@pytest.mark.parametrize("window", [1, 10, 20])
def test_window_schedules_and_liveness_keep_exactly_the_blocks_with_a_visible_key(window):
  """For several lengths, the live pairs of both schedules are exactly the 8x8 blocks of the
  windowed dense mask that hold a visible key; the window removes pairs statically (10 puts
  a kept pair's nearest query and key exactly window - 1 apart)."""
  g = aligned_geometry(LONG.layout(), BLOCKS, window)
  pc, rc = g.prompt_capacity, g.response_capacity
  nb = g.total_len // 8
  for plens, rlens in [(LONG.prompt_lens, LONG.response_lens), ((pc, 1), ((rc, rc), (rc, 5))),
                       ((1, 9), ((rc, 0), (16, 8)))]:
    lay = make_layout(np.array(plens), np.array(rlens), pc, rc)
    pos = lay.positions()
    dense = np.asarray(lay.dense_mask() & reference.in_window(pos, pos, window))
    blocks = dense.reshape(lay.batch, nb, 8, nb, 8).any(axis=(2, 4))
    lens = schedule.region_lens(lay.prompt_lens, lay.response_lens)
    for sched in (schedule.forward_schedule(g), schedule.dkv_schedule(g)):
      assert len(set(zip(sched.q_block, sched.k_block))) == sched.length
      live = np.asarray(schedule.liveness(sched, g, lens))
      for b in range(lay.batch):
        got = np.zeros((nb, nb), bool)
        got[sched.q_block[live[b]], sched.k_block[live[b]]] = True
        np.testing.assert_array_equal(got, blocks[b], err_msg=f"lens {plens} {rlens} row {b}")
  full = aligned_geometry(LONG.layout(), BLOCKS)
  for make in (schedule.forward_schedule, schedule.dkv_schedule):
    if window < 20:
      assert make(g).length < make(full).length
    else:  # every pair of LONG's geometry can come within 20 positions
      assert make(g).length == make(full).length


def test_packed_attention_fn_passes_window_and_sm_scale():
  lay, q, k, v, _ = ODD_GQA_PADDED.inputs()
  fn = packed_attention_fn(lay, backend="xla")

  @jax.jit
  def both(q, k, v):
    got = fn(q, k, v, None, None, None, None, window=4, sm_scale=0.3)
    return got, reference.n_copies_attention(q, k, v, lay, sm_scale=0.3, window=4)[0]

  got, want = both(q, k, v)
  np.testing.assert_allclose(got, want, **TOL)
  plain = jax.jit(lambda q, k, v: fn(q, k, v, None, None, None, None))(q, k, v)
  assert not np.allclose(plain, want, atol=1e-3)


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "4"])
def test_window_must_be_a_positive_int(window):
  lay, q, k, v, _ = ODD_GQA_PADDED.inputs()
  msg = re.escape(f"window: expected a positive int or None, got {window!r}")
  with pytest.raises(ValueError, match=msg):
    shared_prompt_attention(q, k, v, lay, window=window, backend="xla")
  args = _decode_inputs()
  with pytest.raises(ValueError, match="window: expected a positive int or None"):
    shared_prefix_decode_attention(*args, window=window, backend="pallas_tpu", interpret=True)


# Decode: N samples sharing a prefix.

B, N, H, HKV, D = 2, 3, 4, 2, 16
PREFIX, SUFFIX = 20, 12
PREFIX_LENS = np.array([20, 5], np.int32)
SUFFIX_LENS = np.array([[1, 12, 0], [3, 0, 7]], np.int32)  # unequal, and empty suffixes
DECODE_BLOCK = 8


@functools.cache
def _decode_inputs():
  ks = jax.random.split(jax.random.key(11), 5)
  q = jax.random.normal(ks[0], (B, N, H, D))
  pk = jax.random.normal(ks[1], (B, PREFIX, HKV, D))
  pv = jax.random.normal(ks[2], (B, PREFIX, HKV, D))
  sk = jax.random.normal(ks[3], (B, N, SUFFIX, HKV, D))
  sv = jax.random.normal(ks[4], (B, N, SUFFIX, HKV, D))
  return q, pk, pv, PREFIX_LENS, sk, sv, SUFFIX_LENS


@functools.cache
def _decode_truth(window):
  return jax.jit(functools.partial(reference.decode_n_copies, window=window))(*_decode_inputs())


@pytest.mark.parametrize("window", [1, 4, 10])
def test_decode_n_copies_window_equals_brute_force(window):
  q, pk, pv, plens, sk, sv, slens = _decode_inputs()
  q, pk, pv, sk, sv = (np.asarray(x, np.float64) for x in (q, pk, pv, sk, sv))
  o, lse = (np.asarray(x) for x in _decode_truth(window))
  for b in range(B):
    for n in range(N):
      p, s = plens[b], slens[b, n]
      keys = np.concatenate([pk[b, :p], sk[b, n, :s]])
      vals = np.concatenate([pv[b, :p], sv[b, n, :s]])
      visible = (p + s - 1 - np.arange(p + s) < window)[None]  # the query is at p + s - 1
      so, slse = _softmax_rows(q[b, n][None], keys, vals, visible, D ** -0.5)
      np.testing.assert_allclose(o[b, n], so[0], atol=1e-5, err_msg=f"sample {b}, {n}")
      np.testing.assert_allclose(lse[b, n], slse[0], atol=1e-5, err_msg=f"sample {b}, {n}")


def test_decode_window_larger_than_everything_equals_no_window():
  want = jax.jit(reference.decode_n_copies)(*_decode_inputs())
  for got, w in zip(_decode_truth(BIG), want):
    np.testing.assert_allclose(got, w, atol=1e-6)


@pytest.mark.parametrize("window", [1, 4, 10])
def test_decode_xla_matches_n_copies_under_window(window):
  fn = jax.jit(functools.partial(shared_prefix_decode_attention, window=window, backend="xla"))
  for got, want in zip(fn(*_decode_inputs()), _decode_truth(window)):
    np.testing.assert_allclose(got, want, **TOL)


def _poison_skipped_blocks(window):
  """NaN in the K/V blocks that lie wholly below the first visible key of every query of
  their grid row: the Pallas decode kernel must neither compute nor use them."""
  q, pk, pv, plens, sk, sv, slens = _decode_inputs()
  pre, suf = (np.maximum(np.asarray(x), 0) for x in
              reference.decode_window_starts(plens, slens, window))
  pre_dead = np.arange(PREFIX)[None] < (pre.min(1) // DECODE_BLOCK * DECODE_BLOCK)[:, None]
  suf_dead = np.arange(SUFFIX)[None, None] < (suf // DECODE_BLOCK * DECODE_BLOCK)[..., None]
  assert pre_dead.any()
  nan = lambda x, dead: jnp.where(dead[..., None, None], jnp.nan, x)
  return q, nan(pk, pre_dead), nan(pv, pre_dead), plens, nan(sk, suf_dead), nan(sv, suf_dead), slens


# 10 slow (suite time): 4 poisons prefix blocks as 10 does, and also a suffix block.
@pytest.mark.parametrize("window", [4, pytest.param(10, marks=pytest.mark.slow)])
def test_decode_pallas_matches_n_copies_and_skips_blocks_below_the_window(window):
  fn = jax.jit(functools.partial(shared_prefix_decode_attention, window=window,
                                 backend="pallas_tpu", block_s=DECODE_BLOCK, interpret=True))
  for got, want in zip(fn(*_poison_skipped_blocks(window)), _decode_truth(window)):
    np.testing.assert_allclose(got, want, **TOL)
