"""The load test: 32 simulated workers for 60 s against one server while the trainer publishes."""

import os
import re
import subprocess
import sys

import pytest

from ps_testlib import REPO


@pytest.mark.slow
def test_32_workers_for_60s_lose_and_duplicate_nothing(tmp_path):
  out = subprocess.run(
      [sys.executable, os.path.join(REPO, "benchmarks", "param_server.py"), "--skip_pull", "--seconds=60",
       "--workers=32"], cwd=REPO, capture_output=True, text=True, timeout=600,
      env={**os.environ, "TMPDIR": str(tmp_path)})
  assert out.returncode == 0, out.stderr[-2000:]
  row = next(line for line in out.stdout.splitlines() if line.startswith("load:"))
  acked = int(re.search(r"(\d+) groups acked", row).group(1))
  assert acked > 0
  assert re.search(r"\b0 errors\b", row), row
  assert "lost 0, duplicated 0" in row, row
  assert "p99" in out.stdout  # latencies printed
  assert not os.listdir(tmp_path)  # the server's storage folder is removed
