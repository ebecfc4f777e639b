"""SampleBatch: rows shared by every prompt's samples. Each sample equals generate's for its
prompt and seed, groups come back whole and in sample order, a long answer holds no other
row back, and partial rollouts, resumed samples and multi-turn replies keep their group's
keys and sample indices."""

import dataclasses

import pytest
from flax import nnx

from inference_workers import continuous
from inference_workers.continuous import ContinuousBatch
from inference_workers.sample_batch import SampleBatch
from rlax_ps.models import Transformer
from test_continuous_batching import (CONFIG, LONGEST_FIRST, PARAMS, PROMPTS, STOPS, assert_same,
                                      count_decode_steps, lengths, reference, references,
                                      seeds_of)


@pytest.fixture(scope="module")
def model():
  return Transformer(CONFIG, rngs=nnx.Rngs(0))


def test_every_sample_is_generates_and_groups_come_back_whole(model):
  batch = SampleBatch(model, 3, 4, PARAMS, return_after=1)
  for i in LONGEST_FIRST:  # five prompts, 15 samples, through 4 rows
    batch.add(i, PROMPTS[i], seeds_of(i, 3))
  assert (batch.waiting, batch.running, batch.free) == (5, 0, 0)
  first = batch.step()
  assert batch.running >= 2  # the 4 rows took samples of the first two prompts
  done = first + batch.run()
  assert sorted(k for k, _ in done) == list(range(5))
  assert batch.running == batch.waiting == 0 and batch.free == 2  # 4 rows: 2 prompts' worth
  want = references(model, 3)
  for k, got in done:
    assert_same(got, want[k])
  with pytest.raises(ValueError, match="seeds: expected 1 to n=3 seeds"):
    batch.add(9, PROMPTS[0], seeds_of(0, 4))
  batch.add(9, PROMPTS[0], seeds_of(0, 2))  # fewer samples than n: a group of 2
  with pytest.raises(ValueError, match="key: 9 is queued or running already"):
    batch.add(9, PROMPTS[1], seeds_of(1, 2))
  (key, got), = batch.run()
  assert key == 9 and len(got) == 2
  assert_same(got, want[0][:2])


def test_a_prompts_samples_share_one_prefill(model, monkeypatch):
  insert, prefilled = continuous._insert, []

  def recorded(graphdef, state, slots, slot_ids, tokens, *args, **kwargs):
    prefilled.append((len(slot_ids), tokens.shape[0]))
    return insert(graphdef, state, slots, slot_ids, tokens, *args, **kwargs)

  monkeypatch.setattr(continuous, "_insert", recorded)
  batch = SampleBatch(model, 3, 6, PARAMS)
  for i in range(2):
    batch.add(i, PROMPTS[i], seeds_of(i, 3))
  done = dict(batch.run())
  assert prefilled[0] == (8, 2)  # six samples (padded to 8 slots), two prompts prefilled
  want = references(model, 3)
  for i in range(2):
    assert_same(done[i], want[i])


def test_bad_settings_are_refused_naming_them(model):
  with pytest.raises(ValueError, match="rows: expected a positive int"):
    SampleBatch(model, 2, 0, PARAMS)
  with pytest.raises(ValueError, match=r"return_after: expected an int >= 0 \(0: rows // 8\)"):
    SampleBatch(model, 2, 4, PARAMS, return_after=-1)
  with pytest.raises(ValueError, match="return_after: expected a positive int"):
    ContinuousBatch(model, 2, 4, PARAMS, return_after=0)
  batch = SampleBatch(model, 2, 2, PARAMS)
  with pytest.raises(ValueError, match=r"prompts\[0\]: token ids must lie in \[0, 61\)"):
    batch.add("x", [3, 99], seeds_of(0))
  assert batch.waiting == 0  # nothing of a refused prompt is queued


@pytest.mark.slow  # ~6 s; test_continuous_batching's long-group case stays in the default suite
def test_a_long_answer_holds_no_other_row_back(model, monkeypatch):
  """Two rows, prompt a's samples long and short, b's two short: a slot per prompt keeps
  both rows on a until its long answer ends; shared rows finish b beside it."""
  lens = lengths(model, PROMPTS[0], list(range(64)))
  long_ = next(s for s in range(64) if lens[s] == PARAMS.max_new_tokens)
  short = [s for s in range(64) if lens[s] <= 3][:3]
  steps = count_decode_steps(monkeypatch)
  runs = {}
  for name, batch in (("slot per prompt", ContinuousBatch(model, 2, 1, PARAMS)),
                      ("shared rows", SampleBatch(model, 2, 2, PARAMS, return_after=1))):
    steps.clear()
    batch.add("a", PROMPTS[0], [long_, short[0]])
    batch.add("b", PROMPTS[0], short[1:])
    runs[name] = (dict(batch.run()), sum(steps))
  (per_prompt, slow), (shared, fast) = runs.values()
  for key in "ab":
    assert_same(shared[key], per_prompt[key])
  # a's long answer takes max_new_tokens - 1 steps; b's ran beside it, not after.
  assert fast == PARAMS.max_new_tokens - 1 and slow > fast


def test_partial_rollouts_and_resumed_samples_keep_their_group(model):
  lens = lengths(model, PROMPTS[0], list(range(64)))
  seeds = [s for s in range(64) if lens[s] >= 8][:3]
  want = reference(model, PROMPTS[0], seeds)

  def begun(sample, k, done=False):
    return dataclasses.replace(sample, tokens=sample.tokens[:k], finish_reason=(
        sample.finish_reason if done else ""), logprobs=sample.logprobs[:k],
        sampling_logprobs=sample.sampling_logprobs[:k])

  batch = SampleBatch(model, 3, 1, PARAMS, chunk_steps=2, resume=True)
  batch.add("a", PROMPTS[0], seeds, [begun(want[0], 3), want[1]])  # the second complete
  batch.step()  # one row: sample 0 has 2 more tokens, 1 and 2 wait
  (key, samples, finished), = batch.partial()
  assert key == "a" and finished == [False, True, False]  # a complete begun sample: done
  assert samples[0].tokens.tolist() == want[0].tokens[:5].tolist()
  assert samples[1].tokens.tolist() == want[1].tokens.tolist()
  assert samples[2].tokens.size == 0
  (_, got), = batch.run()
  assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]
  assert got[0].resumed and got[1].resumed and not got[2].resumed
  batch.add("b", PROMPTS[1], seeds_of(1, 3))
  assert batch.partial() == []  # queued, nothing started
  batch.clear()
  assert (batch.waiting, batch.running) == (0, 0)


def test_replies_are_asked_for_by_the_groups_key_and_sample_index(model):
  asked = []

  def respond(key, j, tokens, observed):
    asked.append((key, j, tokens.tolist()))
    return None  # the sample ends at its stop token

  batch = SampleBatch(model, 3, 2, PARAMS, respond=respond)
  for i in range(2):
    batch.add(i, PROMPTS[i], seeds_of(i, 3))
  got = dict(batch.run())
  batch.close()
  stopped = {(k, j): s.tokens.tolist() for k, g in got.items() for j, s in enumerate(g)
             if s.finish_reason == "stop"}
  assert stopped and sorted((k, j) for k, j, _ in asked) == sorted(stopped)
  assert all(tokens == stopped[(k, j)] for k, j, tokens in asked)
  assert all(tokens[-1] in STOPS for _, _, tokens in asked)
