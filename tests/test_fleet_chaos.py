"""The whole fleet under chaos, as separate processes on 127.0.0.1 (`rlax-ps serve`, `train`,
`worker`): a worker killed mid-lease and replaced, the server killed and restarted on its
port and storage, the trainer killed and rerun. The run reaches its step target, every
submitted group is trained on once, left queued or dropped as too stale, and the workers
end on the trainer's newest weights."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from child_env import child_env
from param_server.client import ParamServerClient, RetryPolicy
from ports import free_port

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEPS = 24


class Fleet:
  """The processes of one run, each logging to a file under `root`; `stop()` ends them all."""

  def __init__(self, root):
    self.root, self.port = root, free_port()
    self.address = f"127.0.0.1:{self.port}"
    self.procs: dict[str, subprocess.Popen] = {}

  def start(self, name, *args):
    with open(self.root / f"{name}.log", "ab") as log:
      self.procs[name] = subprocess.Popen([sys.executable, "-m", "rlax_ps", *args], cwd=REPO,
                                          env=child_env(), stdout=log,
                                          stderr=subprocess.STDOUT)
    return self.procs[name]

  def log(self, name):
    return (self.root / f"{name}.log").read_text(errors="replace")

  def serve(self, storage="ps"):
    """Start the server on the fleet's port and `storage`; return once it listens."""
    log = self.root / "server.log"
    before = log.read_text().count("listening on") if log.exists() else 0
    proc = self.start("server", "serve", f"--storage_dir={self.root / storage}",
                      f"--port={self.port}", "--host=127.0.0.1")
    _wait(lambda: self.log("server").count("listening on") > before, 60, "the server", proc,
          self)

  def connect_args(self):
    return [f"--address={self.address}", f"--token_file={self.root / 'ps' / 'tokens.json'}",
            "--config=configs/rl_local.py:tiny",
            f"--config.init_from_hf={self.root / 'sft' / 'hf'}"]

  def train(self):
    return self.start("trainer", "train", *self.connect_args(), f"--workdir={self.root / 'rl'}",
                      f"--config.rl.steps={STEPS}", "--config.checkpoint.every_steps=4",
                      "--config.eval.num_examples=0", "--config.export.hf=False")

  def worker(self, i):
    return self.start(f"worker-{i}", "worker", *self.connect_args(), f"--name=worker-{i}",
                      f"--seed={i}")

  def client(self, role):
    tokens = json.loads((self.root / "ps" / "tokens.json").read_text())
    return ParamServerClient(self.address, token=tokens[role], role=role, timeout_s=10.0,
                             retry=RetryPolicy(deadline_s=30.0))

  def kill(self, name):
    proc = self.procs[name]
    proc.kill()
    proc.wait(30)

  def stop(self):
    for proc in self.procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def _wait(cond, timeout, what, proc=None, fleet=None):
  end = time.monotonic() + timeout
  while not cond():
    if proc is not None and proc.poll() is not None:
      name = next(n for n, p in fleet.procs.items() if p is proc)
      raise AssertionError(f"{name} exited ({proc.returncode}) before {what}: "
                           f"{fleet.log(name)[-3000:]}")
    assert time.monotonic() < end, f"timed out waiting for {what}"
    time.sleep(0.2)


def _records(root):
  path = root / "rl" / "steps.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
          if line.endswith("\n")]


def _wait_steps(fleet, n):
  _wait(lambda: len(_records(fleet.root)) >= n, 240, f"step record {n}",
        fleet.procs["trainer"], fleet)


def _kill_worker_mid_lease(fleet, name):
  """SIGKILL the worker as the server lists a lease of it (at once if none shows in 20 s)."""
  with fleet.client("viewer") as viewer:
    end = time.monotonic() + 20
    while time.monotonic() < end and not any(
        w.worker_id.startswith(name + "-") and w.leases for w in viewer.stats().workers):
      time.sleep(0.02)
  fleet.kill(name)


def _live_versions(client):
  """The versions the workers still running (worker-1, worker-2) hold, by name."""
  return sorted(w.version for w in client.stats().workers
                if w.worker_id.startswith(("worker-1-", "worker-2-")))


def _workers_hold(fleet, names):
  """The version and digest each worker's exit line says it holds."""
  held = {}
  for name in names:
    found = re.findall(r"holds v(\d+) digest ([0-9a-f]{16})", fleet.log(name))
    assert found, fleet.log(name)[-2000:]
    held[name] = (int(found[-1][0]), found[-1][1])
  return held


def _warm_fleet(tmp_path):
  """The fleet of a run in tmp_path, after its supervised warm start (tmp_path/sft)."""
  sft = subprocess.run([sys.executable, "-m", "rlax_ps", "sft", "--config=configs/sft_tiny.py:tiny",
                        f"--workdir={tmp_path / 'sft'}"], cwd=REPO, env=child_env(),
                       capture_output=True, text=True, timeout=300)
  assert sft.returncode == 0, sft.stderr[-3000:]
  return Fleet(tmp_path)


def _wait_trainer_end(fleet):
  trainer = fleet.procs["trainer"]
  _wait(lambda: trainer.poll() is not None, 240, "the trainer's end")
  assert trainer.returncode == 0, fleet.log("trainer")[-3000:]


def _wait_live_workers_hold(client, latest):
  """Idle now, every worker still running takes the newest version (a heartbeat away)."""
  held = _live_versions(client)
  end = time.monotonic() + 40
  while held != [latest, latest] and time.monotonic() < end:
    time.sleep(0.2)
    held = _live_versions(client)
  assert held == [latest, latest], f"workers hold {held}; the newest is v{latest}"


def _stop_live_workers(fleet):
  for name in ("worker-1", "worker-2"):
    fleet.procs[name].send_signal(signal.SIGTERM)
    assert fleet.procs[name].wait(60) == 0, fleet.log(name)[-3000:]


def _assert_workers_hold_published_weights(fleet):
  """Each worker's exit line names a version the trainer published, with its digest."""
  digests = {json.loads(line)["version"]: json.loads(line)["digest"]
             for line in (fleet.root / "rl" / "versions.jsonl").read_text().splitlines()}
  held = _workers_hold(fleet, ["worker-1", "worker-2"])
  assert all(digests[v] == d for v, d in held.values()), held


def test_the_fleet_rides_out_kills_of_a_worker_the_server_and_the_trainer(tmp_path):
  """kill -9 of a worker mid-lease (a new one joins), of the server (restarted on its port
  and storage) and of the trainer (rerun): about 40 s on 2 cores."""
  fleet = _warm_fleet(tmp_path)
  try:
    fleet.serve()
    fleet.train()
    fleet.worker(0)
    fleet.worker(1)
    _wait_steps(fleet, 4)
    _kill_worker_mid_lease(fleet, "worker-0")
    fleet.worker(2)
    _wait_steps(fleet, 8)
    fleet.kill("server")
    time.sleep(2)
    fleet.serve()
    done = len(_records(tmp_path))
    _wait_steps(fleet, done + 2)
    fleet.kill("trainer")
    fleet.train()
    _wait_trainer_end(fleet)
    with fleet.client("trainer") as tc:
      latest = tc.latest_version()
      _wait_live_workers_hold(tc, latest)
      left = {int(r.rollout_id) for r in tc.take_rollouts(0, 1000).rollouts}
      stats = tc.stats()
    _stop_live_workers(fleet)
  finally:
    fleet.stop()

  effective = {}  # a step redone after the trainer's restart replaces the lost one
  for r in _records(tmp_path):
    effective[r["step"]] = r["rollout_ids"]
  assert sorted(effective) == list(range(1, STEPS + 1))
  trained = [i for s in sorted(effective) for i in effective[s]]
  assert len(trained) == len(set(trained)) == STEPS * 4  # none twice
  assert not set(trained) & left and stats.rollouts_duplicate == 0
  # Every accepted group was trained on, is still queued, or was dropped as too stale.
  assert stats.rollouts_accepted == len(trained) + len(left) + stats.rollouts_stale_dropped
  _assert_workers_hold_published_weights(fleet)


def test_a_server_replaced_by_an_empty_one_is_fed_again_and_the_run_goes_on(tmp_path):
  """kill -9 of the server, and another started on its port with an empty storage folder
  (the tokens given again, as an operator's secret would): the trainer feeds it, sends it
  the weights, and the run reaches its step target with the workers on its newest weights."""
  fleet = _warm_fleet(tmp_path)
  try:
    fleet.serve()
    fleet.train()
    fleet.worker(1)
    fleet.worker(2)
    _wait_steps(fleet, 6)
    fleet.kill("server")
    (tmp_path / "ps2").mkdir()
    (tmp_path / "ps2" / "tokens.json").write_bytes((tmp_path / "ps" / "tokens.json").read_bytes())
    os.chmod(tmp_path / "ps2" / "tokens.json", 0o600)
    fleet.serve("ps2")
    _wait_trainer_end(fleet)
    assert "lost its weights and queues" in fleet.log("trainer")
    with fleet.client("trainer") as tc:
      latest = tc.latest_version()
      _wait_live_workers_hold(tc, latest)
    _stop_live_workers(fleet)
  finally:
    fleet.stop()
  assert [r["step"] for r in _records(tmp_path)] == list(range(1, STEPS + 1))
  summary = json.loads((tmp_path / "rl" / "summary.json").read_text())
  assert summary["servers_lost"] == 1
  _assert_workers_hold_published_weights(fleet)
