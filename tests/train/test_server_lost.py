"""A parameter server that lost what it held (its storage folder lost or replaced) behind the
same address: the trainer notices by the server's storage id, feeds it again the prompts it
had fed and not trained on, sends it the latest version as a keyframe and trains on; at a
restart too. Unit tests on a fake server, and (slow) a real server replaced mid-run."""

import os
import socket
import threading
import types
from unittest import mock

import pytest

import grpc

from param_server.client import ParamServerError, Take, make_sample
from param_server.protos import param_server_pb2 as pb
from rl_testlib import FakeWorker, client, rl_config, start_server
from rlax_ps.train.rl import PendingTake, RLTrainer


class FakeServer:
  """Answers each take with one group of the oldest prompt fed to it and not yet answered,
  with its storage id; `lose()` forgets everything, as a new storage folder would."""

  def __init__(self):
    self.address = "fake:1"
    self.store, self.fed, self.taken, self.acked, self.takes = "store-a", [], 0, [], 0
    self.latest = 3

  def lose(self):
    self.store, self.fed, self.taken, self.latest = "store-b", [], 0, -1

  def enqueue_prompts(self, prompts):  # as the server: an id it holds already is skipped
    held = {p.id for p in self.fed}
    self.fed.extend(p for p in prompts if p.id not in held)

  def take_rollouts(self, min_version, max_n, **kwargs):
    self.takes += 1
    assert self.takes <= 40, "the step took too many times"
    if min_version > max(self.latest, 0):  # as the server: no group can be that new
      raise ParamServerError("TakeRollouts", grpc.StatusCode.FAILED_PRECONDITION,
                             f"min_version: expected at most v{self.latest}")
    if self.taken == len(self.fed):
      return Take("", [], 0, self.store)
    prompt = self.fed[self.taken]
    self.taken += 1
    group = pb.RolloutGroup(prompt_id=prompt.id, policy_version=min_version, samples=[
        make_sample([5, 6], float(j % 2), logprobs=[-1.0, -1.0]) for j in range(4)])
    return Take(f"{self.store}-t{self.taken}", [pb.TakenRollout(
        rollout_id=self.taken, prompt=prompt, group=group)], 0, self.store)

  def version_info(self):
    return pb.VersionInfo(latest_version=self.latest, store_id=self.store)

  def latest_version(self):
    return self.latest

  def ack(self, take_id):
    self.acked.append(take_id)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
  config = rl_config("tiny")
  config.rl.max_staleness = 1
  server = FakeServer()
  with RLTrainer(config, str(tmp_path_factory.mktemp("rl")), server) as tr:
    yield tr, server


def _fresh(tr, server):
  """The trainer and the server as after a first step's takes from store-a."""
  server.__init__()
  tr.store_id, tr.outstanding, tr.pending, tr.servers_lost = "", {}, [], 0
  tr.consumed = tr.feed.position - tr.retired  # nothing outstanding from an earlier test
  groups = tr._take_groups()
  tr.pending = [PendingTake(f"store-a-t{i + 1}", [i + 1], tr.step) for i in range(server.taken)]
  return groups


def test_a_server_that_lost_its_queues_is_fed_again_and_gets_the_weights(trainer):
  tr, server = trainer
  step1 = _fresh(tr, server)
  per_step = tr.shape.groups
  assert len(step1) == per_step and tr.store_id == "store-a"
  waiting = [p.id for p in server.fed[server.taken:]]  # fed, not yet sampled
  assert len(waiting) == per_step * tr.max_staleness and set(tr.outstanding) == set(waiting)
  resent = []
  tr.publisher = types.SimpleNamespace(
      version=3, resend_keyframe=lambda: (resent.append(len(server.fed)),
                                          setattr(server, "latest", 3)))
  tr.skip_ids, tr.skip_prompts = {1}, {"p-x": 1}  # the lost server's rollout ids
  server.lose()  # the trainer's first take asks it for v2 or newer: refused
  step2 = tr._take_groups()
  assert tr.skip_ids == set() and tr.skip_prompts == {}  # (the new one numbers from 1)
  # The new server was fed the prompts the lost one held (beside new ones) and answered the
  # next step from its own queue; the latest version went to it as a keyframe, first.
  fed = [p.id for p in server.fed]
  assert set(waiting) <= set(fed)
  assert [g.rollout_id for g in step2] == list(range(1, per_step + 1)) == list(range(
      1, server.taken + 1))
  # Before any prompt: a worker leasing one first would sample it with the old weights.
  assert resent == [0] and tr.servers_lost == 1 and tr.store_id == "store-b"
  # The lost server's takes are not acknowledged (or kept): only the new one's are pending.
  assert all(t.take_id.startswith("store-b") for t in tr.pending)
  # What a checkpoint keeps of it, and gives back.
  saved = tr.metadata()
  assert saved["server_store"] == "store-b"
  assert sorted(saved["outstanding"]) == sorted(tr.outstanding.values())
  outstanding = dict(tr.outstanding)
  tr.outstanding, tr.store_id = {}, ""
  tr._load_metadata(saved)
  assert tr.outstanding == outstanding and tr.store_id == "store-b"


@pytest.mark.parametrize("store", ["store-b", ""])
def test_a_restart_on_a_server_that_lost_its_queues_feeds_it_again_and_acks_nothing(
    trainer, store, caplog):
  """Known by another storage id, or (a server without ids) by a latest version below the
  checkpoint's. The restored weights go above any version the run published (workers may
  hold the lost server's newest)."""
  tr, server = trainer
  _fresh(tr, server)
  waiting = [p.id for p in server.fed[server.taken:]]
  tr.saved_version = 7
  server.lose()
  server.store = store
  with open(os.path.join(tr.workdir, "versions.jsonl"), "w") as f:
    f.write('{"version": 11}\n{"version": 12}\n{"vers')  # the last line torn by a kill
  tr.publisher = types.SimpleNamespace(version=None)  # a restart: nothing published yet
  try:
    with caplog.at_level("WARNING"):
      assert tr._server_start() == 13
    assert "sending the next version as a keyframe" in caplog.text  # (it said v-1)
  finally:
    os.remove(os.path.join(tr.workdir, "versions.jsonl"))
  assert server.acked == [] and tr.pending == []
  assert sorted(p.id for p in server.fed) == sorted(waiting)
  assert tr.store_id == (store or "store-a") and tr.servers_lost == 1


def test_a_restart_on_the_same_server_acknowledges_and_feeds_only_what_it_lacks(trainer):
  """The prompts outstanding are fed again: the server skips those it holds, and takes one
  a stop cut the enqueue of short (its record was skipped for the epoch, and counted in
  flight for good)."""
  tr, server = trainer
  _fresh(tr, server)
  lost = server.fed.pop()  # outstanding, never enqueued
  assert lost.id in tr.outstanding
  fed, pending = len(server.fed), [t.take_id for t in tr.pending]
  tr.saved_version = 3
  assert tr._server_start() == 4
  assert server.acked == pending and tr.servers_lost == 0
  assert len(server.fed) == fed + 1 and server.fed[-1].id == lost.id


def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_a_run_whose_server_is_replaced_by_an_empty_one_trains_to_the_end(tmp_path):
  """The server is stopped after step 2 and an empty one (another storage folder) starts on
  its address: the run trains every step, on groups of the new server once it is fed, and
  the new server holds the trainer's last version."""
  port = _port()

  def start(folder):
    return start_server(tmp_path / folder, port)

  first = start("ps1")
  worker = FakeWorker(first.address, samples=4).start()
  config = rl_config("tiny")
  config.rl.steps = 5
  out = {}
  with client(first.address, "trainer") as tc, RLTrainer(config, str(tmp_path / "rl"), tc) as tr:
    thread = threading.Thread(target=lambda: out.update(summary=tr.train()), daemon=True)
    thread.start()
    steps = tmp_path / "rl" / "steps.jsonl"  # read here, not tr.state: each step donates it
    while (not steps.exists() or len(steps.read_text().splitlines()) < 2) and thread.is_alive():
      thread.join(0.1)
    worker.stop()
    first.stop(grace=0)
    second = start("ps2")
    worker2 = FakeWorker(second.address, samples=4, seed=1).start()
    thread.join(120)
    assert not thread.is_alive()
    worker2.stop()
  try:
    summary = out["summary"]
    assert summary["step"] == 5 and summary["servers_lost"] == 1
    with client(second.address, "viewer") as vc:
      assert vc.latest_version() == summary["version"]
    assert set(worker2.submitted)  # the new server's groups were trained on
  finally:
    second.stop(grace=0)
  assert os.path.exists(tmp_path / "ps2" / "STORE")


def test_a_stop_in_the_take_round_that_met_a_lost_server_undoes_the_round(trainer):
  """The round took a group from the server, the server was lost (fed the prompts
  outstanding then), a group came from the new one, then a stop: the counts and the prompts
  outstanding are as before the round (new ones aside), and the first group's prompt (which the new server
  never held) is fed to it, so that the restart trains on every prompt once."""
  tr, server = trainer
  _fresh(tr, server)
  assert tr.shape.groups >= 2
  counts, outstanding = tr.counts(), dict(tr.outstanding)
  tr.publisher = types.SimpleNamespace(
      version=3, resend_keyframe=lambda: setattr(server, "latest", 3))
  take, calls = server.take_rollouts, []

  def take_then_lose_then_stop(min_version, max_n, **kwargs):
    calls.append(server.store)
    if len(calls) == 3 + (tr.shape.groups > 2):  # a group of each server's taken: stop
      tr._stop.set()
      raise ParamServerError("TakeRollouts", grpc.StatusCode.UNAVAILABLE, "gone")
    answer = take(min_version, max_n, **kwargs)
    if len(calls) == 1:
      first.append(answer.rollouts[0].prompt.id)
      server.lose()
    return answer

  first = []
  server.take_rollouts = take_then_lose_then_stop
  try:
    assert tr._take_groups() is None
  finally:
    del server.take_rollouts
    tr._stop.clear()
  assert calls[:2] == ["store-a", "store-b"] and tr.servers_lost == 1
  # (more prompts were fed in the round: outstanding too)
  assert tr.counts() == {**counts, "servers_lost": 1}
  assert tr.outstanding.items() >= outstanding.items() and first[0] in outstanding
  fed = [p.id for p in server.fed]  # the new server holds every prompt outstanding, once
  assert first[0] in fed and len(fed) == len(set(fed)) and set(fed) == set(tr.outstanding)


def test_a_prompt_of_a_take_not_yet_acknowledged_that_comes_again_is_not_trained_twice(trainer):
  """The takes of the last step wait for its checkpoint; their groups requeued (ack deadline
  passed), dropped as stale and their prompts sampled again come under new rollout ids: the
  take round skips them (its pending takes' prompts), not only _valid_groups when told."""
  tr, server = trainer
  first = _fresh(tr, server)
  tr.pending = [PendingTake(f"store-a-t{i + 1}", [i + 1], tr.step + 1, [server.fed[i].id])
                for i in range(server.taken)]
  came_back, again_ids = tr.came_back, {g.prompt_id for g in first}
  server.taken = 0  # the server serves the step's prompts again
  step2 = tr._take_groups()
  assert len(step2) == tr.shape.groups and not {g.prompt_id for g in step2} & again_ids
  assert tr.came_back == came_back + len(again_ids)


def _not_found(take_id):
  raise ParamServerError("AckRollouts", grpc.StatusCode.NOT_FOUND, f"no take {take_id}")


def test_a_restart_skips_the_groups_of_a_checkpointed_take_the_server_requeued(trainer):
  """Its ack deadline passed before the restart: the checkpoint trained on its groups, which
  the server serves again; they (and their prompts sampled anew) are skipped when they come."""
  tr, server = trainer
  _fresh(tr, server)
  tr.pending = [PendingTake("gone", [41, 42], tr.step, ["p-41", "p-42"])]
  tr.saved_version, tr.skip_ids, tr.skip_prompts = 3, set(), {}
  server.ack = _not_found
  try:
    assert tr._server_start() == 4
    assert tr.pending == [] and tr.skip_ids == {41, 42}
    assert tr.skip_prompts == {"p-41": 41, "p-42": 42}
  finally:
    del server.ack
    tr.skip_ids, tr.skip_prompts = set(), {}


def test_a_stop_during_the_acknowledgements_keeps_the_takes_for_the_next_start(trainer):
  tr, server = trainer
  _fresh(tr, server)
  pending = list(tr.pending)

  def gone(take_id):
    raise ParamServerError("AckRollouts", grpc.StatusCode.UNAVAILABLE, "gone")

  server.ack = gone
  tr._stop.set()
  try:
    with mock.patch.object(tr.checkpointer, "latest_step", return_value=tr.step), \
         mock.patch.object(tr.checkpointer, "saving", return_value=False):
      tr._ack_durable()
  finally:
    tr._stop.clear()
    del server.ack
  assert tr.pending == pending  # (in the checkpoint the stop writes: acked at the restart)
