"""`rlax-ps worker` against a TLS parameter server with role tokens read from a token file:
it pulls the published weights, answers a leased prompt and exits; a token file without a
worker token is refused naming the file."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from child_env import child_env
from param_server.client import ParamServerClient, Prompt, RetryPolicy
from param_server.server import ParamServer, ServerConfig
from rlax_ps import config_files, sync
from rlax_ps.models import Transformer, flatten_params, model_config_from
from rlax_ps.tokenizers import CharTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = {"trainer": "t-tls", "worker": "w-tls", "viewer": "v-tls"}
CONFIG = "configs/rl_local.py:tiny"


def _self_signed(tmp_path):
  key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                  "-out", str(cert), "-days", "1", "-subj", "/CN=rlax-test", "-addext",
                  "subjectAltName=DNS:rlax-test"], check=True, capture_output=True)
  return key, cert


def _worker(address, token_file, *extra):
  env = child_env(tokens=False)
  return subprocess.run([sys.executable, "-m", "rlax_ps", "worker", f"--config={CONFIG}",
                         f"--address={address}", f"--token_file={token_file}", "--max_leases=1",
                         "--backoff_max_s=0.5", *extra],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def tls_server(tmp_path):
  key, cert = _self_signed(tmp_path)
  server = ParamServer(ServerConfig(
      storage_dir=str(tmp_path / "ps"), port=0, tls_cert=str(cert), tls_key=str(key),
      wal_fsync=False, compact_in_background=False, threads=16, **{
          f"{r}_token": t for r, t in TOKENS.items()})).start()
  yield server, cert
  server.stop(grace=0)


def test_worker_serves_a_tls_server_with_tokens_from_a_file(tls_server, tmp_path):
  server, cert = tls_server
  tokens = tmp_path / "tokens.json"
  tokens.write_text(json.dumps(TOKENS))
  cfg = config_files.load(os.path.join(REPO, "configs", "rl_local.py"), "tiny")
  model_config = model_config_from(cfg.model, CharTokenizer().vocab_size)
  params = {k: np.asarray(v) for k, v in
            flatten_params(Transformer(model_config, rngs=nnx.Rngs(0))).items()}
  with ParamServerClient(server.address, token=TOKENS["trainer"], role="trainer",
                         root_certificates=cert.read_bytes(), tls_server_name="rlax-test",
                         retry=RetryPolicy(deadline_s=5.0)) as trainer:
    trainer.publish(sync.encode(None, params, "bf16", version=0).to_bytes())
    trainer.enqueue_prompts([Prompt(id="p0", text="1+2=", task="addition", extra=b"3")])
    done = _worker(server.address, tokens, f"--tls_ca={cert}", "--tls_server_name=rlax-test")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 groups submitted" in done.stdout and "holds v0 digest" in done.stdout
    taken = trainer.take_rollouts(0, 4).rollouts
  assert [t.prompt.id for t in taken] == ["p0"] and taken[0].group.policy_version == 0


def test_a_token_file_without_the_workers_role_is_refused_naming_it(tls_server, tmp_path):
  server, cert = tls_server
  tokens = tmp_path / "tokens.json"
  tokens.write_text(json.dumps({"viewer": "v-tls"}))
  done = _worker(server.address, tokens, f"--tls_ca={cert}", "--tls_server_name=rlax-test")
  assert done.returncode != 0
  assert f"--token_file {tokens}: expected a JSON object with a 'worker' token" in done.stderr


@pytest.mark.slow  # ~13 s; the refused-role case below stays in the default suite
def test_a_wrong_token_or_a_missing_token_file_is_one_line_not_a_traceback(tls_server, tmp_path):
  server, cert = tls_server
  tokens = tmp_path / "tokens.json"
  tokens.write_text(json.dumps({"worker": "not-the-servers"}))
  tls = (f"--tls_ca={cert}", "--tls_server_name=rlax-test")
  refused = _worker(server.address, tokens, *tls)
  assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
  assert "UNAUTHENTICATED: the worker token was rejected by" in refused.stderr
  missing = _worker(server.address, tmp_path / "tokns.json", *tls)
  assert missing.returncode != 0 and "Traceback" not in missing.stderr, missing.stderr[-2000:]
  assert f"--token_file {tmp_path / 'tokns.json'}: no such file" in missing.stderr
  tokens.write_text(json.dumps(TOKENS))
  too_long = _worker(server.address, tokens, *tls, "--max_new_tokens=100000")
  assert too_long.returncode != 0 and "Traceback" not in too_long.stderr, too_long.stderr[-2000:]
  assert "WorkerConfig.max_new_tokens: expected fewer than the model's" in too_long.stderr
