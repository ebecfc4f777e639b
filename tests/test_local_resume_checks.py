"""`rlax-ps local` on a workdir with an RL checkpoint reads that checkpoint's metadata before
it starts anything: another data source is refused in the trainer's words, and the lines the
trainer would log on resuming (the lr schedule kept or changed) go to the console."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from child_env import child_env
from rlax_ps import optim
from rlax_ps.checkpoint import Checkpointer
from rlax_ps.config_files import load
from rlax_ps.train.prompts import config_records
from rlax_ps.train.rl_checks import NEW_SOURCE_FED, latest_metadata, resume_lines
from rlax_ps.train.run import TrainerRun, data_source

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEPS_DECAY = "optimizer: rl.steps is 40 now, the lr schedule keeps the checkpoint's decay over 4"


def _config(**data):
  """The :tiny recipe with a decaying lr (its own is constant after warmup)."""
  config = load(os.path.join(REPO, "configs", "rl_local.py"), "tiny")
  config.optimizer.min_lr_ratio = 0.1
  config.data.update(data)
  return config


def _write(path, start, n=6):
  path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1),
                                      "task": "addition"}) + "\n"
                          for i in range(start, start + n)))
  return str(path)


def _records(config):
  """data.jsonl's records as the trainer reads them; None for the built-in tasks."""
  if not config.data.jsonl:
    return None
  return [(r["prompt"], r["answer"], r["task"])
          for r in config_records(config, "data.jsonl", config.data.jsonl)]


def _checkpoint(workdir, config, step=4):
  """A checkpoint saved as the RL trainer saves one in <workdir>/checkpoints: a tiny state and
  the metadata that resuming reads. Returns that metadata."""
  metadata = {"step": step, "data_source": data_source(config, _records(config)),
              "schedule": optim.schedule_settings(config.optimizer, int(config.rl.steps))}
  with Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False) as checkpointer:
    checkpointer.save(step, {"x": np.zeros(2, np.float32)}, metadata)
  return metadata


class _Trainer(TrainerRun):
  """What TrainerRun.check_data_source reads of a trainer."""

  def __init__(self, config, directory):
    self.config, self.checkpointer = config, types.SimpleNamespace(directory=directory)


def test_the_config_it_was_trained_with_resumes_without_a_line(tmp_path):
  config = _config()
  _checkpoint(tmp_path, config)
  assert resume_lines(config, str(tmp_path)) == []


def test_another_number_of_updates_per_batch_is_refused_before_anything_starts(tmp_path):
  """The trainer refused it only after the server, its model load and the workers started."""
  config = _config()
  metadata = {"step": 4, "data_source": data_source(config, None),
              "config": {"rl": {"updates_per_batch": 2}}}
  with Checkpointer(os.path.join(tmp_path, "checkpoints"), async_save=False) as checkpointer:
    checkpointer.save(4, {"x": np.zeros(2, np.float32)}, metadata)
  with pytest.raises(ValueError, match="rl.updates_per_batch: 2 in the checkpoint at step 4, "
                                       "1 now"):
    resume_lines(config, str(tmp_path))


def test_another_publication_format_is_refused_before_anything_starts(tmp_path):
  """The server holds the run's versions in its format and refuses another's keyframe: the
  trainer failed at its first publication, after the warm start, server and workers."""
  config = _config()
  metadata = {"step": 4, "data_source": data_source(config, None),
              "config": {"publish": {"format": "bf16"}}}
  with Checkpointer(os.path.join(tmp_path, "checkpoints"), async_save=False) as checkpointer:
    checkpointer.save(4, {"x": np.zeros(2, np.float32)}, metadata)
  assert resume_lines(config, str(tmp_path)) == []
  config.publish.format = "int8"
  with pytest.raises(ValueError, match=r"^publish.format: 'int8' now, 'bf16' in the run's "
                                       r"checkpoint in .*; resume with publish.format='bf16'"):
    resume_lines(config, str(tmp_path))


def test_a_checkpoint_a_newer_release_wrote_is_refused_before_anything_starts(tmp_path,
                                                                              monkeypatch):
  from rlax_ps import checkpoint
  config = _config()
  monkeypatch.setattr(checkpoint, "FORMAT", checkpoint.FORMAT + 1)
  _checkpoint(tmp_path, config)
  monkeypatch.undo()
  with pytest.raises(ValueError, match=r"the checkpoint in .*checkpoints was written by a "
                                       r"newer rlax-ps .*resume with that release"):
    resume_lines(config, str(tmp_path))


def test_a_checkpoint_of_another_model_is_refused_in_the_trainers_words(tmp_path):
  """A warm start trained anew on another model block (its old one deleted): the worker was
  the first to fail, on the trainer's first weights ("give the worker the trainer's config",
  which it had)."""
  from rlax_ps.models import longest_sequence, model_config_from
  from rlax_ps.train.rl_checks import check_resumed_model
  from rlax_ps.train.run import run_tokenizer
  config = _config()
  model = model_config_from(config.model, run_tokenizer(config).vocab_size, "",
                            longest_sequence(config))
  with Checkpointer(os.path.join(tmp_path, "checkpoints"), async_save=False) as checkpointer:
    checkpointer.save(4, {"x": np.zeros(2, np.float32)}, {
        "step": 4, "model_config": model.to_dict(), "config": {"init_from_hf": ""}})
  assert check_resumed_model(config, str(tmp_path), "") == ""
  # Another init_from_hf (of the same model): resumed all the same, said in the trainer's
  # words, which `rlax-ps local` prints (test_local: a synchronous run ... resumed).
  from rlax_ps.train.run import resumed_init_line
  saved = {"step": 4, "config": {"init_from_hf": ""}}
  assert resumed_init_line(saved, "") == "" and resumed_init_line({"step": 4}, "/x") == ""
  assert resumed_init_line(saved, "/moved/hf").startswith(
      "init_from_hf: '' in the checkpoint (step 4), '/moved/hf' now: the run resumes the "
      "checkpoint's weights")
  config.model.num_layers = model.num_layers + 1
  with pytest.raises(ValueError, match=(
      f"^model: the checkpoint in {tmp_path / 'checkpoints'} was written for another model "
      f"\\(model.num_layers: {model.num_layers} in the checkpoint, {model.num_layers + 1} now\\); "
      f"resume with its model, or use another workdir$")):
    check_resumed_model(config, str(tmp_path), "")


def test_another_seed_is_refused_in_the_trainers_words(tmp_path):
  saved = _checkpoint(tmp_path, _config())
  config = _config()
  config.seed = 1
  with pytest.raises(ValueError) as local:
    resume_lines(config, str(tmp_path))
  directory = str(tmp_path / "checkpoints")
  assert str(local.value).startswith(
      f"data: the checkpoint in {directory} (step 4) was trained on other data than this "
      f"config's (seed: 0 in the checkpoint, 1 now)")
  with pytest.raises(ValueError) as trainer:
    _Trainer(config, directory).check_data_source(saved, data_source(config, None),
                                                  NEW_SOURCE_FED)
  assert str(local.value) == str(trainer.value)


def test_another_jsonl_is_refused_unless_allowed_and_then_said(tmp_path):
  path = tmp_path / "d.jsonl"
  _checkpoint(tmp_path, _config(jsonl=_write(path, 0)))
  _write(path, 100)  # same file, other records
  with pytest.raises(ValueError, match=r"\(data.jsonl: .*d.jsonl \(6 records, digest \w+\) in "
                     r"the checkpoint, .*d.jsonl \(6 records, digest \w+\) now\)"):
    resume_lines(_config(jsonl=str(path)), str(tmp_path))
  line, = resume_lines(_config(jsonl=str(path), allow_new_source=True), str(tmp_path))
  assert line.startswith(f"data: the checkpoint in {tmp_path / 'checkpoints'} (step 4) was "
                         f"trained on other data (data.jsonl: ")
  assert line.endswith(f"; data.allow_new_source: {NEW_SOURCE_FED}")


def test_a_longer_run_gets_the_schedule_line(tmp_path):
  _checkpoint(tmp_path, _config())
  config = _config()
  config.rl.steps = 40
  line, = resume_lines(config, str(tmp_path))
  assert line.startswith(KEEPS_DECAY) and "set optimizer.decay_steps" in line


def test_a_fresh_workdir_has_nothing_to_check_and_gets_nothing_written(tmp_path):
  assert resume_lines(_config(), str(tmp_path)) == []
  assert os.listdir(tmp_path) == []


def test_the_newest_complete_checkpoint_is_read_as_the_checkpointer_reads_it(tmp_path):
  config = _config()
  _checkpoint(tmp_path, config, step=2)
  _checkpoint(tmp_path, config, step=4)
  directory = tmp_path / "checkpoints"
  (directory / "6.orbax-checkpoint-tmp-1").mkdir()  # a save still being written
  with Checkpointer(str(directory), async_save=False) as checkpointer:
    assert latest_metadata(str(directory)) == checkpointer.latest_metadata()
  assert latest_metadata(str(directory))["step"] == 4
  os.remove(directory / "4" / "metadata" / "metadata")  # damaged: the trainer names it
  assert latest_metadata(str(directory)) is None


def _local(workdir, *flags):
  return subprocess.run([sys.executable, "-m", "rlax_ps", "local",
                         "--config=configs/rl_local.py:tiny", f"--workdir={workdir}",
                         "--progress=false", "--config.optimizer.min_lr_ratio=0.1", *flags],
                        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_rlax_ps_local_refuses_or_says_before_it_starts_anything(tmp_path):
  """The command: exit 2 with the refusal; the schedule line on stdout (here the run then
  stops at a bad local.workers, before the warm start)."""
  _checkpoint(tmp_path, _config())
  proc = _local(tmp_path, "--config.seed=1")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.startswith(f"rlax-ps local: data: the checkpoint in "
                                f"{tmp_path / 'checkpoints'} (step 4) was trained on other "
                                f"data than this config's (seed: 0 in the checkpoint, 1 now)")
  proc = _local(tmp_path, "--config.rl.steps=40", "--config.local.workers=0")
  assert proc.returncode == 2 and "local.workers: expected >= 1" in proc.stderr, proc.stderr
  assert proc.stdout.startswith(KEEPS_DECAY), proc.stdout
  assert sorted(os.listdir(tmp_path)) == ["checkpoints"]  # nothing started


@pytest.mark.slow
def test_the_rl_trainer_refuses_in_the_same_words(tmp_path):
  """A checkpoint the RL trainer wrote, resumed on another seed: its refusal and the one
  `rlax-ps local` prints are the same text."""
  from rlax_ps.train.rl import RLTrainer
  config = _config()
  config.checkpoint.async_save = False
  with RLTrainer(config, str(tmp_path), object()) as trainer:
    trainer.save()
  config.seed = 1
  with pytest.raises(ValueError) as trainer:
    RLTrainer(config, str(tmp_path), object())
  with pytest.raises(ValueError) as local:
    resume_lines(config, str(tmp_path))
  assert str(local.value) == str(trainer.value)
