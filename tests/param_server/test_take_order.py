"""The order a take hands out ready groups: oldest policy version first, ties by submission."""

import os

import pytest

from param_server.protos import param_server_pb2 as pb
from param_server.queues import PromptRolloutQueues
from param_server.wal import WriteAheadLog


def make_queues(tmp_path, latest=5):
  return PromptRolloutQueues(WriteAheadLog(os.path.join(tmp_path, "q.wal")),
                             clock=lambda: 1000.0, latest_version=lambda: latest)


def submitted(q, versions):
  """One prompt per version, its group made by that version, submitted in the order given."""
  ids = [f"p{i}" for i in range(len(versions))]
  q.enqueue([pb.Prompt(id=i, text=f"question {i}") for i in ids])
  lease = q.lease("w1", len(ids), 60.0)
  for pid, v in zip(ids, versions):
    q.submit(lease.lease_id, "w1", pb.RolloutGroup(prompt_id=pid, policy_version=v, samples=[
        pb.Sample(token_ids=[4, 5], reward=1.0)]))
  return ids


@pytest.fixture
def queues(tmp_path):
  q = make_queues(tmp_path)
  yield q
  q.close()


def test_take_hands_out_the_oldest_policy_version_first(queues):
  submitted(queues, [3, 1, 2, 1])
  order = [queues.take(0, 1, 0.0, 30.0).rollouts[0] for _ in range(4)]
  assert [(r.group.policy_version, r.rollout_id) for r in order] == [(1, 2), (1, 4), (2, 3), (3, 1)]


def test_a_group_behind_newer_ones_is_taken_before_the_floor_drops_it(queues):
  """Submitted last but sampled by the oldest policy: taken in the first take, not dropped
  when the trainer's staleness floor rises past it."""
  submitted(queues, [3, 3, 1])
  first = queues.take(1, 2, 0.0, 30.0)
  second = queues.take(2, 2, 0.0, 30.0)
  assert [r.prompt.id for r in first.rollouts] == ["p2", "p0"]
  assert [r.prompt.id for r in second.rollouts] == ["p1"]
  assert first.dropped_stale + second.dropped_stale == 0


def test_the_max_bytes_cut_follows_the_version_order(queues):
  submitted(queues, [2, 1, 1])
  one = queues.take(0, 3, 0.0, 30.0, max_bytes=1).rollouts
  assert [r.prompt.id for r in one] == ["p1"]  # the first group always goes, whatever its size


def test_a_replayed_log_and_a_snapshot_hold_what_the_version_ordered_takes_left(tmp_path):
  q = make_queues(tmp_path)
  submitted(q, [4, 2, 3, 1, 2])
  taken = q.take(0, 2, 0.0, 30.0)
  q.ack(taken.take_id)
  q.take(0, 1, 0.0, 30.0)
  state = (list(q.ready), sorted(q.in_flight), sorted(q.takes.items()))
  q.close()
  q = make_queues(tmp_path)
  assert (list(q.ready), sorted(q.in_flight), sorted(q.takes.items())) == state
  q._wal.rewrite(q._snapshot())
  q.close()
  q = make_queues(tmp_path)
  assert (list(q.ready), sorted(q.in_flight), sorted(q.takes.items())) == state
  assert [r.group.policy_version for r in q.take(0, 5, 0.0, 30.0).rollouts] == [3, 4]
  q.close()
