"""Continuous batching a sample at a time: every decode row draws one sample of any queued
prompt, and a row whose sample ends takes the next queued sample, whichever prompt it
belongs to. So no row waits for the rest of its prompt's group (the long answers of RL on
reasoning tasks), and a group's samples run side by side on as many rows as are free.

`SampleBatch` keeps ContinuousBatch's interface (add / step / partial / run, prompts and
groups by key) over a ContinuousBatch of one sample per slot: sample j of prompt `key` is
its entry (key, j). The samples of a prompt that start together share one prefill, but
each row holds its own copy of the prompt's keys and values (no prefix read once for a
group's rows: prompts are short beside RL answers), and a sample equals ContinuousBatch's
for the same prompt and seed. A chunk returns once `return_after` samples have ended (or the chunk
steps run out), and the finished rows take new samples then.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Hashable, Sequence

import numpy as np

from inference_workers.continuous import ContinuousBatch
from inference_workers.decoding import Sample
from inference_workers.sampling import SamplingParams


def _by_group(respond, entry, _, tokens, observed):
  """A sample's entry (key, j) asks `respond` as its group's sample j."""
  return respond(entry[0], entry[1], tokens, observed)


@dataclasses.dataclass
class _Group:
  """A queued or running prompt: how many samples it draws, those that have ended (by
  index), and, resumed, the samples another run began (handed back as they are while their
  entry waits)."""
  count: int
  got: dict[int, Sample] = dataclasses.field(default_factory=dict)
  begun: list[Sample] | None = None


class SampleBatch:
  """`rows` decode rows shared by every queued prompt's samples (module docstring). `n`:
  the most samples a prompt draws; `return_after` (0: rows // 8, at least 1) samples
  ending make a chunk return, so the rows they free take new samples; `respond` and the
  other settings (record_routes, chunk_steps, resume, mesh, kv_dtype, ...) are
  ContinuousBatch's."""

  def __init__(self, model, n: int, rows: int, params: SamplingParams = SamplingParams(), *,
               respond: Callable[[Hashable, int, np.ndarray, np.ndarray],
                                 Sequence[int] | None] | None = None,
               return_after: int = 0, **batch_settings):
    if not isinstance(n, int) or n < 1:
      raise ValueError(f"n: expected a positive int (samples per prompt), got {n!r}")
    if not isinstance(rows, int) or rows < 1:
      raise ValueError(f"rows: expected a positive int (decode rows), got {rows!r}")
    if not isinstance(return_after, int) or return_after < 0:
      raise ValueError(f"return_after: expected an int >= 0 (0: rows // 8), got "
                       f"{return_after!r}")
    if respond is not None and not callable(respond):
      raise TypeError(f"respond: expected a callable or None, got {type(respond).__name__}")
    self.n, self.rows = n, rows
    self._inner = ContinuousBatch(
        model, 1, rows, params,
        respond=None if respond is None else functools.partial(_by_group, respond),
        return_after=return_after or max(1, rows // 8), **batch_settings)
    self._groups: dict[Hashable, _Group] = {}  # in the order they were added

  @property
  def waiting(self) -> int:
    """Prompts none of whose samples has started."""
    return len(self._groups) - self.running

  @property
  def running(self) -> int:
    """Prompts with a sample started, whose group has not been returned yet."""
    started = {entry[0] for entry in self._inner.running_keys}
    return sum(bool(g.got) or key in started for key, g in self._groups.items())

  @property
  def free(self) -> int:
    """Prompts' worth of rows that the queued samples do not already claim (a prompt is
    counted free when some of its samples would find a row)."""
    left = self.rows - self._inner.running - self._inner.waiting
    return max(0, -(-left // self.n))

  def add(self, key: Hashable, prompt: Sequence[int], seeds: Sequence[int],
          begun: Sequence[Sample] | None = None) -> None:
    """Queue `prompt` for len(seeds) samples (at most n), as ContinuousBatch.add; each
    sample is queued on its own."""
    seeds = np.asarray(seeds, np.int64).reshape(-1)
    if not 1 <= seeds.size <= self.n:
      raise ValueError(f"seeds: expected 1 to n={self.n} seeds (one per sample), got "
                       f"{seeds.size}")
    if key in self._groups:
      raise ValueError(f"key: {key!r} is queued or running already")
    if begun and len(begun) > seeds.size:
      raise ValueError(f"begun: expected at most {seeds.size} samples (one per seed), got "
                       f"{len(begun)}")
    self._inner.queue([  # every sample checked before any is queued
        self._inner.entry((key, j), prompt, [seed], [begun[j]] if begun and j < len(begun)
                          else None) for j, seed in enumerate(seeds.tolist())])
    self._groups[key] = _Group(int(seeds.size), begun=list(begun) if begun else None)

  def step(self) -> list[tuple[Hashable, list[Sample]]]:
    """Start queued samples on free rows, decode one chunk, return the groups whose
    samples have all ended (each in sample order)."""
    out = []
    for (key, j), (sample,) in self._inner.step():
      group = self._groups[key]
      group.got[j] = sample
      if len(group.got) == group.count:
        del self._groups[key]
        out.append((key, [group.got[i] for i in range(group.count)]))
    return out

  def partial(self) -> list[tuple[Hashable, list[Sample], list[bool]]]:
    """Each running prompt's samples so far and which have finished, as
    ContinuousBatch.partial: an ended one whole, a running one so far, a queued one empty
    (or as another run began it, finished if that run finished it)."""
    running = {entry: (samples[0], done[0]) for entry, samples, done in self._inner.partial()}
    started = {entry[0] for entry in running}
    out = []
    for key, group in self._groups.items():
      if not group.got and key not in started:
        continue
      samples, finished = [], []
      for j in range(group.count):
        if j in group.got:
          sample, done = group.got[j], True
        elif (key, j) in running:
          sample, done = running[(key, j)]
        elif group.begun is not None and j < len(group.begun):  # queued: as begun
          sample = group.begun[j]
          done = bool(sample.finish_reason)
        else:
          sample, done = Sample(np.zeros(0, np.int32), np.zeros(0, np.float32),
                                np.zeros(0, np.float32), ""), False
        samples.append(sample)
        finished.append(done)
      out.append((key, samples, finished))
    return out

  def drop(self, keys: Sequence[Hashable]) -> None:
    """Take the prompts of `keys` out, queued or running, as ContinuousBatch.drop: the
    rows of their samples are free for the next ones."""
    groups = [(key, self._groups.pop(key)) for key in keys if key in self._groups]
    self._inner.drop([(key, j) for key, group in groups for j in range(group.count)])

  def clear(self) -> None:
    """Drop every prompt, running or queued."""
    self._inner.clear()
    self._groups.clear()

  def close(self) -> None:
    self._inner.close()

  def run(self) -> list[tuple[Hashable, list[Sample]]]:
    """Step until nothing waits or runs; every group, in the order they finished."""
    out = []
    while self._groups:
      out.extend(self.step())
    return out
