"""One parameter server per storage folder: an exclusive lock on <storage_dir>/LOCK, held
while the server lives and let go by the kernel when its process dies (even by kill -9),
so a second server on the same folder is refused instead of interleaving its write-ahead
log and weights with the first one's."""

from __future__ import annotations

import fcntl
import os

LOCK_FILE = "LOCK"


class StorageInUse(RuntimeError):
  """Another live process holds the storage folder."""


class StorageLock:
  """The lock on a storage folder, taken at construction; `release()` lets it go."""

  def __init__(self, storage_dir: str):
    self.path = os.path.join(storage_dir, LOCK_FILE)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
      os.close(fd)
      raise StorageInUse(f"--storage_dir {storage_dir}: in use by another parameter server "
                         f"(pid {holder}, {self.path}); stop it, or give this one another "
                         f"folder") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    self._fd: int | None = fd

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the descriptor drops the lock
      self._fd = None
