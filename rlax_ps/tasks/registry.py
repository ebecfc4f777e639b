"""Task names -> classes, and construction from config keyword arguments."""

from __future__ import annotations

import inspect
from typing import Any

from rlax_ps.tasks.addition import Addition
from rlax_ps.tasks.base import Task
from rlax_ps.tasks.reversal import Reversal

TASKS: dict[str, type[Task]] = {"addition": Addition, "reversal": Reversal}


def get_task(name: str, **kwargs: Any) -> Task:
  """Build a task by name; unknown names or arguments raise an error naming them."""
  if name not in TASKS:
    raise ValueError(f"task: expected one of {sorted(TASKS)}, got {name!r}")
  cls = TASKS[name]
  accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
  unknown = sorted(set(kwargs) - accepted)
  if unknown:
    raise ValueError(f"task {name!r}: unknown arguments {unknown}; accepted: {sorted(accepted)}")
  return cls(**kwargs)
