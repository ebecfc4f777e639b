"""A worker whose held version cannot be brought forward by deltas takes the latest keyframe
instead of exiting: the server holds less than it (a new run, or a server restarted on an
empty store, while the worker stayed up)."""

import logging

from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from param_server.protos import param_server_pb2 as pb
from rlax_ps import sync
from worker_testlib import CONFIG, SMALL, TOKENIZER, client, enqueue_addition, published, same_held


def holding_v3(wc):
  """A worker that holds v3 of an earlier run (its server's, gone since)."""
  worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(max_leases=1, **SMALL))
  worker.policy.apply(published(CONFIG, version=3)[0])
  assert worker.policy.version == 3
  return worker


def test_a_worker_ahead_of_a_fresh_server_takes_its_keyframe_and_works_on(
    server, versions, caplog):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    worker = holding_v3(wc)
    with caplog.at_level(logging.WARNING):
      stats = worker.run()
    assert worker.policy.version == 0 and same_held(worker.policy, versions[0])
    assert stats.groups_submitted == 2 and stats.resyncs == 1
    said = [r.getMessage() for r in caplog.records if "dropping the v3" in r.getMessage()]
    assert len(said) == 1 and "latest is v0" in said[0]
    taken = trainer.take_rollouts(min_version=0, max_n=10).rollouts
    assert [r.group.policy_version for r in taken] == [0, 0]


def test_a_pull_the_server_refuses_for_a_version_it_never_had_falls_back_to_a_keyframe(
    server, versions, caplog):
  """The server's latest read as newer than the held version (it moved on between the
  question and the pull, say): the pull from v3 is refused with FAILED_PRECONDITION."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    worker = holding_v3(wc)
    pulls, pull = [], wc.pull_updates

    def counted(have=None, **kwargs):
      pulls.append(have)
      return pull(have, **kwargs)

    wc.pull_updates = counted
    wc.version_info = lambda *a, **k: pb.VersionInfo(latest_version=5, fmt="bf16")
    with caplog.at_level(logging.WARNING):
      worker._catch_up()
    assert pulls == [3, None]
    assert worker.policy.version == 0 and same_held(worker.policy, versions[0])
    assert "dropping the v3 it holds: the server refused a pull from it (have_version" in (
        caplog.text)


def test_updates_that_do_not_decode_are_replaced_by_a_keyframe(server, versions, caplog):
  """A stored delta failing its section seal (the client pulled it twice): the worker takes
  the latest keyframe, on a version check and on a prefetch alike, instead of exiting."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    checking, prefetching = (Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
                             for _ in range(2))
    checking.sync_weights()
    prefetching.sync_weights()
    trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
    pulls, pull = [], wc.pull_updates

    def corrupt_deltas(have=None, **kwargs):
      pulls.append(have)
      if have is not None:
        raise sync.CodecError("update v1: section 'tensors': its seal does not match")
      return pull(have, **kwargs)

    wc.pull_updates = corrupt_deltas
    with caplog.at_level(logging.WARNING):
      checking._catch_up()
      prefetching.prefetch(1)
      assert prefetching.apply_prefetched()
    assert pulls == [0, None, 0, None]
    for worker in (checking, prefetching):
      assert worker.policy.version == 1 and same_held(worker.policy, versions[1])
      assert worker.stats.resyncs == 1
    said = [r.getMessage() for r in caplog.records if "dropping the v0" in r.getMessage()]
    assert len(said) == 2 and all("section 'tensors'" in line for line in said)
