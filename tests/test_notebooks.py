"""The notebooks run top to bottom (their code cells, in order, from the repository root)."""

import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def code_of(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())["cells"]
  return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_quickstart_runs_the_rl_loop_and_its_delta_is_exact(monkeypatch):
  monkeypatch.chdir(ROOT)
  scope: dict = {}
  exec(compile(code_of(ROOT / "notebooks" / "quickstart.ipynb"), "quickstart.ipynb", "exec"),
       scope)
  assert scope["exact"] is True
  accuracy = scope["accuracy"]  # the same number of held-out prompts per task
  per_task = [v for k, v in accuracy.items() if k != "all"]
  assert set(accuracy) == {"addition", "reversal", "all"}
  assert accuracy["all"] == pytest.approx(sum(per_task) / len(per_task))
  assert len(scope["rewards"]) == 2 * scope["N"]
  assert scope["delta"].nbytes < scope["keyframe"].nbytes
  assert os.path.exists(os.path.join(scope["hf_dir"], "config.json"))
  assert scope["rl"].returncode == 0 and "after RL" in scope["rl"].stdout
  assert scope["summary"]["step"] == 4 and scope["summary"]["rollout_groups_trained"] == 16
