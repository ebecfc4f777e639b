"""The write-ahead log: records survive reopening; a torn or corrupt tail is discarded; an
append that does not fit fails and leaves no torn record."""

import errno
import os

import pytest

from param_server.protos import param_server_pb2 as pb
from param_server.wal import DamagedLog, WriteAheadLog, encode_record, read_records


def record(i):
  return pb.WalRecord(ack=pb.WalAck(take_id=f"take-{i}"))


def write(path, n):
  wal = WriteAheadLog(path)
  for i in range(n):
    wal.append(record(i))
  wal.close()


def test_appended_records_are_read_back_in_order(tmp_path):
  path = str(tmp_path / "a.wal")
  write(path, 5)
  assert [r.ack.take_id for r in WriteAheadLog(path).recovered] == [f"take-{i}" for i in range(5)]


def test_a_torn_tail_is_discarded_and_appends_continue(tmp_path):
  path = str(tmp_path / "a.wal")
  write(path, 3)
  with open(path, "ab") as f:
    f.write(encode_record(record(99))[:-3])  # a crash mid-append
  wal = WriteAheadLog(path)
  assert [r.ack.take_id for r in wal.recovered] == ["take-0", "take-1", "take-2"]
  wal.append(record(3))
  wal.close()
  records, _, torn = read_records(path)
  assert [r.ack.take_id for r in records][-1] == "take-3" and torn == 0


def test_a_record_of_any_size_is_recovered_whole(tmp_path, monkeypatch):
  """A compaction's snapshot may be larger than any bound on a record (it held more than
  1 GiB of queued groups, the bound there was): read back whole, not cut off as torn with
  all that follows. (A bound of 100 bytes stands for one here.)"""
  import param_server.wal as wal_module
  monkeypatch.setattr(wal_module, "MAX_RECORD_BYTES", 100, raising=False)
  path = str(tmp_path / "a.wal")
  wal = WriteAheadLog(path)
  wal.append(pb.WalRecord(snapshot=pb.WalSnapshot(next_rollout_id=7, queued=[
      pb.Prompt(id=str(i), text="x" * 100) for i in range(30)])))
  wal.append(record(1))
  wal.close()
  records = WriteAheadLog(path).recovered
  assert len(records) == 2 and len(records[0].snapshot.queued) == 30


def test_a_corrupt_record_ends_recovery_there(tmp_path):
  path = str(tmp_path / "a.wal")
  write(path, 3)
  size = os.path.getsize(path)
  with open(path, "r+b") as f:  # flip a payload byte of the last record
    f.seek(size - 2)
    byte = f.read(1)
    f.seek(size - 2)
    f.write(bytes([byte[0] ^ 0xFF]))
  assert len(WriteAheadLog(path).recovered) == 2


def test_a_flipped_bit_that_still_parses_is_caught_by_the_checksum(tmp_path):
  """take-2 read as take-3: a record that parses whole but is not what was written (the
  test above flips a byte to invalid UTF-8, which parsing refuses with no checksum)."""
  path = str(tmp_path / "a.wal")
  write(path, 3)
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    f.seek(size - 1)
    byte = f.read(1)
    f.seek(size - 1)
    f.write(bytes([byte[0] ^ 0x01]))
  assert [r.ack.take_id for r in WriteAheadLog(path).recovered] == ["take-0", "take-1"]


def test_closing_the_log_syncs_what_was_appended(tmp_path, monkeypatch):
  path = str(tmp_path / "a.wal")
  wal = WriteAheadLog(path)
  wal.append(record(0))  # not synced by a caller yet
  synced = []
  real = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
  wal.close()
  assert synced

def test_a_damaged_record_with_whole_records_after_it_is_refused_not_truncated(tmp_path):
  """A flipped bit in record 2 of 10 read as a torn tail: the log was cut there, its 8
  acknowledged changes after it lost without a word."""
  path = str(tmp_path / "a.wal")
  write(path, 10)
  size = os.path.getsize(path)
  second = len(encode_record(record(0))) + 10  # a payload byte of record 2
  with open(path, "r+b") as f:
    f.seek(second)
    byte = f.read(1)
    f.seek(second)
    f.write(bytes([byte[0] ^ 0xFF]))
  with pytest.raises(DamagedLog, match=r"a.wal: record 2 \(bytes \d+-\d+\) is damaged and "
                                       r"whole records follow it.*truncate -s \d+ "):
    WriteAheadLog(path)
  assert os.path.getsize(path) == size  # nothing cut

def test_rewrite_replaces_the_log_with_one_record(tmp_path):
  path = str(tmp_path / "a.wal")
  wal = WriteAheadLog(path)
  for i in range(10):
    wal.append(record(i))
  wal.rewrite([pb.WalRecord(snapshot=pb.WalSnapshot(next_rollout_id=42))])
  wal.append(record(10))
  wal.close()
  records, _, _ = read_records(path)
  assert records[0].snapshot.next_rollout_id == 42 and len(records) == 2


def _ops(path):
  """The log's records: "snapshot", or the take id of an ack (`record(i)`: "take-i")."""
  return [r.ack.take_id if r.WhichOneof("op") == "ack" else r.WhichOneof("op")
          for r in read_records(path)[0]]


def test_a_rewrite_since_a_mark_carries_over_what_was_appended_after_it(tmp_path):
  """A snapshot of the state at a mark, written while the log went on: the records appended
  since follow it in the new log, and the log takes appends after."""
  path = str(tmp_path / "a.wal")
  wal = WriteAheadLog(path)
  for i in range(5):
    wal.append(record(i))
  at = wal.mark()
  for i in range(5, 8):
    wal.sync(wal.append(record(i)))
  snapshot = pb.WalRecord(snapshot=pb.WalSnapshot(next_rollout_id=42))
  assert wal.rewrite([snapshot, snapshot], since=at)
  assert wal.records_since_rewrite == 5 and wal.bytes == os.path.getsize(path)
  wal.sync(wal.append(record(8)))
  wal.close()
  assert _ops(path) == ["snapshot", "snapshot", "take-5", "take-6", "take-7", "take-8"]
  assert os.listdir(tmp_path) == ["a.wal"]


def test_a_rewrite_since_a_mark_another_rewrite_passed_changes_nothing(tmp_path):
  path = str(tmp_path / "a.wal")
  wal = WriteAheadLog(path)
  wal.append(record(0))
  at = wal.mark()
  assert wal.rewrite([pb.WalRecord(snapshot=pb.WalSnapshot(next_rollout_id=1))])
  wal.append(record(1))
  assert not wal.rewrite([pb.WalRecord(snapshot=pb.WalSnapshot(next_rollout_id=2))], since=at)
  wal.close()
  records = read_records(path)[0]
  assert records[0].snapshot.next_rollout_id == 1 and _ops(path) == ["snapshot", "take-1"]
  assert os.listdir(tmp_path) == ["a.wal"]


def test_a_snapshot_that_cannot_be_written_leaves_the_log_as_it_was(tmp_path, monkeypatch):
  path = str(tmp_path / "a.wal")
  wal = WriteAheadLog(path)
  wal.sync(wal.append(record(0)))

  def full_disk():
    yield pb.WalRecord(snapshot=pb.WalSnapshot())
    raise OSError(errno.ENOSPC, "No space left on device")

  with pytest.raises(OSError, match="No space"):
    wal.rewrite(full_disk())
  wal.sync(wal.append(record(1)))
  wal.close()
  assert _ops(path) == ["take-0", "take-1"] and os.listdir(tmp_path) == ["a.wal"]


def test_a_snapshot_a_crash_left_half_written_is_cleared_at_the_next_start(tmp_path):
  path = str(tmp_path / "a.wal")
  WriteAheadLog(path).close()
  with open(path + ".tmpx1y2", "wb") as f:
    f.write(b"half a snapshot")
  WriteAheadLog(path).close()
  assert os.listdir(tmp_path) == ["a.wal"]


class _FillingDisk:
  """The log's file on a disk with `room` bytes left: a write takes what fits (a short
  write, as on a nearly full disk), then ENOSPC, until `room` is raised again."""

  def __init__(self, file, room):
    self.file, self.room = file, room

  def write(self, data):
    if self.room <= 0:
      raise OSError(errno.ENOSPC, "No space left on device")
    n = self.file.write(bytes(data[:self.room]))
    self.room -= n
    return n

  def __getattr__(self, name):
    return getattr(self.file, name)


def test_a_full_disk_fails_the_append_and_leaves_no_torn_record(tmp_path):
  """A record that did not fit is cut off again: the append fails (nothing is acknowledged)
  and records appended once there is room follow the last whole one, so recovery keeps
  every record whose append returned (a torn record in between used to cost them all)."""
  path = str(tmp_path / "a.wal")
  wal = WriteAheadLog(path)
  wal.append(record(0))
  size = os.path.getsize(path)
  wal._file = _FillingDisk(wal._file, room=len(encode_record(record(1))) // 2)
  with pytest.raises(OSError, match="No space left"):
    wal.append(record(1))
  assert os.path.getsize(path) == size  # the half-written record is gone
  wal._file.room = 1 << 20  # space freed
  wal.append(record(2))
  wal.append(record(3))
  wal.close()
  records, _, torn = read_records(path)
  assert [r.ack.take_id for r in records] == ["take-0", "take-2", "take-3"] and torn == 0


def test_a_zero_filled_tail_is_torn_not_records(tmp_path):
  """A tail whose size reached the disk before its data reads as zeros: crc32 of no bytes
  is 0, so each 8 zero bytes passed as an empty record, and the server's replay stopped at
  'unknown op None' on every start."""
  path = str(tmp_path / "a.wal")
  write(path, 2)
  with open(path, "ab") as f:
    f.write(bytes(4096))
  wal = WriteAheadLog(path)
  assert [r.ack.take_id for r in wal.recovered] == ["take-0", "take-1"]
  wal.close()
  assert read_records(path)[2] == 0  # cut off


def test_a_rewrite_failing_after_its_rename_loses_nothing_acknowledged(tmp_path, monkeypatch):
  """The folder's fsync fails once the snapshot replaced the log: appends went on into the
  old file, gone from the folder, acknowledged and lost on restart. Now the log refuses
  them until a restart, which recovers every record it acknowledged."""
  from param_server import wal as wal_lib
  path = str(tmp_path / "a.wal")
  wal = WriteAheadLog(path)
  wal.sync(wal.append(record(0)))

  def eio(_):
    raise OSError(errno.EIO, "I/O error")

  monkeypatch.setattr(wal_lib, "fsync_dir", eio)
  with pytest.raises(OSError):
    wal.rewrite([pb.WalRecord(snapshot=pb.WalSnapshot())])
  monkeypatch.undo()
  with pytest.raises(OSError, match="restart the server"):
    wal.sync(wal.append(record(1)))
  wal.close()
  assert [r.WhichOneof("op") for r in WriteAheadLog(path).recovered] == ["snapshot"]


def test_a_failed_fsync_is_never_followed_by_an_acknowledgement(tmp_path, monkeypatch):
  """Linux reports an fsync error once and may drop the pages: a retried fsync's success
  acknowledged a record that never reached the disk."""
  path = str(tmp_path / "a.wal")
  wal = WriteAheadLog(path)
  at = wal.append(record(0))
  real = os.fsync

  def once(fd):
    monkeypatch.setattr(os, "fsync", real)
    raise OSError(errno.EIO, "I/O error")

  monkeypatch.setattr(os, "fsync", once)
  with pytest.raises(OSError, match="I/O error"):
    wal.sync(at)
  with pytest.raises(OSError, match="an fsync failed"):
    wal.sync(at)  # (fsync would succeed now)
  with pytest.raises(OSError, match="an fsync failed"):
    wal.append(record(1))
