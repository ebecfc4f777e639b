"""A client retrying an unreachable or stalled server says so at once, and a stop request
ends its wait at once (a worker told to stop holds nothing up)."""

import threading

from param_server import client as client_module
from netem import Link
from param_server.client import ParamServerClient, ParamServerError, RetryPolicy
from ports import free_port
from ps_testlib import TOKENS


def test_the_first_failed_attempt_is_logged_and_a_stop_ends_the_retrying(monkeypatch):
  said, first = [], threading.Event()

  def warning(msg, *args):
    said.append(msg % args)
    first.set()

  monkeypatch.setattr(client_module.logging, "warning", warning)
  c = ParamServerClient(f"127.0.0.1:{free_port()}", token="t", role="worker", timeout_s=1.0,
                        retry=RetryPolicy(initial_s=5.0, max_s=5.0, deadline_s=3600.0))
  errors = []

  def call():
    try:
      c.latest_version()
    except ParamServerError as e:
      errors.append(e)

  caller = threading.Thread(target=call, daemon=True)
  caller.start()
  try:
    assert first.wait(60), "the first failed attempt was not logged"
    assert "GetLatest failed (UNAVAILABLE" in said[0] and "retrying for up to 3600s" in said[0]
    c.interrupt.set()
    caller.join(60)  # a guard against a hang, not a measure: the retry deadline is an hour
    assert not caller.is_alive() and len(errors) == 1
    assert "stop requested while retrying" in str(errors[0])
    assert len(said) == 1  # the rate cap: one line for the whole outage so far
  finally:
    c.interrupt.set()
    c.close()


def test_a_call_that_ran_past_its_deadline_is_tried_again(server):
  """A server that stalls for longer than a call's timeout (here its link freezes for a few
  seconds) fails the attempt DEADLINE_EXCEEDED; the client tries again, as for UNAVAILABLE,
  instead of ending the trainer that called it."""
  link = Link(server.port)
  try:
    with ParamServerClient(link.address, token=TOKENS["viewer"], role="viewer", timeout_s=1.0,
                           retry=RetryPolicy(deadline_s=60.0)) as c:
      assert c.latest_version() == -1
      link.stalled.set()
      threading.Timer(2.5, link.stalled.clear).start()
      assert c.stats().versions.latest_version == -1
  finally:
    link.close()


def test_the_retry_deadline_counts_from_the_call_not_its_first_failure(monkeypatch):
  """A first attempt that took longer than deadline_s leaves no retry (the deadline ran
  from when the waits were asked for, before the attempt)."""
  clock = [100.0]
  monkeypatch.setattr("param_server.client.time.monotonic", lambda: clock[0])
  waits = RetryPolicy(deadline_s=0.5).delays()
  clock[0] += 1.0  # the first attempt
  assert next(waits, None) is None
  waits = RetryPolicy(deadline_s=2.0).delays()
  clock[0] += 1.0
  assert 0 <= next(waits) <= 1.0
