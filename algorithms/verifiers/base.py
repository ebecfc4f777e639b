"""The verifier interface and a registry of verifiers by name.

A verifier scores one completion against a reference (an answer string, an example,
a list of tests): `verifier(completion, reference) -> VerifierResult`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol


@dataclasses.dataclass(frozen=True)
class VerifierResult:
  """reward: the scalar for RL; passed: whether the completion is fully correct;
  info: what was extracted or measured, for logs."""

  reward: float
  passed: bool
  info: dict = dataclasses.field(default_factory=dict)


class Verifier(Protocol):
  def __call__(self, completion: str, reference: Any) -> VerifierResult: ...


VERIFIERS: dict[str, Callable[..., Verifier]] = {}


def register_verifier(name: str):
  """Class or factory decorator: `make_verifier(name, **kwargs)` will call it."""

  def wrap(factory):
    if name in VERIFIERS and VERIFIERS[name] is not factory:
      raise ValueError(f"verifier name: {name!r} is already registered to {VERIFIERS[name]!r}")
    VERIFIERS[name] = factory
    return factory

  return wrap


def make_verifier(name: str, **kwargs: Any) -> Verifier:
  """Build a registered verifier; `task:<name>` wraps the built-in task of that name."""
  if name.startswith("task:"):
    from algorithms.verifiers.tasks import task_verifier  # imports rlax_ps.tasks lazily
    return task_verifier(name[len("task:"):], **kwargs)
  if name not in VERIFIERS:
    raise ValueError(f"verifier: expected one of {sorted(VERIFIERS)} or 'task:<name>', got "
                     f"{name!r}")
  return VERIFIERS[name](**kwargs)
