"""A peer that vanished without closing its connection (a preempted VM): the client's calls
fail UNAVAILABLE within its dead_after_s (a pull, which has no deadline, hung for ever), and
the server drops the vanished client's connection, ending its streams."""

import contextlib
import threading
import time

import pytest

from netem import Link
from param_server.client import ParamServerError, RetryPolicy
from ps_testlib import client_for, publish_chain


def test_a_pull_over_a_link_gone_silent_fails_unavailable_instead_of_hanging(server, trainer):
  publish_chain(trainer, 2)
  link = Link(server.port)
  try:
    with client_for(link.address, "worker", retry=RetryPolicy(deadline_s=0.0),
                    dead_after_s=2.0) as w:
      assert w.pull()  # the link passes bytes
      link.stalled.set()
      errors = []

      def pull():
        try:
          w.pull()
        except ParamServerError as e:
          errors.append(e)

      puller = threading.Thread(target=pull, daemon=True)
      puller.start()
      puller.join(timeout=40.0)  # a ping within 10 s (its least interval), 2 s for its answer
      assert not puller.is_alive(), "the pull still hangs on the silent link"
      assert len(errors) == 1 and errors[0].code.name == "UNAVAILABLE", errors
  finally:
    link.close()


@pytest.mark.slow
def test_the_server_ends_the_streams_of_a_client_gone_silent(start_server):
  server = start_server(dead_after_s=2.0)
  link = Link(server.port)
  try:
    with client_for(link.address, "worker", retry=RetryPolicy(deadline_s=0.0),
                    dead_after_s=600.0) as w:  # the client does not give up first
      watch = w.watch(after_version=-1, timeout_s=600.0)

      def follow():
        with contextlib.suppress(ParamServerError):  # the client closes at the test's end
          next(watch, None)

      threading.Thread(target=follow, daemon=True).start()
      end = time.monotonic() + 10.0
      while server.servicer.streams_open != 1:
        assert time.monotonic() < end, "the watch did not begin"
        time.sleep(0.05)
      link.stalled.set()
      end = time.monotonic() + 60.0  # a ping within 10 s, 2 s for its answer
      while server.servicer.streams_open:
        assert time.monotonic() < end, "the server still serves the vanished client's watch"
        time.sleep(0.2)
      with client_for(server, "viewer") as viewer:
        assert viewer.stats().streams_open == 0
  finally:
    link.close()
