"""The task adapter: any object with reward(example, completion) becomes a Verifier."""

import dataclasses

import pytest

from algorithms.verifiers import TaskVerifier, VerifierResult, make_verifier, register_verifier
from rlax_ps.tasks import TASKS, get_task


@dataclasses.dataclass
class _Parity:
  """A fake task: the completion must name the parity of the example's number."""

  name: str = "parity"

  def reward(self, example, completion):
    want = "even" if example % 2 == 0 else "odd"
    return 1.0 if completion.strip() == want else (0.5 if completion.strip() else 0.0)


def test_adapter_wraps_a_fake_task():
  verify = TaskVerifier(_Parity())
  assert verify("even", 4) == VerifierResult(1.0, True, {"task": "parity"})
  assert verify("odd", 4) == VerifierResult(0.5, False, {"task": "parity"})
  assert TaskVerifier(_Parity(), pass_threshold=0.5)("odd", 4).passed


def test_adapter_rejects_objects_without_reward():
  with pytest.raises(TypeError, match="task: expected an object with a reward"):
    TaskVerifier(object())


@pytest.mark.parametrize("name", sorted(TASKS))
def test_builtin_tasks_through_the_registry(name):
  verify = make_verifier(f"task:{name}")
  task = get_task(name)
  for example in task.examples("train", seed=0, n=5):
    assert verify(example.answer, example).passed
    assert not verify(example.answer + "9", example).passed
    assert verify(example.answer + "9", example).reward == 0.0


def test_registry_errors_name_the_field():
  with pytest.raises(ValueError, match="verifier: expected one of .*'code'.*'math'"):
    make_verifier("nope")
  with pytest.raises(ValueError, match="verifier name: 'math' is already registered"):
    register_verifier("math")(lambda: None)


def test_running_a_verifier_definition_again_replaces_it_as_a_notebook_cell_would(caplog):
  cell = '''
@register_verifier("rerun_cell")
class RerunCell:
  def __call__(self, completion, reference):
    return VerifierResult(reward=SCORE, passed=True)
'''
  from algorithms.verifiers import VerifierResult
  for score in (0.25, 0.75):  # the cell, edited and run again in the same kernel
    exec(cell.replace("SCORE", str(score)), {"__name__": "__main__", "VerifierResult": VerifierResult,
                                            "register_verifier": register_verifier})
    assert make_verifier("rerun_cell")("x", "y").reward == score
  assert "replaces" not in caplog.text  # the same definition run again: nothing to say
  # Renamed, or made a factory, in the cell: still the notebook's own, so it replaces it,
  # saying so (two cells may have taken one name).
  renamed = cell.replace("class RerunCell", "class RerunCellV2").replace("SCORE", "0.5")
  with caplog.at_level("WARNING"):
    exec(renamed, {"__name__": "__main__", "VerifierResult": VerifierResult,
                   "register_verifier": register_verifier})
  assert make_verifier("rerun_cell")("x", "y").reward == 0.5
  assert "verifier name 'rerun_cell': RerunCellV2 replaces RerunCell" in caplog.text
  with pytest.raises(ValueError, match="'rerun_cell' is already registered"):
    register_verifier("rerun_cell")(lambda: None)  # another module's definition


def test_a_notebooks_environment_edited_and_run_again_replaces_it_and_another_modules_clashes():
  from algorithms.environments import ENVIRONMENTS, register_environment
  cell = "@register_environment('_cell_env')\nclass NAME:\n  pass\n"
  try:
    for name in ("A", "B"):  # renamed in the cell, run again
      exec(cell.replace("NAME", name), {"__name__": "__main__",
                                        "register_environment": register_environment})
    assert ENVIRONMENTS["_cell_env"].__qualname__ == "B"
    with pytest.raises(ValueError, match="environment name: '_cell_env' is already registered"):
      register_environment("_cell_env")(type("C", (), {}))
  finally:
    ENVIRONMENTS.pop("_cell_env", None)
