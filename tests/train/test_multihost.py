"""The trainers on a multi-host slice: two processes of `rlax-ps train` (or `rlax-ps sft`)
joined by a local jax.distributed coordinator, 2 CPU devices each, the params sharded
across both (fsdp 4), checkpoints in one shared directory. Process 0 alone talks to the
server and writes logs and exports; each run must end cleanly on both processes with
what it published or exported equal to what it checkpointed."""

import contextlib
import json
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from child_env import child_env
from ports import free_port
from rl_testlib import REPO, TOKENS, FakeWorker, rl_config, start_server
from rlax_ps import sharding as shd
from rlax_ps import sync
from rlax_ps.checkpoint import Checkpointer
from rlax_ps.models import load_hf_checkpoint, model_config_from
from rlax_ps.optim import make_optimizer
from rlax_ps.tokenizers import make_tokenizer
from rlax_ps.train.publisher import flat_params
from rlax_ps.train.state import abstract_state

STEPS, GROUPS = 4, 4  # the :tiny config's groups_per_step


def _launch(tmp, job, config, *args):
  """Two processes of `rlax-ps job` on one coordinator, params sharded over both."""
  env = child_env(devices=2)
  coordinator = f"127.0.0.1:{free_port()}"
  procs = []
  for i in range(2):
    log = open(tmp / f"{job}{i}.log", "wb")
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "rlax_ps", job, f"--config={config}", "--config.mesh.data=1",
         "--config.mesh.fsdp=4", f"--config.checkpoint.directory={tmp / 'shared'}",
         f"--workdir={tmp / job}", *args, f"--coordinator_address={coordinator}",
         "--num_processes=2", f"--process_id={i}"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
  return procs


def _wait(procs, tmp, job, worker=None, timeout=540):
  """Both processes' logs once both exited 0 (fails on the first that does not)."""
  try:
    end = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
      assert worker is None or not worker.errors, f"the fake worker failed: {worker.errors!r}"
      if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > end:
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait(30)
  logs = [(tmp / f"{job}{i}.log").read_text() for i in range(2)]
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"{job} process {i} exited {p.returncode}: {logs[i][-3000:]}"
  return logs


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def _abstract_state(devices):
  config = rl_config()
  tokenizer = make_tokenizer(config.tokenizer.kind, config.tokenizer.path,
                             config.tokenizer.alphabet)
  model_config = model_config_from(config.model, tokenizer.vocab_size, "")
  mesh = shd.make_mesh({"data": 1, "fsdp": len(devices), "tensor": 1}, devices)
  return abstract_state(model_config, make_optimizer(config.optimizer, STEPS), mesh)


def test_the_multi_host_mesh_splits_the_params_over_both_processes():
  """The run below shards params 4 ways (fsdp 4 over 2 processes x 2 devices): a tensor
  whose shards lie on 4 devices has some on each process."""
  params = jax.tree.leaves(_abstract_state(jax.devices()[:4]).params)
  split = [p for p in params
           if len({str(i) for i in p.sharding.devices_indices_map(p.shape).values()}) == 4]
  assert len(split) >= len(params) // 2


def _digest_of_checkpoint(directory, step=STEPS):
  """sync.state_digest of the bf16 held state of the run's final checkpoint (at `step`),
  restored here on one device."""
  target = _abstract_state(jax.devices()[:1])
  with Checkpointer(directory, async_save=False) as ckpt:
    assert ckpt.latest_step() == step
    tree, _ = ckpt.restore(target.to_tree())
  held = {k: np.asarray(v.astype(jax.numpy.bfloat16)) for k, v in
          flat_params(tree["params"]).items()}
  return sync.state_digest(sync.encode(None, held, "bf16", version=0).checksums)


# ~45 s; two jax.distributed processes stay in the default suite in test_distributed_flags and
# test_multihost_worker
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_process_rl_trainer_trains_publishes_and_checkpoints_as_one(tmp_path):
  (tmp_path / "tokens.json").write_text(json.dumps(TOKENS))
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4, limit=STEPS * GROUPS).start()
  try:
    procs = _launch(tmp_path, "train", "configs/rl_local.py:tiny", f"--config.rl.steps={STEPS}",
                    "--config.rl.max_staleness=20", "--config.eval.num_examples=4",
                    "--config.eval.batch_size=4", f"--address={server.address}",
                    # held-out rounds fed to the workers by the leader alone (its followers
                    # hold no server connection)
                    "--config.eval.on_workers=True", "--config.eval.every_steps=1",
                    f"--token_file={tmp_path / 'tokens.json'}")
    logs = _wait(procs, tmp_path, "train", worker)
  finally:
    worker.stop()
    server.stop(grace=0)
  assert "process 1 of 2" in logs[1] and "server " in logs[0]

  workdir = tmp_path / "train"
  steps = _lines(workdir / "steps.jsonl")  # the leader's alone: one line per step
  assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
  trained = [i for r in steps for i in r["rollout_ids"]]
  assert len(trained) == len(set(trained)) == STEPS * GROUPS
  assert set(trained) <= set(worker.submitted)
  versions = _lines(workdir / "versions.jsonl")
  assert [v["version"] for v in versions] == list(range(STEPS + 1))
  assert versions[0]["keyframe"] and not any(v["keyframe"] for v in versions[1:])
  # What was published after the last step is what both processes checkpointed.
  assert versions[-1]["digest"] == f"{_digest_of_checkpoint(str(tmp_path / 'shared')):016x}"
  assert not (workdir / "checkpoints").exists()
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["step"] == STEPS and set(summary["heldout_exact_match"]) >= {"all"}
  assert 0 <= summary["heldout_pass"]["pass@1"] <= summary["heldout_pass"]["pass@2"]


@pytest.mark.slow  # ~50 s; the RL test above covers the shared multi-host machinery
@pytest.mark.timeout(600)
def test_two_process_sft_exports_the_weights_it_checkpointed(tmp_path):
  _wait(_launch(tmp_path, "sft", "configs/sft_tiny.py:tiny", "--progress=false"), tmp_path,
        "sft")
  summary = json.loads((tmp_path / "sft" / "summary.json").read_text())
  assert summary["step"] == 4 and summary["train"]["loss"] > 0
  config = rl_config().sft
  target = _abstract_state(jax.devices()[:1])
  with Checkpointer(str(tmp_path / "shared"), async_save=False) as ckpt:
    assert ckpt.latest_step() == 4
    tree, _ = ckpt.restore(target.to_tree())
  exported = load_hf_checkpoint(summary["export"], config.model.param_dtype)
  got = flat_params(nnx.state(exported, nnx.Param).to_pure_dict())
  want = flat_params(tree["params"])
  assert set(got) == set(want)
  for name in want:
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


@pytest.mark.slow  # two runs of the test above
@pytest.mark.timeout(900)
def test_a_restarted_two_process_trainer_resumes_from_its_shared_checkpoint(tmp_path):
  (tmp_path / "tokens.json").write_text(json.dumps(TOKENS))
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4, limit=5 * GROUPS).start()
  args = ["--config.rl.max_staleness=20", "--config.eval.num_examples=0",
          f"--address={server.address}", f"--token_file={tmp_path / 'tokens.json'}"]
  try:
    for steps in (2, 5):  # the second run resumes at step 2 and trains 3 more
      logs = _wait(_launch(tmp_path, "train", "configs/rl_local.py:tiny",
                           f"--config.rl.steps={steps}", *args), tmp_path, "train", worker)
  finally:
    worker.stop()
    server.stop(grace=0)
  assert "resuming from checkpoint step 2" in logs[0] and "resuming" in logs[1]
  workdir = tmp_path / "train"
  steps = _lines(workdir / "steps.jsonl")
  assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
  trained = [i for r in steps for i in r["rollout_ids"]]
  assert len(trained) == len(set(trained)) == 5 * GROUPS
  versions = _lines(workdir / "versions.jsonl")
  # v0-v2 from the first run; the restart republishes its weights as keyframe v3.
  assert [v["version"] for v in versions] == list(range(7))
  assert [v["version"] for v in versions if v["keyframe"]] == [0, 3]
  assert versions[3]["digest"] == versions[2]["digest"]  # the restored weights, unchanged
  assert versions[-1]["digest"] == f"{_digest_of_checkpoint(str(tmp_path / 'shared'), 5):016x}"


@contextlib.contextmanager
def _training_slice(tmp_path, *args):
  """A server, a FakeWorker and a 2-process trainer of 1000 steps, yielded (procs, server,
  worker) once step 2 is logged; all of them stopped after."""
  (tmp_path / "tokens.json").write_text(json.dumps(TOKENS))
  server = start_server(tmp_path / "ps")
  worker = FakeWorker(server.address, samples=4).start()
  procs = []
  try:
    procs = _launch(tmp_path, "train", "configs/rl_local.py:tiny", "--config.rl.steps=1000",
                    "--config.rl.max_staleness=20", "--config.eval.num_examples=0", *args,
                    f"--address={server.address}", f"--token_file={tmp_path / 'tokens.json'}")
    end = time.monotonic() + 300
    steps = tmp_path / "train" / "steps.jsonl"
    while not (steps.exists() and any(r["step"] >= 2 for r in _lines(steps))):
      assert all(p.poll() is None for p in procs) and time.monotonic() < end
      time.sleep(0.2)
    yield procs, server, worker
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    worker.stop()
    server.stop(grace=0)


@pytest.mark.slow  # ~40 s
@pytest.mark.timeout(600)
def test_a_sigterm_to_a_follower_alone_stops_every_process_at_one_step(tmp_path):
  """A preempted follower host gets the SIGTERM alone: it was ignored (the leader decided),
  the slice trained on until the follower was killed, and the steps since the last
  checkpoint were lost. Every process now checkpoints the same step and exits 143."""
  with _training_slice(tmp_path) as (procs, _, _):
    procs[1].send_signal(signal.SIGTERM)
    codes = [p.wait(120) for p in procs]
  logs = [(tmp_path / f"train{i}.log").read_text() for i in range(2)]
  assert codes == [143, 143], logs[0][-2000:] + logs[1][-2000:]
  step = int(re.search(r"rl: stopped by SIGTERM at step (\d+) of 1000", logs[0]).group(1))
  assert f"rl: stopped by SIGTERM at step {step} of 1000" in logs[1]
  assert _lines(tmp_path / "train" / "steps.jsonl")[-1]["step"] == step < 1000
  with Checkpointer(str(tmp_path / "shared"), async_save=False) as ckpt:
    assert ckpt.latest_step() == step


@pytest.mark.slow  # ~40 s
@pytest.mark.timeout(600)
def test_a_leader_that_fails_ends_the_slice_at_once(tmp_path):
  """The leader's error (here its server gone past rl.take_timeout_s) ended it with a line,
  but jax.distributed.shutdown at exit then waited 5 minutes for the follower, itself
  waiting for the leader's next batch: both aborted after 331 s. Now they end within
  seconds of the leader's line."""
  with _training_slice(tmp_path, "--config.rl.take_timeout_s=5") as (procs, server, worker):
    worker.stop()
    server.stop(grace=0)
    stopped = time.monotonic()
    codes = [p.wait(240) for p in procs]
    took = time.monotonic() - stopped
  log = (tmp_path / "train0.log").read_text()
  assert codes[0] == 1 and "rlax-ps train: " in log, log[-3000:]
  assert codes[1] != 0
  assert took < 120, took  # the leader's retries (5 s) and the follower leaving, not 300 s
