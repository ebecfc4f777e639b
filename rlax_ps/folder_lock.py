"""One live process per folder: an exclusive lock on <folder>/LOCK, held while its holder
lives and let go by the kernel when the process dies (even by kill -9). A parameter server
holds its --storage_dir (a second would interleave its write-ahead log and weights with the
first one's); a trainer holds its --workdir (a second would interleave checkpoints)."""

from __future__ import annotations

import fcntl
import os
import weakref

LOCK_FILE = "LOCK"
_HELD: set[str] = set()  # the lock files this process holds (a pid is no proof: containers)


class FolderInUse(RuntimeError):
  """Another live process holds the folder (or its filesystem cannot lock it: said so)."""


class FolderLock:
  """The lock on a folder, taken at construction by a `holder` (what the message calls it)
  given the folder by `flag`; `release()` lets it go, as does collecting the lock (a
  notebook's trainer dropped unclosed must not hold its folder for the kernel's life)."""

  def __init__(self, folder: str, *, holder: str, flag: str):
    self.path = os.path.join(folder, LOCK_FILE)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      pid = os.read(fd, 64).decode(errors="replace").strip() or "?"
      os.close(fd)
      if os.path.realpath(self.path) in _HELD:  # a notebook cell's, interrupted or re-run
        raise FolderInUse(f"{flag} {folder}: held by a {holder} in this process that was not "
                          f"closed (an interrupted cell's?): call its close(), or open it "
                          f"with `with`; or give this one another folder") from None
      raise FolderInUse(f"{flag} {folder}: in use by another {holder} (pid {pid}, "
                        f"{self.path}); stop it, or give this one another folder") from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP: no holder to name or stop
      os.close(fd)
      raise FolderInUse(f"{flag} {folder}: cannot lock {self.path} ({e.strerror or e}): its "
                        f"filesystem does not support locks (NFS without lockd, some FUSE "
                        f"mounts); give the {holder} a folder on one that does") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    held = os.path.realpath(self.path)
    _HELD.add(held)
    self._close = weakref.finalize(self, _let_go, fd, held)

  def release(self) -> None:
    self._close()  # (once: later calls do nothing)


def _let_go(fd: int, held: str) -> None:
  _HELD.discard(held)
  os.close(fd)  # closing the descriptor drops the lock
