"""The prompt/lease/rollout state machine, without gRPC: leases, exactly-once, acks, recovery."""

import os

import grpc
import numpy as np
import pytest

from param_server import errors
from param_server import queues as queues_lib
from param_server.client import make_routes, make_sample, routes_of, sample_logprobs, sample_observed
from param_server.protos import param_server_pb2 as pb
from param_server.queues import PromptRolloutQueues, QueueLimits
from param_server.wal import WriteAheadLog, read_records


class Clock:
  def __init__(self):
    self.t = 1000.0

  def __call__(self):
    return self.t


def make_queues(tmp_path, clock, latest=5, **limits):
  wal = WriteAheadLog(os.path.join(tmp_path, "q.wal"))
  return PromptRolloutQueues(wal, clock=clock, latest_version=lambda: latest, limits=QueueLimits(**limits))


def prompts(*ids):
  return [pb.Prompt(id=i, text=f"question {i}", token_ids=[1, 2, 3], task="t") for i in ids]


def group(pid, version=3, reward=1.0):
  return pb.RolloutGroup(prompt_id=pid, policy_version=version, samples=[
      pb.Sample(token_ids=[4, 5], reward=reward, logprobs=[-0.5, -0.25], finish_reason="stop")])


@pytest.fixture
def clock():
  return Clock()


@pytest.fixture
def queues(tmp_path, clock):
  q = make_queues(tmp_path, clock)
  yield q
  q.close()


def test_enqueue_assigns_ids_and_skips_duplicates(queues):
  reply = queues.enqueue(prompts("a", "b") + [pb.Prompt(text="no id")])
  assert reply.ids[:2] == ["a", "b"] and reply.ids[2]
  again = queues.enqueue(prompts("a"))
  assert again.duplicates == 1 and again.queue_depth == 3


def test_lease_hands_out_prompts_in_order_once(queues):
  queues.enqueue(prompts("a", "b", "c"))
  first = queues.lease("w1", 2, 10.0)
  second = queues.lease("w2", 2, 10.0)
  assert [p.id for p in first.prompts] == ["a", "b"]
  assert [p.id for p in second.prompts] == ["c"]
  assert not queues.lease("w3", 1, 10.0).lease_id


def test_expired_lease_returns_prompts_to_front_of_queue(queues, clock):
  queues.enqueue(prompts("a", "b", "c"))
  lease = queues.lease("w1", 2, 5.0)
  clock.t += 6.0
  assert queues.expire_due() == 1
  again = queues.lease("w2", 3, 5.0)
  assert [p.id for p in again.prompts] == ["a", "b", "c"]
  assert queues.depths()["leases_expired"] == 1
  with pytest.raises(errors.FailedPrecondition, match="expired"):
    queues.submit(lease.lease_id, "w1", group("a"))


@pytest.mark.parametrize("expire", ["deadline", "silent worker"])
def test_an_expired_lease_returns_only_its_unanswered_prompts(tmp_path, clock, expire):
  """A worker answered one prompt of its lease and died: the lease's expiry (at its deadline,
  or its worker heard from no more) queues the other alone, and so does the log replayed."""
  queues = make_queues(tmp_path, clock)
  queues.enqueue(prompts("a", "b"))
  lease = queues.lease("w1", 2, 5.0)
  queues.submit(lease.lease_id, "w1", group("a"))
  if expire == "deadline":
    clock.t += 6.0
    assert queues.expire_due() == 1
  else:
    assert queues.expire_leases_of(["w1"]) == {lease.lease_id: 1}
  assert queues.depths()["prompts_queued"] == 1
  queues.close()
  queues = make_queues(tmp_path, clock)  # a restart: the same, from the log
  assert queues.depths()["prompts_queued"] == 1
  assert [p.id for p in queues.lease("w2", 2, 5.0).prompts] == ["b"]
  queues.close()


def test_renew_extends_the_deadline(queues, clock):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 5.0)
  clock.t += 4.0
  renewed = queues.renew(lease.lease_id, "w1", 5.0)
  assert renewed.deadline_unix_s == clock.t + 5.0
  clock.t += 4.0
  assert queues.expire_due() == 0


def test_a_multi_turn_samples_observed_tokens_are_kept_as_sent(queues):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  g = group("a")
  g.samples[0].observed = b"\x00\x01"
  queues.submit(lease.lease_id, "w1", g)
  [taken] = queues.take(0, 1, 0.0, 10.0).rollouts
  assert taken.group.samples[0].observed == b"\x00\x01"


def test_submission_is_accepted_exactly_once(queues):
  queues.enqueue(prompts("a", "b"))
  lease = queues.lease("w1", 2, 10.0)
  first = queues.submit(lease.lease_id, "w1", group("a"))
  retry = queues.submit(lease.lease_id, "w1", group("a"))
  assert retry.duplicate and retry.rollout_id == first.rollout_id
  assert queues.depths()["rollouts_ready"] == 1
  with pytest.raises(errors.FailedPrecondition, match="different group"):
    queues.submit(lease.lease_id, "w1", group("a", reward=0.0))


def test_last_submission_closes_the_lease_and_retry_still_acked(queues):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  assert queues.submit(lease.lease_id, "w1", group("a")).lease_closed
  assert queues.complete(lease.lease_id, "w1") == 1
  assert queues.submit(lease.lease_id, "w1", group("a")).duplicate
  assert queues.depths()["leases_active"] == 0


def test_the_closed_lease_history_keeps_the_newest_and_survives_a_restart(tmp_path, clock):
  q = make_queues(tmp_path, clock, closed_lease_history=2)
  q.enqueue(prompts("a", "b", "c"))
  leases = [q.lease("w1", 1, 10.0) for _ in range(3)]
  for lease, pid in zip(leases, "abc"):
    q.submit(lease.lease_id, "w1", group(pid))
  assert list(q.closed_leases) == [l.lease_id for l in leases[1:]]
  q.close()
  q = make_queues(tmp_path, clock, closed_lease_history=2)
  assert q.submit(leases[2].lease_id, "w1", group("c")).duplicate  # a retry, acknowledged
  with pytest.raises(errors.NotFound, match="lease_id"):  # forgotten: long accepted
    q.submit(leases[0].lease_id, "w1", group("a"))
  q.close()


def test_the_acked_take_history_keeps_the_newest_as_many_as_set(tmp_path, clock):
  q = make_queues(tmp_path, clock, acked_take_history=2)
  q.enqueue(prompts("a", "b", "c"))
  lease = q.lease("w1", 3, 10.0)
  takes = []
  for pid in "abc":
    q.submit(lease.lease_id, "w1", group(pid))
    takes.append(q.take(0, 1, 0.0, 30.0).take_id)
    q.ack(takes[-1])
  assert list(q.acked_takes) == takes[1:]
  assert q.ack(takes[1]) == 1  # a retry, acknowledged
  q.close()

def test_foreign_and_unknown_leases_are_rejected(queues):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  with pytest.raises(errors.FailedPrecondition, match="belongs to worker 'w1'"):
    queues.submit(lease.lease_id, "w2", group("a"))
  with pytest.raises(errors.NotFound, match="lease_id"):
    queues.submit("nope", "w1", group("a"))
  # A lease a server never had (it lost its storage): NOT_FOUND, which a worker takes as the
  # lease gone, even for a group of a version it never published.
  with pytest.raises(errors.NotFound, match="lease_id"):
    queues.submit("nope", "w1", group("a", version=99))
  with pytest.raises(errors.InvalidArgument, match="group.prompt_id"):
    queues.submit(lease.lease_id, "w1", group("zzz"))
  assert queues.depths()["rollouts_ready"] == 0


@pytest.mark.parametrize("mutate, field", [
    (lambda g: g.ClearField("samples"), "group.samples"),
    (lambda g: setattr(g, "policy_version", 99), "group.policy_version"),
    (lambda g: setattr(g.samples[0], "reward", float("nan")), "reward"),
    (lambda g: setattr(g, "baseline_reward", float("inf")), "group.baseline_reward"),
    (lambda g: setattr(g.samples[0], "teacher_logprobs_f32", b"\0" * 4),
     r"group.samples\[0\].teacher_logprobs_f32: expected 2 finite float32"),
    (lambda g: setattr(g.samples[0], "teacher_topk_ids", b"\0" * 8),
     r"group.samples\[0\].teacher_topk_ids: expected k int32 ids and k float32 log-probs"),
    (lambda g: g.samples[0].logprobs.append(-1.0), "logprobs"),
    (lambda g: g.samples[0].logprobs.__setitem__(1, 0.5),
     r"group.samples\[0\].logprobs\[1\]: expected a log-probability \(<= 0\), got 0.5"),
    (lambda g: setattr(g.samples[0], "teacher_logprobs_f32", np.array([-1, 2], "<f4").tobytes()),
     r"teacher_logprobs_f32: expected 2 finite float32 log-probabilities <= 0"),
    (lambda g: (setattr(g.samples[0], "teacher_topk_ids", np.array([1, 2], "<i4").tobytes()),
                setattr(g.samples[0], "teacher_topk_logprobs_f32",
                        np.array([-1, 3], "<f4").tobytes())),
     r"teacher_topk_ids: expected ids >= 0 and finite log-probs <= 0"),
    (lambda g: setattr(g, "prompt_id", ""), "group.prompt_id"),
    (lambda g: setattr(g.samples[0], "observed", b"\x01"),
     r"group.samples\[0\].observed: expected one byte 0 or 1 per token \(2\), got 1 bytes"),
    (lambda g: setattr(g.samples[0], "observed", b"\x01\x02"),
     "observed: .* got 2 bytes holding other values"),
])
def test_bad_groups_are_rejected_naming_the_field(queues, mutate, field):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  g = group("a")
  mutate(g)
  with pytest.raises(errors.InvalidArgument, match=field) as info:
    queues.submit(lease.lease_id, "w1", g)
  assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
  assert queues.depths()["rollouts_ready"] == 0 and queues.depths()["prompts_leased"] == 1


def test_log_probs_rounded_just_above_0_are_accepted(queues):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  g = group("a")
  g.samples[0].logprobs[0] = 1e-5  # float rounding of a log-prob of 0 (a certain token)
  assert queues.submit(lease.lease_id, "w1", g).rollout_id >= 0
  assert queues.depths()["rollouts_ready"] == 1


@pytest.mark.parametrize("call, field", [
    (lambda q: q.lease("", 1, 1.0), "worker_id"),
    (lambda q: q.lease("w", 0, 1.0), "n"),
    (lambda q: q.lease("w", 1, -1.0), "deadline_s"),
    (lambda q: q.lease("w", 1, 1.0, wait_s=1e9), "wait_s"),
    (lambda q: q.enqueue([pb.Prompt(id="x")]), "prompts\\[0\\]"),
    (lambda q: q.enqueue(prompts("x", "x")), "prompts\\[1\\].id"),
    (lambda q: q.take(-1, 1, 0.0, 1.0), "min_version"),
    (lambda q: q.take(0, 0, 0.0, 1.0), "max_groups"),
    (lambda q: q.ack(""), "take_id"),
])
def test_bad_requests_name_the_field_and_change_nothing(queues, call, field):
  queues.enqueue(prompts("a"))
  before = queues.depths()
  with pytest.raises(errors.RequestError, match=field):
    call(queues)
  assert queues.depths() == before


def test_release_returns_unanswered_prompts_and_is_idempotent(queues):
  queues.enqueue(prompts("a", "b"))
  lease = queues.lease("w1", 2, 10.0)
  queues.submit(lease.lease_id, "w1", group("a"))
  with pytest.raises(errors.FailedPrecondition, match="no accepted rollout"):
    queues.complete(lease.lease_id, "w1")
  assert queues.release(lease.lease_id, "w1", []) == 1
  assert queues.release(lease.lease_id, "w1", ["b"]) == 0
  assert [p.id for p in queues.lease("w2", 5, 10.0).prompts] == ["b"]


def test_a_group_for_a_prompt_its_lease_released_is_refused_and_the_prompt_stays_queued(queues):
  """Accepted, the released prompt was answered while queued: the next lease of it failed (or
  a second worker answered it too)."""
  queues.enqueue(prompts("a", "b"))
  lease = queues.lease("w1", 2, 10.0)
  assert queues.release(lease.lease_id, "w1", ["a"]) == 1
  with pytest.raises(errors.FailedPrecondition, match="released"):
    queues.submit(lease.lease_id, "w1", group("a"))
  assert [p.id for p in queues.lease("w2", 5, 10.0).prompts] == ["a"]

def test_a_release_of_an_expired_lease_returns_nothing_and_fails_nothing(queues, clock):
  """Its prompts went back at the deadline: a worker releasing them as it stops hears 0
  (it was a log record failing to apply, an internal error, and the log rewritten)."""
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 5.0)
  clock.t += 6.0
  assert queues.release(lease.lease_id, "w1", []) == 0
  assert [p.id for p in queues.lease("w2", 5, 10.0).prompts] == ["a"]

def test_take_then_ack_removes_rollouts(queues):
  queues.enqueue(prompts("a", "b"))
  lease = queues.lease("w1", 2, 10.0)
  queues.submit(lease.lease_id, "w1", group("a"))
  queues.submit(lease.lease_id, "w1", group("b"))
  take = queues.take(0, 10, 0.0, 30.0)
  assert [r.prompt.id for r in take.rollouts] == ["a", "b"]
  assert queues.take(0, 10, 0.0, 30.0).rollouts == []
  assert queues.ack(take.take_id) == 2
  assert queues.ack(take.take_id) == 2  # a retried ack is acknowledged again
  assert queues.depths()["rollouts_in_flight"] == 0


def test_unacked_take_is_redelivered_after_its_deadline(queues, clock):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  queues.submit(lease.lease_id, "w1", group("a"))
  take = queues.take(0, 10, 0.0, 5.0)
  clock.t += 6.0
  again = queues.take(0, 10, 0.0, 5.0)
  assert [r.rollout_id for r in again.rollouts] == [r.rollout_id for r in take.rollouts]
  with pytest.raises(errors.NotFound, match="take_id"):
    queues.ack(take.take_id)


def test_duplicate_submissions_are_counted_since_this_start_whatever_a_snapshot_held(
    tmp_path, clock):
  """A retried submission is answered from state and logged nowhere: its count is this
  process's, as bytes served are; a snapshot taken between must not bring back part of it."""
  q = make_queues(tmp_path, clock)
  q.enqueue(prompts("a"))
  lease = q.lease("w1", 1, 10.0)
  for _ in range(3):
    q.submit(lease.lease_id, "w1", group("a"))
    if not q.counters["rollouts_duplicate"]:
      q._wal.rewrite(q._snapshot())  # (after the first submission, before any retry)
  assert q.counters["rollouts_duplicate"] == 2
  q._wal.rewrite(q._snapshot())
  q.submit(lease.lease_id, "w1", group("a"))
  q.close()
  q = make_queues(tmp_path, clock)
  assert q.counters["rollouts_duplicate"] == 0 and q.counters["rollouts_accepted"] == 1
  assert q.submit(lease.lease_id, "w1", group("a")).duplicate
  assert q.counters["rollouts_duplicate"] == 1
  q.close()


def test_requeued_takes_are_counted_and_the_count_survives_a_restart(tmp_path, clock):
  """One take past its ack deadline, one given back by a restarted trainer: two requeued,
  counted again from the log and kept by a snapshot."""
  q = make_queues(tmp_path, clock)
  q.enqueue(prompts("a", "b"))
  lease = q.lease("w1", 2, 10.0)
  q.submit(lease.lease_id, "w1", group("a"))
  q.submit(lease.lease_id, "w1", group("b"))
  q.take(0, 1, 0.0, 5.0)
  clock.t += 6.0
  q.take(0, 2, 0.0, 30.0)  # the first take's deadline passed: it goes back first
  assert len(q.take(0, 2, 0.0, 30.0, requeue_unacked=True).rollouts) == 2
  assert q.depths()["takes_requeued"] == 2
  q.close()
  q = make_queues(tmp_path, clock)  # the write-ahead log replayed
  assert q.depths()["takes_requeued"] == 2
  q._wal.rewrite(q._snapshot())
  q.close()
  q = make_queues(tmp_path, clock)  # the snapshot loaded
  assert q.depths()["takes_requeued"] == 2
  q.close()


def test_stale_rollouts_are_dropped_and_their_prompts_requeued(queues):
  queues.enqueue(prompts("a", "b"))
  lease = queues.lease("w1", 2, 10.0)
  queues.submit(lease.lease_id, "w1", group("a", version=1))
  queues.submit(lease.lease_id, "w1", group("b", version=4))
  take = queues.take(3, 10, 0.0, 5.0)
  assert [r.prompt.id for r in take.rollouts] == ["b"] and take.dropped_stale == 1
  assert [p.id for p in queues.lease("w2", 5, 10.0).prompts] == ["a"]


def test_stale_prompts_go_back_in_submission_order_after_a_take_was_requeued(queues, clock):
  """A requeued take's groups rejoin the ready ones in rollout order: dropped as stale, the
  prompts return to the queue in the order they were answered, as from a restarted server
  (whose snapshot lists rollouts by id), not with the requeued ones last."""
  queues.enqueue(prompts("a", "b"))
  lease = queues.lease("w1", 2, 10.0)
  queues.submit(lease.lease_id, "w1", group("a", version=1))
  queues.submit(lease.lease_id, "w1", group("b", version=1))
  assert [r.prompt.id for r in queues.take(0, 1, 0.0, 5.0).rollouts] == ["a"]
  clock.t += 6.0
  assert queues.expire_due() == 1  # "a"'s take requeued
  assert queues.take(3, 10, 0.0, 5.0).dropped_stale == 2
  assert [p.id for p in queues.lease("w2", 5, 10.0).prompts] == ["a", "b"]

def test_a_prompt_enqueued_again_while_its_group_waits_is_never_in_two_places(tmp_path, clock):
  """Were the second enqueue queued, the stale drop would put "a" in the queue while a lease
  holds it: two groups for one prompt, the second failing mid-log and the log unreplayable."""
  q = make_queues(tmp_path, clock)
  q.enqueue(prompts("a"))
  first = q.lease("w1", 1, 10.0)
  q.submit(first.lease_id, "w1", group("a", version=1))
  assert q.enqueue(prompts("a")).duplicates == 1  # a retry: its group waits for the trainer
  assert q.take(3, 10, 0.0, 5.0).dropped_stale == 1  # "a" back in the queue, once
  again = q.lease("w2", 5, 10.0)
  assert [p.id for p in again.prompts] == ["a"] and not q.lease("w3", 5, 10.0).prompts
  q.submit(again.lease_id, "w2", group("a", version=4))
  before = _state(q)
  q.close()
  replayed = make_queues(tmp_path, clock)
  assert _state(replayed) == before
  replayed.close()


def test_a_record_that_fails_to_apply_leaves_a_log_the_server_starts_from(
    tmp_path, clock, monkeypatch):
  # Logged, then failing in _apply (a bug, half applied): replayed, it would fail again and
  # the server could not start. The log is rewritten as the state held at the failure.
  q = make_queues(tmp_path, clock)
  q.enqueue(prompts("a", "b"))
  apply = q._apply

  def half_then_fail(record, joined=None):
    if record.WhichOneof("op") == "lease":
      del q.queue[record.lease.prompt_ids[0]]
      raise KeyError("no such prompt")
    apply(record, joined)

  monkeypatch.setattr(q, "_apply", half_then_fail)
  with pytest.raises(KeyError):
    q.lease("w1", 1, 10.0)
  monkeypatch.setattr(q, "_apply", apply)
  q.enqueue(prompts("c"))  # the server goes on, and logs on top of the rewritten log
  before = _state(q)
  q.close()
  replayed = make_queues(tmp_path, clock)
  assert _state(replayed) == before and list(replayed.queue) == ["b", "c"]
  replayed.close()


def _state(q):
  return (list(q.queue), sorted((l.lease_id, tuple(l.open_ids), l.deadline) for l in q.leases.values()),
          list(q.ready), sorted(q.in_flight), sorted(q.takes), q.next_rollout_id, q.depths())


def _busy_history(q, clock):
  q.enqueue(prompts(*"abcdefgh"))
  l1 = q.lease("w1", 3, 10.0)
  l2 = q.lease("w2", 3, 2.0)
  q.submit(l1.lease_id, "w1", group("a"))
  q.release(l1.lease_id, "w1", ["b"])
  q.renew(l1.lease_id, "w1", 20.0)
  clock.t += 3.0
  q.expire_due()
  take = q.take(0, 1, 0.0, 100.0)
  l3 = q.lease("w3", 2, 50.0)
  q.submit(l3.lease_id, "w3", group(l3.prompts[0].id))
  return take, l2


def test_restart_replays_the_log_to_the_same_state(tmp_path, clock):
  q = make_queues(tmp_path, clock)
  _busy_history(q, clock)
  before = _state(q)
  q.close()
  again = make_queues(tmp_path, clock)
  assert _state(again) == before
  again.close()


def test_snapshot_rewrite_keeps_the_state_and_shrinks_the_log(tmp_path, clock):
  # (compacted in the call that makes it due: in the background, the records logged while a
  # snapshot is written follow it, and how many is a matter of timing)
  q = make_queues(tmp_path, clock, wal_compact_records=4, compact_in_background=False)
  take, expired_lease = _busy_history(q, clock)
  before = _state(q)
  q.close()
  again = make_queues(tmp_path, clock, wal_compact_records=4, compact_in_background=False)
  assert _state(again) == before
  assert again.ack(take.take_id) == 1
  with pytest.raises(errors.FailedPrecondition, match="expired"):
    again.renew(expired_lease.lease_id, "w2", 5.0)
  assert len(again._wal.recovered) == 0 and again._wal.records_since_rewrite < 4 + 2
  again._wal.rewrite(again._snapshot())  # the ack in a snapshot
  again.close()
  third = make_queues(tmp_path, clock)
  assert third.ack(take.take_id) == 1  # a retried ack's answer: the groups it acknowledged
  third.close()


def test_the_log_is_compacted_beside_the_calls_and_keeps_what_they_logged_meanwhile(
    tmp_path, clock, monkeypatch):
  """The snapshot is written outside the lock (seconds for a large backlog of groups, every
  call stalled): calls go on meanwhile, and their records follow it in the new log."""
  import threading
  q = make_queues(tmp_path, clock, wal_compact_records=3)
  go_on, writing = threading.Event(), threading.Event()
  snapshot = q._snapshot

  def slow_snapshot(state=None):
    writing.set()
    assert go_on.wait(30.0)
    yield from snapshot(state)

  monkeypatch.setattr(q, "_snapshot", slow_snapshot)
  q.enqueue(prompts("a", "b"))
  q.enqueue(prompts("c"))
  lease = q.lease("w1", 2, 10.0)  # the third record: the compaction starts
  assert writing.wait(10.0)
  q.submit(lease.lease_id, "w1", group("a"))  # answered while the snapshot is written
  q.enqueue(prompts("d"))
  assert q._compaction is not None and q._wal.records_since_rewrite == 5
  go_on.set()
  q.wait_compacted()
  records, _, _ = read_records(os.path.join(tmp_path, "q.wal"))
  assert [r.WhichOneof("op") for r in records] == ["snapshot", "submit", "enqueue"]
  before = _state(q)
  q.close()
  again = make_queues(tmp_path, clock)
  assert _state(again) == before and list(again.queue) == ["c", "d"] and list(again.ready)
  again.close()


def test_a_snapshot_past_one_records_size_is_split_and_replays_whole(tmp_path, clock):
  """One protobuf message holds < 2 GiB: a larger backlog's snapshot is several records."""
  q = make_queues(tmp_path, clock, wal_snapshot_record_bytes=200)
  take, _ = _busy_history(q, clock)
  before = _state(q)
  q._wal.rewrite(q._snapshot())
  q.close()
  records, _, _ = read_records(os.path.join(tmp_path, "q.wal"))
  assert len(records) > 3 and all(r.WhichOneof("op") == "snapshot" for r in records)
  assert [r.snapshot.continues for r in records] == [False] + [True] * (len(records) - 1)
  again = make_queues(tmp_path, clock)
  assert _state(again) == before
  assert again.ack(take.take_id) == 1
  again.close()


def test_renewals_carrying_begun_samples_keep_the_log_within_a_few_times_the_state(
    tmp_path, clock):
  """Each renewal's begun samples replace the last: the log is rewritten by size too, so it
  holds about the live state, not every checkpoint ever sent."""
  def checkpoints(where, **limits):
    where.mkdir()
    q = make_queues(where, clock, **limits)
    q.enqueue(prompts("a"))
    lease = q.lease("w1", 1, 10.0)
    sizes = []
    for n in range(1, 201):  # 200 checkpoints of a sample growing to 200 tokens
      q.renew(lease.lease_id, "w1", 10.0, [pb.PartialRollouts(prompt_id="a", samples=[
          pb.Sample(token_ids=list(range(n)), logprobs=[-0.5] * n)])])
      sizes.append(os.path.getsize(os.path.join(where, "q.wal")))
    q.close()
    return sizes

  floor = 16 << 10
  every = checkpoints(tmp_path / "all")  # what the log would hold without the size rule
  sizes = checkpoints(tmp_path / "compacted", wal_compact_bytes=floor,  # (in the call:
                      compact_in_background=False)  # sizes read right after each renewal)
  assert every[-1] > 6 * floor and max(sizes) < 2 * floor
  q = make_queues(tmp_path / "compacted", clock)
  clock.t += 11.0
  q.expire_due()
  (a,) = q.lease("w2", 1, 10.0).prompts
  assert list(a.partial[0].token_ids) == list(range(200))  # the last checkpoint
  q._wal.rewrite(q._snapshot())
  q.close()
  q = make_queues(tmp_path / "compacted", clock)  # the counts come back with the snapshot
  counts = q.depths()
  assert (counts["prompts_resumed"], counts["samples_resumed"], counts["tokens_resumed"]) == (
      1, 1, 200)
  q.close()


def test_a_call_that_logs_nothing_answers_only_once_all_logged_before_it_is_on_disk(
    queues, monkeypatch):
  """A retried submission (the first still in its fsync when the client gave up) is
  answered as a duplicate from state the first's record made: it waits for that record to
  be on disk too, or a power loss could take back what it acknowledged."""
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  synced = []
  sync = queues._wal.sync
  monkeypatch.setattr(queues._wal, "sync", lambda position: (synced.append(position),
                                                            sync(position))[1])
  queues.submit(lease.lease_id, "w1", group("a"))
  assert queues.submit(lease.lease_id, "w1", group("a")).duplicate
  assert queues.enqueue(prompts("a")).duplicates == 1  # (logs nothing either)
  assert len(synced) == 3 and synced[1] >= synced[0] > 0 and synced[2] >= synced[0]


def test_a_retried_release_with_partial_rollouts_is_answered_as_the_first(queues):
  """A worker's stop releases with its partial rollouts; the reply is lost and the client
  retries: the retry is harmless (0 released), not refused for partial rollouts of prompts
  it released already."""
  queues.enqueue(prompts("a", "b"))
  lease = queues.lease("w1", 2, 10.0)
  begun = [pb.PartialRollouts(prompt_id="a", samples=[pb.Sample(token_ids=[4],
                                                                logprobs=[-0.5])])]
  assert queues.release(lease.lease_id, "w1", [], begun) == 2
  assert queues.release(lease.lease_id, "w1", [], begun) == 0
  assert list(queues.lease("w2", 2, 10.0).prompts[0].partial) == list(begun[0].samples)


def test_an_ack_past_its_deadline_before_the_reaper_ran_still_acks(tmp_path, clock):
  """The take was still held (no reaper tick since its deadline): the ack expired it first
  and answered NotFound, and its trained groups came back to the queue."""
  q = make_queues(tmp_path, clock)
  q.enqueue(prompts("a"))
  lease = q.lease("w1", 1, 60.0)
  q.submit(lease.lease_id, "w1", group("a"))
  take = q.take(0, 1, 0.0, 10.0)
  clock.t += 11.0
  assert q.ack(take.take_id) == 1
  q.expire_due()
  assert q.depths()["rollouts_ready"] == 0 and q.depths()["takes_requeued"] == 0
  q.close()


def test_a_lease_reply_holds_about_max_bytes_of_prompts_and_one_at_least(tmp_path, clock):
  """Prompts carrying large partial samples: a lease of all of them made a reply past the
  server's send limit, which failed, its prompts leased to no worker until the deadline,
  and again at every later lease."""
  q = make_queues(tmp_path, clock)
  big = [pb.Prompt(id=f"b{i}", text="x" * 5000, token_ids=[1], task="t") for i in range(3)]
  q.enqueue(big)
  first = q.lease("w1", 3, 10.0, max_bytes=8000)
  assert [p.id for p in first.prompts] == ["b0"]
  assert [p.id for p in q.lease("w1", 3, 10.0, max_bytes=100).prompts] == ["b1"]  # one at least
  assert [p.id for p in q.lease("w1", 3, 10.0).prompts] == ["b2"]
  q.close()


def test_a_failed_compaction_leaves_the_change_done_and_said_done(tmp_path, clock,
                                                                  monkeypatch):
  """Compacting the log (a snapshot written over it) fails, a full disk: the change whose
  record was logged and applied returns as done (a retry would lease or take again), later
  changes do not try again at once, and a restart replays the log that grew on."""
  q = make_queues(tmp_path, clock, wal_compact_records=3, compact_in_background=False)
  tries = []

  def full_disk(records, since=None):
    tries.append(list(records))
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(q._wal, "rewrite", full_disk)
  q.enqueue(prompts("a"))
  q.enqueue(prompts("b"))
  lease = q.lease("w1", 2, 10.0)  # the third record: compaction fails here
  assert [p.id for p in lease.prompts] == ["a", "b"] and len(tries) == 1
  q.enqueue(prompts("c"))
  assert len(tries) == 1  # not again at the next record
  q.close()
  q = make_queues(tmp_path, clock)
  assert q.depths()["prompts_queued"] == 1 and q.depths()["prompts_leased"] == 2
  q.close()


def test_a_prompt_released_with_partial_rollouts_carries_them_across_a_restart(
    tmp_path, clock):
  q = make_queues(tmp_path, clock)
  q.enqueue(prompts("a", "b"))
  lease = q.lease("w1", 2, 10.0)
  begun = [pb.Sample(token_ids=[4, 5], logprobs=[-0.5, -0.25]),
           pb.Sample(token_ids=[6], logprobs=[-1.0], finish_reason="stop")]
  routed = [pb.Sample(token_ids=[4, 5], routes=pb.Routes(ids=b"\x01\x02", layers=1, top_k=2,
                                                         id_bytes=1))]  # no prompt routes
  assert q.release(lease.lease_id, "w1", [], [pb.PartialRollouts(
      prompt_id="b", samples=begun, policy_version=2), pb.PartialRollouts(
      prompt_id="a", samples=routed)]) == 2
  assert not lease.prompts[1].partial  # the lease's reply is not changed under it
  q.close()
  q = make_queues(tmp_path, clock)  # the write-ahead log replayed
  again = q.lease("w2", 2, 10.0)
  a, b = again.prompts
  assert list(a.partial) == routed and list(b.partial) == begun and b.partial_version == 2
  # A later release without partial rollouts keeps the ones it has.
  q.release(again.lease_id, "w2", ["b"])
  assert list(q.lease("w3", 1, 10.0).prompts[0].partial) == begun
  q.close()


def test_samples_sent_with_a_renewal_go_back_with_the_prompts_of_an_expired_lease(
    tmp_path, clock):
  """A worker killed without notice: its last renewal's begun samples are what the next
  worker gets, across a server restart; a prompt answered or released meanwhile keeps none."""
  q = make_queues(tmp_path, clock)
  q.enqueue(prompts("a", "b", "c"))
  lease = q.lease("w1", 3, 10.0)
  first = [pb.Sample(token_ids=[4], logprobs=[-0.5])]
  later = [pb.Sample(token_ids=[4, 5], logprobs=[-0.5, -0.25]),
           pb.Sample(token_ids=[6], logprobs=[-1.0], finish_reason="stop")]
  q.renew(lease.lease_id, "w1", 10.0, [pb.PartialRollouts(prompt_id="a", samples=first,
                                                          policy_version=3)])
  q.submit(lease.lease_id, "w1", group("b"))
  q.release(lease.lease_id, "w1", ["c"])
  renewed = q.renew(lease.lease_id, "w1", 10.0, [
      pb.PartialRollouts(prompt_id="a", samples=later, policy_version=2),
      pb.PartialRollouts(prompt_id="b", samples=first),  # answered since: passed over
      pb.PartialRollouts(prompt_id="c", samples=first)])  # released since: passed over
  assert [p.id for p in renewed.prompts] == ["a"] and not renewed.prompts[0].partial
  assert not q.lease("w2", 1, 10.0).prompts[0].partial  # c, leased again as it was
  q.close()
  q = make_queues(tmp_path, clock)  # the write-ahead log replayed
  clock.t += 11.0
  assert q.expire_due() == 2  # both leases
  again = {p.id: p for p in q.lease("w3", 2, 10.0).prompts}
  assert list(again["a"].partial) == later and again["a"].partial_version == 2
  assert not again["c"].partial
  counts = q.depths()
  assert (counts["prompts_resumed"], counts["samples_resumed"], counts["tokens_resumed"]) == (
      1, 2, 3)
  q.close()


@pytest.mark.parametrize("partial,field", [
    (pb.PartialRollouts(prompt_id="z", samples=[pb.Sample(token_ids=[1])]),
     "partial[0].prompt_id"),
    (pb.PartialRollouts(prompt_id="a", samples=[pb.Sample(token_ids=[1], logprobs=[])],
                        policy_version=9), "partial[0].policy_version"),
])
def test_bad_partial_rollouts_with_a_renewal_are_refused_and_keep_the_lease(
    queues, clock, partial, field):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 5.0)
  with pytest.raises(errors.InvalidArgument, match=field.replace("[", r"\[").replace("]", r"\]")):
    queues.renew(lease.lease_id, "w1", 5.0, [partial])
  clock.t += 6.0  # the refused renewal extended nothing, and held no samples
  assert queues.expire_due() == 1
  assert not queues.lease("w2", 1, 5.0).prompts[0].partial


@pytest.mark.parametrize("partial,field,code", [
    (pb.PartialRollouts(prompt_id="z", samples=[pb.Sample(token_ids=[1])]),
     "partial[0].prompt_id", errors.InvalidArgument),
    (pb.PartialRollouts(prompt_id="a", samples=[pb.Sample(token_ids=[1, 2], logprobs=[-1.0])]),
     "partial[0].samples[0].logprobs", errors.InvalidArgument),
    (pb.PartialRollouts(prompt_id="a", samples=[pb.Sample(token_ids=[1])], policy_version=9),
     "partial[0].policy_version", errors.InvalidArgument),
    (pb.PartialRollouts(prompt_id="a", samples=[  # routing replay: routes for every sample
        pb.Sample(token_ids=[1, 2], routes=pb.Routes(ids=b"\x01\x02", layers=1, top_k=2,
                                                      id_bytes=1)),
        pb.Sample(token_ids=[3])]), "partial[0].samples[1].routes", errors.InvalidArgument),
])
def test_bad_partial_rollouts_are_refused_naming_the_field_and_release_nothing(
    queues, partial, field, code):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  with pytest.raises(code, match=field.replace("[", r"\[").replace("]", r"\]")):
    queues.release(lease.lease_id, "w1", ["a"], [partial])
  assert queues.depths()["prompts_queued"] == 0  # still leased: nothing was lost
  assert queues.release(lease.lease_id, "w1", ["a"]) == 1


def test_an_answered_prompt_drops_its_partial_rollouts_so_a_stale_group_starts_afresh(queues):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  queues.release(lease.lease_id, "w1", ["a"], [pb.PartialRollouts(
      prompt_id="a", samples=[pb.Sample(token_ids=[4], logprobs=[-0.5])], policy_version=1)])
  again = queues.lease("w2", 1, 10.0)
  assert again.prompts[0].partial
  queues.submit(again.lease_id, "w2", group("a", version=1))
  taken = queues.take(min_version=4, max_groups=1, wait_s=0.0, ack_deadline_s=10.0)
  assert not taken.rollouts  # too stale: dropped, its prompt queued again
  fresh = queues.lease("w3", 1, 10.0).prompts[0]
  assert fresh.id == "a" and not fresh.partial and fresh.partial_version == 0


def _routes(rows, width=1):
  return make_routes(np.asarray(rows, np.int32).reshape(-1, 1, 2)) if width == 1 else pb.Routes(
      ids=np.asarray(rows, "<u2").tobytes(), layers=1, top_k=2, id_bytes=2)


def _as_arrays(sample):
  observed = sample_observed(sample)
  return (list(sample.token_ids), sample_logprobs(sample).tolist(),
          None if observed is None else observed.tolist(), routes_of(sample.routes).tolist(),
          sample.finish_reason)


def test_incremental_checkpoints_join_to_the_whole_samples_across_a_restart(tmp_path, clock):
  """A renewal may send only each sample's tokens past those the server holds (`kept`);
  the next worker gets the samples whole, as had they been sent whole, after a restart."""
  q = make_queues(tmp_path, clock)
  q.enqueue(prompts("a"))
  lease = q.lease("w1", 1, 10.0)
  renew = lambda *parts: q.renew(lease.lease_id, "w1", 10.0, list(parts))  # noqa: E731
  renew(pb.PartialRollouts(prompt_id="a", policy_version=3, samples=[pb.Sample(
      token_ids=[4, 5, 6], logprobs=[-1.0, -2.0, -3.0], observed=b"\x00\x01\x00",
      routes=_routes([[1, 2], [3, 4]]))]))
  renew(pb.PartialRollouts(prompt_id="a", policy_version=3, kept=[3, 0], samples=[
      make_sample([7, 8], 0.0, logprobs=[-4.0, -5.0], routes=np.asarray(
          [[[5, 6]], [[7, 8]]])),  # the rows of tokens 6 and 7
      make_sample([9], 0.0, logprobs=[-1.0], routes=np.zeros((0, 1, 2)))]))
  # Sample 0 keeps two tokens (a reply the worker had not fed whole is left out) and goes
  # on, its new routes two bytes wide; sample 1 ends with no new token.
  renew(pb.PartialRollouts(prompt_id="a", policy_version=2, kept=[2, 1], samples=[
      pb.Sample(token_ids=[6, 10], logprobs_f32=np.asarray([-3.0, -6.0], "<f4").tobytes(),
                routes=_routes([[3, 4], [300, 1]], width=2), metadata={"replies": "[]"}),
      make_sample([], 0.0, logprobs=[], finish_reason="stop", routes=np.zeros((0, 1, 2)))]))
  q.close()
  q = make_queues(tmp_path, clock)  # the write-ahead log replayed
  clock.t += 11.0
  q.expire_due()
  (a,) = q.lease("w2", 1, 10.0).prompts
  assert a.partial_version == 2 and a.partial[0].metadata["replies"] == "[]"
  assert [_as_arrays(s) for s in a.partial] == [
      ([4, 5, 6, 10], [-1.0, -2.0, -3.0, -6.0], [False, True, False, False],
       [[[1, 2]], [[3, 4]], [[300, 1]]], ""),
      ([9], [-1.0], None, [], "stop")]
  q.close()


def test_an_increment_of_log_prob_bytes_not_whole_floats_is_named(queues):
  """np.frombuffer raised first: the worker got UNKNOWN and a traceback, not the field."""
  from param_server import errors
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 10.0)
  queues.renew(lease.lease_id, "w1", 10.0, [pb.PartialRollouts(prompt_id="a", samples=[
      pb.Sample(token_ids=[4, 5], logprobs=[-1.0, -2.0])])])
  with pytest.raises(errors.InvalidArgument,
                     match=r"partial\[0\].samples\[0\].logprobs_f32: expected 4 bytes a "
                           r"log-prob, got 3 bytes"):
    queues.renew(lease.lease_id, "w1", 10.0, [pb.PartialRollouts(prompt_id="a", kept=[2], samples=[
        pb.Sample(token_ids=[3], logprobs_f32=b"\0\0\0")])])


def test_incremental_checkpoints_grow_the_log_by_what_is_new(tmp_path, clock):
  """40 checkpoints of a sample growing 25 tokens each: whole, the log holds every prefix
  (quadratic in the length); as increments, each token once."""
  def log_bytes(where, incremental):
    where.mkdir()
    q = make_queues(where, clock)
    q.enqueue(prompts("a"))
    lease = q.lease("w1", 1, 10.0)
    for n in range(25, 1001, 25):
      new = range(n - 25, n) if incremental else range(n)
      q.renew(lease.lease_id, "w1", 10.0, [pb.PartialRollouts(
          prompt_id="a", kept=[n - 25] if incremental else [],
          samples=[make_sample(list(new), 0.0, logprobs=[-0.5] * len(new))])])
    clock.t += 11.0
    q.expire_due()
    (a,) = q.lease("w2", 1, 10.0).prompts
    assert list(a.partial[0].token_ids) == list(range(1000))
    q.close()
    return os.path.getsize(os.path.join(where, "q.wal"))

  whole, increments = log_bytes(tmp_path / "whole", False), log_bytes(tmp_path / "inc", True)
  assert whole > 10 * increments


def test_a_live_increment_is_joined_once_and_held_as_replay_joins_it(tmp_path, clock,
                                                                    monkeypatch):
  # Validation joins an increment to check it whole; the record's apply holds that join
  # instead of making it again. Replaying the log joins it once more, to the same samples.
  calls = []
  join = queues_lib.joined_partial
  monkeypatch.setattr(queues_lib, "joined_partial",
                      lambda *a, **k: calls.append(1) or join(*a, **k))
  q = make_queues(tmp_path, clock)
  q.enqueue(prompts("a", "b"))
  lease = q.lease("w1", 2, 10.0)
  first = [pb.PartialRollouts(prompt_id=p, samples=[make_sample([4, 5], 0.0,
                                                                logprobs=[-1.0, -2.0])])
           for p in "ab"]
  q.renew(lease.lease_id, "w1", 10.0, first)
  calls.clear()
  q.renew(lease.lease_id, "w1", 10.0, [pb.PartialRollouts(
      prompt_id="a", kept=[1], samples=[make_sample([6], 0.0, logprobs=[-3.0])])])
  q.release(lease.lease_id, "w1", ["b"], [pb.PartialRollouts(
      prompt_id="b", kept=[2], samples=[make_sample([7], 0.0, logprobs=[-4.0])])])
  assert len(calls) == 2  # one join for each increment
  held = lambda q: {p: [(list(s.token_ids), sample_logprobs(s).tolist())  # noqa: E731
                         for s in q.prompts[p].partial] for p in "ab"}
  live = held(q)
  assert live == {"a": [([4, 6], [-1.0, -3.0])], "b": [([4, 5, 7], [-1.0, -2.0, -4.0])]}
  q.close()
  q = make_queues(tmp_path, clock)  # replayed: the log's increments joined the same way
  assert held(q) == live
  q.close()


@pytest.mark.parametrize("part,field", [
    (pb.PartialRollouts(prompt_id="a", kept=[3], samples=[pb.Sample(token_ids=[7])]),
     "partial[0].kept[0]"),  # more than the 2 tokens held
    (pb.PartialRollouts(prompt_id="a", kept=[0, 0], samples=[pb.Sample(token_ids=[7])]),
     "partial[0].kept"),
    (pb.PartialRollouts(prompt_id="a", kept=[2], samples=[pb.Sample(token_ids=[7])]),
     "partial[0].samples[0].logprobs"),  # the held tokens have log-probs, the new none
    (pb.PartialRollouts(prompt_id="a", kept=[2], samples=[make_sample(
        [7], 0.0, logprobs=[-1.0], routes=np.zeros((1, 2, 2)))]),
     "partial[0].samples[0].routes"),  # the held sample's routes are 1 layer x top-2
    (pb.PartialRollouts(prompt_id="a", kept=[2], samples=[make_sample(
        [7, 8], 0.0, logprobs=[-1.0, -1.0], routes=np.zeros((1, 1, 2)))]),
     "partial[0].samples[0].routes"),  # 2 rows wanted: those of tokens 5 and 7
])
def test_bad_incremental_checkpoints_are_refused_naming_the_field(queues, clock, part, field):
  queues.enqueue(prompts("a"))
  lease = queues.lease("w1", 1, 5.0)
  held = pb.PartialRollouts(prompt_id="a", samples=[make_sample(
      [4, 5], 0.0, logprobs=[-0.5, -0.5], routes=np.ones((1, 1, 2)))])
  queues.renew(lease.lease_id, "w1", 5.0, [held])
  with pytest.raises(errors.InvalidArgument, match=field.replace("[", r"\[").replace("]", r"\]")):
    queues.renew(lease.lease_id, "w1", 5.0, [part])
  with pytest.raises(errors.InvalidArgument, match="at most once"):
    queues.renew(lease.lease_id, "w1", 5.0, [held, held])
  clock.t += 6.0  # refused: nothing extended, the samples held are the last accepted
  assert queues.expire_due() == 1
  assert list(queues.lease("w2", 1, 5.0).prompts[0].partial) == list(held.samples)


def test_increments_past_what_a_lease_carries_are_refused_and_the_prompt_stays_leasable(
    tmp_path, clock):
  """Each renewal under the request limit, the joined samples past what one lease reply
  carries: the prompt could never be handed out again (every lease reply failed, the prompt
  leased to no one at each deadline). The increment is refused, naming it, and the lease
  kept; a prompt an older server let grow so is leased without its begun samples."""
  q = make_queues(tmp_path, clock, max_prompt_bytes=1500)
  q.enqueue(prompts("a", "b"))
  lease = q.lease("w1", 2, 10.0)

  def piece(first, kept=()):
    return pb.PartialRollouts(prompt_id="a", policy_version=3, kept=list(kept), samples=[
        make_sample(list(range(first, first + 100)), 0.0, logprobs=[-0.5] * 100)])

  q.renew(lease.lease_id, "w1", 10.0, [piece(0)])
  q.renew(lease.lease_id, "w1", 10.0, [piece(100, kept=[100])])
  with pytest.raises(errors.ResourceExhausted,
                     match=r"partial\[0\]: prompt 'a' would hold \d+ bytes with these samples "
                           r"joined, more than the 1500 a lease can carry"):
    q.renew(lease.lease_id, "w1", 10.0, [piece(200, kept=[200])])
  with pytest.raises(errors.ResourceExhausted, match=r"partial\[0\]: prompt 'a'"):
    q.release(lease.lease_id, "w1", ["a"], [piece(200, kept=[200])])
  q.renew(lease.lease_id, "w1", 10.0)  # the lease is kept, with what the prompt held
  assert len(q.prompts["a"].partial[0].token_ids) == 200
  clock.t += 11.0
  q.expire_due()
  a, b = q.lease("w2", 2, 10.0).prompts
  assert len(a.partial[0].token_ids) == 200 and 1000 < a.ByteSize() <= 1500
  q.close()
  grown = make_queues(tmp_path, clock, max_prompt_bytes=1000)  # a lower limit on restart
  clock.t += 11.0
  grown.expire_due()
  a, b = grown.lease("w3", 2, 10.0).prompts
  assert a.id == "a" and not a.partial and a.token_ids == [1, 2, 3]
  assert len(grown.prompts["a"].partial[0].token_ids) == 200  # (held, as the log says)
  grown.close()
