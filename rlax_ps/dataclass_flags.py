"""Settings dataclasses as absl flags: one flag per field, resolved defaults < config < flags.

`ServerConfig` (`rlax-ps serve`) and `WorkerConfig` (`rlax-ps worker`) declare their fields
with `setting(default, help)`; their command lines call `define_flags` once and `resolve` in
main. Imports only absl and the standard library, so a CLI stays light until its flags parse.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypeVar

from absl import flags

T = TypeVar("T")
_DEFINE = {str: flags.DEFINE_string, int: flags.DEFINE_integer, float: flags.DEFINE_float,
           bool: flags.DEFINE_bool}


def setting(default: Any, help_text: str) -> Any:
  """A dataclass field with a default and the help text of its flag."""
  return dataclasses.field(default=default, metadata={"help": help_text})


def define_flags(cls: type, flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """One flag per field of `cls`, named as the field, None unless given on the command line."""
  for f in dataclasses.fields(cls):
    kind = type(f.default)
    if kind not in _DEFINE:
      raise TypeError(f"{cls.__name__}.{f.name}: a flag needs a str, int, float or bool "
                      f"default, got {kind.__name__}")
    _DEFINE[kind](f.name, None, f"{f.metadata.get('help', '')} (default {f.default!r})",
                  flag_values=flag_values)


def resolve(cls: type[T], section: Mapping[str, Any] | None, where: str,
            flag_values: flags.FlagValues = flags.FLAGS) -> T:
  """`cls` from its defaults, then `section` (a config file's, named `where` in errors),
  then every flag given explicitly. An unknown setting in `section` raises ValueError."""
  names = [f.name for f in dataclasses.fields(cls)]
  values = dict(section or {})
  unknown = sorted(set(values) - set(names))
  if unknown:
    raise ValueError(f"{where}: unknown settings {unknown}; expected some of {sorted(names)}")
  values.update({n: flag_values[n].value for n in names if flag_values[n].value is not None})
  return cls(**values)
