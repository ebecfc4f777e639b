"""Lease and submission replies name the server's latest version; a worker that hears of a
newer one there starts pulling it at once, and a version check finding that pull under way
waits for it instead of pulling again."""

import threading

from inference_workers.loop import Worker
from inference_workers.worker_config import WorkerConfig
from param_server.protos import param_server_pb2 as pb
from rlax_ps import sync
from worker_testlib import CONFIG, SMALL, TOKENIZER, client, enqueue_addition, same_held


def failure(prompt_id):
  return pb.RolloutGroup(prompt_id=prompt_id, policy_version=0, failure="not sampled: a test")


def test_a_reply_naming_a_newer_version_wakes_the_prefetch_once(server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    enqueue_addition(trainer, 2)
    wc.register("hints")
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.sync_weights()
    lease = worker._lease(0.0)
    assert lease.latest_version == 0 and not worker._pull_now.is_set()  # v0 is held
    trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
    worker._submit(lease.lease_id, "p0", failure("p0"))
    assert worker._latest_heard == 1 and worker._pull_now.is_set()
    worker._pull_now.clear()
    reply = wc.submit_rollouts(lease.lease_id, failure("p1"))
    assert reply.latest_version == 1
    worker._hear(reply.latest_version)  # heard already: the prefetch is not woken again
    assert not worker._pull_now.is_set()


def test_a_version_check_waits_for_the_prefetch_under_way_and_pulls_nothing_more(
    server, versions):
  with client(server, "trainer") as trainer, client(server, "worker") as wc:
    trainer.publish(sync.encode(None, versions[0], "bf16", version=0).to_bytes())
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    worker.sync_weights()
    trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
    pull, pulls, opened, in_pull = wc.pull_updates, [], threading.Event(), threading.Event()

    def held_at_first(have, **kwargs):  # the prefetch's pull waits until `opened`
      pulls.append(have)
      if len(pulls) == 1:
        in_pull.set()
        opened.wait(30)
      return pull(have, **kwargs)

    wc.pull_updates = held_at_first
    prefetch = threading.Thread(target=worker.prefetch, args=(1,))
    prefetch.start()
    assert in_pull.wait(30)
    # Opened later: a version check that pulled for itself would have pulled by then.
    threading.Timer(0.2, opened.set).start()
    worker._catch_up()
    prefetch.join(30)
    assert pulls == [0] and worker.stats.versions_applied == [0, 1]
    assert same_held(worker.policy, versions[1])
