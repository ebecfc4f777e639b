"""The Task interface: deterministic examples per split, and an exact-match reward.

A problem's split is a pure function of the task name and the prompt (a hash), so the
train and held-out splits never share a prompt whatever the seeds or sizes asked for.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import zlib
from typing import Any

import numpy as np

SPLITS = ("train", "heldout")
ANSWER_DELIMITER = "="  # Every prompt ends with it; the answer follows.
EOS_TEXT = "<eos>"  # How a tokenizer spells end-of-sequence when specials are decoded.


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem: the model sees `prompt` and should complete it with `answer` then eos
  (supervised data may give a multi-turn demonstration: a list of messages)."""

  prompt: str
  answer: Any
  task: str = ""


def split_of(task_name: str, prompt: str, heldout_fraction: float) -> str:
  """'heldout' for a fixed `heldout_fraction` of all prompts (by hash), else 'train'."""
  digest = hashlib.blake2b(f"{task_name}\x00{prompt}".encode(), digest_size=8).digest()
  u = int.from_bytes(digest, "little") / 2.0**64
  return "heldout" if u < heldout_fraction else "train"


def extract_answer(completion: str) -> str:
  """The answer a completion gives: the text after the prompt's delimiter (when the
  completion repeats the prompt), up to the first eos or the newline after it (an instruct
  model may start with one), without outer spaces."""
  completion = completion.split(EOS_TEXT, 1)[0].lstrip().split("\n", 1)[0]  # (first: a later
  if ANSWER_DELIMITER in completion:  # line's "=" is no echo of the prompt)
    completion = completion.split(ANSWER_DELIMITER, 1)[1]
  return completion.strip()


class Task(abc.ABC):
  """A family of synthetic problems with an exact checker."""

  name: str = ""

  def __init__(self, heldout_fraction: float = 0.1):
    if not 0.0 < heldout_fraction < 1.0:
      raise ValueError(f"{self.name}.heldout_fraction: expected a number in (0, 1), got "
                       f"{heldout_fraction!r}")
    self.heldout_fraction = heldout_fraction

  @abc.abstractmethod
  def sample(self, rng: np.random.Generator) -> Example:
    """One random problem from either split."""

  def examples(self, split: str, seed: int, n: int) -> list[Example]:
    """`n` problems of `split`, the same list for the same (split, seed, n); held out, `n`
    distinct ones (a short problem drawn again and again weighed as many: '9+4=' was 7% of
    addition's 200)."""
    if split not in SPLITS:
      raise ValueError(f"{self.name}.examples split: expected one of {SPLITS}, got {split!r}")
    if n < 0:
      raise ValueError(f"{self.name}.examples n: expected >= 0, got {n}")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(self.name.encode()),
                                 SPLITS.index(split)])
    out: list[Example] = []
    seen: set[str] = set()
    distinct = split == "heldout"
    tries = 0
    limit = 1000 * (n + 10)
    while len(out) < n:
      ex = self.sample(rng)
      if split_of(self.name, ex.prompt, self.heldout_fraction) == split and not (
          distinct and ex.prompt in seen):
        out.append(ex)
        seen.add(ex.prompt)
      tries += 1
      if tries > limit:
        raise RuntimeError(f"{self.name}: found only {len(out)} of {n} {'distinct ' * distinct}"
                           f"{split} examples in {tries} draws; the problem space is too "
                           f"small for this split (eval.num_examples asks {n})")
    return out

  def reward(self, target: Example | str, completion: str) -> float:
    """1.0 when the completion's answer equals the expected one exactly, else 0.0."""
    answer = target.answer if isinstance(target, Example) else target
    return 1.0 if extract_answer(completion) == answer else 0.0

  @property
  @abc.abstractmethod
  def max_prompt_chars(self) -> int:
    """Longest prompt this task can produce (sizes sequence and evaluation buffers)."""

  @property
  @abc.abstractmethod
  def max_answer_chars(self) -> int:
    """Longest answer this task can produce (sizes the decoding budget)."""
