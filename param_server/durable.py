"""Writes that a crash (kill -9, a lost VM) leaves whole: the old file or the new one, never
a torn or empty one, and never a rename the folder forgot."""

from __future__ import annotations

import os
import uuid


def fsync_dir(path: str) -> None:
  """Make the folder's entries (a file created, renamed or deleted in it) durable."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_durably(path: str, data: str | bytes, mode: int = 0o644) -> None:
  """Replace `path` with `data`: written to a temporary file (created with `mode`), fsynced,
  renamed over `path`, the folder fsynced."""
  tmp = f"{path}.{uuid.uuid4().hex}.tmp"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data.encode() if isinstance(data, str) else data)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, mode)  # (the umask may have narrowed it)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  fsync_dir(os.path.dirname(os.path.abspath(path)))
