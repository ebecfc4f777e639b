"""A benchmark given a flag value it cannot run with says which flag at once, before any
measuring: not a traceback (a division by zero), nor one after minutes of work."""

import os
import subprocess
import sys

import pytest

from child_env import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args,message", [
    (["continuous_batching.py", "--rows=4", "--samples=8"],
     "--rows: expected at least --samples (8)"),
    (["weight_sync.py", "--elements=1000"], "--elements=1000: 1000 is not integer >= 4096"),
    (["weight_sync.py", "--real_sizes=38M"], "--real_sizes: expected some of ['38m', 'tiny']"),
    (["relay.py", "--relays=0"], "--relays=0: 0 is not a positive integer"),
])
def test_a_flag_value_a_benchmark_cannot_run_with_is_named_up_front(args, message):
  r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", args[0]), *args[1:]],
                     cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr
