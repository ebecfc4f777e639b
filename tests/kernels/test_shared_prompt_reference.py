"""XLA paths (dense packed mask, two-pass LSE merge) against the N-copies ground truth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import CASES, ODD_GQA_PADDED, reference_outputs, valid_lse, vjp_outputs
from rlax_ps.kernels import reference
from rlax_ps.kernels.layout import make_layout


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("fn", [reference.packed_dense_attention, reference.two_pass_attention],
                         ids=["dense", "two_pass"])
def test_xla_paths_match_n_copies(case, fn):
  lay, q, k, v, do = case.inputs()
  ref_out = reference_outputs(case)
  out = vjp_outputs(lambda q, k, v: fn(q, k, v, lay), q, k, v, do, ref_out[1])
  lse, ref_lse = valid_lse(out[1], ref_out[1])
  np.testing.assert_allclose(lse, ref_lse, atol=1e-5, rtol=1e-5)
  for name, got, want in zip(["o", "dq", "dk", "dv"], [out[0], *out[2:]],
                             [ref_out[0], *ref_out[2:]]):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)


def test_padding_rows_output_zero_and_lse_neg_inf():
  lay, q, k, v, _ = ODD_GQA_PADDED.inputs()
  o, lse = jax.jit(lambda q, k, v: reference.two_pass_attention(q, k, v, lay))(q, k, v)
  valid = np.asarray(lay.valid())
  assert np.all(np.asarray(o)[~valid] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[~valid]))
  assert np.all(np.isfinite(np.asarray(lse)[valid]))


def test_merge_lse_of_two_key_halves_equals_full_attention():
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (1, 3, 2, 8))
  k = jax.random.normal(ks[1], (1, 10, 2, 8))
  v = jax.random.normal(ks[2], (1, 10, 2, 8))
  full = jnp.ones((1, 3, 10), bool)

  @jax.jit
  def both(q, k, v):
    o1, l1 = reference.masked_attention(q, k[:, :4], v[:, :4], full[..., :4])
    o2, l2 = reference.masked_attention(q, k[:, 4:], v[:, 4:], full[..., 4:])
    return reference.masked_attention(q, k, v, full), reference.merge_lse(o1, l1, o2, l2)

  (o, lse), (om, lm) = both(q, k, v)
  np.testing.assert_allclose(om, o, atol=1e-6)
  np.testing.assert_allclose(lm, lse, atol=1e-6)
  # Softmax by hand for the logsumexp.
  logits = np.einsum("bthd,bshd->bths", q, k) / np.sqrt(8)
  np.testing.assert_allclose(lse, np.log(np.exp(logits).sum(-1)), atol=1e-5)


def test_layout_positions_segments_and_validity_by_hand():
  lay = make_layout([2], [[1, 3]], prompt_capacity=3, response_capacity=3)
  # rows: prompt p0 p1 pad | r0: t0 pad pad | r1: t0 t1 t2
  np.testing.assert_array_equal(lay.valid()[0], [1, 1, 0, 1, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(lay.positions()[0], [0, 1, 2, 2, 3, 4, 2, 3, 4])
  np.testing.assert_array_equal(lay.segment_ids()[0], [1, 1, 0, 2, 0, 0, 3, 3, 3])
  mask = np.asarray(lay.dense_mask()[0])
  assert mask[3, :2].all() and not mask[3, 2]  # response 0 sees the real prompt
  assert not mask[6, 3]  # response 1 never sees response 0
  assert mask[8, 6] and not mask[6, 8]  # causal inside a response


def test_layout_rejects_lengths_outside_capacity():
  with pytest.raises(ValueError, match=r"prompt_lens must lie in \[1, prompt_capacity=3\]"):
    make_layout([4], [[1, 3]], 3, 3)
  with pytest.raises(ValueError, match=r"prompt_lens must lie in \[1, prompt_capacity=3\]"):
    make_layout([0], [[1, 3]], 3, 3)
  with pytest.raises(ValueError, match=r"response_lens must lie in \[0, response_capacity=3\]"):
    make_layout([2], [[1, 5]], 3, 3)


def test_layout_is_a_pytree_with_static_capacities():
  lay = make_layout([2], [[1, 3]], 3, 3)
  leaves, treedef = jax.tree.flatten(lay)
  assert len(leaves) == 2  # the two length arrays; capacities live in the treedef
  positions = jax.jit(lambda l: l.positions())(lay)
  np.testing.assert_array_equal(positions, lay.positions())
  assert jax.tree.unflatten(treedef, leaves).response_capacity == 3


def test_layout_rejects_wrong_shapes_with_named_field():
  with pytest.raises(ValueError, match="response_lens must have shape"):
    make_layout([2, 3], [[1, 3]], 3, 3)
  lay = make_layout([2], [[1, 3]], 3, 3)
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(ValueError, match="sequence length must be .* = 9, got 8"):
    reference.two_pass_attention(q, q, q, lay)
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    reference.two_pass_attention(jnp.zeros((1, 9, 3, 4)), jnp.zeros((1, 9, 2, 4)),
                                 jnp.zeros((1, 9, 2, 4)), lay)


@pytest.mark.parametrize("window", [None, 3])
def test_chunked_causal_prompt_attention_equals_one_masked_matmul(window):
  ks = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(ks[0], (2, 13, 4, 8))
  k = jax.random.normal(ks[1], (2, 13, 2, 8))
  v = jax.random.normal(ks[2], (2, 13, 2, 8))
  valid = jnp.arange(13)[None, :] < jnp.array([[13], [6]])

  @jax.jit
  def both(q, k, v):
    full = jnp.tril(jnp.ones((13, 13), bool))[None] & valid[:, :, None] & valid[:, None, :]
    if window is not None:
      full = full & reference.in_window(jnp.arange(13), jnp.arange(13), window)
    chunked = reference._chunked_causal_attention(q, k, v, valid, None, min_chunk=3,
                                                  window=window)
    return reference.masked_attention(q, k, v, full), chunked

  (o, lse), (oc, lsec) = both(q, k, v)
  np.testing.assert_allclose(oc, o, atol=1e-6)
  np.testing.assert_allclose(*valid_lse(lsec, lse), atol=1e-6)
