"""The verifier interface and a registry of verifiers by name.

A verifier scores one completion against a reference (an answer string, an example,
a list of tests): `verifier(completion, reference) -> VerifierResult`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from typing import Any, Callable, Protocol

from algorithms.environments import ENVIRONMENTS
from algorithms.registry import check_register
from algorithms.tools import TOOLS


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
# The task of prompts that the worker's reward model scores (worker.reward_model), not a
# verifier: preference data, records with no answer to check.
REWARD_MODEL_TASK = "reward_model"


def register_verifier(name: str):
  """Class or factory decorator: `make_verifier(name, **kwargs)` will call it; a static
  `check_reference(reference)` on it is run on every record's answer before training
  (reference_check). A name taken by another module's definition is a ValueError; the same
  definition run again, or a notebook's new one, replaces it (check_register)."""

  def wrap(factory):
    from rlax_ps.tasks import TASKS
    if name in TASKS or name == REWARD_MODEL_TASK:  # (prompts of that task never reach it)
      raise ValueError(f"verifier name: {name!r} is a built-in task's, whose own checker "
                       f"scores its prompts; register yours under another name")
    check_register("verifier", name, VERIFIERS.get(name), factory)
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


def verifier_for_task(task: str, field: str = "task") -> Verifier:
  """The verifier a prompt's task names: a built-in task of `rlax_ps.tasks` (its exact
  checker) or a registered verifier; ValueError naming `field` for any other name."""
  from rlax_ps.tasks import TASKS
  if task == REWARD_MODEL_TASK:
    raise ValueError(f"{field}: task {task!r} is scored by the worker's reward model, not a "
                     f"verifier; set worker.reward_model to a reward model checkpoint")
  if task not in TASKS and task not in VERIFIERS:
    raise ValueError(f"{field}: {task!r} is neither a built-in task nor a registered verifier "
                     f"(known: {', '.join(known_tasks())}); a verifier of your own goes in a "
                     f"file that worker.verifiers names")
  if task in TASKS:
    return Guarded(task, make_verifier(f"task:{task}"))
  try:
    verifier = make_verifier(task)
  except Exception as e:  # noqa: BLE001 - the factory is the user's code
    raise ValueError(f"{field}: the verifier {task!r} could not be made: {type(e).__name__}: "
                     f"{e} (@register_verifier decorates a class, or a factory of no "
                     f"arguments, whose instances take (completion, reference))") from e
  if not callable(verifier):
    raise ValueError(f"{field}: the verifier {task!r} made a {type(verifier).__name__}; expected "
                     f"a callable (completion, reference) -> VerifierResult")
  return Guarded(task, verifier)


def verifiers_by_task(default_task: str, verifiers: str = "") -> Callable[[str], Verifier]:
  """Task name ("" = `default_task`) -> its verifier (verifier_for_task), cached, after
  importing the files or modules `verifiers` names (WorkerConfig.verifiers). The default
  task's is made now, so that a wrong name fails at start naming worker.default_task."""
  load_verifiers(verifiers, "worker.verifiers")
  cache = ({} if default_task == REWARD_MODEL_TASK else
           {default_task: verifier_for_task(default_task, "worker.default_task")})

  def verifier_for(task: str) -> Verifier:
    task = task or default_task
    if task not in cache:
      cache[task] = verifier_for_task(task)
    return cache[task]

  return verifier_for


class Guarded:
  """A task's verifier whose exceptions score the completion 0, not passed, with the error
  in `info["error"]`: a completion the verifier cannot parse must not stop a worker (the
  prompt would go back to the queue and stop the next worker too). A NaN or infinite reward
  is scored so too (the server refuses such a group, and its prompt would come back for
  ever). A result that is not a VerifierResult of a numeric reward is a TypeError naming
  the task: that mistake is in every call."""

  def __init__(self, task: str, verifier: Verifier):
    self.task, self.verifier = task, verifier

  def __call__(self, completion: str, reference: Any) -> VerifierResult:
    try:
      result = self.verifier(completion, reference)
    except Exception as e:  # noqa: BLE001 - the verifier is the user's code
      return VerifierResult(0.0, False, {"task": self.task, "error": f"{type(e).__name__}: {e}"})
    if not isinstance(result, VerifierResult):
      raise TypeError(f"verifier of task {self.task!r}: expected a VerifierResult(reward, "
                      f"passed), got {type(result).__name__}")
    try:
      if isinstance(result.reward, (str, bytes)):
        raise TypeError
      reward = float(result.reward)  # a Python, NumPy or JAX scalar
    except (TypeError, ValueError):
      raise TypeError(f"verifier of task {self.task!r}: expected a VerifierResult whose reward "
                      f"is a number, got {type(result.reward).__name__} "
                      f"{result.reward!r}") from None
    if not math.isfinite(reward):
      return VerifierResult(0.0, False, {**result.info, "task": self.task, "error": (
          f"reward: expected a finite number, got {reward}")})
    return VerifierResult(reward, bool(result.passed), result.info)


def reference_check(task: str) -> Callable[[Any], Any] | None:
  """The `check_reference(reference)` of the verifier registered as `task`, if it has one as
  a static or class method (one of an instance is the verifier's own business): it raises
  ValueError for a reference it could never score against, so that a data file in another
  format is refused before training, not scored 0 throughout."""
  factory = VERIFIERS.get(task)
  if not isinstance(inspect.getattr_static(factory, "check_reference", None),
                    (staticmethod, classmethod)):
    return None
  return factory.check_reference


def known_tasks() -> list[str]:
  """The task names a prompt can carry: the built-in tasks, the registered verifiers and
  `reward_model`."""
  from rlax_ps.tasks import TASKS
  return sorted(set(TASKS) | set(VERIFIERS) | {REWARD_MODEL_TASK})


_LOADED: dict[str, list[str]] = {}  # imported file or module -> the names it registered


def _registered(module: str | None = None) -> set[str]:
  """The names registered (by definitions of `module` only, when given)."""
  def of(registry):
    return {name for name, f in registry.items()
            if module is None or getattr(f, "__module__", None) == module}
  return (of(VERIFIERS) | {f"environment:{e}" for e in of(ENVIRONMENTS)}
          | {f"tool:{t}" for t in of(TOOLS)})


def load_verifiers(spec: str, field: str = "verifiers") -> list[str]:
  """Import each comma-separated Python file (`path/rewards.py`) or module (`pkg.rewards`)
  of `spec`, once per process, so that the verifiers it registers with @register_verifier
  can score prompts whose task names them (and the environments and tools it registers can
  answer their turns). Returns the names registered; ValueError naming `field` when one
  cannot be imported or registers nothing."""
  names: list[str] = []
  for entry in filter(None, (e.strip() for e in spec.split(","))):
    key = os.path.abspath(entry) if entry.endswith(".py") else entry
    if key not in _LOADED:
      before = _registered()
      try:
        if key.endswith(".py"):
          if not os.path.isfile(key):
            raise FileNotFoundError(f"no file {key}")
          name = "rlax_ps_verifiers_" + hashlib.blake2b(key.encode(), digest_size=6).hexdigest()
          module_spec = importlib.util.spec_from_file_location(name, key)
          module = importlib.util.module_from_spec(module_spec)
          sys.modules[name] = module
          module_spec.loader.exec_module(module)
        else:
          module = importlib.import_module(key)
      except Exception as e:
        raise ValueError(f"{field}: could not import {entry!r}: {type(e).__name__}: {e}") from e
      # A module imported before (by a config file, a notebook) registered its names then.
      added = sorted(_registered() - before) or sorted(_registered(module.__name__))
      if not added:
        raise ValueError(f"{field}: {entry!r} registered no verifier, environment or tool; "
                         f"decorate a class or factory in it with @register_verifier('name') "
                         f"(or @register_environment('name'), or a function @register_tool)")
      _LOADED[key] = added
    names += _LOADED[key]
  return names
