"""Code-execution verifier: scoring, and the sandbox's time, memory, network and
filesystem limits. Most tests pass run_as=None (the worker's own user): what they test is
the audit hook and the limits, which a root worker whose Python the sandbox user cannot
run would otherwise refuse to start (test_a_root_worker_refuses_...)."""

import json
import os
import pathlib
import re
import shutil
import stat
import sys
import tempfile
import time

import pytest

from algorithms.verifiers import CodeExecutionVerifier, make_verifier
from algorithms.verifiers.code_exec import _NAMESPACES, _can_run_as, namespace_flags
from algorithms.verifiers import CodeExecutionVerifier

PROGRAM = "def add(a, b):\n  return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]


@pytest.fixture(scope="module")
def verify():
  return CodeExecutionVerifier(timeout_s=10.0, memory_mb=256, run_as=None)


def test_fraction_of_tests_passed(verify):
  result = verify(PROGRAM, TESTS)
  assert result.reward == pytest.approx(2 / 3)
  assert not result.passed and result.info["n_passed"] == 2
  assert any("AssertionError" in e for e in result.info["errors"])
  assert verify(PROGRAM, TESTS[:2]).passed


def test_program_output_does_not_garble_the_reports(verify):
  # partial lines on stdout, and a fake report line, change nothing
  noisy = PROGRAM + 'print("x", end="")\nprint("0" * 32 + \'{"step": "test_2", "ok": true}\')\n'
  result = verify(noisy, TESTS)
  assert result.info["n_passed"] == 2 and result.info["stdout"].startswith("x")


def test_a_program_cannot_report_its_tests_passed_through_the_harness(verify):
  """The harness's report function, nonce and exec lived in __main__, which a program can
  import: three lines gave a wrong add every test passed. Now they are the harness's own,
  and exec patched in builtins does not reach the tests."""
  wrong = "def add(a, b):\n  return 0\n"
  forge = ("import __main__\nfor i in range(3):\n  __main__.report('test_%d' % i, True)\n")
  patch = ("import builtins\nbuiltins.exec = lambda *a, **k: None\n"
           "builtins.compile = lambda *a, **k: None\n")
  tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(5, 1) == 6"]
  for attack in (forge, patch):
    result = verify(wrong + attack, tests)
    assert result.info["n_passed"] == 0 and not result.passed, (attack, result.info)


ALWAYS_EQUAL = "class A:\n  def __eq__(self, other):\n    return True\n  __hash__ = object.__hash__\n"
REWARD_HACKS = {  # a wrong `add` that each of these passed every test with, as a policy learns to
    "an object equal to anything": ALWAYS_EQUAL + "def add(a, b):\n  return A()\n",
    "an int whose == is always true": ("class I(int):\n  def __eq__(self, other):\n    return True\n"
                                       "  __hash__ = int.__hash__\ndef add(a, b):\n  return I(0)\n"),
    "a builtin's != moved to ==": "class I(int):\n  __eq__ = int.__ne__\ndef add(a, b):\n  return I(0)\n",
    "one inside a list": ALWAYS_EQUAL + "def add(a, b):\n  return [A()][0:1][0]\n",
    "one imported from a file it wrote": (
        "open('m.py', 'w').write(" + repr(ALWAYS_EQUAL) + ")\nimport sys\nsys.path.insert(0, '.')\n"
        "import m\ndef add(a, b):\n  return m.A()\n"),
    "a false __bool__": "class B:\n  def __bool__(self):\n    return False\ndef add(a, b):\n  return B()\n",
    "builtins patched": "import builtins\nbuiltins.abs = lambda x: 0\ndef add(a, b):\n  return 0.5\n",
}


@pytest.mark.parametrize("hack", sorted(REWARD_HACKS))
def test_a_program_cannot_pass_the_tests_with_values_whose_comparisons_it_wrote(verify, hack):
  """An object whose __eq__ is always true passed `assert add(1, 2) == 3`: tests ran in the
  program's namespace with its types' own comparisons. Now a value whose comparisons the
  program wrote meets a plain value by identity, and may not be truth-tested."""
  tests = ["assert add(1, 2) == 3", "assert [add(2, 2)] == [4]", "assert add(5, 1) in (6, 7)",
           "assert not add(0, 0) != 0 and add(1, 1) != 5",
           "assert not add(2, 3) - 5 or abs(add(2, 3) - 5.0) < 1e-9", "assert not add(0, 0)"]
  assert verify(PROGRAM, tests).passed
  result = verify(REWARD_HACKS[hack], tests)
  assert result.info["n_passed"] == 0, (hack, result.info)
  assert not result.passed


def test_right_answers_of_library_types_and_program_classes_still_pass(verify):
  """What the rule must not fail: Counter against a dict, a namedtuple against a tuple,
  Fraction against a float, chained and short-circuit comparisons, and a program's class
  compared with its own instances or through plain values it returns."""
  program = (
      "from collections import Counter, defaultdict, namedtuple\nfrom fractions import Fraction\n"
      "P = namedtuple('P', 'x y')\ndef count(s):\n  return Counter(s)\ndef point():\n  return P(1, 2)\n"
      "def half():\n  return Fraction(1, 2)\ndef double(x):\n  return 2.0 * x\n"
      "class V:\n  def __init__(self, x):\n    self.x = x\n"
      "  def __eq__(self, other):\n    return isinstance(other, V) and other.x == self.x\n"
      "class Stack:\n  def __init__(self):\n    self.items = []\n"
      "  def push(self, x):\n    self.items.append(x)\n  def pop(self):\n    return self.items.pop()\n")
  tests = ["assert count('aab') == {'a': 2, 'b': 1}", "assert point() == (1, 2) and point().x == 1",
           "assert half() == 0.5 and half() < 1", "assert 1 < double(1) < 3 and not 1 > 2 > 0",
           "assert V(1) == V(1) and [V(1), V(2)] != [V(1), V(3)]",
           "s = Stack()\ns.push(4)\nassert s.pop() == 4",
           "assert [x for x in range(5) if double(x) > 3] == [2, 3, 4]",
           "assert all(double(i) == 2 * i for i in range(4)) and double(1) is not None",
           "assert (1 if double(1) == 2 else 0) == 1", "assert 2 in [double(1)]",
           "d = defaultdict(int)\nd['a'] += 1\nassert d == {'a': 1}"]
  result = verify(program, tests)
  assert result.passed, result.info["errors"]
  result = verify(program, ["assert double(1) == 3", "assert 3 < double(1) < 5"])
  assert result.info["n_passed"] == 0


def test_a_program_class_met_by_ordering_or_truth_is_named_in_the_error(verify):
  result = verify(ALWAYS_EQUAL + "def add(a, b):\n  return A()\n",
                  ["assert add(1, 2) < 4", "assert add(1, 2)"])
  assert result.info["n_passed"] == 0
  assert [e for e in result.info["errors"] if "type A, defined by the program" in e
          ] == result.info["errors"], result.info["errors"]


def test_the_sandbox_dies_at_its_timeout_also_when_its_caller_died_first(tmp_path):
  """A worker's hard exit mid-call left the sandboxed program (a sleep) running for ever:
  the deadline was only the caller's wait."""
  import signal
  import subprocess
  import time
  caller = subprocess.Popen(
      [sys.executable, "-c", "from algorithms.verifiers import CodeExecutionVerifier\n"
       "CodeExecutionVerifier(timeout_s=2.0, memory_mb=256, run_as=None)('import time\\n"
       f"time.sleep(600)\\n', {TESTS[:1]!r})"],  # (its tests never run: it sleeps)
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
      env=dict(os.environ, TMPDIR=str(tmp_path)))

  def sandboxed():  # processes whose cwd is a scratch folder of this test's
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
      try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
      except OSError:
        continue
      if cwd.startswith(str(tmp_path)) and int(pid) != caller.pid:
        found.append(int(pid))
    return found

  end = time.monotonic() + 30
  while not sandboxed() and time.monotonic() < end:
    time.sleep(0.1)
  assert sandboxed(), "the sandbox never started"
  caller.send_signal(signal.SIGKILL)
  caller.wait()
  end = time.monotonic() + 15
  while sandboxed() and time.monotonic() < end:
    time.sleep(0.2)
  assert not sandboxed()


def test_syntax_error_fails_every_test(verify):
  result = verify("def add(a, b) return a + b", TESTS)
  assert result.reward == 0.0 and not result.passed
  assert "SyntaxError" in result.info["errors"][0]


def test_infinite_loop_is_killed_at_the_timeout():
  result = CodeExecutionVerifier(timeout_s=2.0, memory_mb=256, run_as=None)(
      "while True:\n  pass\n", TESTS)
  assert result.info["timed_out"] and not result.passed and result.reward == 0.0


def test_infinite_loop_in_a_test_keeps_earlier_results():
  result = CodeExecutionVerifier(timeout_s=2.0, memory_mb=256, run_as=None)(
      PROGRAM, [TESTS[0], "while True:\n  pass"])
  assert result.info["timed_out"] and result.info["n_passed"] == 1
  assert result.reward == pytest.approx(0.5) and not result.passed


def test_memory_hog_hits_the_address_space_limit(verify):
  hog = "blocks = []\nwhile True:\n  blocks.append(bytearray(16 << 20))\n"
  result = verify(hog, TESTS)
  assert not result.passed and result.reward == 0.0 and not result.info["timed_out"]
  assert result.info["errors"][0].startswith("MemoryError")


def test_socket_attempt_fails(verify):
  program = ("import socket\n"
             "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
             "s.connect(('1.1.1.1', 80))\n")
  result = verify(program, ["assert True"])
  assert not result.passed and result.reward == 0.0
  assert "socket" in result.info["errors"][0]


def test_socket_attempt_fails_without_a_network_namespace_too():
  verify = CodeExecutionVerifier(timeout_s=10.0, memory_mb=256, use_network_namespace=False,
                                 run_as=None)
  result = verify("import urllib.request\nurllib.request.urlopen('http://1.1.1.1')\n",
                  ["assert True"])
  assert not result.info["network_namespace"] and not result.passed
  assert "sandbox" in result.info["errors"][0]


def test_subprocess_and_writes_outside_scratch_are_refused(verify):
  result = verify("import os\nos.system('echo hi')\n", [])
  assert not result.passed and "os.system" in result.info["errors"][0]
  result = verify("open('/tmp/rlax_ps_sandbox_escape', 'w').write('x')\n", [])
  assert not result.passed and "outside the scratch directory" in result.info["errors"][0]
  # the scratch directory itself is writable and is the working directory
  result = verify("open('out.txt', 'w').write('x')\nassert open('out.txt').read() == 'x'\n", [])
  assert result.passed and result.reward == 1.0


def test_registered_as_code_and_rejects_bad_reference():
  verify = make_verifier("code", timeout_s=5.0, run_as=None)
  for bad, got in [("assert add(1, 2) == 3", "'assert add(1, 2) == 3'"),  # not JSON
                   ('"assert add(1, 2) == 3"', "'\"assert add(1, 2) == 3\"'"),  # a JSON string
                   ('{"tests": [1]}', "'{\"tests\": [1]}'"), ([1], "list")]:
    with pytest.raises(ValueError, match="reference: expected a sequence of test source "
                                         "strings, a dict with 'tests', or either as JSON text "
                                         r"\(such as .*\), got " + re.escape(got)):
      verify(PROGRAM, bad)
  with pytest.raises(ValueError, match="timeout_s: expected > 0"):
    CodeExecutionVerifier(timeout_s=0)


@pytest.fixture
def outside():
  """A folder the sandboxed code sees: not under /tmp, /var/tmp or /dev/shm, which it sees
  as empty folders of its own (where a mount namespace is made); removed after."""
  folder = tempfile.mkdtemp(prefix=".rlax_ps_test_", dir=os.path.expanduser("~"))
  yield pathlib.Path(folder)
  shutil.rmtree(folder, ignore_errors=True)


def test_signals_spawning_and_changes_outside_scratch_are_refused(verify, outside):
  tmp_path = outside
  kept = tmp_path / "kept.txt"
  kept.write_text("mine")
  attempts = {
      "os.kill": "import os\nos.kill(os.getpid(), 0)\n",
      "os.remove outside": f"import os\nos.remove({str(kept)!r})\n",
      "os.rename outside": f"import os\nos.rename({str(kept)!r}, 'taken.txt')\n",
      "os.mkdir outside": f"import os\nos.mkdir({str(tmp_path / 'made')!r})\n",
      "opening a directory outside": (  # a dir_fd would bypass the write check
          f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
          "os.open('kept.txt', os.O_WRONLY, dir_fd=fd)\n"),
      "fork_exec is not allowed": (  # subprocess's own fork+exec raises no audit event
          "import _posixsubprocess\n_posixsubprocess.fork_exec(*[None] * 23)\n"),
      "gc.get_objects": "import gc\ngc.get_objects()\n",
  }
  for refusal, program in attempts.items():
    result = verify(program, [])
    assert not result.passed and refusal in result.info["errors"][0], (refusal, result.info)
  assert kept.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [
      "kept.txt"]
  # inside scratch, the same calls work (shutil.rmtree uses dir_fd)
  inside = ("import os, shutil\nos.mkdir('d')\nopen('a', 'w').write('x')\n"
            "os.rename('a', 'd/b')\nshutil.rmtree('d')\nassert os.listdir('.') == []\n")
  assert verify(inside, []).passed


def _python_others_can_run():
  """A Python that user nobody can run, for the root-only tests (None: there is none)."""
  for python in (sys.executable, "/usr/bin/python3"):
    if os.geteuid() == 0 and os.path.exists(python) and _can_run_as(python, 65534, 65534):
      return python
  return None


def test_as_root_the_child_runs_as_nobody_so_code_past_the_hook_cannot_reach_the_worker(
    outside):
  python = _python_others_can_run()
  if python is None:
    pytest.skip("needs root and a Python that user nobody can run")
  secret = outside / "token"
  secret.write_text("s3cret")
  secret.chmod(0o600)
  verify = CodeExecutionVerifier(timeout_s=10.0, memory_mb=256, python=python, run_as="nobody")
  # the audit hook is a tripwire: code can switch it off through frames and closures
  unhook = ("try:\n  1 / 0\nexcept ZeroDivisionError as e:\n"
            "  main = e.__traceback__.tb_frame.f_back.f_back\n"
            "for c in main.f_locals['hook'].__closure__:\n"
            "  v = c.cell_contents\n"
            "  if isinstance(v, frozenset): c.cell_contents = frozenset()\n"
            "  elif isinstance(v, dict): c.cell_contents = {}\n"
            "  elif getattr(v, '__name__', '') == 'inside': c.cell_contents = lambda *a: True\n"
            "import os\n")
  for program in [f"open({str(secret)!r}).read()", f"open({str(secret)!r}, 'w')",
                  f"os.kill({os.getpid()}, 0)"]:  # not seen (PID namespace) or not allowed
    result = verify(unhook + program + "\n", [])
    assert result.info["uid"] == 65534 and not result.passed, result.info
    assert result.info["errors"][0].startswith(("PermissionError: [Errno 13]",
                                                "ProcessLookupError: [Errno 3]")), result.info
  assert secret.read_text() == "s3cret"


def test_what_the_code_writes_is_bounded_in_total_and_gone_with_it(tmp_path):
  """Only each file was bounded (output_mb): many files filled the worker's disk; and
  /tmp, /var/tmp and /dev/shm were the host's, where code past the audit hook (native,
  as nobody) left files for good and saw other samples' and the worker's. In the mount
  namespace they and the scratch folder are tmpfs of scratch_mb each, gone with the run."""
  if "--mount-proc" not in namespace_flags():
    pytest.skip("needs a mount namespace")
  verify = CodeExecutionVerifier(timeout_s=20.0, memory_mb=256, output_mb=8, scratch_mb=8,
                                 run_as=None)
  fill = "for i in range(4):\n  open('f%d' % i, 'wb').write(b'x' * (3 << 20))\n"
  result = verify(fill, [])
  assert not result.passed and "No space left on device" in result.info["errors"][0]
  (tmp_path / "host.txt").write_text("the worker's")
  look = (f"import os\nassert not os.path.exists({str(tmp_path / 'host.txt')!r})\n"
          "for where in ('/var/tmp', '/dev/shm'):\n  assert os.listdir(where) == [], where\n"
          "assert os.listdir('/tmp') == [os.getcwd().split('/')[2]]\n")
  assert verify(look, []).passed
  # The mounts' ctypes is not left imported: the program's own import still meets the hook.
  result = verify("import ctypes\n", [])
  assert not result.passed and result.info["errors"][0].startswith(
      "PermissionError: sandbox: ctypes.dlopen"), result.info
  python = _python_others_can_run()
  if python is None:
    return
  native = CodeExecutionVerifier(timeout_s=20.0, memory_mb=256, python=python, run_as="nobody")
  leak = f"/tmp/rlax_ps_leak_{os.getpid()}"
  result = native("import ctypes, os\nlibc = ctypes.CDLL(None)\n"
                  f"fd = libc.open({leak.encode()!r}, 0o101, 0o644)\n"
                  "assert fd >= 0 and libc.write(fd, b'left', 4) == 4\n"
                  f"assert os.path.exists({leak!r})\n", [])
  assert result.passed, result.info
  assert not os.path.exists(leak)


def test_an_unknown_run_as_user_is_refused_naming_the_field():
  with pytest.raises(ValueError, match="run_as: expected a user name or uid of this host, "
                                       "got 'no-such-user-here'"):
    CodeExecutionVerifier(run_as="no-such-user-here")


CTYPES_PROGRAM = "import ctypes\nassert ctypes.CDLL(None).getpid() > 0\n"


def test_as_nobody_in_namespaces_ctypes_loads_so_numpy_and_sympy_can():
  python = _python_others_can_run()
  verify = python and CodeExecutionVerifier(timeout_s=10.0, memory_mb=256, python=python,
                                            run_as="nobody")
  if not verify or verify.unshare != _NAMESPACES:
    pytest.skip("needs root, a Python that user nobody can run, and namespaces")
  result = verify(CTYPES_PROGRAM, [])
  assert result.passed and result.info["uid"] == 65534, result.info


@pytest.mark.parametrize("settings", [{"run_as": None},
                                      {"run_as": "nobody", "use_network_namespace": False}])
def test_ctypes_is_refused_where_the_os_does_not_bound_the_code_saying_how(settings):
  """Not as the sandbox user, or not in namespaces: a native call would pass the audit hook
  by, so ctypes (numpy's and sympy's import) stays refused, naming what allows it."""
  python = _python_others_can_run()
  if python is None:  # the sandbox user cannot run a Python here: the worker's own user
    python, settings = sys.executable, {"run_as": None, **settings}
  result = CodeExecutionVerifier(timeout_s=10.0, memory_mb=256, python=python, **settings)(
      CTYPES_PROGRAM, [])
  assert not result.passed
  assert result.info["errors"][0].startswith(
      "PermissionError: sandbox: ctypes.dlopen is not allowed (numpy and sympy import ctypes) "
      "unless the code runs as the sandbox user in namespaces: run the worker as root"), result.info


def test_a_json_text_reference_is_read_as_the_worker_passes_it(verify):
  """Data files and the worker (reference_of) carry the answer as a string: the code task
  scored 0 on every sample, its reference refused as not a sequence."""
  assert verify(PROGRAM, json.dumps(TESTS)).reward == pytest.approx(2 / 3)
  assert verify(PROGRAM, json.dumps({"tests": TESTS[:2]})).passed


def test_the_last_fenced_code_block_runs_else_the_whole_completion(verify):
  """A completion with prose around its code ran whole, a SyntaxError on every sample."""
  prose = ("Here is a first try:\n```python\ndef add(a, b):\n  return 0\n```\n"
           "A note:\n```text\nnot code\n```\nAnd the fix:\n```py\n" + PROGRAM + "```\nDone.")
  result = verify(prose, TESTS[:2])
  assert result.passed and result.info["program_from"] == "last code block", result.info
  bare = verify("Code:\n```\n" + PROGRAM + "```\n", TESTS[:2])
  assert bare.passed and bare.info["program_from"] == "last code block", bare.info
  raw = verify(PROGRAM, TESTS[:2])
  assert raw.passed and raw.info["program_from"] == "completion", raw.info


def test_truncating_and_making_nodes_outside_scratch_are_refused(verify, tmp_path):
  """os.open with O_RDONLY | O_TRUNC emptied a file outside scratch (not counted as a
  write), and os.mknod / os.mkfifo raise no audit event at all."""
  kept = tmp_path / "kept.txt"
  kept.write_text("mine")
  node = f"0o600 | {stat.S_IFIFO}"
  attempts = [
      ("writing outside the scratch directory",
       f"import os\nos.open({str(kept)!r}, os.O_RDONLY | os.O_TRUNC)\n"),
      ("writing outside the scratch directory",
       f"import os\nos.open({str(kept)!r}, os.O_RDONLY | os.O_APPEND)\n"),
      ("os.mkfifo is not allowed", f"import os\nos.mkfifo({str(tmp_path / 'f1')!r})\n"),
      ("os.mknod is not allowed", f"import os\nos.mknod({str(tmp_path / 'f2')!r}, {node})\n"),
      ("posix.mkfifo is not allowed",
       f"import posix\nposix.mkfifo({str(tmp_path / 'f3')!r})\n"),
      ("posix.mknod is not allowed",
       f"import posix\nposix.mknod({str(tmp_path / 'f4')!r}, {node})\n"),
  ]
  for refusal, program in attempts:
    result = verify(program, [])
    assert not result.passed and refusal in result.info["errors"][0], (refusal, result.info)
  assert kept.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["kept.txt"]


def test_a_root_worker_refuses_a_run_as_user_that_cannot_run_its_python(tmp_path, monkeypatch):
  """It logged a warning and ran model-written code as root."""
  if os.geteuid() != 0:
    pytest.skip("needs root: only a root worker switches to run_as")
  hidden = tmp_path / "private"  # a Python behind a folder only root may enter
  hidden.mkdir(mode=0o700)
  python = hidden / "python3"
  python.symlink_to(sys.executable)
  said = (f"run_as: user 'nobody' cannot read the Python at {python} .*give that user read "
          "access.*or run the code as root knowingly: run_as=None, or RLAX_PS_SANDBOX_USER=root")
  with pytest.raises(ValueError, match=said):
    CodeExecutionVerifier(python=str(python), run_as="nobody")
  with monkeypatch.context() as m:  # the default: $RLAX_PS_SANDBOX_USER, else nobody
    m.delenv("RLAX_PS_SANDBOX_USER", raising=False)
    with pytest.raises(ValueError, match=said):
      CodeExecutionVerifier(python=str(python))
    m.setenv("RLAX_PS_SANDBOX_USER", "root")
    assert CodeExecutionVerifier(python=str(python)).user is None
  knowingly = CodeExecutionVerifier(timeout_s=10.0, memory_mb=256, python=str(python),
                                    run_as=None)
  result = knowingly(PROGRAM, TESTS[:2])
  assert result.passed and result.info["uid"] == 0, result.info


def test_a_root_worker_runs_code_as_nobody_with_the_python_named_for_the_sandbox(monkeypatch):
  """A worker's Python that nobody cannot read (a virtualenv under /root) left it two
  choices: refuse, or run the code as root. RLAX_PS_SANDBOX_PYTHON names another."""
  system = "/usr/bin/python3"
  if os.geteuid() != 0 or not _can_run_as(system, 65534, 65534):
    pytest.skip("needs root and a system Python that nobody can run")
  monkeypatch.setenv("RLAX_PS_SANDBOX_PYTHON", system)
  monkeypatch.delenv("RLAX_PS_SANDBOX_USER", raising=False)
  verify = CodeExecutionVerifier(timeout_s=10.0, memory_mb=256)
  assert verify.python == system
  result = verify(PROGRAM, TESTS[:2])
  assert result.passed and result.info["uid"] == 65534, result.info


@pytest.mark.parametrize("end", ["import os\nos._exit(3)\n", "while True:\n  pass\n"])
def test_what_a_program_printed_before_it_died_is_kept(end):
  """stdout, a file, was block-buffered: what was printed before a timeout's kill or an
  os._exit was lost (-I ignores PYTHONUNBUFFERED)."""
  verify = CodeExecutionVerifier(timeout_s=1.0, memory_mb=256, run_as=None)
  result = verify("print('got this far')\n" + end, [])
  assert result.info["stdout"] == "got this far\n" and not result.passed, result.info


@pytest.fixture
def not_root(monkeypatch):
  """This process seen as a worker that is not root (the namespace probe made afresh)."""
  from algorithms.verifiers import code_exec
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  code_exec.namespace_flags.cache_clear()
  yield code_exec
  monkeypatch.undo()
  code_exec.namespace_flags.cache_clear()


def test_a_worker_that_is_not_root_runs_code_in_namespaces_of_its_own(not_root):
  """Its code ran with the worker's own network and processes (no namespace: `unshare -n`
  needs root): now in a user namespace of its own, where it can make them."""
  flags = not_root.namespace_flags()
  if not flags:
    pytest.skip("no user namespaces on this machine")
  assert flags == ("-r", *_NAMESPACES)
  verify = CodeExecutionVerifier(timeout_s=10.0, memory_mb=256)
  worker = os.getpid()
  result = verify("import os\n", [f"assert not os.path.exists('/proc/{worker}')",
                                  "assert os.getpid() < 10"])
  assert result.passed and result.info["network_namespace"], result.info


def test_where_no_namespace_can_be_made_the_code_verifier_refuses_to_start(
    not_root, monkeypatch):
  """Fails closed: model code with the worker's own user and network could read its token
  and call its server. Accepted knowingly with RLAX_PS_NO_SANDBOX=1."""
  monkeypatch.setattr(not_root, "namespace_flags", lambda: ())
  monkeypatch.delenv("RLAX_PS_NO_SANDBOX", raising=False)  # (a test machine's, conftest)
  with pytest.raises(ValueError, match=r"code execution: no namespace can be made here .* "
                                       r"RLAX_PS_NO_SANDBOX=1 in the worker's environment"):
    CodeExecutionVerifier()
  from algorithms.code_interpreter import PythonInterpreter
  with pytest.raises(ValueError, match="no namespace can be made"):
    PythonInterpreter()
  monkeypatch.setenv("RLAX_PS_NO_SANDBOX", "1")
  assert not CodeExecutionVerifier().netns


def test_what_the_code_leaves_running_is_killed_when_it_ends(tmp_path):
  """Without a PID namespace (whose end kills all in it), a process the program started
  and left behind lived on after its score, on the worker's machine."""
  pid_file = tmp_path / "left.pid"
  python = tmp_path / "python"
  python.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nexec {sys.executable} \"$@\"\n")
  python.chmod(0o755)
  verify = CodeExecutionVerifier(timeout_s=10.0, memory_mb=256, use_network_namespace=False,
                                 run_as=None, python=str(python))
  assert verify(PROGRAM, TESTS[:1]).passed
  left = int(pid_file.read_text())
  deadline = time.monotonic() + 10.0  # (a SIGKILL is delivered at once, taken a bit later)
  while _state(left) not in ("Z", "X") and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _state(left) in ("Z", "X"), _state(left)  # a zombie of a killed shell, or gone


def _state(pid: int) -> str:
  """A process's state letter (/proc), "X" once it is gone."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[0]
  except FileNotFoundError:
    return "X"


def test_a_sandbox_that_cannot_start_is_an_error_not_a_score_of_0(tmp_path):
  verify = CodeExecutionVerifier(timeout_s=10.0, memory_mb=256, run_as=None,
                                 python=str(tmp_path / "no_python"))
  with pytest.raises(RuntimeError, match=r"code execution: the sandbox could not start "
                                         r"\(exit 127\)"):
    verify(PROGRAM, TESTS)


def test_the_runs_outputs_are_readable_by_the_worker_alone(tmp_path):
  from algorithms.verifiers.code_exec import _private
  with _private(str(tmp_path / "out")) as f:
    f.write(b"x")
  assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o600


def test_all_tests_passing_then_hanging_is_not_a_pass():
  program = ("import threading, time\n"
             "def add(a, b):\n  return a + b\n"
             "threading.Thread(target=time.sleep, args=(600,)).start()\n")  # never joins
  result = CodeExecutionVerifier(timeout_s=2.0, memory_mb=256, run_as=None)(
      program, ["assert add(1, 2) == 3"])
  assert result.info["timed_out"], result.info
  assert result.info["n_passed"] == 1
  assert not result.passed
