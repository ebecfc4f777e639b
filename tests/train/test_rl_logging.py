"""The RL trainer's step figures, recomputed from their inputs: staleness (versions behind the
weights a step trained, in steps.jsonl and TensorBoard alike), samples per second (steady
state, not the loop's start), and the summary's sync cost."""

import json
import types

import numpy as np
import pytest

from rlax_ps.train.rl import RLTrainer, StepRate, group_of, pass_at_n
from rlax_ps.train.rl_loss import LossConfig
from rlax_ps.train.rollouts import BatchShape, Group


class Writer:
  """A SummaryWriter that keeps what it is given."""

  def __init__(self):
    self.scalars, self.histograms = {}, {}

  def add_scalar(self, tag, value, step):
    self.scalars[tag] = (value, step)

  def add_histogram(self, tag, values, step):
    self.histograms[tag] = (np.asarray(values), step)


def _group(rollout_id, version, rewards, passed=None):
  return Group(rollout_id=rollout_id, prompt_tokens=np.asarray([1, 2], np.int32),
               responses=tuple(np.asarray([3, 4], np.int32) for _ in rewards),
               behaviour_logp=tuple(np.zeros(2, np.float32) for _ in rewards),
               rewards=np.asarray(rewards, np.float32), policy_version=version,
               passed=None if passed is None else tuple(passed))


def _trainer(version):
  stats = types.SimpleNamespace(workers_alive=2)
  return types.SimpleNamespace(
      version=version, saved_version=-1, _restart_version=0, shape=BatchShape(groups=2, samples=2, prompt_len=4, response_len=8),
      tokenizer=types.SimpleNamespace(stop_ids=(0,)), dynamic=None, selective=False,
      rollout_wait_s=0.0, left_out=[], loss_cfg=LossConfig(),
      writer=Writer(), client=types.SimpleNamespace(stats=lambda: stats))


def _batch(rewards, mask):
  return {"rewards": np.asarray(rewards, np.float32),
          "sample_mask": np.asarray(mask, np.float32),
          "response_tokens": np.zeros((2, 2, 8), np.int32)}


METRICS = {"loss": 0.5, "iw_mean": 1.0, "entropy": 2.0, "clip_frac": 0.25}


def test_staleness_is_versions_behind_the_trained_weights_in_the_log_and_tensorboard():
  trainer = _trainer(version=5)
  groups = [_group(1, 5, [1.0, 0.0]), _group(2, 3, [0.0, 0.0])]
  record = RLTrainer._step_record(trainer, 6, groups, _batch([[1, 0], [0, 0]], [[1, 1], [1, 1]]),
                                  METRICS, 3.0)
  assert record["staleness"] == [0, 2]
  assert record["staleness_mean"] == 1.0 and record["staleness_max"] == 2
  trainer.version = 6  # the step's publication comes between the record and the log
  RLTrainer._log_step(trainer, record, METRICS)
  hist, step = trainer.writer.histograms["rollouts/staleness"]
  assert step == 6 and sorted(hist.tolist()) == [0, 2]
  assert trainer.writer.scalars["rollouts/staleness_max"] == (2, 6)
  assert trainer.writer.scalars["rollouts/samples_per_second"] == (3.0, 6)
  json.dumps(record)  # a steps.jsonl line


def test_staleness_across_a_restart_counts_from_the_restored_weights_not_version_numbers():
  """A restart republishes its checkpoint's weights (v8) as v12; one publication on (v13), a
  group sampled by v8 is 1 version behind (not 5), one of v7 2, one of a lost step's v10 (a
  branch the restart left) 3, and one of the restart's own v12 counts as before."""
  trainer = _trainer(version=13)
  trainer.saved_version, trainer._restart_version = 8, 12
  groups = [_group(1, 8, [1.0, 0.0]), _group(2, 7, [0.0, 0.0]), _group(3, 10, [1.0, 1.0]),
            _group(4, 12, [0.0, 1.0])]
  record = RLTrainer._step_record(trainer, 10, groups, _batch([[1, 0], [0, 0]], [[1, 1], [1, 1]]),
                                  METRICS, 3.0)
  assert record["staleness"] == [1, 2, 3, 1]
  assert record["staleness_max"] == 3


def test_reward_mean_and_pass_at_n_count_real_samples_only():
  trainer = _trainer(version=1)
  groups = [_group(1, 1, [1.0], [True]), _group(2, 1, [0.0, 0.5], [False, False])]
  # The first row's second slot is padding (its reward slot holds junk).
  record = RLTrainer._step_record(trainer, 1, groups, _batch([[1, 9], [0, 0.5]],
                                                             [[1, 0], [1, 1]]), METRICS, 0.0)
  assert record["reward_mean"] == pytest.approx(0.5)
  assert record["pass_at_n"] == 0.5


def test_pass_at_n_is_the_verifiers_verdict_not_a_reward_threshold():
  # A verifier's pass plus a reward model's weighted score: 1.3 failed, 0.6 passed; a
  # reward model's task alone has no verdict and counts in neither share.
  groups = [_group(1, 1, [1.3, 0.2], [False, False]), _group(2, 1, [0.6, 0.1], [True, False]),
            _group(3, 1, [2.0, 1.5])]
  assert pass_at_n(groups) == 0.5
  assert pass_at_n(groups[2:]) is None
  trainer = _trainer(version=1)
  record = RLTrainer._step_record(trainer, 1, groups[2:], _batch([[2.0, 1.5]], [[1, 1]]),
                                  METRICS, 0.0)
  RLTrainer._log_step(trainer, record, METRICS)
  assert record["pass_at_n"] is None and "rollouts/pass_at_n" not in trainer.writer.scalars


def test_the_trainer_reads_each_samples_verdict_from_the_worker():
  from param_server.client import make_sample
  from param_server.protos import param_server_pb2 as pb
  taken = pb.TakenRollout(rollout_id=4, prompt=pb.Prompt(id="p", token_ids=[1, 2]),
                          group=pb.RolloutGroup(prompt_id="p", samples=[
                              make_sample([3], 1.2, metadata={"passed": "0"}),
                              make_sample([4], 0.7, metadata={"passed": "1"})]))
  assert group_of(taken, None).passed == (False, True)
  del taken.group.samples[1].metadata["passed"]  # a worker that sent no verdict
  assert group_of(taken, None).passed is None


def test_samples_per_second_leaves_out_the_loops_start_and_is_over_recent_steps():
  rate = StepRate(window=2, now=0.0)
  assert rate.add(16, now=100.0) == pytest.approx(0.16)  # the first step: compiles and all
  assert rate.add(16, now=101.0) == pytest.approx(16.0)  # not 32 / 101
  assert rate.add(16, now=103.0) == pytest.approx(32 / 3)
  assert rate.add(8, now=104.0) == pytest.approx(24 / 3)  # the window: the last 2 steps


def test_a_loss_that_clips_nothing_logs_no_clip_fraction():
  metrics = {k: v for k, v in METRICS.items() if k != "clip_frac"}  # loss.correction=m2po
  record = RLTrainer._step_record(_trainer(version=1), 1, [_group(1, 1, [1.0, 0.0])],
                                  _batch([[1, 0], [0, 0]], [[1, 1], [0, 0]]), metrics, 0.0)
  assert record["clip_frac"] is None


def test_reward_parts_are_the_means_over_the_steps_samples_and_junk_is_skipped(caplog):
  from param_server.client import make_sample
  from param_server.protos import param_server_pb2 as pb
  trainer = _trainer(version=1)
  trainer.reward_parts_malformed = 0

  def taken(rollout_id, *metas):  # a taken group whose samples carry `metas`
    group = group_of(pb.TakenRollout(
        rollout_id=rollout_id, prompt=pb.Prompt(id="p", token_ids=[1, 2]),
        group=pb.RolloutGroup(prompt_id="p", samples=[
            make_sample([3], 0.0, metadata=m) for m in metas])), None)
    RLTrainer._count_malformed(trainer, group)
    return group

  with caplog.at_level("WARNING"):
    groups = [taken(1, {"passed": "1", "reward/task": "1.0", "reward/think_format": "0.5"},
                    {"reward/task": "0.0", "reward/think_format": "nope"}),
              taken(2, {"reward/task": "0.5", "reward/reward_model": "-2.0", "reward/": "1"})]
  assert caplog.text.count("reward part metadata") == 1  # warned once, counted after
  assert "reward/think_format='nope': expected a finite number; skipped" in caplog.text
  parts = RLTrainer._reward_parts_record(trainer, groups)
  assert parts == {"reward_parts": {"reward_model": -2.0, "task": 0.5, "think_format": 0.5},
                   "reward_parts_malformed": 2}
  record = RLTrainer._step_record(trainer, 1, [_group(1, 1, [1.0, 0.0]), _group(2, 1, [0.5])],
                                  _batch([[1, 0], [0.5, 0]], [[1, 1], [1, 0]]), METRICS, 0.0)
  RLTrainer._log_step(trainer, {**record, **parts}, METRICS)
  assert trainer.writer.scalars["rollouts/reward/task"] == (0.5, 1)
  assert trainer.writer.scalars["rollouts/reward/think_format"] == (0.5, 1)
  json.dumps({**record, **parts})  # a steps.jsonl line
  trainer.reward_parts_malformed = 0
  assert RLTrainer._reward_parts_record(trainer, [_group(3, 1, [1.0])]) == {}  # none carry parts


@pytest.mark.parametrize("field,theirs,ours", [
    ("temperature", "0.7", 1.0), ("top_p", "0.9", 1.0), ("top_k", "20", 0),
    ("min_p", "0.1", 0.0), ("max_new_tokens", "10", 20), ("samples_per_prompt", "1", 4)])
def test_a_group_sampled_with_other_settings_is_refused_naming_the_worker_and_field(
    field, theirs, ours):
  """A worker started with its own --temperature (behaviour log-probs of another
  distribution than the ratios'), --max_new_tokens (samples cut where the overlong penalty
  and truncation masks, judging by the trainer's, see none), --samples_per_prompt...: named
  from the group's metadata (none: an older worker's group, let be)."""
  from ml_collections import config_dict
  from param_server.protos import param_server_pb2 as pb
  from rlax_ps.train.rl import check_sampling, trainer_sampling
  settings = trainer_sampling(config_dict.ConfigDict(
      {"temperature": 1.0, "max_new_tokens": 20, "samples_per_prompt": 4}))
  assert settings[field] == ours
  same = {k: repr(v) if isinstance(v, float) else str(v) for k, v in settings.items()}
  group = pb.RolloutGroup(prompt_id="p1", metadata={**same, "worker": "w0"})
  check_sampling(group, settings)
  check_sampling(pb.RolloutGroup(prompt_id="p2"), settings)
  group.metadata[field] = theirs
  with pytest.raises(ValueError, match=rf"^prompt p1: sampled with {field}={theirs} by worker "
                                       rf"'w0', this trainer's worker.{field}={ours:g}; start "
                                       rf"the workers with the trainer's config \(or the same "
                                       rf"--{field}\)"):
    check_sampling(group, settings)


def test_a_group_sampled_with_another_tokenizer_is_refused_naming_the_worker():
  """A worker started with another tokenizer (another init_from_hf or tokenizer block)
  encodes prompts and decodes answers in another vocabulary: refused, from the identity
  its groups name (none: an older worker's group, let be)."""
  from param_server.protos import param_server_pb2 as pb
  from rlax_ps.tokenizers import CharTokenizer
  from rlax_ps.train.rl import check_tokenizer
  ours, theirs = CharTokenizer().identity, CharTokenizer(alphabet="0123456789+=").identity
  group = pb.RolloutGroup(prompt_id="p1", metadata={"tokenizer": ours, "worker": "w0"})
  check_tokenizer(group, ours)
  check_tokenizer(pb.RolloutGroup(prompt_id="p2"), ours)
  with pytest.raises(ValueError, match=rf"^prompt p1: sampled by worker 'w0' with another "
                                       rf"tokenizer \({ours}\) than this trainer's "
                                       rf"\({theirs}: its vocabulary, chat template and "
                                       rf"chat_kwargs\); start the workers with the "
                                       rf"trainer's config, its --config.tokenizer.\* "
                                       rf"overrides and init_from_hf"):
    check_tokenizer(group, theirs)


def test_the_overlong_penalty_the_advantages_add_is_logged_beside_the_raw_reward():
  """reward_mean is the verifiers' reward; DAPO's soft overlong punishment
  (loss.overlong_buffer) is added inside the loss: logged beside it, over real samples."""
  trainer = _trainer(version=1)
  trainer.loss_cfg = LossConfig(budget=8, overlong_buffer=4)
  batch = {**_batch([[1, 0], [0, 9]], [[1, 1], [1, 0]]),
           "response_lens": np.asarray([[4, 6], [8, 8]], np.int32)}
  record = RLTrainer._step_record(trainer, 1, [_group(1, 1, [1.0, 0.0]), _group(2, 1, [0.0])],
                                  batch, METRICS, 0.0)
  # lengths 4, 6, 8 of a budget of 8, the last 4 tokens a ramp to -1: 0, -0.5, -1
  assert record["overlong_penalty_mean"] == pytest.approx(-0.5)
  assert record["reward_mean"] == pytest.approx(1 / 3)
  RLTrainer._log_step(trainer, record, METRICS)
  assert trainer.writer.scalars["rollouts/overlong_penalty_mean"] == (pytest.approx(-0.5), 1)
