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


@numba.njit(**_JIT)
def tree_lengths(counts):
  """Huffman code lengths of positive counts, unlimited (a single symbol gets length 1)."""
  if counts.size == 1:
    return np.ones(1, np.int64)
  order = np.argsort(counts, kind="mergesort")
  lengths = np.empty(counts.size, np.int64)
  lengths[order] = _tree_depths(counts[order])
  return lengths


@numba.njit(**_JIT)
def limited_lengths(counts):
  """Huffman lengths of positive counts, at most MAX_LEN: while the longest code is too
  long, the counts are flattened (halved, kept >= 1), which shortens the rare codes."""
  c = counts.astype(np.int64)
  while True:
    lengths = tree_lengths(c)
    if lengths.max() <= MAX_LEN:
      return lengths
    for i in range(c.size):
      c[i] = max(1, c[i] // 2)


def code_lengths(counts: np.ndarray) -> np.ndarray:
  """limited_lengths of counts (at most 2**MAX_LEN of them)."""
  c = np.asarray(counts, np.int64)
  if c.size > 1 << MAX_LEN:
    raise ValueError(f"counts: at most {1 << MAX_LEN} symbols, got {c.size}")
  return limited_lengths(c)


@numba.njit(**_JIT)
def prefix_free(lengths):
  """Whether lengths in [1, MAX_LEN] satisfy the Kraft inequality (exact, in units of
  2**-MAX_LEN)."""
  if lengths.size == 0:
    return False
  total = 0
  for n in lengths:
    if n < 1 or n > MAX_LEN:
      return False
    total += 1 << (MAX_LEN - n)
  return total <= 1 << MAX_LEN


@numba.njit(**_JIT)
def canonical(lengths):
  """Bit-reversed canonical codes, assigned by length, then position (lengths must be
  prefix_free)."""
  codes = np.zeros(lengths.size, np.uint64)
  code, prev = np.uint64(0), 0
  for i in np.argsort(lengths, kind="mergesort"):
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
  if not prefix_free(lengths):
    raise ValueError("code lengths violate the Kraft inequality")
  return canonical(lengths)


@numba.njit(**_JIT)
def fill_table(table, lengths, codes, entries):
  """Writes decode_table's entries into table (zeroed, 2**MAX_LEN entries)."""
  for i in range(lengths.size):
    step = 1 << lengths[i]
    v = np.uint32(entries[i] | (lengths[i] << 24))
    for j in range(codes[i], table.size, step):
      table[j] = v


def decode_table(lengths: np.ndarray, codes: np.ndarray, entries: np.ndarray) -> np.ndarray:
  """Table of 2**MAX_LEN uint32: for every MAX_LEN-bit window whose low bits start with
  the code of symbol i, entries[i] | length << 24; 0 where no code matches."""
  table = np.zeros(1 << MAX_LEN, np.uint32)
  fill_table(table, np.asarray(lengths, np.int64), np.asarray(codes, np.int64),
             np.asarray(entries, np.int64))
  return table
