"""The trainer's prompt pacing: how many prompts it keeps queued or in flight while it takes a
step's groups, against a fake server whose groups come one per take."""

import pytest

from param_server.client import Take, make_sample
from param_server.protos import param_server_pb2 as pb
from rl_testlib import rl_config
from rlax_ps.train.rl import RLTrainer


class OneGroupPerTake:
  """A server that answers each take with one group of the oldest prompt not answered yet,
  and records how many prompts were outstanding (fed, not yet taken) at each take."""

  def __init__(self):
    self.fed, self.taken, self.outstanding = [], 0, []

  def enqueue_prompts(self, prompts):
    self.fed.extend(prompts)

  def version_info(self):
    return pb.VersionInfo()

  def take_rollouts(self, min_version, max_n, **kwargs):
    self.outstanding.append(len(self.fed) - self.taken)
    assert len(self.outstanding) <= 20, "the step took too many groups"
    prompt = self.fed[self.taken]
    self.taken += 1
    group = pb.RolloutGroup(prompt_id=prompt.id, policy_version=min_version,
                            samples=[make_sample([5, 6], float(j % 2), logprobs=[-1.0, -1.0]) for j in range(4)])
    return Take(f"t{self.taken}", [pb.TakenRollout(rollout_id=self.taken, prompt=prompt,
                                                   group=group)], 0)


def _take_a_step(tmp_path, staleness):
  config = rl_config("tiny")
  config.rl.max_staleness = staleness
  server = OneGroupPerTake()
  with RLTrainer(config, str(tmp_path), server) as tr:
    groups = tr._take_groups()
  assert tr.rejected == 0, tr.last_rejection
  return tr.shape.groups, groups, server


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_step_keeps_its_own_groups_and_max_staleness_steps_more_in_flight(tmp_path, staleness):
  per_step, groups, server = _take_a_step(tmp_path, staleness)
  assert len(groups) == per_step
  # Before each take: the groups the step still needs, and max_staleness steps' more, so
  # workers sample the next steps' groups while this one waits and trains; synchronous
  # (0): no prompt beyond the step's own, which would be sampled too stale to train on.
  assert server.outstanding == [per_step - i + per_step * staleness for i in range(per_step)]
  assert len(server.fed) == per_step * (1 + staleness)
