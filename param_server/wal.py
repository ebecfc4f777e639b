"""Append-only write-ahead log of `WalRecord`s: an acknowledged change survives kill -9.

Each record on disk is `[u32 length][u32 crc32][payload]` (little-endian) and is
fsync'd before the caller acknowledges it. Recovery reads records up to the
first torn or corrupt one and truncates the file there (a crash mid-append
leaves at most one partial record at the tail). `rewrite` replaces the log with
snapshot records atomically (temp file, fsync, rename, fsync of the folder); the snapshot
may be written while appends go on, which it then carries over (`mark`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import os
import shutil
import struct
import tempfile
import threading
import zlib
from collections.abc import Iterable

from absl import logging

from param_server.durable import fsync_dir
from param_server.protos import param_server_pb2 as pb

_HEADER = struct.Struct("<II")




def encode_record(record: pb.WalRecord) -> bytes:
  payload = record.SerializeToString(deterministic=True)
  return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


@dataclasses.dataclass(frozen=True)
class Mark:
  """A point in the log (`WriteAheadLog.mark`): a snapshot of the state held there replaces
  what precedes it, and the records appended after it are carried over."""
  generation: int  # rewrites before it: a rewrite since makes the mark void
  offset: int  # the file's size there
  records: int  # records_since_rewrite there


class DamagedLog(RuntimeError):
  """A record in the middle of the log is damaged: not a torn tail a crash leaves."""


def _record_at(data: bytes, pos: int) -> tuple[pb.WalRecord | None, int]:
  """(the whole record at `pos`, or None: torn, zeros or damaged; where it ends)."""
  length, crc = _HEADER.unpack_from(data, pos)
  start, end = pos + _HEADER.size, pos + _HEADER.size + length
  if end > len(data):  # torn: a crash mid-append (a torn length field reads as past the
    return None, end  # end too; a compaction snapshot may be larger than any bound set here)
  if not length:  # zeros (a tail whose size reached the disk before its data): no record
    return None, end  # has no bytes, yet crc32 of none is 0
  payload = data[start:end]
  if zlib.crc32(payload) != crc:
    return None, end
  record = pb.WalRecord()
  try:
    record.ParseFromString(payload)
  except Exception:  # A crc collision on garbage: treat as torn.
    return None, end
  if record.WhichOneof("op") is None:  # likewise: no change a server wrote
    return None, end
  return record, end


def read_records(path: str) -> tuple[list[pb.WalRecord], int, int]:
  """Returns (records, bytes of the valid prefix, bytes discarded after it). DamagedLog
  when a whole record follows the first bad one: a torn append is the last record, so this
  is damage (a flipped bit) that truncating there would lose acknowledged changes to."""
  if not os.path.exists(path):
    return [], 0, 0
  with open(path, "rb") as f:
    data = f.read()
  records, pos = [], 0
  while pos + _HEADER.size <= len(data):
    record, end = _record_at(data, pos)
    if record is None:
      if _HEADER.size < end and end + _HEADER.size <= len(data) and _record_at(data, end)[0]:
        raise DamagedLog(
            f"write-ahead log {path}: record {len(records) + 1} (bytes {pos}-{end}) is "
            f"damaged and whole records follow it, so it is no torn tail; starting would "
            f"drop acknowledged changes. Restore the storage folder from a copy, or keep "
            f"only the {len(records)} records before it, knowing that what follows is lost: "
            f"truncate -s {pos} {path}")
      break
    records.append(record)
    pos = end
  return records, pos, len(data) - pos


class WriteAheadLog:
  """An open log file. `append` writes a record and returns its position; `sync(position)`
  returns once that record is on disk. Callers append under their own lock and sync after
  releasing it, so concurrent changes share one fsync (group commit); an fsync covers every
  record written before it, so nothing is acknowledged before all it depends on is durable."""

  def __init__(self, path: str, *, fsync: bool = True):
    self.path = path
    self.fsync = fsync
    self._lock = threading.Lock()
    self._sync_lock = threading.Lock()
    records, valid, torn = read_records(path)
    if torn:
      logging.warning("write-ahead log %s: discarding a torn tail of %d bytes "
                      "after %d good records", path, torn, len(records))
      with open(path, "r+b") as f:
        f.truncate(valid)
        os.fsync(f.fileno())
    self.recovered = records
    for left in glob.glob(glob.escape(path) + ".tmp*"):  # a rewrite a crash cut short
      with contextlib.suppress(OSError):
        os.remove(left)
    self._file = open(path, "ab", buffering=0)
    self._generation = 0  # rewrites since opened
    self.bytes = valid
    self.base_bytes = valid  # the log's size when opened or last rewritten
    self.records_since_rewrite = len(records)
    self._written = 0  # logical positions: never reset, also across rewrites
    self._synced = 0
    self._broken = ""  # why the log takes no more records (a torn one it could not cut
    # off, a failed fsync, a rewrite half done): until a restart recovers it

  def append(self, record: pb.WalRecord) -> int:
    """Write one record; OSError (e.g. a full disk) leaves the log as it was, ending at its
    last whole record, so the caller applies and acknowledges nothing, and records written
    later do not follow a torn one (which recovery would discard with them)."""
    blob = encode_record(record)
    with self._lock:
      if self._broken:
        raise OSError(errno.EIO, f"write-ahead log {self.path}: {self._broken}; restart the "
                      f"server to recover the log")
      written = 0
      try:
        while written < len(blob):  # a write to a nearly full disk may take part of it
          n = self._file.write(memoryview(blob)[written:])
          if not n:
            raise OSError(errno.ENOSPC, f"write-ahead log {self.path}: short write")
          written += n
      except OSError:
        if written:
          try:
            os.ftruncate(self._file.fileno(), self.bytes)
          except OSError as e:
            self._broken = f"a failed record could not be cut off ({e})"
        raise
      self.bytes += len(blob)
      self._written += len(blob)
      self.records_since_rewrite += 1
      return self._written

  @property
  def broken(self) -> bool:
    """Whether the log refuses records until a restart."""
    return bool(self._broken)

  @property
  def written(self) -> int:
    """The position after the last record appended (what `sync` of it makes durable)."""
    with self._lock:
      return self._written

  def sync(self, position: int) -> None:
    """Blocks until everything up to `position` (from `append`) is on disk. A failed fsync
    breaks the log for good: the kernel reports it once and may have dropped the pages, so
    a later fsync's success would acknowledge records that never reached the disk."""
    if not self.fsync or self._synced >= position:
      return
    with self._sync_lock:
      if self._synced >= position:
        return
      with self._lock:
        if self._broken:
          raise OSError(errno.EIO, f"write-ahead log {self.path}: {self._broken}; restart "
                        f"the server to recover the log")
        target, fd = self._written, self._file.fileno()
      try:
        os.fsync(fd)
      except OSError as e:
        with self._lock:
          self._broken = f"an fsync failed ({e})"
        raise
      self._synced = max(self._synced, target)

  def mark(self) -> Mark:
    """Where the log ends now: taken with the state it holds, for `rewrite(..., since=)`."""
    with self._lock:
      return Mark(self._generation, self.bytes, self.records_since_rewrite)

  def rewrite(self, records: Iterable[pb.WalRecord], since: Mark | None = None) -> bool:
    """Atomically replaces the log with `records` (a snapshot of the state at `since`, by
    default now) and the records appended after `since`. The snapshot is written and synced
    without holding the log, so appends go on meanwhile; only the carried-over tail, the
    rename and the folder's sync hold them. False, nothing changed, when another rewrite
    came after `since`. An error writing the snapshot leaves the log as it was."""
    since = since or self.mark()
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(self.path) + ".tmp",
                               dir=os.path.dirname(os.path.abspath(self.path)))
    try:
      count = 0
      with os.fdopen(fd, "wb") as f:
        for record in records:  # one at a time: a large snapshot is never held twice
          f.write(encode_record(record))
          count += 1
        f.flush()
        os.fsync(f.fileno())
        snapshot_bytes = f.tell()
    except BaseException:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise
    with self._sync_lock, self._lock:
      try:
        if self._broken:
          raise OSError(errno.EIO, f"write-ahead log {self.path}: {self._broken}")
        if self._generation != since.generation:
          os.remove(tmp)
          return False
        with open(tmp, "ab") as f, open(self.path, "rb") as old:
          old.seek(since.offset)  # what was appended while the snapshot was written
          shutil.copyfileobj(old, f)
          f.flush()
          os.fsync(f.fileno())
          size = f.tell()
        os.replace(tmp, self.path)
      except BaseException:
        with contextlib.suppress(OSError):
          os.remove(tmp)
        raise
      self._generation += 1
      # From here the log is the new file: appends must go to it, never to the old one,
      # which is gone from the folder (what was written there would be lost on restart).
      old = self._file
      try:
        self._file = open(self.path, "ab", buffering=0)
      except OSError as e:
        self._broken = f"the log was rewritten but could not be opened again ({e})"
        raise
      finally:
        with contextlib.suppress(OSError):  # (its writes are all in the new file)
          old.close()
      self.records_since_rewrite = count + self.records_since_rewrite - since.records
      self.bytes, self.base_bytes = size, snapshot_bytes
      try:
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))
      except OSError as e:  # the rename may not last a crash: nothing more is acknowledged
        self._broken = f"the rewritten log's folder could not be synced ({e})"
        raise
      self._synced = self._written
    return True

  def close(self) -> None:
    with self._sync_lock, self._lock:
      if self.fsync and self._synced < self._written:
        os.fsync(self._file.fileno())
      self._file.close()
