"""The RL prompt stream: a grain pipeline over the built-in tasks or a JSONL file of
`{"prompt", "answer"[, "task"]}` records (a prompt is text or a list of chat messages),
shuffled by seed, whose iterator state goes in
the trainer's checkpoint so a restarted trainer feeds on from where its checkpoint was.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Sequence

import grain
import numpy as np

from algorithms.verifiers import known_tasks, load_verifiers
from rlax_ps.chat import check_messages
from rlax_ps.tasks import Task

# Records of the built-in stream: one per index, far more than any run asks for.
TASK_STREAM_LEN = 2**31 - 1


class TaskPrompts(Sequence):
  """Random-access train-split examples of weighted tasks: record i depends only on
  (seed, i), so the stream needs no storage and any position can be resumed."""

  def __init__(self, tasks: Sequence[Task], weights: Sequence[float], seed: int):
    p = np.asarray(weights, np.float64)
    if len(tasks) != len(p) or not len(p) or (p < 0).any() or p.sum() <= 0:
      raise ValueError(f"tasks: expected one weight >= 0 per task with a positive sum, got "
                       f"{list(weights)} for {[t.name for t in tasks]}")
    self.tasks, self.cdf, self.seed = list(tasks), np.cumsum(p / p.sum()), int(seed)

  def __len__(self) -> int:
    return TASK_STREAM_LEN

  def __getitem__(self, i: int) -> dict[str, str]:
    u = np.random.default_rng([self.seed & 0xFFFFFFFF, int(i)]).random()
    task = self.tasks[min(int(np.searchsorted(self.cdf, u, side="right")), len(self.tasks) - 1)]
    ex = task.examples("train", seed=zlib.crc32(f"{self.seed}/{i}".encode()), n=1)[0]
    return {"prompt": ex.prompt, "answer": ex.answer, "task": task.name}


def read_text(path: str, field: str = "path") -> str:
  """A local file's text, or an object's at a URL that tensorstore reads (gs://bucket/key,
  s3://, file://): TPU VMs keep data in buckets. ValueError naming `field` when absent."""
  if "://" not in path:
    try:
      with open(path) as f:
        return f.read()
    except FileNotFoundError:
      raise ValueError(f"{field}: no file {path}") from None
  import tensorstore as ts
  try:
    got = ts.KvStore.open(path).result().read("").result()
  except ValueError as e:
    raise ValueError(f"{field}: cannot read {path}: {e}") from None
  if got.state != "value":
    raise ValueError(f"{field}: no object at {path}")
  return got.value.decode("utf-8")


def read_jsonl(path: str, default_task: str = "", known: Sequence[str] | None = None,
               field: str = "data.jsonl") -> list[dict[str, str]]:
  """Records of a JSONL prompt file (a path or a URL: read_text); a bad line raises
  ValueError naming the line and field, as does a task not in `known` (when given), the
  config `field` that named the file too."""
  out = []
  for n, line in enumerate(read_text(path, field).split("\n"), 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    if not isinstance(rec, dict):
      raise ValueError(f"{path}:{n}: expected an object, got {type(rec).__name__}")
    prompt = rec.get("prompt")
    if isinstance(prompt, list):
      prompt = check_messages(prompt, f"{path}:{n}: field 'prompt'")
    elif not isinstance(prompt, str) or not prompt:
      raise ValueError(f"{path}:{n}: field 'prompt': expected a non-empty string or a list "
                       f"of {{'role', 'content'}} messages, got {prompt!r}")
    if not isinstance(rec.get("answer"), str):
      raise ValueError(f"{path}:{n}: field 'answer': expected a string, got "
                       f"{rec.get('answer')!r}")
    task = rec.get("task", default_task)
    if not isinstance(task, str):
      raise ValueError(f"{path}:{n}: field 'task': expected a string, got {task!r}")
    if known is not None and task not in known:
      raise ValueError(f"{field} {path}:{n}: field 'task': expected a built-in task or a "
                       f"registered verifier ({', '.join(known)}; worker.verifiers "
                       f"registers more), got {task!r}")
    out.append({"prompt": prompt, "answer": rec["answer"], "task": task})
  if not out:
    raise ValueError(f"{path}: no prompt records")
  return out


def config_records(config, field: str, path: str) -> list[dict[str, str]]:
  """A JSONL file's records, each task checked against the built-in tasks and the verifiers
  that the config's worker.verifiers registers (imported here)."""
  worker = config.get("worker", {})
  load_verifiers(str(worker.get("verifiers", "")), "worker.verifiers")
  return read_jsonl(path, default_task=str(worker.get("default_task", "")),
                    known=known_tasks(), field=field)


def prompt_dataset(source: Sequence[dict[str, str]], seed: int) -> grain.IterDataset:
  """The shuffled, endlessly repeated stream of `source` (each epoch in a new order)."""
  ds = grain.MapDataset.source(source).shuffle(seed=int(seed) & 0x7FFFFFFF).repeat(None)
  return ds.to_iter_dataset()


class PromptFeed:
  """A position in a prompt stream: `take(n)` yields (index, record); `state()` is what a
  checkpoint keeps, `restore(state)` goes back to it."""

  def __init__(self, source: Sequence[dict[str, str]], seed: int):
    self._dataset = prompt_dataset(source, seed)
    self._it = iter(self._dataset)
    self.position = 0

  def take(self, n: int) -> list[tuple[int, dict[str, str]]]:
    out = [(self.position + i, next(self._it)) for i in range(n)]
    self.position += n
    return out

  def state(self) -> dict[str, Any]:
    return {"position": self.position, "iterator": self._it.get_state()}

  def restore(self, state: dict[str, Any]) -> None:
    try:
      self._it.set_state(state["iterator"])
      self.position = int(state["position"])
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"checkpoint data state: expected {{'position', 'iterator'}}, got "
                       f"{state!r} ({e})") from None
