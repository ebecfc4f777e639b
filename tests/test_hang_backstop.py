"""The suite's backstop for hangs pytest-timeout cannot end (pyproject.toml's
faulthandler settings): a test stuck in native code holding the GIL ends its process with
every thread's stack printed, instead of stalling the whole run."""

import os
import re
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HANG = '''
import ctypes
import pytest

@pytest.mark.timeout(1)
def test_stuck_holding_the_gil():
  ctypes.PyDLL(None).sleep(600)  # libc's sleep through PyDLL: the GIL stays held
'''


def test_a_test_stuck_holding_the_gil_ends_its_process_naming_where(tmp_path):
  (tmp_path / "test_stuck.py").write_text(HANG)
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", ROOT,
       "-c", os.path.join(ROOT, "pyproject.toml"), "-o", "faulthandler_timeout=3",
       str(tmp_path / "test_stuck.py")],
      cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert done.returncode != 0, done.stdout[-3000:]
  assert "Timeout (0:00:03)!" in done.stderr, done.stdout[-3000:] + done.stderr[-2000:]
  assert "in test_stuck_holding_the_gil" in done.stderr, done.stderr[-2000:]


def test_the_backstop_comes_after_every_tests_own_timeout(pytestconfig):
  backstop = float(pytestconfig.getini("faulthandler_timeout"))
  assert pytestconfig.getini("faulthandler_exit_on_timeout") is True
  marks = [float(m) for path in _test_files()
           for m in re.findall(r"mark\.timeout\((\d+)", open(path).read())]
  assert backstop > max([float(pytestconfig.getini("timeout")), *marks])


def _test_files():
  for folder, _, names in os.walk(os.path.join(ROOT, "tests")):
    yield from (os.path.join(folder, n) for n in names if n.endswith(".py"))
