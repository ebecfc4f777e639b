"""The supervised warm start: a trainer with a lifetime (mesh, state, checkpoints, logs) and
`train_and_evaluate(config, workdir)`, the whole job that `rlax-ps sft` runs.

A rerun with the same workdir resumes from the latest complete checkpoint: same step,
params, optimizer state, RNG and data position (the batch of step s depends only on s).
On a multi-host slice every process builds the same global batches and runs the steps;
process 0 alone writes logs, the summary and the export.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from typing import Any, Sequence

import jax
from absl import logging
from flax import nnx

from rlax_ps import optim
from rlax_ps import sharding as shd
from rlax_ps.config_files import check_counts, save_run_config, write_json
from rlax_ps.tasks import Example
from rlax_ps.train.data import SFTBatches, encode_example
from rlax_ps.train.heldout import heldout_from_config
from rlax_ps.train.prompts import data_files, file_parts, file_weights, iter_prompts
from rlax_ps.train.run import STOP_SIGNALS, TrainerRun, data_source, open_checkpointer
from rlax_ps.train.state import TrainState, mesh_layout, restore_or_init
from rlax_ps.train.step import make_train_step


class SFTTrainer(TrainerRun):
  """Owns one run: mesh, sharded state, jitted step, data, checkpoints and event files."""

  def __init__(self, config, workdir: str, *, devices: Sequence[jax.Device] | None = None):
    self.config = config
    self.open_workdir(workdir, lambda: self._build(config, devices))

  def _build(self, config, devices: Sequence[jax.Device] | None) -> None:
    """The trainer's parts, built once it holds its workdir."""
    self.read_model(config)
    self.total_steps = int(config.train.steps)
    self.mesh = shd.make_mesh(config.mesh.to_dict(), devices)
    self.check_mesh()
    num_micro = optim.grad_accum_steps(config.optimizer)
    batch_size, seq_len = int(config.data.batch_size), int(config.data.seq_len)
    if batch_size < 1 or seq_len < 2:
      raise ValueError(f"data.batch_size, data.seq_len: expected >= 1 and >= 2, got "
                       f"{batch_size}, {seq_len}")
    if seq_len > self.model_config.max_position_embeddings:
      raise ValueError(f"data.seq_len: expected at most the model's max_position_embeddings="
                       f"{self.model_config.max_position_embeddings} (positions past it were "
                       f"never trained and rope scaling is not meant for them), got {seq_len}")
    if batch_size % num_micro:
      raise ValueError(f"optimizer.grad_accum_steps: expected a divisor of data.batch_size="
                       f"{batch_size}, got {num_micro}")
    self.warn_unsplit_rows(batch_size, num_micro, f"data.batch_size={batch_size}, "
                           f"optimizer.grad_accum_steps={num_micro}")
    check_counts(config, ("checkpoint.every_steps", "train.eval_every"))
    # The data is checked before the checkpointer starts, so a bad file or seq_len is the
    # one line the command ends with.
    records, parts = self._records()
    self.data = SFTBatches(self.tasks, self.weights, self.tokenizer, batch_size=batch_size,
                           seq_len=seq_len, seed=int(config.seed),
                           packing=bool(config.data.packing), records=records, parts=parts)
    self.checkpointer = open_checkpointer(config, self.workdir)
    saved = self.checkpointer.latest_metadata()
    self.note_resumed_init(saved)
    read = None if records is None else ((e.prompt, e.answer, e.task) for e in records)
    new_source = self.check_data_source(
        saved, data_source(config, read),
        "the steps left draw their batches from this data, from its first record")
    self.build_optimizer(saved, "train.steps")
    self.state, self.shardings, self.graphdef = self._init_or_restore()
    stream = ((saved or {}).get("data") or {}).get("stream")
    if stream and not new_source:  # data.jsonl's records: where the stream was (in others:
      self.data.restore(stream)      # a new source is read from its start)
    elif records is not None and saved is not None and not new_source and self.leader:
      logging.warning("sft: the checkpoint at step %d holds no position in data.jsonl's "
                      "records (written by an older rlax-ps): they are gone through from a "
                      "new epoch's start", int(saved["step"]))
    self.train_step = make_train_step(self.graphdef, self.optimizer, self.shardings, self.mesh,
                                      num_micro=num_micro, schedule=self.schedule)
    self.heldout = heldout_from_config(config, self.tasks, self.tokenizer)
    self.warn_heldout_overlap(e.prompt for e in records or ())
    self._stop = threading.Event()
    self.stop_signal: int | None = None  # the signal that asked for the stop, if any

  # -- state ------------------------------------------------------------------------------

  def _records(self) -> tuple[list[Example] | None, list[tuple[int, int, float]]]:
    """(data.jsonl's records as examples (prompt, answer), or None to train on the tasks;
    each file's records and weight, file_parts, where data.weights mixes the files)."""
    data = self.config.data
    path = data.get("jsonl", "")
    weights = file_weights(data)  # (refused without data.jsonl's files to weigh)
    if not path:
      return None, []
    if not data.get("answer_key", "answer"):
      raise ValueError("data.answer_key: supervised data needs answers; expected the key "
                       "that holds them, got ''")
    sizes, seq_len = [], int(data.seq_len)

    def fits(record):  # a record the tokenizer cannot encode or seq_len cannot hold: named
      n = len(encode_example(self.tokenizer, Example(record["prompt"], record["answer"],
                                                     record["task"]))[0]) - 1
      if n > seq_len:
        raise ValueError(f"data.seq_len: {seq_len} is too small for this record's {n} "
                         f"next-token pairs; raise it or shorten the record")

    records = iter_prompts(path, field="data.jsonl",
                           prompt_key=str(data.get("prompt_key", "prompt")),
                           answer_key=str(data.get("answer_key", "answer")),
                           task_key=str(data.get("task_key", "task")), demonstrations=True,
                           check=fits, sizes=sizes)
    examples = [Example(r["prompt"], r["answer"], r["task"]) for r in records]
    return examples, file_parts(sizes, weights, data_files(path)) if weights else []

  def _init_or_restore(self) -> tuple[TrainState, TrainState, nnx.GraphDef]:
    return restore_or_init(self.model_config, self.optimizer, self.mesh, self.checkpointer,
                           init_from_hf=self.init_from_hf, seed=int(self.config.seed))[:3]

  @property
  def step(self) -> int:
    return int(shd.to_host(self.state.step))

  def metadata(self) -> dict[str, Any]:
    """The JSON blob saved with each checkpoint: step, data position, model, tokenizer, config."""
    step = self.step
    return {
        "step": step,
        "data": {"seed": int(self.config.seed), "position": step,
                 "stream": self.data.state()},
        "data_source": self.data_source,
        "schedule": self.schedule_settings,
        "model_config": self.model_config.to_dict(),
        "tokenizer": {"kind": self.config.tokenizer.kind, "path": self.config.tokenizer.path,
                      "vocab_size": self.tokenizer.vocab_size},
        "config": json.loads(self.config.to_json_best_effort()),
    }

  def save(self) -> None:
    """Start an async checkpoint of the current state (skipped if this step is saved)."""
    step = self.step
    if step in self.checkpointer.all_steps():
      return
    self.checkpointer.save(step, self.state.to_tree(), self.metadata())

  # -- loop -------------------------------------------------------------------------------

  def request_stop(self, signum: int | None = None) -> None:
    """Finish the current step, checkpoint and return (a SIGTERM or Ctrl-C: `signum`)."""
    self.stop_signal = self.stop_signal or signum
    self._stop.set()

  def _stopping(self) -> bool:
    """Whether any process was asked to stop: on a multi-host slice all stop at one step,
    and each then holds the stop and its signal (saves, evaluates and exits alike: a save
    or an evaluation that some processes skip waits for them for ever)."""
    stop, signum = shd.agreed_stop(self._stop.is_set(), self.stop_signal)
    if stop:
      self._stop.set()
      self.stop_signal = signum
    return stop

  def train(self, until: int | None = None, *, progress: bool = True) -> dict[str, float]:
    """Run steps up to `until` (default: train.steps); returns the last logged metrics."""
    from tqdm import tqdm

    until = self.total_steps if until is None else min(until, self.total_steps)
    log_every = max(1, int(self.config.train.log_every))
    ckpt_every = int(self.config.checkpoint.every_steps)
    eval_every = int(self.config.train.eval_every)
    start = self.step
    last: dict[str, float] = {}
    skipped = 0  # updates skipped for non-finite gradients, as last logged
    bar = tqdm(total=until, initial=start, desc="sft", unit="step",
               disable=not (progress and self.leader), dynamic_ncols=True)
    t0 = time.time()
    for step in range(start, until):
      if self._stopping():
        break
      batch = shd.shard_batch(self.mesh, self.data.batch(step))
      self.state, metrics = self.train_step(self.state, batch)
      done = step + 1
      if done % log_every == 0 or done == until:  # Fetching metrics waits for the step.
        last = {k: float(v) for k, v in shd.to_host(metrics).items()}
        last["answer_tokens"] = last.pop("tokens")
        if last.get("skipped_updates", 0) > skipped and self.leader:
          logging.warning("step %d: %d update(s) skipped since step %d: their gradients were "
                          "not finite", done, last["skipped_updates"] - skipped, done - log_every)
        skipped = last.get("skipped_updates", 0)
        optim.check_finite_updates(last, self.config.optimizer, done)
        for k, v in last.items():
          self.writer.add_scalar(f"train/{k}", v, done)
        elapsed = time.time() - t0
        self.writer.add_scalar("train/steps_per_second", (done - start) / elapsed, done)
        bar.set_postfix(loss=f"{last['loss']:.3f}", tok_acc=f"{last['token_accuracy']:.2f}")
      bar.update(1)
      if ckpt_every and done % ckpt_every == 0 and done < until:
        self.save()
      if eval_every and done % eval_every == 0 and done < until and self.heldout.size:
        self.log_eval(self.evaluate(), done)
    bar.close()
    stopped = self._stopping()  # (agreed: one process's signal may come after the last check)
    if self.step == self.total_steps or stopped:
      self.save()
    return last


def format_accuracy(result: dict[str, float], counts: dict[str, int]) -> str:
  """The held-out line: each task's rate of its `counts` examples, and all of them's."""
  parts = [f"{k} {100 * v:.1f}% of {counts.get(k, 0)}" for k, v in result.items() if k != "all"]
  return (f"held-out exact match: {', '.join(parts)}; all {100 * result['all']:.1f}% of "
          f"{sum(counts.values())}")


@contextlib.contextmanager
def _stop_on_signals(trainer: SFTTrainer, enabled: bool):
  """SIGTERM / SIGINT / SIGHUP: finish the step, checkpoint and return (the handlers restored
  after)."""
  if not enabled:
    yield
    return
  old = {sig: signal.signal(sig, lambda signum, _: trainer.request_stop(signum))
         for sig in STOP_SIGNALS}
  try:
    yield
  finally:
    for sig, handler in old.items():
      signal.signal(sig, handler)


def train_and_evaluate(config, workdir: str, *, progress: bool = True,
                       stop_on_signals: bool = False,
                       trainer: SFTTrainer | None = None) -> dict[str, Any]:
  """The `rlax-ps sft` job: train (resuming if possible), evaluate, export, report. With
  `stop_on_signals`, a SIGTERM or Ctrl-C checkpoints the step reached and returns at once
  (no evaluation or export), "stopped" in the summary naming the signal. `trainer`: the
  SFTTrainer of `config` and `workdir` if built already."""
  t0 = time.time()
  with (trainer or SFTTrainer(config, workdir)) as trainer, \
       _stop_on_signals(trainer, stop_on_signals):
    if trainer.leader:  # what `rlax-ps local` compares before reusing this warm start
      save_run_config(config, trainer.workdir)
    if trainer.step:
      print(f"resuming from checkpoint step {trainer.step} in {trainer.checkpointer.directory}",
            flush=True)
    print(f"model: {trainer.model_config.num_params:,} params; "
          f"{mesh_layout(trainer.model_config, trainer.mesh)}; {trainer.total_steps} steps of "
          f"{config.data.batch_size}x{config.data.seq_len} tokens", flush=True)
    last = trainer.train(progress=progress)
    if trainer.stop_signal and trainer.step < trainer.total_steps:
      trainer.checkpointer.wait()
      print(f"sft: stopped by {signal.Signals(trainer.stop_signal).name} at step "
            f"{trainer.step} of {trainer.total_steps}; checkpointed, a rerun resumes",
            flush=True)
      return {"step": trainer.step, "train": last, "stopped": trainer.stop_signal,
              "seconds": time.time() - t0}
    result = None  # eval.num_examples=0: nothing held out, nothing evaluated
    if trainer.heldout.size:
      result = trainer.evaluate()
      trainer.log_eval(result, trainer.step)
    export = trainer.export_hf() if config.export.hf else None
    trainer.checkpointer.wait()
    summary = {"step": trainer.step, "train": last, "heldout_exact_match": result,
               "export": export, "seconds": time.time() - t0}
    if not trainer.leader:
      return summary
    print(format_accuracy(result, {k: len(v) for k, v in trainer.heldout.examples.items()})
          if result else
          "held-out: no examples, not evaluated", flush=True)
    if export:
      print(f"Hugging Face export: {export}", flush=True)
    print(f"done in {summary['seconds']:.0f}s; workdir {trainer.workdir}", flush=True)
    write_json(os.path.join(trainer.workdir, "summary.json"), summary)
  return summary
