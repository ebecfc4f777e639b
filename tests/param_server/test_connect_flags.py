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


def test_a_given_token_needs_no_token_file_and_no_wait(tmp_path, monkeypatch):
  typo = str(tmp_path / "tokns.json")
  monkeypatch.delenv("RLAX_PS_TRAINER_TOKEN", raising=False)
  assert connect_flags.token_for("trainer", "t", typo, wait_s=300.0) == "t"
  monkeypatch.setenv("RLAX_PS_TRAINER_TOKEN", "from-env")
  assert connect_flags.token_for("trainer", None, typo, wait_s=300.0) == "from-env"


def test_waiting_for_the_token_file_is_said_at_once_and_its_end_names_flag_and_path(
    tmp_path, monkeypatch):
  monkeypatch.delenv("RLAX_PS_TRAINER_TOKEN", raising=False)
  typo = str(tmp_path / "tokns.json")
  said = []
  monkeypatch.setattr(connect_flags.logging, "warning", lambda msg, *a: said.append(msg % a))
  with pytest.raises(connect_flags.TokenFileError,
                     match=f"--token_file {typo}: not written within 0.2s"):
    connect_flags.token_for("trainer", None, typo, wait_s=0.2)
  assert len(said) == 1 and f"waiting up to 0.2s for --token_file {typo}" in said[0]
  assert "rlax-ps serve" in said[0]


def test_token_file_errors_name_the_flag_and_path(tmp_path, monkeypatch):
  monkeypatch.delenv("RLAX_PS_WORKER_TOKEN", raising=False)
  missing = str(tmp_path / "missing.json")
  with pytest.raises(connect_flags.TokenFileError, match=f"--token_file {missing}: no such file"):
    connect_flags.token_for("worker", None, missing)
  garbled = tmp_path / "tokens.json"
  garbled.write_text("{worker: x")
  with pytest.raises(connect_flags.TokenFileError,
                     match=f"--token_file {garbled}: not valid JSON"):
    connect_flags.token_for("worker", None, str(garbled))
  garbled.write_bytes(b"\xff\xfe{")  # not UTF-8: a traceback, not one line
  with pytest.raises(connect_flags.TokenFileError,
                     match=f"--token_file {garbled}: not valid JSON"):
    connect_flags.token_for("worker", None, str(garbled))
  garbled.write_text('{"worker": 5}')
  with pytest.raises(connect_flags.TokenFileError, match="'worker': expected a string token"):
    connect_flags.token_for("worker", None, str(garbled))


def test_a_token_with_a_trailing_newline_is_stripped_and_one_with_control_chars_named(
    monkeypatch):
  """gRPC refused `echo`'s newline as "Invalid metadata", naming no token."""
  monkeypatch.setenv("RLAX_PS_WORKER_TOKEN", "w-secret\n")
  assert connect_flags.token_for("worker", None, "") == "w-secret"
  assert connect_flags.token_for("worker", " t\n", "") == "t"
  with pytest.raises(connect_flags.TokenFileError, match="--token: expected a token of "
                                                         "printable ASCII"):
    connect_flags.token_for("worker", "a\x00b", "")


def test_a_server_name_without_a_certificate_is_refused_not_sent_in_clear():
  """--tls_server_name alone was ignored: a plaintext channel, the bearer token in clear."""
  from absl import app, flags
  from absl.testing import flagsaver

  from param_server.client import ParamServerClient
  with pytest.raises(ValueError, match="tls_server_name: 'ps.example.com' without "
                                       "root_certificates"):
    ParamServerClient("127.0.0.1:1", token="t", tls_server_name="ps.example.com")
  parsed = flags.FLAGS.is_parsed()
  flags.FLAGS.mark_as_parsed()
  try:
    with flagsaver.flagsaver(tls_server_name="ps.example.com", tls_ca=None, token="t"), \
         pytest.raises(app.UsageError, match="--tls_server_name=ps.example.com: expected "
                                             "with --tls_ca"):
      connect_flags.connect("worker")
  finally:
    if not parsed:
      flags.FLAGS.unparse_flags()
