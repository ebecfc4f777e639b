"""A weight relay in front of the server: each version crosses from the server once however
many workers pull it from the relay; pulls through it equal pulls from the server and wait for
the version being fetched; leases, rollouts and heartbeats pass through with the caller's
token; what it keeps survives its restart."""

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

from param_server.client import (RELAY_DOWN, ParamServerClient, ParamServerError, RetryPolicy,
                                  make_sample)
from param_server.protos import param_server_pb2 as pb
from param_server import relay as relay_module
from param_server.relay import RelayConfig, WeightRelay
from param_server.weights import WeightStore
from child_env import child_env
from ps_testlib import (CHUNK, REPO, TOKENS, apply_blobs, client_for, perturbed, publish_chain,
                       tiny_weights)
from rlax_ps import sync


@pytest.fixture
def start_relay(tmp_path):
  relays = []

  def start(server, **overrides):
    config = RelayConfig(**{"storage_dir": str(tmp_path / "relay"), "port": 0,
                            "chunk_bytes": CHUNK, "threads": 16, "max_wait_s": 10.0,
                            **overrides})
    relay = WeightRelay(config, client_for(server, "worker"), TOKENS["worker"]).start()
    relays.append(relay)
    return relay

  yield start
  for r in relays:
    r.stop(grace=0)


def _until(predicate, timeout_s=10.0):
  end = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < end, "timed out"
    time.sleep(0.02)


def _same(a, b):
  return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_workers_pull_through_the_relay_what_the_server_holds_each_version_sent_once(
    server, trainer, start_relay):
  versions = publish_chain(trainer, 3)
  relay = start_relay(server)
  _until(lambda: relay.fetches == 3)  # (counted once stored)
  sent = server.servicer.bytes_served
  held = []
  for _ in range(3):  # three workers behind one relay
    with client_for(relay, "worker") as w:
      held.append(apply_blobs(w.pull()))
  with client_for(server, "worker") as direct:
    want = apply_blobs(direct.pull())
  assert all(_same(h, want) for h in held)
  assert _same(want, apply_blobs([sync.encode(None, versions[2], "bf16", version=2).to_bytes()]))
  # The server sent the chain to the relay once; the relay served the three pulls.
  assert relay.fetches == 3 and sent == relay.bytes_fetched
  assert relay.servicer.bytes_served == 3 * relay.bytes_fetched
  # A new version: the relay fetches only the delta; a worker's pull from v2 gets it.
  versions.append(perturbed(versions[-1], 0.05, seed=9))
  trainer.publish(sync.encode(versions[2], versions[3], "bf16", version=3).to_bytes())
  _until(lambda: relay.fetches == 4)
  with client_for(relay, "worker") as w:
    (delta,) = w.pull(have_version=2)
  assert sync.Update.from_bytes(bytes(delta)).base_version == 2 and relay.fetches == 4


def test_a_pull_waits_for_the_version_the_relay_is_fetching(server, trainer, start_relay):
  versions = publish_chain(trainer, 1)
  relay = start_relay(server)
  _until(lambda: relay.weights.latest == 0)
  slow = relay.upstream.stream_pull

  def after_a_second(*args, **kwargs):
    time.sleep(1.0)
    return slow(*args, **kwargs)

  relay.upstream.stream_pull = after_a_second
  versions.append(perturbed(versions[0], 0.05, seed=1))
  trainer.publish(sync.encode(versions[0], versions[1], "bf16", version=1).to_bytes())
  _until(lambda: relay.server_latest == 1)
  assert relay.weights.latest == 0  # still fetching
  with client_for(relay, "worker") as w:
    (delta,) = w.pull(have_version=0)  # as current as the server
  assert sync.Update.from_bytes(bytes(delta)).version == 1


class _Broken(grpc.RpcError):
  def code(self):
    return grpc.StatusCode.UNAVAILABLE

  def details(self):
    return "link cut by the test"


class _Upstream:
  """The relay's Pull streams from the server, held back before their last chunk until
  `go` is set, or (`break_after`) cut after that many chunks of the first stream."""

  def __init__(self, relay, break_after=None):
    self.stream_pull, self.calls = relay.upstream.stream_pull, []
    self.held, self.go, self.break_after = threading.Event(), threading.Event(), break_after
    self.last_bytes = 0
    relay.upstream.stream_pull = self

  def __call__(self, have=None, resume=None, relay_id=""):
    self.calls.append((have, resume))
    call = self.stream_pull(have, resume=resume, relay_id=relay_id)
    broken = self.break_after is not None and len(self.calls) == 1

    class Stream:
      def __iter__(s):
        for i, chunk in enumerate(call):
          if broken and i == self.break_after:
            raise _Broken()
          if (not broken and chunk.update_index == chunk.update_count - 1
              and chunk.offset + len(chunk.data) == chunk.update_bytes):
            self.last_bytes = len(chunk.data)
            self.held.set()
            self.go.wait(20)
          yield chunk

      def cancel(s):
        call.cancel()

    return Stream()


def _big_keyframe(version=0):
  weights = {"w": np.random.default_rng(3).normal(size=(128, 256)).astype(np.float32)}
  return sync.encode(None, weights, "bf16", version=version).to_bytes()  # 16 chunks


def _held_back_pull(trainer, upstream, target):
  """Publish a keyframe whose last chunk `upstream` holds back, pull it from `target` on a
  thread; return (keyframe, what the pull returns, the thread) once the pull holds all but
  that chunk."""
  keyframe = _big_keyframe()
  trainer.publish(keyframe)
  out, received = [], []
  puller = _pull_in_thread(target, out, received)
  assert upstream.held.wait(10)
  _until(lambda: sum(received) == len(keyframe) - upstream.last_bytes)
  return keyframe, out, puller


def _pull_in_thread(relay, out, received):
  def pull():
    with client_for(relay, "worker") as w:
      out.append(w.pull(on_chunk=lambda c: received.append(len(c.data))))

  thread = threading.Thread(target=pull)
  thread.start()
  return thread


def test_a_version_arriving_at_the_relay_streams_on_to_workers_as_it_comes(
    server, trainer, start_relay):
  """Cut-through: a worker behind the relay holds all but the last chunk of a version while
  the relay still waits for that chunk from the server."""
  relay = start_relay(server)
  upstream = _Upstream(relay)
  keyframe, out, puller = _held_back_pull(trainer, upstream, relay)
  assert relay.weights.latest == -1 and relay.pulls_cut_through == 1  # not stored yet
  upstream.go.set()
  puller.join(timeout=20)
  assert [bytes(b) for b in out[0]] == [keyframe]
  _until(lambda: relay.weights.latest == 0)
  # A delta on what the relay holds streams on the same way, after the stored part.
  upstream.held.clear()
  upstream.go.clear()
  held = apply_blobs([keyframe])
  delta = sync.encode(held, {k: v * 1.01 for k, v in held.items()}, "bf16", version=1).to_bytes()
  trainer.publish(delta)
  assert upstream.held.wait(10)
  with client_for(relay, "worker") as w:
    fresh = []
    thread = threading.Thread(target=lambda: fresh.append(w.pull()))
    thread.start()
    _until(lambda: relay.pulls_cut_through == 2)
    assert relay.weights.latest == 0
    upstream.go.set()
    thread.join(timeout=20)
  assert [bytes(b) for b in fresh[0]] == [keyframe, delta]  # keyframe stored, delta arriving


def test_a_broken_link_to_the_server_resumes_where_it_broke_and_pulls_wait_for_it(
    server, trainer, start_relay):
  relay = start_relay(server)
  upstream = _Upstream(relay, break_after=3)
  upstream.go.set()
  keyframe = _big_keyframe()
  out, received = [], []
  trainer.publish(keyframe)
  _until(lambda: relay._arriving is not None)
  puller = _pull_in_thread(relay, out, received)
  puller.join(timeout=20)
  assert [bytes(b) for b in out[0]] == [keyframe]
  _until(lambda: relay.fetches == 1)  # (stored after the pull ended: cut-through)
  assert upstream.calls[1] == (None, (0, -1, 3 * CHUNK))  # resumed at the break
  assert relay.bytes_resumed == 3 * CHUNK and relay.weights.latest == 0


def test_a_stalled_link_fails_pulls_as_unavailable_then_they_succeed(
    server, trainer, start_relay):
  relay = start_relay(server, max_wait_s=0.5)
  upstream = _Upstream(relay)
  keyframe = _big_keyframe()
  trainer.publish(keyframe)
  assert upstream.held.wait(10)
  with client_for(relay, "worker") as w:
    with pytest.raises(grpc.RpcError) as stalled:
      list(w.stream_pull())
    assert stalled.value.code() == grpc.StatusCode.UNAVAILABLE  # workers retry it
    assert "stalled at byte" in stalled.value.details()
    upstream.go.set()
    assert [bytes(b) for b in w.pull()] == [keyframe]


def test_leases_rollouts_and_heartbeats_pass_through_with_the_callers_token(
    server, trainer, start_relay):
  publish_chain(trainer, 1)
  relay = start_relay(server)
  trainer.enqueue_prompts([pb.Prompt(id="p0", text="1+1=", token_ids=[1, 2])])
  with client_for(relay, "worker") as w:
    worker_id = w.register("behind-relay")
    assert w.heartbeat(version=0).latest_version == 0
    lease = w.lease(1, deadline_s=30.0, wait_s=1.0)
    assert [p.id for p in lease.prompts] == ["p0"]
    group = pb.RolloutGroup(prompt_id="p0", policy_version=0,
                            samples=[make_sample([5, 6], 1.0), make_sample([7], 0.0)])
    w.submit_rollouts(lease.lease_id, group)
  take = trainer.take_rollouts(max_n=4, wait_s=2.0)
  assert [r.group.prompt_id for r in take.rollouts] == ["p0"]
  stats = trainer.stats()
  assert [x.worker_id for x in stats.workers] == [worker_id]  # the server saw the worker
  # The server checks what passes through: a trainer's call with a worker's token is denied.
  with client_for(relay, "worker") as w:
    with pytest.raises(ParamServerError) as denied:
      w.take_rollouts(max_n=1)
  assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_the_relay_checks_tokens_and_refuses_publications(server, trainer, start_relay):
  publish_chain(trainer, 1)
  relay = start_relay(server)
  with ParamServerClient(relay.address, token="wrong", retry=RetryPolicy(deadline_s=1.0)) as bad:
    with pytest.raises(ParamServerError) as pull:
      bad.pull()
    with pytest.raises(ParamServerError) as lease:  # passed through: the server says no
      bad.lease(1, deadline_s=30.0, worker_id="w")
  assert pull.value.code == lease.value.code == grpc.StatusCode.UNAUTHENTICATED
  with client_for(relay, "trainer") as t:
    with pytest.raises(ParamServerError) as publish:
      t.publish(sync.encode(None, tiny_weights(), "bf16", version=5).to_bytes())
  assert publish.value.code == grpc.StatusCode.FAILED_PRECONDITION
  assert "weight relay" in publish.value.details and trainer.latest_version() == 0


def test_a_restarted_relay_keeps_what_it_fetched(server, trainer, start_relay):
  versions = publish_chain(trainer, 2)
  relay = start_relay(server)
  _until(lambda: relay.weights.latest == 1)
  relay.stop(grace=0)
  versions.append(perturbed(versions[-1], 0.05, seed=5))
  trainer.publish(sync.encode(versions[1], versions[2], "bf16", version=2).to_bytes())
  again = start_relay(server)
  _until(lambda: again.weights.latest == 2 and again.fetches >= 1)
  assert again.fetches == 1  # the new delta only
  with client_for(again, "worker") as w:
    held = apply_blobs(w.pull())
  assert _same(held, apply_blobs([sync.encode(None, versions[2], "bf16", version=2).to_bytes()]))


def test_the_relays_metrics_show_its_version_against_the_servers(server, trainer,
                                                                  start_relay):
  publish_chain(trainer, 2)
  relay = start_relay(server, metrics_port=0)
  _until(lambda: relay.fetches == 2)
  with client_for(relay, "worker") as w:
    w.pull()
  with urllib.request.urlopen(f"http://127.0.0.1:{relay.metrics_port}/metrics",
                              timeout=10) as r:
    text = r.read().decode()

  def value(name):
    return float(re.search(rf"^rlax_ps_{name} (\S+)$", text, re.M).group(1))

  assert value("relay_version") == value("relay_server_version") == 1.0
  assert value("relay_updates_fetched_total") == 2.0
  assert value("relay_bytes_fetched_total") == relay.bytes_fetched > 0
  assert value("relay_bytes_served_total") == relay.bytes_fetched  # one pull of the chain
  assert value("relay_pulls_served_total") == 1.0
  assert value("relay_pulls_cut_through_total") == relay.pulls_cut_through
  assert value("relay_bytes_resumed_total") == relay.bytes_resumed


def test_a_relay_reports_the_version_it_holds_to_the_server(server, trainer, start_relay,
                                                              monkeypatch):
  monkeypatch.setattr(relay_module, "REPORT_S", 0.05)
  publish_chain(trainer, 2)
  relay = start_relay(server, name="relay@zone-b")
  _until(lambda: relay.weights.latest == 1)

  def reported():
    return {w.worker_id: (w.kind, w.version) for w in server.servicer.GetStats(
        pb.GetStatsRequest(), None).workers}

  _until(lambda: reported().get("relay@zone-b") == ("relay", 1))


@pytest.mark.parametrize("versions", [1, 4], ids=["behind", "past"])
def test_a_relay_serves_and_takes_nothing_of_another_runs_versions(start_server, start_relay,
                                                                   tmp_path, versions):
  """The server restarted on an empty store (a new run) while the relay kept the old run's
  versions, the new run behind the relay's v1 or already past it (its v2 is a delta on its
  own v1, not the old one's): the relay knows the server's storage is another (the one it
  followed is kept in its folder), refuses pulls naming the fix and fetches nothing, rather
  than serve stale weights or join the new run's deltas to the old run's chain."""
  first = start_server(storage_dir=tmp_path / "run1")
  with client_for(first, "trainer") as trainer:
    publish_chain(trainer, 2)
  relay = start_relay(first, poll_s=0.2)
  _until(lambda: relay.weights.latest == 1)
  port = first.port
  first.stop(grace=0)
  second = start_server(storage_dir=tmp_path / "run2", port=port)
  with client_for(second, "trainer") as trainer:
    publish_chain(trainer, versions, density=0.5)
  _until(lambda: "another run's versions" in relay.diverged)
  time.sleep(0.5)  # (polls past the new run's newest)
  assert relay.weights.latest == 1 and "another run's versions" in relay.diverged
  # UNAVAILABLE (RELAY_DOWN): a worker given the server too goes there.
  with client_for(relay, "worker", retry=RetryPolicy(deadline_s=0.0)) as w:
    with pytest.raises(ParamServerError) as refused:
      w.pull()
  assert refused.value.code == grpc.StatusCode.UNAVAILABLE
  assert refused.value.details.startswith(RELAY_DOWN) and "empty storage_dir" in (
      refused.value.details)
  both = f"ipv4:127.0.0.1:{relay.port},127.0.0.1:{port}"
  with client_for(both, "worker") as w:
    assert w.pull_updates()[-1].version == versions - 1  # the new run's, from the server


@pytest.mark.parametrize("have", [None, 1])
def test_a_relay_still_fetching_answers_what_it_cannot_serve_yet_as_unavailable(
    server, trainer, start_relay, monkeypatch, have):
  """A relay behind its server (here it never fetches) past max_wait_s: a puller holding
  nothing, or a version the relay lacks (pulled from the server meanwhile), is told
  UNAVAILABLE (RELAY_DOWN: retried, or taken to the server), not the server's verdicts
  NOT_FOUND (nothing published) or FAILED_PRECONDITION (a version from the future), which
  end a worker."""
  publish_chain(trainer, 2)
  monkeypatch.setattr(WeightRelay, "_fetch", lambda self: None)
  relay = start_relay(server, max_wait_s=0.2, poll_s=0.2)
  assert relay.server_latest == 1 and relay.weights.latest == -1
  with client_for(relay, "worker", retry=RetryPolicy(deadline_s=0.0)) as w:
    with pytest.raises(ParamServerError) as refused:
      w.pull(have)
  assert refused.value.code == grpc.StatusCode.UNAVAILABLE
  assert RELAY_DOWN in refused.value.details and "is fetching v1" in refused.value.details
  both = f"ipv4:127.0.0.1:{relay.port},127.0.0.1:{server.port}"
  with client_for(both, "worker") as w:
    assert [u.version for u in w.pull_updates(have)] == ([] if have == 1 else [0, 1])


def test_a_relay_answers_within_the_callers_deadline_while_it_fetches(
    server, trainer, start_relay, monkeypatch):
  """GetLatest waits for the version being fetched up to max_wait_s (60 here), or until
  just before the caller's deadline (3 s): then it answers what the relay serves."""
  publish_chain(trainer, 2)
  monkeypatch.setattr(WeightRelay, "_fetch", lambda self: None)
  relay = start_relay(server, max_wait_s=60.0, poll_s=0.2)
  with ParamServerClient(relay.address, token=TOKENS["worker"], timeout_s=3.0,
                         retry=RetryPolicy(deadline_s=0.0)) as w:
    assert w.latest_version() == -1  # (past its deadline: DEADLINE_EXCEEDED)


def test_a_relay_that_cannot_fetch_yet_answers_version_checks_with_what_it_holds(
    server, trainer, start_relay, monkeypatch):
  """A relay whose fetch cannot start (the server's pull slots full) held each worker's
  version check for the caller's whole deadline (29 of 30 s: the workers idle, the relay's
  threads taken): it answers what it holds after GET_LATEST_WAIT_S."""
  publish_chain(trainer, 1)
  relay = start_relay(server, max_wait_s=60.0, poll_s=0.2)
  _until(lambda: relay.weights.latest == 0)
  monkeypatch.setattr(WeightRelay, "_fetch", lambda self: None)
  trainer.publish(sync.encode(None, tiny_weights(seed=3), "bf16", version=1).to_bytes())
  _until(lambda: relay.server_latest == 1)
  with ParamServerClient(relay.address, token=TOKENS["worker"], timeout_s=30.0,
                         retry=RetryPolicy(deadline_s=0.0)) as w:
    asked = time.monotonic()
    assert w.latest_version() == 0
    assert time.monotonic() - asked < relay_module.GET_LATEST_WAIT_S + 5.0  # not 29 s


def test_relays_past_the_servers_watch_slots_follow_it_by_asking_without_errors(
    start_server, start_relay, tmp_path):
  """A relay refused a Watch stream (threads // 8 taken) warned and was counted a rejected
  request every second, for good: it now asks the server's version every poll_s, quietly."""
  server = start_server(threads=8)  # one Watch stream at once
  with client_for(server, "trainer") as trainer:
    versions = publish_chain(trainer, 1)
    relays = [start_relay(server, storage_dir=str(tmp_path / f"relay{i}"), poll_s=0.5)
              for i in range(2)]
    _until(lambda: all(r.weights.latest == 0 for r in relays))
    trainer.publish(sync.encode(versions[0], perturbed(versions[0], 0.05, seed=1), "bf16",
                                version=1).to_bytes())
    _until(lambda: all(r.weights.latest == 1 for r in relays))
  assert server.servicer.max_watches == 1
  assert server.servicer._rejections.count == 0  # refusals of flow control, not of input


def test_a_version_fetched_while_the_servers_answer_came_back_is_no_new_run(
    server, trainer, start_relay):
  """The server answers v1, then publishes v2, which the relay fetches before it reads the
  answer: v1 is below what it holds then, not below what it held when it asked, so the
  relay serves on (it refused every pull, and its workers stopped)."""
  versions = publish_chain(trainer, 2)
  relay = start_relay(server, poll_s=0.2)
  _until(lambda: relay.weights.latest == 1)
  ask = relay._ask_upstream

  def ask_while_a_version_lands(retry=None):
    latest = ask(retry)
    trainer.publish(sync.encode(versions[1], perturbed(versions[1], 0.05, seed=9), "bf16",
                                version=2, base_version=1).to_bytes())
    _until(lambda: relay.weights.latest == 2)
    return latest

  relay._ask_upstream = ask_while_a_version_lands
  relay._refreshed_at = 0.0
  relay.refresh()
  assert relay.refreshes and not relay.diverged and not relay.upstream_down()


def test_a_relay_holding_nothing_follows_a_server_restarted_on_new_storage(
    start_server, start_relay, tmp_path):
  """Before any version arrives there is no run to mix: a server restarted on another
  storage folder (its id another) is followed, not refused for good."""
  first = start_server(storage_dir=tmp_path / "run1")
  relay = start_relay(first, poll_s=0.2)
  _until(lambda: relay.upstream_store)
  port = first.port
  first.stop(grace=0)
  second = start_server(storage_dir=tmp_path / "run2", port=port)
  with client_for(second, "trainer") as trainer:
    publish_chain(trainer, 2)
  _until(lambda: relay.weights.latest == 1)
  assert not relay.diverged and relay.upstream_store == second.servicer.store_id


def test_a_worker_given_the_relay_then_the_server_goes_on_when_the_relay_dies(
    server, trainer, start_relay):
  """--address=ipv4:RELAY,SERVER: the client takes the relay while it answers and the
  server once it does not, so a relay is no single point of failure."""
  publish_chain(trainer, 2)
  relay = start_relay(server)
  with client_for(f"ipv4:127.0.0.1:{relay.port},127.0.0.1:{server.port}", "worker") as w:
    want = apply_blobs(w.pull())
    assert relay.servicer.pulls_served == 1 and server.servicer.pulls_served == 1  # the relay's
    relay.stop(grace=0)
    assert _same(apply_blobs(w.pull()), want)
    assert server.servicer.pulls_served == 2  # the worker's own, from the server
    w.register("fell-back")
    assert w.heartbeat(version=1).latest_version == 1


def test_a_zone_relay_whose_region_relay_dies_passes_calls_to_the_server(
    server, trainer, start_relay, tmp_path):
  """Relays in tiers: the zone's follows ipv4:REGION,SERVER. Once the region's relay dies
  the zone's fetches from the server, and the calls it passes through (leases) go there
  too, not to the dead relay for good."""
  publish_chain(trainer, 1)
  region = start_relay(server, storage_dir=str(tmp_path / "region"), poll_s=0.2)
  zone = start_relay(f"ipv4:127.0.0.1:{region.port},127.0.0.1:{server.port}",
                     storage_dir=str(tmp_path / "zone"), poll_s=0.2)
  _until(lambda: zone.weights.latest == 0)
  region.stop(grace=0)
  trainer.publish(sync.encode(tiny_weights(), perturbed(tiny_weights(), 0.05, seed=3), "bf16",
                              version=1, base_version=0).to_bytes())
  _until(lambda: zone.weights.latest == 1)  # its follower went to the server
  trainer.enqueue_prompts([pb.Prompt(id="p0", text="1+1=", token_ids=[1, 2])])
  with client_for(zone, "worker", retry=RetryPolicy(deadline_s=0.0)) as w:
    w.register("behind-zone")
    assert [p.id for p in w.lease(1, deadline_s=30.0, wait_s=1.0).prompts] == ["p0"]


def test_a_worker_that_left_its_relay_goes_back_to_it_once_it_serves_again(
    server, trainer, start_relay):
  """A relay restarted (its VM preempted and replaced) gets its workers back: a client that
  went to the server tries the relay again relay_again_s later, instead of leaving the
  server to carry every worker's pulls for good."""
  publish_chain(trainer, 2)
  relay = start_relay(server)
  port = relay.port
  with client_for(f"ipv4:127.0.0.1:{port},127.0.0.1:{server.port}", "worker",
                  relay_again_s=0.5) as w:
    want = apply_blobs(w.pull())
    relay.stop(grace=0)
    assert _same(apply_blobs(w.pull()), want) and not w.on_relay
    time.sleep(0.6)  # the relay is tried again, still down: the server answers at once
    assert _same(apply_blobs(w.pull()), want) and not w.on_relay
    served = server.servicer.pulls_served
    again = start_relay(server, port=port)
    _until(lambda: again.weights.latest == 1)
    end = time.monotonic() + 10.0
    while not again.servicer.pulls_served:
      assert time.monotonic() < end, "the worker never went back to its relay"
      assert _same(apply_blobs(w.pull()), want)
      time.sleep(0.1)
    assert w.on_relay
    pulls_via_server = server.servicer.pulls_served - served
    assert _same(apply_blobs(w.pull()), want)
    assert again.servicer.pulls_served == 2
    assert server.servicer.pulls_served - served == pulls_via_server  # the relay's, not more


def test_through_a_server_outage_a_pull_gets_what_the_relay_holds_at_once(
    server, trainer, tmp_path):
  """A pull holding all the relay holds makes it ask the server once, not for the length of
  its client's retries: the worker (5 s deadline) is told nothing is newer."""
  publish_chain(trainer, 2)
  config = RelayConfig(storage_dir=str(tmp_path / "relay"), port=0, chunk_bytes=CHUNK)
  upstream = client_for(server, "worker", retry=RetryPolicy(deadline_s=60.0))
  with WeightRelay(config, upstream, TOKENS["worker"]) as relay:
    _until(lambda: relay.weights.latest == 1)
    server.stop(grace=0)
    with client_for(relay, "worker", retry=RetryPolicy(deadline_s=0.0)) as w:
      answers = []
      puller = threading.Thread(target=lambda: answers.append(w.pull(have_version=1)))
      puller.start()
      puller.join(timeout=20.0)  # the upstream's retries would hold it 60 s
      assert answers == [[]]
      w.timeout_s = 20.0
      assert w.latest_version() == 1


def test_relay_settings_are_checked_naming_the_field():
  with pytest.raises(ValueError, match="RelayConfig.max_wait_s"):
    RelayConfig(max_wait_s=-1.0)
  with pytest.raises(ValueError, match="RelayConfig.chunk_bytes"):
    RelayConfig(chunk_bytes=0)
  with pytest.raises(ValueError, match="RelayConfig.pull_message_bytes"):
    RelayConfig(pull_message_bytes=0)
  with pytest.raises(ValueError, match="RelayConfig.metrics_port"):
    RelayConfig(metrics_port=70000)
  with pytest.raises(ValueError, match="RelayConfig.poll_s"):
    RelayConfig(poll_s=0.0)


def test_many_pullers_at_once_get_one_fetch(server, trainer, start_relay):
  publish_chain(trainer, 2)
  relay = start_relay(server)
  results, errors = [], []

  def pull():
    try:
      with client_for(relay, "worker") as w:
        results.append(apply_blobs(w.pull()))
    except Exception as e:  # noqa: BLE001
      errors.append(e)

  threads = [threading.Thread(target=pull) for _ in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and len(results) == 6 and all(_same(r, results[0]) for r in results)
  _until(lambda: relay.fetches == 2)  # (the pulls may end first: cut-through)
  assert relay.fetches == 2 and server.servicer.pulls_served == 1


def test_pulls_that_find_nothing_newer_ask_the_server_once_between_them(server, trainer,
                                                                          start_relay):
  """Workers pull when their heartbeat tells of a newer version: the relay asks the server
  first, and pulls arriving while it asks take that answer."""
  publish_chain(trainer, 1)
  relay = start_relay(server)
  _until(lambda: relay.weights.latest == 0)
  ask = relay.upstream.version_info

  def slowly(retry=None):
    time.sleep(0.5)
    return ask(retry)

  relay.upstream.version_info = slowly
  answers = []

  def pull():
    with client_for(relay, "worker") as w:
      answers.append(w.pull(have_version=0))

  threads = [threading.Thread(target=pull) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert answers == [[]] * 8  # nothing newer, after asking
  assert 1 <= relay.refreshes <= 2


def test_rlax_ps_relay_serves_workers_and_stops_on_sigterm(server, trainer, tmp_path):
  publish_chain(trainer, 2)
  env = dict(child_env(), RLAX_PS_WORKER_TOKEN=TOKENS["worker"], PYTHONFAULTHANDLER="1")
  log = tmp_path / "relay.log"
  with open(log, "w") as stderr:  # a file: a pipe nobody reads could block the relay's logging
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlax_ps", "relay", f"--address={server.address}", "--port=0",
         f"--storage_dir={tmp_path / 'relay'}", f"--chunk_bytes={CHUNK}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
  try:
    line = proc.stdout.readline()
    assert line.startswith("weight relay listening on 127.0.0.1:"), log.read_text()[-2000:]
    address = line.split()[4].rstrip(",")
    assert f"following {server.address}" in line
    with client_for(address, "worker") as w:
      held = apply_blobs(w.pull())
    with client_for(server, "worker") as direct:
      assert _same(held, apply_blobs(direct.pull()))
    proc.send_signal(signal.SIGTERM)
    try:
      code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack, into the log
      proc.wait(timeout=30)
      code = None
    assert code == 0, log.read_text()[-6000:]
  finally:
    proc.kill()
  no_token = subprocess.run([sys.executable, "-m", "rlax_ps", "relay", "--address=127.0.0.1:1"],
                            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
  assert no_token.returncode != 0 and "worker token" in no_token.stderr


def test_a_relay_may_follow_another_relay(server, trainer, start_relay, tmp_path):
  """Two tiers (a region's relay, a zone's relay behind it): each version still crosses
  from the server once, and leases pass through both to the server."""
  versions = publish_chain(trainer, 2)
  region = start_relay(server)
  zone = start_relay(region, storage_dir=str(tmp_path / "zone"))
  _until(lambda: zone.weights.latest == 1)
  with client_for(zone, "worker") as w:
    held = apply_blobs(w.pull())
    assert _same(held, apply_blobs([sync.encode(None, versions[1], "bf16",
                                                version=1).to_bytes()]))
    versions.append(perturbed(versions[-1], 0.05, seed=4))
    trainer.publish(sync.encode(versions[1], versions[2], "bf16", version=2).to_bytes())
    (delta,) = w.pull(have_version=1)  # the zone asks; the pull waits for it to arrive
    assert sync.Update.from_bytes(bytes(delta)).version == 2
    trainer.enqueue_prompts([pb.Prompt(id="p0", text="1+1=", token_ids=[1, 2])])
    w.register("two-tiers")
    assert [p.id for p in w.lease(1, deadline_s=30.0, wait_s=1.0).prompts] == ["p0"]
  _until(lambda: region.fetches == zone.fetches == 3)  # (the pulls may end first)
  assert server.servicer.bytes_served == region.bytes_fetched  # once from the server


def test_relays_in_tiers_stream_a_version_on_as_it_arrives(server, trainer, start_relay,
                                                           tmp_path):
  region = start_relay(server)
  upstream = _Upstream(region)
  zone = start_relay(region, storage_dir=str(tmp_path / "zone"))
  keyframe, out, puller = _held_back_pull(trainer, upstream, zone)
  assert region.weights.latest == zone.weights.latest == -1  # neither has stored it yet
  upstream.go.set()
  puller.join(timeout=20)
  assert [bytes(b) for b in out[0]] == [keyframe]
  _until(lambda: zone.weights.latest == 0)


def test_a_relay_whose_token_the_server_refuses_does_not_start(server, tmp_path):
  config = RelayConfig(storage_dir=str(tmp_path / "relay"), port=0, chunk_bytes=CHUNK)
  upstream = ParamServerClient(server.address, token="wrong", role="worker", timeout_s=10.0,
                               retry=RetryPolicy(deadline_s=5.0))
  with pytest.raises(relay_module.UpstreamRefused, match="refused the relay's worker token"):
    WeightRelay(config, upstream, "wrong").start()


def test_rlax_ps_relay_with_a_wrong_token_exits_at_once_saying_so(server, tmp_path):
  r = subprocess.run(
      [sys.executable, "-m", "rlax_ps", "relay", f"--address={server.address}", "--port=0",
       "--token=wrong", f"--storage_dir={tmp_path / 'relay'}"],
      cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
  assert r.returncode == 1, r.stderr[-2000:]
  assert "refused the relay's worker token" in r.stderr and "UNAUTHENTICATED" in r.stderr
  assert "Traceback" not in r.stderr


def test_a_relay_that_cannot_follow_its_server_sends_workers_to_the_server(
    server, trainer, tmp_path):
  """A relay whose server is unreachable answers UNAVAILABLE naming that, never a verdict on
  the worker's token; a worker given ipv4:RELAY,SERVER then talks to the server."""
  from ports import free_port
  publish_chain(trainer, 1)
  config = RelayConfig(storage_dir=str(tmp_path / "relay"), port=0, chunk_bytes=CHUNK)
  nowhere = ParamServerClient(f"127.0.0.1:{free_port()}", token="wrong", role="worker",
                              timeout_s=2.0, retry=RetryPolicy(deadline_s=0.1))
  relay = WeightRelay(config, nowhere, "wrong").start()
  try:
    with client_for(relay, "worker", retry=RetryPolicy(deadline_s=0.1)) as w:
      with pytest.raises(ParamServerError) as down:
        w.latest_version()
    assert down.value.code == grpc.StatusCode.UNAVAILABLE
    assert "cannot follow its server" in down.value.details
    with client_for(f"ipv4:127.0.0.1:{relay.port},127.0.0.1:{server.port}", "worker") as w:
      assert w.latest_version() == 0
      w.register("fell-back")
      assert w.heartbeat(version=0).latest_version == 0
  finally:
    relay.stop(grace=0)


def test_a_relay_that_refused_an_update_fetches_anew_from_a_keyframe(server, trainer,
                                                                     start_relay):
  """An update the relay's store refuses (a delta on other weights of its base: a server
  restored from a backup) is not fetched again the same way for ever: the next fetch pulls
  the server's latest from its keyframe."""
  from param_server import errors
  publish_chain(trainer, 3)
  store_commit, refused, starts = WeightStore.commit, [], []

  def refuse_the_first_delta(store, writer):
    if store is not server.weights and not refused and store.latest == 0:
      refused.append(1)
      raise errors.FailedPrecondition("base_version", "sealed other weights")
    return store_commit(store, writer)

  stream_pull = ParamServerClient.stream_pull

  def noted(client, have, **kwargs):
    starts.append(have)
    return stream_pull(client, have, **kwargs)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(WeightStore, "commit", refuse_the_first_delta)
    mp.setattr(ParamServerClient, "stream_pull", noted)
    relay = start_relay(server, poll_s=0.2)
    _until(lambda: relay.weights.latest == 2)
  assert refused and starts[-1] is None and 0 not in starts[starts.index(None, 1):]


def publish_after(trainer, weights, version, seeds, scale):
  """Deltas after `weights` (version `version`), one a seed: versions version+1, ..."""
  for seed in seeds:
    weights, old = perturbed(weights, scale, seed=seed), weights
    version += 1
    trainer.publish(sync.encode(old, weights, "bf16", version=version,
                                base_version=version - 1).to_bytes())


def test_a_refused_update_whose_keyframe_is_behind_what_the_relay_holds_sends_workers_to_the_server(
    server, trainer, start_relay):
  """Refused v3 while holding v2 (the server's keyframe v0): fetching anew from that keyframe
  was refused too, every second, while the relay answered pulls as if current: workers
  stayed on v2. It stops following and sends them to the server."""
  from param_server import errors
  publish_chain(trainer, 4)
  store_commit, refused = WeightStore.commit, []

  def refuse_v3_once(store, writer):
    if store is not server.weights and not refused and store.latest == 2:
      refused.append(1)
      raise errors.FailedPrecondition("base_version", "sealed other weights")
    return store_commit(store, writer)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(WeightStore, "commit", refuse_v3_once)
    relay = start_relay(server, poll_s=0.2, max_wait_s=2.0)
    _until(lambda: relay.diverged)
  assert refused and relay.weights.latest == 2 and "cannot follow the v2" in relay.diverged
  assert RELAY_DOWN in relay.upstream_down()
  with client_for(f"ipv4:127.0.0.1:{relay.port},127.0.0.1:{server.port}", "worker",
                  retry=RetryPolicy(deadline_s=5.0)) as w:
    assert [u.version for u in w.pull_updates(2)] == [3]


def test_an_answer_asked_before_a_version_watch_announced_does_not_lower_the_servers_latest(
    server, trainer, start_relay):
  """The server answers v1; v2 is published and announced by Watch before the answer is
  read: the late answer set the server's latest back to v1, and until the next version (or
  poll_s) the relay neither fetched v2 nor passed it on as it arrived."""
  versions = publish_chain(trainer, 2)
  relay = start_relay(server, poll_s=30.0)
  _until(lambda: relay.weights.latest == 1)
  ask, announced = relay._ask_upstream, []

  def ask_while_watch_announces(retry=None):
    latest = ask(retry)
    fetch, relay._fetch = relay._fetch, lambda: announced.append(relay.server_latest)
    try:  # (held back: v2 announced, not yet fetched when the answer lands)
      trainer.publish(sync.encode(versions[1], perturbed(versions[1], 0.05, seed=9), "bf16",
                                  version=2, base_version=1).to_bytes())
      _until(lambda: announced)
    finally:
      relay._fetch = fetch
    return latest

  relay._ask_upstream = ask_while_watch_announces
  relay._refreshed_at = 0.0
  relay.refresh()
  assert announced == [2] and relay.server_latest == 2 and not relay.diverged


def test_a_server_restored_from_a_backup_stays_refused_once_its_new_history_passes_the_relay(
    start_server, start_relay, tmp_path):
  """Same storage id, back at v1: refused while behind the relay's v3, then served again as
  the new history's v4 arrived, from the old history's chain (a worker got the old v3)."""
  import shutil
  storage = tmp_path / "ps"
  server = start_server(storage_dir=storage)
  with client_for(server, "trainer") as trainer:
    versions = publish_chain(trainer, 2)
  port = server.port
  server.stop(grace=0)
  shutil.copytree(storage, tmp_path / "backup")  # at v1
  server = start_server(storage_dir=storage, port=port)
  with client_for(server, "trainer") as trainer:
    publish_after(trainer, versions[1], 1, [2, 3], scale=0.05)  # the old history
  relay = start_relay(server, poll_s=0.2)
  _until(lambda: relay.weights.latest == 3)
  server.stop(grace=0)
  shutil.rmtree(storage)
  shutil.copytree(tmp_path / "backup", storage)
  server = start_server(storage_dir=storage, port=port)
  _until(lambda: relay.diverged)
  with client_for(server, "trainer") as trainer:
    publish_after(trainer, versions[1], 1, [12, 13, 14], scale=0.3)  # a new one, to v4
  time.sleep(1.0)  # (polls past the new history's v4)
  assert relay.weights.latest == 3 and "older than the v3" in relay.diverged
  with client_for(relay, "worker", retry=RetryPolicy(deadline_s=0.0)) as w:
    with pytest.raises(ParamServerError) as down:
      w.pull()
  assert down.value.code == grpc.StatusCode.UNAVAILABLE and RELAY_DOWN in down.value.details


def test_a_relay_whose_metrics_port_is_taken_leaves_nothing_started(server, start_relay):
  import socket

  from param_server.server import CannotListen
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    with pytest.raises(CannotListen, match="--metrics_port"):
      start_relay(server, metrics_port=taken.getsockname()[1])
  assert start_relay(server, metrics_port=0).metrics_port  # the storage folder is free


def test_a_status_without_a_message_passed_through_says_what_failed():
  """An upstream status with no details (a proxy's, gRPC's own) reaches the worker naming
  the call and the server, not as an empty message."""
  class Refused(grpc.RpcError):
    def code(self):
      return grpc.StatusCode.PERMISSION_DENIED

    def details(self):
      return None

  def call(*args, **kwargs):
    raise Refused()

  upstream = type("Upstream", (), {"channel": type("Channel", (), {
      "unary_unary": lambda self, name: call})()})()
  handler = relay_module._passing("LeasePrompts", upstream, 30.0, "server:1")
  aborted = []

  class Context:
    def invocation_metadata(self):
      return []

    def time_remaining(self):
      return None

    def abort(self, code, details):
      aborted.append((code, details))

  handler.unary_unary(b"", Context())
  assert aborted == [(grpc.StatusCode.PERMISSION_DENIED,
                      "LeasePrompts via the relay to server:1: PERMISSION_DENIED")]


def test_long_polls_passed_through_a_relay_leave_it_threads_for_its_pulls(
    server, trainer, start_relay):
  """A relay passes its workers' leases to the server, a thread held for each one's wait:
  an idle group of workers held them all, and no pull or version query of theirs was
  answered. Past threads // 4 waiting, a lease goes on with no wait, its client waiting out
  the rest itself."""
  publish_chain(trainer, 1)
  relay = start_relay(server, threads=8)
  _until(lambda: relay.weights.latest == 0)
  done = []

  def idle_worker(i):
    with client_for(relay, "worker") as worker:
      worker.register(f"idle-{i}")
      t0 = time.monotonic()
      done.append((worker.lease(1, 30.0, wait_s=3.0).prompts, time.monotonic() - t0))

  threads = [threading.Thread(target=idle_worker, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  time.sleep(1.0)
  with client_for(relay, "worker", retry=RetryPolicy(deadline_s=0.0)) as asker:
    asker.timeout_s = 1.0
    assert asker.latest_version() == 0  # served by the relay: a thread was left for it
  for t in threads:
    t.join(timeout=30.0)
  assert len(done) == 4 and all(not prompts and waited >= 2.9 for prompts, waited in done)
