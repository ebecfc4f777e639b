"""The RL prompt stream: a grain pipeline over the built-in tasks or JSONL or Parquet files
of `{"prompt", "answer"[, "task"]}` records (a prompt is text or a list of chat messages),
shuffled by seed (several files mixed in the proportions data.weights gives), whose
iterator state goes in the trainer's checkpoint so a restarted trainer feeds on from where
its checkpoint was.
"""

from __future__ import annotations

import array
import json
import math
import operator
import os
import reprlib
import zlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import grain
import numpy as np

from algorithms.verifiers import REWARD_MODEL_TASK, known_tasks, load_verifiers, reference_check
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


# A URL's object is read in byte ranges of this size: a large file is never held whole.
URL_CHUNK_BYTES = 16 << 20
# Parquet rows are decoded this many at a time.
PARQUET_BATCH_ROWS = 4096


def read_bytes(path: str, field: str = "path") -> bytes:
  """A local file's bytes, or an object's at a URL that tensorstore reads (gs://bucket/key,
  s3://, file://): TPU VMs keep data in buckets. ValueError naming `field` when absent."""
  if "://" not in path:
    with _open_local(path, field) as f:
      return f.read()
  return b"".join(_url_chunks(path, field))


def _open_local(path: str, field: str):
  try:
    return open(path, "rb")
  except FileNotFoundError:
    raise ValueError(f"{field}: no file {path}") from None
  except OSError as e:  # a folder, no permission
    raise ValueError(f"{field}: cannot read {path}: {e.strerror}") from None


def _url_chunks(path: str, field: str) -> Iterator[bytes]:
  """The bytes of the object at `path`, in order, URL_CHUNK_BYTES at a time."""
  import tensorstore as ts
  try:
    store = ts.KvStore.open(path).result()
  except ValueError as e:
    raise ValueError(f"{field}: cannot read {path}: {e}") from None
  offset, size = 0, URL_CHUNK_BYTES
  while True:
    try:
      got = store.read("", byte_range=slice(offset, offset + size)).result()
    except ValueError as e:  # a range past the end: the rest of the object
      if "OUT_OF_RANGE" not in str(e):
        raise ValueError(f"{field}: cannot read {path}: {e}") from None
      got = store.read("", byte_range=slice(offset, None)).result()
    if got.state != "value":
      raise ValueError(f"{field}: no object at {path}")
    yield got.value
    if len(got.value) < size:
      return
    offset += size


def _lines(path: str, field: str) -> Iterator[bytes]:
  """The lines of a local file or of the object at a URL, read as they are iterated."""
  if "://" not in path:
    with _open_local(path, field) as f:
      yield from f
    return
  pending = b""
  for chunk in _url_chunks(path, field):
    lines = chunk.split(b"\n")
    lines[0] = pending + lines[0]
    pending = lines.pop()
    yield from lines
  if pending:
    yield pending


def _parquet_rows(path: str, field: str) -> Iterator[dict[str, Any]]:
  """The rows of a Parquet file, decoded PARQUET_BATCH_ROWS at a time (a URL's object is
  fetched whole: Parquet is read from its end)."""
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    raise ValueError(f"{field}: reading Parquet needs pyarrow: pip install "
                     f"'rlax-ps[parquet]'") from None
  source = path if "://" not in path else pa.BufferReader(read_bytes(path, field))
  try:
    with pq.ParquetFile(source) as table:
      for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        yield from batch.to_pylist()
  except FileNotFoundError:
    raise ValueError(f"{field}: no file {path}") from None
  except OSError as e:  # a folder (a Spark or datasets one: name its files), no permission
    raise ValueError(f"{field}: cannot read {path}: {e}") from None
  except pa.ArrowException as e:
    raise ValueError(f"{field}: {path} is not a readable Parquet file: {e}") from None


def _raw_records(path: str, field: str) -> Iterator[tuple[str, Any]]:
  """(where, record) of each JSONL line, or of each row of a `.parquet` file (the format
  verl and Hugging Face datasets keep prompts in), read as they are iterated."""
  if path.endswith(".parquet"):
    for n, rec in enumerate(_parquet_rows(path, field)):
      yield f"{path}:row {n}", rec
    return
  for n, raw in enumerate(_lines(path, field), 1):
    if n == 1:
      raw = raw.removeprefix(b"\xef\xbb\xbf")
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}:{n}: not UTF-8: {e}") from None
    if not line.strip():
      continue
    try:
      # an error's column is then the line's own; a float keeps its text (_Number)
      rec = json.loads(line.rstrip("\r\n"), parse_float=_Number)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    yield f"{path}:{n}", rec


class _Number(float):
  """A JSON float that keeps its text as written: an answer 0.00001 or 2.50 is sent and
  trained as that, not as Python's repr (1e-05, 2.5)."""

  def __new__(cls, text: str):
    number = super().__new__(cls, text)
    number.text = text
    return number


def _number_text(x: int | float) -> str:
  """A number answer as text: a JSON float as written, another (Parquet's) without an
  exponent (1e-05 -> 0.00001, 1e16 -> 10000000000000000, 1000.0 -> 1000)."""
  if isinstance(x, _Number):
    return x.text
  return np.format_float_positional(x, trim="-") if isinstance(x, float) else str(x)


def _lookup(rec: dict, key: str) -> Any:
  """rec's value at a dotted key ("reward_model.ground_truth"), None when absent."""
  for part in key.split("."):
    if not isinstance(rec, dict):
      return None
    rec = rec.get(part)
  return rec


def conversation_answer(messages: Any, field: str) -> list[dict[str, str]]:
  """A multi-turn demonstration: the policy's turns ("assistant" messages), the first and
  the last among them, with the environment's replies ("tool" or "user" messages) between;
  ValueError naming `field` otherwise."""
  messages = check_messages(messages, field)
  roles = [m["role"] for m in messages]
  bad = [i for i, r in enumerate(roles) if r not in ("assistant", "tool", "user")]
  if bad or roles[0] != "assistant" or roles[-1] != "assistant":
    raise ValueError(f"{field}: expected assistant turns, the first and the last, with tool "
                     f"or user replies between, got roles {roles}")
  return messages


_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 80
_QUOTE.maxlist = _QUOTE.maxtuple = _QUOTE.maxdict = 4
_QUOTE.maxlevel = 2


def quoted(value: Any) -> str:
  """`value` as an error message shows it: its repr, cut short (a bad field may hold a whole
  document: the message stays a line)."""
  return _QUOTE.repr(value)


def _check_encodable(value: Any, where: str, key: str) -> None:
  """ValueError naming the record and key when a string in `value` is not valid Unicode (a
  lone surrogate such as JSON's "\\ud83d" of a cut emoji): it could not be sent or tokenized."""
  texts = [value] if isinstance(value, str) else [m["content"] for m in value]
  for text in texts:
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ValueError(f"{where}: field {key!r}: not valid Unicode: {e.reason} at "
                       f"{text[max(0, e.start - 10):e.end + 10]!r}") from None


def iter_prompts(path: str, default_task: str = "", known: Sequence[str] | None = None,
                 field: str = "data.jsonl", *, prompt_key: str = "prompt",
                 answer_key: str = "answer", task_key: str = "task",
                 demonstrations: bool = False,
                 check: Callable[[dict[str, Any]], None] | None = None,
                 sizes: list[int] | None = None) -> Iterator[dict[str, Any]]:
  """The `{"prompt", "answer", "task"}` records of JSONL or Parquet prompt files (`path`: one
  path or URL, or several joined by commas, read in order), read at the given
  (dotted) keys; a record without a task takes `default_task`. A bad record raises
  ValueError naming its file, line or row and key, as does a task not in `known` (when
  given), with the config `field` that named the file. `demonstrations` (supervised
  data): an answer may also be a multi-turn demonstration (`conversation_answer`). An
  empty `answer_key` reads prompts alone (answer ""): for a reward model to score.
  `check(record)`: a further check of each record, whose ValueError is raised naming the
  record's file and line. `sizes` gets each file's count of records as its last is read.
  Records are read as they are iterated, none held."""
  count = 0
  for where, rec in _each_file(path, field, sizes):
    if not isinstance(rec, dict):
      raise ValueError(f"{where}: expected an object, got {type(rec).__name__}")
    prompt = _lookup(rec, prompt_key)
    if isinstance(prompt, (list, tuple)):
      prompt = check_messages(prompt, f"{where}: field {prompt_key!r}")
    elif not isinstance(prompt, str) or not prompt.strip():
      raise ValueError(f"{where}: field {prompt_key!r}: expected a non-empty string or a list "
                       f"of {{'role', 'content'}} messages, got {quoted(prompt)}")
    task = _lookup(rec, task_key)
    task = default_task if task is None else task
    if not isinstance(task, str):
      raise ValueError(f"{where}: field {task_key!r}: expected a string, got {quoted(task)}")
    answer = _lookup(rec, answer_key) if answer_key else ""
    if answer is None and task == REWARD_MODEL_TASK:  # a reward model needs no answer
      answer = ""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
      if not math.isfinite(answer):  # JSON's NaN / 1e400: "nan" / "inf" matches no answer
        raise ValueError(f"{where}: field {answer_key!r}: expected a string or a finite "
                         f"number, got {float(answer)!r}")
      answer = _number_text(answer)
    if isinstance(answer, (list, tuple)) and demonstrations:
      answer = conversation_answer(answer, f"{where}: field {answer_key!r}")
    elif not isinstance(answer, str):
      also = (" (a list of messages is a multi-turn demonstration: the data.jsonl of "
              "`rlax-ps sft` takes those; a held-out or RL record's answer is the one "
              "reference its verifier checks)" if isinstance(answer, (list, tuple)) else "")
      raise ValueError(f"{where}: field {answer_key!r}: expected a string, got "
                       f"{quoted(answer)}{also}")
    if known is not None and task not in known:
      raise ValueError(f"{field} {where}: field {task_key!r}: expected a built-in task or a "
                       f"registered verifier ({', '.join(known)}; worker.verifiers "
                       f"registers more), got {task!r}")
    _check_encodable(prompt, where, prompt_key)
    _check_encodable(answer, where, answer_key)
    record = {"prompt": prompt, "answer": answer, "task": task}
    if check is not None:
      try:
        check(record)
      except ValueError as e:
        raise ValueError(f"{field} {where}: {e}") from None
    count += 1
    yield record
  if not count:
    raise ValueError(f"{field}: {path}: no prompt records")


def prompt_key(prompt: Any) -> str:
  """A prompt (text, or a list of messages) as a string to compare prompts by."""
  return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def heldout_overlap(heldout_prompts: Iterable[Any], prompts: Iterable[Any]) -> str | None:
  """The warning for data.heldout_jsonl prompts that data.jsonl trains on too (their score
  is a training score; overfitting a small set on purpose is one reason), or None."""
  held = {prompt_key(p) for p in heldout_prompts}
  both = {k for k in map(prompt_key, prompts) if k in held}
  if not both:
    return None
  return (f"data.heldout_jsonl: {len(both)} of its {len(held)} prompts are also in data.jsonl "
          f"(e.g. {quoted(min(both))}): their held-out score is a training score")


def data_files(path: str) -> list[str]:
  """The files (paths or URLs) of a data.jsonl setting: several are joined by commas; a
  local path's ~ is the home folder (the shell leaves `--config.data.jsonl=~/x` as it is)."""
  return [p if "://" in p else os.path.expanduser(p)
          for p in (p.strip() for p in path.split(",")) if p]


def file_weights(data) -> tuple[float, ...]:
  """data.weights: one weight >= 0 a file of data.jsonl (comma-joined numbers, or a list),
  with a positive sum: the share of prompts drawn from each file; () when unset (the files'
  records as one set). ValueError naming the field otherwise."""
  spec = data.get("weights", "") or ""
  if not isinstance(spec, str):
    spec = ",".join(str(w) for w in spec)
  if not spec.strip():
    return ()
  files = data_files(str(data.get("jsonl", "")))
  try:
    weights = tuple(float(w) for w in spec.split(","))
  except ValueError:
    weights = ()
  if (len(weights) != len(files) or not all(0 <= w < float("inf") for w in weights)
      or not sum(weights) > 0):
    raise ValueError(f"data.weights: expected one weight >= 0 for each of the {len(files)} "
                     f"file(s) of data.jsonl {files}, with a positive sum, got {spec!r}")
  return weights


def file_parts(sizes: Sequence[int], weights: Sequence[float],
               files: Sequence[str] = ()) -> list[tuple[int, int, float]]:
  """(first record, end, weight) of each file whose records, `sizes` of them, are held one
  file after another (`files`: their names, for the error of a weighed file without any)."""
  empty = [f for f, n, w in zip(files or [""] * len(sizes), sizes, weights) if not n and w]
  if empty:
    raise ValueError(f"data.weights: {empty[0]} has no prompt records to draw; expected a "
                     f"weight of 0 for it")
  ends = np.cumsum(sizes, dtype=np.int64)
  return [(int(end - n), int(end), float(w)) for n, end, w in zip(sizes, ends, weights)]


def _each_file(path: str, field: str, sizes: list[int] | None) -> Iterator[tuple[str, Any]]:
  """(where, record) of each file of `path` in order (_raw_records); `sizes` (if given) gets
  each file's count as its last record is read."""
  for one in data_files(path):
    n = 0
    for n, item in enumerate(_raw_records(one, field), 1):
      yield item
    if sizes is not None:
      sizes.append(n)


def read_prompts(path: str, default_task: str = "", known: Sequence[str] | None = None,
                 field: str = "data.jsonl", **kwargs) -> list[dict[str, Any]]:
  """All the records of iter_prompts (same arguments), in a list."""
  return list(iter_prompts(path, default_task, known, field, **kwargs))


def iter_config_records(config, field: str, path: str,
                        check: Callable[[dict[str, Any]], None] | None = None,
                        sizes: list[int] | None = None) -> Iterator[dict[str, Any]]:
  """The records of a prompt file the config names, read at its data.*_key keys, each task
  (else worker.default_task, or math in a config without workers) checked against the
  built-in tasks and the verifiers that worker.verifiers registers (imported here), each
  answer by its verifier's check_reference, and each record by `check` (iter_prompts); the checks of the whole file's tasks follow its
  last record. One at a time: a check of a large file holds none of them."""
  worker = config.get("worker", {})
  data = config.get("data", {})
  load_verifiers(str(worker.get("verifiers", "")), "worker.verifiers")
  answer_key = str(data.get("answer_key", "answer"))

  def checked(record: dict[str, Any]) -> None:
    check_reference = reference_check(record["task"]) if answer_key else None
    if check_reference is not None:  # (its verifier would score every sample 0)
      try:
        check_reference(record["answer"])
      except Exception as e:  # noqa: BLE001 - the check may be the user's code
        said = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"field {answer_key!r}: not a reference the {record['task']!r} "
                         f"verifier can score against: {said}") from None
    if check is not None:
      check(record)

  tasks = set()
  for record in iter_prompts(path, default_task=str(worker.get("default_task", "math")),
                             known=known_tasks(), field=field,
                             prompt_key=str(data.get("prompt_key", "prompt")),
                             answer_key=answer_key,
                             task_key=str(data.get("task_key", "task")), check=checked,
                             sizes=sizes):
    tasks.add(record["task"])
    yield record
  if "worker" in config and not worker.get("reward_model", "") and REWARD_MODEL_TASK in tasks:
    raise ValueError(f"worker.reward_model: {field} has prompts of task {REWARD_MODEL_TASK!r}; "
                     f"expected a reward model checkpoint to score them, got ''")
  if field == "data.heldout_jsonl" and not data.get("answer_key", "answer"):
    unscored = sorted(tasks - {REWARD_MODEL_TASK})
    if unscored:
      raise ValueError(f"data.heldout_jsonl: held-out records of task(s) {unscored} are scored "
                       f"against their answers, but data.answer_key is '' (prompts alone); "
                       f"give them task {REWARD_MODEL_TASK!r} (scored by worker.reward_model) "
                       f"or an answer key")


def config_records(config, field: str, path: str,
                   check: Callable[[dict[str, Any]], None] | None = None
                   ) -> list[dict[str, Any]]:
  """All the records of iter_config_records (same arguments), in a list."""
  return list(iter_config_records(config, field, path, check))


_LINE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_LINE_VALUE = json.JSONDecoder().raw_decode  # (a line's value, where it ends)


def record_line(record: dict[str, Any]) -> bytes:
  """A record's prompt, answer and task as one line of compact UTF-8 JSON (a JSON string
  escapes every newline): what PromptRecords holds of it."""
  return (_LINE_JSON([record["prompt"], record["answer"], record["task"]]) + "\n").encode()


class PromptRecords(Sequence):
  """`{"prompt", "answer", "task"}` records held as one buffer of their lines (record_line)
  and where each ends, each decoded when it is asked for: random access for the shuffled
  feed at a fraction of the memory of as many dicts (a large prompt file is held whole)."""

  def __init__(self, records: Iterable[dict[str, Any]]):
    self._lines, self._ends = bytearray(), array.array("q")
    for record in records:
      self._lines += record_line(record)
      self._ends.append(len(self._lines))

  def __len__(self) -> int:
    return len(self._ends)

  def __getitem__(self, i: int) -> dict[str, Any]:
    i = operator.index(i)
    if not -len(self) <= i < len(self):
      raise IndexError(f"record {i} of {len(self)}")
    i %= len(self)
    line = self._lines[self._ends[i - 1] if i else 0:self._ends[i]].decode()
    (prompt, answer, task), _ = _LINE_VALUE(line)
    return {"prompt": prompt, "answer": answer, "task": task}

  def __iter__(self) -> Iterator[dict[str, Any]]:
    return (self[i] for i in range(len(self)))


# How an unweighted stream's order follows from the seed. 1: the seed itself, as grain's
# shuffle seed; grain orders epoch e by that seed + e, so seed s + 1's epochs were seed s's
# from its second on. 2: a hash of the seed. A checkpoint's feed state names its order.
ORDER = 2


def shuffle_seed(seed: int, order: int = ORDER) -> int:
  """grain's shuffle seed of an unweighted stream for `seed` (ORDER)."""
  if order == 1:
    return int(seed) & 0x7FFFFFFF
  return zlib.crc32(f"{int(seed)}/order".encode()) & 0x7FFFFFFF


def prompt_dataset(source: Sequence[dict[str, str]], seed: int,
                   parts: Sequence[tuple[int, int, float]] = (),
                   order: int = ORDER) -> grain.IterDataset:
  """The shuffled, endlessly repeated stream of `source` (each epoch in a new order), each
  record with its index in `source` under "record". `parts` (file_parts): each file's
  records shuffled and repeated on their own, mixed in proportion to their weights.
  `order`: ORDER, or an older one that a checkpoint's feed state names."""
  if not parts:
    ds = grain.MapDataset.range(len(source)).shuffle(
        seed=shuffle_seed(seed, order)).repeat(None)
  else:
    mixed = [(grain.MapDataset.range(a, b).shuffle(
                  seed=zlib.crc32(f"{seed}/{k}".encode()) & 0x7FFFFFFF).repeat(None), w)
             for k, (a, b, w) in enumerate(parts) if w > 0]
    ds = grain.MapDataset.mix([d for d, _ in mixed], [w for _, w in mixed])
  return ds.map(lambda i: {**source[i], "record": int(i)}).to_iter_dataset()


class PromptFeed:
  """A position in a prompt stream: `take(n)` yields (index, record); `state()` is what a
  checkpoint keeps, `restore(state)` goes back to it."""

  def __init__(self, source: Sequence[dict[str, str]], seed: int,
               parts: Sequence[tuple[int, int, float]] = ()):
    self.size = len(source)
    self._source, self._seed, self._parts = source, seed, parts
    self._order = ORDER  # (a weighted stream's seeds are hashed in every order)
    self._dataset = prompt_dataset(source, seed, parts)
    self._it = iter(self._dataset)
    self.position = 0

  def take(self, n: int) -> list[tuple[int, dict[str, str]]]:
    out = [(self.position + i, next(self._it)) for i in range(n)]
    self.position += n
    return out

  def state(self) -> dict[str, Any]:
    return {"position": self.position, "iterator": self._it.get_state(), "order": self._order}

  def number_from(self, position: int) -> None:
    """Feed this source from its start, numbering its records from `position` on: a source
    that replaces another after `position` records keeps each prompt's index unique."""
    self.position = int(position)

  def restore(self, state: dict[str, Any]) -> None:
    """Back to a checkpoint's place: in the order it was read in (one saved before the
    order was recorded read an unweighted stream in order 1)."""
    try:
      order = int(state.get("order", 1))
      if not self._parts and order != self._order:
        if order not in (1, ORDER):
          raise ValueError(f"order {order}: expected 1 or {ORDER}")
        self._order = order
        self._dataset = prompt_dataset(self._source, self._seed, self._parts, order)
        self._it = iter(self._dataset)
      self._it.set_state(state["iterator"])
      self.position = int(state["position"])
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"checkpoint data state: expected {{'position', 'iterator'}}, got "
                       f"{state!r} ({e})") from None
