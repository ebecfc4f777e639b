"""The `rlax-ps` command: unknown subcommands and bad flags or config keys print one clear
message and exit non-zero; `python -m rlax_ps` is the same entry point."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  return subprocess.run([sys.executable, "-m", "rlax_ps", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120)


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


def test_unknown_config_variant_is_reported():
  r = _run("sft", "--config=configs/sft_tiny.py:huge", "--workdir=/nonexistent/x")
  assert r.returncode != 0 and "unknown variant 'huge'" in r.stderr


def test_missing_workdir_is_reported():
  r = _run("sft", "--config=configs/sft_tiny.py:tiny")
  assert r.returncode == 2 and "--workdir" in r.stderr


def test_unknown_plain_flag_is_reported():
  r = _run("sft", "--config=configs/sft_tiny.py:tiny", "--workdir=/tmp/x", "--stpes=3")
  assert r.returncode == 2 and "stpes" in r.stderr


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
