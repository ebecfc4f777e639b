"""Test setup: CPU only, 8 fake devices for sharding tests, unoptimized XLA:CPU programs, a
persistent compile cache.

The environment must be set before jax is imported anywhere.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# Tests check results, not speed: XLA:CPU's backend optimizations cost compile time (a
# quarter of the model tests' time) and change no IEEE result (no fast math on CPU).
if "xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402

# Compiles dominate a JAX suite on CPU; keep them between runs, outside the repo.
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("RLAX_PS_JAX_CACHE", os.path.expanduser("~/.cache/rlax_ps/jax")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
