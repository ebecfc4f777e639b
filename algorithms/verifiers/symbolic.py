"""Symbolic equality of two LaTeX answers (math-verify over sympy: sqrt(12) = 2 sqrt(3),
x^2+1 = 1+x^2, {1,2} = {2,1}, intervals, equations), in a child process.

sympy can take minutes, or all memory, on an answer such as 10^{10^{10}}; math-verify's own
timeout is SIGALRM, which works only in a main thread. So a child process runs it in its main
thread under that timeout, and the parent, whatever thread asks, kills a child that overruns
its wait (and starts another at the next question): a worker's scoring never hangs, and a
question that ran out of time is not asked again. Several children answer a worker's scoring
threads side by side.
"""

from __future__ import annotations

import collections
import importlib
import multiprocessing
import os
import queue
import threading
from typing import Callable

_READY = "ready"


def _boxed(answer: str) -> str:
  return "\\boxed{" + answer + "}"


def math_verify_equal(reference: str, answer: str, timeout_s: int) -> bool:
  """math-verify's verdict on two LaTeX answers (run in a child: sympy's import and memory
  stay there); an answer sympy cannot read is not equal."""
  from math_verify import parse, verify
  try:
    gold, pred = (parse(_boxed(x), parsing_timeout=timeout_s) for x in (reference, answer))
    return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout_s))
  except Exception:  # noqa: BLE001
    return False


def _serve(conn, timeout_s: int, check: Callable[[str, str, int], bool]) -> None:
  """The child: answer (reference, answer) pairs with `check`'s verdict, True or False,
  until None comes or the pipe closes."""
  if check is math_verify_equal:  # imported before `ready`: not in the first question's wait
    importlib.import_module("math_verify")
  conn.send(_READY)
  while True:
    try:
      pair = conn.recv()
    except EOFError:
      return
    if pair is None:
      return
    try:
      equal = bool(check(*pair, timeout_s))
    except Exception:  # noqa: BLE001 - an answer the check cannot read is not equal
      equal = False
    conn.send(equal)


def default_children() -> int:
  """Children a checker keeps by default: one per two cores, at most 4 (each holds sympy,
  ~100 MB; a worker's scoring threads ask side by side)."""
  return max(1, min(4, (os.cpu_count() or 1) // 2))


class _Child:
  """One checking process, started at its first question, killed when it overruns."""

  def __init__(self, name: str):
    self.name = name
    self.proc = self.conn = None

  def ask(self, owner: "SymbolicEqual", key: tuple[str, str]) -> tuple[bool | None, bool]:
    """The verdict (None: no answer, the child killed) and whether the child ran past its
    wait (that question would again; one that died or was closed says nothing of it)."""
    if not self.running:
      self.start(owner)
    conn = self.conn  # None once closed
    timed_out = False
    try:
      conn.send(key)
      timed_out = not conn.poll(owner.wait_s)
      verdict = None if timed_out else bool(conn.recv())
    except (OSError, EOFError, AttributeError):  # died or closed: the next starts another
      verdict = None
    if verdict is None:  # past the wait, or dead: killed
      self.stop()
    return verdict, timed_out

  def start(self, owner: "SymbolicEqual") -> None:
    self.stop()
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
    self.conn, child = ctx.Pipe()
    self.proc = ctx.Process(target=_serve, args=(child, owner.timeout_s, owner.check),
                            daemon=True, name=self.name)
    self.proc.start()
    child.close()
    try:
      ready = self.conn.recv() if self.conn.poll(owner.start_s) else None
    except (EOFError, OSError):  # it exited before `ready`
      self.proc.join(5)
      code = self.proc.exitcode
      self.stop()
      raise RuntimeError(
          f"math-verify: its process exited as it started (exit code {code}; its error is on "
          f"stderr). Likely: a script that scores math answers without `if __name__ == "
          f"'__main__':` around its code ('spawn' runs the script again in the child), "
          f"math_verify not installed, or a `check` the child cannot import") from None
    if ready != _READY:
      self.stop()
      raise RuntimeError(f"math-verify: its process did not start in {owner.start_s:.0f} s")

  def stop(self) -> None:
    proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
    if proc is not None:
      proc.kill()
      proc.join(5)
      conn.close()

  @property
  def running(self) -> bool:
    proc = self.proc
    return proc is not None and proc.is_alive()


class SymbolicEqual:
  """`checker(reference, answer)` -> True / False (math-verify's verdict within `timeout_s`
  seconds), or None where its child did not answer within `wait_s` (then killed). Thread
  safe: `children` processes (default_children()) answer side by side, each started at the
  first question it takes (the import takes a second or two); a question waits for a free
  one. The last `cache` verdicts are kept, a time-out's None too (each costs `wait_s`): a
  group's samples often give the same answer.
  `check`: what the children run (a module-level function, as math_verify_equal)."""

  def __init__(self, timeout_s: int = 5, wait_s: float | None = None,
               start_s: float = 120.0, cache: int = 4096, children: int | None = None,
               check: Callable[[str, str, int], bool] = math_verify_equal):
    self.timeout_s = max(1, int(timeout_s))
    self.wait_s = 2.0 * self.timeout_s + 5.0 if wait_s is None else float(wait_s)
    self.start_s = start_s
    self.check = check
    count = default_children() if children is None else int(children)
    if count < 1:
      raise ValueError(f"children: expected >= 1 checking processes, got {children!r}")
    self._children = [_Child(f"math-verify-{i}") for i in range(count)]
    self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
    for child in self._children:
      self._idle.put(child)
    self._lock = threading.Lock()  # the verdicts
    self._verdicts: collections.OrderedDict[tuple[str, str], bool | None] = (
        collections.OrderedDict())
    self._cache = cache

  def __call__(self, reference: str, answer: str) -> bool | None:
    key = (reference, answer)
    with self._lock:
      if key in self._verdicts:
        self._verdicts.move_to_end(key)
        return self._verdicts[key]
    child = self._idle.get()
    try:
      verdict, timed_out = child.ask(self, key)
    finally:
      self._idle.put(child)
    if verdict is not None or timed_out:
      with self._lock:
        self._verdicts[key] = verdict
        if len(self._verdicts) > self._cache:
          self._verdicts.popitem(last=False)
    return verdict

  def close(self) -> None:
    """Stop every child (one answering now: its question gets None)."""
    for child in self._children:
      child.stop()

  @property
  def running(self) -> bool:
    return any(child.running for child in self._children)
