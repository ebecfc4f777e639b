"""Code-execution verifier: run candidate Python against tests in a sandboxed subprocess.

What bounds the child: a wall-clock timeout (its process group is killed); address space
(RLIMIT_AS), CPU, per-file size and core limits; a fresh scratch directory as
cwd/HOME/TMPDIR; an isolated interpreter (-I -B) with an empty environment. Where
`unshare` works (root, or user namespaces), new network, PID and mount namespaces: no
network, no other process to see or signal, and whatever it forks dies with it; a worker
that is not root makes them in a user namespace of its own (`unshare -r`). Where no
namespace can be made, the verifier refuses to start (the code would run with the worker's
own user and network: its token, its server) unless $RLAX_PS_NO_SANDBOX=1 accepts that
knowingly; what such a child forks is killed with its process group when it ends. Where the
worker runs as root, the child drops to `run_as` (nobody, or $RLAX_PS_SANDBOX_USER; it must
be able to run the worker's Python, else $RLAX_PS_SANDBOX_PYTHON names one) with a process
limit, so it
cannot signal the worker, read its files or environment (`/proc`), or write outside
the scratch directory and world-writable places.
An audit hook also refuses sockets, subprocesses, exec, fork, signals, and writes,
renames and removals outside the scratch directory; it is a tripwire for accidents and
reward hacks, not a boundary: code in the same interpreter can get around it (frames,
symlink races) and tamper with the harness. It refuses ctypes (which numpy and sympy
import) too, since a native call passes it by, unless the child runs as `run_as` in the
namespaces: then the OS is the boundary. So without root (no `run_as`) the child can
read what the worker's user can read and, without namespaces, signal its processes.
In a mount namespace the scratch directory, /tmp, /var/tmp and /dev/shm are tmpfs of
scratch_mb each: what the code writes is bounded in total and gone with it, and it sees no
other sample's files there nor the worker's; without one, writes are bounded file by file. Run workers as root in a
container, or use an OS sandbox (gVisor, a VM) for code you must not trust.

The program is the completion's last fenced code block (```python, ```py or a bare
```), else the whole completion. The reference is a sequence of test snippets (Python
source, usually `assert` lines), or a dict with "tests", or either as JSON text (data
files hold answers as strings: '["assert f(1) == 2"]'); they run one by one after the
program, in its namespace. reward = fraction of tests passed; passed = all of them passed.

Tests score plain values, so that a policy cannot learn to pass them with an object whose
__eq__ is always true: builtins are restored after the program, and each test's comparisons
and truth tests are rewritten (before the program runs) to check their operands. A value
whose comparison methods the program wrote (its own class, a builtin's subclass, or a file
it wrote and imported) meets a plain value by identity (== False, != True); ordering and
membership between them raise TypeError, and so does truth-testing it. Two such values
compare as they define (a class task's `V(1) == V(1)`); library types (Counter, Fraction,
namedtuple, numpy) are plain. Arithmetic is not checked: an object whose `-` returns 0.0
passes `abs(f(x) - 2.0) < 1e-6`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pwd
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
import ast, builtins, json, operator, os, resource, sys
def _main():  # the harness's state in its scope: not in __main__ for the program
  _exec, _compile, _dumps = exec, compile, json.dumps  # as they are before the program
  nonce, report_fd, mem, cpu, fsize, uid, gid, nproc, tmp = sys.stdin.readline().split()
  for limit, value in ((resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_CPU, int(cpu)),
                       (resource.RLIMIT_FSIZE, int(fsize)), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
  sys.stdin.close()
  sys.stdin = open(os.devnull)
  with open("job.json") as f:
    job = json.load(f)
  os.remove("job.json")
  native = job.pop("native")  # ctypes allowed: the OS bounds the child
  scratch = os.path.realpath(os.getcwd())
  if int(tmp):  # in a mount namespace of its own: what it writes is bounded and goes with it
    loaded = set(sys.modules)
    import ctypes
    mount = ctypes.CDLL(None, use_errno=True).mount
    for where in ("/tmp", "/var/tmp", "/dev/shm", scratch):
      if where == scratch:
        os.makedirs(scratch, exist_ok=True)  # (hidden by a tmpfs above it: made anew there)
      elif not os.path.isdir(where):
        continue
      options = ("size=%s,mode=%s" % (tmp, "700" if where == scratch else "1777")).encode()
      if mount(b"tmpfs", where.encode(), b"tmpfs", 2 | 4, options):  # MS_NOSUID | MS_NODEV
        sys.stderr.write("sandbox: cannot mount a tmpfs on %s: %s\n"
                         % (where, os.strerror(ctypes.get_errno())))
        os._exit(126)
    del mount, ctypes
    for name in set(sys.modules) - loaded:  # as unloaded as before: the program's own import
      del sys.modules[name]  # of ctypes meets the audit hook (where it is refused)
    os.chdir(scratch)
    if int(uid) >= 0:
      os.chown(scratch, int(uid), int(gid))
  if int(uid) >= 0:  # root: run as the sandbox user, with a process limit it cannot lift
    resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
    os.setgroups([])
    os.setgid(int(gid))
    os.setuid(int(uid))
  out = os.fdopen(int(report_fd), "w")
  import _posixsubprocess, posix
  def refuse(module, name):
    def refused(*args, **kwargs):
      raise PermissionError("sandbox: " + module.__name__ + "." + name + " is not allowed")
    setattr(module, name, refused)
  # calls that raise no audit event of their own: subprocess's fork+exec, device and fifo nodes
  refuse(_posixsubprocess, "fork_exec")
  for module in (os, posix):
    refuse(module, "mknod")
    refuse(module, "mkfifo")
  BLOCKED = frozenset({
      "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
      "socket.sendto", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
      "os.spawn", "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
      "sys.addaudithook", "os.kill", "os.killpg", "gc.get_objects", "gc.get_referrers",
      "gc.get_referents"})
  CTYPES = frozenset({"ctypes.dlopen", "ctypes.dlsym"})
  CTYPES_HINT = (" (numpy and sympy import ctypes) unless the code runs as the sandbox user in "
                 "namespaces: run the worker as root, with a run_as user that can run this "
                 "Python; see algorithms/verifiers/code_exec.py")
  if native:
    BLOCKED -= CTYPES
  # event -> positions of its path arguments (and of their dir_fd) that must lie in scratch
  CHANGES = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
             "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)),
             "os.symlink": ((1, 2),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
             "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.setxattr": ((0, None),),
             "os.removexattr": ((0, None),), "os.chflags": ((0, None),)}
  WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  def inside(path, dir_fd=None):
    if isinstance(path, int):
      return False
    path = os.fsdecode(path)
    if dir_fd is not None and dir_fd >= 0 and not os.path.isabs(path):
      path = os.path.join(os.readlink("/proc/self/fd/%d" % dir_fd), path)
    path = os.path.realpath(path)
    return path == scratch or path.startswith(scratch + os.sep)
  def hook(event, args):
    if event in BLOCKED or (event == "import" and args[0] == "_posixsubprocess"):
      raise PermissionError("sandbox: " + event + (" " + args[0] if event == "import" else "")
                            + " is not allowed" + (CTYPES_HINT if event in CTYPES else ""))
    if event in CHANGES and not (event == "os.truncate" and isinstance(args[0], int)):
      for at, fd_at in CHANGES[event]:  # (a file opened for writing is in scratch)
        if not inside(args[at], None if fd_at is None else args[fd_at]):
          raise PermissionError("sandbox: " + event + " outside the scratch directory: " +
                                str(args[at]))
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
      mode, flags = args[1], args[2]
      writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
          isinstance(flags, int) and flags & WRITE_FLAGS)  # O_TRUNC empties even read-only
      path = os.path.realpath(os.fsdecode(args[0]))
      if (writing or os.path.isdir(path)) and not inside(path):  # a directory: a dir_fd
        raise PermissionError("sandbox: " + ("writing" if writing else "opening a directory")
                              + " outside the scratch directory: " + path)
  sys.addaudithook(hook)
  # Tests score plain values. A value whose comparisons the program wrote (a class with an
  # __eq__, a subclass of int whose __eq__ is True) could pass every test: where one meets a
  # plain value in a test's comparison it is compared by identity, ordering and membership
  # are refused, and a test may not truth-test it. Builtins are as before the program ran.
  _builtins, _type, _id, _isinstance, _any = dict(vars(builtins)), type, id, isinstance, any
  _TypeError, _realpath, _isfile, _getattr = TypeError, os.path.realpath, os.path.isfile, getattr
  COMPARE, TRUTH, HEAPTYPE, IMMUTABLETYPE = "__rlax_ps_compare__", "__rlax_ps_truth__", 512, 256
  SCORED = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__",
            "__contains__", "__iter__")
  ITEMS = ((dict, dict.items), (list, list.__iter__), (tuple, tuple.__iter__),
           (set, set.__iter__), (frozenset, frozenset.__iter__))
  def written_here(function):  # code the program or a test compiled, or imported from scratch
    path = _getattr(_getattr(function, "__code__", None), "co_filename", "")
    return not _isfile(path) or (_realpath(path) + os.sep).startswith(scratch + os.sep)
  def own_type(t):  # whether t's scored methods are the builtins' or a library's
    for name in SCORED:
      for c in t.__mro__:
        if name in vars(c):
          method = vars(c)[name]
          if c.__flags__ & HEAPTYPE and not c.__flags__ & IMMUTABLETYPE and method is not None and (
              not _isinstance(method, FUNCTION) or written_here(method)):
            return False  # (a builtin's slot moved, such as __eq__ = int.__ne__, counts too)
          break
    return True
  FUNCTION = _type(own_type)
  def plain(value):
    seen, todo = set(), [value]
    while todo:
      v = todo.pop()
      if _type(v).__flags__ & HEAPTYPE and not own_type(_type(v)):
        return False
      for kind, items in ITEMS:  # elements through the builtin's own iteration
        if _isinstance(v, kind) and _id(v) not in seen:
          seen.add(_id(v))
          todo.extend(items(v))
          break
    return True
  OPS = {"Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le,
         "Gt": operator.gt, "GtE": operator.ge, "Is": operator.is_, "IsNot": operator.is_not,
         "In": lambda a, b: a in b, "NotIn": lambda a, b: a not in b}
  IDENTITY = ("Is", "IsNot")
  _parse = ast.parse
  class Scored(ast.NodeTransformer):  # a test's comparisons and truth tests through those below
    def call(self, name, *args):
      return ast.copy_location(ast.Call(ast.Name(name, ast.Load()), list(args), []), args[0])
    def truth(self, node):
      return self.call(TRUTH, node)
    def visit_Compare(self, node):
      self.generic_visit(node)
      no_args = ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[],
                              kw_defaults=[], kwarg=None, defaults=[])
      ops = ast.Tuple([ast.Constant(type(op).__name__) for op in node.ops], ast.Load())
      rights = ast.Tuple([ast.Lambda(no_args, c) for c in node.comparators], ast.Load())
      return self.call(COMPARE, node.left, ops, rights)
    def visit_Assert(self, node):
      self.generic_visit(node)
      node.test = self.truth(node.test)
      return node
    visit_If = visit_While = visit_IfExp = visit_Assert
    def visit_UnaryOp(self, node):
      self.generic_visit(node)
      if isinstance(node.op, ast.Not):
        node.operand = self.truth(node.operand)
      return node
    def visit_BoolOp(self, node):
      self.generic_visit(node)
      node.values[:-1] = [self.truth(v) for v in node.values[:-1]]
      return node
    def visit_comprehension(self, node):
      self.generic_visit(node)
      node.ifs = [self.truth(c) for c in node.ifs]
      return node
  def refused(what, value):
    return _TypeError("sandbox: " + what + " a value of type " + _type(value).__qualname__ +
                      ", defined by the program: tests score plain values")
  def compare(left, ops, rights):
    for i, (op, right) in enumerate(zip(ops, rights)):
      right = right()
      if op in IDENTITY or plain(left) == plain(right):
        ok = OPS[op](left, right)
      elif op in ("Eq", "NotEq"):
        ok = (left is right) == (op == "Eq")
      elif op in ("In", "NotIn") and plain(right):
        found = _any(left is x for x in right)
        ok = found == (op == "In")
      else:
        raise refused("comparing (" + op + ") a plain value and", left if plain(right) else right)
      if not ok and i < len(ops) - 1:  # (a chain stops at a false link, as Python's)
        return ok
      left = right
    return ok
  def truth(value):
    if not plain(value):
      raise refused("truth-testing", value)
    return value
  def report(step, ok, error=""):
    out.write(nonce + _dumps({"step": step, "ok": ok, "error": error[:500]}) + "\n")
    out.flush()
  ns = {"__name__": "__main__", "__builtins__": builtins}
  def run(step, code):
    try:
      _exec(_compile(code, step, "exec") if _isinstance(code, str) else code, ns)
      report(step, True)
      return True
    except BaseException as e:
      report(step, False, type(e).__name__ + ": " + str(e))
      return False
  tests = []  # rewritten (Scored) before the program runs, so it cannot change how
  for i, test in enumerate(job.pop("tests")):
    try:
      tree = ast.fix_missing_locations(Scored().visit(_parse(test, "test_%d" % i)))
      tests.append(_compile(tree, "test_%d" % i, "exec"))
    except SyntaxError as e:
      tests.append(e)
  if run("program", job.pop("program")):
    for k in [k for k in vars(builtins) if k not in _builtins]:  # what the program changed
      delattr(builtins, k)
    vars(builtins).update(_builtins)
    for i, test in enumerate(tests):
      ns.update({"__builtins__": builtins, COMPARE: compare, TRUTH: truth})
      if _isinstance(test, SyntaxError):
        report("test_%d" % i, False, "SyntaxError: " + str(test))
      else:
        run("test_%d" % i, test)
  else:
    ns.clear()

_main()
"""
# The sandbox user's process (and thread) limit, counted over all its processes.
_SANDBOX_PROCESSES = 64


_NAMESPACES = ("-n", "-p", "-f", "--mount-proc", "--kill-child")


NO_SANDBOX_ENV = "RLAX_PS_NO_SANDBOX"  # "1": run code where no namespace can be made


@functools.lru_cache(maxsize=1)
def namespace_flags() -> tuple[str, ...]:
  """The `unshare` flags that work here: new network, PID and mount namespaces, else a
  network namespace alone, else none; a worker that is not root makes them in a user
  namespace of its own (-r: root there, its own user outside). Probed once."""
  exe = shutil.which("unshare")
  user = () if os.geteuid() == 0 else ("-r",)
  for flags in (user + _NAMESPACES, user + ("-n",)) if exe else ():
    try:
      if subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10).returncode == 0:
        return flags
    except (OSError, subprocess.SubprocessError):
      continue  # these namespaces are not allowed here: try fewer
  return ()


def _user_ids(run_as: str | int) -> tuple[int, int]:
  """(uid, gid) of a user name or uid; ValueError naming run_as for an unknown one."""
  try:
    entry = pwd.getpwuid(run_as) if isinstance(run_as, int) else pwd.getpwnam(run_as)
  except (KeyError, TypeError):
    raise ValueError(f"run_as: expected a user name or uid of this host, got {run_as!r}"
                     ) from None
  return entry.pw_uid, entry.pw_gid


_LIST_PATH = "import json, os, sys; print(json.dumps([p for p in sys.path if os.path.isdir(p)]))"
_READ_PATH = "import json, math, os, sys; [os.listdir(p) for p in json.loads(sys.argv[1])]"


@functools.lru_cache(maxsize=None)
def _can_run_as(python: str, uid: int, gid: int) -> bool:
  """Whether user uid can start `python` and read its whole module path; probed once."""
  try:
    dirs = subprocess.run([python, "-I", "-B", "-c", _LIST_PATH], capture_output=True,
                          timeout=30, check=True, cwd="/").stdout.decode().strip()
    subprocess.run([python, "-I", "-B", "-c", _READ_PATH, dirs], capture_output=True,
                   timeout=30, check=True, cwd="/", user=uid, group=gid, extra_groups=[],
                   env={"PATH": "/usr/bin:/bin"})
    return True
  except (OSError, subprocess.SubprocessError):
    return False


SANDBOX_USER_ENV = "RLAX_PS_SANDBOX_USER"  # run_as where none is given ("root": as root)
# The Python the code runs with where none is given (default: the worker's): one the sandbox
# user can run, where it cannot read the worker's (a virtualenv under /root).
SANDBOX_PYTHON_ENV = "RLAX_PS_SANDBOX_PYTHON"


def _sandbox_user(run_as: str | int | None, python: str) -> tuple[int, int] | None:
  """(uid, gid) the child runs as: run_as's where the worker is root ("" takes
  $RLAX_PS_SANDBOX_USER, else nobody), else None (the worker's own user; root's too). Fails
  closed: a root worker whose run_as cannot run `python` raises ValueError rather than run
  model-written code as root."""
  if run_as == "":
    run_as = os.environ.get(SANDBOX_USER_ENV) or "nobody"
  ids = None if run_as is None else _user_ids(run_as)
  if ids is None or ids[0] == 0 or os.geteuid() != 0:
    return None
  if not _can_run_as(python, *ids):
    real = os.path.realpath(python)
    where = python if real == python else f"{python} ({real})"
    raise ValueError(
        f"run_as: user {run_as!r} cannot read the Python at {where} or its modules, so the "
        f"sandboxed code would run as root; give that user read access to that Python, or "
        f"name one it can run ({SANDBOX_PYTHON_ENV}=/usr/bin/python3 in the worker's "
        f"environment, or python=), or run the code as root knowingly: run_as=None, or "
        f"{SANDBOX_USER_ENV}=root in the worker's environment")
  return ids


def _tests_of(reference: Any) -> list[str]:
  """The test snippets a reference holds (module docstring); a string is parsed as JSON,
  since data files and the worker carry answers as strings."""
  tests = reference
  if isinstance(tests, str):
    try:
      tests = json.loads(tests)
    except json.JSONDecodeError:
      tests = None
  tests = tests.get("tests") if isinstance(tests, dict) else tests
  if isinstance(tests, str) or not isinstance(tests, Sequence) or not all(
      isinstance(t, str) for t in tests):
    got = repr(reference[:100]) if isinstance(reference, str) else type(reference).__name__
    raise ValueError(f"reference: expected a sequence of test source strings, a dict with "
                     f"'tests', or either as JSON text (such as '[\"assert f(1) == 2\"]' or "
                     f"'{{\"tests\": [...]}}'), got {got}")
  return list(tests)


_PYTHON_FENCES = ("", "py", "python", "python3")


def program_of(completion: str) -> tuple[str, str]:
  """(program, where it came from): the completion's last fenced Python block (```python,
  ```py or bare ```; one left open at the end runs to the end), else the whole completion."""
  blocks, block, language = [], None, ""
  for line in completion.split("\n"):
    if not line.strip().startswith("```"):
      if block is not None:
        block.append(line)
    elif block is None:
      block, language = [], line.strip()[3:].strip().lower()
    else:  # the block's closing fence
      if language in _PYTHON_FENCES:
        blocks.append(block)
      block = None
  if block is not None and language in _PYTHON_FENCES:  # the reply stopped inside it
    blocks.append(block)
  if not blocks:
    return completion, "completion"
  return "\n".join(blocks[-1]) + "\n", "last code block"


@register_verifier("code")
class CodeExecutionVerifier:
  """Scores a Python program by the fraction of test snippets that pass (module docstring).
  `run_as`: the user the child runs as when the worker is root ("": $RLAX_PS_SANDBOX_USER,
  else nobody; None or "root": root itself)."""

  check_reference = staticmethod(_tests_of)  # (data files checked before training)

  def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512, output_mb: int = 8,
               scratch_mb: int = 64,
               use_network_namespace: bool = True, python: str | None = None,
               run_as: str | int | None = ""):
    if not timeout_s > 0:
      raise ValueError(f"timeout_s: expected > 0, got {timeout_s!r}")
    if not memory_mb >= 64:
      raise ValueError(f"memory_mb: expected >= 64 (the interpreter needs it), got "
                       f"{memory_mb!r}")
    self.timeout_s = float(timeout_s)
    self.memory_bytes = int(memory_mb) << 20
    self.output_bytes = int(output_mb) << 20
    if not scratch_mb >= 1:
      raise ValueError(f"scratch_mb: expected >= 1, got {scratch_mb!r}")
    self.unshare = namespace_flags() if use_network_namespace else ()
    self.netns = bool(self.unshare)
    self.python = python or os.environ.get(SANDBOX_PYTHON_ENV) or sys.executable
    self.user = _sandbox_user(run_as, self.python)
    if (use_network_namespace and not self.unshare and not self.user
        and os.environ.get(NO_SANDBOX_ENV) != "1"):
      raise ValueError(
          f"code execution: no namespace can be made here (`unshare -r -n` failed: user "
          f"namespaces are off, or a container's seccomp profile refuses them), so "
          f"model-written code would run with this worker's own user and network: it could "
          f"read its token and call its server. Run the worker as root (the code then runs "
          f"as nobody), allow user namespaces, or accept it knowingly: {NO_SANDBOX_ENV}=1 "
          f"in the worker's environment")
    # ctypes (numpy, sympy) where the OS bounds the child: its own user, namespaces
    self.native = bool(self.user) and self.unshare == _NAMESPACES
    # In a mount namespace: scratch, /tmp, /var/tmp and /dev/shm are tmpfs of this size
    # each, gone with it (0: none; the files it writes are bounded one by one alone)
    self.scratch_bytes = (int(scratch_mb) << 20) if "--mount-proc" in self.unshare else 0

  def __call__(self, completion: str, reference: Any) -> VerifierResult:
    """Runs the completion's program (program_of) against the reference's tests."""
    program, source = program_of(completion)
    result = self.run(program, _tests_of(reference))
    result.info["program_from"] = source
    return result

  def run(self, program: str, tests: Sequence[str]) -> VerifierResult:
    """Runs `program` as it is, then each test snippet, in the sandbox."""
    with tempfile.TemporaryDirectory(prefix="rlax_ps_code_") as root:
      scratch = os.path.join(root, "scratch")
      os.mkdir(scratch)
      with open(os.path.join(scratch, "job.json"), "w") as f:
        json.dump({"program": program, "tests": list(tests), "native": self.native}, f)
      nonce = secrets.token_hex(16)
      out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
      report_path = os.path.join(root, "reports")
      # -u: what the program printed before a timeout's kill or an os._exit is kept
      cmd = [self.python, "-I", "-B", "-u", "-c", _HARNESS]
      if self.unshare:
        cmd = [shutil.which("unshare"), *self.unshare, "--"] + cmd
      if shutil.which("timeout"):  # the deadline also when this process dies mid-call (a
        cmd = [shutil.which("timeout"), "-s", "KILL",  # worker's hard exit): its own clock
               str(int(self.timeout_s) + 2)] + cmd
      uid, gid = self.user or (-1, -1)
      if self.user:  # the sandbox user writes in scratch and may pass through root
        os.chown(scratch, uid, gid)
        os.chmod(root, 0o711)
      env = {"HOME": scratch, "TMPDIR": scratch, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
      timed_out = False
      with _private(out_path) as out, _private(err_path) as err, _private(
          report_path) as reports:  # (owner-only: other samples' code cannot read them)
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=scratch, env=env,
            start_new_session=True, pass_fds=(reports.fileno(),))
        try:
          proc.stdin.write(f"{nonce} {reports.fileno()} {self.memory_bytes} "
                           f"{int(self.timeout_s) + 1} {self.output_bytes} {uid} {gid} "
                           f"{_SANDBOX_PROCESSES} {self.scratch_bytes}\n".encode())
          proc.stdin.close()
        except BrokenPipeError:
          pass  # the child died before reading its settings; its exit status says why
        try:
          proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
          timed_out = True
          os.killpg(proc.pid, signal.SIGKILL)
          proc.wait()
        finally:  # what it forked and left running (a PID namespace kills it by itself)
          with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
      steps = _read_reports(report_path, nonce)
      with open(err_path, "rb") as f:
        stderr_tail = f.read()[-2000:].decode("utf-8", "replace")
      with open(out_path, "rb") as f:
        stdout_head = f.read(2000).decode("utf-8", "replace")
    if not steps and not timed_out and proc.returncode in (126, 127):
      # The harness never ran (a Python or unshare that cannot start): no score of the
      # program, an error the worker counts (rewards of 0 would train on it silently).
      raise RuntimeError(f"code execution: the sandbox could not start (exit "
                         f"{proc.returncode}): {stderr_tail.strip()[-500:]}")
    program_ok = steps.get("program", {}).get("ok", False)
    results = [steps.get(f"test_{i}", {"ok": False, "error": "not run"}) for i in range(len(tests))]
    n_passed = sum(bool(r["ok"]) for r in results) if program_ok else 0
    fraction = n_passed / len(tests) if tests else float(program_ok and not timed_out)
    passed = program_ok and n_passed == len(tests) and not timed_out
    # (a program that reported no end died: os._exit, a signal, a limit)
    errors = [steps.get("program", {"error": "not run"}).get("error", "")] + [
        r.get("error", "") for r in results]
    info = {"n_tests": len(tests), "n_passed": n_passed, "timed_out": timed_out,
            "returncode": proc.returncode, "errors": [e for e in errors if e],
            "stdout": stdout_head, "stderr": stderr_tail, "network_namespace": self.netns,
            "uid": uid if self.user else os.geteuid()}
    return VerifierResult(reward=fraction, passed=passed, info=info)


def _private(path: str):
  """A new file at `path` for writing, readable by its owner alone."""
  return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def _read_reports(path: str, nonce: str) -> dict:
  """Steps reported by the harness (lines carrying the nonce), in the order it runs them
  (program, test_0, test_1, ...): a report out of that order is passed over, and the
  first of each step counts, so a program cannot overwrite a failure by printing."""
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
      if isinstance(rec, dict) and rec.get("step") == (
          f"test_{len(steps) - 1}" if steps else "program"):
        steps[rec["step"]] = rec
  return steps
