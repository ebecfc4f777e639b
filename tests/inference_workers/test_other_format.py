"""A worker whose worker.weights_format is not the format the server's versions are published
in pulls none of them: the server names its format first. It says so in one line a version,
naming worker.weights_format, and waits for a version in its own."""

import logging

from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from param_server.protos import param_server_pb2 as pb
from rlax_ps import sync
from worker_testlib import CONFIG, SMALL, TOKENIZER, PublishingClient, client, published


def counting_pulls(wc):
  """The versions `wc` pulls from, as they are pulled."""
  pulls, pull = [], wc.pull
  wc.pull = lambda have=None, **kwargs: (pulls.append(have), pull(have, **kwargs))[1]
  return pulls


def publish_bf16(trainer, versions, count):
  base = None
  for v in range(count):
    params = versions[v % 2]
    trainer.publish(sync.encode(base, params, "bf16", version=v).to_bytes())
    base = params
    yield v


def test_a_worker_of_the_other_format_pulls_no_version(server, versions, caplog):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL, weights_format="int8"))
    pulls = counting_pulls(wc)
    with caplog.at_level(logging.WARNING):
      for _ in publish_bf16(trainer, versions, 3):
        worker._catch_up()
        worker._catch_up()  # a version seen is not said again
    assert pulls == [] and worker.policy.version is None
    said = [r.getMessage() for r in caplog.records if "is published in bf16" in r.getMessage()]
    assert len(said) == 3 and all("\n" not in line for line in said)
    assert "not this worker's int8 (worker.weights_format" in said[0]
    assert "holding nothing" in said[0]


def test_a_worker_holding_its_own_format_prefetches_no_version_of_the_other(server, versions):
  """It holds an int8 version (of a server since replaced by one publishing bf16): the
  versions it hears of are not prefetched either."""
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL, weights_format="int8"))
    worker.policy.apply(published(CONFIG, "int8", version=0)[0])
    pulls = counting_pulls(wc)
    for v in publish_bf16(trainer, versions, 3):
      worker.prefetch(v)
      worker._catch_up()
    assert pulls == [] and worker.policy.version == 0


def test_a_version_whose_format_is_not_told_is_pulled(server):
  """A relay still empty tells no format (""): its versions are pulled, not skipped."""
  with client(server, "worker") as wc:
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL, weights_format="int8"))
    assert worker._in_own_format(3, "") and worker._in_own_format(3, "int8")
    assert not worker._in_own_format(3, "bf16")


def test_a_version_of_the_other_format_does_not_stop_the_refills():
  """Without in-flight updates, a newer version waits for the running prompts, and new ones
  with it. One in another format is never pulled, yet it counted as one that waits: while
  any prompt ran, no free slot was filled, cycle after cycle."""
  keyframe, _ = published(CONFIG, version=0)

  class Client(PublishingClient):  # the trainer's latest, v1, in int8
    def latest_version(self):
      return 1

    def version_info(self):
      return pb.VersionInfo(latest_version=1, fmt="int8")

  class Batch:  # one prompt running, three slots free
    running, waiting, free, added = 1, 0, 3, []

    def add(self, key, tokens, seeds, begun=None):
      self.added.append(key)

  worker = Worker(Client(keyframe), CONFIG, TOKENIZER, WorkerConfig(**SMALL))
  worker.policy.apply(keyframe)
  worker._catch_up()
  assert (worker.policy.version, worker._skipped_version) == (0, 1)
  worker._started[("l0", "running")] = (pb.Prompt(id="running"), 0)
  worker._pending.extend(("l1", pb.Prompt(id=f"q{i}", text="1+2=", task="addition"))
                         for i in range(3))
  batch = Batch()
  worker._start_pending(batch)
  assert batch.added == [("l1", "q0"), ("l1", "q1"), ("l1", "q2")] and not worker._pending


def test_a_version_skipped_on_a_replaced_store_is_forgotten_with_it():
  """v1 of store A is in another format (skipped); the server restarts on an empty store B,
  whose v0 the worker pulls. A's skipped v1 says nothing of B's versions: the prompts the
  worker begins on v0 are stale once B's trainer names floor v1."""
  keyframe, _ = published(CONFIG, version=0)

  class Client(PublishingClient):
    store, latest, fmt = "A", 0, keyframe.fmt

    def latest_version(self):
      return self.latest

    def version_info(self):
      return pb.VersionInfo(latest_version=self.latest, fmt=self.fmt, store_id=self.store)

  wc = Client(keyframe)
  worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
  worker.policy.apply(keyframe)
  worker._catch_up()  # v0 of store A, held
  wc.latest, wc.fmt = 1, "int8"
  worker._catch_up()
  assert (worker.policy.version, worker._skipped_version, wc.pulls) == (0, 1, [])
  wc.store, wc.latest, wc.fmt = "B", 0, keyframe.fmt  # restarted on an empty store
  worker._catch_up()  # B's keyframe, pulled
  assert (worker.policy.version, worker._held_store, wc.pulls) == (0, "B", [None])
  worker.prefetch(0)  # told of the version it holds: nothing to pull
  assert wc.pulls == [None]
  worker._floor = 1  # as B's trainer's first take at min_version 1 names it
  assert worker._stale(0)
