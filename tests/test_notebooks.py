"""The notebooks run top to bottom (their code cells, in order, from the repository root)."""

import json
import os
import pathlib

import jax
import pytest

from child_env import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def code_of(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())["cells"]
  return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


# Slow: its RL loop is test_local.py's tiny run, its warm start, evaluation and export the
# SFT and eval tests'; this checks the notebook's cells run in order.
@pytest.mark.slow
def test_quickstart_runs_the_rl_loop_and_its_delta_is_exact(monkeypatch):
  monkeypatch.chdir(ROOT / "notebooks")  # where Jupyter starts it: it finds the root itself
  jax.devices()  # this process keeps its devices; the notebook's `rlax-ps local` gets a child's
  for name, value in child_env().items():
    monkeypatch.setenv(name, value)
  scope: dict = {}
  exec(compile(code_of(ROOT / "notebooks" / "quickstart.ipynb"), "quickstart.ipynb", "exec"),
       scope)
  assert scope["exact"] is True
  accuracy = scope["accuracy"]  # the same number of held-out prompts per task
  per_task = [v for k, v in accuracy.items() if k != "all"]
  assert set(accuracy) == {"addition", "reversal", "all"}
  assert accuracy["all"] == pytest.approx(sum(per_task) / len(per_task))
  assert accuracy["all"] > 0.3  # the `make run` warm start (49-59%), not the seconds-long one
  assert len(scope["rewards"]) == 2 * scope["N"]
  # Prompts as the policy was trained on them: <bos> first (encode_prompt), the config's task.
  assert all(p[0] == scope["tokenizer"].bos_id for p in scope["prompts"])
  assert scope["task"].max_digits == scope["config"].tasks.addition.max_digits
  assert scope["delta"].nbytes < scope["keyframe"].nbytes
  assert os.path.exists(os.path.join(scope["hf_dir"], "config.json"))
  assert scope["rl"].returncode == 0 and "after RL" in scope["rl"].stdout
  assert scope["summary"]["step"] == 4 and scope["summary"]["rollout_groups_trained"] == 16
  # What the policy wrote: a trained group's samples, each with its reward and advantage.
  last = scope["last"]
  assert last["step"] == 4 and len(last["samples"]) == 4
  assert all({"completion", "reward", "advantage"} <= set(s) for s in last["samples"])
  # The side-by-side evaluation reproduces the run's own numbers for both checkpoints.
  compared, summary = scope["compared"], scope["summary"]
  assert compared[scope["hf_dir"]]["heldout_exact_match"] == summary["warm_start"]
  assert compared[summary["export"]]["heldout_exact_match"] == summary["heldout_exact_match"]
  # The notebook's own verifier: full credit exactly where the task's checker passes, and
  # partial credit in [0, 1) elsewhere.
  partial, exact = scope["partial_rewards"], scope["rewards"]
  assert len(partial) == len(exact)
  assert all((p == 1.0) == (e == 1.0) and 0.0 <= p <= 1.0 for p, e in zip(partial, exact))
  # The notebook's tool, called as the model's <tool_call> asks, and the calculator agree.
  assert scope["tool_replies"] == ["408"] and scope["calculator_reply"] == "<result>408</result>"
