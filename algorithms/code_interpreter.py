"""The "python" environment: a code interpreter for tool-integrated reasoning.

The policy writes ```python blocks and ends its turn; they run, in order, in the code
verifier's sandbox (`algorithms.verifiers.code_exec`: timeout, memory and process limits,
no network, and what it does not protect against) and what they printed comes back as
`<output>...</output>` (the error, if one raised), cut to `max_output_chars`. Each call
runs the blocks of the policy's earlier turns first, their output discarded, so a variable
set in one turn is there in the next, as in a notebook, while the environment itself keeps
no state between calls; a turn whose code timed out or ended the interpreter is left out,
so it does not stop every later one. All of it shares one `timeout_s`. A turn without a
block ends the sample.
"""

from __future__ import annotations

import re
from typing import Any

from algorithms.environments import register_environment
from algorithms.verifiers.code_exec import CodeExecutionVerifier

_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)
# Earlier blocks run with their printing discarded and their errors passed over (as a
# notebook goes on after a failed cell); the latest one prints for real.
_QUIET = "import io as _io, sys as _sys\n_sys.stdout = _io.StringIO()\n"
_CELL = "try:\n  exec({!r}, globals())\nexcept BaseException:\n  pass\n"
_LOUD = "_sys.stdout = _sys.__stdout__\n"
# The latest turn's blocks, part of the program (not a verifier test, whose comparisons are
# rewritten to score plain values): compiled on their own, so an error's line is theirs.
_LATEST = "exec(compile({!r}, 'cell', 'exec'), globals())\n"
_TIMED_OUT = "TimeoutError: the code ran past"
_EXITED = "SystemExit: the interpreter ended"


@register_environment("python")
class PythonInterpreter:
  """Runs the latest turn's ```python blocks after the earlier turns' (module docstring);
  `run_as`: the sandbox user when the worker is root (CodeExecutionVerifier)."""

  def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512,
               max_output_chars: int = 1024, run_as: str | int | None = ""):
    if max_output_chars < 16:
      raise ValueError(f"max_output_chars: expected >= 16, got {max_output_chars!r}")
    self.sandbox = CodeExecutionVerifier(timeout_s=timeout_s, memory_mb=memory_mb,
                                         run_as=run_as)
    self.max_output_chars = int(max_output_chars)

  def __call__(self, messages: list[dict[str, str]], reference: Any) -> str | None:
    del reference
    blocks = _BLOCK.findall(messages[-1]["content"])
    if not blocks:
      return None
    before = "".join(_CELL.format(b) for b in _earlier_blocks(messages[:-1]))
    latest = _LATEST.format("\n".join(blocks))
    info = self.sandbox.run(_QUIET + before + _LOUD + latest, []).info
    text, end = info["stdout"], ""
    if info["timed_out"]:
      end = f"{_TIMED_OUT} {self.sandbox.timeout_s:g} s"
    elif info["errors"] == ["not run"]:  # the interpreter died: os._exit, a signal, a limit
      end = f"{_EXITED} with status {info['returncode']}"
    elif info["errors"]:
      text += info["errors"][-1]
    # The output is cut, not an ending that says the code timed out or ended the interpreter
    # (_earlier_blocks reads it: cut, every later turn would run that code again).
    room = max(self.max_output_chars - len(end), 4)
    if len(text) > room:
      text = text[:room - 4] + " ..."
    return f"<output>\n{(text + end).rstrip()}\n</output>"


def _earlier_blocks(messages: list[dict[str, str]]) -> list[str]:
  """The blocks of the assistant turns, but those of a turn whose reply says its code timed
  out or ended the interpreter (run again, it would end every later turn the same way)."""
  blocks = []
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    reply = "".join(r["content"] for r in messages[i + 1:i + 2] if r["role"] == "tool")
    if _TIMED_OUT not in reply and _EXITED not in reply:
      blocks.extend(_BLOCK.findall(m["content"]))
  return blocks
