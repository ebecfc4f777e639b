"""Plain-XLA shared-prompt attention: ground truth, dense packed mask, two-pass LSE merge.

Shapes: q [B, T, H, D]; k, v [B, S, Hkv, D] (GQA: H a multiple of Hkv, query head
h uses kv head h // (H // Hkv)); outputs o [B, T, H, D] and lse [B, T, H] float32.
A query that attends no key (a padding row) gets o = 0 and lse = -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_ps.kernels.layout import SharedPromptLayout, join_regions, split_regions
from rlax_ps.models.attention import cap_logits, check_softcap, check_window

_MASKED = -1e30  # finite: keeps max/exp NaN-free on rows with no key


def default_scale(head_dim: int) -> float:
  return head_dim ** -0.5


def in_window(q_pos, k_pos, window):
  """[..., T, S] bool: key position within `window` of the query position (q_pos [..., T],
  k_pos [..., S]); keys after the query are left to the causal mask."""
  return (q_pos[..., :, None] - k_pos[..., None, :]) < window


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
  """Rank, head-count and dtype checks shared by every entry point."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        f"q, k, v must be rank 4 [B, T, heads, head_dim], got shapes {q.shape}, "
        f"{k.shape}, {v.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"head_dim of q ({q.shape[-1]}) must equal head_dim of k ({k.shape[-1]})")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
        f"num_heads of q ({q.shape[2]}) must be a multiple of num_kv_heads ({k.shape[2]})")


def masked_attention(q, k, v, mask, sm_scale=None, out_dtype=None, softcap=None):
  """Softmax attention under a boolean mask [B, T, S]; returns (o, lse [B, T, H]).
  softcap (None: none) caps the scaled logits to softcap * tanh(s / softcap)."""
  b, t, h, d = q.shape
  hkv = k.shape[2]
  g = h // hkv
  scale = default_scale(d) if sm_scale is None else sm_scale
  qg = q.reshape(b, t, hkv, g, d)
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  s = cap_logits(s, softcap)
  m4 = mask[:, None, None, :, :]
  s = jnp.where(m4, s, _MASKED)
  mx = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  # Masked logits underflow to exactly 0; a row with no key at all (mx == _MASKED) gets
  # garbage here and is replaced below, which keeps one select off the [T, S] path.
  p = jnp.exp(s - mx)
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  o = o / jnp.moveaxis(l, -1, 1)[..., None]
  has = jnp.any(mask, axis=-1)  # [B, T]
  o = jnp.where(has[:, :, None, None, None], o, 0.0)
  lse = mx[..., 0] + jnp.log(l)  # [B, Hkv, G, T]
  lse = jnp.where(has[:, None, None, :], lse, -jnp.inf)
  o = o.reshape(b, t, h, d).astype(out_dtype or q.dtype)
  lse = jnp.moveaxis(lse.reshape(b, h, t), 1, 2)
  return o, lse


def merge_lse(o1, lse1, o2, lse2, out_dtype=None):
  """Combines two attention partials over disjoint key sets (o [B,T,H,D], lse [B,T,H])."""
  m = jnp.maximum(lse1, lse2)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w1 = jnp.exp(lse1 - m_safe)
  w2 = jnp.exp(lse2 - m_safe)
  tot = w1 + w2
  has = tot > 0
  tot_safe = jnp.where(has, tot, 1.0)
  o = (o1.astype(jnp.float32) * w1[..., None] + o2.astype(jnp.float32) * w2[..., None])
  o = o / tot_safe[..., None]
  lse = jnp.where(has, m_safe + jnp.log(tot_safe), -jnp.inf)
  return o.astype(out_dtype or o1.dtype), lse


def _causal_valid_mask(len_q_valid, len_k_valid):
  """[B, T, T] causal mask with per-row valid prefixes ([B, T] bool each)."""
  t = len_q_valid.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))
  return causal[None] & len_q_valid[:, :, None] & len_k_valid[:, None, :]


def n_copies_attention(q, k, v, layout: SharedPromptLayout, sm_scale=None, window=None,
                       softcap=None):
  """Ground truth: run N separate [prompt, response i] sequences, then pack the result.

  Prompt rows come from copy 0 (all copies agree). Differentiating this function
  with respect to the packed inputs sums the prompt gradients over the N copies.
  `window` limits each query to keys fewer than `window` positions back; `softcap`
  caps the scaled logits (masked_attention).
  """
  check_qkv(q, k, v)
  window = check_window(window)
  softcap = check_softcap(softcap)
  layout.validate(q.shape[1], q.shape[0])
  b, n = q.shape[0], layout.num_responses
  pc, rc = layout.prompt_capacity, layout.response_capacity

  def copies(x):
    prompt, resp = split_regions(x, layout)
    prompt = jnp.broadcast_to(prompt[:, None], (b, n, *prompt.shape[1:]))
    seqs = jnp.concatenate([prompt, resp], axis=2)  # [B, N, P+R, ...]
    return seqs.reshape(b * n, pc + rc, *x.shape[2:])

  valid_p = jnp.arange(pc)[None, :] < layout.prompt_lens[:, None]  # [B, P]
  valid_r = jnp.arange(rc)[None, None, :] < layout.response_lens[:, :, None]  # [B, N, R]
  valid = jnp.concatenate(
      [jnp.broadcast_to(valid_p[:, None], (b, n, pc)), valid_r], axis=2).reshape(b * n, pc + rc)
  mask = _causal_valid_mask(valid, valid)
  if window is not None:
    pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(pc), (b, pc)),
                           layout.prompt_lens[:, None] + jnp.arange(rc)], axis=1)
    mask = mask & jnp.repeat(in_window(pos, pos, window), n, axis=0)
  o, lse = masked_attention(copies(q), copies(k), copies(v), mask, sm_scale, softcap=softcap)

  def pack(x):
    x = x.reshape(b, n, pc + rc, *x.shape[2:])
    return join_regions(x[:, 0, :pc], x[:, :, pc:])

  return pack(o), pack(lse)


def packed_dense_attention(q, k, v, layout: SharedPromptLayout, sm_scale=None, window=None,
                           softcap=None):
  """The packed row under its dense [L, L] mask: simple, but computes every masked pair."""
  check_qkv(q, k, v)
  layout.validate(q.shape[1], q.shape[0])
  window = check_window(window)
  softcap = check_softcap(softcap)
  mask = layout.dense_mask()
  if window is not None:
    pos = layout.positions()
    mask = mask & in_window(pos, pos, window)
  return masked_attention(q, k, v, mask, sm_scale, softcap=softcap)


def _chunked_causal_attention(q, k, v, valid, sm_scale, min_chunk=256, max_chunks=4,
                              window=None, softcap=None):
  """Causal self-attention in query chunks, chunk i reading only keys [0, end_i): skips
  up to 3/8 of the square that a single masked matmul would compute. With a window
  (positions are the indices here), chunk i reads only keys [start_i - window + 1, end_i),
  in chunks of about the window length (at most 16)."""
  t = q.shape[1]
  if window is None:
    chunks = max(1, min(max_chunks, t // min_chunk))
  else:
    chunks = max(1, min(16, t // max(min_chunk, window)))
  bounds = [t * i // chunks for i in range(chunks + 1)]
  outs, lses = [], []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    k_lo = 0 if window is None else max(0, lo - window + 1)
    causal = jnp.arange(k_lo, hi)[None, :] <= jnp.arange(lo, hi)[:, None]
    if window is not None:
      causal = causal & in_window(jnp.arange(lo, hi), jnp.arange(k_lo, hi), window)
    mask = causal[None] & valid[:, lo:hi, None] & valid[:, None, k_lo:hi]
    o, lse = masked_attention(q[:, lo:hi], k[:, k_lo:hi], v[:, k_lo:hi], mask, sm_scale,
                              softcap=softcap)
    outs.append(o)
    lses.append(lse)
  return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def two_pass_attention(q, k, v, layout: SharedPromptLayout, sm_scale=None, window=None,
                       softcap=None):
  """XLA fast path: prompt causal self-attention; all N*R response queries against
  the prompt keys in one matmul; each response against its own keys; LSE merge.

  With a window, prompt chunks read only the keys their window reaches, and only the
  first window - 1 tokens of each response (the only ones that can reach a prompt key)
  enter the cross matmul. softcap caps the logits of every partial (masked_attention)."""
  check_qkv(q, k, v)
  layout.validate(q.shape[1], q.shape[0])
  window = check_window(window)
  softcap = check_softcap(softcap)
  b, n = q.shape[0], layout.num_responses
  pc, rc = layout.prompt_capacity, layout.response_capacity
  qp, qr = split_regions(q, layout)
  kp, kr = split_regions(k, layout)
  vp, vr = split_regions(v, layout)
  valid_p = jnp.arange(pc)[None, :] < layout.prompt_lens[:, None]
  valid_r = jnp.arange(rc)[None, None, :] < layout.response_lens[:, :, None]

  o_p, lse_p = _chunked_causal_attention(qp, kp, vp, valid_p, sm_scale, window=window,
                                         softcap=softcap)

  # Response token t sits at position prompt_len + t: at least t + 1 past every prompt key.
  tx = rc if window is None else min(rc, window - 1)
  if tx:
    qr_flat = (qr if tx == rc else qr[:, :, :tx]).reshape(b, n * tx, *qr.shape[3:])
    cross = valid_r[:, :, :tx].reshape(b, n * tx)[:, :, None] & valid_p[:, None, :]
    if window is not None:
      q_pos = jnp.tile(layout.prompt_lens[:, None] + jnp.arange(tx), (1, n))  # [B, N*tx]
      cross = cross & in_window(q_pos, jnp.broadcast_to(jnp.arange(pc), (b, pc)), window)
    o_x, lse_x = masked_attention(qr_flat, kp, vp, cross, sm_scale, out_dtype=jnp.float32,
                                  softcap=softcap)

  fold = lambda x: x.reshape(b * n, rc, *x.shape[3:])
  vr_flat = valid_r.reshape(b * n, rc)
  fq, fk, fv = fold(qr), fold(kr), fold(vr)
  self_mask = _causal_valid_mask(vr_flat, vr_flat)
  if window is not None:
    self_mask = self_mask & in_window(jnp.arange(rc), jnp.arange(rc), window)[None]
  o_s, lse_s = masked_attention(fq, fk, fv, self_mask, sm_scale, out_dtype=jnp.float32,
                                softcap=softcap)
  o_s = o_s.reshape(b, n * rc, *o_s.shape[2:])
  lse_s = lse_s.reshape(b, n * rc, -1)
  if not tx:  # window 1: no response token reaches the prompt
    return (jnp.concatenate([o_p, o_s.astype(q.dtype)], axis=1),
            jnp.concatenate([lse_p, lse_s], axis=1))
  if tx < rc:  # the later response tokens get an empty cross partial (o 0, lse -inf)
    def widen(x, fill):
      x = x.reshape(b, n, tx, *x.shape[2:])
      width = [(0, 0), (0, 0), (0, rc - tx)] + [(0, 0)] * (x.ndim - 3)
      return jnp.pad(x, width, constant_values=fill).reshape(b, n * rc, *x.shape[3:])
    o_x, lse_x = widen(o_x, 0.0), widen(lse_x, -jnp.inf)
  o_r, lse_r = merge_lse(o_x, lse_x, o_s, lse_s, out_dtype=q.dtype)
  return (jnp.concatenate([o_p, o_r], axis=1), jnp.concatenate([lse_p, lse_r], axis=1))


# Decode: N samples, one new token each, sharing one prefix KV cache.

def check_decode(q, prefix_k, prefix_v, suffix_k, suffix_v):
  if q.ndim != 4:
    raise ValueError(f"q must be [B, N, heads, head_dim], got shape {q.shape}")
  b, n, _, d = q.shape
  if prefix_k.ndim != 4 or prefix_k.shape != prefix_v.shape or prefix_k.shape[0] != b:
    raise ValueError(
        f"prefix_k and prefix_v must both be [B={b}, S, kv_heads, head_dim], got "
        f"{prefix_k.shape} and {prefix_v.shape}")
  if (suffix_k.ndim != 5 or suffix_k.shape != suffix_v.shape or suffix_k.shape[:2] != (b, n)
      or suffix_k.shape[3:] != prefix_k.shape[2:]):
    raise ValueError(
        f"suffix_k and suffix_v must both be [B={b}, N={n}, S_suffix, "
        f"{prefix_k.shape[2]}, {prefix_k.shape[3]}], got {suffix_k.shape} and {suffix_v.shape}")
  if prefix_k.shape[-1] != d or q.shape[2] % prefix_k.shape[2]:
    raise ValueError(
        f"q heads/head_dim {q.shape[2:]} do not fit kv heads/head_dim {prefix_k.shape[2:]}")


def decode_window_starts(prefix_lens, suffix_lens, window: int):
  """First visible key index ([B, N] each) of the prefix and of the suffix: the query of
  sample (b, n) sits at position prefix_lens[b] + suffix_lens[b, n] - 1, prefix key j at j,
  suffix key s at prefix_lens[b] + s."""
  suffix_start = (suffix_lens - window).astype(jnp.int32)
  return (prefix_lens[:, None] + suffix_start).astype(jnp.int32), suffix_start


def extend_two_pass(q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v, index,
                    sm_scale=None, window=None, softcap=None):
  """T tokens of each of N samples in one step (a reply or begun tokens fed at once):
  q [B, N, T, H, D]; their keys already written at suffix slots [index, index + T) (index
  [B, N]). Query t of sample (b, n) sits at prefix_lens[b] + index[b, n] + t and sees the
  prefix and its suffix up to its own slot; the prefix is read once for all N*T queries.
  -> (o [B, N, T, H, D], lse [B, N, T, H])."""
  b, n, t, h, d = q.shape
  check_decode(q[:, :, 0], prefix_k, prefix_v, suffix_k, suffix_v)
  window = check_window(window)
  softcap = check_softcap(softcap)
  lens = index[:, :, None] + jnp.arange(1, t + 1)  # [B, N, T]: suffix keys each query sees
  pre_start = suf_start = None
  if window is not None:
    pre_start, suf_start = decode_window_starts(prefix_lens, lens.reshape(b, n * t), window)
  o1, l1 = decode_prefix_partial(q.reshape(b, n * t, h, d), prefix_k, prefix_v, prefix_lens,
                                 sm_scale, pre_start, softcap)
  ss = suffix_k.shape[2]
  mask = jnp.arange(ss) < lens[..., None]
  if suf_start is not None:
    mask = mask & (jnp.arange(ss) >= suf_start.reshape(b, n, t)[..., None])
  fold = lambda x: x.reshape(b * n, ss, *x.shape[3:])  # noqa: E731
  o2, l2 = masked_attention(q.reshape(b * n, t, h, d), fold(suffix_k), fold(suffix_v),
                            mask.reshape(b * n, t, ss), sm_scale, out_dtype=jnp.float32,
                            softcap=softcap)
  o, lse = merge_lse(o1.reshape(b * n, t, h, d), l1.reshape(b * n, t, h), o2, l2,
                     out_dtype=q.dtype)
  return o.reshape(b, n, t, h, d), lse.reshape(b, n, t, h)


def decode_n_copies(q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v, suffix_lens,
                    sm_scale=None, window=None, softcap=None):
  """Ground truth: each sample attends its own copy of [prefix, suffix]."""
  check_decode(q, prefix_k, prefix_v, suffix_k, suffix_v)
  window = check_window(window)
  softcap = check_softcap(softcap)
  b, n, h, d = q.shape
  sp, ss = prefix_k.shape[1], suffix_k.shape[2]
  cat = lambda pre, suf: jnp.concatenate(
      [jnp.broadcast_to(pre[:, None], (b, n, *pre.shape[1:])), suf], axis=2
  ).reshape(b * n, sp + ss, *pre.shape[2:])
  valid = jnp.concatenate([
      jnp.broadcast_to((jnp.arange(sp)[None, :] < prefix_lens[:, None])[:, None], (b, n, sp)),
      jnp.arange(ss)[None, None, :] < suffix_lens[:, :, None]], axis=2).reshape(b * n, 1, sp + ss)
  if window is not None:
    k_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(sp), (b, sp)),
                             prefix_lens[:, None] + jnp.arange(ss)], axis=1)  # [B, Sp + Ss]
    q_pos = prefix_lens[:, None] + suffix_lens - 1  # [B, N]
    near = (q_pos[:, :, None] - k_pos[:, None, :]) < window
    valid = valid & near.reshape(b * n, 1, sp + ss)
  o, lse = masked_attention(q.reshape(b * n, 1, h, d), cat(prefix_k, suffix_k),
                            cat(prefix_v, suffix_v), valid, sm_scale, softcap=softcap)
  return o.reshape(b, n, h, d), lse.reshape(b, n, h)


def decode_prefix_partial(q, prefix_k, prefix_v, prefix_lens, sm_scale=None, key_start=None,
                          softcap=None):
  """All N samples' queries against the shared prefix in one matmul: [N*G, D] x [D, S].
  key_start [B, N] (optional): each sample sees only prefix keys from that index on."""
  sp = prefix_k.shape[1]
  mask = jnp.broadcast_to((jnp.arange(sp)[None, :] < prefix_lens[:, None])[:, None],
                          (q.shape[0], q.shape[1], sp))
  if key_start is not None:
    mask = mask & (jnp.arange(sp) >= key_start[:, :, None])
  return masked_attention(q, prefix_k, prefix_v, mask, sm_scale, out_dtype=jnp.float32,
                          softcap=softcap)


def decode_suffix_partial(q, suffix_k, suffix_v, suffix_lens, sm_scale=None, key_start=None,
                          softcap=None):
  """Each sample's query against its own suffix cache; key_start [B, N] (optional): each
  sample sees only suffix keys from that index on."""
  b, n, h, d = q.shape
  ss = suffix_k.shape[2]
  mask = jnp.arange(ss)[None, None, :] < suffix_lens[:, :, None]
  if key_start is not None:
    mask = mask & (jnp.arange(ss) >= key_start[:, :, None])
  mask = mask.reshape(b * n, 1, ss)
  fold = lambda x: x.reshape(b * n, ss, *x.shape[3:])
  o, lse = masked_attention(q.reshape(b * n, 1, h, d), fold(suffix_k), fold(suffix_v), mask,
                            sm_scale, out_dtype=jnp.float32, softcap=softcap)
  return o.reshape(b, n, h, d), lse.reshape(b, n, h)


def decode_two_pass(q, prefix_k, prefix_v, prefix_lens, suffix_k, suffix_v, suffix_lens,
                    sm_scale=None, window=None, softcap=None):
  """XLA decode: prefix read once for all N queries, suffix per sample, LSE merge."""
  check_decode(q, prefix_k, prefix_v, suffix_k, suffix_v)
  window = check_window(window)
  softcap = check_softcap(softcap)
  pre_start = suf_start = None
  if window is not None:
    pre_start, suf_start = decode_window_starts(prefix_lens, suffix_lens, window)
  o1, l1 = decode_prefix_partial(q, prefix_k, prefix_v, prefix_lens, sm_scale, pre_start,
                                 softcap)
  o2, l2 = decode_suffix_partial(q, suffix_k, suffix_v, suffix_lens, sm_scale, suf_start,
                                 softcap)
  return merge_lse(o1, l1, o2, l2, out_dtype=q.dtype)
