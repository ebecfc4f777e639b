"""models.attention.dot_product_attention with a sliding window and an explicit softmax scale,
against a brute-force float64 softmax over the segment / causal / window mask."""

import functools

import jax
import numpy as np
import pytest

from rlax_ps.models.attention import attention_mask, dot_product_attention

H, HKV, D = 4, 2, 8
# Two packed segments and a padding slot; the second query row is a decode-style step whose
# queries sit at the end of the key positions.
Q_SEG = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0], [1] * 10])
Q_POS = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0], np.arange(6, 16)])
K_SEG = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0], [1] * 12])
K_POS = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0], np.arange(4, 16)])


@functools.cache
def _inputs():
  ks = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(ks[0], (2, 10, H, D))
  k = jax.random.normal(ks[1], (2, 12, HKV, D))
  v = jax.random.normal(ks[2], (2, 12, HKV, D))
  return q, k, v


def _brute_force(q, k, v, window, scale):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.zeros(q.shape)
  for b in range(q.shape[0]):
    for t in range(q.shape[1]):
      for h in range(H):
        kh = h // (H // HKV)
        seen = [s for s in range(k.shape[1]) if K_SEG[b, s] == Q_SEG[b, t]
                and K_POS[b, s] <= Q_POS[b, t]
                and (window is None or Q_POS[b, t] - K_POS[b, s] < window)]
        if not seen:
          continue
        logits = np.array([q[b, t, h] @ k[b, s, kh] for s in seen]) * scale
        p = np.exp(logits - logits.max())
        out[b, t, h] = (p / p.sum()) @ v[b, seen, kh]
  return out


_attend = jax.jit(dot_product_attention, static_argnames=("window", "sm_scale"))


@pytest.mark.parametrize("window,sm_scale", [(None, None), (None, 0.3), (1, None), (3, 0.3),
                                             (100, None)])
def test_dot_product_attention_equals_brute_force(window, sm_scale):
  q, k, v = _inputs()
  got = _attend(q, k, v, Q_SEG, Q_POS, K_SEG, K_POS, window=window, sm_scale=sm_scale)
  want = _brute_force(q, k, v, window, D ** -0.5 if sm_scale is None else sm_scale)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_window_one_sees_only_the_own_position():
  mask = np.asarray(attention_mask(Q_SEG, Q_POS, K_SEG, K_POS, window=1))
  same = (Q_POS[:, :, None] == K_POS[:, None, :]) & (Q_SEG[:, :, None] == K_SEG[:, None, :])
  np.testing.assert_array_equal(mask, same)


@pytest.mark.parametrize("window", [0, -1, 1.5, True])
def test_window_must_be_a_positive_int(window):
  q, k, v = _inputs()
  with pytest.raises(ValueError, match=f"window: expected a positive int or None, got {window}"):
    dot_product_attention(q, k, v, Q_SEG, Q_POS, K_SEG, K_POS, window=window)
