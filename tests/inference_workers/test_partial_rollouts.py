"""Partial rollouts: a worker stopped mid-generation hands its running prompts back with
the samples it began, and the next worker finishes them as if never interrupted (single
turn, routing replay, multi-turn), against real parameter servers on 127.0.0.1."""

import dataclasses
import json
import time

import numpy as np
import pytest
from flax import nnx

from algorithms.verifiers.base import Guarded
from inference_workers import loop
from inference_workers.continuous import ContinuousBatch
from inference_workers.loop import Worker
from inference_workers.sampler import generate
from inference_workers.worker_config import WorkerConfig
from param_server import errors
from param_server.client import routes_of, sample_logprobs
from param_server.protos import param_server_pb2 as pb
from param_server.server import ParamServer, ServerConfig
from rlax_ps import sync
from rlax_ps.models import Transformer, flatten_params
from rlax_ps.tasks import get_task
from rlax_ps.train.rl import group_of, routing_shape
from rlax_ps.train.rollouts import BatchShape, check_group
from worker_testlib import (CONFIG, SMALL, TOKENIZER, TOKENS, ManyStops, TextCodes,
                            addition_prompts, client, enqueue_addition, run_until_stopped,
                            stopped_first_worker)

PROMPTS = {p.id: p for p in addition_prompts(2)}  # what stopped_first_worker enqueues


@pytest.mark.parametrize("sample_rows", [0, pytest.param(6, marks=pytest.mark.slow)],
                         ids=["slots", "sample_rows"])  # (~4 s a case)
def test_a_stopped_worker_hands_back_begun_samples_that_the_next_one_finishes(
    server, versions, monkeypatch, sample_rows):
  """SIGTERM's grace runs low mid-generation: the running prompts go back with their begun
  samples, and the next worker (of another --seed, as `rlax-ps local` starts them) draws them
  on with the same seeds, their prompts': the samples are exactly those of an uninterrupted
  run. Likewise with rows shared by the samples (6: all begin)."""
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4, sample_rows=sample_rows)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    first = stopped_first_worker(Worker(wc, CONFIG, TOKENIZER, WorkerConfig(
        max_leases=1, **config)), trainer, versions[0], monkeypatch)
    assert first.stats.groups_submitted == 0 and first.stats.prompts_released == 2
    assert first.stats.samples_salvaged == 6  # 2 prompts x 3 samples, each begun
    with client(server, "worker") as wc2:
      wc2.register("peek")
      lease = wc2.lease(2, deadline_s=30)
      begun = {p.id: [pb.Sample(token_ids=s.token_ids, logprobs_f32=s.logprobs_f32)
                      for s in p.partial] for p in lease.prompts}
      assert all(0 < len(s.token_ids) < 24 for ps in begun.values() for s in ps)
      # One begun sample altered on its way back: the next worker must write it as given.
      altered = begun["p0"][0]
      altered.token_ids[-1] = (altered.token_ids[-1] + 1) % TOKENIZER.vocab_size
      wc2.release(lease, partial=[pb.PartialRollouts(prompt_id=pid, samples=ps)
                                  for pid, ps in begun.items()])
    second = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, seed=1, **config))
    second.run()
    taken = trainer.take_rollouts(0, 10).rollouts
    groups = {r.group.prompt_id: r.group for r in taken}
  assert type(second._batch).__name__ == ("SampleBatch" if sample_rows else "ContinuousBatch")
  assert sorted(groups) == ["p0", "p1"] and second.stats.groups_submitted == 2
  assert_finished_as_begun(second, groups, begun, altered=("p0", 0))
  assert all(group_of(t, TOKENIZER).resumed == 3 for t in taken)  # what the trainer counts
  assert not second._held  # the begun tokens the server held, forgotten with their groups


def test_a_salvage_hands_a_leases_partial_rollouts_back_in_calls_of_bounded_size(
    server, versions, monkeypatch):
  """The begun samples of a lease's running prompts go back in calls of at most about
  _PARTIAL_BYTES (here: one prompt's a call), as renewals send them: one message of them
  all could pass the server's size limit, be refused, and lose the lease's decoding."""
  monkeypatch.setattr(loop, "_PARTIAL_BYTES", 1)
  calls = []
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    release = wc.release
    wc.release = lambda lease, ids=(), **kw: (
        calls.append((list(ids), len(kw.get("partial", ())))), release(lease, ids, **kw))[1]
    first = stopped_first_worker(Worker(wc, CONFIG, TOKENIZER, WorkerConfig(
        max_leases=1, **dict(SMALL, max_new_tokens=24, decode_chunk_steps=4))), trainer,
        versions[0], monkeypatch)
    assert sorted(calls) == [(["p0"], 1), (["p1"], 1)]
    assert (first.stats.prompts_released, first.stats.samples_salvaged) == (2, 6)
    with client(server, "worker") as wc2:
      wc2.register("peek")
      lease = wc2.lease(2, deadline_s=30)
      assert all(len(p.partial) == 3 for p in lease.prompts)


@pytest.mark.slow  # ~5 s
def test_a_greedy_baseline_sample_begun_by_a_stopped_worker_is_finished_greedily(
    server, versions, monkeypatch):
  """worker.greedy_baseline (ReMax): the greedy sample goes back begun with the others and
  the next worker draws it on greedily; the group's baseline is its finished answer's
  reward, its samples those of an uninterrupted run."""
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4, greedy_baseline=True)
  codes = TextCodes()
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    first = stopped_first_worker(Worker(wc, CONFIG, TOKENIZER, WorkerConfig(
        max_leases=1, **config)), trainer, versions[0], monkeypatch)
    assert first.stats.groups_submitted == 0 and first.stats.samples_salvaged == 8
    second = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config),
                    verifier_for=lambda task: Guarded(task, codes))
    second.run()
    groups = {r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts}
  examples = get_task("addition", max_digits=2).examples("train", 0, 2)
  greedy = dataclasses.replace(second.params, greedy=True)
  for pid, group in groups.items():
    head = TOKENIZER.encode_prompt(examples[int(pid[1:])].prompt)
    want = generate(second.policy.model, [head] * 3, second._seeds(PROMPTS[pid], 0, 0, 3),
                    second.params)
    assert [list(s.token_ids) for s in group.samples] == [w.tokens.tolist() for w in want]
    assert group.metadata["resumed_samples"] == "3"
    answer = generate(second.policy.model, [head], [0], greedy)[0]
    assert codes.texts[group.baseline_reward] == TOKENIZER.decode(answer.tokens)


def test_a_group_resumed_on_a_newer_version_is_tagged_with_the_older_it_began_on(
    server, versions, monkeypatch):
  """Samples begun on v0 and finished on v1: the group's version is v0 (the oldest its
  tokens were drawn with, which the trainer's staleness bound and corrections read), its
  metadata's last_version v1. Tagged v1, an old group passed the bound."""
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    stopped_first_worker(Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config)),
                         trainer, versions[0], monkeypatch)
    trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
    second = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config))
    second.run()
    groups = [r.group for r in trainer.take_rollouts(0, 10).rollouts]
  assert second.stats.versions_applied[-1] == 1 and len(groups) == 2
  for group in groups:
    assert group.metadata["resumed_samples"] == "3" and group.policy_version == 0
    assert group.metadata["last_version"] == "1"


def assert_finished_as_begun(worker, groups, begun, altered=None):
  """Each group resumed whole from its begun samples (their tokens and log-probs as first
  drawn) and drawn on as an uninterrupted worker would; the `altered` sample (prompt id,
  index) is drawn on from its altered last token."""
  examples = get_task("addition", max_digits=2).examples("train", 0, 2)
  for pid, group in groups.items():
    assert group.metadata["resumed_samples"] == "3" and group.policy_version == 0
    head = TOKENIZER.encode_prompt(examples[int(pid[1:])].prompt)
    want = generate(worker.policy.model, [head] * 3, worker._seeds(PROMPTS[pid], 0, 0, 3),
                    worker.params)  # what an uninterrupted worker draws
    for j, (s, w, before) in enumerate(zip(group.samples, want, begun[pid])):
      k = len(before.token_ids)
      assert list(s.token_ids[:k]) == list(before.token_ids)
      if (pid, j) == altered:
        assert s.token_ids[k - 1] != w.tokens[k - 1]
        continue
      assert list(s.token_ids) == w.tokens.tolist()
      lp = sample_logprobs(s)
      np.testing.assert_array_equal(lp[:k], sample_logprobs(before))  # as first drawn
      np.testing.assert_allclose(lp[k:], w.sampling_logprobs[k:], atol=1e-5)


class Killed(Exception):
  """The worker's process is gone: nothing more of it reaches the server."""


def checkpointed_steps(sent, last, then):
  """ContinuousBatch.step that waits, before each chunk, for the heartbeat to carry the
  checkpoint the chunk before left (`sent`: the partial rollouts renewals carried; two
  prompts a checkpoint), and calls `then()` in place of chunk `last` + 1."""
  step, chunks = ContinuousBatch.step, [0]

  def stepping(batch):
    deadline = time.monotonic() + 30
    while chunks[0] <= last and len(sent) < 2 * chunks[0] and time.monotonic() < deadline:
      time.sleep(0.02)
    if chunks[0] == last:
      then()
    chunks[0] += 1
    return step(batch)

  return stepping


def spy_on(wc, method, sent):
  """The partial rollouts the client's `method` (renew or release) sent and got accepted."""
  call = getattr(wc, method)

  def spied(*args, partial=(), **kwargs):
    out = call(*args, partial=partial, **kwargs)
    sent.extend(partial)
    return out

  setattr(wc, method, spied)


def test_a_worker_killed_without_notice_loses_only_what_it_decoded_since_its_checkpoint(
    server, versions, monkeypatch):
  """kill -9: no SIGTERM, no release. The begun samples its lease renewals carried (after
  the first, only each sample's new tokens) go back with the prompts once the lease
  expires, and the next worker finishes them as an uninterrupted run would."""
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4)
  queues, ids, sent = server.queues, ("p0", "p1"), []

  def die():  # three checkpoints carried: the second and third as increments
    raise Killed

  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    spy_on(wc, "renew", sent)
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    first = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(
        max_leases=1, checkpoint_s=1e-3, **dict(config, lease_deadline_s=1.0)))
    monkeypatch.setattr(first, "_release_all", lambda: 0)  # a killed process releases nothing
    with monkeypatch.context() as m, pytest.raises(Killed):
      m.setattr(ContinuousBatch, "step", checkpointed_steps(sent, 3, die))
      first.run()
    assert first.stats.checkpoints >= 2 and first.stats.groups_submitted == 0
    begun = {p: [pb.Sample(token_ids=s.token_ids, logprobs_f32=s.logprobs_f32)
                 for s in queues.prompts[p].partial] for p in ids}
    assert all(0 < len(s.token_ids) < 24 for ps in begun.values() for s in ps)
    # An increment keeps what the server held and carries the rest.
    increment = next(p for p in sent if p.kept)
    assert 0 < sum(increment.kept) and all(
        k + len(s.token_ids) <= 24 for k, s in zip(increment.kept, increment.samples))
    assert trainer.stats().prompts_leased == 2  # until the lease expires
    second = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config))
    second.run()
    groups = {r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts}
    assert trainer.stats().leases_expired == 1
  assert sorted(groups) == list(ids)
  assert_finished_as_begun(second, groups, begun)


@pytest.mark.parametrize("refused", [False, True])
def test_a_stop_after_checkpoints_hands_back_only_what_is_new(server, versions, monkeypatch,
                                                              refused):
  """SIGTERM after two checkpoints: the samples handed back go past what the server holds;
  joined, the next worker finishes them as an uninterrupted run. Refused (counts the server
  does not hold), the prompts are still released, with the samples of the last checkpoint."""
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4)
  queues, ids, renewed, released = server.queues, ("p0", "p1"), [], []
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    spy_on(wc, "renew", renewed)
    spy_on(wc, "release", released)
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    first = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, checkpoint_s=1e-3,
                                                       **config))

    if refused:  # e.g. counts the server does not hold
      release = queues.release

      def refusing(lease_id, worker_id, prompt_ids, partial=()):
        if partial:
          raise errors.InvalidArgument("partial[0].kept[0]", "expected at most 4, got 9")
        return release(lease_id, worker_id, prompt_ids, partial)

      monkeypatch.setattr(queues, "release", refusing)
    with monkeypatch.context() as m:
      m.setattr(ContinuousBatch, "step", checkpointed_steps(
          renewed, 2, lambda: first.request_stop(grace_s=first.config.salvage_s)))
      first.run()
    assert first.stats.groups_submitted == 0 and first.stats.prompts_released == 2
    begun = {p: [pb.Sample(token_ids=s.token_ids, logprobs_f32=s.logprobs_f32)
                 for s in queues.prompts[p].partial] for p in ids}
    last = {p.prompt_id: p for p in renewed[-2:]}  # the second checkpoint
    if refused:
      assert first.stats.samples_salvaged == 0 and not released
      assert all(len(s.token_ids) == k + len(n.token_ids) for p in ids
                 for s, k, n in zip(begun[p], last[p].kept, last[p].samples))
    else:
      assert first.stats.samples_salvaged == 6
      assert len(released) == 2 and all(p.kept for p in released)
      new = sum(len(s.token_ids) for p in released for s in p.samples)
      assert new < sum(sum(p.kept) for p in released)  # a chunk's tokens, not the samples
      assert all(len(s.token_ids) == k + len(n.token_ids) for p in released
                 for s, k, n in zip(begun[p.prompt_id], p.kept, p.samples))
    second = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config))
    second.run()
    groups = {r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts}
  assert sorted(groups) == list(ids)
  assert_finished_as_begun(second, groups, begun)


def test_a_stop_hands_back_running_prompts_with_their_samples_and_waiting_ones_as_they_are(
    server, versions, monkeypatch):
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4, prompts_per_lease=4)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 4)  # one lease of four; two decode, two wait for a slot
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config))
    stats = run_until_stopped(worker, monkeypatch)
    assert stats.prompts_released + stats.groups_submitted == 4
    st = trainer.stats()
    assert st.prompts_leased == 0 and st.prompts_queued == stats.prompts_released
    with client(server, "worker") as peek:
      peek.register("peek")
      back = peek.lease(4, deadline_s=30).prompts
  begun = sorted(p.id for p in back if p.partial)
  assert len(begun) == 2 - stats.groups_submitted and len(back) - len(begun) == 2


@pytest.mark.slow  # two MoE workers; test_continuous_batching covers the routes
def test_begun_samples_travel_with_their_experts_under_routing_replay(server, monkeypatch):
  """Mixture of experts: the begun samples go back with their routes; the next worker's
  groups carry every token's experts, as an uninterrupted run's, and the trainer takes them."""
  moe = CONFIG.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  params = {k: np.asarray(v) for k, v in flatten_params(Transformer(moe, rngs=nnx.Rngs(0))).items()}
  config = WorkerConfig(max_leases=1, routing_replay=True, max_new_tokens=24,
                        decode_chunk_steps=4, **{k: v for k, v in SMALL.items()
                                                 if k != "max_new_tokens"})
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    first = stopped_first_worker(Worker(wc, moe, TOKENIZER, config), trainer, params,
                                 monkeypatch)
    assert first.stats.samples_salvaged > 0 and first.stats.groups_submitted < 2
    second = Worker(wc, moe, TOKENIZER, config)
    second.run()
    taken = trainer.take_rollouts(0, 10).rollouts
  assert len(taken) == 2 and any("resumed_samples" in t.group.metadata for t in taken)
  shape = BatchShape(groups=2, samples=3, prompt_len=32, response_len=24,
                     **routing_shape(moe, {"routing_replay": True}))
  examples = get_task("addition", max_digits=2).examples("train", 0, 2)
  for t in taken:
    check_group(group_of(t, TOKENIZER), shape)  # every token's experts, in range and distinct
    pid = t.group.prompt_id
    head = TOKENIZER.encode_prompt(examples[int(pid[1:])].prompt)
    want = generate(second.policy.model, [head] * 3, second._seeds(PROMPTS[pid], 0, 0, 3),
                    second.params, record_routes=True)
    for s, w in zip(t.group.samples, want):
      assert list(s.token_ids) == w.tokens.tolist()
      np.testing.assert_array_equal(routes_of(s.routes), w.routes)


def test_begun_samples_that_do_not_fit_are_drawn_afresh(server, versions, caplog):
  config = dict(SMALL, max_new_tokens=24, decode_chunk_steps=4)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 1)
    with client(server, "worker") as other:  # a worker of another model hands it back
      other.register("other")
      lease = other.lease(1, deadline_s=30)
      other.release(lease, partial=[pb.PartialRollouts(prompt_id="p0", samples=[
          pb.Sample(token_ids=[10 ** 6], logprobs=[-1.0])])])
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **config))
    worker.run()
    (r,) = trainer.take_rollouts(0, 10).rollouts
  assert "resumed_samples" not in r.group.metadata and len(r.group.samples) == 3
  assert all(10 ** 6 not in s.token_ids for s in r.group.samples)
  assert "the begun samples of prompt p0 are drawn afresh: begun[0].tokens" in caplog.text


def test_salvage_must_leave_part_of_the_grace_period_and_begin_before_the_watchdog():
  """The watchdog releases every open prompt, without its samples, 1 s before the grace
  period ends: a salvage due after that (salvage_s 0.5) would never hand samples back."""
  for salvage in (25.0, 0.5):
    with pytest.raises(ValueError, match=r"WorkerConfig.salvage_s: expected 0 \(off\) or a "
                       r"number of seconds in \[2, grace_s=25.0\) .* got " + str(salvage)):
      WorkerConfig(salvage_s=salvage)
  assert WorkerConfig(salvage_s=0).salvage_s == 0 and WorkerConfig(salvage_s=2).salvage_s == 2


@pytest.mark.slow  # three workers, two servers; test_multi_turn covers the batch
@pytest.mark.parametrize("sample_rows", [0, 6], ids=["slots", "sample_rows"])
def test_a_stopped_multi_turn_run_is_continued_as_if_never_interrupted(
    server, versions, tmp_path, monkeypatch, sample_rows):
  """Multi-turn partial rollouts: the replies a sample had travel with it (the environment
  sees the whole conversation again), a reply not fed whole is asked for again, and the
  groups equal an uninterrupted run's on another server; with slots or shared rows."""
  from algorithms.environments import ENVIRONMENTS, register_environment

  @register_environment("test_turns")
  def turns():
    def reply(messages, reference):
      assert [m["role"] for m in messages] == ["assistant", "tool"] * (len(messages) // 2) + [
          "assistant"]
      return None if len(messages) >= 5 else f"<{len(messages)}>"
    return reply

  tok = ManyStops()
  config = WorkerConfig(max_leases=1, environment="test_turns", max_turns=3,
                        sample_rows=sample_rows,
                        **dict(SMALL, max_new_tokens=24, decode_chunk_steps=4))
  other = ParamServer(ServerConfig(storage_dir=str(tmp_path / "ps2"), port=0, threads=8,
                                   compact_in_background=False, wal_fsync=False,
                                   trainer_token=TOKENS["trainer"],
                                   worker_token=TOKENS["worker"])).start()
  try:
    groups = []
    for place, stop in ((other, False), (server, True)):
      with client(place, "trainer") as trainer, client(place, "worker") as wc:
        trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
        enqueue_addition(trainer, 2)
        worker = Worker(wc, CONFIG, tok, config)
        if stop:  # after three chunks some samples have had replies, some wait for one
          assert run_until_stopped(worker, monkeypatch, chunks=3).samples_salvaged > 0
          worker = Worker(wc, CONFIG, tok, config)
        worker.run()
        groups.append({r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts})
  finally:
    other.stop(grace=0)
    ENVIRONMENTS.pop("test_turns")
  whole, resumed = groups
  assert sorted(whole) == sorted(resumed) == ["p0", "p1"]
  assert any("resumed_samples" in g.metadata for g in resumed.values())
  replied = 0
  for pid in whole:
    for a, b in zip(resumed[pid].samples, whole[pid].samples):
      assert list(a.token_ids) == list(b.token_ids) and a.observed == b.observed
      replied += bool(b.observed.strip(b"\x00"))
  assert replied  # some samples got replies


def test_a_worker_without_the_environment_will_not_resume_replies_as_its_own_tokens():
  from param_server.client import make_sample
  worker = Worker(None, CONFIG, TOKENIZER, WorkerConfig(max_new_tokens=8))
  begun = make_sample([5, 6, 7], 0.0, logprobs=np.zeros(3), observed=np.array([0, 1, 0], bool))
  with pytest.raises(ValueError, match="partial sample 0: holds an environment's replies"):
    worker._begun_sample(("lease", "p0"), 0, begun, None)
  plain = make_sample([5, 6, 7], 0.0, logprobs=np.zeros(3))
  assert worker._begun_sample(("lease", "p0"), 0, plain, None).tokens.tolist() == [5, 6, 7]


def test_a_reply_not_fed_whole_is_left_out_of_a_partial_rollout():
  from inference_workers.decoding import Sample
  from param_server.client import sample_observed
  seen = np.array([0, 0, 1, 1, 0, 0, 1], bool)  # two replies given, the second cut short
  sample = Sample(np.arange(7, dtype=np.int32), -np.ones(7, np.float32), -np.ones(7, np.float32),
                  "length", routes=np.zeros((6, 1, 2), np.int32), observed=seen)
  cut, kept = Worker._begun(sample, False, ["r1", "r2", "r3"])  # r3: asked, not yet fed
  assert list(cut.token_ids) == [0, 1, 2, 3, 4, 5] and cut.finish_reason == "" and kept == 0
  assert sample_observed(cut).tolist() == seen[:6].tolist()
  assert json.loads(cut.metadata["replies"]) == ["r1"] and len(routes_of(cut.routes)) == 5
  whole, _ = Worker._begun(sample, True, ["r1", "r2"])  # finished: kept whole
  assert len(whole.token_ids) == 7 and whole.finish_reason == "length"
  assert json.loads(whole.metadata["replies"]) == ["r1", "r2"]
  # Past the 4 tokens the server holds: the rest, with the routes from token 3's on.
  new, kept = Worker._begun(sample, False, ["r1", "r2", "r3"], held=4)
  assert kept == 4 and list(new.token_ids) == [4, 5] and sample_observed(new) is None
  assert len(routes_of(new.routes)) == 2 and json.loads(new.metadata["replies"]) == ["r1"]
  # The server holds more than the partial rollout now has (a reply cut short since).
  new, kept = Worker._begun(sample, False, ["r1", "r2", "r3"], held=7)
  assert kept == 6 and not new.token_ids and len(routes_of(new.routes)) == 0


def test_a_finished_multi_turn_sample_keeps_its_replies_when_resumed():
  """A begun sample that had finished after a reply goes on finished, its replies with it:
  scoring reads them, and the next checkpoint sends them back (not "[]" over the server's)."""
  from algorithms.environments import GuardedEnvironment
  from param_server.client import make_sample, sample_observed
  worker = Worker(None, CONFIG, TOKENIZER, WorkerConfig(max_new_tokens=8))
  tokens = TOKENIZER.encode("abRcd") + [TOKENIZER.eos_id]  # "ab", a reply "R", then "cd"
  begun = make_sample(tokens, 0.0, logprobs=np.zeros(6), finish_reason="stop",
                      observed=np.array([0, 0, 1, 0, 0, 0], bool),
                      metadata={"replies": json.dumps(["R"])})
  key = ("lease", "p0")
  sample = worker._begun_sample(key, 0, begun, GuardedEnvironment("mine", lambda m, r: "X"))
  assert sample.tokens.tolist() == tokens and sample.finish_reason == "stop"
  assert worker._given[key] == {0: ["R"]}
  again, _ = Worker._begun(sample, True, worker._given[key][0])
  assert json.loads(again.metadata["replies"]) == ["R"]
  assert sample_observed(again).tolist() == sample_observed(begun).tolist()
