"""worker.reward_terms: weighted verifiers added to every sample's reward, their raw values in
the sample's metadata for the trainer's log, the verdict left to the task's verifier."""

import os

import numpy as np
import pytest

from inference_workers.decoding import Sample
from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from param_server.protos import SCORE_ERROR
from param_server.protos import param_server_pb2 as pb
from rlax_ps import sync
from rlax_ps.train.rl import reward_parts_of
from worker_testlib import CONFIG, REPO, SMALL, TOKENIZER, client, enqueue_addition

USER_VERIFIERS = os.path.join(REPO, "tests", "fixtures", "user_verifiers.py")
PROMPT = pb.Prompt(id="p1", text="5+7=", task="addition", extra=b"12")


def _sample(text):
  ids = np.asarray(TOKENIZER.encode(text), np.int32)
  return Sample(ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.float32), "stop")


def _worker(**config):
  return Worker(None, CONFIG, TOKENIZER, WorkerConfig(max_new_tokens=8, **config))


def test_terms_parse_as_name_and_weight():
  config = WorkerConfig(reward_terms=" think_format:0.5, task:addition,math:-1 ,x:y:2")
  assert config.reward_term_weights() == [("think_format", 0.5), ("task:addition", 1.0),
                                          ("math", -1.0), ("x:y", 2.0)]
  assert WorkerConfig().reward_term_weights() == []


@pytest.mark.parametrize("terms, why", [
    ("think_format:", "expected comma-separated NAME:WEIGHT"),
    ("think_format:abc", "expected comma-separated NAME:WEIGHT .*got 'think_format:abc'"),
    ("think_format:nan", ".*WEIGHT a finite float"),
    (":1", "expected comma-separated NAME:WEIGHT"),
    ("math,,think_format", ".*got ''"),
    ("math:1,think_format,math:2", "expected each verifier once .*got 'math'"),
    ("task", ".*none of \\('task', 'reward_model'\\)"),
    ("reward_model:0.5", ".*got 'reward_model'"),
])
def test_bad_terms_are_refused_naming_the_field(terms, why):
  with pytest.raises(ValueError, match="WorkerConfig.reward_terms: " + why):
    WorkerConfig(reward_terms=terms)


def test_a_term_no_verifier_answers_to_is_refused_at_start_naming_the_field():
  with pytest.raises(ValueError, match="WorkerConfig.reward_terms: 'fixture_nope' is neither a "
                                       "built-in task nor a registered verifier"):
    _worker(reward_terms="fixture_nope:1", verifiers=USER_VERIFIERS)


def test_terms_add_their_weighted_rewards_and_travel_raw_to_the_trainer(caplog):
  # fixture_contains: 1.0 when the answer is in the text; fixture_strict_int raises on a
  # text that is not an integer (scored 0, counted, logged).
  worker = _worker(reward_terms="think_format:0.5,fixture_contains:-2,fixture_strict_int",
                   verifiers=USER_VERIFIERS)
  samples = [_sample("12"), _sample("<think>a</think>12")]
  with caplog.at_level("WARNING"):
    rewards, passed, parts, erred = worker._scored(PROMPT, samples)
  assert rewards == [1.0 + 0.5 * 0.0 - 2 * 1.0 + 1.0, 0.0 + 0.5 * 1.0 - 2 * 1.0 + 0.0]
  assert erred == [False, True]  # the term raised on the second: it says so to the trainer
  assert passed == [True, False]  # the task's verifier's, whatever the terms add
  assert parts[1] == {"task": 0.0, "think_format": 1.0, "fixture_contains": 1.0,
                      "fixture_strict_int": 0.0}
  assert worker.stats.score_errors == 1
  assert "reward term 'fixture_strict_int' gave no reward on prompt p1" in caplog.text
  group = worker._group(PROMPT, 0, samples, rewards, passed, parts, erred=erred)
  assert dict(group.samples[0].metadata) == {
      "passed": "1", "reward/task": "1.0", "reward/think_format": "0.0",
      "reward/fixture_contains": "1.0", "reward/fixture_strict_int": "1.0"}
  assert group.samples[1].metadata[SCORE_ERROR] == "1"
  assert reward_parts_of(group.samples) == ({"task": [1.0, 0.0], "think_format": [0.0, 1.0],
                                             "fixture_contains": [1.0, 1.0],
                                             "fixture_strict_int": [1.0, 0.0]}, [])


def test_without_terms_or_a_reward_model_the_samples_carry_the_verdict_alone():
  worker = _worker()
  samples = [_sample("12"), _sample("13")]
  rewards, passed, parts, erred = worker._scored(PROMPT, samples)
  assert (rewards, passed, parts, erred) == ([1.0, 0.0], [True, False], None, [False, False])
  group = worker._group(PROMPT, 0, samples, rewards, passed, parts)
  assert [dict(s.metadata) for s in group.samples] == [{"passed": "1"}, {"passed": "0"}]


@pytest.mark.parametrize("allocator", ["vigor", pytest.param("fixed", marks=pytest.mark.slow)])
def test_a_running_worker_sends_each_samples_parts(server, versions, allocator):
  # vigor: the parts of its rounds gathered per prompt; fixed: a continuous batch's groups.
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    # fixture_strict_int raises on a text that is not an integer: such samples say so
    config = WorkerConfig(max_leases=1, verifiers=USER_VERIFIERS,
                          reward_terms="think_format:-0.5,fixture_strict_int:0",
                          **dict(SMALL, allocator=allocator, samples_per_prompt=4))
    Worker(wc, CONFIG, TOKENIZER, config).run()
    samples = [s for r in trainer.take_rollouts(0, 10).rollouts for s in r.group.samples]
  assert len(samples) == 8
  raised = [not _is_int(s.text) for s in samples]
  assert any(raised)
  for s, erred in zip(samples, raised):  # an untrained model writes no <think> layout: 0
    assert dict(s.metadata) == {"passed": str(int(s.reward == 1.0)),
                                "reward/task": repr(s.reward), "reward/think_format": "0.0",
                                "reward/fixture_strict_int": repr(float(s.reward == 1.0)),
                                **({SCORE_ERROR: "1"} if erred else {})}


def _is_int(text: str) -> bool:
  try:
    int(text.strip())
  except ValueError:
    return False
  return True
