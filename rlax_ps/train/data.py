"""SFT batches from the built-in tasks or a prompt file's records: tokenize (prompts as the
model sees them, chat template included), then pack several examples per row (or pad one
per row), with the loss on answer tokens only (a multi-turn demonstration's replies are
context).

The batch for step s is a pure function of (seed, s), so the data position of a run is its
step and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from rlax_ps.tasks import Example, Task
from rlax_ps.tokenizers import Tokenizer


def encode_example(tokenizer: Tokenizer, example: Example) -> tuple[list[int], list[float]]:
  """(ids, loss weights) for the prompt's ids, answer and the token that ends an assistant's
  turn (turn_end_id: the chat template's, e.g. Gemma's <end_of_turn>, else eos); weight 1 on
  both. A multi-turn answer (a list of messages) is laid out as a rollout is sampled: each
  assistant turn and its end (weight 1), each run of replies (tool or user messages, in
  their roles) as `encode_reply` renders it after that end, the framing alone between two
  assistant turns (weight 0: context, as in RL)."""
  end = tokenizer.turn_end_id
  ids = tokenizer.encode_prompt(example.prompt)
  weights = [0.0] * len(ids)
  turns = [example.answer] if isinstance(example.answer, str) else example.answer
  replies: list[dict] = []  # each keeps its role: a user's turn is not a tool's reply
  for i, m in enumerate(turns):
    if isinstance(m, dict) and m["role"] != "assistant":
      replies.append(m)
      continue
    if i:  # the replies since the last turn, or (none) two assistant turns' framing
      fed = tokenizer.encode_reply(replies, end)
      ids, weights, replies = ids + fed, weights + [0.0] * len(fed), []
    said = tokenizer.encode(m if isinstance(m, str) else m["content"]) + [end]
    ids, weights = ids + said, weights + [1.0] * len(said)
  return ids, weights


def pack_rows(encoded: Sequence[tuple[list[int], list[float]]], batch_size: int, seq_len: int,
              pad_id: int, packing: bool = True) -> tuple[dict[str, np.ndarray], int]:
  """Fill `batch_size` rows of `seq_len` next-token pairs from `encoded`, in order.

  With packing, examples go into the current row while they fit (segment ids 1, 2, ...,
  positions restarting at 0 for each); without, one example per row. Returns the batch and
  how many examples it used; rows left empty are all padding.
  """
  n = seq_len + 1  # An example of L ids yields L - 1 next-token pairs.
  ids = np.full((batch_size, n), pad_id, np.int32)
  weights = np.zeros((batch_size, n), np.float32)
  seg = np.zeros((batch_size, n), np.int32)
  pos = np.zeros((batch_size, n), np.int32)
  row, col, segment, used = 0, 0, 0, 0
  for toks, w in encoded:
    if len(toks) > n:
      raise ValueError(f"data.seq_len: an example of {len(toks) - 1} next-token pairs does not "
                       f"fit seq_len={seq_len}; raise seq_len")
    if col > 0 and (not packing or col + len(toks) > n):
      row, col, segment = row + 1, 0, 0
    if row >= batch_size:
      break
    segment += 1
    ids[row, col:col + len(toks)] = toks
    weights[row, col:col + len(toks)] = w
    seg[row, col:col + len(toks)] = segment
    pos[row, col:col + len(toks)] = np.arange(len(toks))
    col += len(toks)
    used += 1
  # Inputs are ids[:-1], targets ids[1:]; a pair counts only inside one segment.
  same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  batch = {
      "tokens": ids[:, :-1],
      "targets": ids[:, 1:],
      "loss_mask": weights[:, 1:] * same,
      "positions": pos[:, :-1],
      "segment_ids": seg[:, :-1],
  }
  return batch, used


def mixed_examples(tasks: Sequence[Task], weights: Sequence[float], split: str, seed: int,
                   n: int) -> list[Example]:
  """`n` examples drawn from `tasks` in proportion to `weights`, shuffled, deterministic."""
  rng = np.random.default_rng(seed & 0xFFFFFFFF)
  p = np.asarray(weights, np.float64)
  counts = rng.multinomial(n, p / p.sum())
  out: list[Example] = []
  for task, c in zip(tasks, counts):
    out.extend(task.examples(split, seed=int(rng.integers(2**31)), n=int(c)))
  order = rng.permutation(len(out))
  return [out[i] for i in order]


def step_seed(seed: int, step: int, chunk: int = 0) -> int:
  """A 31-bit seed for the data of (run seed, step, chunk)."""
  return zlib.crc32(f"{seed}/{step}/{chunk}".encode()) & 0x7FFFFFFF


class _Indices:
  """A sequence of `n` empty records: prompt_dataset's stream of record indices alone."""

  def __init__(self, n: int):
    self.n = n

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, i: int) -> dict:
    return {}


class SFTBatches:
  """The training batches of one run. From the weighted tasks, `batch(step)` is a function of
  the step. From `records` (data.jsonl's, its files mixed as `parts` weighs them), batches
  go through the records epoch by epoch, each epoch in a new order (the RL feed's stream,
  prompts.PromptFeed), every record once an epoch; `state()` is the position a checkpoint
  keeps and `restore(state)` goes back to, so a resumed run goes on where it was."""

  def __init__(self, tasks: Sequence[Task], weights: Sequence[float], tokenizer: Tokenizer,
               *, batch_size: int, seq_len: int, seed: int, packing: bool = True,
               records: Sequence[Example] | None = None,
               parts: Sequence[tuple[int, int, float]] = ()):
    self.records = None if records is None else list(records)
    self.parts = list(parts)  # data.weights' mix of the records' files (file_parts)
    self.feed, self._carry = None, []  # (records) the stream, and what the last batch left
    if self.records:
      from rlax_ps.train.prompts import PromptFeed  # grain: on use
      self.feed = PromptFeed(_Indices(len(self.records)), seed, self.parts)
    self.tasks, self.weights, self.tokenizer = list(tasks), list(weights), tokenizer
    self.batch_size, self.seq_len, self.seed, self.packing = batch_size, seq_len, seed, packing
    if self.records is not None:
      self._check_records()
    else:
      self._check_tasks()
    # Examples to draw per chunk: about one batch worth, estimated from the mean length.
    probe = self._draw(seed, 64)
    mean_len = np.mean([len(encode_example(tokenizer, e)[0]) for e in probe])
    per_row = max(1, int(seq_len // mean_len)) if packing else 1
    self._chunk = max(8, int(batch_size * per_row * 1.3))

  def _check_records(self) -> None:
    if not self.records:
      raise ValueError("data.jsonl: expected at least one record")
    lengths = [len(encode_example(self.tokenizer, e)[0]) - 1 for e in self.records]
    over = [i for i, n in enumerate(lengths) if n > self.seq_len]
    if over:
      raise ValueError(f"data.seq_len: {self.seq_len} is too small for {len(over)} of "
                       f"{len(lengths)} records (the longest has {max(lengths)} next-token "
                       f"pairs, record {over[0] + 1} has {lengths[over[0]]}); raise it")

  def _check_tasks(self) -> None:
    tasks, weights, seq_len = self.tasks, self.weights, self.seq_len
    if len(tasks) != len(weights) or not tasks:
      raise ValueError(f"tasks: expected one weight per task and at least one task, got "
                       f"{len(tasks)} tasks and {len(weights)} weights")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
      raise ValueError(f"task weights: expected >= 0 with a positive sum, got {list(weights)}")
    # A character is at most one token of the built-in tasks' text; what the tokenizer adds
    # around an example (a chat template's turns, eos) is measured on an empty one.
    longest = max(t.max_prompt_chars + t.max_answer_chars
                  + len(encode_example(self.tokenizer, Example("", "", t.name))[0])
                  for t in tasks) - 1
    if longest > seq_len:
      raise ValueError(f"data.seq_len: expected >= {longest} so the longest example of "
                       f"{[t.name for t in tasks]} fits, got {seq_len}")

  def _draw(self, seed: int, n: int) -> list[Example]:
    if self.records is not None:  # (the chunk size's probe): the first n records
      return self.records[:n]
    return mixed_examples(self.tasks, self.weights, "train", seed, n)

  def state(self) -> dict:
    """The records' stream position (a checkpoint's; {} from the tasks)."""
    return {} if self.feed is None else {**self.feed.state(), "carry": list(self._carry)}

  def restore(self, state: dict) -> None:
    """Back to a position state() gave (records only)."""
    if self.feed is not None:
      self.feed.restore(state)
      self._carry = [int(i) for i in state.get("carry", [])]

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """The next batch of the records' stream, or the tasks' batch of `step`."""
    if self.feed is not None:
      return self._records_batch()
    encoded: list = []
    chunk = 0
    while True:
      examples = self._draw(step_seed(self.seed, step, chunk), self._chunk)
      encoded.extend(encode_example(self.tokenizer, e) for e in examples)
      batch, used = pack_rows(encoded, self.batch_size, self.seq_len, self.tokenizer.pad_id,
                              self.packing)
      if used < len(encoded):  # Every row is full.
        return batch
      chunk += 1

  def _records_batch(self) -> dict[str, np.ndarray]:
    """Records from the stream, those the last batch left first, until every row is full;
    the ones left over wait for the next batch (none is skipped)."""
    taken = list(self._carry)
    encoded = [encode_example(self.tokenizer, self.records[i]) for i in taken]
    while True:
      more = [int(r["record"]) for _, r in self.feed.take(self._chunk)]
      taken += more
      encoded += [encode_example(self.tokenizer, self.records[i]) for i in more]
      batch, used = pack_rows(encoded, self.batch_size, self.seq_len, self.tokenizer.pad_id,
                              self.packing)
      if used < len(encoded):  # every row is full
        self._carry = taken[used:]
        return batch
