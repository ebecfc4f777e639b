"""The "python" environment: a code interpreter for tool-integrated reasoning.

The policy writes a ```python block and ends its turn; the block runs in the code
verifier's sandbox (`algorithms.verifiers.code_exec`: timeout, memory limit, no network)
and what it printed comes back as `<output>...</output>` (its error, if it raised), cut to
`max_output_chars`. Each call runs the blocks of the policy's earlier turns first, their
output discarded, so a variable set in one turn is there in the next, as in a notebook,
while the environment itself keeps no state between calls. A turn without a block ends
the sample.
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


@register_environment("python")
class PythonInterpreter:
  """Runs the latest turn's last ```python block after the earlier turns' blocks."""

  def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512,
               max_output_chars: int = 1024):
    if max_output_chars < 16:
      raise ValueError(f"max_output_chars: expected >= 16, got {max_output_chars!r}")
    self.sandbox = CodeExecutionVerifier(timeout_s=timeout_s, memory_mb=memory_mb)
    self.max_output_chars = int(max_output_chars)

  def __call__(self, messages: list[dict[str, str]], reference: Any) -> str | None:
    del reference
    blocks = _BLOCK.findall(messages[-1]["content"])
    if not blocks:
      return None
    before = "".join(_CELL.format(b) for m in messages[:-1] if m["role"] == "assistant"
                     for b in _BLOCK.findall(m["content"]))
    result = self.sandbox(_QUIET + before + _LOUD, [blocks[-1]])
    info = result.info
    text = info["stdout"]
    if info["timed_out"]:
      text += f"TimeoutError: the code ran past {self.sandbox.timeout_s:g} s"
    elif info["errors"]:
      text += info["errors"][-1]
    if len(text) > self.max_output_chars:
      text = text[:self.max_output_chars - 4] + " ..."
    return f"<output>\n{text.rstrip()}\n</output>"
