"""One text under two tokenizers: which tokens of each cover the same characters, so that a
teacher of another tokenizer can score the policy's responses (on-policy distillation
across tokenizers, worker.teacher_tokenizer)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

# Tokens decoded again before the one whose text is wanted: a tokenizer may decode a token
# differently at the start of a text (a SentencePiece word's leading space), as a stream
# detokenizer knows.
_CONTEXT = 4


def decoded_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
  """The text each of `ids` adds to the decoding of those before it: a token that ends
  inside a character adds "" and the one that completes it adds the character; special
  tokens add "". Joined, they are tokenizer.decode(ids) wherever decoding is incremental
  (`aligned_chunks` checks it)."""
  ids = [int(i) for i in ids]
  pieces = []
  start = given = 0
  before = ""  # decode(ids[start:given]): the text given out since `start`
  whole = [0]  # where a character ends: a window starts there, not inside one (whose bytes
  # a byte-fallback decoder would read as a run of U+FFFD)
  for k in range(len(ids)):
    after = tokenizer.decode(ids[start:k + 1])
    if after.endswith("\ufffd") and k + 1 < len(ids):  # inside a character: wait for it
      pieces.append("")
      continue
    pieces.append(after[len(before):] if after.startswith(before) else after)
    given, before = k + 1, after
    whole.append(given)
    if given - start > 2 * _CONTEXT:  # decode from a few tokens back, not from the start
      back = next(i for i in reversed(whole) if i <= given - _CONTEXT)
      if back > start:
        start, whole = back, [i for i in whole if i >= back]
        before = tokenizer.decode(ids[start:given])
  return pieces


def aligned_chunks(a: Sequence[str], b: Sequence[str]) -> tuple[np.ndarray, np.ndarray, int]:
  """The chunk of each token of `a` and of `b` (text pieces of one text): chunks end where a
  token of each ends at the same character, the smallest spans both tokenize alike; a
  token of no text joins the chunk it ends in. Texts that differ (a tokenizer that does
  not give back what it was given) are one chunk. Returns (a's chunks, b's, count)."""
  text_a, text_b = "".join(a), "".join(b)
  ends_a = np.cumsum([len(p) for p in a], dtype=np.int64)
  ends_b = np.cumsum([len(p) for p in b], dtype=np.int64)
  if text_a != text_b or not text_a:
    return np.zeros(len(a), np.int64), np.zeros(len(b), np.int64), 1
  bounds = np.intersect1d(ends_a[ends_a > 0], ends_b[ends_b > 0])  # the text's end is one
  return (np.searchsorted(bounds, ends_a, side="left"),
          np.searchsorted(bounds, ends_b, side="left"), len(bounds))


def spread_over_chunks(values: np.ndarray, chunks_from: np.ndarray, chunks_to: np.ndarray,
                       weights: np.ndarray, count: int) -> np.ndarray:
  """Each chunk's sum of `values` (one per token of the side `chunks_from` numbers) shared
  out over the other side's tokens of that chunk in proportion to `weights` (equally where
  a chunk's weights sum to 0): the sums per chunk are kept."""
  values = np.asarray(values, np.float64)
  weights = np.asarray(weights, np.float64)
  total = np.bincount(chunks_from, values, minlength=count)
  weight = np.bincount(chunks_to, weights, minlength=count)
  tokens = np.bincount(chunks_to, minlength=count)
  share = np.where(weight[chunks_to] != 0, weights / np.where(weight == 0, 1, weight)[chunks_to],
                   1.0 / np.maximum(tokens[chunks_to], 1))
  return (total[chunks_to] * share).astype(np.float32)
