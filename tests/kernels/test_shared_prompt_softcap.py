"""Attention logit soft-capping (Gemma 2: s = softcap * tanh(sm_scale * q.k / softcap)):
the references against a brute-force softmax over each separate sequence, and every training
backend (forward and gradients) and decode backend against the N-copies reference."""

import functools
import re

import jax
import numpy as np
import pytest

from kernel_cases import ODD_GQA_PADDED, SMALL_GQA_PADDED, Case, valid_lse, vjp_outputs
from rlax_ps.kernels import reference
from rlax_ps.kernels.dispatch import shared_prefix_decode_attention, shared_prompt_attention
from rlax_ps.kernels.packing import packed_attention_fn
from test_shared_prompt_window import (BLOCKS, DECODE_BLOCK, TOL, _assert_matches,
                                       _decode_inputs, _softmax_rows)

# Queries scaled up so that raw logits reach several times the cap: the cap clearly bites.
GAIN = 4.0

# (case, softcap, window, sm_scale): the cap alone, and with a window and an explicit scale.
SETTINGS = [(ODD_GQA_PADDED, 2.0, None, None), (ODD_GQA_PADDED, 5.0, 4, 0.5),
            (SMALL_GQA_PADDED, 2.0, None, None), (SMALL_GQA_PADDED, 5.0, 4, 0.5)]
_id = lambda case, softcap, window, sm_scale: f"{case.name}-c{softcap}-w{window}-s{sm_scale}"


def _inputs(case: Case):
  lay, q, k, v, do = case.inputs()
  return lay, q * GAIN, k, v, do


@functools.cache
def capped_reference(case: Case, softcap, window, sm_scale):
  """N-copies outputs (o, lse, dq, dk, dv) under the cap, computed once per setting."""
  lay, q, k, v, do = _inputs(case)
  ref = lambda q, k, v: reference.n_copies_attention(q, k, v, lay, sm_scale, window, softcap)
  ref_lse = jax.jit(ref)(q, k, v)[1]
  return vjp_outputs(ref, q, k, v, do, ref_lse)


@pytest.mark.parametrize("case,softcap,window,sm_scale", SETTINGS[:2],
                         ids=[_id(*s) for s in SETTINGS[:2]])
def test_n_copies_softcap_equals_brute_force_per_sequence(case, softcap, window, sm_scale):
  lay, q, k, v, _ = _inputs(case)
  o, lse = (np.asarray(x) for x in capped_reference(case, softcap, window, sm_scale)[:2])
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  scale = case.head_dim ** -0.5 if sm_scale is None else sm_scale
  pc, rc = case.prompt_capacity, case.response_capacity
  want_o, want_lse = np.zeros_like(o), np.full_like(lse, -np.inf)
  for b, plen in enumerate(case.prompt_lens):
    for i, rlen in enumerate(case.response_lens[b]):
      rows = np.r_[np.arange(plen), pc + i * rc + np.arange(rlen)]
      pos = np.arange(plen + rlen)
      visible = pos[None, :] <= pos[:, None]
      if window is not None:
        visible &= pos[:, None] - pos[None, :] < window
      so, slse = _softmax_rows(q[b, rows], k[b, rows], v[b, rows], visible, scale, softcap)
      np.testing.assert_allclose(o[b, rows], so, atol=1e-5, err_msg=f"b={b} response {i}")
      want_o[b, rows], want_lse[b, rows] = so, slse
  np.testing.assert_allclose(o, want_o, atol=1e-5)
  np.testing.assert_allclose(*valid_lse(lse, want_lse), atol=1e-5)


def test_softcap_changes_the_result():
  """The raw logits of the test inputs exceed the cap, and capping changes o, lse and dq."""
  case, softcap = ODD_GQA_PADDED, 2.0
  _, q, k, _, _ = _inputs(case)
  g = case.num_heads // case.num_kv_heads
  raw = np.einsum("blhd,bmhd->bhlm", q, np.repeat(k, g, axis=2)) * case.head_dim ** -0.5
  assert np.abs(raw).max() > 4 * softcap
  capped = capped_reference(case, softcap, None, None)
  plain = capped_reference(case, None, None, None)
  for i, name in enumerate(["o", "lse", "dq"]):
    got, want = (np.nan_to_num(np.asarray(x[i]), neginf=0.0) for x in (capped, plain))
    assert not np.allclose(got, want, atol=1e-2), name


TRAIN = ([(*s, backend) for s in SETTINGS[:2] for backend in ("xla", "xla_dense", "pallas_tpu")]
         + [(*s, "pallas_gpu") for s in SETTINGS[2:]])


@pytest.mark.parametrize("case,softcap,window,sm_scale,backend", TRAIN,
                         ids=[f"{_id(*s[:4])}-{s[4]}" for s in TRAIN])
def test_training_backends_match_n_copies_with_softcap(case, softcap, window, sm_scale,
                                                       backend):
  lay, q, k, v, do = _inputs(case)
  want = capped_reference(case, softcap, window, sm_scale)
  pallas = backend.startswith("pallas")
  attn = functools.partial(shared_prompt_attention, layout=lay, sm_scale=sm_scale,
                           window=window, softcap=softcap, backend=backend,
                           block_sizes=BLOCKS if pallas else None, interpret=pallas)
  _assert_matches(vjp_outputs(attn, q, k, v, do, want[1]), want)


def test_packed_attention_fn_passes_softcap():
  lay, q, k, v, _ = _inputs(ODD_GQA_PADDED)
  fn = packed_attention_fn(lay, backend="xla")
  got = jax.jit(lambda q, k, v: fn(q, k, v, None, None, None, None, softcap=2.0))(q, k, v)
  np.testing.assert_allclose(got, capped_reference(ODD_GQA_PADDED, 2.0, None, None)[0], **TOL)


@pytest.mark.parametrize("softcap", [0, -1.0, float("inf"), float("nan"), True, "2"])
def test_softcap_must_be_a_positive_number(softcap):
  lay, q, k, v, _ = ODD_GQA_PADDED.inputs()
  msg = re.escape(f"softcap: expected a positive number or None, got {softcap!r}")
  for backend in ("xla", "reference", "pallas_tpu"):
    with pytest.raises(ValueError, match=msg):
      shared_prompt_attention(q, k, v, lay, softcap=softcap, backend=backend)
  with pytest.raises(ValueError, match=msg):
    shared_prefix_decode_attention(*_decode_inputs(), softcap=softcap, backend="pallas_tpu",
                                   interpret=True)


# Decode: (softcap, window, sm_scale).

DECODE = [(2.0, None, None), (5.0, 4, 0.5)]


def _decode_capped_inputs():
  q, *rest = _decode_inputs()
  return (q * GAIN, *rest)


@functools.cache
def _decode_truth(softcap, window, sm_scale):
  fn = functools.partial(reference.decode_n_copies, sm_scale=sm_scale, window=window,
                         softcap=softcap)
  return jax.jit(fn)(*_decode_capped_inputs())


@pytest.mark.parametrize("softcap,window,sm_scale", DECODE)
def test_decode_n_copies_softcap_equals_brute_force(softcap, window, sm_scale):
  q, pk, pv, plens, sk, sv, slens = (np.asarray(x) for x in _decode_capped_inputs())
  q, pk, pv, sk, sv = (x.astype(np.float64) for x in (q, pk, pv, sk, sv))
  o, lse = (np.asarray(x) for x in _decode_truth(softcap, window, sm_scale))
  scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
  for b in range(q.shape[0]):
    for n in range(q.shape[1]):
      p, s = plens[b], slens[b, n]
      keys = np.concatenate([pk[b, :p], sk[b, n, :s]])
      vals = np.concatenate([pv[b, :p], sv[b, n, :s]])
      visible = np.ones((1, p + s), bool)
      if window is not None:
        visible = (p + s - 1 - np.arange(p + s) < window)[None]
      so, slse = _softmax_rows(q[b, n][None], keys, vals, visible, scale, softcap)
      np.testing.assert_allclose(o[b, n], so[0], atol=1e-5, err_msg=f"sample {b}, {n}")
      np.testing.assert_allclose(lse[b, n], slse[0], atol=1e-5, err_msg=f"sample {b}, {n}")
  plain = jax.jit(functools.partial(reference.decode_n_copies, sm_scale=sm_scale,
                                    window=window))(*_decode_capped_inputs())
  assert not np.allclose(o, plain[0], atol=1e-2)


@pytest.mark.parametrize("softcap,window,sm_scale", DECODE)
@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_decode_backends_match_n_copies_with_softcap(backend, softcap, window, sm_scale):
  fn = jax.jit(functools.partial(shared_prefix_decode_attention, sm_scale=sm_scale,
                                 window=window, softcap=softcap, backend=backend,
                                 block_s=DECODE_BLOCK, interpret=backend == "pallas_tpu"))
  for got, want in zip(fn(*_decode_capped_inputs()), _decode_truth(softcap, window, sm_scale)):
    np.testing.assert_allclose(got, want, **TOL)
