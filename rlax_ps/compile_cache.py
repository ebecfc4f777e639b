"""The JAX persistent compilation cache, kept outside the repository.

Compiles dominate short CPU runs; with the cache a rerun of `make run` starts training
in seconds. RLAX_PS_JAX_CACHE moves it; an empty value turns it off.
"""

from __future__ import annotations

import os

from absl import logging

DEFAULT_DIR = os.path.join("~", ".cache", "rlax_ps", "jax")


def enable_compile_cache(directory: str | None = None) -> str | None:
  """Point JAX's persistent cache at `directory` (default ~/.cache/rlax_ps/jax; a URL such
  as gs://... as it is); a local folder that cannot be made leaves the cache off, said,
  not the run failed (a container's read-only or missing home)."""
  if directory is None:
    directory = os.environ.get("RLAX_PS_JAX_CACHE", DEFAULT_DIR)
  if not directory:
    return None
  import jax

  if "://" not in directory:  # (makedirs would make a local ./gs:/bucket tree)
    directory = os.path.expanduser(directory)
    try:
      os.makedirs(directory, exist_ok=True)
    except OSError as e:
      logging.warning("compile cache off: cannot make %s (%s); set RLAX_PS_JAX_CACHE to a "
                      "writable folder to keep compiles between runs", directory,
                      e.strerror or e)
      return None
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  return directory
