"""The gcloud launch scripts, run with DRY_RUN=1: the commands they would issue."""

import os
import pathlib
import subprocess

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "tpu_scripts"
ENV = dict(os.environ, TPU_PROJECT="proj-x", TPU_ZONE="zone-y", DRY_RUN="1")


def run(script, *args, env=ENV):
  return subprocess.run(["bash", str(SCRIPTS / script), *args], env=env, capture_output=True,
                        text=True, timeout=60)


@pytest.mark.parametrize("script", ["common.sh", "launch_trainer.sh", "launch_workers.sh",
                                    "teardown.sh"])
def test_scripts_parse(script):
  assert subprocess.run(["bash", "-n", str(SCRIPTS / script)]).returncode == 0


def test_trainer_creates_ships_and_starts_server_and_training():
  out = run("launch_trainer.sh", "trainer-a", "v4-32")
  assert out.returncode == 0, out.stderr
  lines = [l for l in out.stdout.splitlines() if l.startswith("+ gcloud")]
  assert "create trainer-a" in lines[0] and "--accelerator-type=v4-32" in lines[0]
  assert all("--project=proj-x" in l and "--zone=zone-y" in l for l in lines)
  assert any("rlax-ps\\ serve" in l and "--worker=0" in l for l in lines)
  assert any("rlax-ps\\ sft" in l and "--worker=all" in l for l in lines)


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
