"""Environments: the calculator tool, the registry, user files, and the guard."""

import pytest

from algorithms.environments import (ENVIRONMENTS, GuardedEnvironment, evaluate_arithmetic,
                                     make_environment)
from algorithms.verifiers import load_verifiers


def test_the_calculator_answers_the_latest_turns_last_call_and_ends_a_turn_without_one():
  calc = make_environment("calculator")
  assert calc("let me see <calc>12 * (3 + 4)</calc>", "84") == "<result>84</result>"
  assert calc("<calc>1+1</calc> then <calc>7/2</calc>", "") == "<result>3.5</result>"
  assert calc("<calc>2**10</calc><result>1024</result> so 1024", "") is None  # answered
  assert calc("<calc>1</calc><result>1</result> <calc>-3 % 5</calc>", "") == "<result>2</result>"
  assert calc("the answer is 84", "84") is None
  assert calc("<calc>6/3</calc>", "") == "<result>2</result>"


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "unsupported syntax Call"),
    ("x + 1", "unsupported syntax Name"),
    ("2 ** 1000", "exponent 1000 is larger than 64"),
    ("1 / 0", "division by zero"),
    ("1 +", "not an arithmetic expression"),
    ("9" * 40 + " * " + "9" * 40, "more than 64 digits"),
])
def test_the_calculator_runs_no_code_and_reports_what_it_refused(expression, message):
  with pytest.raises(ValueError, match=message):
    evaluate_arithmetic(expression)
  reply = make_environment("calculator")(f"<calc>{expression}</calc>", "")
  assert reply.startswith("<result>error: ") and message.split()[0] in reply


def test_an_unknown_environment_is_refused_naming_the_field():
  with pytest.raises(ValueError, match=r"^worker.environment: expected one of \[.*'calculator'"
                                       r".*got 'nope'"):
    make_environment("nope")


def test_a_users_file_registering_an_environment_loads_through_worker_verifiers(tmp_path):
  path = tmp_path / "my_tools.py"
  path.write_text("from algorithms.environments import register_environment\n"
                  "@register_environment('echo_once')\n"
                  "def echo():\n"
                  "  return lambda c, r: None if 'ECHO' in c else 'ECHO ' + r\n")
  try:
    assert load_verifiers(str(path), "worker.verifiers") == ["environment:echo_once"]
    env = make_environment("echo_once")
    assert env("hi", "ref") == "ECHO ref" and env("hi ECHO ref", "ref") is None
  finally:
    ENVIRONMENTS.pop("echo_once", None)


def test_the_guard_turns_an_exception_into_a_reply_and_refuses_a_wrong_type():
  def broken(completion, reference):
    raise KeyError("x")

  guarded = GuardedEnvironment("broken", broken)
  assert guarded("a", "b") == "error: KeyError: 'x'" and guarded.errors == 1
  with pytest.raises(TypeError, match="environment 'bad': expected a str reply or None, got int"):
    GuardedEnvironment("bad", lambda c, r: 3)("a", "b")


def test_the_python_interpreter_runs_the_latest_block_after_the_earlier_ones():
  env = make_environment("python", timeout_s=5.0)
  first = "Let me compute.\n```python\nx = 6 * 7\nprint('first')\n1 / 0\n```"
  assert env(first, None) == "<output>\nfirst\nZeroDivisionError: division by zero\n</output>"
  # The next turn sees x (the earlier block ran again, its output and error discarded).
  second = first + env(first, None) + "So\n```py\nprint(x + 1)\n```"
  assert env(second, None) == "<output>\n43\n</output>"
  assert env(second + "\n</output>The answer is 43.", None) is None  # no block: done
  assert env("no code here", None) is None


def test_the_python_interpreter_is_sandboxed_and_bounded():
  env = make_environment("python", timeout_s=1.0)
  assert env("```python\nwhile True: pass\n```", None) == (
      "<output>\nTimeoutError: the code ran past 1 s\n</output>")
  long = make_environment("python", max_output_chars=32)("```python\nprint('y' * 1000)\n```",
                                                         None)
  assert long == "<output>\n" + "y" * 28 + " ...\n</output>"
  denied = env("```python\nimport socket\nsocket.socket()\n```", None)
  assert "PermissionError: sandbox: socket.__new__ is not allowed" in denied
