"""Block schedules for the packed shared-prompt kernels.

A schedule lists only the (query block, key block) pairs the layout can make
non-zero, so fully masked blocks cost no grid step at all. The forward and dQ
pass visit, per query block, the prompt key blocks and then the query's own
response blocks; the dK/dV pass visits, per key block, every query block that
reads it: for a prompt key block that is the prompt's own queries followed by
all N responses, the sequential reduction that sums the prompt gradients.
Lengths are dynamic, so each pair also gets a per-row liveness flag; a dead
pair re-uses the previous block index so that no DMA is issued for it.

A sliding window (Geometry.window, in RoPE positions) removes the pairs that no
length can bring within the window from the schedule, and marks the pairs that
the row's lengths put wholly outside it as dead.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from rlax_ps.models.attention import check_softcap


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query/key block lengths of the training kernels (multiples of 128 on TPU)."""
  block_q: int = 128
  block_kv: int = 128

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      val = getattr(self, name)
      if not isinstance(val, int) or val < 1:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {val!r}")

  @property
  def region_multiple(self) -> int:
    return math.lcm(self.block_q, self.block_kv)


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static shape of an aligned packed row: capacities are block multiples."""
  num_responses: int
  prompt_capacity: int
  response_capacity: int
  block_q: int
  block_kv: int
  window: int | None = None  # sliding window in positions; None: full causal
  softcap: float | None = None  # logit cap softcap * tanh(s / softcap); None: no cap

  def __post_init__(self):
    if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
      raise ValueError(f"window: expected a positive int or None, got {self.window!r}")
    check_softcap(self.softcap)
    for cap in (self.prompt_capacity, self.response_capacity):
      for blk in (self.block_q, self.block_kv):
        if cap % blk:
          raise ValueError(f"region capacity {cap} is not a multiple of block size {blk}")

  @property
  def total_len(self) -> int:
    return self.prompt_capacity + self.num_responses * self.response_capacity

  def region_start(self, region):
    """Global start of region 0 (prompt) or i + 1 (response i); works on scalars."""
    return jnp.where(region == 0, 0,
                     self.prompt_capacity + (region - 1) * self.response_capacity)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Static pair list (numpy, length T) in visiting order."""
  q_block: np.ndarray
  k_block: np.ndarray
  q_region: np.ndarray
  k_region: np.ndarray
  first: np.ndarray  # first pair of its output block (init the accumulator)
  last: np.ndarray  # last pair of its output block (write the output)

  @property
  def length(self) -> int:
    return int(self.q_block.shape[0])


def _may_reach(g: Geometry, qb: int, kb: int, q_reg: int, k_reg: int) -> bool:
  """Whether some lengths put a key of block kb within the window of a query of block qb."""
  if g.window is None:
    return True
  start = lambda r: 0 if r == 0 else g.prompt_capacity + (r - 1) * g.response_capacity
  q_first = qb * g.block_q - start(q_reg)
  k_last = kb * g.block_kv - start(k_reg) + g.block_kv - 1
  if q_reg == k_reg:  # same region: a static distance
    return q_first - k_last < g.window
  # Response query (position prompt_len + t) and prompt key (< prompt_len): at least t + 1.
  return q_first + 1 < g.window


def _pairs_to_schedule(pairs, out_index: int, g: Geometry) -> Schedule:
  pairs = [p for p in pairs if _may_reach(g, *p)]
  arr = np.asarray(pairs, np.int32).reshape(-1, 4)
  out = arr[:, out_index]
  first = np.ones(len(arr), np.int32)
  first[1:] = out[1:] != out[:-1]
  last = np.ones(len(arr), np.int32)
  last[:-1] = out[:-1] != out[1:]
  return Schedule(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], first, last)


def forward_schedule(g: Geometry) -> Schedule:
  """Pairs ordered by query block: prompt key blocks, then the own response's."""
  bq, bk, n = g.block_q, g.block_kv, g.num_responses
  nqp, nqr = g.prompt_capacity // bq, g.response_capacity // bq
  nkp, nkr = g.prompt_capacity // bk, g.response_capacity // bk
  pairs = []
  for qb in range(nqp):
    for kb in range(min(nkp, (qb * bq + bq - 1) // bk + 1)):
      pairs.append((qb, kb, 0, 0))
  for i in range(n):
    for t in range(nqr):
      qb = nqp + i * nqr + t
      for kb in range(nkp):
        pairs.append((qb, kb, i + 1, 0))
      for r in range(min(nkr, (t * bq + bq - 1) // bk + 1)):
        pairs.append((qb, nkp + i * nkr + r, i + 1, i + 1))
  return _pairs_to_schedule(pairs, 0, g)


def dkv_schedule(g: Geometry) -> Schedule:
  """Pairs ordered by key block: a prompt key block sees its prompt queries and
  then every response's queries (the sum over N), a response key block only
  its own response's later queries."""
  bq, bk, n = g.block_q, g.block_kv, g.num_responses
  nqp, nqr = g.prompt_capacity // bq, g.response_capacity // bq
  nkp, nkr = g.prompt_capacity // bk, g.response_capacity // bk
  pairs = []
  for kb in range(nkp):
    for qb in range(nqp):
      if qb * bq + bq - 1 >= kb * bk:
        pairs.append((qb, kb, 0, 0))
    for i in range(n):
      for t in range(nqr):
        pairs.append((nqp + i * nqr + t, kb, i + 1, 0))
  for i in range(n):
    for r in range(nkr):
      for t in range(nqr):
        if t * bq + bq - 1 >= r * bk:
          pairs.append((nqp + i * nqr + t, nkp + i * nkr + r, i + 1, i + 1))
  return _pairs_to_schedule(pairs, 1, g)


def region_lens(prompt_lens: jax.Array, response_lens: jax.Array) -> jax.Array:
  """[B, 1 + N] int32: real length of region 0 (prompt) and each response."""
  return jnp.concatenate([prompt_lens[:, None], response_lens], axis=1).astype(jnp.int32)


def liveness(sched: Schedule, g: Geometry, lens: jax.Array) -> jax.Array:
  """[B, T] bool: the pair's query block and key block both hold a real token (and, with a
  window, the block's first real query is within the window of its last real key)."""
  start = lambda r: np.where(r == 0, 0, g.prompt_capacity + (r - 1) * g.response_capacity)
  q_local = sched.q_block * g.block_q - start(sched.q_region)
  k_local = sched.k_block * g.block_kv - start(sched.k_region)
  q_len = lens[:, sched.q_region]
  k_len = lens[:, sched.k_region]
  live = (jnp.asarray(q_local)[None] < q_len) & (jnp.asarray(k_local)[None] < k_len)
  if g.window is None:
    return live
  # Position of a region's local index 0: 0 in the prompt, prompt_len in every response.
  offset = lambda r: jnp.where(jnp.asarray(r == 0)[None], 0, lens[:, :1])
  q_first = jnp.asarray(q_local)[None] + offset(sched.q_region)
  k_last = jnp.minimum(jnp.asarray(k_local + g.block_kv - 1)[None], k_len - 1)
  k_last = k_last + offset(sched.k_region)
  return live & (q_first - k_last < g.window)


def fill_dead(blocks: np.ndarray, live: jax.Array) -> jax.Array:
  """[B, T] block index to fetch: a dead pair repeats the last live pair's block
  (or the first live one's, before any), so the pipeline skips its copy."""
  t = blocks.shape[0]
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  last_live = jax.lax.cummax(jnp.where(live, pos, -1), axis=1)
  first_live = jnp.argmax(live, axis=1).astype(jnp.int32)[:, None]
  src = jnp.where(last_live >= 0, last_live, first_live)
  return jnp.asarray(blocks)[src].astype(jnp.int32)
