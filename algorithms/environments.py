"""Multi-turn rollouts: an environment answers each turn the policy ends.

When a sample ends a turn (emits a stop token), the worker calls the environment with the
conversation since the prompt and the prompt's reference:
`environment(messages, reference) -> reply`, where `messages` alternate
{"role": "assistant", "content": the policy's turn} and {"role": "tool", "content": an
earlier reply}, the turn just ended last. A reply is a string (a tool's output, a judge's
feedback) or a list (or tuple) of them (one tool message each, e.g. one per call the turn
made): the worker renders it as the next message(s) and the policy goes on. None, or an
empty list, ends the sample, which the task's verifier then scores as a whole. The
replies' tokens are context for the policy, not its actions: they carry no log-prob and
no loss.

Built in: "calculator" (`<calc>expression</calc>` -> `<result>value</result>`), "python"
(a sandboxed code interpreter, `algorithms.code_interpreter`) and "tool_calls" (your Python
functions, called as the model's chat template asks for them, `algorithms.tools`).
`@register_environment("name")` in a file or module that worker.verifiers names adds one.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import operator
import re
import threading
from typing import Any, Callable, Protocol, Sequence, Union

from algorithms.registry import check_register


Reply = Union[str, list[str], None]


class Environment(Protocol):
  def __call__(self, messages: list[dict[str, str]], reference: Any) -> Reply: ...


ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}
# imported when first named
_BUILT_IN_MODULES = {"python": "algorithms.code_interpreter", "tool_calls": "algorithms.tools"}


def register_environment(name: str):
  """Class or factory decorator: `make_environment(name, **kwargs)` will call it. A name
  taken by another module's definition is a ValueError; the same definition run again, or a
  notebook's new one, replaces it (check_register)."""

  def wrap(factory):
    check_register("environment", name, ENVIRONMENTS.get(name), factory)
    ENVIRONMENTS[name] = factory
    return factory

  return wrap


def make_environment(name: str, field: str = "worker.environment", **kwargs: Any
                     ) -> Environment:
  """A registered or built-in environment; ValueError naming `field` for any other name."""
  if name not in ENVIRONMENTS and name in _BUILT_IN_MODULES:
    importlib.import_module(_BUILT_IN_MODULES[name])
  if name not in ENVIRONMENTS:
    known = sorted(set(ENVIRONMENTS) | set(_BUILT_IN_MODULES))
    raise ValueError(f"{field}: expected one of {known} (or one that a file worker.verifiers "
                     f"names registers), got {name!r}")
  return ENVIRONMENTS[name](**kwargs)


def run_within(fn: Callable[[], Any], timeout_s: float | None, what: str) -> Any:
  """fn() on a daemon thread (one that hangs holds neither its caller nor the process's
  exit): its result or its exception (a SystemExit as a RuntimeError), or a TimeoutError
  naming `what` once timeout_s (None: no limit) has passed, fn left running."""
  done: dict[str, Any] = {}

  def call():
    try:
      done["result"] = fn()
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      done["error"] = e

  thread = threading.Thread(target=call, name=what, daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise TimeoutError(f"{what} ran past {timeout_s:g} s")
  error = done.get("error")
  if isinstance(error, Exception):
    raise error
  if error is not None:
    raise RuntimeError(f"{what} raised {type(error).__name__}: {error}")
  return done["result"]


class GuardedEnvironment:
  """An environment whose exceptions become its reply ("error: ..."), so that a turn it
  cannot parse neither stops the worker nor loses the prompt; so does running past
  `timeout_s` (None: no limit; the call is left on its thread), so that one that hangs
  does not hold its sample's row for good. A reply of no strings ([]) is None (the sample
  ends) and a tuple a list; any other type is a TypeError naming the environment, counted in
  `errors` (the worker ends that sample)."""

  def __init__(self, name: str, environment: Environment, timeout_s: float | None = None):
    if timeout_s is not None and not timeout_s > 0:
      raise ValueError(f"worker.environment_timeout_s: expected > 0 (or none), got "
                       f"{timeout_s!r}")
    self.name, self.environment, self.timeout_s = name, environment, timeout_s
    self.errors = 0

  def __call__(self, messages: list[dict[str, str]], reference: Any) -> Reply:
    try:
      reply = run_within(lambda: self.environment(messages, reference), self.timeout_s,
                         f"environment {self.name!r}")
    except Exception as e:  # noqa: BLE001 - the environment is the user's code
      self.errors += 1
      return f"error: {type(e).__name__}: {e}"
    if reply is None or isinstance(reply, str):
      return reply
    if isinstance(reply, (list, tuple)) and all(isinstance(r, str) for r in reply):
      return list(reply) or None
    self.errors += 1
    got = type(reply).__name__
    if isinstance(reply, (list, tuple)):
      got += " holding " + next(type(r).__name__ for r in reply if not isinstance(r, str))
    raise TypeError(f"environment {self.name!r}: expected a str reply, a list of them or None, "
                    f"got {got}")


def environment_from(name: str, args: str | dict = "", timeout_s: float | None = None
                     ) -> GuardedEnvironment:
  """The guarded environment worker.environment names, built with worker.environment_args
  (a JSON object of its constructor's arguments, e.g. '{"timeout_s": 30}'), each call cut
  at `timeout_s` (worker.environment_timeout_s); ValueError naming the field that is
  wrong."""
  args = _json_object(args, "worker.environment_args")
  try:
    return GuardedEnvironment(name, make_environment(name, **args), timeout_s)
  except TypeError as e:
    raise ValueError(f"worker.environment_args: {e}") from None


def _json_object(args: str | dict, field: str) -> dict:
  """`args` as a dict: a JSON object's text ('' is {}), or a dict as it is."""
  if isinstance(args, str):
    try:
      args = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError as e:
      raise ValueError(f"{field}: expected a JSON object, got {args!r} ({e})") from None
  if not isinstance(args, dict):
    raise ValueError(f"{field}: expected a JSON object, got {args!r}")
  return args


def environment_names(spec: str) -> dict[str, str]:
  """worker.environment's names by task ("*": every other task), its syntax checked but no
  environment made: "" -> {}, "NAME" -> {"*": NAME}, "TASK=NAME,..." -> as written."""
  spec = spec.strip()
  if not spec:
    return {}
  if "=" not in spec:
    return {"*": spec}
  by_task: dict[str, str] = {}
  for i, item in enumerate(p.strip() for p in spec.split(",")):
    task, _, name = (x.strip() for x in item.partition("="))
    if not task or not name or task in by_task:
      raise ValueError(f"worker.environment: expected NAME or TASK=NAME,... with each task "
                       f"once, got {spec!r} (item {i}: {item!r})")
    by_task[task] = name
  return by_task


def environments_from(spec: str, args: str | dict = "", timeout_s: float | None = None
                      ) -> dict[str, GuardedEnvironment]:
  """worker.environment as environments by task: "NAME" answers every task (key "*");
  "TASK=NAME,TASK=NAME" each task listed, "*=NAME" the others, and a task without one is
  single-turn. worker.environment_args: the JSON arguments of the one environment, or by
  task, an object of them by environment name; `timeout_s`: each call's limit (None: none).
  ValueError naming the field that is wrong."""
  by_task = environment_names(spec)
  if not by_task:
    return {}
  if "=" not in spec:
    return {"*": environment_from(by_task["*"], args, timeout_s)}
  args = _json_object(args, "worker.environment_args")
  unknown = sorted(set(args) - set(by_task.values()))
  if unknown:
    raise ValueError(f"worker.environment_args: with environments by task, expected their "
                     f"arguments by environment name ({sorted(set(by_task.values()))}), got "
                     f"{unknown}")
  made = {name: environment_from(name, args.get(name, {}), timeout_s)
          for name in set(by_task.values())}
  return {task: made[name] for task, name in by_task.items()}


def environment_for(environments: dict[str, GuardedEnvironment], task: str
                    ) -> GuardedEnvironment | None:
  """The environment that answers a task's turns (environments_from); None: single-turn."""
  return environments.get(task, environments.get("*"))


def turn_text(tokenizer, ids: Sequence[int]) -> str:
  """One policy turn (its ids, the stop token that closed it last) as environments read it:
  special tokens kept, as a chat template writes them into the assistant's content (some
  checkpoints' `<tool_call>` markers are special tokens), the closing one decoded as usual."""
  ids = [int(i) for i in ids]
  return (tokenizer.decode(ids[:-1], skip_special=False)
          + tokenizer.decode(ids[-1:]) if ids else "")


def conversation(turns: Sequence[str], replies: Sequence[Reply]) -> list[dict[str, str]]:
  """The messages an environment sees: the policy's turns (assistant messages), each but
  the last followed by the reply it got (one tool message per string)."""
  if len(turns) != len(replies) + 1:
    raise ValueError(f"conversation: expected one reply fewer than turns, got {len(turns)} "
                     f"turns and {len(replies)} replies")
  messages = []
  for turn, reply in zip(turns, list(replies) + [None]):
    messages.append({"role": "assistant", "content": turn})
    for text in ([] if reply is None else [reply] if isinstance(reply, str) else reply):
      messages.append({"role": "tool", "content": text})
  return messages


# ---------------------------------------------------------------- the calculator

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_DIGITS = 64
_MAX_CHARS = 1000


def _shown(expression: str) -> str:
  """An expression for an error message, cut to 60 characters."""
  text = expression.strip()
  return repr(text if len(text) <= 60 else text[:57] + "...")


def _real(number: int | float | complex) -> int | float:
  if isinstance(number, complex) or (isinstance(number, float) and not math.isfinite(number)):
    raise ValueError(f"result is not a finite real number: {number}")
  return number


def evaluate_arithmetic(expression: str) -> int | float:
  """The value of +, -, *, /, //, %, ** over int and float literals and parentheses; a
  ValueError for anything else (names, calls, huge powers, complex or infinite results,
  over _MAX_CHARS characters), so it runs no code and stays bounded."""
  if len(expression) > _MAX_CHARS:
    raise ValueError(f"expression longer than {_MAX_CHARS} characters: {_shown(expression)}")

  def value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return _UNARY[type(node.op)](value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      left, right = value(node.left), value(node.right)
      if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
        raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
      result = _BINARY[type(node.op)](left, right)
      if isinstance(result, int) and len(str(abs(result))) > _MAX_DIGITS:
        raise ValueError(f"result has more than {_MAX_DIGITS} digits")
      return _real(result)
    raise ValueError(f"unsupported syntax {type(node).__name__} in {_shown(expression)}")

  try:
    return _real(value(ast.parse(expression.strip(), mode="eval").body))
  except SyntaxError as e:
    raise ValueError(f"not an arithmetic expression: {_shown(expression)}") from e
  except (RecursionError, MemoryError) as e:
    raise ValueError(f"expression nested too deeply: {_shown(expression)}") from e
  except (ZeroDivisionError, OverflowError) as e:
    raise ValueError(str(e)) from e


def _format(number: int | float) -> str:
  """A whole float as an int where every digit is exact (below 2**53), else as Python
  shows it: 6.02e+23, not its binary value's 24 digits."""
  if isinstance(number, float) and abs(number) < 2**53 and number == int(number):
    return str(int(number))
  return repr(number)


@register_environment("calculator")
class Calculator:
  """A tool: each `<calc>expression</calc>` of the policy's latest turn is answered with
  `<result>value</result>` (or `<result>error: ...</result>`), one tool message each, in
  order; a turn without one ends the sample."""

  def __call__(self, messages: list[dict[str, str]], reference: Any) -> Reply:
    del reference
    results = [_result(c) for c in _CALL.findall(messages[-1]["content"])]
    return (results[0] if len(results) == 1 else results) or None


def _result(expression: str) -> str:
  try:
    return f"<result>{_format(evaluate_arithmetic(expression))}</result>"
  except ValueError as e:
    return f"<result>error: {e}</result>"
