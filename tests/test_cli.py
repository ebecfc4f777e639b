"""The `rlax-ps` command: unknown subcommands and bad flags or config keys print one clear
message and exit non-zero; `python -m rlax_ps` is the same entry point."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  return subprocess.run([sys.executable, "-m", "rlax_ps", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120)


IN_ONE_PROCESS = """
import signal, sys
from rlax_ps.cli import main
mine = lambda signum, frame: None
signal.signal(signal.SIGTERM, mine)
kernel = list(sys.argv)
for args in kernel[1:]:
  try:
    main(["rlax-ps", *args.split()])
  except SystemExit as e:
    print("exit", e.code, signal.getsignal(signal.SIGTERM) is mine, sys.argv == kernel,
          flush=True)
"""


def test_a_notebook_runs_commands_one_after_another_in_its_own_process(tmp_path):
  """rlax_ps.cli.main(argv) called from a kernel: `--config.a.b=` overrides are read from
  `argv` (not the kernel's sys.argv), each call starts from the defaults (the last one's
  overrides and flags gone), and `rlax-ps local` gives the kernel its SIGTERM handler back,
  and main its sys.argv; another subcommand is refused, naming the one that ran."""
  local = f"local --config=configs/rl_local.py:tiny --workdir={tmp_path / 'w'}"
  r = subprocess.run([sys.executable, "-c", IN_ONE_PROCESS, f"{local} --config.rl.steps=-3",
                      f"{local} --config.rl.steps=-5 --config.rl.max_staleness=-1 "
                      f"--progress=false", f"{local} --config.rl.max_staleness=-2",
                      "eval --config=configs/rl_local.py:tiny --checkpoints=x"],
                     cwd=REPO, capture_output=True, text=True, timeout=120)
  said = [line for line in r.stderr.splitlines() if line.startswith("rlax-ps local: ")]
  assert [line for line in r.stdout.splitlines() if line.startswith("exit")] == [
      "exit 2 True True"] * 4, r.stdout + r.stderr[-3000:]
  assert ("rlax-ps eval: this process ran `rlax-ps local`; it runs one subcommand (each "
          "defines its own --config): in a notebook, `!rlax-ps eval ...`") in r.stderr
  assert said == [  # (steps, max_staleness, publish_every): the last call's steps back to 4
      "rlax-ps local: bad flags: rl: expected steps >= 1, max_staleness >= 0, publish_every "
      f">= 1, got {got}" for got in ("-3, 1, 1", "-5, -1, 1", "4, -2, 1")], r.stderr[-3000:]


def test_unknown_subcommand_is_named_with_the_choices():
  r = _run("trian")
  assert r.returncode == 2
  assert "unknown subcommand 'trian'" in r.stderr and "sft" in r.stderr


def test_no_subcommand_prints_usage_and_fails():
  r = _run()
  assert r.returncode == 2 and "usage: rlax-ps <subcommand>" in r.stdout


def test_help_lists_the_sft_subcommand():
  r = _run("--help")
  assert r.returncode == 0 and "sft" in r.stdout


def test_bad_config_key_names_the_flag_and_suggests_the_field():
  r = _run("sft", "--config=configs/sft_tiny.py:tiny", "--config.optimizer.lrr=1e-3",
           "--workdir=/nonexistent/never-created")
  assert r.returncode == 2
  assert "--config.optimizer.lrr=1e-3: no such config field 'lrr'" in r.stderr
  assert '"lr"' in r.stderr  # ml_collections' did-you-mean.
  assert "Traceback" not in r.stderr
  assert not os.path.exists("/nonexistent/never-created")


def test_bad_config_value_type_is_reported():
  r = _run("sft", "--config=configs/sft_tiny.py:tiny", "--config.train.steps=many",
           "--workdir=/nonexistent/x")
  assert r.returncode == 2 and "--config.train.steps=many" in r.stderr
  assert "Traceback" not in r.stderr


@pytest.mark.slow  # ~6 s
def test_a_setting_the_sft_trainer_refuses_is_one_line_not_a_traceback(tmp_path):
  # Found as the trainer is built (from the config's values, not its keys), before step 1.
  r = _run("sft", "--config=configs/sft_tiny.py:tiny", "--config.data.batch_size=0",
           f"--workdir={tmp_path / 'a'}")
  assert r.returncode == 2, r.stderr[-2000:]
  assert "rlax-ps sft: data.batch_size, data.seq_len: expected >= 1" in r.stderr
  assert "Traceback" not in r.stderr
  r = _run("sft", "--config=configs/sft_tiny.py:tiny", f"--config.init_from_hf={tmp_path}/nope",
           f"--workdir={tmp_path / 'b'}")
  assert r.returncode == 2 and f"no config.json in HF checkpoint folder '{tmp_path}/nope'" in (
      r.stderr), r.stderr[-2000:]
  assert "Traceback" not in r.stderr


def test_unknown_config_variant_is_reported():
  r = _run("sft", "--config=configs/sft_tiny.py:huge", "--workdir=/nonexistent/x")
  assert r.returncode != 0 and "unknown variant 'huge'" in r.stderr


def test_missing_workdir_is_reported():
  r = _run("sft", "--config=configs/sft_tiny.py:tiny")
  assert r.returncode == 2 and "--workdir" in r.stderr


def test_unknown_plain_flag_is_reported():
  r = _run("sft", "--config=configs/sft_tiny.py:tiny", "--workdir=/tmp/x", "--stpes=3")
  assert r.returncode == 2 and "stpes" in r.stderr


# serve slow (~5 s, suite time): the check is cli.reporting_errors', which every subcommand
# shares; status and sft hold it in the default suite.
@pytest.mark.parametrize("subcommand, flag", [
    pytest.param("serve", "--storage_dir={tmp}", marks=pytest.mark.slow),
    ("status", "--help=false"), ("sft", "--config=configs/sft_tiny.py:tiny --workdir={tmp}")])
def test_an_argument_that_is_no_flag_is_named_in_one_line(subcommand, flag, tmp_path):
  """Every subcommand takes flags alone: `rlax-ps serve foo` is a usage error (exit 2, one
  line), not a traceback (serve, relay and status raised ValueError)."""
  r = _run(subcommand, "foo", *flag.format(tmp=tmp_path).split())
  assert r.returncode == 2, r.stderr[-2000:]
  assert f"rlax-ps {subcommand}: unexpected arguments ['foo']; flags are --name=value" in r.stderr
  assert "Traceback" not in r.stderr


def test_subcommand_help_shows_its_usage_and_flags():
  r = _run("sft", "--help")
  assert r.returncode == 0
  assert "rlax-ps sft --config=configs/sft_tiny.py" in r.stdout and "--workdir" in r.stdout


def test_a_bad_server_setting_in_a_config_file_is_named(tmp_path):
  config = tmp_path / "server.py"
  config.write_text("import ml_collections\n"
                    "def get_config():\n"
                    "  return ml_collections.ConfigDict({'param_server': {'colour': 1}})\n")
  r = _run("serve", f"--config={config}", f"--storage_dir={tmp_path / 'ps'}")
  assert r.returncode != 0 and "Traceback" not in r.stderr
  assert "--config server settings: unknown settings ['colour']" in r.stderr


def test_each_subcommands_help_lists_the_flags_a_user_sets():
  wanted = {"serve": ["--storage_dir", "--port", "--tls_cert", "--tls_key", "--worker_token"],
            "relay": ["--address", "--token", "--token_file", "--tls_ca", "--storage_dir",
                      "--port"],
            "worker": ["--address", "--token", "--token_file", "--tls_ca", "--tls_server_name",
                       "--samples_per_prompt"],
            "status": ["--address", "--token", "--token_file", "--tls_ca", "--timeout_s"],
            "train": ["--address", "--token", "--token_file", "--tls_ca", "--workdir",
                      "--coordinator_address"]}
  for name, names in wanted.items():
    r = _run(name, "--help")
    assert r.returncode == 0, r.stderr
    listed = {line.split(":")[0].strip().replace("[no]", "") for line in r.stdout.splitlines()
              if line.strip().startswith("--")}
    assert set(names) <= listed, (name, sorted(set(names) - listed))


def test_a_required_address_claims_no_default():
  r = _run("train", "--helpfull")
  address = [line for line in r.stdout.splitlines() if line.strip().startswith("--address:")]
  assert address and "(required)" in address[0]
  assert "127.0.0.1:50051" not in r.stdout.split("--address:")[1].split("--")[0]


def _self_signed(tmp_path):
  key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                  "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"], check=True,
                 capture_output=True)
  return key, cert


def test_serve_names_a_missing_or_swapped_tls_file(tmp_path):
  key, cert = _self_signed(tmp_path)
  alone = _run("serve", f"--tls_cert={cert}", f"--storage_dir={tmp_path / 'ps'}")
  assert alone.returncode == 2 and "Traceback" not in alone.stderr
  assert "TLS needs --tls_key too" in alone.stderr
  swapped = _run("serve", f"--tls_cert={key}", f"--tls_key={cert}",
                 f"--storage_dir={tmp_path / 'ps'}")
  assert swapped.returncode == 2 and "Traceback" not in swapped.stderr
  assert f"--tls_cert={key} --tls_key={cert}: could not be loaded" in swapped.stderr


def test_a_second_server_on_one_storage_folder_is_refused_in_one_line(tmp_path):
  from param_server.server import ParamServer, ServerConfig
  with ParamServer(ServerConfig(storage_dir=str(tmp_path), host="127.0.0.1", port=0)):
    r = _run("serve", f"--storage_dir={tmp_path}", "--port=0", "--host=127.0.0.1")
  assert r.returncode == 1, r.stderr[-2000:]
  assert r.stderr.strip().splitlines() == [
      f"rlax-ps serve: --storage_dir {tmp_path}: in use by another parameter server (pid "
      f"{os.getpid()}, {tmp_path}/LOCK); stop it, or give this one another folder"]


def test_a_taken_port_is_named_in_one_line(tmp_path):
  import socket
  with socket.socket() as taken:
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    r = _run("serve", f"--storage_dir={tmp_path}", f"--port={port}", "--host=127.0.0.1")
  assert r.returncode == 1, r.stderr[-2000:]
  assert "Traceback" not in r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith(
      f"rlax-ps serve: --host 127.0.0.1 --port {port}: cannot listen there"), r.stderr


def test_a_run_its_fleet_left_without_groups_ends_in_one_line(capsys):
  """rl.take_timeout_s ran out (a preempted fleet, or workers of another config): the trainer
  checkpointed, and the command ends with why in one line and status 1, not a traceback."""
  from rlax_ps import cli
  from rlax_ps.train.rl import TakeTimeout

  def main(argv):
    raise TakeTimeout("rl.take_timeout_s: no usable rollout group for 3.0s; are workers "
                      "running against 127.0.0.1:1?")

  with pytest.raises(SystemExit) as e:
    cli.reporting_errors(main, "rlax-ps train")(["rlax-ps train"])
  assert e.value.code == 1
  assert capsys.readouterr().err == ("rlax-ps train: rl.take_timeout_s: no usable rollout group "
                                     "for 3.0s; are workers running against 127.0.0.1:1?\n")
  with pytest.raises(TimeoutError):  # another timeout is no user error: its traceback stays
    cli.reporting_errors(lambda argv: (_ for _ in ()).throw(TimeoutError("x")), "p")(["p"])


def test_ctrl_c_before_a_commands_own_handlers_ends_it_in_one_line(capsys):
  """Ctrl-C while `rlax-ps train` waited for its --token_file printed a traceback."""
  from rlax_ps import cli
  with pytest.raises(SystemExit) as e:
    cli.reporting_errors(lambda argv: (_ for _ in ()).throw(KeyboardInterrupt()),
                         "rlax-ps train")(["rlax-ps train"])
  assert e.value.code == 130 and capsys.readouterr().err == "rlax-ps train: interrupted\n"
