"""The notebooks run top to bottom (their code cells, in order, from the repository root)."""

import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def code_of(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())["cells"]
  return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_quickstart_runs_and_its_delta_is_exact(monkeypatch):
  monkeypatch.chdir(ROOT)
  scope: dict = {}
  exec(compile(code_of(ROOT / "notebooks" / "quickstart.ipynb"), "quickstart.ipynb", "exec"),
       scope)
  assert scope["exact"] is True
  assert 0.0 <= scope["accuracy"]["all"] <= 1.0
  assert len(scope["rewards"]) == 2 * scope["N"]
  assert scope["delta"].nbytes < scope["keyframe"].nbytes
  assert os.path.exists(os.path.join(scope["hf_dir"], "config.json"))
