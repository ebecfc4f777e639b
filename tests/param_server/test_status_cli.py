"""`rlax-ps status` as a user meets it: token problems in one line, and a reader that stops
early (`| head -1`) ends it quietly."""

import json
import re
import subprocess
import sys

import pytest

from child_env import child_env
from param_server.protos import param_server_pb2 as pb
from param_server.status_main import format_stats
from ps_testlib import REPO, TOKENS


def _status(*args, **popen):
  return subprocess.Popen([sys.executable, "-m", "rlax_ps", "status", *args], cwd=REPO,
                          env=child_env(tokens=False), text=True, **popen)


def test_status_into_a_closed_pipe_exits_quietly(server):
  proc = _status(f"--address={server.address}", f"--token={TOKENS['viewer']}",
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  proc.stdout.close()  # the reader is gone before the first line (`| head -0`)
  err = proc.stderr.read()
  assert proc.wait(timeout=120) == 141
  assert "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]


@pytest.mark.slow  # ~4 s; test_connect_flags and test_worker_cli_tls's refused-role case
def test_status_token_file_problems_are_one_line_naming_the_file(server, tmp_path):
  for name, text, said in [("missing.json", None, "no such file"),
                           ("garbled.json", "{viewer: x", "not valid JSON")]:
    path = tmp_path / name
    if text is not None:
      path.write_text(text)
    proc = _status(f"--address={server.address}", f"--token_file={path}",
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err[-2000:]
    assert f"rlax-ps status: --token_file {path}: {said}" in err


def test_status_says_no_token_apart_from_a_rejected_one(server, tmp_path):
  tokens = tmp_path / "tokens.json"
  tokens.write_text(json.dumps({"viewer": "wrong"}))
  for flag, said in [(f"--token_file={tokens}", "the viewer token was rejected"),
                     (None, "no token given for role 'viewer'")]:
    proc = _status(f"--address={server.address}", *([flag] if flag else []),
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and said in err, err[-2000:]


def test_status_shows_sizes_in_a_unit_that_reads():
  """A small model's keyframe is kilobytes, not "0.0 MiB"; a large one's stays in MiB or GiB."""
  text = format_stats(pb.Stats(versions=pb.VersionInfo(
      latest_version=4, keyframe_version=0, fmt="bf16", keyframe_bytes=31_521,
      delta_chain_bytes=328, store_id="5e1f"), bytes_served=3 * 2**30))
  assert "v0, 30.8 KiB" in text
  assert re.search(r"storage id +5e1f", text)
  assert "delta chain" in text and "328 B; deltas" in text
  assert "3.0 GiB in 0 pulls" in text
