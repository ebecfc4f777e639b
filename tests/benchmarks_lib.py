"""The scripts of benchmarks/ as modules, so tests can check their pure parts."""

import importlib.util
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")
if BENCHMARKS not in sys.path:  # a benchmark imports its siblings, as when run as a script
  sys.path.append(BENCHMARKS)


def load_benchmark(name: str):
  """benchmarks/<name>.py imported (its main() not run)."""
  spec = importlib.util.spec_from_file_location(f"benchmarks_{name}",
                                                os.path.join(BENCHMARKS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
