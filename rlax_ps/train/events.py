"""Where a trainer's scalars, histograms and tables go: TensorBoard events in <workdir>/tb,
and a Weights & Biases run too when `wandb.project` is set (`pip install 'rlax-ps[wandb]'`;
WANDB_MODE=offline keeps it on disk for `wandb sync`). A resumed run logs to the same W&B
run (its id is the trainer's), so one run's curves stay one run however often it restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Iterator, Sequence

import numpy as np


STEP = "trainer/step"  # W&B's x axis: the trainer's step, logged as a value


class Events:
  """TensorBoard events in `directory`, mirrored to `wandb_run` (None: TensorBoard alone).
  W&B plots every value against STEP, logged with it, not as its own step: W&B drops a
  value logged at a step below its last one (a held-out round finished steps after the
  step it evaluated, the steps a restart does again)."""

  def __init__(self, directory: str, wandb_run: Any = None, purge_step: int | None = None):
    """`purge_step`: a resumed run's first step; TensorBoard drops the earlier files' points
    from it on (the steps a kill undid, logged again: two points a step)."""
    from tensorboardX import SummaryWriter
    self.tb = SummaryWriter(directory, flush_secs=10, purge_step=purge_step)
    self.wandb_run = wandb_run
    self._row_step: int | None = None  # the step of the W&B row being filled
    if wandb_run is not None:
      wandb_run.define_metric(STEP)
      wandb_run.define_metric("*", step_metric=STEP)

  @staticmethod
  def _tag(tag: str) -> str:
    """`tag` as TensorBoard keeps it, for both sinks alike: tensorboardX turns characters
    other than letters, digits, _ - / . into _ ("eval/pass@8" read "eval/pass_8" there
    and "eval/pass@8" in W&B); @ reads "_at_"."""
    return re.sub(r"[^-/\w.]", "_", tag.replace("@", "_at_"))

  def _wandb_log(self, values: dict[str, Any], step: int) -> None:
    """`values` into the W&B row of `step` (a row is written once another step comes)."""
    if self._row_step is not None and self._row_step != int(step):
      self.wandb_run.log({}, commit=True)
    self.wandb_run.log({**values, STEP: int(step)}, commit=False)
    self._row_step = int(step)

  def add_scalar(self, tag: str, value: float, step: int) -> None:
    tag = self._tag(tag)
    self.tb.add_scalar(tag, value, step)
    if self.wandb_run is not None:
      self._wandb_log({tag: float(value)}, step)

  def add_histogram(self, tag: str, values, step: int) -> None:
    tag = self._tag(tag)
    self.tb.add_histogram(tag, values, step)
    if self.wandb_run is not None:
      import wandb
      self._wandb_log({tag: wandb.Histogram(np.asarray(values))}, step)

  def add_table(self, tag: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                step: int) -> None:
    """A table: TensorBoard's text tab shows it as markdown, W&B as a wandb.Table."""
    tag = self._tag(tag)
    self.tb.add_text(tag, markdown_table(columns, rows), step)
    if self.wandb_run is not None:
      import wandb
      self._wandb_log({tag: wandb.Table(columns=list(columns),
                                        data=[list(r) for r in rows])}, step)

  def flush(self) -> None:
    self.tb.flush()
    if self.wandb_run is not None and self._row_step is not None:
      self.wandb_run.log({}, commit=True)
      self._row_step = None

  def close(self) -> None:
    self.flush()
    self.tb.close()
    if self.wandb_run is not None:
      self.wandb_run.finish()
      self.wandb_run = None


class NoEvents:
  """The writer of a process that writes no events (not process 0 of a slice)."""

  def add_scalar(self, *args, **kwargs) -> None:
    del args, kwargs

  add_histogram = add_table = add_scalar

  def flush(self) -> None:
    """Nothing is buffered."""

  close = flush


def open_jsonl(path: str):
  """`path` opened to append JSON lines (steps.jsonl, versions.jsonl); a last line a kill
  tore (the file not ending in a newline) is ended first, so the next line stays whole."""
  torn = False
  with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
    if f.seek(0, os.SEEK_END):
      f.seek(-1, os.SEEK_END)
      torn = f.read(1) != b"\n"
  f = open(path, "a")
  if torn:
    f.write("\n")
  return f


def open_steps_jsonl(path: str, after_step: int):
  """open_jsonl of a trainer's per-step log, resuming after `after_step` (its checkpoint's):
  the lines of steps past it, which a kill undid and the run does again, are dropped first
  (atomically), so each step has one line, the one its checkpointed state went on from. The
  file is read a line at a time (a long run's is hundreds of MB); kept lines stay as written."""
  if any(int(r.get("step", 0)) > after_step for _, r in _records(path)):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      for line, r in _records(path):
        if int(r.get("step", 0)) <= after_step:
          f.write(line if line.endswith("\n") else line + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  return open_jsonl(path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
  """The records of a JSON-lines log, a line a kill tore left out ([] without the file)."""
  return [r for _, r in _records(path)]


def _records(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
  """(line, record) of each line of a JSON-lines log holding a JSON object, a line at a time."""
  with contextlib.suppress(FileNotFoundError), open(path) as f:
    for line in f:
      with contextlib.suppress(ValueError):
        record = json.loads(line)
        if isinstance(record, dict):
          yield line, record


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """`rows` as a markdown table; a cell's pipes are escaped and its line breaks kept as <br>,
  so that a completion stays in its cell."""
  def cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace(
        "\n", "<br>")

  lines = ["| " + " | ".join(map(cell, columns)) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
  return "\n".join(lines)


def open_wandb(cfg, *, run_id: str, name: str, directory: str, config: dict[str, Any]):
  """The W&B run that `cfg` (the config's wandb block: project, entity, group) asks for,
  resumed by `run_id` when it exists, its files under `directory`; None when no project is
  set. ValueError naming wandb.project when wandb is not installed or cannot start (no API
  key: `wandb login`, or WANDB_MODE=offline)."""
  cfg = cfg or {}
  project = str(cfg.get("project", ""))
  if not project:
    return None
  try:
    import wandb
  except ImportError:
    raise ValueError(f"wandb.project: logging to Weights & Biases project {project!r} needs "
                     f"the wandb package: pip install 'rlax-ps[wandb]'") from None
  os.makedirs(directory, exist_ok=True)
  try:
    return wandb.init(project=project, entity=str(cfg.get("entity", "")) or None,
                      group=str(cfg.get("group", "")) or None, id=run_id, name=name,
                      resume="allow", dir=directory, config=config)
  except Exception as e:  # noqa: BLE001 - wandb's own errors (auth, network) name the cause
    raise ValueError(f"wandb.project: Weights & Biases run {run_id!r} of project {project!r} "
                     f"did not start: {type(e).__name__}: {e}") from None
