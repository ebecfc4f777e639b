"""A run resumed on its workdir with a changed setting: another data source is refused naming
the fields (or, with data.allow_new_source, fed from its start), a decaying lr schedule keeps
its horizon when the run's length changes, and a constant one takes a new length quietly."""

import json
import os

import pytest

from rlax_ps import optim
from rlax_ps.config_files import load
from rlax_ps.train.rl import RLTrainer
from rlax_ps.train.run import data_source_changes, resumed_optimizer
from rlax_ps.train.sft import SFTTrainer

from rl_testlib import rl_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DECAYING = {"lr": 1.0, "warmup_steps": 2, "min_lr_ratio": 0.1}


def _write(path, start, n=6):
  path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1),
                                      "task": "addition"}) + "\n"
                          for i in range(start, start + n)))
  return str(path)


def test_a_longer_run_keeps_a_decaying_schedule_on_its_curve():
  """Raising the steps mid-run or after the end: the lr goes on as the checkpoint's schedule
  had it (at its floor past the end), not up the curve stretched over the new length."""
  saved = optim.schedule_settings(DECAYING, 10)
  for step in (5, 10):
    cfg, line = optim.resumed_optimizer_config(DECAYING, 40, saved, step, "rl.steps")
    assert cfg["decay_steps"] == 10
    before = float(optim.learning_rate_schedule(DECAYING, 10)(step))
    assert float(optim.learning_rate_schedule(cfg, 40)(step)) == pytest.approx(before)
    assert "rl.steps is 40 now" in line and "optimizer.decay_steps" in line
  assert float(optim.learning_rate_schedule(cfg, 40)(30)) == pytest.approx(0.1)


def test_a_constant_schedule_takes_a_new_length_quietly():
  constant = dict(DECAYING, min_lr_ratio=1.0)
  saved = optim.schedule_settings(constant, 10)
  assert optim.resumed_optimizer_config(constant, 40, saved, 10, "rl.steps") == (constant, None)


def test_a_changed_schedule_is_applied_and_the_lr_it_moves_to_is_said():
  saved = optim.schedule_settings(DECAYING, 10)
  cfg, line = optim.resumed_optimizer_config(dict(DECAYING, decay_steps=40), 40, saved, 10,
                                             "rl.steps")
  assert cfg["decay_steps"] == 40
  assert ("optimizer.decay_steps: 10 in the checkpoint, 40 now): the next step's lr is 0.8"
          in line and "0.1 on the checkpoint's" in line)
  _, line = optim.resumed_optimizer_config(dict(DECAYING, lr=0.5), 10, saved, 4, "rl.steps")
  assert "optimizer.lr: 1.0 in the checkpoint, 0.5 now" in line


def test_a_checkpoint_without_a_schedule_follows_the_config_it_saved():
  metadata = {"config": {"optimizer": DECAYING, "train": {"steps": 10}}}
  assert optim.saved_schedule(metadata, "train.steps") == optim.schedule_settings(DECAYING, 10)
  assert optim.saved_schedule({"model_config": {}}, "train.steps") is None
  assert optim.saved_schedule(None, "train.steps") is None


def test_data_source_changes_name_contents_not_paths():
  was = {"seed": 0, "jsonl": "a.jsonl", "records": 6, "digest": "aa"}
  assert data_source_changes(was, dict(was, jsonl="moved/a.jsonl")) == []
  assert data_source_changes(was, dict(was, digest="bb")) == [
      "data.jsonl: a.jsonl (6 records, digest aa) in the checkpoint, a.jsonl (6 records, "
      "digest bb) now"]
  tasks = {"seed": 0, "tasks": {"addition": {"weight": 1.0, "max_digits": 2},
                                "reversal": {"weight": 1.0, "max_len": 6}}}
  now = {"seed": 1, "tasks": {"addition": {"weight": 2.0, "max_digits": 2}}}
  assert data_source_changes(tasks, now) == [
      "seed: 0 in the checkpoint, 1 now", "tasks.addition.weight: 1.0 in the checkpoint, 2.0 now",
      "tasks.reversal.weight: 1.0 in the checkpoint, 0.0 now"]


def test_clipping_turned_on_or_off_on_resume_is_refused_naming_clip_norm():
  """It adds or removes a part of the optimizer state: the restore failed deep in orbax with
  'a changed optimizer?' and no field named."""
  saved = {"step": 3, "config": {"optimizer": {"clip_norm": 1.0}}}
  with pytest.raises(ValueError, match=r"optimizer.clip_norm: 1.0 in the checkpoint at step 3, "
                                       r"0.0 now: clipping turned off .* clip_norm > 0"):
    resumed_optimizer(dict(DECAYING, clip_norm=0.0), 10, saved, "rl.steps")
  resumed_optimizer(dict(DECAYING, clip_norm=0.5), 10, saved, "rl.steps")  # still clipped
  with pytest.raises(ValueError, match=r"clip_norm: 1.0 in the checkpoint .* turned off"):
    resumed_optimizer(dict(DECAYING, clip_norm=0.0), 10, {"step": 3, "config": {
        "optimizer": {}}}, "rl.steps")  # (unset: the default, 1.0)
  resumed_optimizer(dict(DECAYING, clip_norm=0.0), 10, {"step": 3}, "rl.steps")  # no record


def _sft_config(**data):
  config = load(os.path.join(REPO, "configs", "sft_tiny.py"), "tiny")
  config.export.hf = False
  config.checkpoint.async_save = False
  config.checkpoint.every_steps = 0  # the last step's alone
  config.data.update(data)
  return config


def test_sft_resumed_on_other_data_is_refused_and_a_longer_run_keeps_its_decay(tmp_path):
  workdir = str(tmp_path / "sft")
  with SFTTrainer(_sft_config(), workdir) as trainer:
    trainer.train(progress=False)
  floor = 3e-3 * 0.1
  longer = _sft_config()
  longer.train.steps = 8
  with SFTTrainer(longer, workdir) as trainer:  # steps 4 -> 8: at the floor, not back up
    assert float(trainer.schedule(4)) == pytest.approx(floor)
  jsonl = _write(tmp_path / "a.jsonl", 0)
  with pytest.raises(ValueError, match=r"data: the checkpoint in .* \(step 4\) was trained on "
                     r"other data than this config's \(data.jsonl: '' \(the tasks addition, "
                     r"reversal\) in the checkpoint, .*a.jsonl \(6 records, digest \w+\) now\)"):
    SFTTrainer(_sft_config(jsonl=jsonl), workdir)
  with SFTTrainer(_sft_config(jsonl=jsonl, allow_new_source=True), workdir) as trainer:
    assert trainer.metadata()["data_source"]["records"] == 6
  # From a file's records to another's: the old stream's record indices (up to 40) were
  # restored onto the new file of 3 (an IndexError), or drew unrelated records mid-epoch.
  big = str(tmp_path / "records")
  first = _sft_config(jsonl=_write(tmp_path / "big.jsonl", 0, n=40))
  first.train.steps = 1
  with SFTTrainer(first, big) as trainer:
    trainer.train(progress=False)
    assert trainer.data.state() != SFTTrainer(first, str(tmp_path / "new")).data.state()
  small = _write(tmp_path / "small.jsonl", 500, n=3)
  with SFTTrainer(_sft_config(jsonl=small, allow_new_source=True), big) as trainer:
    fresh = _sft_config(jsonl=small)
    assert trainer.data.state() == SFTTrainer(fresh, str(tmp_path / "fresh")).data.state()
    trainer.data.batch(1)  # (an IndexError where the old records' place was restored)


def _rl_config(**data):
  config = rl_config("tiny")
  config.data.update(data)
  return config


def test_weighted_files_feed_rl_and_sft_in_proportion_and_other_weights_are_another_source(
    tmp_path):
  """data.weights mixes data.jsonl's files, in the RL trainer's prompt feed (3 of the first
  file's for 1 of the second's) and in the SFT trainer's draws (a weight of 0: none of that
  file); the checkpoint records them, and a rerun with other weights is refused naming
  data.weights (its data position is a position in another mix)."""
  files = f"{_write(tmp_path / 'a.jsonl', 0)},{_write(tmp_path / 'b.jsonl', 100, n=4)}"
  workdir = str(tmp_path / "rl")
  with RLTrainer(_rl_config(jsonl=files, weights="3,1"), workdir, object()) as tr:
    taken = [rec for _, rec in tr.feed.take(200)]
    assert sum(rec["record"] < 6 for rec in taken) == 150
    assert {rec["prompt"] for rec in taken if rec["record"] >= 6} == {
        f"{i}+1=" for i in range(100, 104)}
    tr.save()
    assert tr.metadata()["data_source"]["weights"] == [3.0, 1.0]
  with pytest.raises(ValueError, match=r"\(data.weights: \[3.0, 1.0\] in the checkpoint, "
                                       r"\[1.0, 1.0\] now\)"):
    RLTrainer(_rl_config(jsonl=files, weights="1,1"), workdir, object())
  with pytest.raises(ValueError, match=r"data.weights: expected one weight >= 0 for each of "
                                       r"the 2 file"):
    RLTrainer(_rl_config(jsonl=files, weights="1"), str(tmp_path / "one"), object())
  with pytest.raises(ValueError, match=r"data.weights: expected one weight >= 0 for each of "
                                       r"the 0 file\(s\)"):
    SFTTrainer(_sft_config(weights="1"), str(tmp_path / "tasks"))  # (none to weigh: tasks)
  with SFTTrainer(_sft_config(jsonl=files, weights="0,1"), str(tmp_path / "sft")) as trainer:
    drawn = [trainer.data.records[r["record"]] for _, r in trainer.data.feed.take(100)]
    assert {e.prompt for e in drawn} == {f"{i}+1=" for i in range(100, 104)}
    assert trainer.metadata()["data_source"]["weights"] == [0.0, 1.0]


def test_rl_resumed_on_other_data_is_refused_or_fed_from_its_start(tmp_path):
  """Same path, other contents: refused before any step. With data.allow_new_source the new
  records are fed from the first, numbered on from the checkpoint's position (prompt ids stay
  unique), the old records' streaks dropped. A checkpoint that records no source resumes."""
  workdir, path = str(tmp_path / "rl"), tmp_path / "d.jsonl"
  config = _rl_config(jsonl=_write(path, 0))
  with RLTrainer(config, workdir, object()) as tr:
    tr.feed.take(3)
    tr.consumed, tr.streaks = 3, {0: 1}
    tr.save()
    saved = tr.metadata()
  _write(path, 100)
  with pytest.raises(ValueError, match=r"\(data.jsonl: .*d.jsonl \(6 records, digest \w+\) in "
                     r"the checkpoint, .*d.jsonl \(6 records, digest \w+\) now\)"):
    RLTrainer(config, workdir, object())
  with RLTrainer(_rl_config(jsonl=str(path), allow_new_source=True), workdir, object()) as tr:
    assert tr.feed.position == 3 and tr.streaks == {} and tr.consumed == 3
    (index, rec), = tr.feed.take(1)
    assert index == 3 and rec["prompt"].startswith("10")
    # Ids of its own: a killed run had fed the old source's 3, 4, ... past the checkpoint,
    # which the server still holds (a new prompt of the same id was dropped as a duplicate).
    assert tr._prompt_id(3) == f"{tr.run_id}-s1-3" != f"{tr.run_id}-3"
    assert tr.metadata()["source_tag"] == 1
  legacy = {k: v for k, v in saved.items() if k not in ("data_source", "schedule")}
  with RLTrainer(config, str(tmp_path / "old"), object()) as tr:
    assert not tr.check_data_source(legacy, tr.data_source, "")
    tr._load_metadata(legacy)
    assert tr.feed.position == 3 and tr.streaks == {0: 1}
