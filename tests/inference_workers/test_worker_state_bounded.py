"""A long-running worker's bookkeeping stays bounded: nothing is kept for leases it settled."""

import threading
import types

from inference_workers.loop import Worker


def test_a_lease_settled_while_its_renewal_is_in_flight_leaves_no_deadline_behind():
  """The heartbeat renews a lease while the decode loop submits its last group and settles
  it (forgetting its deadline): the renewal's answer must not bring the entry back, or every
  such race keeps one for the worker's lifetime."""
  worker = types.SimpleNamespace(
      config=types.SimpleNamespace(lease_deadline_s=60.0), _lock=threading.Lock(),
      _checkpoint={}, _lease_deadline={"done": 0.0, "open": 0.0},
      _inflight={"done": {"p0"}, "open": {"p1"}})

  def renew(lease_id, partial):
    if lease_id == "done":  # settled by the decode loop during the call (Worker._settle)
      worker._inflight.pop("done")
      worker._lease_deadline.pop("done")

  worker._renew = renew
  Worker._renew_leases(worker)
  assert set(worker._lease_deadline) == {"open"}
  assert worker._lease_deadline["open"] > 0.0


def test_a_lease_the_server_no_longer_holds_is_abandoned_on_settling():
  """Settling a lease that a server no longer holds (expired, or the server lost its
  storage): NOT_FOUND is logged and the worker goes on, holding nothing of the lease."""
  import contextlib

  import grpc

  from param_server.client import ParamServerError
  calls = []

  def rpc(method, *args):
    calls.append(method)
    raise ParamServerError("ReleaseLease", grpc.StatusCode.NOT_FOUND, "lease_id: no lease 'x'")

  worker = types.SimpleNamespace(
      _pending=[], _started={}, _scoring={}, _lock=threading.Lock(), _inflight={"x": {"p0"}},
      _lease_deadline={"x": 0.0}, _abandoned=set(), _rpc=rpc, _with_backoff=lambda fn: fn(),
      stats=types.SimpleNamespace(prompts_released=0, time=types.SimpleNamespace(
          span=lambda name: contextlib.nullcontext())))
  Worker._settle(worker, "x")
  assert calls == ["release"] and worker._inflight == {} and worker._lease_deadline == {}


def test_the_versions_applied_are_counted_and_the_last_ones_kept():
  """Every version applied was kept in a list as long as the run (and logged whole at the
  worker's exit: 53 KB after 9,000 versions)."""
  from inference_workers.loop import VERSIONS_KEPT, WorkerStats
  applied = []
  worker = types.SimpleNamespace(stats=WorkerStats(), _beat_now=threading.Event(),
                                 policy=types.SimpleNamespace(apply=applied.append))
  n = VERSIONS_KEPT + 100
  Worker._apply_all(worker, [types.SimpleNamespace(version=v) for v in range(n)])
  assert len(applied) == n and worker.stats.updates_applied == n
  assert worker.stats.versions_applied == list(range(100, n))
