"""Mistakes an operator makes with `rlax-ps serve`, `relay`, `worker` and `status`: each gets
one clear line naming the flag or field, and loses no data; none a traceback, a hang or a
silent wrong run."""

import errno
import http.server
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading

import grpc
import pytest
from absl import app

from child_env import child_env
from param_server import auth, connect_flags
from param_server import client as client_lib
from param_server.client import ParamServerClient, ParamServerError, Prompt, RetryPolicy
from param_server.metrics import serve_metrics
from param_server.relay import RelayConfig, UpstreamRefused, WeightRelay, names_itself
from param_server.server import CannotListen, ParamServer, ServerConfig
from ports import free_port
from rlax_ps.folder_lock import FolderInUse

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENS = {"trainer": "t-fleet", "worker": "w-fleet", "viewer": "v-fleet"}
ONE_TRY = RetryPolicy(deadline_s=0.0)


def _rlax_ps(*args):
  return subprocess.run([sys.executable, "-m", "rlax_ps", *args], cwd=REPO,
                        env=child_env(tokens=False), capture_output=True, text=True, timeout=60)


@pytest.fixture
def server(tmp_path):
  ps = ParamServer(ServerConfig(storage_dir=str(tmp_path / "ps"), wal_fsync=False, threads=8,
                                compact_in_background=False,
                                **{f"{r}_token": t for r, t in TOKENS.items()})).start()
  yield ps
  ps.stop(grace=0)


def _relay(tmp_path, upstream_address, port=0, retry=ONE_TRY):
  upstream = ParamServerClient(upstream_address, token=TOKENS["worker"], retry=retry)
  return WeightRelay(RelayConfig(storage_dir=str(tmp_path / "relay"), port=port, threads=8),
                     upstream, TOKENS["worker"])


def test_an_address_without_a_port_or_written_as_a_url_names_the_flag():
  with pytest.raises(app.UsageError, match="--address=localhost: expected host:port, got no port"):
    connect_flags.check_address("localhost")
  with pytest.raises(app.UsageError, match="not a URL \\(drop 'http://'"):
    connect_flags.check_address("http://10.0.0.2:50051")
  for fine in ("10.0.0.2:50051", "ipv4:10.0.0.3:50052,10.0.0.2:50051", "dns:///ps:50051",
               "[::1]:50051", "ps.internal:1", "unix:/tmp/ps.sock"):
    connect_flags.check_address(fine)
  # gRPC dialled 99999 as 34463, tried 443 for '::1' and 'localhost:', and retried 'abc' for
  # the whole timeout.
  for bad, said in (("localhost:99999", "port in 1..65535"), ("localhost:abc", "1..65535"),
                    ("localhost:", "got no port"), (":50051", "with a host"),
                    ("::1", "in brackets"), ("[::1]", "got no port")):
    with pytest.raises(app.UsageError, match=f"--address={re.escape(bad)}: .*{said}"):
      connect_flags.check_address(bad)


def test_a_tls_ca_that_is_missing_or_holds_no_certificate_names_the_flag(tmp_path):
  with pytest.raises(app.UsageError, match="--tls_ca=.*missing.pem: .*No such file"):
    connect_flags.read_tls_ca(str(tmp_path / "missing.pem"))
  key = tmp_path / "key.pem"  # a private key given as the CA: gRPC fails every handshake
  key.write_text("-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n")
  with pytest.raises(app.UsageError, match="--tls_ca=.*key.pem: expected a PEM certificate"):
    connect_flags.read_tls_ca(str(key))


def test_a_port_out_of_range_is_refused_not_taken_modulo_65536(tmp_path):
  with pytest.raises(ValueError, match="ServerConfig.port: expected a port 0-65535.*70000"):
    ServerConfig(storage_dir=str(tmp_path), port=70000)
  with pytest.raises(ValueError, match="RelayConfig.port: expected a port 0-65535.*-5"):
    RelayConfig(storage_dir=str(tmp_path), port=-5)


@pytest.mark.parametrize("field, value, message", [
    ("threads", 0, "expected a positive int, got 0"),  # a traceback from grpc's pool
    ("chunk_bytes", 0, "expected a positive int, got 0"),  # the first Publish never returned
    ("pull_message_bytes", 0, "expected a positive int, got 0"),
    ("max_chunk_bytes", 0, "expected a positive int"),  # every publish refused
    ("max_lease_prompts", 0, "expected a positive int"),
    ("max_message_bytes", 100, "expected at least 65536, got 100"),
    ("delta_history", -1, "expected >= 0, got -1"),
    ("cache_bytes", -1, "expected >= 0"),
    ("reap_interval_s", 0.0, "expected seconds > 0, got 0.0"),  # an idle server spun a core
    ("heartbeat_interval_s", 0.0, "expected seconds > 0"),
    ("max_lease_deadline_s", 0.0, "expected seconds > 0"),
    ("max_wait_s", -1.0, "expected seconds >= 0, got -1.0"),
])
def test_server_settings_it_cannot_run_with_are_refused_naming_them(tmp_path, field, value,
                                                                   message):
  with pytest.raises(ValueError, match=f"^ServerConfig.{field}: {message}"):
    ServerConfig(storage_dir=str(tmp_path), **{field: value})


def test_a_corrupt_saved_tokens_file_names_the_file_and_is_kept(tmp_path):
  path = tmp_path / "tokens.json"
  for content in ("{trainer", '["a"]'):
    path.write_text(content)
    with pytest.raises(auth.TokenStoreError, match=f"{path}: expected a JSON object of role"):
      auth.load_tokens(str(tmp_path), {})
    assert path.read_text() == content


def test_a_token_given_to_a_restarted_server_replaces_its_stale_entry_in_the_file(
    tmp_path, monkeypatch):
  """The file kept the first start's trainer token after a restart given --trainer_token: a
  trainer reading --token_file was refused (UNAUTHENTICATED) with no word of why."""
  from param_server.connect_flags import TokenFileError, token_for
  for role in ("trainer", "worker", "viewer"):
    monkeypatch.delenv(f"RLAX_PS_{role.upper()}_TOKEN", raising=False)
  first = auth.load_tokens(str(tmp_path), {})
  path = str(tmp_path / auth.TOKEN_FILE)
  again = auth.load_tokens(str(tmp_path), {"trainer": first["trainer"]})  # the same: kept
  assert again == first and token_for("trainer", token_file=path) == first["trainer"]
  given = auth.load_tokens(str(tmp_path), {"trainer": "another-trainer-token"})
  assert given == {**first, "trainer": "another-trainer-token"}
  assert json.load(open(path)) == {"worker": first["worker"], "viewer": first["viewer"]}
  with pytest.raises(TokenFileError, match=r"expected a JSON object with a 'trainer' token, "
                                           r"found keys \['viewer', 'worker'\] \(a server given "
                                           r"its trainer token by --trainer_token or "
                                           r"\$RLAX_PS_TRAINER_TOKEN keeps none there"):
    token_for("trainer", token_file=path)
  assert token_for("worker", token_file=path) == first["worker"]


def test_a_server_given_every_token_starts_beside_a_token_file_it_cannot_read(tmp_path):
  (tmp_path / auth.TOKEN_FILE).mkdir()  # (unreadable as a file, whoever runs the test)
  given = {"trainer": "t", "worker": "w", "viewer": "v"}
  assert auth.load_tokens(str(tmp_path), given) == given


def test_one_token_for_two_roles_is_refused_naming_them(tmp_path, monkeypatch):
  """The last role matching won: the trainer, given the worker's token too, was refused
  every trainer call as a worker."""
  for role in ("trainer", "worker", "viewer"):
    monkeypatch.delenv(f"RLAX_PS_{role.upper()}_TOKEN", raising=False)
  with pytest.raises(auth.TokenStoreError, match=r"--trainer_token, --worker_token: the "
                                                 r"trainer and worker tokens are the same"):
    auth.load_tokens(str(tmp_path), {"trainer": "same", "worker": "same", "viewer": "v"})
  assert auth.load_tokens(str(tmp_path), {"trainer": "t", "worker": "w", "viewer": "v"})


def test_a_token_file_readable_by_other_users_is_warned_about(tmp_path, monkeypatch):
  monkeypatch.delenv("RLAX_PS_WORKER_TOKEN", raising=False)
  said = []
  monkeypatch.setattr(auth.logging, "warning", lambda msg, *a: said.append(msg % a))
  path = tmp_path / "tokens.json"
  path.write_text(json.dumps(TOKENS))
  path.chmod(0o600)
  assert connect_flags.token_for("worker", None, str(path)) == "w-fleet" and not said
  path.chmod(0o644)
  assert connect_flags.token_for("worker", None, str(path)) == "w-fleet"
  assert len(said) == 1 and f"--token_file {path} is readable by other users" in said[0]


def test_serve_on_a_storage_dir_it_cannot_use_says_so_in_one_line(tmp_path):
  not_a_folder = tmp_path / "ps"
  not_a_folder.write_text("")
  done = _rlax_ps("serve", f"--storage_dir={not_a_folder}", "--port=0")
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert f"--storage_dir {not_a_folder}: cannot serve from it" in done.stderr


def test_relay_on_a_storage_dir_it_cannot_use_says_so_in_one_line(tmp_path, server):
  not_a_folder = tmp_path / "file"
  not_a_folder.write_text("")
  done = _rlax_ps("relay", f"--address={server.address}", f"--token={TOKENS['worker']}",
                  f"--storage_dir={not_a_folder / 'relay'}", "--port=0")
  assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert f"--storage_dir {not_a_folder / 'relay'}: cannot use it" in done.stderr


# The last two are slow (~3 s each, suite time): the first holds the worker's one-line refusal.
@pytest.mark.parametrize("flag, message", [
    ("--config.tokenizer.kind=bogus", "tokenizer.kind: expected 'char' or 'hf'"),
    pytest.param("--config.init_from_hf=/nonexistent", "no config.json in HF checkpoint folder",
                 marks=pytest.mark.slow),
    pytest.param("--config.model.num_layers=0", "ModelConfig.num_layers",
                 marks=pytest.mark.slow)])
def test_a_worker_config_naming_no_usable_model_is_one_line(flag, message):
  done = _rlax_ps("worker", "--config=configs/rl_local.py:tiny", "--address=127.0.0.1:1",
                  "--token=w", flag)
  assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
  assert message in done.stderr


def test_status_with_a_timeout_that_is_not_positive_names_the_flag():
  done = _rlax_ps("status", "--address=127.0.0.1:1", "--timeout_s=-1")
  assert done.returncode == 2, done.stderr[-2000:]
  assert "--timeout_s: expected a positive number of seconds" in done.stderr


def test_a_taken_metrics_port_is_cannot_listen_naming_the_flag():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(CannotListen, match=f"--metrics_port {port}: cannot serve metrics"):
      serve_metrics(object(), "127.0.0.1", port)


def test_a_full_storage_folder_answers_unavailable_naming_it_and_keeps_the_queue(server,
                                                                                monkeypatch):
  with ParamServerClient(server.address, token=TOKENS["trainer"], role="trainer",
                         retry=ONE_TRY) as trainer:
    trainer.enqueue_prompts([Prompt(id="kept", text="1+2=")])

    def full(record):
      raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(server.queues._wal, "append", full)
    with pytest.raises(ParamServerError) as refused:
      trainer.enqueue_prompts([Prompt(id="lost", text="2+2=")])
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE  # clients retry, keeping it
    assert f"storage_dir: {server.config.storage_dir}: storage failed (No space" in str(
        refused.value)
    monkeypatch.undo()
    assert trainer.stats().prompts_queued == 1


@pytest.fixture
def http_address():
  """host:port of an HTTP server (what a metrics port answers), stopped after the test."""
  http_server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
  threading.Thread(target=http_server.serve_forever, daemon=True).start()
  yield f"127.0.0.1:{http_server.server_port}"
  http_server.shutdown()
  http_server.server_close()


def test_a_client_pointed_at_an_http_port_is_told_so_and_not_kept_retrying(monkeypatch,
                                                                           http_address):
  said = []
  monkeypatch.setattr("param_server.client.logging.warning",
                      lambda msg, *a: said.append(msg % a))
  # No deadline (a worker's): the named mistake ends the retries, not the clock.
  with ParamServerClient(http_address, token="w", retry=RetryPolicy(deadline_s=math.inf)) as c:
    with pytest.raises(ParamServerError, match="is not a gRPC server \\(an HTTP server") as e:
      c.latest_version()
  assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION  # a worker does not retry it
  assert f"not retried: {client_lib.MISTAKE_TRIES} attempts in a row" in str(e.value)
  assert said and "is not a gRPC server" in said[0]  # what the first retries log


def test_a_relay_following_an_http_port_does_not_start(tmp_path, http_address):
  with pytest.raises(UpstreamRefused, match=f"--address {http_address}: .*is not a gRPC server"):
    _relay(tmp_path, http_address, retry=RetryPolicy(deadline_s=math.inf)).start()


def test_a_server_that_is_away_is_still_retried_to_the_deadline():
  address = f"127.0.0.1:{free_port()}"  # nothing listens: connection refused
  with ParamServerClient(address, token="w", retry=RetryPolicy(deadline_s=0.5)) as c:
    with pytest.raises(ParamServerError, match="still failing after 0.5s") as e:
      c.latest_version()
  assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_tls_client_of_a_plaintext_server_is_told_to_drop_tls_ca(server):
  tls = ParamServerClient(server.address, token=TOKENS["viewer"], role="viewer",
                          root_certificates=b"", retry=ONE_TRY)
  details = ("failed to connect to all addresses; last error: UNKNOWN: Tls handshake failed "
             "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: WRONG_VERSION_NUMBER")
  assert "is not using TLS; drop --tls_ca" in tls.explained(grpc.StatusCode.UNAVAILABLE, details)
  named = "Custom verification check failed: Hostname Verification Check failed."
  assert "--tls_server_name" in tls.explained(grpc.StatusCode.UNAVAILABLE, named)
  tls.close()


def test_two_relays_on_one_storage_dir_are_refused(tmp_path, server):
  first = _relay(tmp_path, server.address)
  try:
    with pytest.raises(FolderInUse, match="--storage_dir .*relay: held by a weight relay in "
                                          "this process"):
      _relay(tmp_path, server.address)
  finally:
    first.stop(grace=0)
  _relay(tmp_path, server.address).stop(grace=0)  # its lock went with it


def test_a_relay_pointed_at_itself_is_refused_at_once(tmp_path):
  port = free_port()
  relay = _relay(tmp_path, f"127.0.0.1:{port}", port=port, retry=RetryPolicy(deadline_s=1.0))
  with pytest.raises(UpstreamRefused, match=f"--address 127.0.0.1:{port} is this relay's own"):
    relay.start()
  assert not names_itself(f"10.9.8.7:{port}", "0.0.0.0", port)
  assert names_itself(f"localhost:{port}", "0.0.0.0", port)
  assert not names_itself(f"127.0.0.1:{port + 1}", "127.0.0.1", port)


def test_a_trainer_pointed_at_a_relay_is_told_it_is_a_relay(tmp_path, server):
  relay = _relay(tmp_path, server.address).start()
  try:
    with ParamServerClient(relay.address, token=TOKENS["trainer"], role="trainer",
                           retry=ONE_TRY) as trainer:
      with pytest.raises(ParamServerError, match="this is a weight relay: .*worker token only"):
        trainer.latest_version()
  finally:
    relay.stop(grace=0)
