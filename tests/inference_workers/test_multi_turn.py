"""Multi-turn sampling in the continuous batch: a sample that ends a turn gets the host's reply
written into its row, which then draws on as if the conversation had been its prompt; the
worker's environment replies of each kind (none, a tuple, a wrong type) in it."""

import string
import threading

import numpy as np
import pytest
from flax import nnx

from inference_workers.continuous import ContinuousBatch
from inference_workers.sampler import generate
from inference_workers.sampling import SamplingParams
from rlax_ps.models import ModelConfig, Transformer

CONFIG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, qkv_bias=True, architecture="qwen2")
STOPS = tuple(range(1, 9))
PROMPTS = [[3, 14, 15, 9], [26, 5], [35, 8, 9, 7, 9, 3]]


@pytest.fixture(scope="module")
def model():
  return Transformer(CONFIG, rngs=nnx.Rngs(0))


def reply_to(tokens):
  """A deterministic environment: replies [50, 40 + turn, 51] to the first two turns."""
  turn = 0 if not len(tokens) else int(np.sum(np.asarray(tokens) == 50))
  return None if turn >= 2 else [50, 40 + turn, 51]


def test_a_greedy_conversation_equals_decoding_the_whole_transcript_as_a_prompt(model):
  params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_tokens=STOPS)
  calls = []

  def respond(key, j, tokens, observed):
    calls.append((key, j, tokens.tolist(), observed.tolist()))
    return reply_to(tokens)

  batch = ContinuousBatch(model, 2, 2, params, respond=respond)
  for i, p in enumerate(PROMPTS):
    batch.add(i, p, [7, 8])
  done = dict(batch.run())
  assert sorted(done) == [0, 1, 2] and calls
  turns, checks = 0, []
  for i, p in enumerate(PROMPTS):
    for sample in done[i]:
      toks, observed = sample.tokens.tolist(), sample.observed.tolist()
      # Every reply sits right after a stop token, marked observed, with log-prob 0.
      starts = [k for k in range(len(toks)) if observed[k] and (k == 0 or not observed[k - 1])]
      turns += len(starts)
      for k in starts:
        assert toks[k - 1] in STOPS and toks[k:k + 3][:1] == [50]
        assert np.all(sample.logprobs[k:k + 3][np.asarray(observed[k:k + 3])] == 0)
      after = [k + 3 for k in starts if k + 3 < len(toks)]  # the first token after a reply
      checks += [(p + toks[:k], toks[k], sample.logprobs[k])
                 for k in after + [k for k in range(1, len(toks)) if not observed[k]][:2]]
  assert turns >= 3  # samples were answered and went on
  # Each policy token equals greedy decoding of everything before it as a prompt, with the
  # same log-prob: the reply joined the row's cache as the prompt would have. (One call, one
  # compile: each prompt of a call decodes as it would alone.)
  refs = generate(model, [c[0] for c in checks], [0] * len(checks),
                  SamplingParams(temperature=0.0, max_new_tokens=1, stop_tokens=STOPS))
  for ref, (_, token, logprob) in zip(refs, checks, strict=True):
    assert ref.tokens.tolist() == [token]
    np.testing.assert_allclose(ref.logprobs, [logprob], atol=1e-5)
  for key, j, tokens, observed in calls:  # each sample up to its stop, replies marked
    assert tokens[-1] in STOPS and len(observed) == len(tokens)
    assert sum(observed) == 3 * (np.asarray(tokens)[np.asarray(observed, bool)] == 50).sum()


def test_sampled_turns_on_fewer_rows_than_samples_reply_finish_and_stop_at_max_turns(model):
  """Also fed a token a decode step (feed_tokens=1): the same samples, the reply's stop id
  (5) ending no turn, its tokens at sampling log-prob 0."""
  params = SamplingParams(max_new_tokens=20, stop_tokens=STOPS)
  runs = []
  for feed_tokens in (256, 1):
    replies_seen = {}

    def respond(key, j, tokens, observed):
      replies_seen[(key, j)] = replies_seen.get((key, j), 0) + 1
      return [50, 5]  # always go on: max_turns ends it

    batch = ContinuousBatch(model, 3, 2, params, rows_per_prompt=2, respond=respond,
                            max_turns=1, feed_tokens=feed_tokens)
    for i, p in enumerate(PROMPTS):
      batch.add(i, p, [11 * i + j for j in range(3)])
    done = dict(batch.run())
    assert sorted(done) == [0, 1, 2]
    assert set(replies_seen.values()) == {1}  # one reply each: then a stop finishes it
    for group in done.values():
      assert len(group) == 3
      for s in group:
        k = int(np.sum(s.observed))
        assert k in (0, 2) and s.tokens.shape == s.observed.shape == s.logprobs.shape
        if k:
          at = int(np.argmax(s.observed))
          assert s.tokens[at:at + 2].tolist() == [50, 5] and s.tokens[at - 1] in STOPS
          assert np.all(s.sampling_logprobs[at:at + 2] == 0)
        ends_on_stop = s.tokens[-1] in STOPS and not s.observed[-1]
        assert s.finish_reason == ("stop" if ends_on_stop else "length")
        assert ends_on_stop or len(s.tokens) == 20
    # The samples that got a reply are the ones that ended a turn within the budget.
    assert sum(int(np.sum(s.observed) > 0) for g in done.values() for s in g) == len(replies_seen)
    runs.append([(s.tokens.tolist(), s.observed.tolist()) for i in range(3) for s in done[i]])
  assert runs[0] == runs[1]


def test_a_reply_the_budget_cannot_hold_ends_the_sample_by_length(model):
  params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_tokens=STOPS)
  batch = ContinuousBatch(model, 1, 1, params, respond=lambda k, j, t, o: [50] * 30)
  for i, p in enumerate(PROMPTS):
    batch.add(i, p, [1])
  for _, [s] in batch.run():
    assert len(s.tokens) <= 8
    if s.observed.any():
      assert len(s.tokens) == 8 and s.finish_reason == "length" and s.observed[-1]
  # A reply that exactly fills the budget is fed a token a step too: it ends the sample at
  # max_new_tokens, by length.
  batch = ContinuousBatch(model, 1, 1, params, respond=lambda k, j, t, o: (
      None if o.any() else [50] * (8 - len(t))))
  for i, p in enumerate(PROMPTS):
    batch.add(i, p, [1])
  ended = [s for _, [s] in batch.run() if s.observed.any()]
  assert ended
  for s in ended:
    assert len(s.tokens) == 8 and s.finish_reason == "length" and s.observed[-1]


def test_a_reply_of_no_tokens_ends_the_sample_as_none_does(model):
  """An empty reply is no turn (a resumed sample could not count it, and would get one
  more): the sample ends at that stop, as with None, and respond is asked once."""
  params = SamplingParams(max_new_tokens=20, stop_tokens=STOPS)
  ends = {}
  for answer in (None, []):
    asked = []
    batch = ContinuousBatch(model, 3, 2, params, respond=lambda k, j, t, o: (
        asked.append((k, j)), answer)[1], max_turns=4)
    for i, p in enumerate(PROMPTS):
      batch.add(i, p, [11 * i + j for j in range(3)])
    done = dict(batch.run())
    assert len(asked) == len(set(asked))
    ends[repr(answer)] = {k: [s.tokens.tolist() for s in g] for k, g in done.items()}
  assert ends["None"] == ends["[]"]
  assert any(t[-1] in STOPS and len(t) < 20 for g in ends["[]"].values() for t in g)


def test_bad_respond_settings_and_replies_are_named(model):
  with pytest.raises(TypeError, match="respond: expected a callable or None, got int"):
    ContinuousBatch(model, 1, 1, respond=3)
  with pytest.raises(ValueError, match="max_turns: expected an int >= 0, got -1"):
    ContinuousBatch(model, 1, 1, respond=lambda *a: None, max_turns=-1)
  with pytest.raises(ValueError, match="respond_threads: expected a positive int, got 0"):
    ContinuousBatch(model, 1, 1, respond=lambda *a: None, respond_threads=0)
  with pytest.raises(ValueError, match="feed_tokens: expected a positive int, got 0"):
    ContinuousBatch(model, 1, 1, respond=lambda *a: None, feed_tokens=0)
  params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_tokens=STOPS)
  batch = ContinuousBatch(model, 1, 1, params, respond=lambda k, j, t, o: [99])
  for i, p in enumerate(PROMPTS):
    batch.add(i, p, [1])
  with pytest.raises(ValueError, match=r"respond: reply token ids must lie in \[0, 61\), got "
                                       r"\[99, 99\]"):
    batch.run()


def test_a_slow_reply_does_not_hold_the_other_rows(model):
  # Prompt "slow"'s replies wait on an event; the other prompts' groups finish meanwhile,
  # then the slow one goes on from where it paused, as if it had not waited.
  params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_tokens=tuple(range(1, 40)))
  release = threading.Event()

  def respond(key, j, tokens, observed):
    if key == "slow":
      assert release.wait(30)
    return [50, 51] if len(tokens) < 4 else None

  def run(slow_first):
    batch = ContinuousBatch(model, 1, 3, params, respond=respond, chunk_steps=4)
    batch.add("slow", PROMPTS[0], [1])
    for i, p in enumerate(PROMPTS[1:]):
      batch.add(i, p, [1])
    done = {}
    for _ in range(50):
      done.update(batch.step())
      if slow_first and len(done) == 2:
        break
    else:
      assert not slow_first
    if slow_first:
      assert sorted(done) == [0, 1] and batch.running == 1  # the slow one still waits
      release.set()
      done.update(batch.run())
    batch.close()
    return done

  waited = run(slow_first=True)
  plain = run(slow_first=False)  # the event is set: no waiting
  assert set(waited) == set(plain) == {"slow", 0, 1}
  for key in plain:
    assert waited[key][0].tokens.tolist() == plain[key][0].tokens.tolist()
    assert waited[key][0].observed.tolist() == plain[key][0].observed.tolist()
  assert waited["slow"][0].observed.any()


@pytest.mark.slow  # ~6 s
def test_routing_replay_records_the_experts_of_the_replies_tokens_too():
  # Replies run through the decode step like the policy's tokens, so the trainer routes
  # every fed-back token (replies included) as the sampler did.
  moe = ModelConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, architecture="qwen3",
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                    norm_topk_prob=True)
  params = SamplingParams(max_new_tokens=12, stop_tokens=tuple(range(1, 20)))
  # Initialised in one program: eagerly, each op of the init is a compile of its own.
  batch = ContinuousBatch(nnx.jit(lambda: Transformer(moe, rngs=nnx.Rngs(0)))(), 2, 2, params,
                          rows_per_prompt=1, record_routes=True,
                          respond=lambda k, j, t, o: [50, 51] if len(t) < 6 else None)
  for i, p in enumerate(PROMPTS[:2]):  # both slots filled at once: one prefill program
    batch.add(i, p, [i, i + 10])
  replied = 0
  for _, group in batch.run():
    for s in group:
      assert s.routes.shape == (len(s.tokens) - 1, 1, 2) and (s.routes >= 0).all()
      replied += int(s.observed.any())
  assert replied > 0


@pytest.mark.slow  # ~9 s
def test_a_resumed_conversation_goes_on_as_if_never_interrupted(model):
  """Partial rollouts of multi-turn samples: begun turns and replies are fed with their
  flags, the replies they had count toward max_turns, and each later turn and reply is the
  uninterrupted run's (the environment sees the sample's own index and flags)."""
  import dataclasses
  params = SamplingParams(max_new_tokens=24, stop_tokens=STOPS)
  calls = {"a": [], "b": []}

  def respond_for(run):
    def respond(key, j, tokens, observed):
      calls[run].append((j, tokens.tolist(), observed.tolist()))
      return [50, 40 + int(np.sum(tokens == 50)), 51]  # always answers: max_turns ends it
    return respond

  seeds = [7, 8, 9]
  whole = ContinuousBatch(model, 3, 1, params, respond=respond_for("a"), max_turns=2)
  whole.add(0, PROMPTS[0], seeds)
  (_, want), = whole.run()
  replied = [s for s in want if s.observed.any()]
  assert len(replied) >= 2
  begun = []
  for s in want:  # cut 2 tokens after the first reply, or mid first turn
    first = np.flatnonzero(s.observed)
    k = first[0] + 5 if len(first) else max(1, len(s.tokens) // 2)
    k = min(k, len(s.tokens) - 1)
    begun.append(dataclasses.replace(s, tokens=s.tokens[:k], logprobs=s.logprobs[:k],
                                     sampling_logprobs=s.sampling_logprobs[:k],
                                     observed=s.observed[:k], finish_reason=""))
  resumed = ContinuousBatch(model, 3, 1, params, respond=respond_for("b"), max_turns=2,
                            resume=True)
  resumed.add(0, PROMPTS[0], seeds, begun)
  (_, got), = resumed.run()
  for a, b in zip(got, want):
    assert a.resumed and a.tokens.tolist() == b.tokens.tolist()
    assert a.observed.tolist() == b.observed.tolist()
    np.testing.assert_allclose(a.sampling_logprobs, b.sampling_logprobs, atol=1e-5)
  # The resumed run asked only for the turns after the cut, exactly as the whole run did.
  later = [c for c in calls["a"] if len(c[1]) > len(begun[c[0]].tokens)]
  assert sorted(calls["b"]) == sorted(later) and later


def test_a_reply_is_fed_in_one_step_not_one_decode_step_a_token(model, monkeypatch):
  """A 6-token reply joins the row in one step: the conversation takes 6 fewer decode steps
  than feeding it a token a step (feed_tokens=1), with the same tokens; a stop id (3) in
  the reply ends no turn either way."""
  from inference_workers import continuous
  params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_tokens=STOPS)
  reply = [50, 51, 3, 53, 54, 55]
  steps = []
  chunk = continuous._chunk

  def counted(*args, **kwargs):
    out = chunk(*args, **kwargs)
    steps[-1] += int(out[2])
    return out

  monkeypatch.setattr(continuous, "_chunk", counted)
  runs = []
  for feed_tokens in (256, 1):
    steps.append(0)
    batch = ContinuousBatch(model, 1, 1, params, feed_tokens=feed_tokens,
                            respond=lambda key, j, tokens, observed: (
                                None if np.any(observed) else reply))
    batch.add(0, PROMPTS[2], [7])
    [(_, [sample])] = batch.run()
    runs.append(sample)
  one_step, a_token_a_step = runs
  assert one_step.observed.sum() == len(reply)  # answered once, then it went on
  assert one_step.tokens.tolist() == a_token_a_step.tokens.tolist()
  np.testing.assert_allclose(one_step.logprobs, a_token_a_step.logprobs, atol=1e-5)
  assert steps[0] == steps[1] - len(reply)


@pytest.mark.parametrize("variant", [  # sinks (~8 s) with the slow suite
    "window-softcap", pytest.param("sinks", marks=pytest.mark.slow)])
def test_a_reply_fed_at_once_attends_as_a_prompt_would(variant):
  """The several-token step keeps the attention variants: after a reply, greedy decoding
  goes on exactly as decoding the transcript as a prompt (a 5-token window that the reply
  crosses and soft-capped logits; gpt-oss's attention sinks)."""
  from rlax_ps.models import assign_params, flatten_params
  config = (CONFIG.replace(sliding_window=5, attn_logit_softcapping=20.0)
            if variant == "window-softcap" else
            CONFIG.replace(architecture="gpt_oss", attention_sinks=True, attention_out_bias=True))
  model = Transformer(config, rngs=nnx.Rngs(2))
  rng = np.random.default_rng(3)  # sinks away from their zero init
  assign_params(model, {k: np.asarray(v) + (rng.normal(0, 1.0, v.shape).astype(np.float32)
                                            if k.endswith("sinks") else 0)
                        for k, v in flatten_params(model).items()})
  params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_tokens=STOPS)
  reply = [50, 51, 52, 53, 54]
  batch = ContinuousBatch(model, 1, len(PROMPTS), params,
                          respond=lambda key, j, tokens, observed: None if observed.any() else reply)
  for i, p in enumerate(PROMPTS):
    batch.add(i, p, [0])
  checked = 0
  for i, [s] in batch.run():
    end = int(np.flatnonzero(s.observed)[-1]) + 1 if s.observed.any() else 0  # past the reply
    toks = s.tokens.tolist()
    if not end or end == len(toks):
      continue
    assert toks[end - len(reply):end] == reply
    [ref] = generate(model, [PROMPTS[i] + toks[:end]], [0], SamplingParams(
        temperature=0.0, max_new_tokens=len(toks) - end, stop_tokens=STOPS))
    assert ref.tokens.tolist() == toks[end:]
    np.testing.assert_allclose(ref.logprobs, s.logprobs[end:], atol=1e-5)
    checked += 1
  assert checked >= 2


@pytest.mark.slow  # ~20 s cold: 4-device compiles of the resume and reply programs
def test_turns_and_resumed_samples_on_a_mesh_equal_one_devices(model):
  # Replies fed at once (_feed_rows), paused rows answered (_answer) and begun samples
  # inserted with their tokens, on slots split over data and heads over tensor.
  import dataclasses
  import jax
  from rlax_ps import sharding as shd
  params = SamplingParams(max_new_tokens=24, stop_tokens=STOPS)
  mesh = shd.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
  graphdef, state = nnx.split(model)
  on_mesh = nnx.merge(graphdef, jax.device_put(state, shd.named(
      mesh, shd.param_specs(state, nnx.get_partition_spec(state), mesh))))
  respond = lambda key, j, tokens, observed: reply_to(tokens)  # noqa: E731
  seeds = [[7, 8, 9], [1, 2, 3], [4, 5, 6]]

  def run(m, mesh, begun=()):
    batch = ContinuousBatch(m, 3, 2, params, respond=respond, max_turns=2, resume=True,
                            rows_per_prompt=2, mesh=mesh)
    for i, (prompt, s) in enumerate(zip(PROMPTS, seeds)):
      batch.add(i, prompt, s, begun[i] if begun else None)
    return dict(batch.run())

  want = run(model, None)
  assert sum(s.observed.any() for got in want.values() for s in got) >= 2
  begun = {i: [dataclasses.replace(s, tokens=s.tokens[:len(s.tokens) // 2],
                                   logprobs=s.logprobs[:len(s.tokens) // 2],
                                   sampling_logprobs=s.sampling_logprobs[:len(s.tokens) // 2],
                                   observed=s.observed[:len(s.tokens) // 2], finish_reason="")
               for s in got] for i, got in want.items()}
  got = run(on_mesh, mesh, begun)  # resumed halfway: their later turns still come
  for i in want:
    for a, b in zip(got[i], want[i]):
      assert a.tokens.tolist() == b.tokens.tolist()
      assert a.observed.tolist() == b.observed.tolist()
      np.testing.assert_allclose(a.sampling_logprobs, b.sampling_logprobs, atol=1e-5)


def worker_turns(model, answers, max_turns=2):
  """The worker's replies in the decode loop on prompts "bad" and "good", its environment
  answering each prompt's turns with answers[prompt id]: ({prompt id: samples}, the
  environment)."""
  from algorithms.environments import GuardedEnvironment
  from inference_workers.loop import Worker
  from inference_workers.worker_config import WorkerConfig
  from param_server.protos import param_server_pb2 as pb
  from worker_testlib import ManyStops

  # CONFIG's 61 ids; digits end turns, so that a random model's samples end them often
  tokenizer = ManyStops(string.digits + string.ascii_letters[:47] + "\n")
  environment = GuardedEnvironment("mine", lambda messages, reference: answers[reference])
  worker = Worker(None, CONFIG, tokenizer,
                  WorkerConfig(samples_per_prompt=3, max_new_tokens=20, max_turns=max_turns),
                  environments={"*": environment})
  batch = ContinuousBatch(model, 3, 2, worker.params, respond=worker._respond,
                          max_turns=max_turns)
  for i, pid in enumerate(answers):
    prompt = pb.Prompt(id=pid, text="hello", extra=pid.encode())
    worker._started[("L", pid)] = (prompt, 0)
    batch.add(("L", pid), tokenizer.encode_prompt(prompt.text), [11 * i + j for j in range(3)])
  done = {key[1]: group for key, group in batch.run()}
  batch.close()
  return done, environment


def tokens_of(done):
  return {pid: [s.tokens.tolist() for s in group] for pid, group in done.items()}


@pytest.mark.slow  # ~4 s; test_environments' guard reads [] as None, and the tests above
def test_an_environment_reply_of_no_strings_ends_the_sample_as_none_does(model):
  """`[run(c) for c in calls]` on a turn without a call is []: the sample ends there, as
  with None, and the worker goes on."""
  ends = {}
  for answer in (None, []):
    done, environment = worker_turns(model, {"bad": answer, "good": "ok"})
    assert environment.errors == 0
    ends[repr(answer)] = tokens_of(done)
  assert ends["None"] == ends["[]"]
  assert any(len(t) < 20 for t in ends["[]"]["bad"])  # it ended turns: asked, then stopped


@pytest.mark.slow  # ~5 s; test_environments holds the tuple in the default suite
def test_an_environment_reply_as_a_tuple_is_fed_as_a_list(model):
  by_tuple, _ = worker_turns(model, {"bad": ("ok", "no"), "good": "ok"})
  by_list, _ = worker_turns(model, {"bad": ["ok", "no"], "good": "ok"})
  assert tokens_of(by_tuple) == tokens_of(by_list)
  assert any(s.observed.any() for s in by_tuple["bad"])


def test_an_environment_reply_of_a_wrong_type_ends_its_sample_and_the_rest_go_on(model,
                                                                                caplog):
  """A reply of no type the contract allows is an error the environment counts, logged
  naming it: that sample ends at its turn; the decode loop does not raise, and the other
  prompt's samples get their replies."""
  with caplog.at_level("WARNING"):
    done, environment = worker_turns(model, {"bad": 7, "good": "ok"})
  ended = [s for s in done["bad"] if len(s.tokens) < 20]
  assert ended and not any(s.observed.any() for s in done["bad"])
  assert all(s.finish_reason == "stop" for s in ended)
  assert any(s.observed.any() for s in done["good"])
  assert environment.errors == len(ended)
  assert ("environment 'mine''s reply on prompt bad cannot be fed (the sample ends; "
          "environment errors so far: 1): environment 'mine': expected a str reply, a list "
          "of them or None, got int") in caplog.text


def test_the_worker_answers_a_call_between_special_token_markers(tmp_path):
  """The worker read a turn with special tokens skipped: where `<tool_call>` is a special
  token (some Hermes checkpoints), a call after any text went unanswered."""
  from algorithms.environments import GuardedEnvironment
  from algorithms.tools import TOOLS, ToolCalls, register_tool
  from inference_workers.loop import Worker
  from inference_workers.worker_config import WorkerConfig
  from param_server.protos import param_server_pb2 as pb
  from tokenizer_testlib import special_marker_tokenizer

  @register_tool
  def twice(n: int) -> int:
    """Double a number."""
    return 2 * n

  try:
    tokenizer = special_marker_tokenizer(tmp_path)
    worker = Worker(None, CONFIG, tokenizer, WorkerConfig(max_turns=2),
                    environments={"*": GuardedEnvironment("tool_calls", ToolCalls())})
    worker._started[("L", "p")] = (pb.Prompt(id="p", text="hi"), 0)
    turn = 'Let me ask.\n<tool_call>\n{"name": "twice", "arguments": {"n": 21}}\n</tool_call>'
    tokens = np.asarray(tokenizer.encode(turn) + [tokenizer.turn_end_id], np.int32)
    ids = worker._respond(("L", "p"), 0, tokens, np.zeros(len(tokens), bool))
    assert ids is not None and "42" in tokenizer.decode(ids)
  finally:
    TOOLS.pop("twice")
