"""Bearer tokens per role, generated token files, health and reflection without a token, TLS."""

import json
import logging
import math
import os
import stat
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from param_server.client import ParamServerClient, ParamServerError, RetryPolicy
from param_server.server import ParamServer
from ps_testlib import TOKENS, client_for, small_config

NO_RETRY = RetryPolicy(deadline_s=0.5)


def error_code(call):
  with pytest.raises(ParamServerError) as info:
    call()
  return info.value.code


def test_missing_or_unknown_token_is_unauthenticated(server):
  # A prefix of a role's token is no token (compared whole, in constant time).
  for token in (None, "wrong-token", TOKENS["trainer"][:-1], TOKENS["trainer"][:1]):
    with ParamServerClient(server.address, token=token, retry=NO_RETRY) as c:
      assert error_code(c.stats) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("role, call", [
    ("worker", lambda c: c.publish(b"x")),
    ("worker", lambda c: c.take_rollouts()),
    ("worker", lambda c: c.enqueue_prompts([])),
    ("worker", lambda c: c.ack("t")),
    ("viewer", lambda c: c.take_rollouts()),  # a dashboard's token takes no trainer's groups
    ("viewer", lambda c: c.ack("t")),
    ("viewer", lambda c: c.lease(1, 1.0, worker_id="w")),
    ("viewer", lambda c: c.pull(None)),
    ("trainer", lambda c: c.submit_rollouts("l", None, worker_id="w")),
    ("trainer", lambda c: c.register("w")),
])
def test_wrong_role_is_permission_denied(server, role, call):
  with client_for(server, role, retry=NO_RETRY) as c:
    assert error_code(lambda: call(c)) == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("role", ["trainer", "worker", "viewer"])
def test_every_role_may_read_versions_and_stats(server, role):
  with client_for(server, role) as c:
    assert c.latest_version() == -1 and c.stats().prompts_queued == 0


def test_health_and_reflection_need_no_token(server):
  channel = grpc.insecure_channel(server.address)
  health = health_pb2_grpc.HealthStub(channel).Check(
      health_pb2.HealthCheckRequest(service="rlax_ps.v1.ParamServer"), timeout=5)
  assert health.status == health_pb2.HealthCheckResponse.SERVING
  stub = reflection_pb2_grpc.ServerReflectionStub(channel)
  (reply,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                       timeout=5)
  names = [s.name for s in reply.list_services_response.service]
  assert "rlax_ps.v1.ParamServer" in names
  channel.close()


def test_generated_tokens_are_saved_owner_only_and_work(tmp_path, monkeypatch):
  for role in TOKENS:
    monkeypatch.delenv(f"RLAX_PS_{role.upper()}_TOKEN", raising=False)
  config = small_config(tmp_path / "ps", trainer_token="", worker_token="", viewer_token="")
  server = ParamServer(config).start()
  try:
    path = tmp_path / "ps" / "tokens.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    tokens = json.loads(path.read_text())
    assert len({tokens[r] for r in TOKENS}) == 3
    with ParamServerClient(server.address, token=tokens["viewer"]) as c:
      assert c.latest_version() == -1
  finally:
    server.stop(grace=0)
  again = ParamServer(config)  # a restart reuses the saved tokens
  assert again.tokens == tokens
  again.queues.close()


def test_tokens_from_the_environment_and_never_logged(tmp_path, monkeypatch, caplog):
  monkeypatch.setenv("RLAX_PS_WORKER_TOKEN", "env-worker-token")
  caplog.set_level(logging.DEBUG)
  server = ParamServer(small_config(tmp_path / "ps", worker_token="")).start()
  try:
    with ParamServerClient(server.address, token="env-worker-token", retry=NO_RETRY) as c:
      assert c.latest_version() == -1
      error_code(lambda: c.publish(b"x"))
    with ParamServerClient(server.address, token="bad", retry=NO_RETRY) as c:
      error_code(c.stats)
  finally:
    server.stop(grace=0)
  text = caplog.text
  for secret in ("env-worker-token", *TOKENS.values()):
    assert secret not in text
  assert "Publish" in text  # the denial itself is logged


def _self_signed(tmp_path):
  key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                  str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                  "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
  return key, cert


def test_tls_serves_trusting_clients_only(tmp_path, start_server):
  key, cert = _self_signed(tmp_path)
  server = start_server(tls_cert=str(cert), tls_key=str(key))
  root = cert.read_bytes()
  with client_for(server, "viewer", root_certificates=root, tls_server_name="localhost") as c:
    assert c.latest_version() == -1
  with client_for(server, "viewer", retry=RetryPolicy(deadline_s=math.inf)) as plain:
    # A plaintext client of a TLS server is a mistake, not an outage: not retried forever.
    assert error_code(plain.latest_version) == grpc.StatusCode.FAILED_PRECONDITION


def test_no_token_is_told_apart_from_a_rejected_one(server):
  with ParamServerClient(server.address, token=None, role="viewer", retry=NO_RETRY) as c:
    with pytest.raises(ParamServerError, match="no token given for role 'viewer'.*--token_file"):
      c.stats()
  with ParamServerClient(server.address, token="wrong", role="viewer", retry=NO_RETRY) as c:
    with pytest.raises(ParamServerError, match="the viewer token was rejected by"):
      c.stats()


def test_a_plaintext_client_of_a_tls_server_is_told_to_pass_tls_ca(tmp_path, start_server):
  key, cert = _self_signed(tmp_path)
  server = start_server(tls_cert=str(cert), tls_key=str(key))
  with client_for(server, "viewer", retry=NO_RETRY) as plain:
    with pytest.raises(ParamServerError, match="is the server at .* using TLS\\? pass --tls_ca"):
      plain.latest_version()


def test_a_client_given_another_ca_is_told_so_not_retried(tmp_path, start_server):
  """A --tls_ca that did not sign the server's certificate read as an outage: retried to the
  deadline, and a relay given it started and followed nothing."""
  key, cert = _self_signed(tmp_path)
  server = start_server(tls_cert=str(cert), tls_key=str(key))
  (tmp_path / "other").mkdir()
  _, other = _self_signed(tmp_path / "other")
  with client_for(server, "viewer", root_certificates=other.read_bytes(),
                  tls_server_name="localhost", retry=RetryPolicy(deadline_s=30.0)) as c:
    with pytest.raises(ParamServerError, match="is not signed by --tls_ca") as e:
      c.latest_version()
  assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("where", ["flag", "environment", "file"])
def test_a_token_with_a_secret_files_newline_is_taken_as_clients_take_it(tmp_path, monkeypatch,
                                                                        where):
  """`openssl rand -hex 32 > f` leaves a newline: the server took the token with it, the
  clients without it (a header cannot carry it), and every call was refused."""
  given = {"worker_token": ""}
  if where == "flag":
    given["worker_token"] = "worker-secret\n"
  elif where == "environment":
    monkeypatch.setenv("RLAX_PS_WORKER_TOKEN", "worker-secret\n")
  else:
    (tmp_path / "ps").mkdir()
    (tmp_path / "ps" / "tokens.json").write_text(json.dumps({"worker": "worker-secret\n"}))
  server = ParamServer(small_config(tmp_path / "ps", **given)).start()
  try:
    with ParamServerClient(server.address, token="worker-secret", retry=NO_RETRY) as c:
      assert c.latest_version() == -1
  finally:
    server.stop(grace=0)
  monkeypatch.setenv("RLAX_PS_WORKER_TOKEN", "worker\tsecret")
  from param_server.auth import TokenStoreError
  with pytest.raises(TokenStoreError, match=r"^\$RLAX_PS_WORKER_TOKEN: expected a token of "
                                            r"printable ASCII"):
    ParamServer(small_config(tmp_path / "ps2", worker_token=""))
