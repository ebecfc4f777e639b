"""What every trainer with a workdir has: the tokenizer, tasks and model its config names,
TensorBoard events, held-out evaluation by greedy exact match, the Hugging Face export, a
checkpointer to close, and a context manager."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Callable

import jax
from absl import logging
from flax import nnx

from rlax_ps import sharding as shd
from rlax_ps.folder_lock import FolderLock
from rlax_ps.models import (flatten_params, longest_sequence, model_config_from,
                            save_hf_checkpoint)
from rlax_ps.models.peft import save_peft_adapter
from rlax_ps.tasks import Task, get_task
from rlax_ps.tokenizers import tokenizer_from_config
from rlax_ps.train import heldout as heldout_lib


def built_or_exit(prog: str, build: Callable[[], "TrainerRun"]) -> "TrainerRun":
  """build() (a trainer); a setting it refuses (a field, a prompt file's line, a checkpoint
  of another model, a missing file) ends the command `prog` with that one line and exit
  status 2, as a bad flag does, not a traceback."""
  try:
    return build()
  except (OSError, ValueError) as e:
    print(f"{prog}: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def tasks_from(cfg) -> tuple[list[Task], list[float]]:
  """The tasks with weight > 0 from the `tasks` config block, and their weights."""
  plain = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
  tasks, weights = [], []
  for name, block in sorted(plain.items()):
    block = dict(block)
    weight = float(block.pop("weight", 1.0))
    if weight < 0:
      raise ValueError(f"tasks.{name}.weight: expected >= 0, got {weight}")
    if weight > 0:
      tasks.append(get_task(name, **block))
      weights.append(weight)
  if not tasks:
    raise ValueError(f"tasks: expected at least one task with weight > 0, got {plain}")
  return tasks, weights


class TrainerRun:
  """Mixin for a trainer that sets workdir, checkpointer, graphdef, state, config and
  heldout (a heldout.Heldout), and calls read_model."""

  _writer = None
  _workdir_lock = None
  last_eval: dict[str, float] | None = None

  def warn_unsplit_rows(self, rows: int, micro: int, fields: str) -> None:
    """Warn before step 1 when a micro-batch's rows (`rows` a step in `micro` slices) do not
    split over data*fsdp, so that the devices repeat one another's work; `fields` names the
    settings that make them."""
    unsplit = shd.unsplit_rows(self.mesh, rows // micro)
    if unsplit:
      logging.warning("%s: %s; a multiple of %d uses every device", fields, unsplit,
                      self.mesh.shape["data"] * self.mesh.shape["fsdp"] * micro)

  def open_workdir(self, workdir: str, build: Callable[[], None]) -> None:
    """Create the workdir and hold it (process 0) while the trainer lives, then `build()` the
    trainer's parts (a build that raises, a config refused, frees it again): a second
    trainer on it (a rerun while the first still runs) is refused, naming the first's pid,
    rather than interleaving checkpoints with it."""
    self.workdir = os.path.abspath(workdir)
    os.makedirs(self.workdir, exist_ok=True)
    if self.leader:
      self._workdir_lock = FolderLock(self.workdir, holder="trainer", flag="--workdir")
    try:
      build()
    except BaseException:
      self.release_workdir()
      raise

  def read_model(self, config) -> None:
    """init_from_hf, tokenizer, tasks and model config from the config's blocks (the model
    and tokenizer of `init_from_hf` where it names an HF checkpoint)."""
    self.init_from_hf = config.get("init_from_hf", "")
    self.tokenizer = tokenizer_from_config(
        config.tokenizer, self.init_from_hf,
        tool_modules=str(config.get("worker", {}).get("verifiers", "")))
    self.tasks, self.weights = tasks_from(config.tasks)
    self.model_config = model_config_from(config.model, self.tokenizer.vocab_size,
                                          self.init_from_hf, longest_sequence(config))

  @property
  def leader(self) -> bool:
    """Process 0: the one that writes events, logs and exports (and, in RL, talks to the
    server); the only one outside a multi-host slice."""
    return jax.process_index() == 0

  @property
  def writer(self):
    if self._writer is None and not self.leader:
      self._writer = _NoEvents()
    if self._writer is None:
      from tensorboardX import SummaryWriter
      self._writer = SummaryWriter(os.path.join(self.workdir, "tb"), flush_secs=10)
    return self._writer

  def evaluate(self) -> dict[str, float]:
    """Held-out exact match per task and over all, with greedy decoding."""
    self.last_eval = heldout_lib.exact_match(self.graphdef, self.state.params, self.tokenizer,
                                             self.heldout, self.config)
    return self.last_eval

  def export_hf(self, path: str | None = None) -> str:
    """Write the model in Hugging Face format (config.json, safetensors, tokenizer files) to
    `path` (default <workdir>/hf) in export.dtype ("" = the params' dtype), replacing an
    earlier export only once the new one is complete; a LoRA model's adapters are merged in
    and also written as a PEFT adapter in `adapter/` where PEFT can hold them. On a
    multi-host slice every process gathers the params; process 0 writes."""
    path = path or os.path.join(self.workdir, "hf")
    params = shd.to_host(self.state.params)
    if not self.leader:
      return path
    tok = self.tokenizer
    partial = path.rstrip("/") + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    model = nnx.merge(self.graphdef, params)
    dtype = self.config.get("export", {}).get("dtype") or None
    save_hf_checkpoint(model, partial, extra_config=ids, dtype=dtype)
    if self.model_config.lora_rank:
      try:
        save_peft_adapter(flatten_params(model), self.model_config,
                          os.path.join(partial, "adapter"), base_model=self.init_from_hf,
                          dtype=dtype)
      except ValueError as e:  # adapters PEFT cannot hold: the merged export alone
        logging.info("export: no PEFT adapter (%s)", e)
    with open(os.path.join(partial, "generation_config.json"), "w") as f:
      json.dump({**ids, "eos_token_id": list(tok.stop_ids)}, f, indent=2)  # stop as trained
    tok.save(partial)  # with the chat template the policy was trained with, if any
    shutil.rmtree(path, ignore_errors=True)
    os.rename(partial, path)
    return path

  def log_eval(self, result: dict[str, float], step: int) -> None:
    for k, v in result.items():
      self.writer.add_scalar(f"eval/exact_match/{k}", v, step)
    self.writer.flush()

  def release_workdir(self) -> None:
    if self._workdir_lock is not None:
      self._workdir_lock.release()

  def close(self) -> None:
    try:
      self.checkpointer.close()
      if self._writer is not None:
        self._writer.close()
    finally:
      self.release_workdir()

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class _NoEvents:
  """The writer of a process that writes no TensorBoard events."""

  def add_scalar(self, *args, **kwargs) -> None:
    del args, kwargs

  add_histogram = add_scalar

  def flush(self) -> None:
    """Nothing is buffered."""

  close = flush
