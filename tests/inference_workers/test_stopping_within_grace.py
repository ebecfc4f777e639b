"""Stopping against a server that does not answer: every call made on the way out gets at
most the grace period left, none is made once it is spent, and the watchdog leaves by the
grace period's end whatever the server does (the leases' expiry serves what was not
released)."""

import dataclasses
import threading
import types

import grpc
import pytest

from inference_workers import loop
from inference_workers.loop import Worker
from inference_workers.worker_config import WATCHDOG_LEAD_S, WorkerConfig
from param_server.client import ParamServerError
from param_server.protos import param_server_pb2 as pb
from param_server.server import ParamServer, ParamServerServicer, ServerConfig
from worker_testlib import CONFIG, SMALL, TOKENIZER, TOKENS, client

DEFAULT_TIMEOUT_S = 30.0  # the client's own call timeout


class FakeClock:
  def __init__(self, now: float = 1000.0):
    self.now = now

  def __call__(self) -> float:
    return self.now

  def advance(self, seconds: float) -> None:
    self.now += seconds


@dataclasses.dataclass
class Call:
  method: str
  args: tuple
  timeout_s: float
  at: float


class SlowServerClient:
  """A worker's client whose server takes `delay_s` to answer each call (math.inf: it is
  stopped, as by SIGSTOP): a call ends after min(delay_s, its timeout) on the fake clock,
  failing DEADLINE_EXCEEDED when the timeout came first. `refuse_whole`: a release of more
  than one prompt is refused at once (as when one was answered meanwhile)."""

  def __init__(self, clock: FakeClock, delay_s: float, refuse_whole: bool = False):
    self.clock, self.delay_s, self.refuse_whole = clock, delay_s, refuse_whole
    self.timeout_s = DEFAULT_TIMEOUT_S
    self.calls: list[Call] = []

  def _call(self, method, *args, answer=None):
    self.calls.append(Call(method, args, self.timeout_s, self.clock()))
    self.clock.advance(min(self.delay_s, self.timeout_s))
    if self.delay_s > self.timeout_s:
      raise ParamServerError(method, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    return answer

  def release(self, lease_id, prompt_ids=(), partial=()):
    if self.refuse_whole and len(prompt_ids) > 1:
      self.calls.append(Call("release", (lease_id, prompt_ids), self.timeout_s, self.clock()))
      raise ParamServerError("ReleaseLease", grpc.StatusCode.FAILED_PRECONDITION,
                             "a prompt of the lease was answered")
    return self._call("release", lease_id, list(prompt_ids), answer=len(prompt_ids))

  def submit_rollouts(self, lease_id, group):
    return self._call("submit_rollouts", lease_id, group.prompt_id)

  def complete(self, lease_id):
    return self._call("complete", lease_id, answer=0)


@pytest.fixture
def clock(monkeypatch):
  clock = FakeClock()
  monkeypatch.setattr(loop, "time", types.SimpleNamespace(monotonic=clock))
  # The watchdog waits in real time: its own test below runs it.
  monkeypatch.setattr(Worker, "_watchdog", lambda self, grace: None)
  return clock


def stopping_worker(client_, grace_s=25.0, leases=2, prompts=8):
  worker = Worker(client_, CONFIG, TOKENIZER, WorkerConfig(**SMALL, grace_s=grace_s))
  worker._inflight = {f"lease{i}": {f"l{i}p{j}" for j in range(prompts)} for i in range(leases)}
  worker.request_stop()
  return worker


def assert_within_grace(calls, end):
  """Each call was given no more than the grace left when it started, and none started
  once the grace was spent."""
  for call in calls:
    assert call.at < end, call
    assert call.timeout_s <= end - call.at, call


def test_the_watchdogs_release_at_a_stopped_server_ends_with_the_grace_period(clock):
  # The audit's case: --grace_s=25, the server SIGSTOPped, the watchdog releasing one second
  # before the end. The first release waits out the last second; nothing more is sent, no
  # one-by-one retry: the leases expire and their prompts are served again.
  fake = SlowServerClient(clock, delay_s=float("inf"))
  worker = stopping_worker(fake)
  end = clock() + 25.0
  clock.advance(25.0 - WATCHDOG_LEAD_S)
  assert worker._release_all() == 0
  assert [(c.method, c.args[0], c.timeout_s) for c in fake.calls] == [
      ("release", "lease0", WATCHDOG_LEAD_S)]
  assert clock() == end
  assert not any(worker._inflight.values())  # left to the leases' expiry


def test_a_slow_server_gets_each_release_with_the_grace_left_until_it_is_spent(clock):
  # Each call takes 4 s and is answered: all of the first lease goes back, the second lease's
  # call is given what is left and fails, the third's is never sent.
  fake = SlowServerClient(clock, delay_s=4.0)
  worker = stopping_worker(fake, leases=3)
  end = clock() + 25.0
  clock.advance(19.0)
  assert worker._release_all() == 8
  assert [(c.args[0], c.timeout_s) for c in fake.calls] == [("lease0", 6.0), ("lease1", 2.0)]
  assert_within_grace(fake.calls, end)
  assert worker.stats.prompts_released == 8


def test_one_by_one_releases_stop_once_the_grace_is_spent(clock):
  # The whole-lease release is refused (a prompt was answered meanwhile): the prompts go
  # one call each, each given the grace left, until it is spent; the rest expire.
  fake = SlowServerClient(clock, delay_s=4.0, refuse_whole=True)
  worker = stopping_worker(fake, leases=2, prompts=8)
  end = clock() + 25.0
  clock.advance(15.0)
  assert worker._release_all() == 2
  singles = [c for c in fake.calls if len(c.args[1]) == 1]
  assert [c.timeout_s for c in singles] == [10.0, 6.0, 2.0]
  assert len(fake.calls) == 1 + 3  # nothing of lease1: the grace was spent
  assert_within_grace(fake.calls, end)


def test_a_stopped_server_ends_the_worker_s_own_release_calls_by_the_grace_end(clock):
  # The main thread's way out: releasing the prompts not started, then settling a lease
  # whose groups were submitted (complete), all against a stopped server.
  fake = SlowServerClient(clock, delay_s=float("inf"))
  worker = stopping_worker(fake, leases=0)
  worker._inflight = {"a": {"a0", "a1"}, "b": {"b0"}, "c": set()}
  worker._pending.extend([("a", pb.Prompt(id="a0")), ("a", pb.Prompt(id="a1")),
                          ("b", pb.Prompt(id="b0"))])
  end = clock() + 25.0
  clock.advance(20.0)
  worker._release_pending()  # lease a's call waits out the grace; lease b's is not sent
  worker._settle("c")
  assert [(c.method, c.args[0], c.timeout_s) for c in fake.calls] == [("release", "a", 5.0)]
  assert clock() == end
  assert worker._inflight == {}  # nothing left to try: the leases expire


def test_a_group_submitted_while_stopping_gets_the_grace_left(clock):
  fake = SlowServerClient(clock, delay_s=1.0)
  worker = stopping_worker(fake, leases=1)
  clock.advance(23.5)
  worker._submit("lease0", "l0p0", pb.RolloutGroup(prompt_id="l0p0"))  # answered in 1 s
  for pid in ("l0p1", "l0p2"):  # times out at the grace end; then not sent at all
    with pytest.raises(ParamServerError, match="DEADLINE_EXCEEDED"):
      worker._submit("lease0", pid, pb.RolloutGroup(prompt_id=pid))
  assert [(c.args[1], c.timeout_s) for c in fake.calls] == [("l0p0", 1.5), ("l0p1", 0.5)]
  assert worker._inflight["lease0"] == {f"l0p{j}" for j in range(1, 8)}


def test_the_watchdog_leaves_by_the_grace_end_while_a_release_never_returns(monkeypatch):
  """A server that answers nothing, not even past its deadline: the watchdog's release is
  given at most the last WATCHDOG_LEAD_S and the worker exits without waiting for it."""
  exits, exited, unblock = [], threading.Event(), threading.Event()
  calls = []

  class HangingClient:
    timeout_s = DEFAULT_TIMEOUT_S

    def release(self, lease_id, prompt_ids=(), partial=()):
      calls.append(self.timeout_s)
      unblock.wait(60)
      raise ParamServerError("ReleaseLease", grpc.StatusCode.DEADLINE_EXCEEDED, "late")

  def fake_exit(code=0):
    exits.append((code, unblock.is_set()))
    exited.set()

  monkeypatch.setattr(loop, "exit_now", fake_exit)
  worker = Worker(HangingClient(), CONFIG, TOKENIZER,
                  WorkerConfig(**dict(SMALL, grace_s=1.5, salvage_s=0)))
  worker._inflight = {"lease0": {"p0", "p1"}}
  try:
    worker.request_stop()
    assert exited.wait(30), "the watchdog did not exit"  # a guard against a hang only
  finally:
    unblock.set()
    worker._done.set()
  assert exits == [(0, False)]  # it left while the release was still hanging
  assert len(calls) == 1 and 0 < calls[0] <= WATCHDOG_LEAD_S


@pytest.fixture
def stalled_release_server(tmp_path, monkeypatch):
  """A real parameter server whose ReleaseLease hangs (the deadline each call arrived with
  is recorded) until the test ends."""
  seen, unblock = [], threading.Event()

  def stalled(self, request, context):
    seen.append(context.time_remaining())
    unblock.wait(60)
    return pb.ReleaseLeaseReply()

  monkeypatch.setattr(ParamServerServicer, "ReleaseLease", stalled)
  server = ParamServer(ServerConfig(
      storage_dir=str(tmp_path / "ps"), port=0, compact_in_background=False, threads=8,
      wal_fsync=False, **{f"{r}_token": t for r, t in TOKENS.items()})).start()
  try:
    yield server, seen
  finally:
    unblock.set()
    server.stop(grace=0)


def test_a_real_client_s_release_arrives_with_the_grace_left_as_its_deadline(
    stalled_release_server, monkeypatch):
  # The client's release takes no timeout: the worker cuts the client's default for it.
  server, seen = stalled_release_server
  monkeypatch.setattr(Worker, "_watchdog", lambda self, grace: None)
  with client(server, "worker") as wc:
    wc.register("w")
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**dict(SMALL, grace_s=2.0,
                                                               salvage_s=0)))
    worker._inflight = {"lease0": {"p0", "p1", "p2"}}
    worker.request_stop()
    assert worker._release_all() == 0  # DEADLINE_EXCEEDED; no one-by-one retry
    assert wc.timeout_s <= 2.0  # cut from its own 10 s (run() restores it on the way out)
  # What reached the server: the grace left, not the client's 10 s (gRPC's timeout header
  # may round it up by a few milliseconds).
  assert len(seen) == 1 and 0 < seen[0] < 2.5


def test_a_stop_ends_the_client_s_retrying_of_an_unreachable_server(monkeypatch):
  # The worker's client retries an unreachable server for up to an hour; request_stop (not
  # only `rlax-ps worker`'s signal thread) ends that wait at once.
  from param_server.client import ParamServerClient, RetryPolicy
  from ports import free_port
  monkeypatch.setattr(Worker, "_watchdog", lambda self, grace: None)
  with ParamServerClient(f"127.0.0.1:{free_port()}", token="t", timeout_s=1.0,
                         retry=RetryPolicy(initial_s=2.0, max_s=2.0, deadline_s=3600.0)) as wc:
    worker = Worker(wc, CONFIG, TOKENIZER, WorkerConfig(**SMALL))
    errors = []
    caller = threading.Thread(target=lambda: errors.append(
        pytest.raises(ParamServerError, wc.latest_version)), daemon=True)
    caller.start()
    worker.request_stop()
    caller.join(60)  # a guard against a hang: the retries would last an hour
    assert not caller.is_alive() and "stop requested" in str(errors[0].value)
