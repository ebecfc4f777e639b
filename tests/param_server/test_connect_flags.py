"""connect_flags: a client started beside its server waits for the server's tokens file."""

import threading

import pytest

from param_server import connect_flags


def test_await_file_returns_once_the_server_has_written_it(tmp_path):
  path = tmp_path / "tokens.json"
  path.write_text("")  # created, not yet written: still waiting
  timer = threading.Timer(0.3, lambda: path.write_text('{"trainer": "t"}'))
  timer.start()
  try:
    connect_flags.await_file(str(path), timeout_s=10.0, poll_s=0.05)
  finally:
    timer.join()
  assert connect_flags.token_for("trainer", token_file=str(path)) == "t"


def test_await_file_names_the_file_when_it_never_comes(tmp_path):
  path = tmp_path / "missing.json"
  with pytest.raises(FileNotFoundError, match="missing.json: not written within 0.2s"):
    connect_flags.await_file(str(path), timeout_s=0.2, poll_s=0.05)
