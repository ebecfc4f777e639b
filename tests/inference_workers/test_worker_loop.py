"""The worker loop against a real parameter server on 127.0.0.1: leases, versions, resyncs,
and preemption (SIGTERM releases within the grace period; SIGKILL leases expire)."""

import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from child_env import child_env
from algorithms.verifiers.base import Guarded, VerifierResult
from inference_workers.continuous import ContinuousBatch
from inference_workers.decoding import Sample
from inference_workers.loop import Worker
from inference_workers.sampler import generate
from inference_workers.sampling import SamplingParams
from inference_workers.worker_config import WorkerConfig
from param_server.client import ParamServerClient, ParamServerError, RetryPolicy, sample_logprobs
from param_server.protos import PROMPT_SEED
from param_server.protos import param_server_pb2 as pb
from rlax_ps import sync
from rlax_ps.sync import device
from rlax_ps.models import Transformer, flatten_params
from rlax_ps.tasks import get_task
from rlax_ps.train.rl import group_of, routing_shape
from rlax_ps.train.rollouts import BatchShape, check_group
from worker_testlib import (CONFIG, MODEL, REPO, SMALL, TOKENIZER, TOKENS, ManyStops, TextCodes,
                            client, enqueue_addition, same_held)


def test_worker_completes_leases_and_submits_scored_groups(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    ids = enqueue_addition(trainer, 4)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=2, **SMALL))
    start = time.monotonic()
    stats = worker.run()
    wall = time.monotonic() - start
    assert stats.leases == 2 and stats.groups_submitted == 4
    # The speed it reports counts decoding time only: at least the whole run's average.
    assert stats.tokens / wall <= worker._tokens_per_s < float("inf")
    # run() waits for its heartbeat thread: one left inside gRPC aborts the interpreter's exit
    assert not any(t.name == "worker-heartbeat" for t in threading.enumerate())
    take = trainer.take_rollouts(min_version=0, max_n=10)
    assert sorted(r.group.prompt_id for r in take.rollouts) == sorted(ids)
    for r in take.rollouts:
      assert r.group.policy_version == 0 and len(r.group.samples) == 3
      for s in r.group.samples:
        assert 0 < len(s.token_ids) <= 6 and s.reward in (0.0, 1.0)
        assert len(sample_logprobs(s)) == len(s.token_ids)
        assert np.all(sample_logprobs(s) <= 0)
    st = trainer.stats()
    assert st.prompts_leased == 0 and st.prompts_queued == 0


@pytest.mark.parametrize("sample_rows", [0, pytest.param(4, marks=pytest.mark.slow)],
                         ids=["slots", "sample_rows"])  # (~3 s a case)
def test_a_greedy_baseline_is_sent_beside_the_samples_as_the_greedy_decodes_reward(
    server, versions, sample_rows):
  """worker.greedy_baseline (ReMax): each group holds samples_per_prompt samples and the
  reward of the prompt's greedy decode, scored by the same verifier. A held-out prompt the
  trainer sends for evaluation (metadata eval) gets that greedy answer alone, or its
  eval_samples sampled answers (pass@k); more than a prompt decodes here is refused naming
  the field."""
  codes = TextCodes()
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    held_out = {"eval": "1", "eval_set": "addition"}
    trainer.enqueue_prompts([
        pb.Prompt(id="e0", text="12+34=", task="addition", extra=b"46", metadata=held_out),
        pb.Prompt(id="e1", text="12+34=", task="addition", extra=b"46",
                  metadata={**held_out, "eval_samples": "3"}),
        pb.Prompt(id="e2", text="12+34=", task="addition", extra=b"46",
                  metadata={**held_out, "eval_samples": "5"})])
    config = WorkerConfig(max_leases=3, greedy_baseline=True, sample_rows=sample_rows,
                          temperature=1.5, **SMALL)
    worker = Worker(wc, CONFIG, TOKENIZER, config, verifier_for=lambda t: Guarded(t, codes))
    worker.run()
    taken = trainer.take_rollouts(0, 10).rollouts
  assert len(taken) == 5
  params = SamplingParams(greedy=True, max_new_tokens=SMALL["max_new_tokens"],
                          stop_tokens=TOKENIZER.stop_ids)
  answers = {r.prompt.id: r.group for r in taken if r.prompt.id.startswith("e")}
  greedy = generate(worker.policy.model, [TOKENIZER.encode_prompt("12+34=")], [0], params)[0]
  assert [list(s.token_ids) for s in answers["e0"].samples] == [greedy.tokens.tolist()]
  # Drawn as a training prompt's samples are (its seeds), each scored by the verifier.
  sampled = generate(worker.policy.model, [TOKENIZER.encode_prompt("12+34=")] * 3,
                     worker._seeds(pb.Prompt(id="e1"), 0, 0, 3), worker.params)
  assert [list(s.token_ids) for s in answers["e1"].samples] == [s.tokens.tolist()
                                                               for s in sampled]
  assert [codes.texts[s.reward] for s in answers["e1"].samples] == [
      TOKENIZER.decode(s.tokens) for s in sampled]
  assert not any(answers[i].HasField("baseline_reward") for i in ("e0", "e1"))
  assert not answers["e2"].samples and "eval_samples: expected 0 to 4" in answers["e2"].failure
  taken = [r for r in taken if not r.prompt.id.startswith("e")]
  for r in taken:
    assert len(r.group.samples) == SMALL["samples_per_prompt"]
    assert r.group.HasField("baseline_reward")
    greedy = generate(worker.policy.model, [TOKENIZER.encode_prompt(r.prompt.text)], [0],
                      params)[0]
    assert codes.texts[r.group.baseline_reward] == TOKENIZER.decode(greedy.tokens)
    # The trainer's Group carries it; a group without one is refused where it is needed.
    group = group_of(r, TOKENIZER)
    assert group.baseline_reward == r.group.baseline_reward and len(group.responses) == 3
  plain = pb.TakenRollout(rollout_id=7, prompt=taken[0].prompt, group=taken[0].group)
  plain.group.ClearField("baseline_reward")
  shape = BatchShape(groups=1, samples=3, prompt_len=32, response_len=6, baselines=True)
  with pytest.raises(ValueError, match="rollout 7: baseline_reward: .*worker.greedy_baseline"):
    check_group(group_of(plain, TOKENIZER), shape)


def test_a_vigor_worker_refuses_a_held_out_prompt_naming_why(server, versions):
  """Held-out prompts (eval.on_workers) want one greedy answer or k sampled ones; VIGOR's
  rounds would give them shares of samples: the trainer is told, no sample is decoded."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    trainer.enqueue_prompts([pb.Prompt(id="e0", text="12+34=", task="addition", extra=b"46",
                                       metadata={"eval": "1", "eval_set": "addition"})])
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1,
                                                        **dict(SMALL, allocator="vigor")))
    worker.run()
    answer, = trainer.take_rollouts(0, 10).rollouts
  assert not answer.group.samples and "fixed allocator only" in answer.group.failure
  assert worker.stats.tokens == 0


def test_a_worker_with_an_fp8_cache_decodes_through_it(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, kv_cache_dtype=
                                                        "float8_e4m3fn", **SMALL))
    stats = worker.run()
    assert stats.groups_submitted == 2
    assert {x.dtype.name for x in worker._batch._dev.slots.cache.prefix_k} == {"float8_e4m3fn"}
    for r in trainer.take_rollouts(0, 10).rollouts:
      assert all(np.all(np.isfinite(sample_logprobs(s))) for s in r.group.samples)


def test_new_version_is_picked_up_between_leases(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 4)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL))
    worker.run()
    trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
    worker.config.max_leases = 2
    worker.run()
    assert worker.policy.version == 1 and same_held(worker.policy, versions[1])
    assert worker.stats.versions_applied == [0, 1]  # the delta, not a second keyframe
    taken = trainer.take_rollouts(0, 10).rollouts
    assert sorted(r.group.policy_version for r in taken) == [0, 0, 1, 1]
    # Each sample carries its verifier's verdict (addition: passed exactly when rewarded).
    assert all(s.metadata["passed"] == str(int(s.reward == 1.0))
               for r in taken for s in r.group.samples)
    # Its work done, the worker said it was leaving: the server lists it no more.
    assert trainer.stats().workers_alive == 0 and not trainer.stats().workers


def test_a_worker_behind_a_weight_relay_pulls_from_it_and_leases_from_the_server(
    server, versions, tmp_path):
  from param_server.relay import RelayConfig, WeightRelay
  with client(server, "trainer") as trainer:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    ids = enqueue_addition(trainer, 4)
    relay = WeightRelay(RelayConfig(storage_dir=str(tmp_path / "relay"), threads=16),
                        client(server, "worker"), TOKENS["worker"]).start()
    try:
      with client(relay, "worker") as wc:
        worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL))
        worker.run()
        trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
        worker.config.max_leases = 2
        worker.run()
      assert worker.policy.version == 1 and same_held(worker.policy, versions[1])
      assert worker.stats.versions_applied == [0, 1]
      # The server sent each version once, to the relay; the worker pulled from the relay
      # (cut through: the worker may hold v1 a moment before the relay has stored it).
      deadline = time.monotonic() + 60  # a guard against a hang, not a measure
      while relay.fetches < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
      assert relay.fetches == 2 and server.servicer.bytes_served == relay.bytes_fetched
      assert relay.servicer.bytes_served >= relay.bytes_fetched
    finally:
      relay.stop(grace=0)
    took = trainer.take_rollouts(0, 10).rollouts
    assert sorted(r.group.prompt_id for r in took) == sorted(ids)


def test_the_server_sees_each_new_version_at_once_not_a_heartbeat_interval_later(
    tmp_path, versions):
  # The server asks for a heartbeat every 120 s here; the worker reports at registration and
  # after each version it applies, so status and metrics never show a stale version long.
  # (A version waits for the batch being decoded, whose first compile takes seconds under
  # load: hence the long interval, not a short deadline.)
  from worker_testlib import start_server
  server = start_server(tmp_path / "ps", heartbeat_interval_s=120.0)
  with client(server, "trainer") as trainer, client(server, "worker") as wc, \
      client(server, "viewer") as viewer:
    def held_versions():
      return [w.version for w in viewer.stats().workers]

    def wait_for(want):
      deadline = time.monotonic() + 60.0
      while held_versions() != want and time.monotonic() < deadline:
        time.sleep(0.05)
      return held_versions()

    enqueue_addition(trainer, 40)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
      assert wait_for([-1]) == [-1]  # registered, holding nothing yet
      trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
      assert wait_for([0]) == [0]
      trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
      assert wait_for([1]) == [1]
    finally:
      worker.request_stop(30.0)
      thread.join(30)
      server.stop(grace=0)


def test_a_version_published_while_a_lease_waits_samples_its_prompts(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    lease = wc.lease

    def lease_across_a_publication(*args, **kwargs):
      got = lease(*args, **kwargs)  # the worker checked the version before this call
      trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
      return got

    wc.lease = lease_across_a_publication
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL))
    worker.run()
    assert worker.stats.versions_applied == [0, 1]
    made = [r.group.policy_version for r in trainer.take_rollouts(0, 10).rollouts]
    assert made == [1, 1]


def test_prefetched_update_waits_for_the_batch_boundary(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.sync_weights()
    trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
    worker.prefetch(1)  # what the heartbeat thread does while a batch is generating
    assert worker.policy.version == 0 and same_held(worker.policy, versions[0])
    assert worker.apply_prefetched()
    assert worker.policy.version == 1 and same_held(worker.policy, versions[1])


def test_updates_prefetched_from_a_version_no_longer_held_are_not_applied(server, versions):
  """Prefetched from v0 while the worker went on to v1 (a pull of its own): applied, they
  met a base they were not made for and cost a keyframe resync."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.sync_weights()
    trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
    worker.prefetch(1)
    prefetched = worker._prefetched
    assert prefetched[0] == 0 and worker.apply_prefetched() and worker.policy.version == 1
    worker._prefetched = prefetched  # as if it came after the worker moved on
    assert not worker.apply_prefetched() and worker._prefetched is None
    assert worker.policy.version == 1 and worker.stats.resyncs == 0


def test_an_idle_worker_takes_the_version_it_prefetched(server, versions):
  # With no prompts to sample (the run ended, or the trainer restarts), a worker must not
  # stay on the version its last prompts used: it holds the one its heartbeat heard of.
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
      deadline = time.monotonic() + 30
      while worker.policy.version != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
      trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
      worker.prefetch(1)  # what the heartbeat thread does as it hears of version 1
      deadline = time.monotonic() + 3
      while worker.policy.version != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
      assert worker.policy.version == 1 and same_held(worker.policy, versions[1])
    finally:
      worker.request_stop(30.0)
      thread.join(30)


@pytest.mark.parametrize("in_flight", [False, True], ids=["at_the_drain", "in_flight"])
def test_a_version_published_mid_generation(server, versions, monkeypatch, in_flight):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 4)
    # In flight, one row per prompt: its three samples one after another.
    config = WorkerConfig(max_leases=2, in_flight_updates=in_flight, decode_chunk_steps=1,
                          rows_per_prompt=1 if in_flight else 0, **SMALL)
    worker = Worker(wc, CONFIG, TOKENIZER, config)
    step = ContinuousBatch.step

    def publish_after_the_first_chunk(batch):
      out = step(batch)
      if worker.stats.leases == 1 and trainer.latest_version() == 0:
        trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
        worker.prefetch(1)  # what the heartbeat thread does while a batch is generating
      return out

    monkeypatch.setattr(ContinuousBatch, "step", publish_after_the_first_chunk)
    worker.run()
    groups = {r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts}
  assert worker.stats.versions_applied == [0, 1] and same_held(worker.policy, versions[1])
  assert worker._batch.rows_per_prompt == (1 if in_flight else 3)
  first, second = [[(groups[p].policy_version, groups[p].metadata["last_version"])
                    for p in pair] for pair in (("p0", "p1"), ("p2", "p3"))]
  assert second == [(1, "1"), (1, "1")]  # the second lease starts on the new version
  if in_flight:  # the first lease's groups went on with the new weights
    assert first == [(0, "1"), (0, "1")]
  else:  # the new version waited for them to finish
    assert first == [(0, "0"), (0, "0")]


def test_a_publisher_on_device_seals_fingerprints_that_the_worker_checks_on_device(
    server, versions, monkeypatch):
  on_device = [{k: jnp.asarray(v) for k, v in sync.held_state(p, "bf16").items()}
               for p in versions]
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    host0 = {k: np.asarray(v) for k, v in on_device[0].items()}
    keyframe = sync.encode(None, host0, "bf16", version=0,
                           fingerprints=device.fingerprints_of(on_device[0]))
    trainer.publish(keyframe.to_bytes())
    host1, printed = device.publish_state(host0, on_device[0], on_device[1])
    trainer.publish(sync.encode(host0, host1, "bf16", version=1, fingerprints=printed,
                                base_checksums=keyframe.checksums).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.policy.on_device_checks = True  # as on an accelerator
    pulled = []
    monkeypatch.setattr(worker.policy, "_pulled_checksum", pulled.append)
    assert worker.sync_weights()
    assert worker.policy.version == 1 and same_held(worker.policy, versions[1])
    assert pulled == [] and worker.stats.versions_applied[-1] == 1


def test_vigor_allocation_spends_the_whole_budget(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    config = WorkerConfig(max_leases=1, **dict(SMALL, allocator="vigor", samples_per_prompt=4))
    stats = Worker(wc, CONFIG, TOKENIZER, config).run()
    groups = [r.group for r in trainer.take_rollouts(0, 10).rollouts]
    assert stats.groups_submitted == 2 and len(groups) == 2
    assert sum(len(g.samples) for g in groups) == 8
    assert all(len(g.samples) >= 2 for g in groups)  # VIGOR's first round: m0 = 2 each
    assert all(s.metadata["passed"] == str(int(s.reward == 1.0))  # its rounds' verdicts
               for g in groups for s in g.samples)


def test_a_vigor_round_scores_a_finished_prompts_samples_while_the_others_decode(
    server, versions, monkeypatch):
  # The round's first finished group is scored on a thread of its own while the batch
  # still decodes the others: the next decode step waits (at most 10 s, a guard against a
  # hang) for its scoring to begin, which scoring after the round never does.
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 4)
    config = WorkerConfig(max_leases=1, **dict(SMALL, allocator="vigor", samples_per_prompt=4,
                                               prompts_per_lease=4, prompts_per_call=4,
                                               max_new_tokens=24, decode_chunk_steps=1))
    worker = Worker(wc, CONFIG, ManyStops(), config)
    step, score = ContinuousBatch.step, Worker._score
    began, ended_early, waited, threads = threading.Event(), [], [], set()

    def watched_step(batch):  # the step after a group ended: the batch decodes the others
      if ended_early and not waited:
        waited.append(began.wait(timeout=10))
      ended = step(batch)
      if ended and (batch.waiting or batch.running):
        ended_early.append(ended)
      return ended

    def watched_score(self, prompt, sample):
      threads.add(threading.current_thread().name)
      began.set()
      return score(self, prompt, sample)

    monkeypatch.setattr(ContinuousBatch, "step", watched_step)
    monkeypatch.setattr(Worker, "_score", watched_score)
    stats = worker.run()
    groups = [r.group for r in trainer.take_rollouts(0, 10).rollouts]
  assert waited == [True]  # a group ended before the round's last one, and was scored then
  assert threads and all(t.startswith(("round-scoring", "scoring")) for t in threads)
  assert stats.groups_submitted == len(groups) == 4
  assert sum(len(g.samples) for g in groups) == 16
  assert all(s.metadata["passed"] == str(int(s.reward == 1.0)) for g in groups for s in g.samples)


def test_prompts_scored_side_by_side_share_one_scoring_pool(server, monkeypatch):
  # A round's prompts call the scoring threads from threads of their own: two first calls
  # at once make one pool, not one each (the other never shut down).
  made, ready = [], threading.Barrier(2)

  class Counted(concurrent.futures.ThreadPoolExecutor):
    def __init__(self, *args, thread_name_prefix="", **kwargs):
      if thread_name_prefix == "scoring":
        time.sleep(0.2)  # widens the window in which a second caller would make its own
        made.append(thread_name_prefix)
      super().__init__(*args, thread_name_prefix=thread_name_prefix, **kwargs)

  monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", Counted)
  with client(server, "worker") as wc:
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    out = []

    def call(x):
      ready.wait(timeout=10)
      out.append(worker._on_threads(lambda v: v * 2, [x, x + 1]))

    threads = [threading.Thread(target=call, args=(i,)) for i in (0, 10)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=30)
    worker._scoring_pool.shutdown()
  assert sorted(out) == [[0, 2], [20, 22]] and made == ["scoring"]


@pytest.mark.parametrize("cut", ["between rounds", "mid-round"])
def test_a_stopping_vigor_worker_sends_the_groups_its_rounds_made(server, versions,
                                                                 monkeypatch, cut):
  # A stop with only salvage_s of grace left ends the rounds where they are: each prompt
  # with two finished samples or more is sent as its group (the rest released), where the
  # watchdog used to release every prompt of the call and lose its rounds.
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    config = WorkerConfig(max_leases=1, **dict(SMALL, allocator="vigor", samples_per_prompt=4,
                                               decode_chunk_steps=1))
    worker = Worker(wc, CONFIG, TOKENIZER, config)
    draw, step, rounds, steps = Worker._draw, ContinuousBatch.step, [], []

    def counted_draw(self, *args):
      out = draw(self, *args)
      rounds.append(args[2])
      if cut == "between rounds":
        self.request_stop(grace_s=self.config.salvage_s)
      return out

    def counted_step(batch):
      steps.append(len(rounds))
      if cut == "mid-round" and steps.count(1) == 2:  # round 1's second decode step
        worker.request_stop(grace_s=worker.config.salvage_s)
      return step(batch)

    monkeypatch.setattr(Worker, "_draw", counted_draw)
    monkeypatch.setattr(ContinuousBatch, "step", counted_step)
    stats = worker.run()
    groups = [r.group for r in trainer.take_rollouts(0, 10).rollouts]
    assert stats.groups_submitted == len(groups) == 2  # m0 = 2 samples each after round 0
    assert all(len(g.samples) >= 2 and all(s.finish_reason for s in g.samples)
               for g in groups)
    made = sum(len(g.samples) for g in groups)
    assert made == 4 if cut == "between rounds" else 4 <= made < 8
    assert len(rounds) == (1 if cut == "between rounds" else 2)
    assert trainer.stats().prompts_leased == 0  # nothing left behind on the lease


def test_routing_replay_sends_each_tokens_experts_that_the_trainer_accepts(server):
  moe = CONFIG.replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
  params = {k: np.asarray(v) for k, v in flatten_params(Transformer(moe, rngs=nnx.Rngs(0))).items()}
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, params, "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    config = WorkerConfig(max_leases=1, routing_replay=True,
                          **dict(SMALL, allocator="vigor", samples_per_prompt=4))
    assert Worker(wc, moe, TOKENIZER, config).run().groups_submitted == 2
    taken = trainer.take_rollouts(0, 10).rollouts
  shape = BatchShape(groups=2, samples=4, prompt_len=32, response_len=6,
                     **routing_shape(moe, {"routing_replay": True}))
  for t in taken:
    group = group_of(t, TOKENIZER)
    check_group(group, shape)  # every token's experts, in range and distinct
    assert group.prompt_routes.shape == (len(group.prompt_tokens), 2, 2)
    assert [len(r) for r in group.response_routes] == [len(r) - 1 for r in group.responses]
  with pytest.raises(ValueError, match="WorkerConfig.routing_replay: expected False for a model "
                                       "without mixture-of-experts layers"):
    Worker(wc, CONFIG, TOKENIZER, config)


@pytest.mark.parametrize("refusal", ["client", "grpc"])
def test_a_group_the_server_refuses_is_answered_with_why_and_the_others_go_on(
    server, versions, refusal):
  """Too large for the server (the client's check), or for a relay on the way (gRPC's own
  RESOURCE_EXHAUSTED, which was retried for ever): the prompt is answered with why, not
  sent round the fleet to be refused at every worker."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    submit = wc.submit_rollouts

    def refuse_the_first(lease_id, group):  # a group the server would refuse, as it would
      if group.prompt_id == "p0" and not group.failure:
        if refusal == "grpc":
          raise ParamServerError("SubmitRollouts", grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 "Received message larger than max (5000000 vs. 4194304)")
        wc.max_request_bytes = 10
      try:
        return submit(lease_id, group)
      finally:
        wc.max_request_bytes = 0

    wc.submit_rollouts = refuse_the_first
    stats = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL)).run()
    assert (stats.groups_refused, stats.prompts_failed, stats.groups_submitted) == (1, 1, 2)
    groups = {r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts}
    assert groups["p0"].failure.startswith("its group was refused: SubmitRollouts: ")
    assert not groups["p0"].samples and groups["p1"].samples
    st = trainer.stats()
    assert (st.prompts_queued, st.prompts_leased) == (0, 0)


@pytest.mark.parametrize("allocator", ["fixed", pytest.param("vigor", marks=pytest.mark.slow)])
def test_a_prompt_the_worker_cannot_sample_is_answered_with_why_and_the_others_go_on(
    server, versions, allocator):
  """Too long for the model with max_new_tokens, or ids outside its vocabulary: each is
  answered with the reason and no samples (it would crash every worker it went to)."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 1)
    trainer.enqueue_prompts([pb.Prompt(id="long", text="1+" * 30, task="addition"),
                             pb.Prompt(id="ids", token_ids=[3, CONFIG.vocab_size + 5],
                                       task="addition"),
                             pb.Prompt(id="task", text="1+1=", task="no_such_task"),
                             pb.Prompt(id="rm", text="1+1=", task="reward_model")])
    config = WorkerConfig(max_leases=1, **dict(SMALL, prompts_per_lease=5, allocator=allocator))
    stats = Worker(wc, CONFIG, TOKENIZER, config).run()
    assert (stats.prompts_failed, stats.groups_submitted) == (4, 5)
    groups = {r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts}
    assert groups["p0"].samples and not groups["p0"].failure
    assert not groups["long"].samples and not groups["ids"].samples
    long = len(TOKENIZER.encode_prompt("1+" * 30))
    assert groups["long"].failure == (f"prompt length {long} + max_new_tokens 6 exceeds "
                                      f"max_position_embeddings={CONFIG.max_position_embeddings}")
    assert groups["ids"].failure.startswith(f"token ids must lie in [0, {CONFIG.vocab_size})")
    # A task this worker's verifiers do not know, and one only a reward model scores.
    assert groups["task"].failure.startswith("task: 'no_such_task' is neither a built-in task "
                                             "nor a registered verifier")
    assert groups["rm"].failure == ("task 'reward_model' is scored by a reward model, and this "
                                    "worker has none (worker.reward_model)")
    st = trainer.stats()
    assert (st.prompts_queued, st.prompts_leased) == (0, 0)


@pytest.mark.parametrize("allocator", ["fixed", "vigor"])
def test_a_group_its_scoring_refuses_is_answered_with_why_and_the_worker_goes_on(
    server, versions, monkeypatch, allocator):
  """A ValueError while scoring finished samples (a reward model's chat template refusing
  the conversation) fails that group, with the reason, on the submitter's thread or in a
  round (VIGOR): the worker does not end (nor would the next one the prompt went to)."""
  scored = Worker._scored

  def refuse_p0(self, prompt, samples, given=None):
    if prompt.id == "p0":
      raise ValueError("tokenizer.chat_template: rendering failed")
    return scored(self, prompt, samples, given)

  monkeypatch.setattr(Worker, "_scored", refuse_p0)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    stats = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **dict(
        SMALL, allocator=allocator))).run()
    assert (stats.prompts_failed, stats.groups_submitted) == (1, 2)
    groups = {r.group.prompt_id: r.group for r in trainer.take_rollouts(0, 10).rollouts}
  assert groups["p0"].failure == ("its samples could not be scored: tokenizer.chat_template: "
                                  "rendering failed") and not groups["p0"].samples
  assert groups["p1"].samples and not groups["p1"].failure


def test_a_budget_the_model_cannot_hold_is_refused_at_the_start_naming_the_field():
  with pytest.raises(ValueError, match=r"WorkerConfig.max_new_tokens: expected fewer than the "
                     r"model's max_position_embeddings=64 .*got 64"):
    Worker(None, CONFIG, TOKENIZER, WorkerConfig(**dict(SMALL, max_new_tokens=64)))


def test_a_failure_group_is_checked_by_the_server(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 1)
    wc.register("w")
    lease = wc.lease(1, deadline_s=30.0)
    sample = pb.Sample(token_ids=[3], reward=1.0)
    for group, field in [(pb.RolloutGroup(prompt_id="p0"), "group.samples"),
                         (pb.RolloutGroup(prompt_id="p0", failure="x", samples=[sample]),
                          "group.samples"),
                         (pb.RolloutGroup(prompt_id="p0", failure="x" * 3000), "group.failure")]:
      with pytest.raises(ParamServerError, match=field):
        wc.submit_rollouts(lease.lease_id, group)


def test_checksum_mismatch_triggers_a_keyframe_resync(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.sync_weights()
    delta = sync.encode(versions[0], versions[1], "bf16", version=1)
    name = next(n for n in delta.tensors if delta.changes(n).kind == "sparse")
    var = worker.policy._vars[name]
    var.set_value(var[...] * 2)  # the held copy went bad
    trainer.publish(delta.to_bytes())
    worker.sync_weights()
    assert worker.stats.resyncs == 1
    assert worker.policy.version == 1 and same_held(worker.policy, versions[1])


def test_a_server_restarted_on_another_store_at_the_held_version_number_is_resynced(
    tmp_path, versions, caplog):
  """The server restarted on an empty store and the new run published its own v0: the
  worker held the old v0 and, the numbers equal, sampled the new run's prompts with the old
  run's weights. The storage id (VersionInfo.store_id) tells them apart."""
  from worker_testlib import start_server
  first = start_server(tmp_path / "a")
  wc = client(first, "worker")
  try:
    with client(first, "trainer") as trainer:
      trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL))
    worker._catch_up()
    assert worker.policy.version == 0 and same_held(worker.policy, versions[0])
  finally:
    first.stop(grace=0)
  second = start_server(tmp_path / "b", first.port)
  try:
    with client(second, "trainer") as trainer:
      # A restarted trainer feeds its prompts again before it publishes: nothing is sampled
      # by the old run's weights (their groups were refused, each prompt answered "cannot be
      # sampled"), the worker waits for the new storage's first version, as at its start.
      enqueue_addition(trainer, 2)
      with caplog.at_level(logging.WARNING):
        ran = concurrent.futures.ThreadPoolExecutor(1).submit(worker.run)
        time.sleep(1.5)
        stats = trainer.stats()
        assert worker.policy.version is None and (stats.rollouts_ready, stats.errors) == (0, 0)
        trainer.publish(sync.encode(None, versions[1], "bf16", version=0).to_bytes())
        stats = ran.result(timeout=120)
      assert "the server's storage is another (id" in caplog.text
      assert same_held(worker.policy, versions[1]) and stats.groups_submitted == 2
      assert (stats.groups_refused, stats.prompts_failed) == (0, 0)
      groups = trainer.take_rollouts(0, 10).rollouts
      assert len(groups) == 2 and all(r.group.samples and not r.group.failure for r in groups)
  finally:
    wc.close()
    second.stop(grace=0)


def test_a_group_of_a_version_the_server_does_not_hold_releases_its_prompt(server, versions):
  """Sampled while the server was replaced by one on another storage: the group is dropped
  and its prompt sampled again, not answered "cannot be sampled" (which the server refused
  as well, the version being none of its)."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 1)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    wc.register("w")
    lease = worker._lease(0.0)
    (prompt,) = lease.prompts
    group = pb.RolloutGroup(prompt_id=prompt.id, policy_version=7,
                            samples=[pb.Sample(token_ids=[3], reward=1.0)])
    worker._submit(lease.lease_id, prompt.id, group)
    worker._settle(lease.lease_id)
    assert (worker.stats.groups_refused, worker.stats.prompts_failed) == (1, 0)
    assert not trainer.take_rollouts(0, 10).rollouts  # no failure answer reached the trainer
    assert [p.id for p in wc.lease(1, deadline_s=30.0).prompts] == [prompt.id]


def test_a_worker_that_crashes_with_the_server_away_raises_at_once(versions, monkeypatch):
  """Its decode loop raised while a finished group waited out an outage: run() waited for
  that send's retries, which have no deadline, so the error (and the supervisor's restart)
  came only once the server was back; meanwhile the worker sat idle, retrying."""
  import itertools

  from param_server.client import Lease
  from worker_testlib import PublishingClient, published

  ids = itertools.count()

  class Away(PublishingClient):  # leases a prompt at a time; sends and renewals never land
    timeout_s, worker_id = 10.0, "w1"

    def lease(self, n, deadline_s, wait_s=0.0):
      return Lease(f"l{next(ids)}", "w1", [pb.Prompt(
          id=f"p{next(ids)}", text="1+2=", task="addition", extra=b"3")], 0.0, 0, 0)

    def submit_rollouts(self, lease_id, group):
      raise ParamServerError("SubmitRollouts", grpc.StatusCode.UNAVAILABLE, "server away")

    def renew(self, *args, **kwargs):
      raise ParamServerError("RenewLease", grpc.StatusCode.UNAVAILABLE, "server away")

    def release(self, lease_id, ids=(), **kwargs):
      return len(ids)

  steps, step = [], ContinuousBatch.step

  def failing_second(batch):  # the first chunk ends a group; the second fails
    steps.append(1)
    if len(steps) == 2:
      raise RuntimeError("decode chunk failed")
    return step(batch)

  monkeypatch.setattr(ContinuousBatch, "step", failing_second)
  worker = Worker(Away(published(CONFIG, version=0)[0]), CONFIG, TOKENIZER,
                  WorkerConfig(**{**SMALL, "prompts_per_call": 4, "prompts_per_lease": 1},
                               backoff_max_s=0.2))
  raised = concurrent.futures.ThreadPoolExecutor(1).submit(worker.run)
  with pytest.raises(RuntimeError, match="decode chunk failed"):
    raised.result(timeout=120)  # (before: for ever, retrying the send)
  assert len(steps) == 2


def test_unreachable_server_is_retried_with_backoff(versions, caplog):
  wc = ParamServerClient("127.0.0.1:1", token="x", role="worker", timeout_s=1.0,
                         retry=RetryPolicy(deadline_s=0.2))
  worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
  threading.Timer(1.5, worker.request_stop).start()
  stats = worker.run()
  assert stats.reconnects >= 2 and stats.leases == 0
  # The client's "retrying for up to 0.2s" is one call's; the worker says it goes on.
  assert "retrying until it answers or the worker stops (no deadline)" in caplog.text


@pytest.mark.parametrize("allocator", ["fixed", "vigor"])
def test_a_finished_group_waits_out_an_outage_and_is_sent(server, versions, allocator):
  """The server away when a group is sent (two refused tries): the group is kept and sent
  once it answers, not dropped with its prompts released (VIGOR's rounds dropped them)."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    submit, refused = wc.submit_rollouts, []

    def away_twice(*args, **kwargs):
      if len(refused) < 2:
        refused.append(1)
        raise ParamServerError("SubmitRollouts", grpc.StatusCode.UNAVAILABLE, "connection refused")
      return submit(*args, **kwargs)

    wc.submit_rollouts = away_twice
    config = WorkerConfig(max_leases=1, **dict(SMALL, allocator=allocator))
    stats = Worker(wc, CONFIG, TOKENIZER, config).run()
    assert (stats.groups_submitted, stats.prompts_released, stats.reconnects) == (2, 0, 2)
    assert len(trainer.take_rollouts(0, 10).rollouts) == 2


def test_a_group_a_stop_leaves_unsent_with_the_server_away_is_logged(server, versions, caplog):
  # SIGTERM while the server is down: the finished group cannot go; the worker must say
  # what it leaves undone, not exit as if all were handed over.
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL))

    def submit_while_the_server_is_away(*args, **kwargs):
      worker.request_stop(5.0)
      raise ParamServerError("SubmitRollouts", grpc.StatusCode.UNAVAILABLE, "connection refused")

    wc.submit_rollouts = submit_while_the_server_is_away
    stats = worker.run()
  assert stats.groups_submitted == 0
  assert "stopping with the server unreachable; not done: SubmitRollouts" in caplog.text


# ---------------------------------------------------------------- preemption (subprocesses)


def spawn_worker(tmp_path, address, **flags):
  config = tmp_path / "worker_config.py"
  config.write_text(textwrap.dedent(f"""
      import ml_collections
      def get_config():
        return ml_collections.ConfigDict(dict(
            tokenizer=dict(kind="char"), model=dict(vocab_size=0, **{MODEL!r})))
      """))
  args = [f"--{k}={v}" for k, v in flags.items()]
  env = dict(child_env(), RLAX_PS_WORKER_TOKEN=TOKENS["worker"], JAX_PLATFORMS="cpu")
  log = tmp_path / "worker.log"  # a file: a pipe nobody reads would stall the worker's logging
  with open(log, "w") as out:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlax_ps", "worker", f"--address={address}", f"--config={config}",
         *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
  proc.log = log
  return proc


def wait_for(cond, timeout, what, log=None):
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if cond():
      return
    time.sleep(0.05)
  raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                       + (f"; the worker's log ends:\n{log.read_text()[-3000:]}" if log else ""))


@pytest.mark.slow  # ~8 s; test_stopping_within_grace holds the release, test_local a SIGTERM
def test_sigterm_releases_leases_within_the_grace_period(server, versions, tmp_path):
  with client(server, "trainer") as trainer:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 32)
    proc = spawn_worker(tmp_path, server.address, prompts_per_lease=32, prompts_per_call=1,
                        samples_per_prompt=4, max_new_tokens=16, grace_s=8)
    try:
      wait_for(lambda: trainer.stats().prompts_leased > 0, 180, "the worker's first lease",
               proc.log)
      proc.send_signal(signal.SIGTERM)
      sent = time.monotonic()
      rc = proc.wait(timeout=30)
      took = time.monotonic() - sent
    finally:
      proc.kill()
      proc.wait()
    out = proc.log.read_text()
    assert rc == 0, out
    assert took < 8 + 2, out
    st = trainer.stats()
    assert st.prompts_leased == 0 and st.leases_expired == 0
    assert st.prompts_queued > 0  # released, not answered
    assert st.prompts_queued + st.rollouts_accepted == 32


@pytest.mark.slow  # ~11 s; lease expiry is the server tests' in the default suite
def test_sigkill_leaves_leases_that_expire_and_are_served_again(server, versions, tmp_path):
  """kill -9 mid-generation: the lease expires and its prompts are served again, the one
  decoding with the samples its last renewal carried (worker.checkpoint_s)."""
  def begun():
    return {p.id for p in list(server.queues.prompts.values()) if p.partial}

  with client(server, "trainer") as trainer, client(server, "worker") as other:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    ids = enqueue_addition(trainer, 96)  # leases of 32: decoding outlasts a few renewals
    proc = spawn_worker(tmp_path, server.address, prompts_per_lease=32, prompts_per_call=1,
                        samples_per_prompt=4, max_new_tokens=40, decode_chunk_steps=2,
                        lease_deadline_s=2, checkpoint_s=0.05)
    try:
      wait_for(lambda: trainer.stats().prompts_leased > 0 and begun(), 180,
               "the worker's first checkpoint", proc.log)
      seen = begun()
      proc.kill()
      proc.wait(timeout=30)
    finally:
      proc.kill()
      proc.wait()
    wait_for(lambda: trainer.stats().leases_expired > 0, 30, "the lease to expire")
    other.register("other")
    lease = other.lease(96, 30.0, wait_s=5.0)
    answered = {r.prompt.id for r in trainer.take_rollouts(0, 96).rollouts}
    assert lease.prompts and {p.id for p in lease.prompts} <= set(ids)
    assert len(lease.prompts) + len(answered) == 96
    back = {p.id for p in lease.prompts if p.partial}
    assert seen <= back | answered  # (answered between the look and the kill: rare)


@pytest.mark.slow  # ~9 s a case; test_multi_turn holds environments in the default suite
@pytest.mark.parametrize("allocator", ["fixed", "vigor"])
def test_an_environment_answers_turns_and_its_replies_reach_the_trainer_marked(
    server, versions, allocator):
  """worker.environment by task: the addition prompts' turns are answered, and their
  replies reach the trainer marked; the reversal prompts' samples end at their first turn.
  VIGOR's rounds too (unequal groups, the budget spent)."""
  from algorithms.environments import ENVIRONMENTS, register_environment
  from rlax_ps.train.rollouts import build_batch

  @register_environment("test_ok")
  def ok():
    def reply(messages, reference):
      assert [m["role"] for m in messages[::2]] == ["assistant"] * ((len(messages) + 1) // 2)
      assert all(m == {"role": "tool", "content": "<ok>"} for m in messages[1::2])
      return None if len(messages) >= 5 else "<ok>"  # two replies, then done
    return reply

  tok = ManyStops()
  try:
    with client(server, "trainer") as trainer, client(server, "worker") as wc:
      trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
      enqueue_addition(trainer, 2)
      examples = get_task("reversal").examples("train", 0, 2)
      trainer.enqueue_prompts([pb.Prompt(id=f"r{i}", text=e.prompt, task="reversal",
                                         extra=e.answer.encode())
                               for i, e in enumerate(examples)])
      worker = Worker(wc, CONFIG, tok, WorkerConfig(
          max_leases=2, environment="addition=test_ok", max_turns=3, allocator=allocator,
          **dict(SMALL, max_new_tokens=24)))
      stats = worker.run()
      assert stats.groups_submitted == 4 and stats.replies > 0
      take = trainer.take_rollouts(min_version=0, max_n=10)
  finally:
    ENVIRONMENTS.pop("test_ok")
  reply = tok.encode("<ok>")
  marked = 0
  sizes = [len(r.group.samples) for r in take.rollouts]
  assert sum(sizes) == 4 * 3 and (set(sizes) == {3} if allocator == "fixed" else min(sizes) >= 2)
  single = [r for r in take.rollouts if r.prompt.task == "reversal"]
  assert len(single) == 2
  for r in single:  # no environment for reversal: one turn, ended by its first stop token
    for s in r.group.samples:
      assert not s.observed or not any(s.observed)
      assert not [t for t in s.token_ids[:-1] if t in tok.stop_ids]
  for r in take.rollouts:
    if r.prompt.task == "reversal":
      continue
    for s in r.group.samples:
      ids, lp = np.asarray(s.token_ids), sample_logprobs(s)
      seen = np.frombuffer(s.observed, np.uint8).astype(bool) if s.observed else np.zeros(
          len(ids), bool)
      # Each reply follows a stop token, is "<ok>" (or the start of it, at the budget), and
      # carries log-prob 0; at most two replies (the environment's own limit).
      starts = [k for k in range(len(ids)) if seen[k] and (k == 0 or not seen[k - 1])]
      assert len(starts) <= 2 and int(seen.sum()) <= 2 * len(reply)
      for k in starts:
        assert int(ids[k - 1]) in tok.stop_ids
        assert ids[k:k + len(reply)].tolist() == reply[:len(ids) - k]
      assert np.all(lp[seen] == 0) and np.all(lp[~seen] < 0)
      marked += len(starts)
    group = group_of(r, tok)
    batch = build_batch([group], BatchShape(groups=1, samples=max(sizes), prompt_len=16,
                                            response_len=24))
    for j, s in enumerate(group.responses):
      seen = group.observed[j] if group.observed and group.observed[j] is not None else 0
      np.testing.assert_array_equal(batch["policy_tokens"][0, j, :len(s)], 1 - np.asarray(seen))
  assert marked == stats.replies


def test_a_reward_model_scores_the_prompts_of_task_reward_model(server, versions):
  from rlax_ps.reward_scoring import RewardScorer
  from tests.models.hf_fixtures import FIXTURES
  rm = os.path.join(FIXTURES, "qwen3_reward")
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    trainer.enqueue_prompts([pb.Prompt(id=f"j{i}", text=t, task="reward_model")
                             for i, t in enumerate(("say hi", "say bye"))])
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(
        max_leases=1, reward_model=rm, reward_model_dtype="float32", **SMALL))
    worker.run()
    rollouts = trainer.take_rollouts(0, 10).rollouts
  assert sorted(r.group.prompt_id for r in rollouts) == ["j0", "j1"]
  scorer = RewardScorer(rm, TOKENIZER, "float32")
  for r in rollouts:
    head = TOKENIZER.encode_prompt({"j0": "say hi", "j1": "say bye"}[r.group.prompt_id])
    want = scorer.scores([head + list(s.token_ids) for s in r.group.samples])
    np.testing.assert_allclose([s.reward for s in r.group.samples], want, rtol=1e-5)
    assert len(set(want.tolist())) > 1  # the samples differ and so do their scores


def test_a_prompts_sampling_seed_is_its_trainers_whatever_the_workers_seed():
  """A prompt that carries its trainer's seed draws the same seeds on every worker (another
  --seed, another workdir's prompt id) and at every version (a restart republishes its
  checkpoint as the next); one without draws of the worker's seed, its id and the version.
  Allocation rounds draw afresh."""
  zero, one = (Worker(None, CONFIG, TOKENIZER, WorkerConfig(max_new_tokens=8, seed=s))
               for s in (0, 1))
  seeded = pb.Prompt(id="runA-3", metadata={PROMPT_SEED: "0-s0-3"})
  moved = pb.Prompt(id="runB-3", metadata={PROMPT_SEED: "0-s0-3"})
  assert zero._seeds(seeded, 2, 0, 4) == one._seeds(seeded, 2, 0, 4) == one._seeds(moved, 2, 0, 4)
  assert len(set(zero._seeds(seeded, 2, 0, 4))) == 4
  assert zero._seeds(seeded, 3, 0, 4) == zero._seeds(seeded, 2, 0, 4)
  assert zero._seeds(seeded, 2, 1, 4) != zero._seeds(seeded, 2, 0, 4)
  bare = pb.Prompt(id="runA-3")
  assert zero._seeds(bare, 2, 0, 4) != one._seeds(bare, 2, 0, 4)
  assert zero._seeds(bare, 3, 0, 4) != zero._seeds(bare, 2, 0, 4)
  assert zero._seeds(bare, 2, 0, 4) != zero._seeds(pb.Prompt(id="runB-3"), 2, 0, 4)


def test_a_verifier_giving_nan_scores_zero_and_the_warning_says_so(caplog):
  def nan(completion, reference):
    return VerifierResult(float("nan"), True)

  worker = Worker(None, CONFIG, TOKENIZER, WorkerConfig(max_new_tokens=8),
                  verifier_for=lambda task: Guarded(task, nan))
  sample = Sample(np.array([5, 6], np.int32), np.zeros(2, np.float32), np.zeros(2, np.float32),
                  "stop")
  with caplog.at_level("WARNING"):
    assert worker._score(pb.Prompt(id="p7", task="mine"), sample) == (0.0, False, True)
  assert worker.stats.score_errors == 1
  assert ("verifier of task 'mine' gave no reward on prompt p7 (scored 0; 1 so far): reward: "
          "expected a finite number, got nan") in caplog.text


def test_decoding_goes_on_while_a_finished_group_is_scored(server, versions):
  """A finished group is scored and submitted on the submitter's thread: while its verifier
  is held, the batch decodes the other prompts (their samples count); every group still
  reaches the server, scored, and the leases complete."""
  release = threading.Event()

  def verifier(completion, reference):
    release.wait(60)
    return VerifierResult(1.0, True)

  reached, worker, take, st = _run_while_held(
      server, versions, verifier, release, WorkerConfig(max_leases=2, **SMALL),
      lambda w: w.stats.samples >= 6)
  assert reached and worker.stats.groups_submitted == 4
  assert all(s.reward == 1.0 for r in take.rollouts for s in r.group.samples)
  assert st.prompts_leased == 0 and st.prompts_queued == 0


def _run_while_held(server, versions, verifier, release, config, until):
  """A worker on 4 addition prompts whose `verifier` waits for `release`: (whether `until`
  (worker) held before the release, waited for up to 60 s; the worker, run to its end; the
  server's rollouts, every prompt's checked there once; its stats)."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    ids = enqueue_addition(trainer, 4)
    worker = Worker(wc, CONFIG, TOKENIZER, config,
                    verifier_for=lambda task: Guarded(task, verifier))
    runner = threading.Thread(target=worker.run)
    runner.start()
    deadline = time.monotonic() + 60
    while not until(worker) and time.monotonic() < deadline:
      time.sleep(0.02)
    reached = until(worker)
    release.set()
    runner.join(60)
    take = trainer.take_rollouts(min_version=0, max_n=10)
    assert sorted(r.group.prompt_id for r in take.rollouts) == sorted(ids)
    return reached, worker, take, trainer.stats()


def test_a_group_held_by_one_slow_test_does_not_hold_the_next_groups(server, versions):
  """Finished groups are scored side by side on the submitter's threads: while the first
  verifier call (a straggling test) is held, the groups that finish after its group are
  scored and submitted; then every group reaches the server, scored."""
  release, calls, lock = threading.Event(), [0], threading.Lock()

  def verifier(completion, reference):
    with lock:
      calls[0] += 1
      first = calls[0] == 1
    if first:
      release.wait(60)
    return VerifierResult(1.0, True)

  reached, worker, take, st = _run_while_held(
      server, versions, verifier, release,
      WorkerConfig(max_leases=2, scoring_threads=2, **SMALL),
      lambda w: w.stats.groups_submitted >= 1)
  assert reached and worker.stats.groups_submitted == 4
  assert all(s.reward == 1.0 for r in take.rollouts for s in r.group.samples)
  assert st.prompts_leased == 0


def test_a_stop_sends_the_group_being_scored_within_the_grace_period(server, versions):
  """A stop while a finished group is being scored: the group is still sent (scored), the
  other prompt goes back or is sent too, and no lease is left open."""
  entered, release = threading.Event(), threading.Event()

  def verifier(completion, reference):
    entered.set()
    release.wait(30)
    return VerifierResult(1.0, True)

  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL),
                    verifier_for=lambda task: Guarded(task, verifier))
    runner = threading.Thread(target=worker.run)
    runner.start()
    assert entered.wait(60)
    worker.request_stop(grace_s=30.0)
    time.sleep(0.2)
    release.set()
    runner.join(60)
    assert not runner.is_alive()
    rollouts = trainer.take_rollouts(min_version=0, max_n=10).rollouts
    st = trainer.stats()
  assert rollouts and all(s.reward == 1.0 for r in rollouts for s in r.group.samples)
  assert st.prompts_leased == 0 and len(rollouts) + st.prompts_queued == 2


@pytest.mark.parametrize("threads", [1, 4])
def test_a_groups_samples_are_scored_at_once_on_scoring_threads(threads):
  """worker.scoring_threads verifier calls run side by side (a code task's tests), each
  sample keeping its own reward; 1 calls one at a time."""
  active, peak, lock = [0], [0], threading.Lock()
  meet = threading.Barrier(2, timeout=30)

  def verifier(completion, reference):
    with lock:
      active[0] += 1
      peak[0] = max(peak[0], active[0])
    if threads > 1:
      meet.wait()  # two calls at once, or this one waits
    with lock:
      active[0] -= 1
    return VerifierResult(float(len(completion)), len(completion) > 2)

  worker = Worker(None, CONFIG, TOKENIZER, WorkerConfig(max_new_tokens=8,
                                                        scoring_threads=threads),
                  verifier_for=lambda task: Guarded(task, verifier))
  lengths = (1, 3, 2, 4)
  samples = [Sample(np.full(k, 20 + k, np.int32), np.zeros(k, np.float32),
                    np.zeros(k, np.float32), "stop") for k in lengths]
  rewards, passed, _, _ = worker._scored(pb.Prompt(id="p", task="mine"), samples)
  assert rewards == [float(len(TOKENIZER.decode(s.tokens))) for s in samples]
  assert passed == [len(TOKENIZER.decode(s.tokens)) > 2 for s in samples]
  assert peak[0] == 1 if threads == 1 else peak[0] >= 2


def test_bad_batching_settings_are_named():
  with pytest.raises(ValueError, match=r"WorkerConfig.rows_per_prompt: expected an int in "
                                       r"\[0, samples_per_prompt=4\]"):
    WorkerConfig(samples_per_prompt=4, rows_per_prompt=5)
  with pytest.raises(ValueError, match="WorkerConfig.decode_chunk_steps"):
    WorkerConfig(decode_chunk_steps=0)
  with pytest.raises(ValueError, match="WorkerConfig.environment: expected NAME or TASK=NAME"):
    WorkerConfig(environment="math=python,code")
  with pytest.raises(ValueError, match="WorkerConfig.checkpoint_s: expected a number of "
                                       "seconds >= 0, got -1"):
    WorkerConfig(checkpoint_s=-1)
  with pytest.raises(ValueError, match="WorkerConfig.stall_s: expected a number of seconds "
                                       ">= 0 \\(0: never\\), got -5"):
    WorkerConfig(stall_s=-5)
  with pytest.raises(ValueError, match="WorkerConfig.max_turns: expected an int >= 0"):
    WorkerConfig(max_turns=-1)
  # -1 leases: the worker loaded its model and exited at once, having done nothing; a
  # negative wait: refused by the server at the first lease, naming its own field
  with pytest.raises(ValueError, match=r"WorkerConfig.max_leases: expected an int >= 0 "
                                       r"\(0: run until stopped\), got -1"):
    WorkerConfig(max_leases=-1)
  with pytest.raises(ValueError, match="WorkerConfig.lease_wait_s: expected a number of "
                                       "seconds >= 0, got -1"):
    WorkerConfig(lease_wait_s=-1)
  with pytest.raises(ValueError, match="WorkerConfig.sample_rows: expected an int >= 0"):
    WorkerConfig(sample_rows=-1)
  with pytest.raises(ValueError, match="WorkerConfig.sample_rows: expected 0 with "
                                       "allocator='vigor'"):
    WorkerConfig(sample_rows=8, allocator="vigor")
  with pytest.raises(ValueError, match="WorkerConfig.greedy_baseline: expected False with "
                                       "allocator='vigor'"):
    WorkerConfig(greedy_baseline=True, allocator="vigor")
  with pytest.raises(ValueError, match="WorkerConfig.rows_per_prompt: expected 0 with "
                                       "allocator='vigor'"):
    WorkerConfig(rows_per_prompt=2, allocator="vigor")
  with pytest.raises(ValueError, match="WorkerConfig.in_flight_updates: expected False with "
                                       "allocator='vigor'"):
    WorkerConfig(in_flight_updates=True, allocator="vigor")
  with pytest.raises(ValueError, match="WorkerConfig.environment_threads: expected a positive"):
    WorkerConfig(environment_threads=0)
  with pytest.raises(ValueError, match="WorkerConfig.scoring_threads: expected a positive"):
    WorkerConfig(scoring_threads=0)
  with pytest.raises(ValueError, match="WorkerConfig.environment_timeout_s: expected seconds >= 0"):
    WorkerConfig(environment_timeout_s=-1.0)
  with pytest.raises(ValueError, match="WorkerConfig.kv_cache_dtype: expected '' .* got 'int4'"):
    WorkerConfig(kv_cache_dtype="int4")


def test_an_environment_that_raises_is_logged_and_its_error_is_the_reply(caplog):
  from algorithms.environments import ENVIRONMENTS, register_environment

  @register_environment("test_raises")
  def raises():
    def env(messages, reference):
      raise RuntimeError("no network")
    return env

  try:
    worker = Worker(None, CONFIG, TOKENIZER, WorkerConfig(environment="test_raises", **SMALL))
    key = ("lease", "p0")
    worker._started[key] = (pb.Prompt(id="p0", text="1+1="), 0)
    tokens = np.asarray(TOKENIZER.encode("2") + [TOKENIZER.eos_id])
    with caplog.at_level("WARNING"):
      ids = worker._respond(key, 0, tokens, np.zeros(len(tokens), bool))
  finally:
    ENVIRONMENTS.pop("test_raises")
  assert TOKENIZER.decode(ids) == "error: RuntimeError: no network"
  assert "environment 'test_raises' raised on prompt p0 (1 so far)" in caplog.text


def test_the_behaviour_logprobs_sent_are_those_of_the_tempered_draw(server, versions):
  """worker.temperature != 1: each token's log-prob sent is under the distribution it was
  drawn from (what the trainer's ratios divide by), not the untempered one."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 1)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, temperature=1.5, **SMALL))
    worker.run()
    (taken,) = trainer.take_rollouts(0, 10).rollouts
  n = len(taken.group.samples)
  drawn = generate(worker.policy.model, [TOKENIZER.encode_prompt(taken.prompt.text)] * n,
                   worker._seeds(taken.prompt, 0, 0, n), worker.params)
  assert [list(s.token_ids) for s in taken.group.samples] == [d.tokens.tolist() for d in drawn]
  for sent, d in zip(taken.group.samples, drawn):
    assert not np.allclose(d.sampling_logprobs, d.logprobs, atol=1e-3)  # T=1.5: they differ
    np.testing.assert_allclose(sample_logprobs(sent), d.sampling_logprobs, atol=1e-5)


def test_a_full_batch_leases_no_prompts_to_hold_idle():
  """No slot free and none waiting: the cycle leases nothing (prompts it could not start
  would wait in the worker, their leases renewed, while another worker could sample them);
  a slot freed, it leases."""
  from param_server.client import Lease
  from worker_testlib import PublishingClient
  leases = []

  class Client(PublishingClient):
    def lease(self, n, deadline_s, wait_s=0.0):
      leases.append(n)
      return Lease("l0", "w1", [], 0.0, 0, 0)

  class Batch:  # one prompt decoding, in every slot there is
    running, waiting, free = 1, 0, 0

    def step(self):
      return []

  worker = Worker(Client(None), CONFIG, TOKENIZER, WorkerConfig(**SMALL))
  worker.policy.version = 0  # as if v0 were held (the batch decodes nothing)
  worker._batch, worker._slots = Batch(), 1
  worker._cycle()
  assert leases == []
  worker._batch.free = 1
  worker._cycle()
  assert leases == [SMALL["prompts_per_lease"]]
