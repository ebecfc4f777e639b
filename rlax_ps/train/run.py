"""What every trainer with a workdir has: the tokenizer, tasks and model its config names,
TensorBoard events, held-out evaluation by greedy exact match, the Hugging Face export, a
checkpointer to close, and a context manager."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import sys
from typing import Any, Callable, Iterable

import jax
from absl import logging
from flax import nnx

from rlax_ps import optim
from rlax_ps import sharding as shd
from rlax_ps.checkpoint import Checkpointer
from rlax_ps.config_files import make_workdir
from rlax_ps.folder_lock import FolderLock
from rlax_ps.models import (flatten_params, longest_sequence, model_config_from,
                            save_hf_checkpoint)
from rlax_ps.models.config import dtype_name
from rlax_ps.models.hf import QUANTIZATIONS, check_quantization
from rlax_ps.models.peft import save_peft_adapter
from rlax_ps.tasks import Task, get_task
from rlax_ps.tokenizers import tokenizer_from_config
from rlax_ps.train import heldout as heldout_lib
from rlax_ps.train.events import Events, NoEvents, open_wandb
from rlax_ps.train.prompts import file_weights, heldout_overlap
from rlax_ps.train.state import check_expert_parallel


# What stops a trainer cleanly (the step finished, checkpointed): a preemption's SIGTERM,
# Ctrl-C, and the SIGHUP of a closed terminal.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def built_or_exit(prog: str, build: Callable[[], Any]) -> Any:
  """build() (a trainer, an export); a setting it refuses (a field, a prompt file's line, a
  checkpoint of another model, a missing file) ends the command `prog` with that one line
  and exit status 2, as a bad flag does, not a traceback."""
  try:
    return build()
  except (OSError, ValueError) as e:
    print(f"{prog}: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_init_from_hf(path: str):
  """The ModelConfig of init_from_hf, once its config and tensor names (from the
  safetensors' headers: no weights read) are what a trainer or worker loads: a missing
  folder, file or foreign tensor is named now, with the field."""
  from rlax_ps.models.hf import check_hf_checkpoint
  try:
    return check_hf_checkpoint(path)
  except (OSError, ValueError) as e:
    raise ValueError(f"init_from_hf: {e}") from None


def tasks_from(cfg, data: str = "", field: str = "data.jsonl"
               ) -> tuple[list[Task], list[float]]:
  """The tasks with weight > 0 from the `tasks` config block, and their weights; none only
  where the records of `data` (the setting `field`) are the prompts instead: ValueError
  naming `field` where neither is given (a recipe for your own data names no task)."""
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
  if not tasks and not data:
    raise ValueError(f"{field}: expected a JSONL file of {{\"prompt\", \"answer\"}} records, "
                     f"as the config names no built-in task (tasks: {plain}, none with "
                     f"weight > 0), got ''")
  return tasks, weights


def checkpoint_directory(config, workdir: str) -> str:
  """Where a run's checkpoints go: checkpoint.directory, else <workdir>/checkpoints."""
  return config.checkpoint.get("directory", "") or os.path.join(workdir, "checkpoints")


def open_checkpointer(config, workdir: str) -> Checkpointer:
  """The run's Checkpointer, as its config's checkpoint block sets it."""
  return Checkpointer(checkpoint_directory(config, workdir),
                      max_to_keep=int(config.checkpoint.max_to_keep),
                      async_save=bool(config.checkpoint.async_save))


def data_source(config, records: Iterable[tuple[Any, Any, str]] | None) -> dict[str, Any]:
  """What a run's data position is a position in, as its checkpoint records it: the seed,
  and data.jsonl's path with the count and a digest of its `records` ((prompt, answer, task)
  as read; one pass, so a generator need hold none), or else the tasks in the mix (weight
  > 0) with their settings."""
  source: dict[str, Any] = {"seed": int(config.seed)}
  if records is None:
    plain = config.tasks.to_dict() if hasattr(config.tasks, "to_dict") else dict(config.tasks)
    source["tasks"] = {name: dict(block) for name, block in sorted(plain.items())
                       if float(block.get("weight", 1.0)) > 0}
    return source
  count, digest = _records_digest(records)
  weights = file_weights(config.data)
  return {**source, "jsonl": str(config.data.get("jsonl", "")), "records": count,
          "digest": digest, **({"weights": list(weights)} if weights else {})}


def _records_digest(records: Iterable[tuple[Any, Any, str]]) -> tuple[int, str]:
  """(count, digest) of the records: each one's sorted-key JSON, a line each."""
  digest = hashlib.blake2b(digest_size=8)
  encode = json.JSONEncoder(sort_keys=True).encode  # json.dumps(..., sort_keys=True), made once
  count = 0
  for count, record in enumerate(records, 1):
    digest.update(encode(list(record)).encode() + b"\n")
  return count, digest.hexdigest()


def _described(source: dict[str, Any]) -> str:
  if "tasks" in source:
    return f"'' (the tasks {', '.join(source['tasks'])})"
  return f"{source['jsonl']} ({source['records']} records, digest {source['digest']})"


def data_source_changes(was: dict[str, Any], now: dict[str, Any]) -> list[str]:
  """'field: <checkpoint's> in the checkpoint, <now> now' for each way the data source `now`
  differs from `was` (data_source); a file moved or renamed with the same records is none."""
  out = []
  if was.get("seed") != now.get("seed"):
    out.append(f"seed: {was.get('seed')!r} in the checkpoint, {now.get('seed')!r} now")
  if "tasks" in was and "tasks" in now:
    for name in sorted(set(was["tasks"]) | set(now["tasks"])):
      a, b = was["tasks"].get(name), now["tasks"].get(name)
      if a is None or b is None:  # in the mix on one side only: its weight says it
        a, b = ({"weight": (t or {"weight": 0.0}).get("weight", 1.0)} for t in (a, b))
      out += [f"tasks.{name}.{k}: {a.get(k)!r} in the checkpoint, {b.get(k)!r} now"
              for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
  elif (was.get("records"), was.get("digest")) != (now.get("records"), now.get("digest")):
    out.append(f"data.jsonl: {_described(was)} in the checkpoint, {_described(now)} now")
  if was.get("weights") != now.get("weights"):
    out.append(f"data.weights: {was.get('weights') or 'none'} in the checkpoint, "
               f"{now.get('weights') or 'none'} now")
  return out


def resumed_source_line(saved: dict[str, Any] | None, source: dict[str, Any], directory: str,
                        allow_new: bool, switch: str) -> str | None:
  """Whether a run on the data `source` (data_source) may resume the checkpoint of metadata
  `saved` in `directory` (None: a fresh run): None when that checkpoint was trained on it or
  records no source; the line to log when `allow_new` (data.allow_new_source: the run
  `switch`es, a phrase saying what it does with the new data); else ValueError naming what
  changed. The trainer and `rlax-ps local` (before it starts anything) say the same."""
  was = (saved or {}).get("data_source")
  changes = data_source_changes(was, source) if was else []
  if not changes:
    return None
  where = f"the checkpoint in {directory} (step {saved.get('step', '?')})"
  if allow_new:
    return (f"data: {where} was trained on other data ({'; '.join(changes)}); "
            f"data.allow_new_source: {switch}")
  raise ValueError(f"data: {where} was trained on other data than this config's "
                   f"({'; '.join(changes)}): its data position does not apply here. Resume "
                   f"with the data it was trained on, use another --workdir (init_from_hf="
                   f"<its hf export> starts from its weights), or set "
                   f"data.allow_new_source=True ({switch})")


def check_resumed_clipping(recorded, cfg, saved: dict[str, Any] | None, block: str) -> None:
  """ValueError naming `block`.clip_norm when clipping is turned on or off against the
  optimizer block `recorded` in the checkpoint of metadata `saved` (None: none recorded)."""
  if recorded is None:
    return
  was, now = float(optim.setting(recorded, "clip_norm")), float(optim.setting(cfg, "clip_norm"))
  if (was > 0) != (now > 0):
    raise ValueError(f"{block}.clip_norm: {was} in the checkpoint at step "
                     f"{saved.get('step', '?')}, {now} now: clipping turned "
                     f"{'on' if now > 0 else 'off'} changes the optimizer state the checkpoint "
                     f"holds; resume with clip_norm {'> 0' if was > 0 else '= 0'}, or use "
                     f"another --workdir")


def resumed_optimizer(cfg, total_steps: int, saved: dict[str, Any] | None,
                      steps_field: str) -> tuple[dict[str, Any], str | None]:
  """(optimizer config, line or None) of a run of `total_steps` (`steps_field`) resuming the
  checkpoint of metadata `saved` (None: a fresh run): optim.resumed_optimizer_config. Turning
  clipping on or off is refused naming optimizer.clip_norm: it adds or removes a part of the
  optimizer's state, which the checkpoint's cannot be restored into."""
  check_resumed_clipping(((saved or {}).get("config") or {}).get("optimizer"), cfg, saved,
                         "optimizer")
  return optim.resumed_optimizer_config(cfg, total_steps,
                                        optim.saved_schedule(saved, steps_field),
                                        int((saved or {}).get("step", 0)), steps_field)


def run_tokenizer(config):
  """The tokenizer a run's config names: its `tokenizer` block, else init_from_hf's, with the
  tools of worker.verifiers."""
  return tokenizer_from_config(config.tokenizer, config.get("init_from_hf", ""),
                               tool_modules=str(config.get("worker", {}).get("verifiers", "")))


def export_options(config) -> dict[str, Any]:
  """How a run's Hugging Face exports are written (save_hf_checkpoint's dtype and
  quantization): export.dtype (""/absent: the params' own) and export.quantization (""/absent:
  none; hf.QUANTIZATIONS); a ValueError names a field it refuses."""
  export = config.get("export", {})
  dtype, quantization = export.get("dtype") or None, export.get("quantization") or ""
  if dtype is not None:
    try:
      dtype = dtype_name(dtype, "export.dtype")
    except ValueError as e:
      raise ValueError(f"{e} ('' for the params' own)") from None
  if quantization not in QUANTIZATIONS:
    raise ValueError(f"export.quantization: expected one of {QUANTIZATIONS} ('': none), got "
                     f"{quantization!r}")
  return {"dtype": dtype, "quantization": quantization}


# What `rlax-ps export` writes beside an export: the run and step it holds.
EXPORT_RECORD = "rlax_ps_export.json"


def write_hf_export(graphdef: nnx.GraphDef, params: Any, tokenizer, path: str, *,
                    dtype: str | None = None, quantization: str = "", peft: bool = False,
                    base_model: str = "", record: dict[str, Any] | None = None) -> str:
  """Write the model (`graphdef` over host `params`) in Hugging Face format to `path`:
  config.json and safetensors in `dtype` (None: the params'; `quantization` as
  save_hf_checkpoint's), a LoRA model's adapters merged
  in, the generation config and the tokenizer files (its chat template) as trained; with
  `peft`, the adapters also as a PEFT adapter over `base_model` in `adapter/` where PEFT can
  hold them; `record` as EXPORT_RECORD. An earlier folder at `path` is replaced only once
  the new one is complete."""
  tok = tokenizer
  partial, old = path.rstrip("/") + ".partial", path.rstrip("/") + ".old"
  if not os.path.lexists(path) and os.path.isdir(old):  # a kill between the renames below
    os.rename(old, path)  # left the export before this one aside: it is the one held
  shutil.rmtree(partial, ignore_errors=True)
  if record is not None:  # first: a folder of that name holding it is this export's own
    os.makedirs(partial)
    with open(os.path.join(partial, EXPORT_RECORD), "w") as f:
      json.dump(record, f, indent=1)
  ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
  model = nnx.merge(graphdef, params)
  save_hf_checkpoint(model, partial, extra_config=ids, dtype=dtype, quantization=quantization)
  if peft:
    try:
      save_peft_adapter(flatten_params(model), model.config, os.path.join(partial, "adapter"),
                        base_model=base_model, dtype=dtype)
    except ValueError as e:  # adapters PEFT cannot hold: the merged export alone
      logging.info("export: no PEFT adapter (%s)", e)
  with open(os.path.join(partial, "generation_config.json"), "w") as f:
    json.dump({**ids, "eos_token_id": list(tok.stop_ids)}, f, indent=2)  # stop as trained
  tok.save(partial)  # with the chat template the policy was trained with, if any
  # The export it replaces, moved aside, not deleted first: a kill then leaves a whole one.
  shutil.rmtree(old, ignore_errors=True)
  if os.path.exists(path):
    os.rename(path, old)
  os.rename(partial, path)
  shutil.rmtree(old, ignore_errors=True)
  return path


def resumed_init_line(saved: dict[str, Any] | None, init_from_hf: str) -> str:
  """A line when `init_from_hf` names another checkpoint than the one the run it resumes
  (metadata `saved`) started from (a moved run's path, or another model: the run goes on as
  it was all the same): the weights resumed are the checkpoint's, but the tokenizer, a KL
  reference and a PEFT export's base are read from the new one; else ""."""
  recorded = (saved or {}).get("config") or {}
  was = recorded.get("init_from_hf", "")
  if not recorded or was == init_from_hf:
    return ""
  return (f"init_from_hf: {was!r} in the checkpoint (step {saved.get('step', '?')}), "
          f"{init_from_hf!r} now: the run resumes the checkpoint's weights; its tokenizer, KL "
          f"reference (if any) and PEFT base are read from {init_from_hf or 'the config'!r}. "
          f"Use another --workdir to start from it")


def prune_exports(folder: str, keep: int) -> list[str]:
  """Deletes the oldest of the periodic exports in `folder` (`step_NNNNNN`, export.every_steps)
  past the newest `keep` (0: keeps them all); what else the folder holds is left. Returns the
  deleted paths."""
  if keep <= 0 or not os.path.isdir(folder):
    return []
  steps = sorted((n for n in os.listdir(folder) if re.fullmatch(r"step_\d{6,}", n)),
                 key=lambda n: int(n[5:]))
  gone = [os.path.join(folder, n) for n in steps[:-keep]]
  for path in gone:
    shutil.rmtree(path)
  return gone


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

  def warn_heldout_overlap(self, prompts: Iterable[Any]) -> None:
    """Warn when data.heldout_jsonl's prompts (self.heldout) are among data.jsonl's
    `prompts`: the held-out score the run reports would be a training score."""
    data = self.config.data
    if self.leader and data.get("heldout_jsonl", "") and data.get("jsonl", ""):
      line = heldout_overlap((e.prompt for examples in self.heldout.examples.values()
                              for e in examples), prompts)
      if line:
        logging.warning("%s", line)

  def check_mesh(self) -> None:
    """Before step 1: warn when the mesh's tensor axis cannot split the model's attention;
    refuse expert parallelism whose fsdp axis does not divide the experts."""
    c = self.model_config
    check_expert_parallel(c, self.mesh)
    unsplit = shd.unsplit_heads(self.mesh, c.num_heads, c.num_kv_heads)
    if unsplit and self.leader:
      logging.warning("%s", unsplit)

  def open_workdir(self, workdir: str, build: Callable[[], None]) -> None:
    """Create the workdir and hold it (process 0) while the trainer lives, then `build()` the
    trainer's parts (a build that raises, a config refused, frees it again): a second
    trainer on it (a rerun while the first still runs) is refused, naming the first's pid,
    rather than interleaving checkpoints with it."""
    self.workdir = make_workdir(workdir)
    if self.leader:
      self._workdir_lock = FolderLock(self.workdir, holder="trainer", flag="--workdir")
    try:
      build()
      self.writer  # TensorBoard, and W&B (wandb.project): refused now, not at the first step
    except BaseException:
      if getattr(self, "checkpointer", None) is not None:  # its threads end before the exit
        self.checkpointer.close()
      self.release_workdir()
      raise

  def check_data_source(self, saved: dict[str, Any] | None, source: dict[str, Any],
                        switch: str) -> bool:
    """Before any step: whether this run trains on a data source other than the one of the
    checkpoint it resumes (`saved`, its metadata; None: a fresh run), as resumed_source_line
    allows it (logged) or refuses it. `source` (data_source) is what this run's checkpoints
    record."""
    self.data_source = source
    line = resumed_source_line(saved, source, self.checkpointer.directory,
                               bool(self.config.data.get("allow_new_source", False)), switch)
    if line and self.leader:
      logging.warning("%s", line)
    return line is not None

  def build_optimizer(self, saved: dict[str, Any] | None, steps_field: str,
                      updates_per_step: int = 1) -> None:
    """The optimizer and its lr schedule over total_steps (`steps_field`); resuming from the
    checkpoint of metadata `saved`, its schedule goes on as optim.resumed_optimizer_config
    says, and a log line says what changes."""
    cfg, line = resumed_optimizer(self.config.optimizer, self.total_steps, saved, steps_field)
    if line and self.leader:
      logging.warning("%s", line)
    self.optimizer = optim.make_optimizer(cfg, self.total_steps, updates_per_step)
    self.schedule = optim.learning_rate_schedule(cfg, self.total_steps)
    self.schedule_settings = optim.schedule_settings(cfg, self.total_steps)  # checkpointed

  def note_resumed_init(self, saved: dict[str, Any] | None) -> None:
    """Log resumed_init_line's line, if any."""
    line = resumed_init_line(saved, self.init_from_hf)
    if line and self.leader:
      logging.warning("%s", line)

  def read_model(self, config) -> None:
    """init_from_hf, tokenizer, tasks and model config from the config's blocks (the model
    and tokenizer of `init_from_hf` where it names an HF checkpoint)."""
    quantization = export_options(config)["quantization"]  # a refused field ends the run now
    self.init_from_hf = config.get("init_from_hf", "")
    if self.init_from_hf:
      check_init_from_hf(self.init_from_hf)
    self.tokenizer = run_tokenizer(config)
    self.tasks, self.weights = tasks_from(config.tasks, (config.get("data") or {}).get("jsonl", ""))
    self.model_config = model_config_from(config.model, self.tokenizer.vocab_size,
                                          self.init_from_hf, longest_sequence(config))
    try:  # one the model cannot be written in, likewise
      check_quantization(quantization, self.model_config.architecture)
    except ValueError as e:
      raise ValueError(f"export.{e}") from None

  @property
  def leader(self) -> bool:
    """Process 0: the one that writes events, logs and exports (and, in RL, talks to the
    server); the only one outside a multi-host slice."""
    return jax.process_index() == 0

  @property
  def writer(self) -> Events | NoEvents:
    """The run's events (process 0): TensorBoard in <workdir>/tb, and the W&B run that
    wandb.project names, resumed under this trainer's id (rl-<run id>, sft-<workdir hash>)."""
    if self._writer is None and not self.leader:
      self._writer = NoEvents()
    if self._writer is None:
      kind = type(self).__name__.removesuffix("Trainer").lower()
      key = getattr(self, "run_id", "") or hashlib.blake2b(
          self.workdir.encode(), digest_size=4).hexdigest()
      config = self.config.to_dict() if hasattr(self.config, "to_dict") else dict(self.config)
      run = open_wandb(self.config.get("wandb"), run_id=f"{kind}-{key}",
                       name=f"{os.path.basename(self.workdir)}-{kind}",
                       directory=self.workdir, config=config)
      resumed = int(getattr(self, "step", 0) or 0)  # (0: no state yet, or a fresh run)
      self._writer = Events(os.path.join(self.workdir, "tb"), run,
                            purge_step=resumed + 1 if resumed else None)
    return self._writer

  def evaluate(self) -> dict[str, float]:
    """Held-out exact match per task and over all, with greedy decoding."""
    self.last_eval = heldout_lib.exact_match(self.graphdef, self.state.params, self.tokenizer,
                                             self.heldout, self.config)
    return self.last_eval

  def export_hf(self, path: str | None = None) -> str:
    """write_hf_export of the model to `path` (default <workdir>/hf), in export.dtype, a LoRA
    model's adapters also as a PEFT adapter where PEFT can hold them. On a multi-host slice
    every process gathers the params; process 0 writes."""
    path = path or os.path.join(self.workdir, "hf")
    params = shd.to_host(self.state.params)
    if not self.leader:
      return path
    return write_hf_export(self.graphdef, params, self.tokenizer, path,
                           **export_options(self.config),
                           peft=bool(self.model_config.lora_rank), base_model=self.init_from_hf)

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
