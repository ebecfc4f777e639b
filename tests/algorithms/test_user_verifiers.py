"""Verifiers of a user's own, imported from a file or a module by name (worker.verifiers),
and the errors that name the field when one cannot be imported or a task is unknown."""

import os

import numpy as np
import pytest

from algorithms.verifiers import (VERIFIERS, VerifierResult, known_tasks, load_verifiers,
                                  verifier_for_task)

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures",
                       "user_verifiers.py")


def test_a_file_registers_its_verifiers_once_and_they_score_tasks():
  names = ["environment:fixture_reply", "fixture_any", "fixture_contains", "fixture_float",
           "fixture_strict_int", "tool:fixture_add"]
  assert load_verifiers(f" {FIXTURE} ,", "worker.verifiers") == names
  assert load_verifiers(FIXTURE) == names  # not imported again
  assert {"fixture_any", "fixture_contains", "addition", "math"} <= set(known_tasks())
  verify = verifier_for_task("fixture_contains")
  assert verify("it is 42.", "42").passed and verify("it is 41.", "42").reward == 0.25
  assert verifier_for_task("addition")("3<eos>", "3").passed  # built-in tasks still resolve


def test_a_module_by_name_is_imported(tmp_path, monkeypatch):
  (tmp_path / "my_pkg_rewards.py").write_text(
      "from algorithms.verifiers import VerifierResult, register_verifier\n"
      "register_verifier('module_len')(lambda: lambda c, r: VerifierResult(len(c), True))\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  assert load_verifiers("my_pkg_rewards") == ["module_len"]
  assert verifier_for_task("module_len")("abc", "").reward == 3
  VERIFIERS.pop("module_len")


def test_a_module_imported_before_gives_the_names_it_registered(tmp_path, monkeypatch):
  """A config file or notebook imported it first: it "registered no verifier"."""
  import importlib
  (tmp_path / "my_early_rewards.py").write_text(
      "from algorithms.verifiers import VerifierResult, register_verifier\n"
      "register_verifier('early_len')(lambda: lambda c, r: VerifierResult(len(c), True))\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  importlib.import_module("my_early_rewards")
  try:
    assert load_verifiers("my_early_rewards") == ["early_len"]
  finally:
    VERIFIERS.pop("early_len")


@pytest.mark.parametrize("content, message", [
    (None, "could not import .*FileNotFoundError: no file"),
    ("raise RuntimeError('boom')", "could not import .*RuntimeError: boom"),
    ("x = 1", "registered no verifier, environment or tool; decorate a class or factory in "
              "it with @register_verifier"),
])
def test_a_file_that_cannot_give_verifiers_is_refused_naming_the_field(tmp_path, content,
                                                                       message):
  path = tmp_path / "bad.py"
  if content is not None:
    path.write_text(content)
  with pytest.raises(ValueError, match=f"^worker.verifiers: .*{message}"):
    load_verifiers(str(path), "worker.verifiers")


def test_an_unknown_task_is_refused_naming_the_field_and_the_known_ones():
  with pytest.raises(ValueError, match="worker.default_task: 'nope' is neither a built-in task "
                                       "nor a registered verifier \\(known: .*addition"):
    verifier_for_task("nope", "worker.default_task")


def test_a_verifier_that_raises_scores_zero_with_the_error_and_a_wrong_result_is_named():
  load_verifiers(FIXTURE)
  strict = verifier_for_task("fixture_strict_int")
  assert strict(" 42\n", "42").passed
  failed = strict("forty-two", "42")
  assert (failed.reward, failed.passed) == (0.0, False)
  assert failed.info["task"] == "fixture_strict_int"
  assert failed.info["error"].startswith("ValueError: invalid literal for int()")
  with pytest.raises(TypeError, match="verifier of task 'fixture_float': expected a "
                                      "VerifierResult\(reward, passed\), got float"):
    verifier_for_task("fixture_float")("x", "y")


def test_a_nan_reward_scores_zero_with_the_error_and_a_reward_not_a_number_is_named():
  """A NaN or infinite reward would make the server refuse the group and send its prompt
  back for ever; it scores 0 as a raising verifier does. A reward that is no number (None,
  an array) is named, not left to a float() deep in the worker."""
  from algorithms.verifiers.base import Guarded
  for bad in (float("nan"), float("inf")):
    got = Guarded("nan_task", lambda c, r, bad=bad: VerifierResult(bad, True))("x", "y")
    assert (got.reward, got.passed) == (0.0, False)
    assert got.info["error"] == f"reward: expected a finite number, got {bad}"
  half = Guarded("np_task", lambda c, r: VerifierResult(np.float32(0.5), np.bool_(True)))
  assert half("x", "y") == VerifierResult(0.5, True)
  for bad, name in ((None, "NoneType"), (np.array([0.5, 1.0]), "ndarray"), ("1", "str")):
    with pytest.raises(TypeError, match=f"verifier of task 'bad': expected a VerifierResult "
                                        f"whose reward is a number, got {name}"):
      Guarded("bad", lambda c, r, bad=bad: VerifierResult(bad, False))("x", "y")


def test_a_verifier_that_cannot_be_made_is_refused_naming_the_field(tmp_path):
  """A plain function under @register_verifier is called as a factory of no arguments: the
  error names the field and says what the decorator takes."""
  path = tmp_path / "plain_fn.py"
  path.write_text("from algorithms.verifiers import VerifierResult, register_verifier\n"
                  "@register_verifier('plain_fn')\n"
                  "def plain_fn(completion, reference):\n"
                  "  return VerifierResult(1.0, True)\n")
  try:
    load_verifiers(str(path))
    with pytest.raises(ValueError, match="^worker.default_task: the verifier 'plain_fn' could "
                                         "not be made: TypeError: .*a factory of no arguments"):
      verifier_for_task("plain_fn", "worker.default_task")
  finally:
    VERIFIERS.pop("plain_fn", None)


@pytest.mark.parametrize("name", ["addition", "reward_model"])
def test_a_verifier_named_like_a_built_in_task_is_refused(name):
  """Prompts of a built-in task are scored by its own checker: a verifier registered under
  its name was never asked, silently."""
  from algorithms.verifiers import register_verifier
  with pytest.raises(ValueError, match=f"verifier name: '{name}' is a built-in task's"):
    register_verifier(name)(lambda: lambda c, r: VerifierResult(1.0, True))
  assert name not in VERIFIERS
