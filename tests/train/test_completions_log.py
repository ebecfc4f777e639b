"""The completions log (log.completions_every, log.completions_groups): every so many steps the
step's first groups, as the workers submitted them, with the advantages they were trained
with, in <workdir>/completions.jsonl and a table in the events; bad settings are refused
naming the field."""

import json
import os
import types

import numpy as np
import pytest

from param_server.client import make_sample
from param_server.protos import param_server_pb2 as pb
from rl_testlib import FakeWorker, client, rl_config, start_server
from rlax_ps.tokenizers import CharTokenizer
from rlax_ps.train.events import open_steps_jsonl
from rlax_ps.train.rl import COMPLETION_COLUMNS, RLTrainer
from rlax_ps.train.rl_checks import check_rl_config
from rlax_ps.train.rl_loss import LossConfig
from rlax_ps.train.rollouts import BatchShape, build_batch

TOK = CharTokenizer()
# Per group of a step: its samples' rewards; the first group spans two packed rows.
REWARDS = ([1.0, 0.0, 0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 1.0, 1.0])


class Writer:
  """An events writer that keeps the tables it is given, by step."""

  def __init__(self):
    self.tables = {}

  def add_table(self, tag, columns, rows, step):
    self.tables[step] = (tag, tuple(columns), rows)


def _trainer(workdir, every, groups):
  """The parts of an RLTrainer that take groups and log their completions."""
  return types.SimpleNamespace(
      consumed=0, version=3, _restart_floor=None, skip_ids=set(), skip_prompts={},
      selective=False, dynamic=None, fixed_groups=False,  # (VIGOR: groups of 4 to 6)
      outstanding={},
      _told_routes=False, tokenizer=TOK, model_config=types.SimpleNamespace(
          vocab_size=TOK.vocab_size),
      shape=BatchShape(groups=len(REWARDS), samples=4, prompt_len=8, response_len=8),
      taken_shape=BatchShape(groups=len(REWARDS), samples=4, prompt_len=8, response_len=8),
      teacher_tokenizer=None, sampling={}, tokenizer_identity=TOK.identity,
      loss_cfg=LossConfig(budget=8), completions_every=every, completions_groups=groups,
      _taken={}, workdir=str(workdir), writer=Writer(),
      _completions_log=open_steps_jsonl(os.path.join(workdir, "completions.jsonl"), 0)
      if every else None)


def _taken(step, g):
  """A taken group as a worker submits it; its second sample came without text."""
  text = f"{step}+{g}="
  samples = []
  for j, reward in enumerate(REWARDS[g]):
    answer = f"{step + g + j}|\n"
    samples.append(make_sample(TOK.encode(answer) + [TOK.eos_id], reward,
                               text="" if j == 1 else answer,
                               logprobs=np.zeros(len(answer) + 1),
                               finish_reason="length" if j == 2 else "stop"))
  return pb.TakenRollout(
      rollout_id=10 * step + g, worker_id=f"w-{g}",
      prompt=pb.Prompt(id=f"p-{step}-{g}", text=text, task="addition",
                       token_ids=TOK.encode_prompt(text), extra=str(step + g).encode()),
      group=pb.RolloutGroup(prompt_id=f"p-{step}-{g}", samples=samples,
                            policy_version=step - 1))


def _steps(trainer, steps):
  """Take, pack and log `steps` steps as the trainer's loop does; the taken groups by id."""
  taken = {}
  for step in range(1, steps + 1):
    takes = [_taken(step, g) for g in range(len(REWARDS))]
    taken.update((t.rollout_id, t) for t in takes)
    groups = RLTrainer._valid_groups(trainer, takes)
    RLTrainer._log_completions(trainer, step, groups, build_batch(groups, trainer.shape,
                                                                  TOK.pad_id))
    assert trainer._taken == {}  # nothing kept past its step
  return taken


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_the_first_groups_are_logged_as_submitted_at_the_configured_steps_only(tmp_path):
  trainer = _trainer(tmp_path, every=2, groups=2)
  taken = _steps(trainer, 5)
  lines = _lines(tmp_path / "completions.jsonl")
  assert [(r["step"], r["prompt_id"]) for r in lines] == [
      (2, "p-2-0"), (2, "p-2-1"), (4, "p-4-0"), (4, "p-4-1")]
  for r in lines:
    t = taken[r["rollout_id"]]
    assert (r["prompt"], r["answer"], r["task"], r["worker_id"], r["policy_version"]) == (
        t.prompt.text, t.prompt.extra.decode(), "addition", t.worker_id, r["step"] - 1)
    samples = r["samples"]
    assert [s["completion"] for s in samples] == [
        TOK.decode(s.token_ids) for s in t.group.samples]  # the text, or its tokens decoded
    assert [s["completion"] for s in samples][0] == t.group.samples[0].text
    assert [s["reward"] for s in samples] == [s.reward for s in t.group.samples]
    assert [s["tokens"] for s in samples] == [len(s.token_ids) for s in t.group.samples]
    assert [s["finish_reason"] for s in samples] == [s.finish_reason for s in t.group.samples]
    rewards = np.asarray(REWARDS[int(r["prompt_id"][-1])])  # GRPO: over the whole group
    want = (rewards - rewards.mean()) / rewards.std(ddof=1)
    np.testing.assert_allclose([s["advantage"] for s in samples], want, rtol=1e-4)
  assert sorted(trainer.writer.tables) == [2, 4]
  tag, columns, rows = trainer.writer.tables[4]
  assert (tag, columns) == ("rollouts/completions", COMPLETION_COLUMNS)
  assert len(rows) == len(REWARDS[0]) + len(REWARDS[1])  # a row per sample
  assert rows[0] == ["p-4-0", 3, "w-0", "4+0=", "4", "4|\n", 1.0, pytest.approx(
      lines[2]["samples"][0]["advantage"]), 4, "stop"]


def test_a_log_that_is_off_writes_nothing_and_keeps_nothing(tmp_path):
  trainer = _trainer(tmp_path, every=0, groups=2)
  _steps(trainer, 2)
  assert not os.path.exists(tmp_path / "completions.jsonl") and not trainer.writer.tables


@pytest.mark.parametrize("fields, message", [
    ({"completions_every": -1}, r"log.completions_every: expected a whole number >= 0, got -1"),
    ({"completions_groups": -2}, r"log.completions_groups: expected a whole number >= 0, got -2"),
    ({"completions_every": 5, "completions_groups": 0},
     r"log.completions_groups: expected >= 1 while log.completions_every=5"),
])
def test_bad_settings_are_refused_naming_the_field(fields, message):
  config = rl_config()
  config.log.update(fields)
  with pytest.raises(ValueError, match=message):
    check_rl_config(config, files=False)
  config.log.update(completions_every=0, completions_groups=0)  # off
  check_rl_config(config, files=False)


class KeepingWorker(FakeWorker):
  """A fake worker that keeps each group it submits, by prompt id."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.groups = {}

  def group(self, prompt_id, version, uniform=False):
    self.groups[prompt_id] = super().group(prompt_id, version, uniform)
    return self.groups[prompt_id]


@pytest.mark.slow
def test_a_trainer_logs_what_its_workers_submitted(tmp_path):
  server = start_server(tmp_path / "ps")
  worker = KeepingWorker(server.address, samples=4).start()
  config = rl_config()
  config.rl.steps, config.eval.num_examples, config.eval.batch_size = 2, 2, 2
  config.export.hf = False
  config.log.update(completions_every=2, completions_groups=3)
  os.makedirs(tmp_path / "rl")  # a line of a step a kill undid (past the checkpoint's, 0)
  (tmp_path / "rl" / "completions.jsonl").write_text('{"step": 2, "prompt_id": "undone"}\n{"st')
  try:
    with client(server.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"),
                                                            tc) as tr:
      tr.train()
      tokenizer = tr.tokenizer
  finally:
    worker.stop()
    server.stop(grace=0)
  steps = _lines(tmp_path / "rl" / "steps.jsonl")
  lines = _lines(tmp_path / "rl" / "completions.jsonl")
  assert [r["step"] for r in lines] == [2, 2, 2]
  assert [r["rollout_id"] for r in lines] == steps[1]["rollout_ids"][:3]
  for r in lines:
    sent = worker.groups[r["prompt_id"]]
    assert [s["completion"] for s in r["samples"]] == [tokenizer.decode(s.token_ids)
                                                       for s in sent.samples]
    assert [s["reward"] for s in r["samples"]] == [s.reward for s in sent.samples]
    assert r["policy_version"] == sent.policy_version
    assert r["prompt"] and r["answer"] and r["worker_id"]
