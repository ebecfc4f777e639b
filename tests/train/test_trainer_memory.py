"""What the RL trainer keeps per step stays bounded over a long run."""

import json
import types

from rlax_ps.train.events import NoEvents
from rlax_ps.train.publisher import Publication
from rlax_ps.train.rl import RLTrainer


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
