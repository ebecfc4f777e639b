"""On-policy distillation with the teacher on the workers (worker.teacher): each finished
group's samples carry the teacher's scores of their tokens (projected to its vocabulary a
few positions at a time), which the trainer packs into the very batch inputs its own
teacher (teacher.path, all positions at once) computes. A teacher of another tokenizer
(worker.teacher_tokenizer) scores the responses' text, shared out over the policy's tokens."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from param_server.client import sample_logprobs
from param_server.protos import param_server_pb2 as pb
from rlax_ps import sync
from rlax_ps.models import ModelConfig, Transformer, save_hf_checkpoint
from rlax_ps.teacher import Teacher, score_retokenized
from rlax_ps.token_alignment import aligned_chunks, decoded_pieces
from rlax_ps.tokenizers import HFTokenizer
from rlax_ps.train.rl import group_of
from rlax_ps.train.rollouts import BatchShape, build_batch, check_group
from worker_testlib import MODEL, SMALL, TOKENIZER, CONFIG, client, enqueue_addition


def test_the_workers_teacher_scores_equal_the_trainers_teacher_on_the_batch(
    server, versions, tmp_path):
  teacher = Transformer(ModelConfig(vocab_size=TOKENIZER.vocab_size, **dict(MODEL, num_layers=1)),
                        rngs=nnx.Rngs(7))
  save_hf_checkpoint(teacher, str(tmp_path / "teacher"))
  config = WorkerConfig(max_leases=1, teacher=str(tmp_path / "teacher"), teacher_topk=2,
                        teacher_dtype="float32", teacher_logits_chunk=4, **SMALL)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    assert Worker(wc, CONFIG, TOKENIZER, config).run().groups_submitted == 2
    taken = trainer.take_rollouts(0, 10).rollouts
  groups = [group_of(r, TOKENIZER) for r in taken]
  shape = BatchShape(groups=2, samples=3, prompt_len=32, response_len=SMALL["max_new_tokens"],
                     teacher_logp=True, teacher_topk=2)
  batch = build_batch(groups, shape)
  scored = Teacher(str(tmp_path / "teacher"), None, vocab_size=TOKENIZER.vocab_size,
                   dtype="float32", topk=2).scores(
      {k: v for k, v in batch.items() if not k.startswith("teacher")})
  assert batch["sample_mask"].sum() == 6 and np.any(batch["teacher_logp"] < -1.0)
  np.testing.assert_allclose(batch["teacher_logp"], scored["teacher_logp"], atol=2e-5)
  np.testing.assert_array_equal(batch["teacher_topk_ids"], scored["teacher_topk_ids"])
  np.testing.assert_allclose(batch["teacher_topk_logp"], scored["teacher_topk_logp"], atol=2e-5)
  # A group without them is refused where the loss needs them, naming the field.
  bare = type(taken[0])()
  bare.CopyFrom(taken[0])
  for s in bare.group.samples:
    s.ClearField("teacher_topk_ids")
    s.ClearField("teacher_topk_logprobs_f32")
  with pytest.raises(ValueError, match=r"samples\[0\].teacher_topk_ids: expected the teacher's "
                                       r"top 2 .* got shape None"):
    check_group(group_of(bare, TOKENIZER), shape)
  with pytest.raises(ValueError, match="WorkerConfig.teacher_topk: expected 0 without a teacher"):
    WorkerConfig(teacher_topk=2)
  with pytest.raises(ValueError, match="worker.teacher: HF checkpoint"):
    Worker(wc, CONFIG, TOKENIZER, WorkerConfig(teacher=str(tmp_path / "none"), **SMALL))


BPE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf", "tokenizer")


def _bpe_teacher(folder):
  """A tiny random teacher of the small BPE fixture's tokenizer (68 ids, not the policy's
  character ids), saved with it: (the model, its tokenizer)."""
  tok = HFTokenizer(BPE, bos_token="<eos>")
  model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **dict(MODEL, num_layers=1)),
                      rngs=nnx.Rngs(5))
  save_hf_checkpoint(model, str(folder))
  shutil.copy(os.path.join(BPE, "tokenizer.json"), folder)
  with open(folder / "tokenizer_config.json", "w") as f:
    json.dump({"bos_token": "<eos>", "eos_token": "<eos>"}, f)
  return model, HFTokenizer(str(folder))


def test_a_teacher_of_another_tokenizer_scores_each_responses_text(tmp_path, caplog):
  """Each span both tokenize alike ("hello" | " world": 5 and 6 characters, one BPE token
  each) gets the teacher's log-prob of its tokens after the prompt, its own tokenization of
  it, shared out over the policy's tokens in proportion to their sampling log-probs; the
  policy's stop token gets the teacher's eos there. Against the teacher's plain forward. A
  text the teacher's tokenizer does not give back (it drops "+") is one span, with a
  warning."""
  model, tok = _bpe_teacher(tmp_path / "teacher")
  teacher = Teacher(str(tmp_path / "teacher"), None, vocab_size=tok.vocab_size,
                    dtype="float32")
  texts, stopped = ["hello world", "the cat gives", "12+34"], [True, False, False]
  responses = [TOKENIZER.encode(t) + [TOKENIZER.eos_id] * s for t, s in zip(texts, stopped)]
  rng = np.random.default_rng(0)
  weights = [-rng.random(len(r)) for r in responses]
  prompt = tok.encode_prompt("the world is")
  out, = score_retokenized(teacher, TOKENIZER, tok, [prompt], [responses], [weights],
                           [stopped], 4)
  assert "does not give back a response's text ('12+34' reads as '1234')" in caplog.text
  for text, stop, got, w in zip(texts, stopped, out, weights):
    if text == "12+34":  # the teacher's log-prob of "1234", over the five tokens
      logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray([prompt + [30, 31]])), axis=-1))[0]
      want = logp[len(prompt) - 1, 30] + logp[len(prompt), 31]
      np.testing.assert_allclose(got.sum(), want, rtol=1e-5)
      np.testing.assert_allclose(got / got.sum(), w / w.sum(), rtol=1e-5)
      continue
    ids = tok.encode(text) + [tok.eos_id] * stop
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray([prompt + ids])), axis=-1))[0]
    want = logp[np.arange(len(prompt) - 1, len(prompt) - 1 + len(ids)), ids]
    mine, theirs, count = aligned_chunks(list(text), decoded_pieces(tok, ids[:len(ids) - stop]))
    assert got.shape == (len(text) + stop,) and count >= 2
    np.testing.assert_allclose(np.bincount(mine, got[:len(text)], minlength=count),
                               np.bincount(theirs, want[:len(ids) - stop], minlength=count),
                               rtol=1e-5)
    np.testing.assert_allclose(got[:len(text)] / np.bincount(mine, got[:len(text)])[mine],
                               w[:len(text)] / np.bincount(mine, w[:len(text)])[mine],
                               rtol=1e-5)
    if stop:
      np.testing.assert_allclose(got[-1], want[-1], rtol=1e-5)


def test_an_environments_reply_is_tokenized_for_the_teacher_apart_from_the_policys_turns(
    tmp_path):
  """A multi-turn response "hel" | "lo" (an environment's reply) | " world": the teacher's
  tokenizer would make "hello" one token across the reply's edge; each run is tokenized on
  its own instead, so the policy's tokens of a turn get the teacher's log-probs of its own
  tokens of that turn, and the reply's tokens those of the reply."""
  model, tok = _bpe_teacher(tmp_path / "teacher")
  assert len(tok.encode("hello")) == 1  # the merge the runs keep apart
  teacher = Teacher(str(tmp_path / "teacher"), None, vocab_size=tok.vocab_size,
                    dtype="float32")
  prompt = tok.encode_prompt("the world is")
  # ... and a reply the teacher's tokenizer does not give back ("+" dropped): that run alone
  # is one span, its log-prob on its own tokens still.
  for runs in (["hel", "lo", " world"], ["hel", "1+2", " world"]):
    response = TOKENIZER.encode("".join(runs))
    observed = np.repeat([False, True, False], [len(r) for r in runs])
    weights = np.where(observed, 0.0, -np.random.default_rng(1).random(len(response)))
    (got,), = score_retokenized(teacher, TOKENIZER, tok, [prompt], [[response]], [[weights]],
                                [[False]], 4, [[observed]])
    ids = [tok.encode(r) for r in runs]
    flat = [t for x in ids for t in x]
    logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray([prompt + flat])), axis=-1))[0]
    want = logp[np.arange(len(prompt) - 1, len(prompt) - 1 + len(flat)), flat]
    chars = np.cumsum([0] + [len(r) for r in runs])
    tokens = np.cumsum([0] + list(map(len, ids)))
    for k in range(3):
      np.testing.assert_allclose(got[chars[k]:chars[k + 1]].sum(),
                                 want[tokens[k]:tokens[k + 1]].sum(), rtol=1e-5)


def test_a_worker_sends_the_scores_of_a_teacher_of_another_tokenizer(server, versions,
                                                                     tmp_path):
  _, tok = _bpe_teacher(tmp_path / "teacher")
  config = WorkerConfig(max_leases=1, teacher=str(tmp_path / "teacher"),
                        teacher_tokenizer=str(tmp_path / "teacher"), teacher_dtype="float32",
                        **SMALL)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    assert Worker(wc, CONFIG, TOKENIZER, config).run().groups_submitted == 2
    taken = trainer.take_rollouts(0, 10).rollouts
    with pytest.raises(ValueError, match=r"worker.teacher: .* gives other ids than the "
                                         r"policy's .*or worker.teacher_tokenizer set"):
      Worker(wc, CONFIG, TOKENIZER, WorkerConfig(teacher=str(tmp_path / "teacher"), **SMALL))
    # A prompt the teacher cannot read (a conversation; it has no chat template) is one the
    # worker cannot sample: the trainer is told why, and the worker goes on.
    chat = pb.Prompt(id="c", text="hi", token_ids=TOKENIZER.encode_prompt("hi"),
                     metadata={"prompt": json.dumps([{"role": "user", "content": "hi"}])})
    _, fault = Worker(wc, CONFIG, TOKENIZER, config)._checked_tokens(chat)
    assert fault.startswith("worker.teacher_tokenizer: the teacher cannot read it: prompt: a "
                            "list of messages needs")
    with pytest.raises(ValueError, match="worker.teacher_tokenizer: .*none"):
      Worker(wc, CONFIG, TOKENIZER, WorkerConfig(teacher=str(tmp_path / "teacher"),
                                                 teacher_tokenizer=str(tmp_path / "none"),
                                                 **SMALL))
  teacher = Teacher(str(tmp_path / "teacher"), None, vocab_size=tok.vocab_size,
                    dtype="float32")
  for r in taken:
    samples = r.group.samples
    want, = score_retokenized(teacher, TOKENIZER, tok, [tok.encode_prompt(r.prompt.text)],
                              [[list(s.token_ids) for s in samples]],
                              [[sample_logprobs(s) for s in samples]],
                              [[s.finish_reason == "stop" for s in samples]], 4)
    for s, w in zip(samples, want):
      got = np.frombuffer(s.teacher_logprobs_f32, np.float32)
      assert len(got) == len(s.token_ids) and np.all(got <= 0)
      np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
  for fields, message in (({"teacher_tokenizer": "T"}, "teacher_tokenizer: expected '' "
                                                       "without a teacher"),
                          ({"teacher": "T", "teacher_tokenizer": "T", "teacher_topk": 2},
                           "teacher_topk: expected 0 with teacher_tokenizer")):
    with pytest.raises(ValueError, match=message):
      WorkerConfig(**fields)


def test_samples_of_no_tokens_need_no_teacher_scores():
  """check_group lets a sample of no tokens through without the teacher's top k (there is
  nothing to score); the batch built from it crashed on the missing scores."""
  from rlax_ps.train.rollouts import Group
  empty = tuple(np.zeros(0, np.int32) for _ in range(2))
  group = Group(rollout_id=1, prompt_tokens=np.arange(3, dtype=np.int32), responses=empty,
                behaviour_logp=tuple(np.zeros(0, np.float32) for _ in range(2)),
                rewards=np.zeros(2, np.float32), policy_version=0)
  shape = BatchShape(groups=1, samples=2, prompt_len=4, response_len=4, teacher_topk=2)
  check_group(group, shape)
  batch = build_batch([group], shape)
  assert not batch["teacher_topk_ids"].any() and not batch["response_lens"].any()


def test_a_stopped_response_is_scored_at_the_token_that_ends_the_teachers_turn():
  """A Gemma-style teacher (eos_token <|endoftext|>, turns closed by <end_of_turn>): the
  policy's stop token is scored as the teacher's <end_of_turn> after the text."""
  chat = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf",
                      "chat_tokenizer")
  tok = HFTokenizer(chat, eos_token="<|endoftext|>", stop_tokens=["<end_of_turn>"],
                    chat_template=os.path.join(chat, "gemma3.jinja"))

  class Scored:
    def score_groups(self, prompts, texts, samples, budget, rows=None):
      self.texts = texts
      return [[(np.full(len(t), -1.0, np.float32), None, None) for t in ts] for ts in texts]

  teacher = Scored()
  response = TOKENIZER.encode("hello") + [TOKENIZER.eos_id]
  out, = score_retokenized(teacher, TOKENIZER, tok, [tok.encode_prompt("hi")], [[response]],
                           [[-np.ones(len(response))]], [[True]], 1)
  sent, = teacher.texts[0]
  assert tok.decode([sent[-1]], skip_special=False) == "<end_of_turn>" != tok.decode(
      [tok.eos_id], skip_special=False)
  assert tok.decode(sent[:-1]) == "hello" and len(out[0]) == len(response)


def test_a_teachers_top_tokens_are_ids_the_tokenizer_gives(tmp_path):
  """A teacher whose head has padded rows past the tokenizer's ids (here scored highest):
  its top k names none of them (a student's head may not have them: it read NaN)."""
  vocab = TOKENIZER.vocab_size
  teacher = Transformer(ModelConfig(vocab_size=vocab + 8, **dict(MODEL, num_layers=1)),
                        rngs=nnx.Rngs(7))
  head = teacher.lm_head.kernel if teacher.lm_head is not None else None
  if head is not None:
    head[...] = head[...].at[:, vocab:].set(5.0)
  else:
    teacher.embed.embedding[...] = teacher.embed.embedding[...].at[vocab:].set(5.0)
  save_hf_checkpoint(teacher, str(tmp_path / "teacher"))
  t = Teacher(str(tmp_path / "teacher"), None, vocab_size=vocab, dtype="float32", topk=4)
  batch = {"prompt_tokens": np.full((1, 4), 5, np.int32), "prompt_lens": np.array([4]),
           "response_tokens": np.full((1, 2, 4), 6, np.int32),
           "response_lens": np.array([[4, 3]])}
  ids = np.asarray(t.scores(batch)["teacher_topk_ids"])
  assert ids.shape == (1, 2, 4, 4) and ids.max() < vocab


def test_a_teachers_own_tokenizer_must_be_its_checkpoints_and_keeps_the_policys_template_args(
    tmp_path):
  """teacher.tokenizer naming another tokenizer than the teacher's folder ships is refused
  naming it (a Qwen teacher would score Llama ids); the teacher's tokenizer renders prompts
  with the policy's chat_kwargs and tools."""
  from rlax_ps.teacher import own_tokenizer
  _, _ = _bpe_teacher(tmp_path / "teacher")
  chat = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "hf",
                      "chat_tokenizer")
  with pytest.raises(ValueError, match=r"^teacher\.tokenizer: .*chat_tokenizer.* is not the "
                                       r"tokenizer of the teacher"):
    Teacher(str(tmp_path / "teacher"), None, vocab_size=68, dtype="float32",
            tokenizer=HFTokenizer(chat), retokenized=True)
  tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
  offering = tmp_path / "chat"  # the chat tokenizer with a template that names the tools
  shutil.copytree(chat, offering)
  config = json.loads((offering / "tokenizer_config.json").read_text())
  config["chat_template"] = "{{ tools | tojson }}" + config["chat_template"]
  (offering / "tokenizer_config.json").write_text(json.dumps(config))
  policy = HFTokenizer(str(offering), chat_template="auto",
                       chat_kwargs={"enable_thinking": False}, tools=tools)
  own = own_tokenizer(str(offering), policy, "teacher.tokenizer")
  assert own.chat_kwargs == {"enable_thinking": False} and own.tools == tools
  assert own.render_prompt("hi") == policy.render_prompt("hi")
