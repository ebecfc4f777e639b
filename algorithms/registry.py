"""Which definition may take a name already registered (verifiers, environments, tools):
the same one run again (a reloaded module, a notebook cell), or any of a notebook's or
script's own (`__main__`: a cell edited, renamed or made a factory, then run again; one of
another name is warned of, in case two cells took one name). Another module's definition
under a taken name is a clash."""

from __future__ import annotations

from typing import Any

from absl import logging


def check_register(kind: str, name: str, old: Any, new: Any) -> None:
  """ValueError naming the `kind` of name when `new` may not replace `old` under `name`."""
  if old is None or old is new or _origin(old) == _origin(new):
    return
  if _origin(old)[0] == "__main__" == _origin(new)[0]:
    logging.warning("%s name %r: %s replaces %s (the last definition run takes the name)",
                    kind, name, _origin(new)[1], _origin(old)[1])
    return
  raise ValueError(f"{kind} name: {name!r} is already registered to {old!r}")


def _origin(definition: Any) -> tuple[str | None, str | None]:
  return getattr(definition, "__module__", None), getattr(definition, "__qualname__", None)
