"""What the RL trainer keeps per step stays bounded over a long run."""

import json
import types

from rlax_ps.train.events import NoEvents
from rlax_ps.train.publisher import Publication
from rlax_ps.train.rl import RLTrainer, sync_summary


class _Publisher:
  def publish(self, params, version, keyframe=False):
    del params
    return Publication(version, keyframe, bytes=100, seconds=0.01, digest=version)


def test_the_leader_keeps_its_publications_in_versions_jsonl_not_in_memory(tmp_path):
  trainer = types.SimpleNamespace(publisher=_Publisher(), state=types.SimpleNamespace(params={}),
                                  leader=True, workdir=str(tmp_path), step=0, sync_log=[],
                                  writer=NoEvents())
  for version in range(200):
    RLTrainer._publish(trainer, version, keyframe=version == 0)
  assert trainer.sync_log == []
  with open(tmp_path / "versions.jsonl") as f:
    assert [json.loads(line)["version"] for line in f] == list(range(200))


def test_a_scheduled_keyframe_counts_its_delta_as_a_delta_and_itself_as_the_keyframe():
  """A scheduled version goes as a delta with a keyframe beside it: the keyframe's bytes were
  added to the delta's and the version counted as a keyframe (keyframe_bytes off, every K-th
  delta missing from the delta figures)."""
  log = [(0, 1000, 0.5, True, 0), (1, 10, 0.1, False, 0), (2, 30, 0.3, False, 900)]
  got = sync_summary("bf16", log)
  assert got["versions"] == 3 and got["keyframe_bytes"] == 900
  assert got["delta_bytes_mean"] == 20.0 and got["delta_seconds_median"] == 0.2
  assert sync_summary("bf16", log[:2])["keyframe_bytes"] == 1000
