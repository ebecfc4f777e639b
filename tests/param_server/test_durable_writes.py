"""The server's small files (its run id, store id, tokens, weight markers) are written so that
a crash leaves the old file or the new one: fsynced, renamed, the folder fsynced."""

import os
import stat

import pytest

from param_server import durable
from param_server.server import RUN_FILE, ParamServer
from ps_testlib import small_config


def test_a_write_is_fsynced_renamed_and_its_folder_fsynced(tmp_path, monkeypatch):
  synced = []
  real = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                               real(fd)))
  path = tmp_path / "RUN"
  path.write_text("old\n")
  durable.write_durably(str(path), "new\n", mode=0o600)
  assert path.read_text() == "new\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
  assert len(synced) == 2 and synced[0].endswith(".tmp") and synced[1] == str(tmp_path)
  assert os.listdir(tmp_path) == ["RUN"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
  path = tmp_path / "RUN"
  path.write_text("old\n")
  monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space")))
  with pytest.raises(OSError, match="No space"):
    durable.write_durably(str(path), "new\n")
  assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["RUN"]


def test_the_servers_run_id_is_written_durably(tmp_path, monkeypatch):
  """The RUN file was renamed into place unsynced: a crash could lose the run id, and with it
  the check that refuses another run's trainer."""
  server = ParamServer(small_config(tmp_path / "ps"))
  try:
    writes = []
    monkeypatch.setattr("param_server.server.write_durably",
                        lambda path, data, **kw: writes.append((path, data)))
    server.servicer._keep_run("run-a")
    assert writes == [(os.path.join(str(tmp_path / "ps"), RUN_FILE), "run-a\n")]
    assert server.servicer.run == "run-a"
  finally:
    server.stop(grace=0)
