"""Environments: the calculator, the code interpreter, function calling, the registry, user
files, and the guard."""

import threading

import pytest

from algorithms.environments import (ENVIRONMENTS, GuardedEnvironment, conversation,
                                     environments_from, evaluate_arithmetic, make_environment,
                                     turn_text)
from algorithms.tools import TOOLS, function_schema, register_tool, tool_schemas
from algorithms.verifiers import load_verifiers
from tokenizer_testlib import special_marker_tokenizer


def said(*turns, replies=None):
  """The conversation of the policy's `turns`, each but the last answered by `replies`."""
  return conversation(list(turns), replies if replies is not None else ["ok"] * (len(turns) - 1))


def test_the_conversation_alternates_turns_and_replies_one_tool_message_each():
  assert conversation(["a", "b", "c"], ["r", ["s", "t"]]) == [
      {"role": "assistant", "content": "a"}, {"role": "tool", "content": "r"},
      {"role": "assistant", "content": "b"}, {"role": "tool", "content": "s"},
      {"role": "tool", "content": "t"}, {"role": "assistant", "content": "c"}]
  with pytest.raises(ValueError, match="expected one reply fewer than turns, got 1 turns and 1"):
    conversation(["a"], ["r"])


def test_the_calculator_answers_each_call_of_the_latest_turn_and_ends_a_turn_without_one():
  calc = make_environment("calculator")
  assert calc(said("let me see <calc>12 * (3 + 4)</calc>"), "84") == "<result>84</result>"
  assert calc(said("<calc>1+1</calc> then <calc>7/2</calc>"), "") == [
      "<result>2</result>", "<result>3.5</result>"]  # one tool message each, in order
  assert calc(said("<calc>2**10</calc>", "so 1024"), "") is None  # only the latest turn
  assert calc(said("<calc>1</calc>", "<calc>-3 % 5</calc>"), "") == "<result>2</result>"
  assert calc(said("the answer is 84"), "84") is None
  assert calc(said("<calc>6/3</calc>"), "") == "<result>2</result>"


@pytest.mark.parametrize("expression,shown", [
    ("6.02e23", "6.02e+23"), ("2.5 * 10.0 ** 30", "2.5e+30"), ("1e300", "1e+300"),
    ("-6.02e23", "-6.02e+23"), ("2.0 ** 52", str(2**52)), ("3.0 * 2", "6"), ("7 / 2", "3.5"),
])
def test_the_calculator_shows_a_large_whole_float_as_python_does_not_its_binary_digits(
    expression, shown):
  assert make_environment("calculator")(said(f"<calc>{expression}</calc>"), "") == (
      f"<result>{shown}</result>")


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "unsupported syntax Call"),
    ("x + 1", "unsupported syntax Name"),
    ("2 ** 1000", "exponent 1000 is larger than 64"),
    ("1 / 0", "division by zero"),
    ("1 +", "not an arithmetic expression"),
    ("9" * 40 + " * " + "9" * 40, "more than 64 digits"),
    ("(-8) ** 0.5", "not a finite real number"),
    ("(-1) ** 0.5 // 2", "not a finite real number"),
    ("1e308 * 10", "not a finite real number"),
    ("-" * 5000 + "1", "longer than 1000 characters"),
    ("(" * 400 + "1" + ")" * 400, "not an arithmetic expression"),
])
def test_the_calculator_runs_no_code_and_reports_what_it_refused(expression, message):
  with pytest.raises(ValueError, match=message):
    evaluate_arithmetic(expression)
  reply = make_environment("calculator")(said(f"<calc>{expression}</calc>"), "")
  assert reply.startswith("<result>error: ") and message.split()[0] in reply
  assert len(reply) < 200  # a huge expression is not echoed back


def test_the_python_interpreter_runs_the_latest_block_after_the_earlier_ones():
  env = make_environment("python", timeout_s=5.0)
  first = "Let me compute.\n```python\nx = 6 * 7\nprint('first')\n1 / 0\n```"
  reply = env(said(first), None)
  assert reply == "<output>\nfirst\nZeroDivisionError: division by zero\n</output>"
  # The next turn sees x (the earlier block ran again, its output and error discarded).
  second = "So\n```py\nprint(x + 1)\n```"
  assert env(said(first, second, replies=[reply]), None) == "<output>\n43\n</output>"
  assert env(said(first, "The answer is 43."), None) is None  # no block: done
  assert env(said("no code here"), None) is None


def test_the_python_interpreter_is_sandboxed_and_bounded():
  env = make_environment("python", timeout_s=1.0)
  assert env(said("```python\nwhile True: pass\n```"), None) == (
      "<output>\nTimeoutError: the code ran past 1 s\n</output>")
  long = make_environment("python", max_output_chars=32)(said("```python\nprint('y' * 1000)\n```"),
                                                         None)
  assert long == "<output>\n" + "y" * 28 + " ...\n</output>"
  denied = env(said("```python\nimport socket\nsocket.socket()\n```"), None)
  assert "PermissionError: sandbox: socket.__new__ is not allowed" in denied


def test_the_python_interpreter_runs_all_the_turns_blocks_and_skips_turns_that_hung_or_died():
  env = make_environment("python", timeout_s=1.0)
  two = "```python\ndef f(x):\n  return x + 1\n```\nthen\n```python\nprint(f(2))\n```"
  assert env(said(two), None) == "<output>\n3\n</output>"
  died = env(said("```python\nimport os\nos._exit(3)\n```"), None)
  assert died == "<output>\nSystemExit: the interpreter ended with status 3\n</output>"
  hung = "<output>\nTimeoutError: the code ran past 1 s\n</output>"
  later = said("```python\nx = 1\n```", "```python\nwhile True: pass\n```",
               "```python\nimport os\nos._exit(3)\n```", "```python\nprint(x + 41)\n```",
               replies=["<output>\n\n</output>", hung, died])
  assert env(later, None) == "<output>\n42\n</output>"  # as a notebook goes on


def test_the_python_interpreter_runs_the_latest_turn_as_program_code_not_as_a_scored_test():
  """Run as a verifier's test, its comparisons and truth tests went through the scoring rule:
  a loop over dataclasses raised TypeError, and an error's line was not the block's."""
  env = make_environment("python", timeout_s=5.0)
  items = ("```python\nfrom dataclasses import dataclass\n@dataclass\nclass Item:\n  w: int\n"
           "stack = [Item(1), Item(2)]\ntotal = 0\nwhile stack:\n  total += stack.pop().w\n"
           "print('total', total, Item(3) == Item(3))\n```")
  assert env(said(items), None) == "<output>\ntotal 3 True\n</output>"
  box = "```python\nclass Box:\n  def __len__(self):\n    return 1\nb = Box()\n```"
  later = said(box, "```python\nif b and b in [b]:\n  print('has', len(b))\n```",
               replies=["<output>\n\n</output>"])
  assert env(later, None) == "<output>\nhas 1\n</output>"
  broken = env(said("```python\nx = 1\ny = (\n```"), None)
  assert broken.startswith("<output>\nSyntaxError: ") and "(cell, line 2)" in broken, broken


def test_a_long_output_before_a_hang_is_cut_not_the_ending_that_says_it_hung():
  """Cut off, the ending let the hung block run again before every later turn."""
  env = make_environment("python", timeout_s=1.0, max_output_chars=64)
  hung = "```python\nprint('y' * 1000, flush=True)\nwhile True: pass\n```"
  reply = env(said(hung), None)
  assert reply.endswith("y ...TimeoutError: the code ran past 1 s\n</output>")
  assert env(said(hung, "```python\nprint(2)\n```", replies=[reply]), None) == (
      "<output>\n2\n</output>")


@pytest.fixture
def tools():
  from typing import Literal

  @register_tool
  def convert(amount: float, unit: Literal["km", "mi"] = "km", digits: int | None = None) -> dict:
    """Convert a distance between kilometres and miles.

    Args:
      amount: the distance to convert
      unit: the unit `amount` is in;
        the other one is returned.
      digits (int): decimals to round to
    """
    value = amount / 1.609344 if unit == "km" else amount * 1.609344
    return {"value": round(value, digits) if digits is not None else value}

  @register_tool
  def shout(text: str) -> str:
    """Upper-case the text."""
    return text.upper()

  yield convert
  TOOLS.pop("convert")
  TOOLS.pop("shout")


def test_a_tools_schema_comes_from_its_type_hints_and_docstring(tools):
  assert function_schema(tools) == {"type": "function", "function": {
      "name": "convert", "description": "Convert a distance between kilometres and miles.",
      "parameters": {"type": "object", "required": ["amount"], "properties": {
          "amount": {"type": "number", "description": "the distance to convert"},
          "unit": {"type": "string", "enum": ["km", "mi"],
                   "description": "the unit `amount` is in; the other one is returned."},
          "digits": {"type": "integer", "description": "decimals to round to"}}}}}
  assert [s["function"]["name"] for s in tool_schemas("shout, convert")] == ["shout", "convert"]
  with pytest.raises(ValueError, match="tokenizer.tools: 'nope' is not a registered tool"):
    tool_schemas("shout,nope")


def test_bad_tools_are_refused_naming_the_function_and_argument():
  def untyped(x):
    """Does x."""

  def undocumented(x: int):
    return x

  def odd(x: set):
    """Takes a set."""

  with pytest.raises(ValueError, match="tool 'untyped': argument 'x' needs a type hint"):
    register_tool(untyped)
  with pytest.raises(ValueError, match="tool 'undocumented': expected a docstring"):
    register_tool(undocumented)
  with pytest.raises(ValueError, match="tool 'odd' argument 'x': expected a type hint among"):
    register_tool(odd)
  assert not {"untyped", "undocumented", "odd"} & set(TOOLS)


def test_tool_calls_are_answered_one_message_each_and_a_wrong_call_learns_its_error(tools):
  env = make_environment("tool_calls")
  turn = ('<tool_call>\n{"name": "convert", "arguments": {"amount": 16.09344, "digits": 2}}\n'
          '</tool_call>\n<tool_call>{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}'
          '</tool_call>')
  assert env(said(turn), None) == ['{"value": 10.0}', "HI"]
  assert env(said(turn, "Ten miles."), None) is None  # only the latest turn's calls
  wrong = ['<tool_call>{"name": "convert"}</tool_call>', "<tool_call>not json</tool_call>",
           '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
           '<tool_call>{"name": "shout", "arguments": [1]}</tool_call>']
  replies = env(said("".join(wrong)), None)
  assert replies[0].startswith("error: TypeError: ") and "amount" in replies[0]
  assert replies[1].startswith("error: the tool call is not JSON")
  assert replies[2].startswith("error: no tool 'nope' (tools: ") and "shout" in replies[2]
  assert replies[3] == "error: expected the arguments as an object"
  # JSON that Python cannot read (an int past its digit limit, nesting past its recursion
  # limit) is one call's error: it raised, and the turn's other calls' replies were lost.
  unreadable = ['<tool_call>{"name": "shout", "arguments": {"text": "ok"}}</tool_call>',
                '<tool_call>{"name": "shout", "arguments": {"n": ' + "9" * 5000 + '}}</tool_call>',
                '<tool_call>' + "[" * 100000 + '</tool_call>']
  replies = env(said("".join(unreadable)), None)
  assert replies[0] == "OK" and all(r.startswith("error: the tool call is not JSON")
                                    for r in replies[1:])
  assert env(said("[" * 100000), None) is None  # a whole turn that is no call: no reply


def test_a_tool_that_hangs_exits_or_returns_too_much_gets_an_error_or_a_cut_reply(tools):
  release = threading.Event()

  @register_tool
  def wait() -> str:
    """Wait until released."""
    release.wait()
    return "late"

  @register_tool
  def leave() -> str:
    """Exit."""
    raise SystemExit(2)

  @register_tool
  def dump(n: int) -> dict:
    """A big or odd result."""
    return {(1, 2): "tuple key"} if n < 0 else {"x": "y" * n}

  try:
    env = make_environment("tool_calls", timeout_s=0.05, max_output_chars=64)
    calls = "".join(f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
                    for name, args in [("wait", "{}"), ("leave", "{}"), ("dump", '{"n": 100}'),
                                       ("dump", '{"n": -1}')])
    assert env(said(calls), None) == [
        "error: TimeoutError: tool 'wait' ran past 0.05 s", "error: RuntimeError: tool 'leave' raised SystemExit: 2",
        '{"x": "' + "y" * 53 + " ...", "{(1, 2): 'tuple key'}"]
    with pytest.raises(ValueError, match="max_output_chars: expected >= 16, got 4"):
      make_environment("tool_calls", max_output_chars=4)
  finally:
    release.set()
    for name in ("wait", "leave", "dump"):
      TOOLS.pop(name)


def test_an_unknown_environment_is_refused_naming_the_field():
  with pytest.raises(ValueError, match=r"^worker.environment: expected one of \[.*'calculator'"
                                       r".*'python'.*'tool_calls'.*got 'nope'"):
    make_environment("nope")


def test_a_users_file_registering_an_environment_loads_through_worker_verifiers(tmp_path):
  path = tmp_path / "my_tools.py"
  path.write_text("from algorithms.environments import register_environment\n"
                  "@register_environment('echo_once')\n"
                  "def echo():\n"
                  "  return lambda m, r: None if len(m) > 1 else 'ECHO ' + r\n")
  try:
    assert load_verifiers(str(path), "worker.verifiers") == ["environment:echo_once"]
    env = make_environment("echo_once")
    assert env(said("hi"), "ref") == "ECHO ref" and env(said("hi", "again"), "ref") is None
  finally:
    ENVIRONMENTS.pop("echo_once", None)


def test_the_guard_turns_an_exception_into_a_reply_and_refuses_a_wrong_type():
  def broken(messages, reference):
    raise KeyError("x")

  guarded = GuardedEnvironment("broken", broken)
  assert guarded(said("a"), "b") == "error: KeyError: 'x'" and guarded.errors == 1
  assert GuardedEnvironment("two", lambda m, r: ["x", "y"])(said("a"), "b") == ["x", "y"]
  wrong = ((3, "int"), (["x", 1], "list holding int"), (("x", None), "tuple holding NoneType"))
  for bad, name in wrong:
    guarded = GuardedEnvironment("bad", lambda m, r, bad=bad: bad)
    with pytest.raises(TypeError, match=f"environment 'bad': expected a str reply, a list of "
                                        f"them or None, got {name}$"):
      guarded(said("a"), "b")
    assert guarded.errors == 1  # the worker ends that sample, and goes on


def test_the_guard_reads_no_replies_as_none_and_a_tuple_as_a_list():
  # `[run(c) for c in calls]` on a turn that made no call is []: the sample ends, as with None.
  for empty in ([], ()):
    guarded = GuardedEnvironment("calls", lambda m, r, empty=empty: empty)
    assert guarded(said("a"), "b") is None and guarded.errors == 0
  assert GuardedEnvironment("calls", lambda m, r: ("x", "y"))(said("a"), "b") == ["x", "y"]


def test_the_guard_answers_a_hung_or_exiting_environment_with_an_error_reply():
  # A user's environment that hangs would hold its sample's row (and a reply thread) for
  # good; one that calls sys.exit would end the reply thread's future with SystemExit.
  release = threading.Event()
  try:
    hung = GuardedEnvironment("hung", lambda m, r: release.wait() and "late", timeout_s=0.05)
    assert hung(said("a"), "b") == "error: TimeoutError: environment 'hung' ran past 0.05 s"
    assert hung.errors == 1
  finally:
    release.set()
  leaving = GuardedEnvironment("leaving", lambda m, r: exit(3))
  assert leaving(said("a"), "b") == ("error: RuntimeError: environment 'leaving' raised "
                                     "SystemExit: 3")
  by_task = environments_from("math=calculator,*=python", "", timeout_s=7.0)
  assert {e.timeout_s for e in by_task.values()} == {7.0}
  with pytest.raises(ValueError, match="worker.environment_timeout_s: expected > 0"):
    environments_from("calculator", "", timeout_s=-1.0)


def test_an_environments_arguments_come_as_json_and_wrong_ones_name_the_field():
  from algorithms.environments import environment_from
  env = environment_from("python", '{"max_output_chars": 20}')
  long = env(said("```python\nprint('z' * 99)\n```"), None)
  assert long == "<output>\n" + "z" * 16 + " ...\n</output>"
  assert environment_from("calculator", "")(said("<calc>2+2</calc>"), None) == "<result>4</result>"
  for args, message in (("[1]", "expected a JSON object, got \\[1\\]"),
                        ("{oops", "expected a JSON object, got '{oops'"),
                        ('{"nope": 1}', "unexpected keyword argument 'nope'")):
    with pytest.raises(ValueError, match=f"^worker.environment_args: .*{message}"):
      environment_from("python", args)


def test_environments_by_task_each_answer_their_tasks_and_the_rest_are_single_turn():
  from algorithms.environments import environment_for, environments_from
  one = environments_from("calculator")
  assert environment_for(one, "math").name == environment_for(one, "any").name == "calculator"
  assert environments_from("") == {}
  envs = environments_from("math=python, arith=calculator,sums=calculator",
                           '{"python": {"max_output_chars": 20}}')
  assert environment_for(envs, "arith") is environment_for(envs, "sums")  # one instance
  assert environment_for(envs, "chat") is None  # single-turn
  long = environment_for(envs, "math")(said("```python\nprint('z' * 99)\n```"), None)
  assert long == "<output>\n" + "z" * 16 + " ...\n</output>"  # its own arguments
  fallback = environments_from("math=python,*=calculator")
  assert environment_for(fallback, "chat").name == "calculator"
  for spec, args, message in (
      ("math=python,math=calculator", "", "worker.environment: expected NAME or TASK=NAME,"
                                          "... with each task once.*item 1"),
      ("math=", "", "worker.environment: expected NAME or TASK=NAME"),
      ("math=nope", "", "worker.environment: expected one of"),
      ("math=python", '{"max_output_chars": 20}',
       r"worker.environment_args: with environments by task, expected their arguments by "
       r"environment name \(\['python'\]\), got \['max_output_chars'\]")):
    with pytest.raises(ValueError, match=message):
      environments_from(spec, args)


def test_a_turn_keeps_its_special_tool_call_markers_and_drops_its_stop_token(tools, tmp_path):
  """Decoded with special tokens skipped, a call between special `<tool_call>` markers after
  any text went unanswered."""
  tokenizer = special_marker_tokenizer(tmp_path)
  hermes = 'I will shout.\n<tool_call>\n{"name": "shout", "arguments": {"text": "a"}}\n</tool_call>'
  ids = tokenizer.encode(hermes) + [tokenizer.turn_end_id]
  assert "<tool_call>" not in tokenizer.decode(ids)  # (special: skipped by default)
  assert turn_text(tokenizer, ids) == hermes
  env = make_environment("tool_calls")
  assert env(conversation([turn_text(tokenizer, ids)], []), None) == ["A"]
  llama = '<|python_tag|>{"name": "shout", "parameters": {"text": "b"}}'
  ids = tokenizer.encode(llama) + [tokenizer.turn_end_id]
  assert env(conversation([turn_text(tokenizer, ids)], []), None) == ["B"]
  assert turn_text(tokenizer, []) == ""


def test_a_turn_that_is_itself_the_call_is_answered_as_llama_and_mistral_write_them(tools):
  env = make_environment("tool_calls")
  llama = '{"name": "shout", "parameters": {"text": "hi"}}'
  assert env(said(llama), None) == env(said("<|python_tag|>" + llama), None) == ["HI"]
  mistral = ('[{"name": "shout", "arguments": {"text": "a"}}, '
             '{"name": "shout", "arguments": {"text": "b"}}]')
  assert env(said(mistral), None) == env(said("[TOOL_CALLS] " + mistral), None) == ["A", "B"]
  for plain in ('{"answer": 4}', "[1, 2]", "The answer is 4.", '{"name": "shout"}'):
    assert env(said(plain), None) is None  # JSON that is not a call ends the sample
