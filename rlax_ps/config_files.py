"""Loading ml_collections config files by path, so a recipe can build on another:
`sibling(__file__, "rl_local.py", arg)` is that file's `get_config(arg)`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys

RUN_CONFIG = "run_config.json"  # the config a run in a workdir was started with
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# Where the recipes are: inside an installed wheel (pyproject's package-dir), else beside the
# package in a checkout.
RECIPE_FOLDERS = (os.path.join(_PACKAGE, "configs"),
                  os.path.join(os.path.dirname(_PACKAGE), "configs"))


def load(path: str, arg: str | None = None):
  """`get_config(arg)` of the config file at `path`."""
  name = "rlax_ps_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f"config file {path!r}: not found or not a Python file")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def sibling(file: str, name: str, arg: str | None = None):
  """`get_config(arg)` of the config file `name` in the folder of `file`."""
  return load(os.path.join(os.path.dirname(os.path.abspath(file)), name), arg)


def shipped_recipe(value: str) -> str | None:
  """The recipe rlax-ps ships for a --config `value` (PATH or PATH:ARG) whose PATH is not a
  file here but names one, as `configs/rl_local.py` or `rl_local.py`; None otherwise."""
  path, sep, arg = value.partition(":")  # as ml_collections splits it
  if not path or os.path.exists(path):
    return None
  folder, name = os.path.split(os.path.normpath(path))
  if folder not in ("", "configs") or not name.endswith(".py"):
    return None
  for recipes in RECIPE_FOLDERS:
    if os.path.isfile(os.path.join(recipes, name)):
      return os.path.join(recipes, name) + sep + arg
  return None


def with_shipped_recipes(argv: list[str], prog: str) -> list[str]:
  """`argv` with a --config that names a recipe not in this folder pointed at the one rlax-ps
  ships (said on stderr): an installed rlax-ps runs `--config=configs/rl_local.py` anywhere."""
  out = list(argv)
  for i, arg in enumerate(out):
    for flag in ("--config", "-config"):
      if arg == flag and i + 1 < len(out):
        index, value, prefix = i + 1, out[i + 1], ""
      elif arg.startswith(flag + "="):
        index, value, prefix = i, arg[len(flag) + 1:], flag + "="
      else:
        continue
      shipped = shipped_recipe(value)
      if shipped:
        print(f"{prog}: --config={value}: not a file in {os.getcwd()}; using the recipe "
              f"rlax-ps ships, {shipped}", file=sys.stderr)
        out[index] = prefix + shipped
  return out


def with_defaults(block, cls, skip=()):
  """`block` (a ConfigDict) with each field of the dataclass `cls` that it lacks, but those
  in `skip`, added at its default: a locked config takes overrides of its fields alone."""
  for field in dataclasses.fields(cls):
    if field.name not in block and field.name not in skip:
      block[field.name] = field.default
  return block


def user_path(path, flag: str) -> str:
  """`path` as its user means it: `~` expanded (a shell leaves `--flag=~/x` as it is), made
  absolute; ValueError naming `flag` where it is empty (an unset $VARIABLE: not the current
  folder)."""
  path = os.fspath(path)
  if not path.strip():
    raise ValueError(f"{flag}: expected a path, got {path!r}")
  return os.path.abspath(os.path.expanduser(path))


def make_workdir(path: str, flag: str = "--workdir") -> str:
  """The absolute path of the run folder `path` (user_path), made if absent; ValueError
  naming `flag` where it cannot be (a file of that name, a file above it, no permission)."""
  path = user_path(path, flag)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"{flag}: cannot use {path} as a folder: {e.strerror}") from None
  return path


def check_counts(config, fields) -> None:
  """ValueError naming the first of the dotted `fields` the config has that is not a whole
  number >= 0 (every-N-steps settings, where 0 means off and a negative one would act on
  every step)."""
  for name in fields:
    block, _, key = name.rpartition(".")
    parent = config
    for part in filter(None, block.split(".")):
      parent = parent.get(part) if hasattr(parent, "get") else None
    if not hasattr(parent, "get") or parent.get(key) is None:
      continue
    value = parent.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{name}: expected a whole number >= 0 (0: off), got {value!r}")


def write_json(path: str, value) -> None:
  """`value` as JSON at `path`, whole or not at all (a kill mid-write leaves the old file)."""
  with open(path + ".tmp", "w") as f:
    json.dump(value, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + ".tmp", path)


def save_run_config(config, workdir: str) -> None:
  """Write `config` to <workdir>/run_config.json (what a later run compares with), whole or
  not at all (a kill mid-write left a file every later start failed to read)."""
  write_json(os.path.join(workdir, RUN_CONFIG), _plain(config))


def run_config_changes(workdir: str, config) -> list[str]:
  """'field: saved -> now' for each field where `config` differs from the one a run in
  `workdir` saved; [] when they agree or none was saved."""
  path = os.path.join(workdir, RUN_CONFIG)
  if not os.path.exists(path):
    return []
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"--workdir: cannot read {path} ({e}); delete it, and the run writes it "
                     f"again") from None
  now, out = _plain(config), []

  def walk(a, b, prefix):
    for key in sorted(set(a) | set(b)):
      x, y = a.get(key, "(none)"), b.get(key, "(none)")
      if isinstance(x, dict) and isinstance(y, dict):
        walk(x, y, f"{prefix}{key}.")
      elif x != y:
        out.append(f"{prefix}{key}: {x!r} -> {y!r}")

  walk(saved, now, "")
  return out


def _plain(config) -> dict:
  """A ConfigDict (or dict) as JSON values."""
  return json.loads(json.dumps(config.to_dict() if hasattr(config, "to_dict") else dict(config),
                               default=str))
