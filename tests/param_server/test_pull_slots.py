"""Pulls served at once are bounded (ServerConfig.max_pulls): each holds a handler thread for
its whole transfer, and pulls crawling over slow links took every thread, so no lease,
submission or heartbeat of the fleet was answered. One pull more waits for a turn."""

import threading
import time

import grpc
import numpy as np
import pytest

from param_server.client import ParamServerError, RetryPolicy, make_sample
from param_server.protos import param_server_pb2 as pb
from param_server.protos import param_server_pb2_grpc as pb_grpc
from param_server.server import ServerConfig
from ps_testlib import TOKENS, client_for
from rlax_ps import sync

WEIGHTS = {"w": np.random.default_rng(0).normal(size=(2048, 2048)).astype(np.float32)}


def _held_pull(server, relay_id=""):
  """A raw Pull that read its first chunk and reads no more (a slow link): its stream, and
  the handler thread serving it, stay busy. (channel, call), or the error of the first read."""
  channel = grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
  call = pb_grpc.ParamServerStub(channel).Pull(
      pb.PullRequest(relay_id=relay_id),
      metadata=(("authorization", f"Bearer {TOKENS['worker']}"),))
  try:
    next(call)
  except grpc.RpcError as e:
    channel.close()
    return e
  return channel, call


def test_slow_pulls_leave_threads_for_the_other_calls_and_one_more_waits_its_turn(
    start_server):
  server = start_server(threads=8, max_pulls=2)
  blob = sync.encode(None, WEIGHTS, "bf16", version=0).to_bytes()
  with client_for(server, "trainer") as trainer:
    trainer.publish(blob)
  held = [_held_pull(server) for _ in range(4)]
  refused = [h for h in held if isinstance(h, grpc.RpcError)]
  assert len(refused) == 2 and all(
      e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and
      e.details().startswith("pulls: busy: 2 pulls under way (max_pulls)") for e in refused)
  streams = [h for h in held if not isinstance(h, grpc.RpcError)]
  with client_for(server, "viewer") as viewer:
    viewer.timeout_s = 5.0
    stats = viewer.stats()  # a thread was left for it
    assert stats.versions.latest_version == 0
    # Flow control, not bad input: counted apart from the rejected requests.
    assert (stats.pulls_busy, stats.errors) == (2, 0)
  pulled = []
  with client_for(server, "worker", retry=RetryPolicy(deadline_s=0.0)) as worker:
    puller = threading.Thread(target=lambda: pulled.append(worker.pull_updates()))
    puller.start()
    puller.join(timeout=2.5)
    assert puller.is_alive() and not pulled  # waiting for a turn (its retries: none)
    channel, call = streams.pop()
    call.cancel()
    channel.close()
    puller.join(timeout=60.0)
  (update,) = pulled[0]
  want = sync.apply(None, sync.Update.from_bytes(blob))["w"]
  assert np.array_equal(sync.apply(None, update)["w"], want)
  for channel, call in streams:
    call.cancel()
    channel.close()


def test_max_pulls_must_leave_a_thread_for_the_other_calls(tmp_path):
  with pytest.raises(ValueError, match=r"ServerConfig.max_pulls: expected 0 \(half of threads\) "
                                       r"or from 1 to threads - 1 = 7"):
    ServerConfig(storage_dir=str(tmp_path), threads=8, max_pulls=8)


def test_an_idle_fleets_long_polls_leave_threads_for_the_other_calls(start_server):
  """Workers asking for prompts on an empty queue each held a thread for their whole wait:
  an idle fleet as large as the thread pool left none for a submission, a heartbeat or the
  trainer's take. Past threads // 4 waiting, a lease is answered at once, and its client
  waits out the rest itself (no spinning)."""
  server = start_server(threads=8)  # two long polls at a time
  done = []

  def idle_worker(i):
    with client_for(server, "worker") as worker:
      worker.register(f"idle-{i}")
      t0 = time.monotonic()
      lease = worker.lease(1, 30.0, wait_s=3.0)
      done.append((lease.prompts, time.monotonic() - t0))

  threads = [threading.Thread(target=idle_worker, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  time.sleep(1.0)  # all four waiting
  with client_for(server, "viewer", retry=RetryPolicy(deadline_s=0.0)) as viewer:
    viewer.timeout_s = 1.0
    assert viewer.stats().prompts_queued == 0  # a thread was left for it
  for t in threads:
    t.join(timeout=30.0)
  assert len(done) == 4 and all(not prompts and waited >= 2.9 for prompts, waited in done)


def test_a_relays_fetch_is_served_while_the_workers_pulls_fill_their_slots(start_server):
  """A relay's fetch serves its whole fleet: with every worker pull slot held by slow links it
  was refused, and every worker behind the relay waited; it has slots of its own."""
  server = start_server(threads=16, max_pulls=4)
  blob = sync.encode(None, WEIGHTS, "bf16", version=0).to_bytes()
  with client_for(server, "trainer") as trainer:
    trainer.publish(blob)
  streams = [_held_pull(server) for _ in range(4)]
  assert not any(isinstance(h, grpc.RpcError) for h in streams)
  refused = _held_pull(server)
  assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  with client_for(server, "worker") as relay:
    chunks = list(relay.stream_pull(None, relay_id="relay@zone-b"))
  assert sum(len(c.data) for c in chunks) == len(blob)
  for channel, call in streams:
    call.cancel()
    channel.close()


def test_the_trainers_take_waits_for_a_group_while_an_idle_fleet_holds_the_wait_slots(
    start_server):
  """Workers waiting for prompts held every long-poll slot (threads // 4): the trainer's take
  was answered empty at once, and a group submitted a moment later reached it a whole wait_s
  late, take after take. The take waits apart."""
  server = start_server(threads=8)  # two worker long polls at a time
  with client_for(server, "trainer") as trainer, client_for(server, "worker") as worker, \
      client_for(server, "worker") as idle:
    worker.register("w")
    idle.register("idle")
    trainer.enqueue_prompts([pb.Prompt(id="p0", text="2+2", metadata={"answer": "4"})])
    lease = worker.lease(1, 30.0)
    assert len(lease.prompts) == 1
    waiting = [threading.Thread(target=idle.lease, args=(1, 30.0), kwargs={"wait_s": 6.0})
               for _ in range(2)]
    for thread in waiting:
      thread.start()  # the queue is empty: they hold both wait slots
    time.sleep(0.5)
    sample = make_sample([7, 8], 1.0, text="4", finish_reason="stop")
    threading.Timer(1.0, worker.submit_rollouts, (lease.lease_id, pb.RolloutGroup(
        prompt_id="p0", samples=[sample, sample], policy_version=0))).start()
    take = trainer.take_rollouts(max_n=4, wait_s=4.0)
    assert [r.prompt.id for r in take.rollouts] == ["p0"]  # woken by the group, not empty
    for thread in waiting:
      thread.join(timeout=30.0)


def test_watch_streams_past_their_slots_are_told_to_come_back_leaving_threads(start_server):
  """Each Watch stream holds a thread while its client keeps it: unbounded, any token (a
  viewer's) opening as many as the server has threads stalled every worker and the trainer."""
  server = start_server(threads=16)  # two Watch streams at once
  channels, streams = [], []
  for _ in range(3):
    channel = grpc.insecure_channel(server.address,
                                    options=[("grpc.use_local_subchannel_pool", 1)])
    call = pb_grpc.ParamServerStub(channel).Watch(
        pb.WatchRequest(after_version=-1),
        metadata=(("authorization", f"Bearer {TOKENS['viewer']}"),))
    channels.append(channel)
    streams.append(call)
  time.sleep(1.0)
  refused = []
  for call in streams:
    if call.done():
      with pytest.raises(grpc.RpcError) as e:
        next(call)
      refused.append(e.value)
  assert len(refused) == 1 and refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert refused[0].details().startswith("watches: busy: 2 Watch streams open")
  for call in streams:
    call.cancel()
  for channel in channels:
    channel.close()


def test_the_worker_registry_and_its_listing_are_bounded(start_server, monkeypatch):
  """Registrations of any size and ids without end grew the server's memory, and GetStats
  outgrew a message: `rlax-ps status` failed for every role."""
  from param_server import server as server_module
  monkeypatch.setattr(server_module, "MAX_WORKERS", 6)
  monkeypatch.setattr(server_module, "MAX_LISTED_WORKERS", 3)
  server = start_server()
  with client_for(server, "worker") as worker, client_for(server, "viewer") as viewer:
    with pytest.raises(ParamServerError, match=r"metadata: expected at most 16384 bytes"):
      worker.register("big", metadata={"k": "x" * 20000})
    for i in range(6):
      worker.heartbeat(version=-1, worker_id=f"w{i}")
    with pytest.raises(ParamServerError, match=r"worker_id: 6 workers and relays known") as e:
      worker.heartbeat(version=-1, worker_id="w6")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    worker.heartbeat(version=-1, worker_id="w5")  # a known one goes on
    stats = viewer.stats()
  assert [w.worker_id for w in stats.workers] == ["w5", "w4", "w3"]  # the latest heard
  assert (stats.workers_unlisted, stats.workers_known, stats.workers_alive) == (3, 6, 6)


def test_relays_past_their_own_slots_take_the_workers(start_server):
  """Relays' slots are besides the workers', not a ceiling: a 9th relay fetching with 32
  worker slots free was told to come back."""
  from param_server.server import RELAY_PULLS
  server = start_server(threads=64)  # max_pulls 32
  blob = sync.encode(None, WEIGHTS, "bf16", version=0).to_bytes()
  with client_for(server, "trainer") as trainer:
    trainer.publish(blob)
  held = [_held_pull(server, relay_id=f"relay-{i}") for i in range(RELAY_PULLS + 2)]
  assert not any(isinstance(h, grpc.RpcError) for h in held)
  for channel, call in held:
    call.cancel()
    channel.close()


def test_workers_long_calls_together_leave_threads_for_takes_relays_and_short_calls(
    start_server):
  """Each kind of a worker's long call (pulls, long polls, Watch streams) is bounded apart,
  and below about 120 threads those bounds add up to more than the pool: a Watch, long polls
  and pulls held every thread, and no heartbeat was answered. Together they hold at most
  what the trainer's takes, relays' fetches and short calls leave (thread_budget)."""
  server = start_server(threads=8)
  from param_server.server import thread_budget
  assert thread_budget(8) == {"reserved": 2, "takes": 2, "relay_pulls": 1, "workers": 3}
  with client_for(server, "trainer") as trainer:
    trainer.publish(sync.encode(None, WEIGHTS, "bf16", version=0).to_bytes())
    trainer.enqueue_prompts([pb.Prompt(id="p0", text="2+2", metadata={"answer": "4"})])
  worker = client_for(server, "worker")
  worker.register("w")
  lease = worker.lease(1, 30.0)
  channel = grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
  watch = pb_grpc.ParamServerStub(channel).Watch(
      pb.WatchRequest(after_version=0), metadata=(("authorization", f"Bearer {TOKENS['viewer']}"),))
  polled = []

  def idle_worker(i):
    with client_for(server, "worker") as idle:
      idle.register(f"idle-{i}")
      polled.append(idle.lease(1, 30.0, wait_s=5.0))

  polls = [threading.Thread(target=idle_worker, args=(i,)) for i in range(2)]
  for poll in polls:
    poll.start()
  time.sleep(1.0)  # the Watch and both long polls hold the workers' 3 threads
  refused = _held_pull(server)  # (max_pulls, 4, not reached)
  assert isinstance(refused, grpc.RpcError) and refused.details().startswith(
      "pulls: busy: 4 pulls under way (max_pulls), or every thread long calls may hold")
  fetch = _held_pull(server, relay_id="relay-a")  # a relay's fetch: a thread of its own
  assert not isinstance(fetch, grpc.RpcError)
  with client_for(server, "viewer", retry=RetryPolicy(deadline_s=0.0)) as viewer:
    viewer.timeout_s = 1.0
    assert viewer.stats().versions.latest_version == 0  # answered while the long calls wait
  # The trainer's take waits, and a group submitted meanwhile wakes it (not a wait_s late).
  sample = make_sample([7, 8], 1.0, text="4", finish_reason="stop")
  threading.Timer(1.0, worker.submit_rollouts, (lease.lease_id, pb.RolloutGroup(
      prompt_id="p0", samples=[sample, sample], policy_version=0))).start()
  with client_for(server, "trainer") as trainer:
    take = trainer.take_rollouts(max_n=4, wait_s=4.0)
  assert [r.prompt.id for r in take.rollouts] == ["p0"]
  for poll in polls:
    poll.join(timeout=30.0)
  assert len(polled) == 2 and not any(p.prompts for p in polled)
  fetch[1].cancel()
  fetch[0].close()
  watch.cancel()
  channel.close()
  worker.close()
  with pytest.raises(ValueError, match=r"ServerConfig.threads: expected at least 6"):
    ServerConfig(storage_dir=str(server.config.storage_dir), threads=5)


def test_a_relay_needs_threads_for_its_long_calls_and_the_short_ones(tmp_path):
  from param_server.relay import RelayConfig
  with pytest.raises(ValueError, match=r"RelayConfig.threads: expected at least 6"):
    RelayConfig(storage_dir=str(tmp_path), threads=5)
