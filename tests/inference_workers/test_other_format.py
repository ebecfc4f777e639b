"""A worker whose worker.weights_format is not the format the server's versions are published
in pulls none of them: the server names its format first. It says so in one line a version,
naming worker.weights_format, and waits for a version in its own."""

import logging

from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from rlax_ps import sync
from worker_testlib import CONFIG, SMALL, TOKENIZER, client, published


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
