"""rlax-ps as a user installs it: the recipes ship inside the package, so `--config=configs/
rl_local.py` works from any folder; and the lowest versions pyproject.toml allows run the loop."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from child_env import child_env
from rlax_ps import config_files

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_recipe_named_as_in_the_readme_is_found_where_rlax_ps_ships_it(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # no configs/ here
  shipped = config_files.shipped_recipe("configs/rl_local.py:tiny")
  assert shipped == str(ROOT / "configs" / "rl_local.py") + ":tiny"
  assert config_files.shipped_recipe("rl_local.py") == str(ROOT / "configs" / "rl_local.py")
  # Only a recipe's name: another folder, an unknown name or a file that is here stay as given.
  assert config_files.shipped_recipe("mine/rl_local.py") is None
  assert config_files.shipped_recipe("configs/rl_nope.py") is None
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "rl_local.py").write_text("")
  assert config_files.shipped_recipe("configs/rl_local.py") is None


def test_both_flag_spellings_are_pointed_at_the_shipped_recipe(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  recipe = str(ROOT / "configs" / "sft_tiny.py")
  argv = ["--config", "configs/sft_tiny.py", "--workdir=w", "--config=sft_tiny.py:tiny"]
  assert config_files.with_shipped_recipes(argv, "rlax-ps sft") == [
      "--config", recipe, "--workdir=w", f"--config={recipe}:tiny"]
  assert "rlax-ps sft: --config=configs/sft_tiny.py: not a file in" in capsys.readouterr().err
  assert config_files.with_shipped_recipes(["--workdir=configs/x.py"], "p") == [
      "--workdir=configs/x.py"]


def test_the_command_takes_the_shipped_recipe_from_another_folder(tmp_path):
  # The config is loaded (its bad override is what is refused), not "no such file".
  r = subprocess.run([sys.executable, "-m", "rlax_ps", "sft", "--config=configs/sft_tiny.py:tiny",
                      "--config.train.steps=many", f"--workdir={tmp_path / 'w'}"],
                     cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2
  assert "using the recipe rlax-ps ships" in r.stderr
  assert "--config.train.steps=many" in r.stderr and "No such file" not in r.stderr


def _floors() -> list[str]:
  """`name==X` for each dependency `name>=X` of pyproject.toml."""
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  pins = [re.match(r"([A-Za-z0-9_.\-]+)\s*>=\s*([^,;\s]+)", dep) for dep in deps]
  assert all(pins), deps  # every dependency has a floor
  return [f"{pin.group(1)}=={pin.group(2)}" for pin in pins]


@pytest.mark.slow  # ~2 min: a venv from the package registry, then the loop's :tiny recipe
def test_the_wheel_at_its_lowest_allowed_dependencies_runs_the_loop_from_any_folder(tmp_path):
  """The floors are honest (pip keeps an older package a user has when it meets them) and the
  wheel alone runs `rlax-ps local` as the README says, from a folder with no recipes."""
  dist, venv, here = tmp_path / "dist", tmp_path / "venv", tmp_path / "here"
  here.mkdir()
  run = lambda *cmd, **kw: subprocess.run(cmd, capture_output=True, text=True, **kw)  # noqa: E731
  source = tmp_path / "source"  # (pip builds in the folder it is given: not in the checkout)
  shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
      ".*", "build", "runs", "__pycache__", "*.egg-info", "tests", "benchmarks", "notebooks"))
  out = run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
            "-w", str(dist), str(source), timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  (wheel,) = dist.glob("rlax_ps-*.whl")
  assert run(sys.executable, "-m", "venv", str(venv), timeout=300).returncode == 0
  (tmp_path / "floors.txt").write_text("\n".join(_floors()) + "\n")
  out = run(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel),
            "-c", str(tmp_path / "floors.txt"), timeout=1200)
  assert out.returncode == 0, out.stderr[-3000:]
  env = child_env(tokens=False)
  env.pop("PYTHONPATH", None)  # the venv's rlax-ps, not this checkout's
  out = run(str(venv / "bin" / "rlax-ps"), "local", "--config=configs/rl_local.py:tiny",
            "--workdir=run", "--progress=false", cwd=here, env=env, timeout=900)
  assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
  assert f"using the recipe rlax-ps ships, {venv}" in out.stderr
  assert (here / "run" / "summary.json").is_file() and "rollout groups trained" in out.stdout
