"""Greedy decoding with the KV cache on left-padded prompts equals recomputing the full
forward per token; exact match scores completions through the task checkers."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from rlax_ps.models import ModelConfig, Transformer
from rlax_ps.tasks import Example, get_task
from rlax_ps.tokenizers import CharTokenizer
from rlax_ps.train import evaluate
from rlax_ps.train import heldout as heldout_lib
from rlax_ps.tasks.base import split_of

TOK = CharTokenizer()


def as_ids(fake):
  """A stand-in for evaluate.completion_ids from one that answers each prompt with text."""
  return lambda g, p, tok, prompts, **kw: [tok.encode(t) for t in fake(g, p, tok, prompts, **kw)]
CONFIG = ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
PROMPTS = ["1+2=", "rev abcdef=", "77+8=", "rev q="]
NEW = 5


@functools.lru_cache(maxsize=1)
def _full_forward(graphdef):
  return jax.jit(lambda p, t, s: nnx.merge(graphdef, p)(t, segment_ids=s))


@pytest.fixture(scope="module")
def model():
  m = Transformer(CONFIG, rngs=nnx.Rngs(3))
  graphdef, state = nnx.split(m, nnx.Param)
  return graphdef, state.to_pure_dict()


def _reference(graphdef, params, prompt: str) -> list[int]:
  """Greedy tokens by a full forward over the whole sequence at every step (no cache)."""
  forward = _full_forward(graphdef)
  ids = TOK.encode(prompt, add_bos=True)
  width = 32
  out = []
  for _ in range(NEW):
    tokens = np.full((1, width), TOK.pad_id, np.int32)
    tokens[0, :len(ids)] = ids
    seg = (np.arange(width) < len(ids)).astype(np.int32)[None]
    logits = forward(params, jnp.asarray(tokens), jnp.asarray(seg))
    nxt = int(np.argmax(np.asarray(logits[0, len(ids) - 1])))
    out.append(nxt)
    ids.append(nxt)
  return out


def test_cached_greedy_on_left_padded_batch_matches_full_recompute(model):
  graphdef, params = model
  arrays = evaluate.left_pad_prompts(TOK, PROMPTS, length=16)
  no_stop = np.array([-1], np.int32)  # No early stop: compare all NEW tokens.
  got = evaluate.jitted_generate(graphdef, NEW)(
      params, arrays["tokens"], arrays["segment_ids"], arrays["positions"], no_stop, TOK.pad_id)
  for row, prompt in zip(np.asarray(got), PROMPTS):
    assert list(row) == _reference(graphdef, params, prompt)


def test_tokens_after_eos_are_padding(model):
  graphdef, params = model
  arrays = evaluate.left_pad_prompts(TOK, PROMPTS, length=16)
  generate = evaluate.jitted_generate(graphdef, NEW)  # stop and pad ids are traced
  free = np.asarray(generate(params, arrays["tokens"], arrays["segment_ids"],
                             arrays["positions"], np.array([-1, -1], np.int32), TOK.pad_id))
  # Pretend a token that first appears at step i >= 1 of some row r is a stop id (the
  # second of two: an instruct model's end of turn beside its eos).
  r, i = next((r, i) for r in range(len(PROMPTS)) for i in range(1, NEW)
              if free[r, i] not in free[r, :i])
  stops = np.array([-1, free[r, i]], np.int32)
  got = np.asarray(generate(params, arrays["tokens"], arrays["segment_ids"],
                            arrays["positions"], stops, TOK.pad_id))
  assert list(got[r, :i + 1]) == list(free[r, :i + 1])  # Up to and with the stop: unchanged.
  assert all(t == TOK.pad_id for t in got[r, i + 1:])


def test_exact_match_scores_with_the_task_checker(model, monkeypatch):
  graphdef, params = model
  task = get_task("addition")
  examples = {"addition": [Example("1+2=", "3"), Example("2+2=", "4"), Example("5+5=", "10")]}
  answers = {"1+2=": "3", "2+2=": "5", "5+5=": "10"}  # Two right, one wrong.
  monkeypatch.setattr(evaluate, "completion_ids",
                      as_ids(lambda g, p, tok, prompts, **kw: [answers[q] for q in prompts]))
  result = evaluate.exact_match(graphdef, params, TOK, [task], examples, batch_size=4)
  assert result == {"addition": pytest.approx(2 / 3), "all": pytest.approx(2 / 3)}


def test_completions_decode_up_to_eos(model, monkeypatch):
  graphdef, params = model
  eos, pad = TOK.eos_id, TOK.pad_id
  rows = np.array([TOK.encode("12") + [eos, pad, pad],  # stops at its eos
                   TOK.encode("abcde"),  # no eos: the whole budget
                   [eos] + TOK.encode("9999"),  # eos first: empty
                   TOK.encode("zzzzz")], np.int32)  # padding row of the batch
  calls = []

  def fake_generate(graphdef_, max_new_tokens, mode=None, mesh=None):
    calls.append((max_new_tokens, mode))
    return lambda *args: rows

  monkeypatch.setattr(evaluate, "jitted_generate", fake_generate)
  texts = evaluate.completions(graphdef, params, TOK, PROMPTS[:3], max_new_tokens=NEW,
                               batch_size=4, prompt_len=16)
  assert texts == ["12", "abcde", ""] and calls == [(NEW, None)]  # greedy


def test_a_multi_turn_completion_feeds_the_environments_replies_back_as_context(model,
                                                                             monkeypatch):
  # Turn 1: one row calls the calculator and stops, one answers at once, one runs out of
  # budget. Turn 2 decodes from the prompt, the first turn and the reply; the reply counts
  # against the budget.
  graphdef, params = model
  eos = TOK.eos_id
  def row(text, stop=True):
    ids = TOK.encode(text) + ([eos] if stop else [])
    return ids + TOK.encode("z" * (16 - len(ids)))

  turns = [np.array([row("<calc>2*3"), row("7"), row("0123456789abcdef", stop=False)],
                    np.int32), np.array([row("is 6")], np.int32)]
  seen = []

  def fake_generate(graphdef_, max_new_tokens, mode=None, mesh=None):
    def gen(params_, tokens, *rest):
      seen.append(tokens)
      return turns[len(seen) - 1][:len(tokens)]
    return gen

  monkeypatch.setattr(evaluate, "jitted_generate", fake_generate)
  seen_messages = []

  def env(messages, reference):
    seen_messages.append(messages)
    return f"={reference}" if messages[-1]["content"].endswith("2*3") else None

  texts = evaluate.completions(graphdef, params, TOK, PROMPTS[:3], max_new_tokens=16,
                               batch_size=3, prompt_len=16, environment=env,
                               references=["6", "7", "8"], max_turns=2)
  assert len(seen) == 2
  first = TOK.encode("<calc>2*3") + [eos]
  want_prompt = TOK.encode_prompt(PROMPTS[0]) + first + TOK.encode("=6")
  assert seen[1][0, -len(want_prompt):].tolist() == want_prompt  # the whole conversation
  # 10 tokens, a reply of 2, then 4 of "is 6<eos>" fit the budget of 16.
  assert texts == ["<calc>2*3=6is 6", "7", "0123456789abcdef"]
  # The environment saw each conversation: the turns, and the reply it gave between them.
  assert seen_messages[0] == [{"role": "assistant", "content": "<calc>2*3"}]
  assert seen_messages[1] == [{"role": "assistant", "content": "7"}]
  assert len(seen_messages) == 2  # the second turn of row 0 ended by the budget
  # A guarded environment's reply of no usable type ends that completion, as in the
  # workers (it raised out of the trainer's evaluation).
  from algorithms.environments import GuardedEnvironment
  seen.clear()
  odd = GuardedEnvironment("odd", lambda messages, reference: 6)
  texts = evaluate.completions(graphdef, params, TOK, PROMPTS[:3], max_new_tokens=16,
                               batch_size=3, prompt_len=16, environment=odd,
                               references=["6", "7", "8"], max_turns=2)
  assert texts == ["<calc>2*3", "7", "0123456789abcdef"] and odd.errors == 2
  # Without an environment the same rows are single-turn completions.
  seen.clear()
  plain = evaluate.completions(graphdef, params, TOK, PROMPTS[:3], max_new_tokens=16,
                               batch_size=3, prompt_len=16)
  assert plain[0] == "<calc>2*3" and len(seen) == 1


class Graded:
  """A task whose rewards are scores (as a reward model's), one batch per call."""
  name = "graded"

  def __init__(self):
    self.calls = []

  def rewards(self, examples, completions):  # (completions as ids: one per character)
    self.calls.append(len(completions))
    return [float(len(c)) for c in completions]


def test_pass_at_k_takes_each_prompts_best_reward(model, monkeypatch):
  """pass@k is the mean of each prompt's best of k: for pass/fail tasks the share of prompts
  with an exact answer, for scored ones the best-of-k score; a scored task gets one batch."""
  graphdef, params = model
  texts = iter(["3", "x", "3", "4", "x", "x",  # addition: "1+2=" hit twice; "2+2=" missed
                "", "ab", "a", "abc", "", "abcde"])  # graded: lengths 0 2 1 | 3 0 5
  monkeypatch.setattr(evaluate, "completion_ids",
                      as_ids(lambda g, p, tok, prompts, **kw: [next(texts) for _ in prompts]))
  graded = Graded()
  examples = {"addition": [Example("1+2=", "3"), Example("2+2=", "5")],
              "graded": [Example("p", "", "graded"), Example("q", "", "graded")]}
  got = evaluate.pass_at_k(graphdef, params, TOK, [get_task("addition"), graded], examples,
                           k=3, max_new_tokens=4)
  assert graded.calls == [6]
  assert got["pass@1"] == pytest.approx((2 + 0 + 3 + 8) / 12)
  assert got["pass@3"] == pytest.approx((1 + 0 + 2 + 5) / 4)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
  """The committed tiny Qwen3 reward model, with the ChatML tokenizer beside it."""
  import os
  import shutil

  from tests.models.hf_fixtures import FIXTURES
  path = tmp_path_factory.mktemp("rm") / "rm"
  shutil.copytree(os.path.join(FIXTURES, "qwen3_reward"), path)
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(FIXTURES, "chat_tokenizer", f), path / f)
  return str(path)


def test_a_reward_model_scores_held_out_answers_as_transformers_does(model, reward_model,
                                                                     monkeypatch, tmp_path):
  """Held-out prompts of task reward_model (no answers): the greedy answer's score is the
  reward model's score of the conversation, as transformers gives it."""
  import json
  import os

  ref = np.load(os.path.join(reward_model, "reference.npz"))
  (user, assistant) = json.loads(str(ref["conversation"]))
  path = tmp_path / "heldout.jsonl"
  path.write_text(json.dumps({"prompt": user["content"]}) + "\n")  # a text: one user message
  config = ml_collections.ConfigDict({
      "data": {"heldout_jsonl": str(path), "answer_key": ""},
      "worker": {"default_task": "reward_model", "reward_model": reward_model,
                 "reward_model_dtype": "float32", "max_new_tokens": 4},
      "eval": {"batch_size": 4, "seed": 0}})
  with pytest.raises(ValueError, match="data.heldout_jsonl: records of task 'reward_model' "
                                       "are scored by worker.reward_model"):
    heldout_lib.heldout_from_config(config, [])  # no tokenizer: nothing to load it beside
  heldout = heldout_lib.heldout_from_config(config, [], TOK)
  assert [t.name for t in heldout.tasks] == ["reward_model"] and heldout.max_new_tokens == 4
  monkeypatch.setattr(evaluate, "completion_ids",
                      as_ids(lambda g, p, tok, prompts, **kw: [assistant["content"]
                                                               for _ in prompts]))
  got = heldout_lib.exact_match(graphdef=model[0], params=model[1], tokenizer=TOK,
                                heldout=heldout, config=config)
  want = float(ref["conversation_score"][0])
  assert got == {"reward_model": pytest.approx(want, rel=2e-5, abs=2e-5),
                 "all": pytest.approx(want, rel=2e-5, abs=2e-5)}


def test_held_out_tasks_decode_with_their_own_environment(model, monkeypatch):
  """worker.environment by task: each task's prompts decode with its environment (or none),
  greedy and sampled; the tasks of one environment share a sampling call."""
  graphdef, params = model
  calls = []

  def fake(g, p, tok, prompts, *, environment=None, seed=0, **kw):
    calls.append((sorted(set(prompts)), environment, seed))
    return ["0"] * len(prompts)

  monkeypatch.setattr(evaluate, "completion_ids", as_ids(fake))
  calc = object()
  envs = {"addition": calc, "*": None}
  add, rev = get_task("addition"), get_task("reversal")
  examples = {"addition": [Example("1+2=", "3")], "reversal": [Example("rev ab=", "ba")]}
  evaluate.exact_match(graphdef, params, TOK, [add, rev], examples, batch_size=4,
                       environments=envs, max_new_tokens=4)
  assert calls == [(["1+2="], calc, 0), (["rev ab="], None, 0)]
  calls.clear()
  evaluate.pass_at_k(graphdef, params, TOK, [add, rev], examples, k=2, seed=7,
                     environments=envs, max_new_tokens=4)
  assert calls == [(["1+2="], calc, 7), (["rev ab="], None, 8)]
  calls.clear()
  evaluate.pass_at_k(graphdef, params, TOK, [add, rev], examples, k=2, seed=7,
                     max_new_tokens=4)  # single-turn: one call, as ever
  assert calls == [(["1+2=", "rev ab="], None, 7)]


@pytest.mark.parametrize("truncation", [{"top_k": 1}, {"min_p": 1.0}])
def test_sampled_completions_truncate_as_the_workers_settings_say(model, truncation):
  """top_k=1, or min_p=1 (only the likeliest token), leave one token to draw: the samples
  are the greedy answers even at a temperature whose untruncated samples are not."""
  graphdef, params = model
  decode = functools.partial(evaluate.completions, graphdef, params, TOK, PROMPTS,
                             max_new_tokens=NEW, batch_size=4, prompt_len=16, seed=3)
  greedy = decode()
  assert decode(temperature=5.0) != greedy
  assert decode(temperature=5.0, **truncation) == greedy


def test_sampled_completions_are_the_same_whatever_the_batch_size(model):
  """Each prompt draws with a key of its own (of the seed and its index): eval.batch_size,
  which a user lowers for memory, changes no sample and so no pass@k; copies of a prompt
  (pass@k's k) draw apart."""
  graphdef, params = model
  decode = functools.partial(evaluate.completions, graphdef, params, TOK, PROMPTS * 2,
                             max_new_tokens=NEW, prompt_len=16, seed=3, temperature=5.0)
  whole = decode(batch_size=4)
  assert decode(batch_size=3) == whole  # (a padded last batch)
  n = len(PROMPTS)
  assert whole[:n] != whole[n:]


def test_held_out_pass_at_k_samples_with_the_workers_settings(model, monkeypatch):
  """worker.temperature, top_k, top_p and min_p, WorkerConfig's defaults for those the
  config leaves out, reach pass@k's sampling; a value a worker refuses is named."""
  from inference_workers.worker_config import WorkerConfig
  config = ml_collections.ConfigDict({
      "worker": {"temperature": 0.7, "top_p": 0.9},
      "eval": {"batch_size": 4, "seed": 0, "num_examples": 2, "pass_k": 2}})
  heldout = heldout_lib.heldout_from_config(config, [get_task("addition")])
  default = WorkerConfig()
  want = {"temperature": 0.7, "top_k": default.top_k, "top_p": 0.9, "min_p": default.min_p}
  assert heldout.sampling == pytest.approx(want)
  seen = []

  def fake(g, p, tok, prompts, **kw):
    seen.append({name: kw[name] for name in want})
    return ["0"] * len(prompts)

  monkeypatch.setattr(evaluate, "completion_ids", as_ids(fake))
  heldout_lib.pass_at_k(model[0], model[1], TOK, heldout, config)
  assert seen == [pytest.approx(want)]
  config.worker.top_p = 1.5
  with pytest.raises(ValueError, match=r"^worker\.top_p: expected a number in \(0, 1\]"):
    heldout_lib.heldout_from_config(config, [get_task("addition")])


def test_the_built_in_tasks_held_out_budget_is_eval_max_new_tokens_or_a_chat_models_worker():
  """Past each task's longest answer alone, an instruct model's reply was cut after a few
  tokens; eval.max_new_tokens was not read for the built-in tasks."""
  config = ml_collections.ConfigDict({
      "worker": {"max_new_tokens": 64}, "tokenizer": {"chat_template": ""},
      "eval": {"batch_size": 4, "seed": 0, "num_examples": 2, "max_new_tokens": 0}})
  tasks = [get_task("addition")]
  assert heldout_lib.heldout_from_config(config, tasks).max_new_tokens is None  # the answers'
  config.tokenizer.chat_template = "auto"
  assert heldout_lib.heldout_from_config(config, tasks).max_new_tokens == 64
  config.eval.max_new_tokens = 12
  assert heldout_lib.heldout_from_config(config, tasks).max_new_tokens == 12


def test_held_out_settings_that_cannot_work_are_refused_or_said(tmp_path, caplog):
  """pass@k at a greedy temperature is refused naming both fields (it crashed after the
  first checkpoint's greedy evaluation); data.jsonl without data.heldout_jsonl says the
  built-in tasks are what is scored; eval.max_new_tokens is a held-out file's budget (a
  short reference answer left a reasoned one no room), before the workers'."""
  config = ml_collections.ConfigDict({
      "worker": {"temperature": 0.0},
      "eval": {"batch_size": 4, "seed": 0, "num_examples": 2, "pass_k": 4}})
  with pytest.raises(ValueError, match=r"^eval\.pass_k: 4 samples .*worker\.temperature"):
    heldout_lib.heldout_from_config(config, [get_task("addition")])
  config.eval.pass_k = 0
  path = tmp_path / "heldout.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2", "task": "addition"}\n')
  config.data = ml_collections.ConfigDict({"jsonl": str(path), "heldout_jsonl": ""})
  with caplog.at_level("WARNING"):
    heldout_lib.heldout_from_config(config, [get_task("addition")])
  assert "data.heldout_jsonl is not set: the held-out evaluation scores the built-in" in (
      caplog.text)
  config.data.heldout_jsonl = str(path)
  assert heldout_lib.heldout_from_config(config, []).max_new_tokens is None  # the answer's
  config.worker.max_new_tokens = 64
  assert heldout_lib.heldout_from_config(config, []).max_new_tokens == 64
  config.eval.max_new_tokens = 200
  assert heldout_lib.heldout_from_config(config, []).max_new_tokens == 200


def test_a_reward_model_on_the_policys_ids_scores_a_held_out_answer_as_the_workers_do(
    tmp_path):
  """A reward model without a tokenizer reads the policy's ids: held out, the answer's text
  was encoded again without its stop token, so it pooled at another token than the workers'
  score (training rewards, eval.on_workers) of the very same answer."""
  import os
  import shutil

  from inference_workers.decoding import Sample
  from inference_workers.loop import Worker
  from inference_workers.worker_config import WorkerConfig
  from param_server.protos import param_server_pb2 as pb
  from rlax_ps.reward_scoring import RewardScorer
  from rlax_ps.tokenizers import HFTokenizer
  from tests.models.hf_fixtures import FIXTURES
  shutil.copytree(os.path.join(FIXTURES, "qwen3_reward"), tmp_path / "rm")  # pad: id 0
  policy = HFTokenizer(os.path.join(FIXTURES, "chat_tokenizer"))
  scorer = RewardScorer(str(tmp_path / "rm"), policy, "float32")
  prompt = "What is 2+2?"
  ids = policy.encode("The answer is 4.") + [policy.turn_end_id]  # a stop token: not a pad
  held_out, = evaluate.RewardModelTask(scorer, policy).rewards(
      [Example(prompt, "", "reward_model")], [ids])
  worker = Worker(None, scorer.model.config, policy, WorkerConfig())
  worker.reward_scorer = scorer
  sample = Sample(tokens=np.asarray(ids, np.int32), logprobs=np.zeros(len(ids), np.float32),
                  sampling_logprobs=np.zeros(len(ids), np.float32), finish_reason="stop")
  scored, = worker._model_scores(pb.Prompt(id="p", text=prompt), [sample], {})
  without_stop, = scorer.scores([policy.encode_prompt(prompt) + ids[:-1]])
  assert held_out == pytest.approx(float(scored), abs=1e-6)
  assert abs(float(without_stop) - held_out) > 1e-3  # (the stop token is what it pools at)


def test_all_weighs_every_example_alike_across_tasks_of_different_sizes(monkeypatch):
  graphdef, state = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(3)), nnx.Param)
  examples = {"addition": [Example("1+2=", "3"), Example("2+2=", "4"), Example("5+5=", "10")],
              "reversal": [Example("rev ab=", "ba", "reversal")]}
  answers = {"1+2=": "3", "2+2=": "5", "5+5=": "10", "rev ab=": "ba"}  # 3 of 4 right
  monkeypatch.setattr(evaluate, "completion_ids", lambda g, p, tok, prompts, **kw:
                      [tok.encode(answers[q]) for q in prompts])
  result = evaluate.exact_match(graphdef, state.to_pure_dict(), TOK,
                                [get_task("addition"), get_task("reversal")], examples,
                                batch_size=4)
  assert result == {"addition": pytest.approx(2 / 3), "reversal": pytest.approx(1.0),
                    "all": pytest.approx(3 / 4)}


def test_held_out_examples_of_built_in_tasks_are_of_the_held_out_split():
  config = ml_collections.ConfigDict({"eval": {"batch_size": 4, "seed": 0, "num_examples": 16}})
  tasks = [get_task("addition"), get_task("reversal")]
  heldout = heldout_lib.heldout_from_config(config, tasks)
  for task in tasks:
    exs = heldout.examples[task.name]
    assert len(exs) == 16
    assert all(split_of(task.name, e.prompt, task.heldout_fraction) == "heldout" for e in exs)
