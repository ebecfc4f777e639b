"""`rlax-ps local` end to end on the :tiny config: a warm start, then a parameter server,
the trainer and two workers as processes on 127.0.0.1; versions advance, every worker
ends holding exactly the trainer's published weights, rollouts are trained on; a failing
child stops the run with a non-zero exit that names it."""

import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from child_env import child_env
from rlax_ps import local

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _local(workdir, *extra, timeout=400, config="configs/rl_local.py:tiny", devices=0):
  env = child_env(devices=devices)
  return subprocess.run([sys.executable, "-m", "rlax_ps", "local", f"--config={config}",
                         f"--workdir={workdir}", "--progress=false", *extra],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("local")
  return workdir, _local(workdir)


def test_the_loop_runs_and_ends_with_the_summary_table(run):
  workdir, proc = run
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "held-out exact match" in proc.stdout and "after RL" in proc.stdout
  assert not re.search(r"sft:\s+\d+%\|", proc.stderr)  # --progress=false: the warm start's too
  summary = json.load(open(workdir / "summary.json"))
  assert summary["step"] == 4 and summary["rollout_groups_trained"] == 16
  # The trained policy, in Hugging Face format, named at the end.
  assert summary["export"] == str(workdir / "hf") and (workdir / "hf" / "config.json").exists()
  assert f"trained policy (Hugging Face format): {workdir / 'hf'}" in proc.stdout
  for name in ("server", "trainer", "worker-0", "worker-1"):
    assert (workdir / "logs" / f"{name}.log").stat().st_size > 0


def test_versions_advance_and_rollouts_are_trained_on(run):
  workdir, _ = run
  versions = _lines(workdir / "versions.jsonl")
  assert [v["version"] for v in versions] == [0, 1, 2, 3, 4]
  steps = _lines(workdir / "steps.jsonl")
  ids = [i for s in steps for i in s["rollout_ids"]]
  assert len(steps) == 4 and len(ids) == len(set(ids)) == 16
  assert [s["trained_token_frac"] for s in steps] == [1.0] * 4  # every token: no selection
  # What the policy wrote, every 2nd step: two trained groups each, all their samples.
  logged = _lines(workdir / "completions.jsonl")
  assert [c["step"] for c in logged] == [2, 2, 4, 4]
  trained = {s["step"]: set(s["rollout_ids"]) for s in steps}
  assert all(c["rollout_id"] in trained[c["step"]] for c in logged)
  assert all(len(c["samples"]) == 4 and c["prompt"] for c in logged)


def test_every_worker_holds_the_trainers_weights_of_its_version(run):
  _holds_the_trainers_weights(run[0])


def _holds_the_trainers_weights(workdir, workers=2):
  digests = {v["version"]: v["digest"] for v in _lines(workdir / "versions.jsonl")}
  # The tiny configs' length penalty moves the weights, so the workers' match is not
  # trivial, unless every sample of the run hit the token budget (equal rewards: no step
  # moves them; about 1 run in 150, seen in the VIGOR recipe's).
  moved = any(s["loss"] != 0.0 for s in _lines(workdir / "steps.jsonl"))
  assert len(set(digests.values())) > 1 or not moved, digests
  for i in range(workers):
    log = (workdir / "logs" / f"worker-{i}.log").read_text()
    held = re.findall(r"holds v(\d+) digest ([0-9a-f]{16})", log)
    assert held, log[-2000:]
    version, digest = held[-1]
    assert digests[int(version)] == digest


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rl_vigor", "rl_sync", "rl_decoupled", "rl_dapo",
                                    "rl_int8_tis", "rl_gpg", "rl_remax", "rl_reinforce_pp"])
def test_each_rl_recipe_runs_the_whole_loop(recipe, tmp_path):
  """Every recipe the README lists runs as `rlax-ps local` does it: versions advance, the
  groups are trained on once, the workers end on the trainer's weights, and the recipe's
  own setting shows where it acts."""
  proc = _local(tmp_path, config=f"configs/{recipe}.py:tiny")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  summary = json.load(open(tmp_path / "summary.json"))
  steps = _lines(tmp_path / "steps.jsonl")
  ids = [i for s in steps for i in s["rollout_ids"]]
  assert summary["step"] == len(steps) == 4 and len(ids) == len(set(ids)) > 0
  assert [v["version"] for v in _lines(tmp_path / "versions.jsonl")] == [0, 1, 2, 3, 4]
  _holds_the_trainers_weights(tmp_path)
  worker_log = (tmp_path / "logs" / "worker-0.log").read_text()
  if recipe == "rl_sync":  # max_staleness 0: every group sampled by the newest version
    assert all(s["staleness_mean"] == 0.0 for s in steps)
  if recipe == "rl_int8_tis":
    assert summary["sync"]["format"] == "int8"
  if recipe == "rl_remax":  # each group's baseline, its greedy sample's reward, was used
    assert all("baseline_reward_mean" in s for s in steps)
  if recipe == "rl_reinforce_pp":  # the KL to the warm start is in each token's reward
    assert all(math.isfinite(s["reward_kl"]) for s in steps)
  # VIGOR samples in rounds (unequal groups); the others batch continuously (ReMax: 4
  # samples and the greedy one).
  batching = ("vigor rounds of 2 prompts" if recipe == "rl_vigor" else
              f"continuous batching of 2 prompts x {5 if recipe == 'rl_remax' else 4} rows")
  assert f"worker: decoding on the default device; {batching}" in worker_log, worker_log[-2000:]


@pytest.mark.slow  # ~75 s
def test_a_synchronous_run_with_one_worker_repeats_exactly_elsewhere_and_resumed(tmp_path):
  """configs/rl_sync.py (max_staleness 0) with one worker, run in two workdirs, the second
  stopped at step 2 and rerun to step 4: the same warm start, prompts, samples (their seeds
  the trainer's, of neither the workdir nor the version a restart republishes as) and step
  sums (groups in their prompts' order), so the same losses and the same trained weights."""
  runs = [tmp_path / "a", tmp_path / "elsewhere" / "b"]
  for workdir, steps in ((runs[0], 4), (runs[1], 2), (runs[1], 4)):
    # The rerun names a's warm start (the same weights: one seed) as init_from_hf: it goes on
    # from its checkpoint all the same, and says so on the console, not only in its log.
    init = ([f"--config.init_from_hf={runs[0] / 'sft' / 'hf'}"]
            if workdir == runs[1] and steps == 4 else [])
    proc = _local(workdir, "--config.local.workers=1", f"--config.rl.steps={steps}", *init,
                  config="configs/rl_sync.py:tiny")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert (f"rlax-ps local: init_from_hf: {str(runs[1] / 'sft' / 'hf')!r} in the checkpoint "
          f"(step 2), {str(runs[0] / 'sft' / 'hf')!r} now: the run resumes the checkpoint's "
          f"weights") in proc.stderr, proc.stderr[-3000:]
  assert json.load(open(runs[1] / "summary.json"))["version"] == 5  # (v3: step 2's again)
  keys = ("reward_mean", "loss", "clip_frac", "response_len_mean")
  steps = [[{k: s[k] for k in keys} for s in _lines(w / "steps.jsonl")]
           for w in runs]
  assert len(steps[0]) == 4 and steps[0] == steps[1]
  weights = [{f.name: f.read_bytes() for f in sorted((w / "hf").glob("*.safetensors"))}
             for w in runs]
  assert weights[0] and weights[0] == weights[1]


@pytest.mark.slow
@pytest.mark.parametrize("where, tokenizer", [("workers", "same"), ("workers", "other"),
                                              ("trainer", "other")])
def test_distillation_of_a_teacher_of_either_tokenizer_runs_the_whole_loop(tmp_path, where,
                                                                           tokenizer):
  """configs/rl_distill.py with worker.teacher: each worker loads the teacher and sends its
  scores with every group, the trainer loads none; or teacher.path: the trainer's. No group
  is rejected, and the reverse KL left is logged. Between two near-uniform tiny models it
  is about log(teacher's vocabulary / student's): 0 for a teacher of the student's
  tokenizer, log(257 / 99) for one of a byte-level BPE's (each character one byte, one
  token: worker.teacher_tokenizer or teacher.tokenizer, no top tokens); teacher scores
  missing (0) would leave the samples' own log-probs, about -4.6."""
  from flax import nnx

  from rlax_ps.models import ModelConfig, Transformer, save_hf_checkpoint
  from rlax_ps.tokenizers import CharTokenizer
  from tokenizer_testlib import save_byte_level_tokenizer
  folder = tmp_path / "teacher"
  field = {"workers": "worker.teacher", "trainer": "teacher.path"}[where]
  flags, vocab = [f"--config.{field}={folder}"], CharTokenizer().vocab_size
  if where == "workers":
    flags.append("--config.worker.teacher_topk=8")
  if tokenizer == "other":
    vocab = save_byte_level_tokenizer(folder).vocab_size
    own = {"workers": "worker.teacher_tokenizer", "trainer": "teacher.tokenizer"}[where]
    flags = flags[:1] + [f"--config.{own}={folder}", "--config.loss.distill_topk=0"]
  teacher = Transformer(ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                    num_layers=1, num_heads=4, num_kv_heads=2,
                                    max_position_embeddings=64), rngs=nnx.Rngs(5))
  save_hf_checkpoint(teacher, str(folder))
  proc = _local(tmp_path / "run", *flags, config="configs/rl_distill.py:tiny")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  summary = json.load(open(tmp_path / "run" / "summary.json"))
  steps = _lines(tmp_path / "run" / "steps.jsonl")
  assert summary["step"] == len(steps) == 4 and summary["rejected"] == 0
  expected = math.log(vocab / CharTokenizer().vocab_size)
  assert all(abs(s["teacher_kl"] - expected) < 0.6 for s in steps), (
      expected, [s["teacher_kl"] for s in steps])


@pytest.mark.slow
def test_the_workers_answer_every_evaluation_of_the_loop(tmp_path):
  """eval.on_workers with rounds' pass@k: the real workers answer the warm start's held-out
  prompts (v0), every round, and the final evaluation (the final version), pass@k included;
  the trainer decodes none of them."""
  proc = _local(tmp_path, "--config.eval.on_workers=True", "--config.eval.every_steps=2",
                "--config.eval.rounds_pass_k=2", "--config.rl.steps=8")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  summary = json.load(open(tmp_path / "summary.json"))
  keys = {"addition", "reversal", "all"}
  assert set(summary["warm_start"]) == set(summary["heldout_exact_match"]) == keys
  assert set(summary["heldout_pass"]) == {"pass@1", "pass@2"}
  rounds = [s for s in _lines(tmp_path / "steps.jsonl") if "heldout_step" in s]
  assert rounds and all(set(s["heldout"]) == keys and set(s["heldout_pass"]) == {"pass@1",
                                                                                 "pass@2"}
                        for s in rounds)
  assert "evaluation of v" not in (tmp_path / "logs" / "trainer.log").read_text()  # in time


def test_tokens_stay_in_an_owner_only_file(run):
  workdir, _ = run
  token_file = workdir / "ps" / "tokens.json"
  assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
  tokens = json.load(open(token_file))
  logs = "".join((workdir / "logs" / n).read_text() for n in os.listdir(workdir / "logs"))
  assert not any(t in logs for t in tokens.values())


def _eval(*flags):
  env = child_env()
  return subprocess.run([sys.executable, "-m", "rlax_ps", "eval", "--config=configs/rl_local.py:tiny",
                         *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_eval_scores_the_warm_start_and_the_trained_policy_as_the_run_did(run, tmp_path):
  workdir, _ = run
  warm, trained = str(workdir / "sft" / "hf"), str(workdir / "hf")
  proc = _eval(f"--checkpoints={warm},{trained}", f"--output={tmp_path / 'eval.json'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.load(open(tmp_path / "eval.json"))
  summary = json.load(open(workdir / "summary.json"))
  assert results[warm]["heldout_exact_match"] == summary["warm_start"]
  assert results[trained]["heldout_exact_match"] == summary["heldout_exact_match"]
  assert results[trained]["heldout_pass"] == summary["heldout_pass"]
  all_row = next(l for l in proc.stdout.splitlines() if l.startswith("exact match all"))
  assert all_row.split()[-2:] == [f"{100 * summary[k]['all']:.1f}%"
                                  for k in ("warm_start", "heldout_exact_match")]
  bad = _eval(f"--checkpoints={warm},{tmp_path / 'nowhere'}")
  assert bad.returncode == 2 and "--checkpoints" in bad.stderr and "nowhere" in bad.stderr


STOP_DURING_CHECKS = """
import os, signal, sys, time
from absl import app
from rlax_ps import local_main
from rlax_ps.train import rl_checks

def check(config, **kw):
  try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
  except local_main.Terminated:
    if sys.argv.pop() == "swallowed":  # as Python does with a gc callback's exception
      return
    raise

rl_checks.check_rl_config = check
app.run(local_main.main)
"""


@pytest.mark.parametrize("how", ["raised", "swallowed"])
def test_a_stop_during_the_checks_exits_as_a_stop_though_its_exception_was_swallowed(
    how, tmp_path):
  """A SIGTERM in the first seconds escaped as a traceback (exit 1), or, its exception
  raised inside JAX's gc callback and swallowed there, was lost with every later one
  ignored: the run went on to its end."""
  proc = subprocess.run([sys.executable, "-c", STOP_DURING_CHECKS, "--config=configs/rl_local.py:tiny",
                         f"--workdir={tmp_path}", "--progress=false", how],
                        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
  assert "rlax-ps local: terminated before the run started" in proc.stderr
  assert "Traceback" not in proc.stderr and not os.listdir(tmp_path)


def test_a_stop_polled_during_the_warm_start_stops_it(tmp_path):
  """The warm start's wait polls for a stop whose exception was swallowed: it went on to
  train the whole warm start first."""
  import multiprocessing

  from rlax_ps import config_files

  class Stop(Exception):
    """The stop check_stop raises (local_main's Terminated in a run)."""

  polls = []

  def check_stop():
    polls.append(time.monotonic())
    if len(polls) == 2:
      raise Stop()

  config = config_files.load(os.path.join(REPO, "configs", "rl_local.py"), "tiny")
  with pytest.raises(Stop):
    local.warm_start(config, str(tmp_path), progress=False, check_stop=check_stop)
  assert not multiprocessing.active_children()  # the sft child, stopped
  assert not (tmp_path / "sft" / "summary.json").exists()


@pytest.mark.parametrize("signum", [
    signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
    pytest.param(signal.SIGKILL, marks=pytest.mark.slow)],  # (~17-25 s a case)
    ids=lambda s: signal.Signals(s).name)
def test_a_stopped_or_killed_run_leaves_no_child_running(signum, run, tmp_path):
  """A SIGTERM or SIGHUP reaches `rlax-ps local` alone (its children run in sessions of
  their own): it must stop them all and exit 128 + the signal, not leave a server, trainer
  and workers running; killed without notice (SIGKILL), its children stop by themselves."""
  workdir, _ = run
  shutil.copytree(workdir / "sft", tmp_path / "sft")  # the warm start, reused
  env = child_env()
  proc = subprocess.Popen([sys.executable, "-m", "rlax_ps", "local",
                           "--config=configs/rl_local.py:tiny", f"--workdir={tmp_path}",
                           "--progress=false", "--config.rl.steps=1000"],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  try:
    line = proc.stdout.readline()
    while line and "parameter server on" not in line:
      line = proc.stdout.readline()
    address = re.search(r"parameter server on (\S+);", line).group(1)
    deadline = time.monotonic() + 120
    while not (tmp_path / "steps.jsonl").exists():  # the trainer is training
      assert proc.poll() is None and time.monotonic() < deadline
      time.sleep(0.2)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
  if signum == signal.SIGKILL:
    assert proc.returncode == -signal.SIGKILL
  else:
    assert proc.returncode == 128 + signum and "terminated; children stopped" in err

  def children():  # server, trainer, workers: their command lines name the workdir
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True,  # (untruncated)
                        text=True).stdout
    return [line for line in ps.splitlines() if str(tmp_path) in line]

  deadline = time.monotonic() + 120
  while children() and time.monotonic() < deadline:
    time.sleep(0.5)
  assert not children()
  host, port = address.rsplit(":", 1)
  with pytest.raises(OSError):
    socket.create_connection((host, int(port)), timeout=2).close()


@pytest.mark.slow
def test_ctrl_c_during_the_warm_start_checkpoints_it_and_a_rerun_resumes(tmp_path):
  """Ctrl-C reaches the whole process group: the warm start checkpoints the step reached."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "rlax_ps", "local", "--config=configs/rl_local.py:tiny",
       f"--workdir={tmp_path}", "--config.sft.train.steps=100000"], cwd=REPO,
      env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      start_new_session=True)
  try:
    for line in proc.stdout:  # the model line: the sft loop starts next
      if "steps of" in line:
        break
    time.sleep(3)
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
  finally:
    proc.kill()
  assert proc.returncode == 130, out[-3000:]
  step = re.search(r"sft: stopped by SIGINT at step (\d+) of 100000; checkpointed", out)
  assert step and int(step.group(1)) > 0, out[-3000:]
  assert str(int(step.group(1))) in os.listdir(tmp_path / "sft" / "checkpoints")


def test_a_failing_child_stops_the_run_naming_it(run):
  workdir, _ = run  # the warm start is reused
  # (more steps: a finished run's rerun starts nothing)
  proc = _local(workdir, "--config.mesh.data=3", "--config.rl.steps=5")  # trainer: 1 device
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "trainer exited with status 2" in proc.stderr  # a setting it refused
  assert "rlax-ps train: mesh: expected data*fsdp*tensor == 1 devices" in proc.stderr  # its log


def _log_sizes(logs):
  """Each log's size, but logs/LOCK's: it holds the pid of whoever holds the folder (a rerun's
  own, of any number of digits)."""
  return {n: os.path.getsize(logs / n) for n in os.listdir(logs) if n != "LOCK"}


def test_a_rerun_of_a_finished_run_says_so_and_starts_nothing(run):
  """The same command again on a finished workdir: no server, trainer or worker is started
  to evaluate and export the same weights as a new version, nor the warm start (its folder
  deleted here to save disk: it was trained again, to no end); it says the run is done, how
  to go on, and shows the run's summary."""
  workdir, _ = run
  logs = workdir / "logs"
  before = _log_sizes(logs)
  summary = (workdir / "summary.json").read_text()
  os.rename(workdir / "sft", workdir / "sft-aside")
  try:
    proc = _local(workdir, timeout=120)
    assert not (workdir / "sft").exists() and "supervised training" not in proc.stdout
  finally:
    shutil.rmtree(workdir / "sft", ignore_errors=True)
    os.rename(workdir / "sft-aside", workdir / "sft")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert (f"rlax-ps local: {workdir} has trained 4 steps (rl.steps=4): nothing to train; "
          f"raise --config.rl.steps to train on") in proc.stdout
  assert re.search(r"^steps / versions\s+4 / v4$", proc.stdout, re.M), proc.stdout
  assert _log_sizes(logs) == before and len(before) >= 4  # server, trainer, workers
  assert (workdir / "summary.json").read_text() == summary


def test_workers_run_on_the_cpu_leaving_the_accelerators_to_the_trainer(tmp_path, monkeypatch):
  """LocalRun's children, with a stand-in interpreter that logs its JAX platform, GPUs and
  TPU chips."""
  for name in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS"):
    monkeypatch.delenv(name, raising=False)  # as on a TPU VM
  fake = tmp_path / "python"
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  fake.write_text('#!/bin/sh\necho "platform=[${JAX_PLATFORMS:-default}] '
                  'gpus=[${CUDA_VISIBLE_DEVICES:-all}] tpu=[${TPU_VISIBLE_CHIPS:-all}] '
                  'prealloc=[${XLA_PYTHON_CLIENT_PREALLOCATE:-default}] $4"\n')
  fake.chmod(0o755)

  def platforms(**kwargs):
    run = local.LocalRun(str(tmp_path / "w"), "cfg.py", [], workers=2, python=str(fake),
                         **kwargs)
    run.address = "127.0.0.1:1"
    children = [run.start_trainer("hf"), *run.start_workers("hf")]
    for child in children:
      child.process.wait(30)
    return {c.name: re.findall(r"platform=\[(\w+)\] gpus=\[([\w,]+)\] tpu=\[([\w,]+)\] "
                               r"prealloc=\[(\w+)\]", open(c.log).read())[-1]
            for c in children}

  def fake_dev(name, *files):  # a /dev with these device files
    dev = tmp_path / name
    (dev / "vfio").mkdir(parents=True)
    for f in files:
      (dev / f).touch()
    return str(dev)

  assert platforms() == {"trainer": ("default", "all", "all", "default"),
                         "worker-0": ("cpu", "all", "all", "default"),
                         "worker-1": ("cpu", "all", "all", "default")}
  # All on JAX's default platform share its accelerators (one GPU): none preallocates.
  assert set(platforms(worker_platform="").values()) == {("default", "all", "all", "false")}
  # A GPU host: the trainer's GPUs first, then each worker its own, on JAX's default platform.
  gpu_host = fake_dev("gpu", "nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl")
  assert platforms(trainer_chips=2, chips_per_worker=1, dev=gpu_host) == {
      "trainer": ("default", "0,1", "all", "default"),
      "worker-0": ("default", "2", "all", "default"),
      "worker-1": ("default", "3", "all", "default")}
  # A TPU host (v5e-8: /dev/vfio/0..7), through the same fields: TPU chips of its own each.
  tpu_host = fake_dev("tpu", "vfio/vfio", *(f"vfio/{i}" for i in range(8)))
  assert platforms(trainer_chips=4, chips_per_worker=2, dev=tpu_host) == {
      "trainer": ("default", "all", "0,1,2,3", "default"),
      "worker-0": ("default", "all", "4,5", "default"),
      "worker-1": ("default", "all", "6,7", "default")}
  with pytest.raises(ValueError, match="local.trainer_chips, local.chips_per_worker: expected "
                                       "both > 0"):
    platforms(trainer_chips=2)


def test_the_summary_table_shows_groups_left_out_and_a_reward_models_scores():
  summary = {"step": 3, "version": 3, "rollout_groups_trained": 12, "seconds": 9.0,
             "warm_start": {"all": 0.5}, "heldout_exact_match": {"all": 0.75}}
  assert "left out" not in local.summary_table(summary)
  table = local.summary_table({**summary, "filtered": 6, "filled": 3})
  assert re.search(r"all-equal-reward groups left out / filled\s+6 / 3$", table, re.M)
  assert re.search(r"^  all\s+50\.0%\s+75\.0%$", table, re.M)
  assert re.search(r"^samples resumed after a worker stopped\s+0$", table, re.M)
  table = local.summary_table({**summary, "samples_score_errors": 7})
  assert re.search(r"^samples a verifier raised on \(worker logs: why\)\s+7$", table, re.M)
  # No held-out set: no held-out header without rows.
  bare = local.summary_table({**summary, "warm_start": None, "heldout_exact_match": None})
  assert "held-out" not in bare and bare.startswith("steps / versions")
  # Held-out prompts a reward model scores: its mean scores, not percentages.
  table = local.summary_table({**summary, "warm_start": {"reward_model": -0.5, "all": -0.5},
                               "heldout_exact_match": {"reward_model": 0.25, "all": 0.25},
                               "heldout_pass": {"pass@1": 0.125, "pass@4": 0.75},
                               "pass_sampling": {"temperature": 1.0, "top_k": 0,
                                                 "top_p": 0.95, "min_p": 0.0}})
  assert re.search(r"^held-out score\s+before RL\s+after RL$", table, re.M)
  assert re.search(r"^  reward_model\s+-0\.500\s+0\.250$", table, re.M)
  assert re.search(r"^  pass@4 \(T=1\.0, top_p=0\.95\)\s+0\.750$", table, re.M)
  from rlax_ps.train.eval_main import table as eval_table  # `rlax-ps eval`'s, alike
  table = eval_table({p: {"heldout_exact_match": {"reward_model": v, "all": v},
                          "heldout_pass": None} for p, v in (("a/hf", -0.5), ("b/hf", 0.25))})
  assert re.search(r"^score reward_model\s+-0\.500\s+0\.250$", table, re.M)


def _record(step, **kw):
  return {"step": step, "version": step, "reward_mean": 0.5, "response_len_mean": 7.9,
          "samples_per_s": 12.0, "staleness_mean": 0.5, "heldout": None, **kw}


def test_the_progress_line_keeps_the_last_accuracy_and_shows_bytes_in_a_fitting_unit():
  progress = local.Progress()
  line = progress.postfix(_record(1, sync_bytes=82))
  assert line["acc"] == "-" and line["synced"] == "82 B"
  assert line["samples/s"] == "12.0" and line["stale"] == "0.5v" and line["len"] == "8tok"
  line = progress.postfix(_record(2, sync_bytes=31_500, heldout={"add": 0.25, "all": 0.25}))
  assert line["acc"] == "25%" and line["synced"] == "30.8 KiB"
  line = progress.postfix(_record(3, sync_bytes=2 << 20))  # a step without an evaluation
  assert line["acc"] == "25%" and line["synced"] == "2.0 MiB"
  # a scheduled keyframe, sent beside its delta, is published too
  line = progress.postfix(_record(4, sync_bytes=0, sync_keyframe_bytes=(2 << 20) - 31_582))
  assert line["synced"] == "4.0 MiB"


def test_the_live_bar_starts_over_where_a_resumed_trainer_goes_on():
  """The killed run logged steps 9-11 past its checkpoint (step 8): the resumed trainer's
  step 9 took the bar backwards, at a negative rate and time left."""
  from tqdm import tqdm
  bar = tqdm(total=40, initial=11, disable=True)
  bar.n = 11
  local.advance(bar, 9)
  assert bar.n == 9 and bar.initial == 8
  local.advance(bar, 10)
  assert bar.n == 10 and bar.initial == 8  # the rate counts this run's 2 steps


def test_the_summary_table_shows_a_deltas_median_seconds_rejected_groups_and_rl_time():
  summary = {"step": 3, "version": 3, "rollout_groups_trained": 12, "seconds": 9.0,
             "rejected": 2, "sync": {"format": "bf16", "delta_seconds_mean": 0.3,
                                     "delta_seconds_median": 0.01}}
  table = local.summary_table(summary)
  assert re.search(r"^sync: seconds per delta \(median\)\s+0\.010$", table, re.M)
  assert re.search(r"^groups rejected \(trainer log: why\)\s+2$", table, re.M)
  # The trainer's clock (rl.max_seconds'), not the command's: no warm start, no final eval.
  assert re.search(r"^RL time this run \(rl.max_seconds\)\s+9 s$", table, re.M)


@pytest.mark.slow
def test_own_prompts_rewards_and_heldout_records_run_through_the_loop(run, tmp_path):
  """A user's JSONL prompts scored by the verifiers of their own file, evaluated on their
  held-out records: the workers' rewards are that file's (0.25 or 1.0), and the summary
  reports its tasks."""
  workdir, _ = run
  shutil.copytree(workdir / "sft", tmp_path / "sft")  # the warm start, reused
  train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
  # One-digit answers: a sample of the tiny warm start contains one often enough that some
  # groups' rewards differ.
  train.write_text("".join(json.dumps({"prompt": f"{i % 9}+1=", "answer": str(i % 9 + 1),
                                       "task": "fixture_contains"}) + "\n" for i in range(40)))
  heldout.write_text("".join(json.dumps({"prompt": f"{i}+2=", "answer": str(i + 2),
                                         "task": "fixture_any"}) + "\n" for i in range(4)))
  proc = _local(tmp_path, f"--config.data.jsonl={train}", f"--config.data.heldout_jsonl={heldout}",
                "--config.worker.verifiers=tests/fixtures/user_verifiers.py",
                "--config.publish.keyframe_every=2")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  summary = json.load(open(tmp_path / "summary.json"))
  assert summary["heldout_exact_match"] == {"fixture_any": 1.0, "all": 1.0}
  steps = _lines(tmp_path / "steps.jsonl")
  assert len(steps) == 4
  for s in steps:  # 16 samples a step, n of them rewarded 1.0 and the others 0.25
    n = (s["reward_mean"] * 16 - 4) / 0.75
    assert 0 <= round(n) <= 16 and abs(n - round(n)) < 1e-6, s["reward_mean"]
  # Rewards that differ within a group move the weights: the workers end on the trainer's
  # weights of their version through deltas that changed them, not the first keyframe's.
  versions = _lines(tmp_path / "versions.jsonl")
  digests = [v["digest"] for v in versions]
  assert digests[-1] != digests[0], [s["reward_mean"] for s in steps]
  _holds_the_trainers_weights(tmp_path)
  # The steps' bytes (the live line's) are what was published after the first keyframe,
  # scheduled keyframes (publish.keyframe_every) too.
  assert any(v.get("keyframe_bytes") for v in versions)
  assert (sum(s["sync_bytes"] + s["sync_keyframe_bytes"] for s in steps)
          == sum(v["bytes"] + v.get("keyframe_bytes", 0) for v in versions[1:]))


@pytest.mark.slow  # ~4 s; test_local_metrics' LocalRun refusals, the wrong-rl-field test below
def test_a_half_given_chip_split_is_refused_before_the_warm_start(tmp_path):
  proc = _local(tmp_path, "--config.local.trainer_chips=2", timeout=60)
  assert proc.returncode == 2
  assert "local.trainer_chips, local.chips_per_worker: expected both > 0" in proc.stderr
  assert not os.path.exists(tmp_path / "sft")


# default_task slow (suite time): the first case holds the refusal before the warm start.
@pytest.mark.parametrize("flag, message", [
    ("--config.worker.samples_per_prompt=1", "worker.samples_per_prompt: loss.advantage='grpo'"),
    pytest.param("--config.worker.default_task=no_such_task",
                 "worker.default_task: 'no_such_task'", marks=pytest.mark.slow),
])
def test_a_wrong_rl_field_is_refused_before_the_warm_start(flag, message, tmp_path):
  proc = _local(tmp_path, flag, timeout=60)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert f"rlax-ps local: bad flags: {message}" in proc.stderr
  assert not os.listdir(tmp_path)  # nothing started


def test_a_warm_start_begun_with_another_model_is_not_reused(run):
  workdir, _ = run
  logs = workdir / "logs"
  before = _log_sizes(logs)
  proc = _local(workdir, "--config.model.num_layers=3", timeout=60)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "was begun with another `sft` config (model.num_layers: 1 -> 3)" in proc.stderr
  # Deleting the warm start alone left the RL checkpoint and versions of the old model.
  assert (f"delete {workdir / 'sft'}, {workdir / 'checkpoints'} and {workdir / 'ps'} to train "
          f"it and the RL run after it anew") in proc.stderr
  assert "warm start: reusing" not in proc.stdout
  assert _log_sizes(logs) == before  # none ran


def test_a_checkpoint_of_another_model_than_the_warm_starts_is_refused_before_the_server(
    run, tmp_path):
  """The RL checkpoint of another model than the warm start's export (one trained anew on
  another model block) was first refused by a worker, on the trainer's first weights."""
  workdir, _ = run
  shutil.copytree(workdir / "sft", tmp_path / "sft")
  shutil.copytree(workdir / "checkpoints", tmp_path / "checkpoints")
  hf_config = tmp_path / "sft" / "hf" / "config.json"
  fields = json.loads(hf_config.read_text())
  layers = fields["num_hidden_layers"]
  hf_config.write_text(json.dumps({**fields, "num_hidden_layers": layers + 1}))
  proc = _local(tmp_path, "--config.rl.steps=1000", timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert (f"rlax-ps local: model: the checkpoint in {tmp_path / 'checkpoints'} was written for "
          f"another model (model.num_layers: {layers} in the checkpoint, {layers + 1} now)"
          ) in proc.stderr
  assert "parameter server on" not in proc.stdout
  assert not (tmp_path / "logs" / "server.log").exists()  # no child started


def test_the_instruct_recipe_needs_a_checkpoint_named(tmp_path):
  proc = _local(tmp_path, config="configs/rl_instruct.py:tiny", timeout=60)
  assert proc.returncode == 2
  assert "--config.init_from_hf: this recipe has no warm start" in proc.stderr
  assert not os.path.exists(tmp_path / "sft")


def test_the_reward_model_recipe_needs_a_reward_model_named(tmp_path):
  proc = _local(tmp_path, f"--config.init_from_hf={tmp_path}",
                config="configs/rl_reward_model.py:tiny", timeout=60)
  assert proc.returncode == 2
  assert ("--config.worker: WorkerConfig.reward_model: expected a reward model checkpoint "
          "when default_task='reward_model'") in proc.stderr
  assert not os.listdir(tmp_path)  # nothing started


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_moe", "qwen3_moe_int8", "olmo3",
                                    "phi3", "granite", "glm4", "gpt_oss", "qwen3_lora",
                                    "qwen3_moe_lora", "qwen3_tools", "qwen3_reward",
                                    "deepseek_v3", "deepseek_v3_int8", "deepseek_v3_fp8"])
def test_the_instruct_recipe_trains_a_checkpoint_on_chat_prompts(family, tmp_path):
  """configs/rl_instruct.py:tiny from a tiny Qwen3, Gemma 3 (8-token sliding window), Qwen3-MoE
  (also published as int8, with scales per expert, and routing replay), OLMo 3, Phi-4-mini-like (LongRoPE, which
  this run's 64 + 8 tokens fix to the long factors in trainer and workers alike), Granite or
  GLM-4 or gpt-oss (attention sinks, biased clamped experts; routing replay) checkpoint, or
  the Qwen3 and Qwen3-MoE ones with configs/rl_lora.py:tiny (adapters, experts' included,
  trained and merged on export), or a DeepSeek-V3 one (latent attention, its workers
  decoding from the latent cache; also as configs/rl_moe.py:tiny: int8 publication, routing
  replay, experts parallel, an int8 KV cache; or shipped in FP8, as DeepSeek ships V3, and
  exported in FP8 again), or the Qwen3 one with
  configs/rl_tools.py:tiny (multi-turn: a user's environment answers each turn, every
  letter token ends one, and the prompts offer a user's tool) or
  configs/rl_reward_model.py:tiny (prompts alone, scored by a reward model with a tokenizer
  and template of its own, on the workers and held out), with a ChatML tokenizer and
  template: JSONL math questions as conversations, scored by the math verifier; the export
  carries the chat template and the end-of-turn stop ids."""
  import numpy as np
  from flax import nnx

  from rlax_ps.models import ModelConfig, Transformer, save_hf_checkpoint
  from rlax_ps.tokenizers import HFTokenizer
  chat = os.path.join(REPO, "tests", "fixtures", "hf", "chat_tokenizer")
  ckpt = tmp_path / family
  tok = HFTokenizer(chat)
  config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                       architecture="qwen3", max_position_embeddings=256)
  if family == "gemma3":
    config = config.replace(
        architecture="gemma3", hidden_act="gelu_tanh", zero_centered_norms=True,
        scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=("sliding_attention", "full_attention"), rope_local_theta=1e4,
        tie_word_embeddings=True)
  if family.startswith("qwen3_moe"):
    config = config.replace(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, norm_topk_prob=True)
  if family == "olmo3":
    config = config.replace(architecture="olmo3", qk_norm_across_heads=True, post_norms=True,
                            sliding_window=8, rope_local_theta=1e4,
                            layer_types=("sliding_attention", "full_attention"))
  if family == "phi3":
    config = config.replace(
        architecture="phi3", qk_norm=False, partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 64,
                      "short_factor": [1.0, 1.0, 1.5, 2.0], "long_factor": [2.0, 3.0, 5.0, 8.0]})
  if family == "glm4":
    config = config.replace(architecture="glm4", qk_norm=False, qkv_bias=True,
                            sandwich_norms=True, partial_rotary_factor=0.5)
  if family == "gpt_oss":
    config = config.replace(
        architecture="gpt_oss", qk_norm=False, qkv_bias=True, attention_out_bias=True,
        attention_sinks=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, moe_bias=True, swiglu_limit=7.0, sliding_window=8,
        layer_types=("sliding_attention", "full_attention"))
  if family == "granite":
    config = config.replace(architecture="granite", qk_norm=False, attention_multiplier=0.1,
                            embedding_multiplier=4.0, residual_multiplier=0.5,
                            logits_scaling=2.0)
  if family.startswith("deepseek_v3"):  # the fixture's shapes, the chat tokenizer's vocab
    from rlax_ps.models import config_from_hf
    with open(os.path.join(REPO, "tests", "fixtures", "hf", "deepseek_v3", "config.json")) as f:
      config = config_from_hf(json.load(f)).replace(vocab_size=tok.vocab_size,
                                                    max_position_embeddings=256)
  fp8 = family == "deepseek_v3_fp8"
  save_hf_checkpoint(Transformer(config, rngs=nnx.Rngs(0)), str(ckpt),
                     quantization="fp8" if fp8 else "")
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(os.path.join(chat, name), ckpt / name)
  rng = np.random.default_rng(0)
  rows = [(int(a), int(b)) for a, b in rng.integers(1, 50, (12, 2))]
  train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
  train.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}"}],
                                       "answer": str(a + b)}) + "\n" for a, b in rows[:10]))
  heldout.write_text("".join(json.dumps({"prompt": f"{a}+{b}", "answer": str(a + b)}) + "\n"
                             for a, b in rows[10:]))
  workdir = tmp_path / "run"
  int8 = family.endswith("int8")  # configs/rl_moe.py: int8, TIS, replay, load balancing
  replay = family in ("qwen3_moe_int8", "gpt_oss", "deepseek_v3_int8")
  tools = family == "qwen3_tools"
  judged = family == "qwen3_reward"
  rm = tmp_path / "reward_model"
  prompts_only = tmp_path / "heldout_prompts.jsonl"  # the reward model scores the answers
  prompts_only.write_text("".join(json.dumps({"prompt": f"{a}+{b}"}) + "\n" for a, b in rows[10:]))
  if judged:
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "hf", "qwen3_reward"), rm)
    for name in ("tokenizer.json", "tokenizer_config.json"):
      shutil.copy(os.path.join(chat, name), rm / name)
  letters = ",".join(chr(c) for c in range(ord("a"), ord("z") + 1))
  template = tmp_path / "tools.jinja"  # the ChatML one, naming the tools in a system turn
  template.write_text("{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for tool in "
                      "tools %}{{- ' ' + tool.function.name }}{%- endfor %}{{- '<|im_end|>\\n' }}"
                      "{%- endif %}" + HFTokenizer(chat, chat_template="auto").chat_template)
  proc = _local(workdir, f"--config.init_from_hf={ckpt}", f"--config.data.jsonl={train}",
                *([f"--config.worker.reward_model={rm}",
                   "--config.worker.reward_model_dtype=float32",
                   f"--config.data.heldout_jsonl={prompts_only}"] if judged
                  else [f"--config.data.heldout_jsonl={heldout}"]),
                *(["--config.worker.routing_replay=True"] if family == "gpt_oss" else []),
                *(["--config.worker.kv_cache_dtype=int8"] if family == "deepseek_v3_int8"
                  else []),
                *(["--config.export.quantization=fp8"] if fp8 else []),
                *([f"--config.tokenizer.stop_tokens={letters}",
                   "--config.worker.verifiers=tests/fixtures/user_verifiers.py",
                   "--config.tokenizer.tools=fixture_add",
                   f"--config.tokenizer.chat_template={template}",
                   "--config.worker.environment=fixture_reply"] if tools else []),
                config="configs/rl_lora.py:tiny" if family.endswith("lora")
                else "configs/rl_moe.py:tiny" if int8 else "configs/rl_tools.py:tiny" if tools
                else "configs/rl_reward_model.py:tiny" if judged
                else "configs/rl_instruct.py:tiny",
                devices=2 if int8 else 0)  # rl_moe: experts split over 2 devices' fsdp
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  summary = json.load(open(workdir / "summary.json"))
  assert summary["step"] == 2
  assert set(summary["heldout_exact_match"]) == {"reward_model" if judged else "math", "all"}
  if judged:  # the reward model's mean score of greedy answers; best-of-k >= mean of k
    assert set(summary["warm_start"]) == {"reward_model", "all"}
    assert summary["heldout_pass"]["pass@2"] >= summary["heldout_pass"]["pass@1"]
    assert "held-out score" in proc.stdout
  assert summary["sync"]["format"] == ("int8" if int8 else "bf16")
  steps = _lines(workdir / "steps.jsonl")
  if judged:  # rewards are the reward model's scores, not a verifier's 0 or 1
    assert all(s["reward_mean"] not in (0.0, 1.0) for s in steps)
  if replay:  # every group brought its routes, and the trainer routed by them
    assert [s["routed_frac"] for s in steps] == [1.0, 1.0]
    assert all(0.5 < s["router_agreement"] <= 1.0 for s in steps)
  else:
    assert "routed_frac" not in steps[0]
  if int8:  # configs/rl_moe.py: the load-balancing term was on, the experts parallel
    assert all(s["router_aux_loss"] >= 1.0 for s in steps)
    assert f"expert parallel: {config.num_experts // 2} whole experts a device" in (
        workdir / "logs" / "trainer.log").read_text()
    for log in (workdir / "logs").glob("worker-*.log"):  # rl_instruct: every local device
      assert "decoding on 2 devices (data 2 x tensor 1)" in log.read_text()
  if tools:  # samples ended turns, got replies (at most 2 each) and trained around them
    assert all(0 < s["env_replies_mean"] <= 2 and 0 < s["env_token_frac"] < 1 for s in steps)
    logged = _lines(workdir / "completions.jsonl")  # the prompts offered the tool
    assert logged and all("Tools: fixture_add" in c["prompt"] for c in logged), logged[:1]
  else:
    assert "env_replies_mean" not in steps[0]
  # Every worker ends holding the trainer's published weights (int8 codes and scales too).
  digests = {v["version"]: v["digest"] for v in _lines(workdir / "versions.jsonl")}
  worker_logs = sorted((workdir / "logs").glob("worker-*.log"))
  assert worker_logs
  for log in worker_logs:
    version, digest = re.findall(r"holds v(\d+) digest ([0-9a-f]{16})", log.read_text())[-1]
    assert digests[int(version)] == digest
  assert not os.path.exists(workdir / "sft")
  export = workdir / "hf"
  assert (export / "chat_template.jinja").read_text() == (
      template.read_text() if tools else HFTokenizer(chat, chat_template="auto").chat_template)
  stops = list(tok.stop_ids) + ([tok._tok.token_to_id(c) for c in letters.split(",")]
                                if tools else [])
  assert json.load(open(export / "generation_config.json"))["eos_token_id"] == stops
  exported = json.load(open(export / "config.json"))
  assert exported["architectures"] == [{
      "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
      "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_moe_int8": "Qwen3MoeForCausalLM",
      "olmo3": "Olmo3ForCausalLM",
      "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
      "glm4": "Glm4ForCausalLM", "gpt_oss": "GptOssForCausalLM",
      "qwen3_lora": "Qwen3ForCausalLM", "qwen3_moe_lora": "Qwen3MoeForCausalLM",
      "qwen3_tools": "Qwen3ForCausalLM", "qwen3_reward": "Qwen3ForCausalLM",
      "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v3_fp8": "DeepseekV3ForCausalLM",
      "deepseek_v3_int8": "DeepseekV3ForCausalLM"}[family]]
  assert ("quantization_config" in exported) == fp8
  assert exported.get("sliding_window") == (8 if family in ("gemma3", "olmo3", "gpt_oss")
                                            else None)


def test_a_failing_childs_message_shows_this_runs_log_lines_not_an_earlier_runs(tmp_path):
  """Every run on a workdir appends to logs/<child>.log: the lines a failure shows are the
  ones this run's child wrote, not the end of an earlier run's (its `done`, say)."""
  fake = tmp_path / "python"
  fake.write_text('#!/bin/sh\necho "this run: boom"\nexit 3\n')
  fake.chmod(0o755)
  logs = tmp_path / "w" / "logs"
  logs.mkdir(parents=True)
  (logs / "trainer.log").write_text("".join(f"earlier run line {i}\n" for i in range(30)))
  run = local.LocalRun(str(tmp_path / "w"), "cfg.py", [], workers=1, python=str(fake))
  run.address = "127.0.0.1:1"
  trainer = run.start_trainer("hf")
  trainer.process.wait(30)
  message = trainer.failed_message()
  assert message.startswith("trainer exited with status 3") and "this run: boom" in message
  assert "earlier run" not in message
  fake.write_text('#!/bin/sh\nkill -9 $$\n')  # killed by a signal: named, not "status -9"
  trainer = run.start_trainer("hf")
  trainer.process.wait(30)
  assert trainer.failed_message().startswith("trainer was killed by SIGKILL; last lines")


_SLOW_TO_STOP = ("import signal, sys, time\n"
                 "signal.signal(signal.SIGTERM, lambda *a: (time.sleep({s}), sys.exit(0)))\n"
                 "print('ready', flush=True)\n"
                 "time.sleep(120)\n")


def _child(name, seconds, tmp_path):
  """A child that takes `seconds` to exit after its SIGTERM (as a worker releasing its leases
  or a trainer checkpointing does), started and ready."""
  process = subprocess.Popen([sys.executable, "-c", _SLOW_TO_STOP.format(s=seconds)],
                             stdout=subprocess.PIPE, text=True)
  assert process.stdout.readline().strip() == "ready"
  return local.Child(name, process, str(tmp_path / f"{name}.log"))


def test_a_stop_gives_workers_their_grace_and_a_second_signal_does_not_cut_it_short(tmp_path):
  """Stopping the run: a worker gets its worker.grace_s (here 3 s, past the stop's 1 s) to
  hand back what it holds before it is killed, the server is stopped last, and a Ctrl-C
  meanwhile is ignored (it cut the stop short, leaving the children to die all at once)."""
  import threading
  run = local.LocalRun(str(tmp_path / "run"), "configs/rl_local.py:tiny", [], workers=1,
                       worker_grace_s=3.0, trainer_grace_s=3.0)
  # The trainer too gets its local.trainer_grace_s for its step and checkpoint (it had 30 s
  # whatever its model's checkpoint took; here 2 s past the stop's 1 s)
  run.children = [_child("server", 0, tmp_path), _child("trainer", 2.0, tmp_path),
                  _child("worker-0", 2.0, tmp_path)]
  threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
  before = signal.getsignal(signal.SIGINT)
  run.stop(grace_s=1.0)
  assert [c.process.returncode for c in run.children] == [0, 0, 0]  # none killed
  assert signal.getsignal(signal.SIGINT) is before
  stuck = local.LocalRun(str(tmp_path / "stuck"), "configs/rl_local.py:tiny", [], workers=1,
                         worker_grace_s=0.5)
  stuck.children = [_child("worker-0", 30, tmp_path)]
  stuck.stop(grace_s=0.5)  # past its grace and the slack: killed
  assert stuck.children[0].process.returncode == -signal.SIGKILL
  with pytest.raises(ValueError, match="local.trainer_grace_s: expected a number of seconds"):
    local.LocalRun(str(tmp_path / "bad"), "configs/rl_local.py:tiny", [], workers=1,
                   trainer_grace_s=0)


def _exited_child(name, code, tmp_path):
  proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"])
  proc.wait()
  log = tmp_path / f"{name}.log"
  log.write_text(f"{name} said goodbye\n")
  return local.Child(name, proc, str(log))


def test_a_worker_that_exits_cleanly_mid_run_is_a_failure_naming_it(tmp_path):
  trainer = local.Child("trainer", subprocess.Popen([sys.executable, "-c",
                                                     "import time; time.sleep(30)"]),
                        str(tmp_path / "trainer.log"))
  try:
    run = object.__new__(local.LocalRun)
    run.children = [trainer, _exited_child("worker-0", 0, tmp_path)]
    with pytest.raises(local.ChildFailed, match=r"^worker-0 exited with status 0"):
      run.check(trainer)
  finally:
    trainer.process.kill()
    trainer.process.wait()


def test_the_trainers_clean_exit_ends_the_run(tmp_path):
  trainer = _exited_child("trainer", 0, tmp_path)
  run = object.__new__(local.LocalRun)
  run.children = [trainer]
  assert run.check(trainer) is True
