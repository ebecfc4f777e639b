"""Exactly-once training across a trainer kill -9: the trainer subprocess is SIGKILLed
between a step and its checkpoint, restarted on the same workdir (and once more after a
SIGTERM), and the rollout groups that reached training (the steps that survive) are
compared with those submitted."""

import json
import signal
import subprocess
import sys
import time

import pytest

from child_env import child_env
from rl_testlib import REPO, TOKENS, FakeWorker, client, start_server

STEPS, GROUPS = 6, 4  # the :tiny config's groups_per_step


def _trainer(tmp, address):
  env = child_env()
  log = open(tmp / "trainer.log", "ab")
  proc = subprocess.Popen(
      [sys.executable, "-m", "rlax_ps", "train", "--config=configs/rl_local.py:tiny",
       f"--config.rl.steps={STEPS}", "--config.eval.num_examples=0",
       # A bound no group can exceed here: the fake worker submits ahead of the trainer.
       "--config.rl.max_staleness=20",
       "--config.checkpoint.every_steps=2", f"--workdir={tmp / 'rl'}", f"--address={address}",
       # Nothing here reads the completions log or the export: neither is written.
       "--config.log.completions_every=0", "--config.export.hf=false",
       f"--token_file={tmp / 'tokens.json'}"],
      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  proc.log_path = tmp / "trainer.log"
  return proc


def _steps(tmp):
  path = tmp / "rl" / "steps.jsonl"
  if not path.exists():
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]


def _wait(cond, proc, worker, timeout, what):
  end = time.monotonic() + timeout
  while not cond():
    assert not worker.errors, f"the fake worker failed: {worker.errors!r}"
    assert proc.poll() is None, (f"trainer exited ({proc.returncode}) before {what}: "
                                 f"{proc.log_path.read_text()[-2000:]}")
    assert time.monotonic() < end, f"timed out waiting for {what}"
    time.sleep(0.1)


# ~30 s; test_rl_trainer's stop and restart tests hold exactly-once in the default suite
@pytest.mark.slow
def test_killed_trainer_trains_every_submitted_group_exactly_once(tmp_path):
  (tmp_path / "tokens.json").write_text(json.dumps(TOKENS))
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4, limit=3 * GROUPS).start()
  try:
    first = _trainer(tmp_path, server.address)
    # Steps 1-3 run on the first 12 groups; step 2 is checkpointed, step 3 is not.
    _wait(lambda: len(_steps(tmp_path)) >= 3, first, worker, 240, "step 3")
    time.sleep(0.5)  # the trainer now waits for groups that do not come
    assert len(_steps(tmp_path)) == 3
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    lost = set(_steps(tmp_path)[2]["rollout_ids"])
    worker.limit = 5 * GROUPS  # the restart redoes step 3 on the redelivered groups
    second = _trainer(tmp_path, server.address)
    # (the restart dropped the killed step 3's line: it does step 3 again)
    _wait(lambda: [r["step"] for r in _steps(tmp_path)][-1:] == [5], second, worker, 240,
          "step 5")
    # SIGTERM while it waits for step 6's groups: it checkpoints step 5 and exits 143, not
    # 0, so a supervisor (a Kubernetes Job) restarts it; the restart finishes the run.
    second.send_signal(signal.SIGTERM)
    second.wait(60)
    log = (tmp_path / "trainer.log").read_text()
    assert second.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "rl: stopped by SIGTERM at step 5 of 6" in log
    # The first start said it had no warm start to start from; the restarts resumed.
    assert log.count("rl: warning: the policy starts from random weights: no "
                     "--config.init_from_hf and no checkpoint in the workdir; this recipe's "
                     "warm start (its sft block) is run by `rlax-ps local`") == 1
    worker.limit = 6 * GROUPS
    third = _trainer(tmp_path, server.address)
    _wait(lambda: third.poll() is not None, third, worker, 240, "the last step")
    assert third.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    worker.stop()
    with client(server.address, "trainer") as tc:
      left = {int(r.rollout_id) for r in tc.take_rollouts(0, 100).rollouts}
      stats = tc.stats()
  finally:
    worker.stop()
    server.stop(grace=0)

  records = _steps(tmp_path)
  effective = {r["step"]: r["rollout_ids"] for r in records}
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # the lost step 3's line
  # went with the restart; the redone step's is the one left
  trained = [i for s in sorted(effective) for i in effective[s]]
  assert len(trained) == len(set(trained)) == STEPS * GROUPS  # none twice
  assert lost <= set(trained)  # the killed step's groups came back and were trained on
  submitted = set(worker.submitted)
  assert stats.rollouts_stale_dropped == 0  # so every submitted group is trained or left
  assert set(trained) | left == submitted and not set(trained) & left
  # Every group the trainers took is acknowledged: in flight are only those taken just above.
  assert stats.rollouts_in_flight == len(left)
  with open(tmp_path / "rl" / "versions.jsonl") as f:
    versions = [json.loads(line)["version"] for line in f]
  # v0, steps 1-3, the restart's keyframe v4, steps 3-5 again, the next restart's keyframe,
  # step 6: monotonic, none reused.
  assert versions == list(range(1 + 3 + 1 + 3 + 1 + 1))
