"""Loading ml_collections config files by path, so a recipe can build on another:
`sibling(__file__, "rl_local.py", arg)` is that file's `get_config(arg)`."""

from __future__ import annotations

import importlib.util
import os


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
