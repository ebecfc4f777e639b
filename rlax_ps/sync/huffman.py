"""Length-limited canonical Huffman codes over the entropy stage's symbols, LSB first.

The joint Rice + Huffman sections (tensor_codec, mode "joint") code each changed value
with a prefix code instead of rANS: one table lookup and one shift per value, in the same
bit stream as its gap. Codes are at most MAX_LEN bits so that the decoder's table
(2**MAX_LEN entries) stays in L1 cache; they are canonical (only the lengths are sent)
and bit-reversed, so that a decoder reading bits LSB first indexes its table with the
next MAX_LEN bits.
"""

import numba
import numpy as np

MAX_LEN = 11
_JIT = dict(nogil=True, cache=True, boundscheck=False)


@numba.njit(**_JIT)
def _tree_depths(weights):
  """Depth of each leaf of the Huffman tree of ascending weights (>= 2 of them), built by
  the two-queue method: leaves in order, then internal nodes in the order they form (both
  queues stay sorted; a tie takes the leaf)."""
  m = weights.size
  w = np.empty(2 * m - 1, np.int64)
  parent = np.empty(2 * m - 1, np.int64)
  w[:m] = weights
  leaf, inner, node = 0, m, m
  for _ in range(m - 1):
    total = 0
    for _ in range(2):
      if leaf < m and (inner >= node or w[leaf] <= w[inner]):
        pick = leaf
        leaf += 1
      else:
        pick = inner
        inner += 1
      parent[pick] = node
      total += w[pick]
    w[node] = total
    node += 1
  depth = np.zeros(2 * m - 1, np.int64)
  for i in range(2 * m - 3, -1, -1):
    depth[i] = depth[parent[i]] + 1
  return depth[:m]


def _lengths(counts: np.ndarray) -> np.ndarray:
  """Huffman code lengths of positive counts (a single symbol gets length 1)."""
  if counts.size == 1:
    return np.ones(1, np.int64)
  order = np.argsort(counts, kind="stable")
  lengths = np.empty(counts.size, np.int64)
  lengths[order] = _tree_depths(counts[order])
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


@numba.njit(**_JIT)
def _canonical(lengths, order):
  """Bit-reversed canonical codes, assigned in `order` (by length, then position)."""
  codes = np.zeros(lengths.size, np.uint64)
  code, prev = np.uint64(0), 0
  for i in order:
    code <<= np.uint64(lengths[i] - prev)
    prev = lengths[i]
    c, r = code, np.uint64(0)
    for _ in range(prev):
      r = (r << np.uint64(1)) | (c & np.uint64(1))
      c >>= np.uint64(1)
    codes[i] = r
    code += np.uint64(1)
  return codes


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
  """LSB-first (bit-reversed) canonical codes for code lengths (sorted by length, then
  by position). Raises ValueError when the lengths do not form a prefix code."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size == 0 or lengths.min() < 1 or lengths.max() > MAX_LEN:
    raise ValueError(f"code lengths must lie in [1, {MAX_LEN}]")
  if np.ldexp(1.0, -lengths).sum() > 1.0:  # exact: at most 2**11 powers of two >= 2**-11
    raise ValueError("code lengths violate the Kraft inequality")
  return _canonical(lengths, np.argsort(lengths, kind="stable"))


@numba.njit(**_JIT)
def _fill(table, lengths, codes, entries):
  for i in range(lengths.size):
    step = 1 << lengths[i]
    v = np.uint32(entries[i] | (lengths[i] << 24))
    for j in range(codes[i], table.size, step):
      table[j] = v


def decode_table(lengths: np.ndarray, codes: np.ndarray, entries: np.ndarray) -> np.ndarray:
  """Table of 2**MAX_LEN uint32: for every MAX_LEN-bit window whose low bits start with
  the code of symbol i, entries[i] | length << 24; 0 where no code matches."""
  table = np.zeros(1 << MAX_LEN, np.uint32)
  _fill(table, np.asarray(lengths, np.int64), np.asarray(codes, np.int64),
        np.asarray(entries, np.int64))
  return table
