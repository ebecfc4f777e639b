"""Length-limited canonical Huffman codes over the entropy stage's symbols, LSB first.

The joint Rice + Huffman sections (tensor_codec, mode "joint") code each changed value
with a prefix code instead of rANS: one table lookup and one shift per value, in the same
bit stream as its gap. Codes are at most MAX_LEN bits so that the decoder's table
(2**MAX_LEN entries) stays in L1 cache; they are canonical (only the lengths are sent)
and bit-reversed, so that a decoder reading bits LSB first indexes its table with the
next MAX_LEN bits.
"""

import heapq

import numpy as np

MAX_LEN = 11


def _lengths(counts: np.ndarray) -> np.ndarray:
  """Huffman code lengths of positive counts (a single symbol gets length 1)."""
  m = counts.size
  if m == 1:
    return np.ones(1, np.int64)
  heap = [(int(c), i, (i,)) for i, c in enumerate(counts)]
  heapq.heapify(heap)
  lengths = np.zeros(m, np.int64)
  tie = m
  while len(heap) > 1:
    c1, _, s1 = heapq.heappop(heap)
    c2, _, s2 = heapq.heappop(heap)
    for s in s1 + s2:
      lengths[s] += 1
    heapq.heappush(heap, (c1 + c2, tie, s1 + s2))
    tie += 1
  return lengths


def code_lengths(counts: np.ndarray) -> np.ndarray:
  """Huffman lengths of positive counts, at most MAX_LEN: while the longest code is too
  long, the counts are flattened (halved, kept >= 1), which shortens the rare codes."""
  c = np.asarray(counts, np.int64)
  if c.size > 1 << MAX_LEN:
    raise ValueError(f"counts: at most {1 << MAX_LEN} symbols, got {c.size}")
  while True:
    lengths = _lengths(c)
    if lengths.max() <= MAX_LEN:
      return lengths
    c = np.maximum(1, c // 2)


def _reverse(code: int, length: int) -> int:
  return int(f"{code:0{length}b}"[::-1], 2) if length else 0


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
  """LSB-first (bit-reversed) canonical codes for code lengths (sorted by length, then
  by position). Raises ValueError when the lengths do not form a prefix code."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size == 0 or lengths.min() < 1 or lengths.max() > MAX_LEN:
    raise ValueError(f"code lengths must lie in [1, {MAX_LEN}]")
  if sum(2.0 ** -int(n) for n in lengths) > 1.0:
    raise ValueError("code lengths violate the Kraft inequality")
  codes = np.zeros(lengths.size, np.uint64)
  code, prev = 0, 0
  for i in sorted(range(lengths.size), key=lambda i: (lengths[i], i)):
    code <<= int(lengths[i]) - prev
    prev = int(lengths[i])
    codes[i] = _reverse(code, prev)
    code += 1
  return codes


def decode_table(lengths: np.ndarray, codes: np.ndarray, entries: np.ndarray) -> np.ndarray:
  """Table of 2**MAX_LEN uint32: for every MAX_LEN-bit window whose low bits start with
  the code of symbol i, entries[i] | length << 24; 0 where no code matches."""
  table = np.zeros(1 << MAX_LEN, np.uint32)
  for n, c, e in zip(lengths, codes, entries):
    table[int(c)::1 << int(n)] = np.uint32(int(e) | int(n) << 24)
  return table
