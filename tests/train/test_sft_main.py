"""`rlax-ps sft` given an RL recipe runs that recipe's warm start (its `sft` block), as the
TPU VM scripts do before `rlax-ps train`."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sft(*args):
  return subprocess.run([sys.executable, "-m", "rlax_ps", "sft", "--progress=false", *args],
                        cwd=REPO, capture_output=True, text=True, timeout=300)


def _warm_start(workdir):
  r = _sft("--config=configs/rl_local.py:tiny", "--config.sft.train.steps=2",
           "--config.sft.export.hf=false", f"--workdir={workdir}")
  assert r.returncode == 0, r.stderr[-2000:]
  return r


def test_an_rl_recipe_trains_its_sft_block_and_exports_it(tmp_path):
  out = _warm_start(tmp_path)
  assert "sft: this RL recipe's warm start: its `sft` block" in out.stdout
  with open(tmp_path / "summary.json") as f:
    assert json.load(f)["step"] == 2  # the sft block's steps, overridden as --config.sft.X
  assert (tmp_path / "hf" / "config.json").is_file()  # what RL starts from: always exported


@pytest.mark.slow  # ~20 s: two runs
def test_a_rerun_of_a_finished_warm_start_trains_nothing_and_passes(tmp_path):
  _warm_start(tmp_path)
  again = _warm_start(tmp_path)
  assert "resuming from checkpoint step 2" in again.stdout


def test_an_rl_recipe_without_an_sft_block_is_refused_in_one_line(tmp_path):
  r = _sft("--config=configs/rl_instruct.py", f"--workdir={tmp_path / 'x'}")
  assert r.returncode == 2
  assert "--config: an RL recipe without an `sft` block has no warm start" in r.stderr
  assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()
