"""models.attention.dot_product_attention with Gemma 2's logit soft-capping
(softcap * tanh(sm_scale * q.k / softcap), before the mask), against a brute-force softmax."""

import re

import jax
import numpy as np
import pytest

from rlax_ps.models.attention import dot_product_attention
from test_attention_window import D, H, HKV, K_POS, K_SEG, Q_POS, Q_SEG, _inputs

GAIN = 4.0  # raw logits several times the cap


def _brute_force(q, k, v, window, scale, softcap):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  out = np.zeros(q.shape)
  for b in range(q.shape[0]):
    for t in range(q.shape[1]):
      seen = [s for s in range(k.shape[1]) if K_SEG[b, s] == Q_SEG[b, t]
              and K_POS[b, s] <= Q_POS[b, t]
              and (window is None or Q_POS[b, t] - K_POS[b, s] < window)]
      if not seen:
        continue
      for h in range(H):
        kh = h // (H // HKV)
        logits = np.array([q[b, t, h] @ k[b, s, kh] for s in seen]) * scale
        logits = softcap * np.tanh(logits / softcap)
        p = np.exp(logits - logits.max())
        out[b, t, h] = (p / p.sum()) @ v[b, seen, kh]
  return out


_attend = jax.jit(dot_product_attention, static_argnames=("window", "sm_scale", "softcap"))


@pytest.mark.parametrize("softcap,window,sm_scale", [(2.0, None, None), (5.0, 3, 0.3)])
def test_dot_product_attention_softcap_equals_brute_force(softcap, window, sm_scale):
  q, k, v = _inputs()
  q = q * GAIN
  scale = D ** -0.5 if sm_scale is None else sm_scale
  got = _attend(q, k, v, Q_SEG, Q_POS, K_SEG, K_POS, window=window, sm_scale=sm_scale,
                softcap=softcap)
  np.testing.assert_allclose(got, _brute_force(q, k, v, window, scale, softcap), atol=1e-5)
  plain = _attend(q, k, v, Q_SEG, Q_POS, K_SEG, K_POS, window=window, sm_scale=sm_scale)
  assert not np.allclose(got, plain, atol=1e-2)


@pytest.mark.parametrize("softcap", [0, -2.0, float("inf"), True, "5"])
def test_softcap_must_be_a_positive_number(softcap):
  q, k, v = _inputs()
  msg = re.escape(f"softcap: expected a positive number or None, got {softcap!r}")
  with pytest.raises(ValueError, match=msg):
    dot_product_attention(q, k, v, Q_SEG, Q_POS, K_SEG, K_POS, softcap=softcap)
