"""Function calling: your Python functions as tools the policy calls through its chat template.

`@register_tool` on a typed, documented function (in a file worker.verifiers names) makes
its JSON schema, in the OpenAI form chat templates take as `tools`; `tokenizer.tools` names
the ones every prompt offers. The "tool_calls" environment answers a turn's calls, written
as Hermes / Qwen templates ask, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
or as a turn that is itself the call, a JSON object or list of them, after Llama 3.1+'s
`<|python_tag|>` or Mistral's `[TOOL_CALLS]` where the turn has one ("parameters" is taken
for "arguments"): one tool message per call with the function's
result (JSON unless a string) cut to `max_output_chars`, or the error a wrong call raised
(or that it ran past `timeout_s`), so the policy can learn from it. A turn without a call
ends the sample. Tools run in the worker's process, unsandboxed: a tool that runs past
its timeout is left running on a thread of its own, its result dropped.
"""

from __future__ import annotations

import collections.abc
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Sequence

from algorithms.environments import register_environment, run_within
from algorithms.registry import check_register

TOOLS: dict[str, Callable[..., Any]] = {}
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array",
               dict: "object"}
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_CALL_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")  # special tokens, kept in turn_text


def _json_type(annotation, where: str) -> dict:
  origin = typing.get_origin(annotation)
  if origin is typing.Literal:
    values = list(typing.get_args(annotation))
    return {"type": _json_type(type(values[0]), where)["type"], "enum": values}
  if origin in (typing.Union, types.UnionType):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1:
      return _json_type(args[0], where)
  if origin in (list, tuple, collections.abc.Sequence) or annotation in (list, tuple):
    args = typing.get_args(annotation)
    return {"type": "array", **({"items": _json_type(args[0], where)} if args else {})}
  if origin is dict or annotation is dict:
    return {"type": "object"}
  if annotation in _JSON_TYPES:
    return {"type": _JSON_TYPES[annotation]}
  raise ValueError(f"{where}: expected a type hint among int, float, str, bool, list[...], "
                   f"dict, Literal[...] or Optional of one, got {annotation!r}")


def _docs(fn) -> tuple[str, dict[str, str]]:
  """(description, {argument: description}) of a Google-style docstring."""
  doc = inspect.getdoc(fn) or ""
  head, _, rest = doc.partition("\nArgs:")
  args: dict[str, str] = {}
  name = None
  for line in rest.splitlines():
    m = re.match(r"^\s{2,}(\w+)(?:\s*\([^)]*\))?\s*:\s*(.*)$", line)
    if m:
      name, args[m.group(1)] = m.group(1), m.group(2).strip()
    elif name and line.strip() and not re.match(r"^\S", line):
      args[name] += " " + line.strip()
    elif re.match(r"^\S", line):  # the next section (Returns:, ...)
      name = None
  return " ".join(head.split()), args


def function_schema(fn: Callable[..., Any]) -> dict:
  """The OpenAI-style schema of a typed function: its docstring's summary and Args."""
  where = f"tool {fn.__name__!r}"
  description, arg_docs = _docs(fn)
  if not description:
    raise ValueError(f"{where}: expected a docstring saying what the function does")
  hints = typing.get_type_hints(fn)
  properties, required = {}, []
  for name, p in inspect.signature(fn).parameters.items():
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      raise ValueError(f"{where}: *args and **kwargs cannot be described to the model")
    if name not in hints:
      raise ValueError(f"{where}: argument {name!r} needs a type hint")
    properties[name] = _json_type(hints[name], f"{where} argument {name!r}")
    if name in arg_docs:
      properties[name]["description"] = arg_docs[name]
    if p.default is p.empty:
      required.append(name)
  return {"type": "function", "function": {
      "name": fn.__name__, "description": description,
      "parameters": {"type": "object", "properties": properties, "required": required}}}


def register_tool(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Decorator: the function becomes a tool named as it is (its schema checked now)."""
  check_register("tool", fn.__name__, TOOLS.get(fn.__name__), fn)
  function_schema(fn)  # a function the model cannot be told about is refused here
  TOOLS[fn.__name__] = fn
  return fn


def tool_schemas(names: str | Sequence[str], field: str = "tokenizer.tools") -> list[dict]:
  """The schemas of the named tools (comma-separated or a list), for a chat template."""
  if isinstance(names, str):
    names = [n.strip() for n in names.split(",") if n.strip()]
  unknown = [n for n in names if n not in TOOLS]
  if unknown:
    raise ValueError(f"{field}: {unknown[0]!r} is not a registered tool (registered: "
                     f"{sorted(TOOLS)}); decorate it with @register_tool in a file that "
                     f"worker.verifiers names")
  return [function_schema(TOOLS[n]) for n in names]


def _whole_turn_calls(turn: str) -> list[dict]:
  """The calls of a turn that is nothing but a JSON call object or a list of them (each
  with a "name" and "arguments" or "parameters"); [] for any other turn."""
  turn = turn.strip()
  for marker in _CALL_MARKERS:
    turn = turn.removeprefix(marker).lstrip()
  try:
    value = json.loads(turn)
  except (ValueError, RecursionError):  # (not JSON, an int past the digit limit, too deep)
    return []
  calls = value if isinstance(value, list) else [value]
  if calls and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                   and ("arguments" in c or "parameters" in c) for c in calls):
    return calls
  return []


@register_environment("tool_calls")
class ToolCalls:
  """Calls the registered tools the policy's latest turn asks for (module docstring)."""

  def __init__(self, timeout_s: float = 30.0, max_output_chars: int = 8192):
    if not timeout_s > 0:
      raise ValueError(f"timeout_s: expected > 0, got {timeout_s!r}")
    if not max_output_chars >= 16:
      raise ValueError(f"max_output_chars: expected >= 16, got {max_output_chars!r}")
    self.timeout_s, self.max_output_chars = float(timeout_s), int(max_output_chars)

  def __call__(self, messages: list[dict[str, str]], reference: Any) -> list[str] | None:
    del reference
    turn = messages[-1]["content"]
    calls = _CALL.findall(turn) or _whole_turn_calls(turn)
    return [_cut(self._call(c), self.max_output_chars) for c in calls] or None

  def _call(self, call: str | dict) -> str:
    if isinstance(call, str):
      try:
        call = json.loads(call)
      except (ValueError, RecursionError) as e:  # (an int past the digit limit, too deep)
        return f"error: the tool call is not JSON ({e})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
      return 'error: expected {"name": ..., "arguments": {...}}'
    fn = TOOLS.get(call["name"])
    if fn is None:
      return f"error: no tool {call['name']!r} (tools: {', '.join(sorted(TOOLS))})"
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some templates write the arguments as a JSON string
      try:
        args = json.loads(args)
      except (ValueError, RecursionError) as e:
        return f"error: the arguments are not JSON ({e})"
    if not isinstance(args, dict):
      return "error: expected the arguments as an object"
    return _call_within(fn, args, self.timeout_s)


def _call_within(fn: Callable[..., Any], args: dict, timeout_s: float) -> str:
  """fn(**args) as text (run_within: a hung tool holds neither the worker nor its exit);
  its error, or a TimeoutError past timeout_s, as "error: ..."."""
  try:
    result = run_within(lambda: fn(**args), timeout_s, f"tool {fn.__name__!r}")
  except Exception as e:  # noqa: BLE001 - a wrong call is the policy's to learn from
    return f"error: {type(e).__name__}: {e}"
  if isinstance(result, str):
    return result
  try:
    return json.dumps(result, default=str)
  except (TypeError, ValueError):  # e.g. non-string keys, a cycle
    return str(result)


def _cut(text: str, most: int) -> str:
  return text if len(text) <= most else text[:most - 4] + " ..."
