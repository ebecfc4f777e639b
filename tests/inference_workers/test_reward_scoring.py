"""The worker's reward model: what it reads for each sample (the conversation under its own
chat template, or the policy's ids) and the rewards the worker gives from it."""

import json
import os
import shutil

import numpy as np
import pytest

from algorithms.environments import conversation
from inference_workers.decoding import Sample
from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from param_server.protos import param_server_pb2 as pb
from rlax_ps.models import ModelConfig
from rlax_ps.reward_scoring import RewardScorer, prompt_messages
from rlax_ps.tokenizers import CharTokenizer, HFTokenizer
from tests.models.hf_fixtures import FIXTURES

RM = os.path.join(FIXTURES, "qwen3_reward")
REF = np.load(os.path.join(RM, "reference.npz"))
POLICY = CharTokenizer()
POLICY_CONFIG = ModelConfig(vocab_size=POLICY.vocab_size, hidden_size=32, intermediate_size=48,
                            num_layers=1, num_heads=4, num_kv_heads=2,
                            max_position_embeddings=64)


@pytest.fixture(scope="module")
def rm_with_tokenizer(tmp_path_factory):
  """The reward model folder with the chat tokenizer (ChatML template) beside it."""
  path = tmp_path_factory.mktemp("rm") / "rm"
  shutil.copytree(RM, path)
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(FIXTURES, "chat_tokenizer", f), path / f)
  return str(path)


def test_padded_batches_score_as_transformers_does_on_the_policys_ids():
  scorer = RewardScorer(RM, POLICY, "float32", batch_size=2)
  assert scorer.tokenizer is None  # no tokenizer.json: it reads the policy's ids
  tokens = REF["tokens"]
  rows = [tokens[0], tokens[1][:14], tokens[2]]  # row 1 without its pad tail
  assert scorer.encode([], "", "", rows[1]) == list(rows[1])
  np.testing.assert_allclose(scorer.scores(rows), REF["scores"][:, 0], rtol=2e-5, atol=2e-5)


def test_on_the_workers_devices_the_model_splits_and_scores_as_on_one():
  worker = _worker(RM, devices=4, tensor_parallel=2)  # data 2 x tensor 2
  scorer = worker.reward_scorer
  assert scorer.mesh is worker.mesh
  q = scorer.model.body.layers[0].attn.q_proj.kernel[...]
  assert q.sharding.shard_shape(q.shape) == (q.shape[0], q.shape[1] // 2)  # heads over tensor
  assert len(q.sharding.device_set) == 4
  tokens = REF["tokens"]
  rows = [tokens[0], tokens[1][:14], tokens[2]]  # 3 rows: padded to split over data
  np.testing.assert_allclose(scorer.scores(rows), REF["scores"][:, 0], rtol=2e-5, atol=2e-5)


def test_its_own_template_renders_the_conversation_as_transformers_does(rm_with_tokenizer):
  scorer = RewardScorer(rm_with_tokenizer, POLICY, "float32")
  messages = json.loads(str(REF["conversation"]))
  ids = scorer.encode(messages, "ignored", "ignored", [1, 2, 3])
  assert ids == REF["conversation_ids"].tolist()
  np.testing.assert_allclose(scorer.scores([ids]), REF["conversation_score"], rtol=2e-5,
                             atol=2e-5)


def test_without_a_template_it_reads_the_text_as_its_autotokenizer_encodes_it(tmp_path):
  # A sequence classifier scores the last token: a post-processor that appends eos (as
  # transformers' tokenizer(text) applies it) must be kept, not replaced by a bos.
  with open(os.path.join(FIXTURES, os.pardir, "hf_defaults.json")) as f:
    defaults = json.load(f)
  case = next(c for c in defaults["tokenizers"]
              if c["post_processor"] == "eos_after" and c["config"] == "none")
  shutil.copytree(RM, tmp_path / "rm")
  with open(os.path.join(FIXTURES, "chat_tokenizer", "tokenizer.json")) as f:
    tok = json.load(f)
  tok["post_processor"] = defaults["post_processors"]["eos_after"]
  (tmp_path / "rm" / "tokenizer.json").write_text(json.dumps(tok))
  scorer = RewardScorer(str(tmp_path / "rm"), POLICY, "float32")
  text = defaults["text"]
  cut = len(text) // 2
  assert scorer.encode([], text[:cut], text[cut:], [1, 2, 3]) == case["encode"]


def test_a_policy_vocabulary_the_reward_model_cannot_read_is_refused():
  class Wide:
    vocab_size = 1000
  with pytest.raises(ValueError, match="worker.reward_model: .*no tokenizer.json.*vocab_size "
                     "336 is smaller than the policy tokenizer's 1000"):
    RewardScorer(RM, Wide(), "float32")


def test_prompt_messages_take_the_trainers_raw_prompt():
  assert prompt_messages("x", {}) == [{"role": "user", "content": "x"}]
  assert prompt_messages("<rendered>", {"prompt": json.dumps("hi")}) == [
      {"role": "user", "content": "hi"}]
  msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
  assert prompt_messages("<rendered>", {"prompt": json.dumps(msgs)}) == msgs


def _sample(text, observed=None):
  ids = np.asarray(POLICY.encode(text), np.int32)
  zeros = np.zeros(len(ids), np.float32)
  return Sample(ids, zeros, zeros, "stop",
                observed=None if observed is None else np.asarray(observed, bool))


def _worker(rm, **config):
  return Worker(None, POLICY_CONFIG, POLICY,
                WorkerConfig(reward_model=rm, reward_model_dtype="float32", max_new_tokens=8,
                             **config))


def test_rewards_are_the_models_scores_or_a_verifiers_plus_a_weighted_score(monkeypatch):
  worker = _worker(RM, reward_model_weight=0.5)
  scorer = RewardScorer(RM, POLICY, "float32")
  samples = [_sample("7"), _sample("12")]
  head = POLICY.encode_prompt("5+7=")
  want = scorer.scores([head + list(s.tokens) for s in samples])
  judged = pb.Prompt(id="a", text="5+7=", token_ids=head, task="reward_model")
  rewards, passed, parts, _ = worker._scored(judged, samples)
  np.testing.assert_allclose(rewards, want, rtol=1e-6)
  assert passed is None  # a score is no verdict
  np.testing.assert_allclose([p["reward_model"] for p in parts], want, rtol=1e-6)
  verified = pb.Prompt(id="b", text="5+7=", token_ids=head, task="addition", extra=b"12")
  rewards, passed, parts, _ = worker._scored(verified, samples)
  np.testing.assert_allclose(rewards, [0.5 * want[0], 1.0 + 0.5 * want[1]], rtol=1e-6)
  assert passed == [False, True]  # the verifier's, whatever the reward model adds
  assert [p["task"] for p in parts] == [0.0, 1.0]  # the parts are unweighted
  unweighted = _worker(RM)  # weight 0: verified tasks never run the reward model
  monkeypatch.setattr(unweighted.reward_scorer, "scores", None)
  assert unweighted._scored(verified, samples)[:2] == ([0.0, 1.0], [False, True])


def test_a_multi_turn_sample_is_read_as_its_conversation(rm_with_tokenizer, monkeypatch):
  worker = _worker(rm_with_tokenizer, default_task="reward_model")
  seen = []
  monkeypatch.setattr(worker.reward_scorer, "scores",
                      lambda seqs: seen.extend(seqs) or np.zeros(len(seqs)))
  # The policy wrote "ab", a reply wrote "R", the policy wrote "cd".
  sample = _sample("abRcd", observed=[0, 0, 1, 0, 0])
  raw = [{"role": "user", "content": "hello world"}]
  prompt = pb.Prompt(id="c", text="<rendered>", token_ids=[1, 2],
                     metadata={"prompt": json.dumps(raw)})
  worker._scored(prompt, [sample], {0: ["R"]})
  rm_tok = HFTokenizer(rm_with_tokenizer, chat_template="auto")
  want = rm_tok.encode_conversation(raw + conversation(["ab", "cd"], ["R"]))
  assert seen == [want]


def test_reward_model_settings_are_checked():
  with pytest.raises(ValueError, match="WorkerConfig.reward_model: expected a reward model "
                     "checkpoint when default_task='reward_model'"):
    WorkerConfig(default_task="reward_model")
  with pytest.raises(ValueError, match="WorkerConfig.reward_model: expected a reward model "
                     "checkpoint when reward_model_weight=0.5"):
    WorkerConfig(reward_model_weight=0.5)
  with pytest.raises(ValueError, match="reward_model_dtype"):
    WorkerConfig(reward_model="x", reward_model_dtype="int8")


def test_a_resumed_finished_multi_turn_sample_is_read_as_its_conversation(rm_with_tokenizer,
                                                                            monkeypatch):
  """A sample a stopped worker had finished after a reply is scored, once resumed, as the
  conversation it was (its group was sent as a failure: it had no replies to read)."""
  from param_server.client import make_sample
  worker = _worker(rm_with_tokenizer, default_task="reward_model", environment="calculator")
  seen = []
  monkeypatch.setattr(worker.reward_scorer, "scores",
                      lambda seqs: seen.extend(seqs) or np.zeros(len(seqs)))
  prompt = pb.Prompt(id="c", text="hello world", token_ids=[1, 2])
  begun = make_sample(POLICY.encode("abRcd"), 0.0, logprobs=np.zeros(5), finish_reason="stop",
                      observed=np.array([0, 0, 1, 0, 0], bool),
                      metadata={"replies": json.dumps(["R"])})
  key = ("lease", "c")
  sample = worker._begun_sample(key, 0, begun, worker._environment(prompt))
  worker._scored(prompt, [sample], worker._given.pop(key, {}))  # as _submit_group takes them
  rm_tok = HFTokenizer(rm_with_tokenizer, chat_template="auto")
  assert seen == [rm_tok.encode_conversation(
      [{"role": "user", "content": "hello world"}] + conversation(["ab", "cd"], ["R"]))]
