"""The trainer's staleness floor (its latest take's min_version): the server remembers it and
names it in lease, renewal, submission and heartbeat replies, so that workers stop prompts
begun on an older policy; after a server restart it is 0 (no floor) until the trainer's next take."""

import os

import numpy as np

from param_server.client import make_sample
from param_server.protos import param_server_pb2 as pb
from param_server.queues import PromptRolloutQueues
from param_server.wal import WriteAheadLog
from ps_testlib import publish_chain


def group(prompt_id, version):
  return pb.RolloutGroup(prompt_id=prompt_id, policy_version=version, samples=[
      make_sample([7, 8], 1.0, logprobs=np.array([-0.1, -0.2]), finish_reason="stop")])


def test_the_floor_follows_the_latest_take_and_a_restart_forgets_it(tmp_path):
  path = os.path.join(tmp_path, "q.wal")
  q = PromptRolloutQueues(WriteAheadLog(path), latest_version=lambda: 5)
  assert q.staleness_floor == 0
  q.take(4, 1, 0.0, 30.0)
  assert q.staleness_floor == 4
  q.take(2, 1, 0.0, 30.0, requeue_unacked=True)  # a restarted trainer's floor may be lower
  assert q.staleness_floor == 2
  q.close()
  q = PromptRolloutQueues(WriteAheadLog(path), latest_version=lambda: 5)
  assert q.staleness_floor == 0
  q.close()


def test_lease_renewal_and_submission_replies_name_the_floor(trainer, worker):
  publish_chain(trainer, 4)
  trainer.enqueue_prompts([pb.Prompt(id=f"p{i}", text="q") for i in range(2)])
  assert worker.lease(1, deadline_s=30).staleness_floor == 0  # no take yet: no floor
  trainer.take_rollouts(min_version=2, max_n=1)
  lease = worker.lease(1, deadline_s=30)
  assert lease.staleness_floor == 2
  trainer.take_rollouts(min_version=3, max_n=1)
  assert worker.renew(lease, 30).staleness_floor == 3
  reply = worker.submit_rollouts(lease.lease_id, group(lease.prompts[0].id, 3))
  assert (reply.staleness_floor, reply.latest_version) == (3, 3)


def test_a_heartbeat_reply_names_the_floor(trainer, worker):
  """A worker decoding one long group makes no other call meanwhile: its heartbeat (a
  leaving one's too) is where it hears the floor rise."""
  publish_chain(trainer, 3)
  assert worker.heartbeat(version=0).staleness_floor == 0  # no take yet: no floor
  trainer.take_rollouts(min_version=2, max_n=1)
  reply = worker.heartbeat(version=0)
  assert (reply.latest_version, reply.staleness_floor) == (2, 2)
  assert worker.heartbeat(version=0, leaving=True).staleness_floor == 2


def test_a_group_submitted_under_the_floor_is_accepted_then_dropped_at_the_next_take(
    trainer, worker):
  """What the server does with a group a worker sends although the floor passed it."""
  publish_chain(trainer, 3)
  trainer.enqueue_prompts([pb.Prompt(id="p0", text="q")])
  lease = worker.lease(1, deadline_s=30)
  trainer.take_rollouts(min_version=2, max_n=1)
  reply = worker.submit_rollouts(lease.lease_id, group("p0", 1))
  assert reply.rollout_id and reply.staleness_floor == 2
  take = trainer.take_rollouts(min_version=2, max_n=1)
  assert (len(take.rollouts), take.dropped_stale) == (0, 1)
  assert [p.id for p in worker.lease(1, deadline_s=30).prompts] == ["p0"]  # queued again
