"""What the RL trainer keeps per step stays bounded over a long run."""

import json
import types

import pytest

from rlax_ps.train.events import NoEvents
from rlax_ps.train.publisher import Publication
from rlax_ps.train.rl import RLTrainer, sync_summary


class _Publisher:
  def publish(self, params, version, keyframe=False):
    del params
    return Publication(version, keyframe, bytes=100, seconds=0.01, digest=version)


@pytest.mark.parametrize("leader", [True, False])
def test_publications_go_to_versions_jsonl_not_to_memory(tmp_path, leader):
  """The leader's publications go to versions.jsonl; a follower of a multi-host slice kept
  them in a list that grew by one a version for the whole run."""
  trainer = types.SimpleNamespace(publisher=_Publisher(), state=types.SimpleNamespace(params={}),
                                  leader=leader, workdir=str(tmp_path), step=0,
                                  writer=NoEvents())
  for version in range(200):
    RLTrainer._publish(trainer, version, keyframe=version == 0)
  assert set(vars(trainer)) == {"publisher", "state", "leader", "workdir", "step", "writer",
                                "_published_step"}  # nothing kept per version
  if leader:
    with open(tmp_path / "versions.jsonl") as f:
      assert [json.loads(line)["version"] for line in f] == list(range(200))
  else:
    assert not (tmp_path / "versions.jsonl").exists()


def test_a_scheduled_keyframe_counts_its_delta_as_a_delta_and_itself_as_the_keyframe():
  """A scheduled version goes as a delta with a keyframe beside it: the keyframe's bytes were
  added to the delta's and the version counted as a keyframe (keyframe_bytes off, every K-th
  delta missing from the delta figures)."""
  log = [(0, 1000, 0.5, True, 0), (1, 10, 0.1, False, 0), (2, 30, 0.3, False, 900)]
  got = sync_summary("bf16", log)
  assert got["versions"] == 3 and got["keyframe_bytes"] == 900
  assert got["delta_bytes_mean"] == 20.0 and got["delta_seconds_median"] == 0.2
  assert sync_summary("bf16", log[:2])["keyframe_bytes"] == 1000
