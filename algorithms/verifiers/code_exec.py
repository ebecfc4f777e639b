"""Code-execution verifier: run candidate Python against tests in a sandboxed subprocess.

The child gets a wall-clock timeout (its whole process group is killed), an address
space limit (RLIMIT_AS), CPU, file-size and core limits, a fresh scratch directory as
cwd/HOME/TMPDIR, an isolated interpreter (-I -B, empty environment), and no network:
a new network namespace (`unshare -n`) when the host allows it, and always an audit
hook that refuses socket creation/connection, subprocesses, exec and fork.
These bound resources and stop accidents and reward hacks through the network or
filesystem; code in the same interpreter can still tamper with the harness itself,
so this is not a security boundary against a hostile adversary.

The reference is a sequence of test snippets (Python source, usually `assert` lines)
run one by one after the candidate, in its namespace. reward = fraction of tests
passed; passed = all of them passed.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from algorithms.verifiers.base import VerifierResult, register_verifier

# Runs in the child. Reads a nonce, the report fd and its resource limits from stdin
# (set here rather than in a preexec_fn, which is unsafe in a multithreaded parent such
# as a JAX process), then the program and tests from the scratch directory (deleting
# them), installs the audit hook, runs everything and writes one nonce-prefixed JSON
# line per step to the report fd (apart from stdout, so whatever the program prints
# cannot garble a report).
_HARNESS = r"""
import json, os, resource, sys
nonce, report_fd, mem, cpu, fsize = sys.stdin.readline().split()
for limit, value in ((resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_CPU, int(cpu)),
                     (resource.RLIMIT_FSIZE, int(fsize)), (resource.RLIMIT_CORE, 0)):
  resource.setrlimit(limit, (value, value))
sys.stdin.close()
sys.stdin = open(os.devnull)
with open("job.json") as f:
  job = json.load(f)
os.remove("job.json")
scratch = os.path.realpath(os.getcwd())
out = os.fdopen(int(report_fd), "w")
BLOCKED = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
           "socket.sendto", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
           "os.spawn", "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen",
           "ctypes.dlsym", "sys.addaudithook"}
def hook(event, args):
  if event in BLOCKED:
    raise PermissionError("sandbox: " + event + " is not allowed")
  if event == "open" and args[0] is not None and not isinstance(args[0], int):
    mode, flags = args[1], args[2]
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    if writing:
      path = os.path.realpath(os.fsdecode(args[0]))
      if not (path == scratch or path.startswith(scratch + os.sep)):
        raise PermissionError("sandbox: writing outside the scratch directory: " + path)
sys.addaudithook(hook)
def report(step, ok, error=""):
  out.write(nonce + json.dumps({"step": step, "ok": ok, "error": error[:500]}) + "\n")
  out.flush()
ns = {"__name__": "__main__", "__builtins__": __builtins__}
def run(step, source):
  try:
    exec(compile(source, step, "exec"), ns)
    report(step, True)
    return True
  except BaseException as e:
    report(step, False, type(e).__name__ + ": " + str(e))
    return False
tests = job.pop("tests")
if run("program", job.pop("program")):
  for i, test in enumerate(tests):
    run("test_%d" % i, test)
else:
  ns.clear()

"""


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
  """Whether `unshare -n` works here (root or user namespaces); probed once."""
  exe = shutil.which("unshare")
  if exe is None:
    return False
  try:
    return subprocess.run([exe, "-n", "true"], capture_output=True, timeout=10).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


@register_verifier("code")
class CodeExecutionVerifier:
  """Scores a Python program by the fraction of test snippets that pass (module docstring)."""

  def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512, output_mb: int = 8,
               use_network_namespace: bool = True, python: str | None = None):
    if not timeout_s > 0:
      raise ValueError(f"timeout_s: expected > 0, got {timeout_s!r}")
    if not memory_mb >= 64:
      raise ValueError(f"memory_mb: expected >= 64 (the interpreter needs it), got "
                       f"{memory_mb!r}")
    self.timeout_s = float(timeout_s)
    self.memory_bytes = int(memory_mb) << 20
    self.output_bytes = int(output_mb) << 20
    self.netns = use_network_namespace and network_namespace_available()
    self.python = python or sys.executable

  def __call__(self, completion: str, reference: Any) -> VerifierResult:
    tests = reference.get("tests") if isinstance(reference, dict) else reference
    if isinstance(tests, str) or not isinstance(tests, Sequence) or not all(
        isinstance(t, str) for t in tests):
      raise ValueError(f"reference: expected a sequence of test source strings (or a dict "
                       f"with 'tests'), got {type(reference).__name__}")
    with tempfile.TemporaryDirectory(prefix="rlax_ps_code_") as root:
      scratch = os.path.join(root, "scratch")
      os.mkdir(scratch)
      with open(os.path.join(scratch, "job.json"), "w") as f:
        json.dump({"program": completion, "tests": list(tests)}, f)
      nonce = secrets.token_hex(16)
      out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
      report_path = os.path.join(root, "reports")
      cmd = [self.python, "-I", "-B", "-c", _HARNESS]
      if self.netns:
        cmd = [shutil.which("unshare"), "-n", "--"] + cmd
      env = {"HOME": scratch, "TMPDIR": scratch, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
      timed_out = False
      with open(out_path, "wb") as out, open(err_path, "wb") as err, open(
          report_path, "wb") as reports:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=scratch, env=env,
            start_new_session=True, pass_fds=(reports.fileno(),))
        try:
          proc.stdin.write(f"{nonce} {reports.fileno()} {self.memory_bytes} "
                           f"{int(self.timeout_s) + 1} {self.output_bytes}\n".encode())
          proc.stdin.close()
        except BrokenPipeError:
          pass  # the child died before reading its settings; its exit status says why
        try:
          proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
          timed_out = True
          os.killpg(proc.pid, signal.SIGKILL)
          proc.wait()
      steps = _read_reports(report_path, nonce)
      with open(err_path, "rb") as f:
        stderr_tail = f.read()[-2000:].decode("utf-8", "replace")
      with open(out_path, "rb") as f:
        stdout_head = f.read(2000).decode("utf-8", "replace")
    program_ok = steps.get("program", {}).get("ok", False)
    results = [steps.get(f"test_{i}", {"ok": False, "error": "not run"}) for i in range(len(tests))]
    n_passed = sum(bool(r["ok"]) for r in results) if program_ok else 0
    fraction = n_passed / len(tests) if tests else float(program_ok and not timed_out)
    passed = program_ok and n_passed == len(tests) and not timed_out
    errors = [steps.get("program", {}).get("error", "")] + [r.get("error", "") for r in results]
    info = {"n_tests": len(tests), "n_passed": n_passed, "timed_out": timed_out,
            "returncode": proc.returncode, "errors": [e for e in errors if e],
            "stdout": stdout_head, "stderr": stderr_tail, "network_namespace": self.netns}
    return VerifierResult(reward=fraction, passed=passed, info=info)


def _read_reports(path: str, nonce: str) -> dict:
  """Steps reported by the harness (lines carrying the nonce); the first report of a step
  counts, so a program cannot overwrite a failure by printing."""
  steps: dict = {}
  with open(path, "rb") as f:
    for raw in f:
      line = raw.decode("utf-8", "replace")
      if not line.startswith(nonce):
        continue
      try:
        rec = json.loads(line[len(nonce):])
      except json.JSONDecodeError:
        continue
      steps.setdefault(rec.get("step"), rec)
  return steps
