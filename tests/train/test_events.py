"""A trainer's events: TensorBoard always, and a Weights & Biases run (here offline, read
back from its record file) when wandb.project is set, resumed under the trainer's id."""

import glob
import json
import os
import re
import struct
import sys
import time

import pytest

from rl_testlib import tb_events
from rlax_ps.train.events import Events, NoEvents, open_jsonl, open_wandb
from rlax_ps.train.run import TrainerRun

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402 - after the skip


@pytest.fixture(autouse=True, scope="module")
def _no_wandb_service_left():
  """wandb's service process (wandb-core) lives as long as the process that started it:
  ended with this module, not left in the xdist worker for the rest of the suite."""
  yield
  wandb.teardown()
  assert not [c for c in _children() if "wandb" in c], _children()


def _children():
  """The command lines of this process's children (Linux)."""
  out = []
  for pid in os.listdir("/proc"):
    try:
      with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rpartition(")")[2].split()[1])
      if ppid == os.getpid():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          out.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
    except (OSError, ValueError, IndexError):
      continue
  return out


@pytest.fixture(autouse=True)
def offline(monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")


def _records(run_dir):
  """The protobuf records of an offline run's .wandb file (a leveldb-style log of 32 KiB
  blocks, each record a 7-byte header: crc, length, type 1 full / 2 first / 3 middle /
  4 last)."""
  (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  with open(path, "rb") as f:
    data = f.read()
  assert data[:4] == b":W&B"
  pos, pending = 7, b""
  while pos + 7 <= len(data):
    left = 32768 - pos % 32768
    _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
    if length == 0 and kind == 0:
      pos += left
      continue
    pending += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      pending = b""
      yield record


def _finished(run_dir, wait_s=60.0):
  """The run's records once its exit record is on disk: wandb's service process writes the
  offline file after finish() returns."""
  deadline = time.monotonic() + wait_s
  while True:
    records = list(_records(run_dir))
    if any(r.WhichOneof("record_type") == "exit" for r in records) or (
        time.monotonic() > deadline):
      return records
    time.sleep(0.05)


def _history(run_dir):
  rows = []
  for r in _finished(run_dir):
    if r.WhichOneof("record_type") == "history":
      rows.append({(i.key or "/".join(i.nested_key)): i.value_json for i in r.history.item})
  return rows


def test_scalars_and_histograms_reach_tensorboard_and_the_wandb_run(tmp_path):
  run = open_wandb({"project": "p"}, run_id="rl-1234", name="n", directory=str(tmp_path),
                   config={"rl": {"steps": 3}})
  events = Events(str(tmp_path / "tb"), run)
  events.add_scalar("rollouts/reward_mean", 0.25, 1)
  events.add_scalar("train/loss", 2.0, 1)
  events.add_histogram("rollouts/staleness", [0, 1, 1], 1)
  events.add_scalar("rollouts/reward_mean", 0.5, 2)
  events.add_scalar("eval/exact_match/all", 0.75, 1)  # a round that evaluated step 1
  events.add_scalar("eval/pass@8", 0.5, 3)  # (tensorboardX read it "eval/pass_8")
  events.close()
  assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
  (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*-rl-1234"))
  rows = _history(run_dir)
  # Each row holds the trainer's step as the x value, a late one too (W&B dropped a value
  # logged at a step below its last).
  assert [(r["trainer/step"], r.get("rollouts/reward_mean"), r.get("train/loss"),
           r.get("eval/exact_match/all")) for r in rows] == [
      ("1", "0.25", "2", None), ("2", "0.5", None, None), ("1", None, None, "0.75"),
      ("3", None, None, None)]
  assert rows[-1]["eval/pass_at_8"] == "0.5"  # the tag TensorBoard shows, in W&B too
  assert "eval/pass_at_8" in {v.tag for e in tb_events(str(tmp_path / "tb"))
                              for v in e.summary.value}
  assert rows[0]["rollouts/staleness/_type"] == '"histogram"'
  (meta,) = [r.run for r in _finished(run_dir) if r.WhichOneof("record_type") == "run"]
  assert (meta.run_id, meta.project) == ("rl-1234", "p")
  assert "rl" in meta.config.SerializeToString().decode(errors="replace")


class FakeTrainer(TrainerRun):
  """The parts of a trainer its events need."""

  def __init__(self, workdir, project):
    self.config = {"wandb": {"project": project}, "seed": 0}
    self.checkpointer = None
    self.open_workdir(str(workdir), lambda: None)

  def close(self):
    self._writer.close()
    self.release_workdir()


def test_a_rerun_on_the_workdir_logs_to_the_same_wandb_run(tmp_path):
  for _ in range(2):
    trainer = FakeTrainer(tmp_path / "work", "p")
    trainer.writer.add_scalar("train/loss", 1.0, 1)
    trainer.close()
  runs = glob.glob(str(tmp_path / "work" / "wandb" / "offline-run-*"))
  ids = [r.run.run_id for d in runs for r in _finished(d) if r.WhichOneof("record_type") == "run"]
  assert len(ids) == 2 and len(set(ids)) == 1 and re.fullmatch("fake-[0-9a-f]{8}", ids[0])
  plain = FakeTrainer(tmp_path / "plain", "")
  assert plain.writer.wandb_run is None and not os.path.exists(tmp_path / "plain" / "wandb")
  plain.close()


def test_wandb_that_cannot_start_is_refused_naming_the_field(tmp_path, monkeypatch):
  def refuse(**kwargs):
    raise RuntimeError("api_key not configured (no-tty)")

  monkeypatch.setattr(wandb, "init", refuse)
  with pytest.raises(ValueError, match=r"^wandb.project: Weights & Biases run 'fake-[0-9a-f]{8}' "
                                       r"of project 'p' did not start: RuntimeError: api_key"):
    FakeTrainer(tmp_path / "work", "p")
  FakeTrainer(tmp_path / "work", "").close()  # the refused trainer left the workdir free
  monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
  with pytest.raises(ValueError, match=r"wandb.project: .* needs the wandb package: pip "
                                       r"install 'rlax-ps\[wandb\]'"):
    open_wandb({"project": "p"}, run_id="x", name="x", directory=str(tmp_path), config={})
  assert open_wandb({"project": ""}, run_id="x", name="x", directory=str(tmp_path),
                    config={}) is None


def _tensorboard_texts(directory):
  """(tag, step, text) of the text summaries in the TensorBoard files of `directory`."""
  return [(v.tag, e.step, v.tensor.string_val[0].decode()) for e in tb_events(directory)
          for v in e.summary.value if v.metadata.plugin_data.plugin_name == "text"]


def test_a_table_reaches_tensorboards_text_tab_and_the_wandb_run(tmp_path):
  run = open_wandb({"project": "p"}, run_id="rl-5678", name="n", directory=str(tmp_path),
                   config={})
  events = Events(str(tmp_path / "tb"), run)
  events.add_table("rollouts/completions", ("prompt", "completion", "reward"),
                   [["1+1=", "2 | x\ny", 1.0], ["1+1=", "3", 0.0]], 4)
  events.close()
  assert _tensorboard_texts(str(tmp_path / "tb")) == [(
      "rollouts/completions/text_summary", 4,
      "| prompt | completion | reward |\n|---|---|---|\n| 1+1= | 2 \\| x<br>y | 1 |\n"
      "| 1+1= | 3 | 0 |")]  # a completion's pipe and line break stay in its cell
  (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*-rl-5678"))
  (row,) = _history(run_dir)
  assert row["trainer/step"] == "4" and row["rollouts/completions/_type"] == '"table-file"'
  with open(os.path.join(run_dir, "files", json.loads(row["rollouts/completions/path"]))) as f:
    assert json.load(f) == {"columns": ["prompt", "completion", "reward"],
                            "data": [["1+1=", "2 | x\ny", 1.0], ["1+1=", "3", 0.0]]}
  NoEvents().add_table("rollouts/completions", ("a",), [[1]], 4)  # not process 0: nothing


def test_a_resumed_runs_step_log_drops_the_lines_of_steps_it_does_again(tmp_path):
  """A kill -9 after step 5's line and before its checkpoint (at 3): the rerun does steps 4
  and 5 again, so their first lines go (each step then has one line), torn line and all; the
  lines kept are as written."""
  from rlax_ps.train.events import open_steps_jsonl, read_jsonl
  path = str(tmp_path / "steps.jsonl")
  kept = [json.dumps({"step": s, "x": s}, indent=None, separators=(",", ":")) + "\n"
          for s in range(1, 4)]
  with open(path, "w") as f:
    f.write("".join(kept) + json.dumps({"step": 4}) + "\n[]\n" + json.dumps({"step": 5})
            + "\n" + '{"st')
  with open_steps_jsonl(path, 3) as f:
    f.write(json.dumps({"step": 4, "x": 40}) + "\n")
  assert [(r["step"], r["x"]) for r in read_jsonl(path)] == [(1, 1), (2, 2), (3, 3), (4, 40)]
  assert open(path).read().startswith("".join(kept))
  open_steps_jsonl(path, 4).close()  # nothing past the checkpoint: kept as it is
  assert len(read_jsonl(path)) == 4 and not os.path.exists(path + ".tmp")


def test_a_resumed_run_purges_tensorboards_points_of_the_steps_it_does_again(tmp_path):
  """The steps a kill undid were logged again beside the first run's points (two a step);
  the resumed writer starts with a START session at its first step, from which TensorBoard
  drops the earlier files' points."""
  class Resumed(FakeTrainer):
    step = 4

  trainer = Resumed(tmp_path / "work", "")
  trainer.writer.add_scalar("rollouts/reward_mean", 0.5, 5)
  trainer.close()
  starts = [e for e in tb_events(str(tmp_path / "work" / "tb"))
            if e.HasField("session_log") and e.session_log.status == e.session_log.START]
  assert [e.step for e in starts] == [5]


def test_a_line_appended_after_a_torn_one_starts_a_line_of_its_own(tmp_path):
  """A kill tore the last line (no newline): the next record is not glued to it."""
  path = tmp_path / "steps.jsonl"
  path.write_text('{"step": 1}\n{"step": 2, "rew')
  with open_jsonl(str(path)) as f:
    f.write(json.dumps({"step": 2}) + "\n")
  lines = path.read_text().splitlines()
  assert lines[:2] == ['{"step": 1}', '{"step": 2, "rew'] and json.loads(lines[2]) == {"step": 2}
  with open_jsonl(str(path)) as f:  # a whole last line: nothing added before the next
    f.write(json.dumps({"step": 3}) + "\n")
  assert len(path.read_text().splitlines()) == 4
