"""The JAX persistent compilation cache, kept outside the repository.

Compiles dominate short CPU runs; with the cache a rerun of `make run` starts training
in seconds. RLAX_PS_JAX_CACHE moves it; an empty value turns it off.
"""

from __future__ import annotations

import os

DEFAULT_DIR = os.path.join("~", ".cache", "rlax_ps", "jax")


def enable_compile_cache(directory: str | None = None) -> str | None:
  """Point JAX's persistent cache at `directory` (default ~/.cache/rlax_ps/jax)."""
  if directory is None:
    directory = os.environ.get("RLAX_PS_JAX_CACHE", DEFAULT_DIR)
  if not directory:
    return None
  import jax

  directory = os.path.expanduser(directory)
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  return directory
