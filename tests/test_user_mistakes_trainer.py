"""A new user's mistakes with the trainer-side commands (`rlax-ps local`, `sft`, `train`,
`eval`): each is refused in one line naming the flag or config field, before anything runs,
rather than a traceback, a late failure in a child or a silently different run."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from absl import app

from rlax_ps import config_files, local
from rlax_ps.folder_lock import FolderInUse, FolderLock
from rlax_ps.train.prompts import read_prompts
from rlax_ps.train.rl_checks import check_rl_config
from rlax_ps.train.run import TrainerRun

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(REPO, "tests", "fixtures", "hf", "llama")


def _config(name: str):
  return config_files.load(os.path.join(REPO, "configs", name), "tiny")


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "rlax_ps", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120)


def test_a_config_file_that_does_not_load_is_one_line_naming_the_flag():
  missing = _cli("local", "--config=configs/nope.py", "--workdir=/nonexistent/x",
                 "--config.rl.steps=2")
  variant = _cli("sft", "--config=configs/sft_tiny.py:tiyn", "--workdir=/nonexistent/x")
  for r in (missing, variant):
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert "--config=configs/nope.py: [Errno 2] No such file" in missing.stderr
  assert "--config=configs/sft_tiny.py:tiyn: ValueError: configs/sft_tiny.py: unknown " \
         "variant 'tiyn'" in variant.stderr


def test_a_config_file_that_is_not_python_is_one_line_naming_its_line(tmp_path):
  (tmp_path / "syn.py").write_text("def get_config(:\n  pass\n")
  done = _cli("sft", f"--config={tmp_path / 'syn.py'}", "--workdir=/nonexistent/x")
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert f"--config={tmp_path / 'syn.py'}: " in done.stderr and "line 1: " in done.stderr


def test_a_prompt_file_that_is_a_folder_empty_or_bad_json_is_named(tmp_path):
  with pytest.raises(ValueError, match="data.jsonl: cannot read .*: Is a directory"):
    read_prompts(str(tmp_path))
  (tmp_path / "empty.jsonl").write_text("")
  with pytest.raises(ValueError, match="data.jsonl: .*empty.jsonl: no prompt records"):
    read_prompts(str(tmp_path / "empty.jsonl"))
  (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 6
                                      + '{"prompt": "3+3=", "answer": 6\n')
  # The error's position is within line 7, not "line 2" of the line and its newline.
  with pytest.raises(ValueError, match="bad.jsonl:7: not JSON: .* line 1 column 31"):
    read_prompts(str(tmp_path / "bad.jsonl"))


def test_a_workdir_that_is_a_file_names_the_flag(tmp_path):
  file = tmp_path / "run"
  file.write_text("")
  with pytest.raises(ValueError, match="--workdir: cannot use .*run as a folder"):
    TrainerRun().open_workdir(str(file), lambda: None)
  with pytest.raises(ValueError, match="--workdir: cannot use .*run/sub as a folder"):
    local.LocalRun(str(file / "sub"), "cfg.py", [], workers=1)


def test_a_workdir_of_tilde_is_the_home_folder_and_an_empty_one_is_refused(tmp_path,
                                                                         monkeypatch):
  """A shell leaves `--workdir=~/run` as it is: it is the home folder's run, not a folder
  named ~ in the current one; --workdir= (an unset $VARIABLE) is refused, not the current
  folder."""
  from rlax_ps.config_files import make_workdir
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  assert make_workdir("~/run") == str(tmp_path / "home" / "run")
  assert (tmp_path / "home" / "run").is_dir() and not (tmp_path / "~").exists()
  with pytest.raises(ValueError, match=r"^--workdir: expected a path, got ''"):
    make_workdir("")
  from param_server.server import ServerConfig
  assert ServerConfig(storage_dir="~/ps").storage_dir == str(tmp_path / "home" / "ps")
  done = _cli("local", "--config=configs/rl_local.py:tiny", "--workdir=")
  assert done.returncode == 2 and "--workdir: expected a path, got ''" in done.stderr, (
      done.stderr[-2000:])


def test_eval_output_that_cannot_be_written_is_refused_before_evaluating(tmp_path):
  done = _cli("eval", "--config=configs/rl_local.py:tiny", f"--checkpoints={LLAMA}",
              f"--output={tmp_path / 'missing' / 'r.json'}")
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert "--output: cannot write" in done.stderr and "exact match" not in done.stdout


def test_a_second_local_run_on_a_workdir_is_refused_before_it_starts(tmp_path):
  first = local.LocalRun(str(tmp_path / "w"), "cfg.py", [], workers=1)
  first.hold_workdir()
  try:
    with pytest.raises(FolderInUse, match=r"--workdir .*w/logs: held by a `rlax-ps local` in "
                                          r"this process that was not closed"):
      local.LocalRun(str(tmp_path / "w"), "cfg.py", [], workers=1).hold_workdir()
  finally:
    first.workdir_lock.release()


def test_a_local_run_on_a_workdir_a_trainer_holds_is_refused_before_it_starts(tmp_path):
  """`rlax-ps train` holds <workdir>/LOCK, `rlax-ps local` <workdir>/logs/LOCK: a local run
  on a running trainer's workdir trained a warm start and started a server and workers in
  it before its trainer was refused."""
  workdir = tmp_path / "w"
  workdir.mkdir()
  trainer = FolderLock(str(workdir), holder="trainer", flag="--workdir")
  try:
    run = local.LocalRun(str(workdir), "cfg.py", [], workers=1)
    with pytest.raises(FolderInUse, match=r"--workdir .*w: held by a trainer in this process"):
      run.hold_workdir()
  finally:
    trainer.release()
  run.hold_workdir()  # the trainer gone: taken, and its own trainer's lock left free
  FolderLock(str(workdir), holder="trainer", flag="--workdir").release()
  run.workdir_lock.release()


def test_a_folder_is_named_in_use_by_another_process_or_freed_with_its_dropped_holder(
    tmp_path):
  """A notebook's trainer dropped unclosed (an interrupted cell) held its workdir for the
  kernel's life, refused as "in use by another trainer" whose pid was the kernel's own. A
  holder in another container may show this process's pid: it is still another's."""
  import gc
  import subprocess
  import sys
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; from rlax_ps.folder_lock import FolderLock; "
       f"lock = FolderLock({str(tmp_path)!r}, holder='trainer', flag='--workdir'); "
       "import os; open(lock.path, 'w').write('%d\\n' % os.getppid()); "
       "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(FolderInUse, match=r"--workdir .*: in use by another trainer \(pid "
                                          r"%d, .*LOCK\); stop it" % os.getpid()):
      FolderLock(str(tmp_path), holder="trainer", flag="--workdir")
  finally:
    holder.kill()
    holder.wait()
  dropped = FolderLock(str(tmp_path), holder="trainer", flag="--workdir")
  with pytest.raises(FolderInUse, match=r"held by a trainer in this process that was not "
                                        r"closed \(an interrupted cell's\?\): call its close"):
    FolderLock(str(tmp_path), holder="trainer", flag="--workdir")
  del dropped
  gc.collect()
  FolderLock(str(tmp_path), holder="trainer", flag="--workdir").release()


@pytest.mark.parametrize("field, value, message", [
    ("max_seconds", -5.0, r"rl.max_seconds: expected seconds >= 0 \(0: no limit\), got -5.0"),
    ("groups_per_step", 0, "rl.groups_per_step: expected >= 1, got 0"),
])
def test_rl_settings_that_would_train_nothing_are_refused(field, value, message):
  config = _config("rl_local.py")
  config.rl[field] = value
  with pytest.raises(ValueError, match=message):
    check_rl_config(config, files=False)


@pytest.mark.parametrize("path", ["checkpoint.every_steps", "eval.every_steps",
                                  "export.every_steps", "export.max_to_keep"])
def test_a_negative_every_steps_is_refused_not_run_every_step(path):
  config = _config("rl_local.py")
  block, key = path.split(".")
  config[block][key] = -1
  with pytest.raises(ValueError, match=rf"{path}: expected a whole number >= 0 \(0: off\), "
                                       r"got -1"):
    check_rl_config(config, files=False)


def test_sft_refuses_bad_data_and_counts_before_its_checkpointer_starts(tmp_path):
  from rlax_ps.train.sft import SFTTrainer
  (tmp_path / "empty.jsonl").write_text("")
  config = _config("sft_tiny.py")
  config.data.jsonl = str(tmp_path / "empty.jsonl")
  with pytest.raises(ValueError, match="data.jsonl: .*no prompt records"):
    SFTTrainer(config, str(tmp_path / "w"))
  # No checkpointer was opened: its background clean-up cannot outlive the command.
  assert not os.path.exists(tmp_path / "w" / "checkpoints")
  config = _config("sft_tiny.py")
  config.train.eval_every = -1
  with pytest.raises(ValueError, match="train.eval_every: expected a whole number >= 0"):
    SFTTrainer(config, str(tmp_path / "w"))
  # A record the tokenizer cannot encode, or too long for data.seq_len: named by its file
  # and line (the line after a blank one, in the second file), not "record 4" or no place.
  (tmp_path / "a.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n\n'
                                    '{"prompt": "2+2=", "answer": "4"}\n')
  for line, message in [('{"prompt": "3+3=", "answer": "6 \u2713"}',
                         "character '\u2713' at position 2 of '6 \u2713' is not in the "
                         "alphabet"),
                        ('{"prompt": "%s=", "answer": "1"}' % ("1" * 300),
                         "data.seq_len: 64 is too small for this record's 303 next-token "
                         "pairs; raise it")]:
    (tmp_path / "b.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n' + line + "\n")
    config = _config("sft_tiny.py")
    config.data.jsonl = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"
    config.data.seq_len = 64
    with pytest.raises(ValueError) as e:
      SFTTrainer(config, str(tmp_path / "w"))
    assert str(e.value).startswith(f"data.jsonl {tmp_path / 'b.jsonl'}:2: "), str(e.value)
    assert message in str(e.value), str(e.value)


def test_sft_says_when_its_held_out_records_are_trained_on(tmp_path, caplog):
  from rlax_ps.train.sft import SFTTrainer
  (tmp_path / "a.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n'
                                    '{"prompt": "2+2=", "answer": "4"}\n')
  (tmp_path / "h.jsonl").write_text('{"prompt": "2+2=", "answer": "4", "task": "addition"}\n'
                                    '{"prompt": "3+3=", "answer": "6", "task": "addition"}\n')
  config = _config("sft_tiny.py")
  config.data.jsonl, config.data.heldout_jsonl = str(tmp_path / "a.jsonl"), str(tmp_path / "h.jsonl")
  with caplog.at_level("WARNING"), SFTTrainer(config, str(tmp_path / "w")) as trainer:
    assert trainer.heldout.size == 2
  assert ("data.heldout_jsonl: 1 of its 2 prompts are also in data.jsonl (e.g. '2+2='): their "
          "held-out score is a training score") in caplog.text


def test_an_init_from_hf_folder_without_a_checkpoint_names_the_field(tmp_path):
  from rlax_ps.train.sft import SFTTrainer
  config = _config("sft_tiny.py")
  config.init_from_hf = str(tmp_path)
  with pytest.raises(ValueError, match="init_from_hf: no config.json"):
    SFTTrainer(config, str(tmp_path / "w"))


@pytest.fixture
def misshapen(tmp_path):
  """The llama fixture with a config.json whose MLP width its tensors do not have."""
  path = tmp_path / "misshapen"
  shutil.copytree(LLAMA, path)
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
  return str(path)


def test_init_from_hf_tensors_that_do_not_fit_its_config_name_the_field(misshapen):
  import jax

  from rlax_ps import sharding as shd
  from rlax_ps.models.hf import read_hf_config
  from rlax_ps.train.state import hf_params
  mesh = shd.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  with pytest.raises(ValueError, match=f"init_from_hf: HF checkpoint '{misshapen}': tensor "
                                       ".*expected shape"):
    hf_params(read_hf_config(misshapen), mesh, misshapen)


def test_eval_of_a_checkpoint_whose_tensors_do_not_fit_names_the_flag(misshapen):
  from rlax_ps.train.eval_main import evaluate_checkpoint
  with pytest.raises(app.UsageError, match=f"--checkpoints: checkpoint {misshapen}: tensor "
                                           ".*expected shape"):
    evaluate_checkpoint(_config("rl_local.py"), misshapen, tokenizer=object())


def test_a_folder_whose_filesystem_cannot_lock_is_named_so_not_blamed_on_a_holder(
    tmp_path, monkeypatch):
  """flock's ENOLCK (NFS without lockd) read as "in use by another trainer (pid ...)"."""
  import errno
  import fcntl

  def no_locks(fd, op):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

  monkeypatch.setattr(fcntl, "flock", no_locks)
  with pytest.raises(FolderInUse, match=r"--workdir .*: cannot lock .*LOCK \(No locks "
                                        r"available\): its filesystem does not support locks"):
    FolderLock(str(tmp_path), holder="trainer", flag="--workdir")
