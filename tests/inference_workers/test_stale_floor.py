"""A worker stops the prompts it began on a version under the trainer's staleness floor (as
lease, renewal, submission and heartbeat replies name it): they leave the batch, their
slots free, and go back to the server without their samples, to be sampled anew on the
newest version; a group that finishes under the floor is released, not sent. The prompts of
a lease a renewal finds gone leave the batch alike, and a worker whose decoding stalls
hands all its prompts back and exits."""

import numpy as np
import pytest

from inference_workers.continuous import ContinuousBatch
from inference_workers.decoding import Sample
from inference_workers.loop import Worker
from inference_workers.sample_batch import SampleBatch
from inference_workers.worker_config import WorkerConfig
from param_server.protos import param_server_pb2 as pb
from rlax_ps import sync
from worker_testlib import CONFIG, SMALL, TOKENIZER, client, enqueue_addition

# The worker tests' shapes and sampling (SMALL), so that they share compiled programs.
PARAMS = WorkerConfig(**SMALL).sampling(TOKENIZER.stop_ids)


def publish(trainer, versions, v):
  trainer.publish(sync.encode(versions[v - 1] if v else None, versions[v], "bf16",
                              version=v).to_bytes())


@pytest.mark.parametrize("kind", ["slots", pytest.param("sample_rows", marks=pytest.mark.slow)])
def test_a_dropped_prompt_frees_its_slot_and_the_next_draws_as_if_alone(
    server, versions, kind):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    publish(trainer, versions, 0)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))  # the model as held
    worker.sync_weights()
  model = worker.policy.model

  def make():
    if kind == "slots":
      return ContinuousBatch(model, 3, 2, PARAMS, chunk_steps=1)
    return SampleBatch(model, 3, 6, PARAMS, chunk_steps=1)

  new, old = TOKENIZER.encode_prompt("12+34="), TOKENIZER.encode_prompt("5+6=")
  alone = make()
  alone.add("new", new, [11, 12, 13])
  want = dict(alone.run())["new"]
  batch = make()
  batch.add("old", old, [21, 22, 23])
  batch.add("other", old, [31, 32, 33])
  assert batch.step() == [] and batch.running == 2
  batch.drop(["old", "other"])
  assert (batch.running, batch.waiting, batch.free) == (0, 0, 2)
  batch.add("new", new, [11, 12, 13])
  got = dict(batch.run())
  assert list(got) == ["new"]
  assert [s.tokens.tolist() for s in got["new"]] == [s.tokens.tolist() for s in want]


def _two_prompts_begun_on_v0(trainer, wc, versions, **settings):
  """A worker that leased two prompts and began them on v0, one decode step in."""
  publish(trainer, versions, 0)
  enqueue_addition(trainer, 2)
  wc.register("floor")
  worker = Worker(wc, CONFIG, TOKENIZER,
                  WorkerConfig(**dict(SMALL, decode_chunk_steps=1, **settings)))
  worker.sync_weights()
  worker._cycle()
  return worker


def test_prompts_begun_under_a_risen_floor_go_back_and_start_again_on_the_newest(
    server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = _two_prompts_begun_on_v0(trainer, wc, versions)
    assert sorted(v for _, v in worker._started.values()) == [0, 0]
    assert worker._batch.running == 2
    publish(trainer, versions, 1)
    assert trainer.take_rollouts(min_version=1, max_n=4).rollouts == []  # the floor is v1
    lease_id, = worker._inflight
    worker._renew(lease_id, [])  # its reply names the floor
    assert worker._floor == 1
    worker._cycle()  # they stop and go back; leased again, they start on v1
    assert worker.stats.groups_abandoned_stale == 2 and worker.stats.prompts_released == 2
    assert sorted(v for _, v in worker._started.values()) == [1, 1]
    while worker._started or worker._scoring:  # the last groups are sent on their thread
      worker._cycle()
    take = trainer.take_rollouts(min_version=1, max_n=4)
  assert sorted(r.prompt.id for r in take.rollouts) == ["p0", "p1"]
  assert [r.group.policy_version for r in take.rollouts] == [1, 1]
  assert take.dropped_stale == 0 and worker.stats.groups_abandoned_stale == 2


def test_a_heartbeat_alone_tells_of_a_risen_floor_and_the_next_cycle_stops_the_prompts(
    server, versions):
  """A worker decoding long groups makes no lease, renewal or submission call for a while:
  its heartbeat is the call that names the floor."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = _two_prompts_begun_on_v0(trainer, wc, versions)
    publish(trainer, versions, 1)
    trainer.take_rollouts(min_version=1, max_n=4)  # the floor is v1
    rpc, calls = worker._rpc, []
    worker._rpc = lambda method, *a, **k: calls.append(method) or rpc(method, *a, **k)
    worker._beat()
    assert calls == ["heartbeat"] and worker._floor == 1  # no lease was due a renewal
    worker._rpc = rpc
    worker._cycle()
  assert worker.stats.groups_abandoned_stale == 2 and worker.stats.prompts_released == 2
  assert sorted(v for _, v in worker._started.values()) == [1, 1]


def test_a_group_finished_under_the_floor_is_released_not_sent(server, versions):
  """The first group's submission reply names a floor past its sibling's version: the
  sibling's prompt goes back instead of a group the server would drop."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    publish(trainer, versions, 0)
    publish(trainer, versions, 1)
    enqueue_addition(trainer, 2)
    wc.register("floor")
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    lease = worker._lease(0.0)
    trainer.take_rollouts(min_version=1, max_n=4)
    worker._submit(lease.lease_id, "p0", pb.RolloutGroup(
        prompt_id="p0", policy_version=1, failure="not sampled: a test"))
    assert worker._floor == 1
    worker._started[(lease.lease_id, "p1")] = (lease.prompts[1], 0)
    sample = Sample(np.array([5, 6], np.int32), np.zeros(2, np.float32),
                    np.zeros(2, np.float32), "length")
    worker._submit_group(lease.lease_id, "p1", [sample] * 3)
    assert worker.stats.groups_submitted == 1 and worker.stats.groups_abandoned_stale == 1
    assert worker.stats.prompts_released == 1 and not worker._inflight
    assert [p.id for p in wc.lease(2, deadline_s=30).prompts] == ["p1"]
    # Versions at the floor in another format than the worker's: nothing is stopped (a
    # prompt begun again would start on the same old version).
    worker._skipped_version = 1
    assert not worker._stale(0)


class Recorded:
  """A batch that records what is added to it."""
  free, running, waiting = 2, 0, 0

  def __init__(self):
    self.added = []

  def add(self, key, tokens, seeds, begun=None):
    self.added.append((key, begun))


def test_begun_samples_under_the_floor_are_drawn_afresh_on_the_held_version(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    publish(trainer, versions, 0)
    publish(trainer, versions, 1)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.sync_weights()
    worker._hear(1, 1)
    worker._batch = batch = Recorded()
    begun = pb.Sample(token_ids=[5, 6], logprobs_f32=np.zeros(2, "<f4").tobytes())
    prompt = pb.Prompt(id="p0", text="1+2=", partial=[begun], partial_version=0)
    worker._pending.append(("L", prompt))
    worker._start_pending(batch)
  assert batch.added == [(("L", "p0"), None)] and worker._started[("L", "p0")][1] == 1


def test_a_lower_floor_a_restarted_trainer_names_is_taken_as_named(server, versions):
  """Kept at its highest, the floor of a trainer that restarted lower made the worker drop
  every group the trainer now takes as stale (and re-lease them for ever)."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    publish(trainer, versions, 0)
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker._hear(1, 2)
    assert worker._floor == 2 and worker._stale(1)
    worker._hear(1, 0)  # the restarted trainer's take
    assert worker._floor == 0 and not worker._stale(1)


def test_a_reply_asked_for_a_stopped_prompt_is_none(server):
  with client(server, "worker") as wc:
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    assert worker._respond(("L", "gone"), 0, np.array([5]), np.zeros(1, bool)) is None
    assert not worker._given


def _vigor_worker(trainer, wc, versions, name):
  """A worker of VIGOR's rounds (no continuous batching), holding v0, 2 prompts queued."""
  publish(trainer, versions, 0)
  enqueue_addition(trainer, 2)
  wc.register(name)
  worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**dict(SMALL, allocator="vigor")))
  worker.sync_weights()
  return worker


def test_vigor_rounds_end_when_the_floor_passes_their_version(server, versions):
  """Without continuous batching (VIGOR's rounds), a chunk whose version falls under the
  floor draws no more rounds and its prompts go back."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = _vigor_worker(trainer, wc, versions, "vigor")
    draw, rounds = worker._draw, []

    def draw_then_floor(*args):
      rounds.append(args[4])  # (prompts, tokens, counts, version, round_, finished)
      out = draw(*args)
      publish(trainer, versions, 1)
      trainer.take_rollouts(min_version=1, max_n=4)
      worker._renew(*worker._inflight, [])
      return out

    worker._draw = draw_then_floor
    lease = worker._lease(0.0)
    worker._serve(lease)
  assert rounds == [0]
  assert worker.stats.groups_submitted == 0 and worker.stats.groups_abandoned_stale == 2
  assert worker.stats.prompts_released == 2 and not worker._inflight[lease.lease_id]


def test_a_vigor_round_whose_version_falls_under_the_floor_as_it_starts_decodes_nothing(
    server, versions):
  """The floor passes the round's version as its prompts go in (VIGOR's rounds): the round
  ends before its first decode chunk, and its prompts go back."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = _vigor_worker(trainer, wc, versions, "floor-in-round")
    seeds, step, steps = worker._seeds, worker._step, []

    def seeds_then_floor(*args):
      worker._floor = 1  # as a reply naming the trainer's take at min_version 1 would
      return seeds(*args)

    worker._seeds = seeds_then_floor
    worker._step = lambda batch: steps.append(1) or step(batch)
    lease = worker._lease(0.0)
    worker._serve(lease)
  assert not steps and worker.stats.samples == 0
  assert worker.stats.groups_submitted == 0 and worker.stats.prompts_released == 2


def test_a_groups_siblings_are_released_once_its_submission_reply_raises_the_floor(
    server, versions):
  """Without continuous batching (VIGOR's rounds): the first group's submission reply names
  a floor above the chunk's version; its sibling, as stale, goes back, not to the server
  (which would drop it at the trainer's next take)."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = _vigor_worker(trainer, wc, versions, "raised")
    submit = worker._submit

    def submit_then_floor(*args):
      submit(*args)
      worker._floor = 1  # what the reply said: the trainer took at min_version 1

    worker._submit = submit_then_floor
    lease = worker._lease(0.0)
    worker._serve(lease)
  assert worker.stats.groups_submitted == 1 and worker.stats.groups_abandoned_stale == 1
  assert worker.stats.prompts_released == 1 and not worker._inflight[lease.lease_id]


def test_prompts_stopped_under_a_floor_that_fell_since_still_go_back(server, versions):
  """A restarted trainer's lower floor, heard between a chunk's stop and its submission:
  the stopped prompts are released all the same, not left open in a renewed lease."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = _vigor_worker(trainer, wc, versions, "fell")

    def stopped_then_fell(prompts, tokens, version):
      worker._floor = 0
      return [None] * len(prompts)

    worker._rollout_groups = stopped_then_fell
    lease = worker._lease(0.0)
    worker._serve(lease)
  assert worker.stats.groups_submitted == 0 and worker.stats.prompts_released == 2
  assert not worker._inflight[lease.lease_id]


def test_the_prompts_of_a_lease_a_renewal_finds_expired_leave_the_batch(server, versions):
  """The heartbeat's renewal finds the lease expired (the worker stalled past its
  deadline): its prompts are served again elsewhere, so the next cycle drops them from the
  batch instead of decoding groups the server refuses, and leases them anew."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = _two_prompts_begun_on_v0(trainer, wc, versions)
    (lease_id, _), _ = worker._started
    clock = server.queues._clock
    server.queues._clock = lambda: clock() + 3600  # past the lease's deadline
    worker._lease_deadline[lease_id] = 0.0  # due a renewal
    worker._renew_leases()
    assert worker._lost == {lease_id}
    rpc, calls = worker._rpc, []
    worker._rpc = lambda method, *a, **k: calls.append((method, *a[:1])) or rpc(method, *a, **k)
    worker._cycle()
    assert worker.stats.groups_dropped_lost == 2 and lease_id not in worker._inflight
    # The lost lease is abandoned: nothing more is said of it to the server.
    assert not [c for c in calls if c[0] in ("release", "complete") and c[1:] == (lease_id,)]
    assert worker._started and all(key[0] != lease_id for key in worker._started)
    while worker._started or worker._scoring:
      worker._cycle()
    take = trainer.take_rollouts(min_version=0, max_n=4)
  assert sorted(r.prompt.id for r in take.rollouts) == ["p0", "p1"]
  assert worker.stats.groups_submitted == 2


def test_a_lease_is_renewed_once_under_half_its_deadline_is_left(server):
  """The heartbeat (every quarter deadline at most) renews a lease with under half of its
  deadline left, so a renewal due lands with a quarter to spare; not one with more left."""
  import time
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    enqueue_addition(trainer, 1)
    wc.register("renewals")
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    lease = worker._lease(0.0)
    rpc, calls = worker._rpc, []
    worker._rpc = lambda method, *a, **k: calls.append(method) or rpc(method, *a, **k)
    length = worker.config.lease_deadline_s
    for left, want in ((0.6, []), (0.4, ["renew"])):
      worker._lease_deadline[lease.lease_id] = time.monotonic() + left * length
      worker._renew_leases()
      assert calls == want


def test_a_decode_chunk_that_stalls_hands_every_prompt_back_and_exits(server, versions,
                                                                      monkeypatch):
  """A hung device never returns from its chunk, and the heartbeat renewed its leases for
  ever (with max_staleness 0 the trainer waited for good): past worker.stall_s the heartbeat
  releases the prompts and the worker exits 1, for its supervisor to start a fresh one."""
  import time

  from inference_workers import loop

  class Exited(Exception):
    pass

  def exit_now(code):
    raise Exited(code)

  monkeypatch.setattr(loop, "exit_now", exit_now)
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = _two_prompts_begun_on_v0(trainer, wc, versions, stall_s=30.0)
    worker._stepping_since = time.monotonic() - 10  # a chunk 10 s in: not yet stalled
    worker._beat()
    assert worker.stats.prompts_released == 0
    worker._stepping_since = time.monotonic() - 31
    with pytest.raises(Exited, match="1"):
      worker._beat()
    assert worker.stats.prompts_released == 2
    assert sorted(p.id for p in wc.lease(2, deadline_s=30).prompts) == ["p0", "p1"]
