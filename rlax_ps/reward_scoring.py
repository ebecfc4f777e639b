"""A reward model scoring conversations, as it reads them, in padded batches: the workers'
rewards (beside the policy, on the worker's devices) and the trainer's held-out score.

A reward model folder with its own tokenizer (tokenizer.json) reads the conversation
re-rendered by its chat template (the prompt's messages, then the policy's turns and any
environment replies), or, without a template, the prompt's text and the completion; one
without a tokenizer shares the policy's, and reads the very ids the policy saw.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from rlax_ps import chat
from rlax_ps import sharding as shd
from rlax_ps.models.reward_model import RewardModel, load_reward_model, pooled_index
from rlax_ps.tokenizers import HFTokenizer, tokenizer_file

_MIN_LENGTH = 16  # the shortest padded length: rows are padded to powers of two from here


@nnx.jit
def _scores(model: RewardModel, tokens, last):
  return model(tokens, last)[:, 0]


def prompt_messages(prompt_text: str | list, metadata: dict[str, str]) -> list[dict[str, Any]]:
  """The prompt as chat messages: the trainer's raw prompt (metadata "prompt": JSON text
  or messages) where it rendered it, else its text as one user message (a list of
  messages: those)."""
  raw = chat.raw_prompt(prompt_text, metadata)
  return [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)


class RewardScorer:
  """A reward model loaded once (`path`: an HF `*ForSequenceClassification` folder, params
  in `dtype`), scoring up to `batch_size` sequences per call. On a `mesh` (the worker's data x
  tensor mesh) its weights split as the policy's do and each batch's rows over data, so a
  reward model too large for one device fits, and every device scores."""

  def __init__(self, path: str, policy_tokenizer: Any, dtype: str = "bfloat16",
               batch_size: int = 16, *, mesh: jax.sharding.Mesh | None = None):
    self.model = load_reward_model(path, dtype, mesh=mesh)
    self.mesh = mesh
    self.batch_size = batch_size
    self.tokenizer: HFTokenizer | None = None
    if tokenizer_file(path):
      template = "auto" if _has_template(path) else ""
      self.tokenizer = HFTokenizer(path, chat_template=template)
    elif self.model.config.vocab_size < policy_tokenizer.vocab_size:
      raise ValueError(f"worker.reward_model: {path!r} has no tokenizer.json, so it reads the "
                       f"policy's ids, but its vocab_size {self.model.config.vocab_size} is "
                       f"smaller than the policy tokenizer's {policy_tokenizer.vocab_size}")
    self._pad = 0 if self.model.pad_id is None else self.model.pad_id

  def encode(self, messages: list[dict[str, Any]], prompt_text: str, response_text: str,
             policy_ids: Sequence[int]) -> list[int]:
    """The ids the reward model scores for one sample: `messages` (the prompt's, then the
    sample's turns) under its template, else `prompt_text + response_text` in its
    tokenizer (with its post-processor's special tokens), else `policy_ids` (prompt and sample as the policy saw them)."""
    tok = self.tokenizer
    if tok is None:
      return [int(i) for i in policy_ids]
    if tok.chat_template is None:  # as its AutoTokenizer encodes the text
      return tok.encode_prompt(prompt_text + response_text)
    return tok.encode_conversation(messages)

  def scores(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """Float32 scores [n] of the sequences (label 0), `batch_size` at a time, each batch
    padded to a power of two of rows and of tokens so that few programs compile."""
    out = []
    data = 1 if self.mesh is None else self.mesh.shape.get("data", 1)
    for start in range(0, len(sequences), self.batch_size):
      part = sequences[start:start + self.batch_size]
      rows = -(-_bucket(len(part), 1) // data) * data
      length = _bucket(max(len(s) for s in part), _MIN_LENGTH)
      tokens = np.full((rows, length), self._pad, np.int32)
      last = np.zeros(rows, np.int32)
      for i, ids in enumerate(part):
        tokens[i, :len(ids)] = ids
        last[i] = pooled_index(ids, self.model.pad_id)
      out.append(np.asarray(shd.to_host(self._score(tokens, last)))[:len(part)])
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


  def _score(self, tokens: np.ndarray, last: np.ndarray):
    if self.mesh is None:
      return _scores(self.model, tokens, last)
    rows = NamedSharding(self.mesh, P("data"))
    with jax.set_mesh(self.mesh):
      return _scores(self.model, jax.device_put(tokens, rows), jax.device_put(last, rows))


def _bucket(n: int, floor: int) -> int:
  return max(floor, 1 << max(0, n - 1).bit_length())


def _has_template(path: str) -> bool:
  try:
    chat.read_template("auto", path)
  except ValueError:
    return False
  return True
