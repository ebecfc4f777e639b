"""Pulls over slow, lossy links (tests/netem.py between a client and a server on 127.0.0.1),
as workers in another region meet them: a keyframe arrives whole however often the link
breaks, a failed pull is resumed by the next one, two pulls of the same version cross the
link once, and a pull does not hold up the worker's heartbeats and renewals."""

import threading
import time

import numpy as np
import pytest

from netem import Link
from param_server.client import ParamServerError, Prompt, PullProgress, RetryPolicy
from ps_testlib import client_for
from rlax_ps import sync

PULL_CHUNK = 64 << 10  # the server's Pull message: a link's cut loses at most one


@pytest.fixture
def keyframe(start_server):
  """(server, the bytes of a 1 MB keyframe it holds as v0), stored in one 4 MiB chunk (the
  default), sent in messages of PULL_CHUNK: a whole chunk a message never came through links
  that drop more often, and each pull began again."""
  server = start_server(chunk_bytes=4 << 20, pull_message_bytes=PULL_CHUNK,
                        max_chunk_bytes=PULL_CHUNK)
  weights = {"w": np.random.default_rng(0).normal(size=(512, 1024)).astype(np.float32)}
  blob = sync.encode(None, weights, "bf16", version=0).to_bytes()
  with client_for(server, "trainer", chunk_bytes=PULL_CHUNK) as trainer:
    trainer.publish(blob)
  return server, blob


def test_a_keyframe_arrives_whole_over_a_link_that_breaks_more_often_than_the_retry_deadline(
    keyframe):
  server, blob = keyframe
  with Link(server.port, rate_bytes_s=2e6, latency_s=0.02, cut_every_bytes=256 << 10) as link, \
       client_for(link.address, "worker", retry=RetryPolicy(deadline_s=0.3)) as w:
    progress = PullProgress()
    blobs = w.pull(None, progress=progress)  # breaks for 0.5 s in all: past the deadline
    assert [bytes(b) for b in blobs] == [blob]
    assert link.cuts >= 3 and progress.attempts >= 3  # broken, resumed, ...
    assert progress.resumed_bytes > 0 and link.bytes_down < 1.5 * len(blob)  # not restarted


def test_a_pull_that_gave_up_is_resumed_by_the_next_one_not_begun_again(keyframe):
  server, blob = keyframe
  with Link(server.port, rate_bytes_s=4e6, cut_every_bytes=300 << 10) as link, \
       client_for(link.address, "worker", retry=RetryPolicy(deadline_s=0.0)) as w:
    failures = []
    for _ in range(10):  # each call: one attempt, broken by the link
      try:
        blobs = w.pull(None)
        break
      except ParamServerError as e:
        failures.append(e)
    else:
      pytest.fail(f"the pull began again each time: {len(failures)} failures, "
                  f"{link.bytes_down} bytes crossed the link for a {len(blob)}-byte keyframe")
    assert [bytes(b) for b in blobs] == [blob]
    assert failures and all(e.code.name == "UNAVAILABLE" for e in failures)
    assert link.bytes_down < 1.5 * len(blob)


def test_a_pull_broken_mid_stream_is_not_blamed_on_tls(keyframe):
  server, _ = keyframe
  with Link(server.port, rate_bytes_s=4e6, cut_every_bytes=300 << 10) as link, \
       client_for(link.address, "worker", retry=RetryPolicy(deadline_s=0.0)) as w:
    with pytest.raises(ParamServerError) as e:
      w.pull(None)
    assert e.value.code.name == "UNAVAILABLE" and "tls" not in str(e.value).lower(), e.value


def test_two_pulls_of_the_same_version_at_once_cross_the_link_once(keyframe):
  server, blob = keyframe
  with Link(server.port, rate_bytes_s=2e6) as link, client_for(link.address, "worker") as w:
    got = []
    first = threading.Thread(target=lambda: got.append(w.pull(None)))
    first.start()
    while not link.bytes_down:  # the first pull is under way
      time.sleep(0.01)
    got.append(w.pull(None))  # the worker's loop catching up while its prefetch pulls
    first.join()
    assert [[bytes(b) for b in blobs] for blobs in got] == [[blob], [blob]]
    assert link.bytes_down < 1.5 * len(blob)


def test_heartbeats_and_renewals_do_not_wait_behind_a_pull(keyframe):
  """On one connection a heartbeat's answer queues behind the pull's bytes (seconds on a
  slow link); pulls take a connection of their own."""
  server, blob = keyframe
  with client_for(server, "trainer") as trainer:
    trainer.enqueue_prompts([Prompt(id="p0", text="hi")])
  with Link(server.port, rate_bytes_s=1e6, latency_s=0.02) as link, \
       client_for(link.address, "worker", retry=RetryPolicy(deadline_s=0.0)) as w:
    w.register("far-away")
    lease = w.lease(1, deadline_s=60.0)
    got = []
    puller = threading.Thread(target=lambda: got.append(w.pull(None)))
    puller.start()
    while link.bytes_down < 200 << 10:  # the pull is under way
      time.sleep(0.01)
    link.stalled_connections.add(link.busiest())  # the pull's bytes stop crossing
    try:
      w.timeout_s = 2.0  # a call held behind the stalled pull fails DEADLINE_EXCEEDED
      assert w.heartbeat(-1).latest_version == 0
      assert w.renew(lease, 60.0).prompts
    finally:
      link.stalled_connections.clear()
    puller.join()
    assert [bytes(b) for b in got[0]] == [blob]
