"""Continuous batching: a finished prompt's slot is refilled while the others decode on, and
every sample still equals `generate`'s for its prompt and seed (refills, a longer prompt
growing the slots, routing replay's routes); a long group no longer holds short ones back;
weights changed between chunks are read by the next one."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax import export

from benchmarks_lib import load_benchmark
from inference_workers import continuous
from inference_workers.continuous import ContinuousBatch
from inference_workers.decoding import knobs
from inference_workers.sampler import generate
from inference_workers.sampling import SamplingParams
from rlax_ps.models import ModelConfig, Transformer

CONFIG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, qkv_bias=True, architecture="qwen2")
MOE = ModelConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, architecture="qwen3", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True)
STOPS = tuple(range(1, 9))  # about one token in eight stops a sample: lengths vary
PARAMS = SamplingParams(max_new_tokens=12, stop_tokens=STOPS)
PROMPTS = [[3, 14, 15, 9], [26, 5], [35, 8, 9, 7, 9, 3], [23, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2],
           [7, 9, 5]]
# The order to add PROMPTS in where slots should not grow (a compile per slot length):
# the longest first.
LONGEST_FIRST = [3, 0, 1, 2, 4]


@pytest.fixture(scope="module")
def model():
  return Transformer(CONFIG, rngs=nnx.Rngs(0))


def seeds_of(i, n=2):
  return [100 * i + j for j in range(n)]


def reference(model, prompt, seeds, params=PARAMS, **kw):
  return generate(model, [prompt] * len(seeds), seeds, params, **kw)


def references(model, n, **kw):
  """generate's samples of every prompt (seeds_of), in one call: {prompt index: [n]}."""
  flat = generate(model, [p for p in PROMPTS for _ in range(n)],
                  [s for i in range(len(PROMPTS)) for s in seeds_of(i, n)], PARAMS, **kw)
  return {i: flat[i * n:(i + 1) * n] for i in range(len(PROMPTS))}


def assert_same(got, want):
  for a, b in zip(got, want, strict=True):
    assert a.tokens.tolist() == b.tokens.tolist()
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    np.testing.assert_allclose(a.sampling_logprobs, b.sampling_logprobs, atol=1e-5)
    assert a.finish_reason == b.finish_reason


def test_refilled_slots_give_every_prompt_its_own_samples(model):
  # Three samples on two rows: the row whose sample ends first takes the third.
  batch = ContinuousBatch(model, 3, 2, PARAMS, rows_per_prompt=2)
  for i in LONGEST_FIRST:  # five prompts through two slots, sized for the longest from the start
    batch.add(i, PROMPTS[i], seeds_of(i, 3))
  assert (batch.waiting, batch.running) == (5, 0)
  done = batch.run()
  assert sorted(k for k, _ in done) == list(range(5)) and batch.running == batch.waiting == 0
  want = references(model, 3)
  for key, group in done:
    assert_same(group, want[key])


# fp8 caches are the int8 ones' QuantizedKV with e4m3 codes (their range and the worker's fp8
# decoding are tested in the default suite): the fp8 case (~6 s) runs with the slow suite.
@pytest.mark.parametrize("held,bound", [
    pytest.param("float8_e4m3fn", 0.02, marks=pytest.mark.slow), ("int8", 0.002)])
def test_a_narrow_cache_holds_a_byte_a_value_and_its_log_probs_stay_the_policys(
    model, held, bound):
  """kv_dtype=float8_e4m3fn or int8: the cache's k/v take 1 byte each (the model's
  float32: 4) and a float32 scale per token and head; the samples drawn through it
  carry log-probs within its precision of the policy's own (teacher-forced, full
  precision), which the trainer's corrections rely on."""
  narrow = ContinuousBatch(model, 2, 2, PARAMS, kv_dtype=held)
  for i, p in enumerate(PROMPTS[:3]):
    narrow.add(i, p, seeds_of(i))
  done = dict(narrow.run())
  c = narrow._dev.slots.cache
  kv = c.prefix_k + c.prefix_v + c.suffix_k + c.suffix_v
  assert {x.dtype.name for x in kv} == {held}
  scales = sum(x.scales.size for x in kv)
  assert sum(x.nbytes for x in kv) == sum(np.prod(x.shape) for x in kv) + 4 * scales
  assert scales == sum(np.prod(x.shape[:-1]) for x in kv)
  seqs = [(PROMPTS[i], s) for i, group in done.items() for s in group]
  width = max(len(p) + len(s.tokens) for p, s in seqs)
  tokens = np.zeros((len(seqs), width), np.int32)  # right-padded: causal, so it is unseen
  for row, (p, s) in enumerate(seqs):
    tokens[row, :len(p) + len(s.tokens)] = p + s.tokens.tolist()
  logp = np.asarray(jax.nn.log_softmax(model(tokens).astype(np.float32), axis=-1))
  gaps = np.concatenate([
      np.abs(logp[row, np.arange(len(p) - 1, len(p) + len(s.tokens) - 1), s.tokens]
             - s.logprobs) for row, (p, s) in enumerate(seqs)])
  assert gaps.max() < bound and gaps.mean() < bound / 4, (gaps.max(), gaps.mean())
  assert gaps.max() > 1e-6  # the cache did round: not the full-precision path
  with pytest.raises(ValueError, match="kv_dtype: expected None .* got 'int4'"):
    ContinuousBatch(model, 2, 2, PARAMS, kv_dtype="int4")


def lengths(model, prompt, seeds):
  return [len(s.tokens) for s in reference(model, prompt, seeds)]


def count_decode_steps(monkeypatch) -> list[int]:
  """The decode steps of each chunk run from now on (appended as they run)."""
  steps, chunk = [], continuous._chunk

  def counted(*args, **kwargs):
    out = chunk(*args, **kwargs)
    steps.append(int(out[2]))
    return out

  monkeypatch.setattr(continuous, "_chunk", counted)
  return steps


def test_a_long_group_does_not_hold_back_the_short_ones(model):
  # Seeds whose samples of PROMPTS[0] run the whole budget, and some that stop at once.
  lens = lengths(model, PROMPTS[0], list(range(64)))
  long_ = [s for s in range(64) if lens[s] == 12][:2]
  short = [s for s in range(64) if lens[s] <= 2][:6]
  assert len(long_) == 2 and len(short) == 6
  pairs = [short[i:i + 2] for i in range(0, 6, 2)]
  batch = ContinuousBatch(model, 2, 2, PARAMS)
  batch.add("long", PROMPTS[0], long_)
  for i, pair in enumerate(pairs):
    batch.add(i, PROMPTS[0], pair)
  order = [key for key, _ in batch.run()]
  assert order == [0, 1, 2, "long"]  # the second slot served all three meanwhile


def test_a_longer_prompt_grows_the_slots_while_others_run(model):
  batch = ContinuousBatch(model, 2, 2, PARAMS)
  batch.add(1, PROMPTS[1], seeds_of(1))  # two tokens: slots sized for 8
  batch.step()
  batch.add(3, PROMPTS[3], seeds_of(3))  # twelve tokens: the slots grow to 16
  got = dict(batch.run())
  want = references(model, 2)
  for key, group in got.items():
    assert_same(group, want[key])
  assert 3 in got


def test_weights_changed_between_chunks_are_read_by_the_next_chunk(model):
  params = SamplingParams(greedy=True, max_new_tokens=8)
  other = Transformer(CONFIG, rngs=nnx.Rngs(1))
  old = reference(model, PROMPTS[0], [0], params)[0].tokens.tolist()
  new = reference(other, PROMPTS[0], [0], params)[0].tokens.tolist()
  assert old[:3] != new[:3]
  held = Transformer(CONFIG, rngs=nnx.Rngs(0))
  batch = ContinuousBatch(held, 1, 1, params, chunk_steps=2)
  batch.add(0, PROMPTS[0], [0])
  assert batch.step() == []  # the first token (prefill) and two decode steps on the old weights
  nnx.update(held, nnx.state(other))
  (_, [sample]), = batch.run()
  tokens = sample.tokens.tolist()
  assert tokens[:3] == old[:3] and tokens != old


def test_the_model_is_split_again_only_when_its_weights_change(model, monkeypatch):
  split, calls = nnx.split, []
  monkeypatch.setattr(continuous.nnx, "split", lambda m: calls.append(1) or split(m))
  held = Transformer(CONFIG, rngs=nnx.Rngs(0))
  batch = ContinuousBatch(held, 2, 1, PARAMS, chunk_steps=2)
  for i in range(2):
    batch.add(i, PROMPTS[i], seeds_of(i))
  batch.step()
  batch.step()  # a prefill and chunks, one split
  assert len(calls) == 1
  nnx.update(held, nnx.state(Transformer(CONFIG, rngs=nnx.Rngs(1))))  # new weights
  batch.step()
  assert len(calls) == 2


@pytest.mark.slow  # ~6 s; test_partial_rollouts holds begun samples in the default suite
def test_begun_samples_are_written_and_drawn_on_as_if_never_interrupted(model):
  """Partial rollouts: a begun sample's tokens are fed first, with the log-probs it was
  drawn with, then it draws on with its own seed (step t: fold_in(seed, t)), so it equals
  the uninterrupted sample; a finished one comes back as it was; a sample starting later on
  device (3 samples on 2 rows) is resumed alike."""
  lens = lengths(model, PROMPTS[0], list(range(64)))
  long_ = [s for s in range(64) if lens[s] >= 6]
  a, b = [long_[0], 1, 2], [3, 4, long_[1]]
  want_a, want_b = reference(model, PROMPTS[0], a), reference(model, PROMPTS[0], b)

  def begun(sample, k):
    return dataclasses.replace(sample, tokens=sample.tokens[:k], finish_reason="",
                               logprobs=np.full(k, -0.5, np.float32),
                               sampling_logprobs=np.full(k, -0.25, np.float32))

  batch = ContinuousBatch(model, 3, 2, PARAMS, rows_per_prompt=2, resume=True)
  batch.add("a", PROMPTS[0], a, [begun(want_a[0], 4), want_a[1]])  # the third not begun
  batch.add("b", PROMPTS[0], b, [begun(want_b[0], 0), begun(want_b[1], 0),
                                 begun(want_b[2], 3)])
  batch.add("c", PROMPTS[1], seeds_of(1, 3))  # nothing begun
  got = dict(batch.run())
  assert_same([got["a"][2], *got["b"][:2]], [want_a[2], *want_b[:2]])
  assert_same(got["c"], reference(model, PROMPTS[1], seeds_of(1, 3)))
  assert got["a"][1].resumed and got["a"][1].tokens.tolist() == want_a[1].tokens.tolist()
  for s, want, k in ((got["a"][0], want_a[0], 4), (got["b"][2], want_b[2], 3)):
    assert s.resumed and s.tokens.tolist() == want.tokens.tolist()
    np.testing.assert_array_equal(s.logprobs[:k], -0.5)  # as first drawn, not re-drawn
    np.testing.assert_array_equal(s.sampling_logprobs[:k], -0.25)
    np.testing.assert_allclose(s.sampling_logprobs[k:], want.sampling_logprobs[k:], atol=1e-5)
  assert not got["c"][0].resumed
  with pytest.raises(ValueError, match="begun: expected None for a batch made with resume"):
    ContinuousBatch(model, 3, 2, PARAMS).add("x", PROMPTS[0], a, [want_a[0]])
  with pytest.raises(ValueError, match=r"begun\[0\].tokens: expected ids in \[0, 61\)"):
    batch.add("x", PROMPTS[0], a, [dataclasses.replace(want_a[0], tokens=np.array([61]))])


def test_begun_tokens_are_prefilled_not_fed_a_decode_step_each(model, monkeypatch):
  """Resuming costs one prefill, not a decode step per begun token: the resumed group takes
  k - 1 fewer steps than drawing it afresh (the last begun token is fed by the first step),
  and its samples are the uninterrupted ones."""
  lens = lengths(model, PROMPTS[2], list(range(64)))
  seeds = [s for s in range(64) if lens[s] >= 9][:2]
  want = reference(model, PROMPTS[2], seeds)
  steps = count_decode_steps(monkeypatch)
  for k in (0, 7):
    batch = ContinuousBatch(model, 2, 1, PARAMS, resume=True)
    batch.add("a", PROMPTS[2], seeds, [dataclasses.replace(w, tokens=w.tokens[:k],
                                                           logprobs=w.logprobs[:k],
                                                           sampling_logprobs=w.sampling_logprobs[:k],
                                                           finish_reason="") for w in want])
    (_, got), = batch.run()
    assert [g.tokens.tolist() for g in got] == [w.tokens.tolist() for w in want]
  fresh, resumed = steps
  assert resumed == fresh - 6


# 2 slow (suite time): [0] holds unequal groups, and test_refilled_slots... rows_per_prompt=2.
@pytest.mark.parametrize("rows_per_prompt", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_prompt_may_ask_for_fewer_samples_than_n(model, rows_per_prompt):
  """Unequal groups (VIGOR's rounds) in one batch: each prompt gets the samples its seeds
  ask for, each equal to generate's."""
  batch = ContinuousBatch(model, 4, 2, PARAMS, rows_per_prompt=rows_per_prompt)
  asked = {3: 2, 0: 1, 1: 4, 2: 3}  # the longest prompt first: the slots never grow
  for i, k in asked.items():
    batch.add(i, PROMPTS[i], seeds_of(i, 4)[:k])
  done = dict(batch.run())
  want = references(model, 4)
  for i, k in asked.items():
    assert len(done[i]) == k
    assert_same(done[i], want[i][:k])
  with pytest.raises(ValueError, match="seeds: expected 1 to n=4 seeds"):
    batch.add(9, PROMPTS[0], seeds_of(0, 5))


@pytest.mark.slow  # ~5 s
def test_routes_are_recorded_across_refills():
  moe = Transformer(MOE, rngs=nnx.Rngs(0))
  batch = ContinuousBatch(moe, 2, 1, PARAMS, rows_per_prompt=1, record_routes=True)
  for i in range(2):
    batch.add(i, PROMPTS[i], seeds_of(i))
  references_ = references(moe, 2, record_routes=True)
  for key, group in batch.run():
    want = references_[key]
    assert_same(group, want)
    for a, b in zip(group, want):
      np.testing.assert_array_equal(a.routes, b.routes)
      np.testing.assert_array_equal(a.prompt_routes, b.prompt_routes)
      assert a.prompt_routes.shape == (len(PROMPTS[key]), 2, 2)


@pytest.mark.slow  # ~6 s
def test_resumed_samples_carry_the_routes_of_an_uninterrupted_run():
  """Routing replay: a begun sample's fed tokens are routed as drawn ones were; a finished
  one keeps the routes it came with, beside this run's prompt routes."""
  moe = Transformer(MOE, rngs=nnx.Rngs(0))
  want = reference(moe, PROMPTS[0], [0, 1], record_routes=True)
  k = 4
  assert len(want[0].tokens) > k  # seed 0 draws 10 tokens: 4 begun, 6 drawn on
  begun = [dataclasses.replace(want[0], tokens=want[0].tokens[:k], logprobs=want[0].logprobs[:k],
                               sampling_logprobs=want[0].sampling_logprobs[:k], routes=None,
                               finish_reason=""), want[1]]
  batch = ContinuousBatch(moe, 2, 1, PARAMS, record_routes=True, resume=True)
  batch.add(0, PROMPTS[0], [0, 1], begun)
  (_, got), = batch.run()
  assert_same(got, want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a.routes, b.routes)
    np.testing.assert_array_equal(a.prompt_routes, b.prompt_routes)
  with pytest.raises(ValueError, match=r"begun\[1\].routes: expected the experts of its"):
    batch.add(1, PROMPTS[0], [0, 1], [begun[0], dataclasses.replace(want[1], routes=None)])


def test_bad_input_is_named(model):
  with pytest.raises(ValueError, match="slots"):
    ContinuousBatch(model, 2, 0, PARAMS)
  with pytest.raises(ValueError, match="n: expected"):
    ContinuousBatch(model, 0, 2, PARAMS)
  with pytest.raises(ValueError, match="rows_per_prompt"):
    ContinuousBatch(model, 2, 2, PARAMS, rows_per_prompt=3)
  with pytest.raises(ValueError, match="chunk_steps"):
    ContinuousBatch(model, 2, 2, PARAMS, chunk_steps=-1)
  batch = ContinuousBatch(model, 2, 2, PARAMS)
  with pytest.raises(ValueError, match="seeds: expected 1 to n=2 seeds"):
    batch.add(0, PROMPTS[0], [1, 2, 3])
  with pytest.raises(ValueError, match="seeds: expected 1 to n=2 seeds"):
    batch.add(0, PROMPTS[0], [])
  with pytest.raises(ValueError, match="seeds: expected a sequence of 2 ints"):
    batch.add(0, PROMPTS[0], [1.7, 2.2])  # not truncated to 1 and 2
  with pytest.raises(ValueError, match=r"prompts\[0\]"):
    batch.add(0, [CONFIG.vocab_size], [1, 2])
  with pytest.raises(ValueError, match="max_position_embeddings"):
    batch.add(0, [1] * CONFIG.max_position_embeddings, [1, 2])
  assert batch.waiting == 0
  batch.add(0, PROMPTS[0], [1, 2])  # a key twice: run()'s groups, drop() go by key
  with pytest.raises(ValueError, match="key: 0 is queued or running already"):
    batch.add(0, PROMPTS[1], [1, 2])
  assert batch.waiting == 1


def test_the_benchmark_counts_the_decode_steps_of_each_schedule():
  bench = load_benchmark("continuous_batching")
  # Four one-sample groups (5 tokens: 4 decode steps, then 1 each) on two rows: static
  # calls wait 4 + 1 steps; continuous slots run the three short ones beside the long one.
  assert bench.static_steps([[5], [2], [2], [2]], 2) == (5, 2.5)  # calls of 4 and of 1
  assert bench.continuous_steps([[5], [2], [2], [2]], 2, 1) == (4, 1.75)
  assert bench.continuous_steps([[3]] * 4, 2, 1)[0] == bench.static_steps([[3]] * 4, 2)[0] == 4
  # Two samples per group on two rows: a slot per group waits for its longest sample (4 +
  # 1 + 1); a row per group lets the short groups run beside the long one (4 + 1 -> 5),
  # each taking its two samples' steps one after the other.
  groups = [[5, 2], [2, 2], [2, 2]]
  assert bench.static_steps(groups, 2)[0] == bench.continuous_steps(groups, 2, 2)[0] == 6
  assert bench.continuous_steps(groups, 2, 1) == (5, 3.0)  # groups of 5, 2 and 2 steps
  # Rows shared by every sample: the long sample's row holds it alone (4 steps) while the
  # other row runs the five short ones (one step each): 5 steps; the first group ends in 4,
  # the short ones in 2 each. With two steps each the short ones spill onto the long one's
  # row once it frees: 4 + 2 + 2.
  assert bench.shared_row_steps(groups, 2) == (5, 8 / 3)
  assert bench.shared_row_steps([[5, 3], [3, 3], [3, 3]], 2)[0] == 8


@pytest.mark.parametrize("platform, turns", [("tpu", False), ("cuda", False), ("tpu", True)])
def test_the_decode_chunk_lowers_for_tpu_and_cuda(platform, turns):
  # The whole chunk (per-row cache writes, rows taking next samples, the decode kernel:
  # Mosaic on TPU, the XLA path on CUDA; multi-turn: replies fed in, paused rows held)
  # exported from the CPU for the real targets.
  config = ModelConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=128, architecture="qwen3",
                       qk_norm=True, dtype="bfloat16")
  model = Transformer(config, rngs=nnx.Rngs(0))
  params = SamplingParams(max_new_tokens=256, stop_tokens=STOPS)
  batch = ContinuousBatch(model, 4, 2, params, rows_per_prompt=2,
                          respond=(lambda *a: None) if turns else None)
  batch.add(0, list(range(1, 101)), [0, 1, 2, 3])
  batch._fill()
  graphdef, state = nnx.split(model)
  fixed, moving = continuous._without_prompts(batch._dev.slots)
  exported = export.export(continuous._chunk, platforms=[platform])(
      graphdef, state, fixed, moving, np.array([True, False]),
      np.zeros((4,), bool) if turns else None, knobs(params), np.int32(8), np.int32(1),
      mode=params.mode, record_routes=False)
  assert exported.platforms == (platform,)
  kernels = set(re.findall(r'kernel_name = "([a-z_]+)"', exported.mlir_module()))
  assert kernels == ({"shared_prefix_decode"} if platform == "tpu" else set())


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_feeding_rows_several_tokens_at_once_lowers_for_tpu_and_cuda(platform):
  # Replies and begun tokens fed in one step (`_feed_rows`: the rows' own prefixes, the
  # multi-token attention in XLA), exported from the CPU for the real targets.
  config = ModelConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=128, architecture="qwen3",
                       qk_norm=True, dtype="bfloat16")
  model = Transformer(config, rngs=nnx.Rngs(0))
  batch = ContinuousBatch(model, 4, 2, SamplingParams(max_new_tokens=256, stop_tokens=STOPS),
                          rows_per_prompt=2, resume=True)
  batch.add(0, list(range(1, 101)), [0, 1, 2, 3])
  batch._fill()
  graphdef, state = nnx.split(model)
  exported = export.export(continuous._feed_rows, platforms=[platform])(
      graphdef, state, batch._dev.slots, np.array([0, 1], np.int32), np.ones((2, 16), np.int32),
      np.array([16, 3], np.int32), record_routes=False)
  assert exported.platforms == (platform,)


def test_a_resumed_sample_stopped_again_before_its_begun_tokens_were_fed_keeps_them():
  """A prompt resumed with begun samples, checkpointed or stopped again while the device was
  still feeding a sample's begun tokens (or before it had a row: no output yet): that sample
  is handed on with all its begun tokens, not the few fed so far (the server replaces what
  it held with what it is sent, and the begun tokens would be drawn afresh); one past them
  is this run's continuation, the begun tokens' log-probs kept."""
  def sample(tokens, logprob):
    n = len(tokens)
    return continuous.Sample(np.asarray(tokens, np.int32), np.full(n, logprob, np.float32),
                             np.full(n, logprob, np.float32), "length")

  begun = [sample([5, 6, 7, 8], -1.0), sample([9, 10], -2.0)]
  waiting = continuous._Waiting("p", np.asarray([1, 2], np.int32), np.zeros(2, np.uint32), 2,
                                begun=begun, order=np.asarray([0, 1]), complete=0)
  got = [sample([5, 6], -0.5), sample([9, 10, 11], -0.25)]
  (first, second), flags = waiting.restore(got, [False, False])
  assert first.tokens.tolist() == [5, 6, 7, 8] and first.resumed
  np.testing.assert_array_equal(first.logprobs, begun[0].logprobs)
  assert second.tokens.tolist() == [9, 10, 11] and second.resumed
  np.testing.assert_array_equal(second.logprobs, [-2.0, -2.0, -0.25])
  assert flags == [False, False]
  (none_yet, _), _ = waiting.restore([sample([], 0.0), got[1]], [False, False])
  assert none_yet.tokens.tolist() == [5, 6, 7, 8]
  # One begun token short of fed (3 of 4): still the begun sample, tokens and log-probs alike.
  (short, _), _ = waiting.restore([sample([5, 6, 7], -0.5), got[1]], [False, False])
  assert short.tokens.tolist() == [5, 6, 7, 8] and len(short.logprobs) == 4
