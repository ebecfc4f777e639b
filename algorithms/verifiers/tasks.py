"""Adapter: any task object with an exact checker `reward(example, completion) -> float`
becomes a `Verifier` (the synthetic tasks of `rlax_ps.tasks` among them)."""

from __future__ import annotations

from typing import Any

from algorithms.verifiers.base import VerifierResult


class TaskVerifier:
  """Wraps `task.reward(reference, completion)`; passed when reward >= pass_threshold."""

  def __init__(self, task: Any, pass_threshold: float = 1.0):
    if not callable(getattr(task, "reward", None)):
      raise TypeError(f"task: expected an object with a reward(example, completion) method, "
                      f"got {type(task).__name__}")
    self.task = task
    self.pass_threshold = pass_threshold

  def __call__(self, completion: str, reference: Any) -> VerifierResult:
    reward = float(self.task.reward(reference, completion))
    return VerifierResult(reward=reward, passed=reward >= self.pass_threshold,
                          info={"task": getattr(self.task, "name", type(self.task).__name__)})


def task_verifier(name: str, pass_threshold: float = 1.0, **task_kwargs: Any) -> TaskVerifier:
  """The verifier of the built-in task `name` (rlax_ps.tasks.get_task(name, **task_kwargs))."""
  from rlax_ps.tasks import get_task
  return TaskVerifier(get_task(name, **task_kwargs), pass_threshold)
