"""`rlax-ps local` with `local.metrics_port`: the parameter server it starts serves its
Prometheus metrics there and the run knows the URL; off by default; a bad port names the
config key."""

import os
import sys
import urllib.request

import pytest

from param_server import auth
from rlax_ps import config_files, local

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh_tokens(monkeypatch):
  """start_server drops the role tokens from the environment: restore them afterwards."""
  for role in auth.ROLES:
    monkeypatch.delenv(auth.env_var(role), raising=False)


def _stand_in(tmp_path):
  """An interpreter that logs its arguments and says what `rlax-ps serve` says (the
  metrics line only when given a metrics port), then waits to be stopped."""
  fake = tmp_path / "python"
  fake.write_text('#!/bin/sh\necho "args: $*"\n'
                  'echo "parameter server listening on 127.0.0.1:4321"\n'
                  'case "$*" in *--metrics_port=*) '
                  'echo "metrics on http://127.0.0.1:9100/metrics";; esac\n'
                  'exec sleep 60\n')
  fake.chmod(0o755)
  return str(fake)


def _started(tmp_path, **kwargs):
  """(the run after start_server, the server's log), the server stopped."""
  run = local.LocalRun(str(tmp_path / "w"), "cfg.py", [], workers=1, **kwargs)
  try:
    address = run.start_server(timeout_s=30)
  finally:
    run.stop(grace_s=5)
  return run, address, open(run.children[0].log).read()


def test_the_server_serves_metrics_on_the_configured_port(tmp_path, fresh_tokens):
  run, address, log = _started(tmp_path, metrics_port=0, python=_stand_in(tmp_path))
  assert address == "127.0.0.1:4321"
  assert "--metrics_port=0" in log
  assert run.metrics_url == "http://127.0.0.1:9100/metrics"


def test_metrics_are_off_by_default_and_a_bad_port_names_the_key(tmp_path, fresh_tokens):
  config = config_files.load(os.path.join(REPO, "configs/rl_local.py"), "tiny")
  assert config.local.metrics_port == -1
  run, _, log = _started(tmp_path, python=_stand_in(tmp_path))
  assert "--metrics_port" not in log and run.metrics_url == ""
  with pytest.raises(ValueError, match="local.metrics_port: expected -1 .* got 70000"):
    local.LocalRun(str(tmp_path / "w"), "cfg.py", [], workers=1, metrics_port=70000)


def test_serve_flags_reach_the_runs_server_and_its_own_are_refused(tmp_path):
  """local.serve_flags: more `rlax-ps serve` flags (a larger message limit for routing
  replay's long responses); those the run sets itself are refused naming the field."""
  config = config_files.load(os.path.join(REPO, "configs/rl_local.py"), "tiny")
  assert config.local.serve_flags == ""
  run = local.LocalRun(str(tmp_path / "w"), "cfg.py", [], workers=1,
                       serve_flags="--max_message_bytes=268435456  --threads=8")
  assert run.server_args()[-2:] == ["--max_message_bytes=268435456", "--threads=8"]
  for flags in ("--port=9", "--storage_dir=/x", "max_message_bytes=1"):
    with pytest.raises(ValueError, match=r"^local\.serve_flags: expected more"):
      local.LocalRun(str(tmp_path / "w"), "cfg.py", [], workers=1, serve_flags=flags)


@pytest.mark.slow
def test_the_real_servers_metrics_answer_at_the_printed_url(tmp_path, fresh_tokens):
  run = local.LocalRun(str(tmp_path / "w"), "cfg.py", [], workers=1, metrics_port=0,
                       python=sys.executable)
  try:
    run.start_server()
    with urllib.request.urlopen(run.metrics_url, timeout=10) as r:
      text = r.read().decode()
  finally:
    run.stop(grace_s=10)
  assert "rlax_ps_prompts_queued" in text and "rlax_ps_takes_requeued_total" in text


def test_the_step_reader_follows_a_resumed_trainer_that_rewrote_its_steps(tmp_path):
  """A resumed trainer rewrites steps.jsonl without the steps a kill undid: the reader went
  on from the old size, read the middle of a line and ended the supervisor with a
  traceback. It reads the file again and keeps this run's records alone."""
  import json
  import time

  from rlax_ps.train.events import open_steps_jsonl
  path = tmp_path / "steps.jsonl"
  path.write_text("".join(json.dumps({"step": i, "time": time.time() - 100}) + "\n"
                          for i in range(1, 7)))
  reader = local.StepReader(str(path))
  assert reader.last_step == 6 and reader.read() == []
  with open_steps_jsonl(str(path), 4) as f:  # resumed at the checkpoint of step 4
    for i in (5, 6, 7):
      f.write(json.dumps({"step": i, "time": time.time()}) + "\n")
      f.flush()
      assert [r["step"] for r in reader.read()] == [i]
  with open(path, "a") as f:
    f.write("{torn\n")  # a line that is no record does not end the run
  assert reader.read() == []


def test_a_childs_config_flags_give_it_the_supervisors_config_where_two_paths_are_one_block():
  """rl_local's model and sft.model are one block: `--config.model.num_layers=4
  --config.sft.model.num_layers=3 --config.model.num_layers=5` gave the supervisor (and its
  warm start) 5 layers and the trainer and workers, handed the values given in first-given
  order, 3."""
  import ml_collections
  config = ml_collections.ConfigDict({"model": {"num_layers": 2, "name": "m"}, "sft": {}})
  config.sft.model = config.model
  config.model.num_layers = 4
  config.sft.model.num_layers = 3
  config.model.num_layers = 5
  given = {"model.num_layers": 5, "sft.model.num_layers": 3, "model.name": "x y"}
  config.model.name = "x y"
  flags = local.override_flags(given, config)
  assert flags == ["--config.model.num_layers=5", "--config.sft.model.num_layers=5",
                   "--config.model.name=x y"]
