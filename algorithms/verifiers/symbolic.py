"""Symbolic equality of two LaTeX answers (math-verify over sympy: sqrt(12) = 2 sqrt(3),
x^2+1 = 1+x^2, {1,2} = {2,1}, intervals, equations), in a child process.

sympy can take minutes, or all memory, on an answer such as 10^{10^{10}}; math-verify's own
timeout is SIGALRM, which works only in a main thread. So a child process runs it in its main
thread under that timeout, and the parent, whatever thread asks, kills a child that overruns
its wait (and starts another at the next question): a worker's scoring never hangs.
"""

from __future__ import annotations

import collections
import multiprocessing
import threading

_READY = "ready"


def _boxed(answer: str) -> str:
  return "\\boxed{" + answer + "}"


def _serve(conn, timeout_s: int) -> None:
  """The child: answer (reference, answer) pairs with math-verify's verdict, True or False,
  until None comes or the pipe closes."""
  from math_verify import parse, verify  # in the child alone: sympy's import, its memory
  conn.send(_READY)
  while True:
    try:
      pair = conn.recv()
    except EOFError:
      return
    if pair is None:
      return
    try:
      gold, pred = (parse(_boxed(x), parsing_timeout=timeout_s) for x in pair)
      equal = bool(gold and pred and verify(gold, pred, timeout_seconds=timeout_s))
    except Exception:  # noqa: BLE001 - an answer sympy cannot read is not equal
      equal = False
    conn.send(equal)


class SymbolicEqual:
  """`checker(reference, answer)` -> True / False (math-verify's verdict within `timeout_s`
  seconds), or None where the child did not answer within `wait_s` (then killed). Thread
  safe; the child starts at the first question (its import takes a second or two). The last
  `cache` verdicts are kept: a group's samples often give the same answer."""

  def __init__(self, timeout_s: int = 5, wait_s: float | None = None,
               start_s: float = 120.0, cache: int = 4096):
    self.timeout_s = max(1, int(timeout_s))
    self.wait_s = 2.0 * self.timeout_s + 5.0 if wait_s is None else float(wait_s)
    self.start_s = start_s
    self._lock = threading.Lock()
    self._proc = self._conn = None
    self._verdicts: collections.OrderedDict[tuple[str, str], bool] = collections.OrderedDict()
    self._cache = cache

  def __call__(self, reference: str, answer: str) -> bool | None:
    key = (reference, answer)
    with self._lock:
      if key in self._verdicts:
        self._verdicts.move_to_end(key)
        return self._verdicts[key]
      if self._proc is None or not self._proc.is_alive():
        self._start()
      try:
        self._conn.send(key)
        verdict = bool(self._conn.recv()) if self._conn.poll(self.wait_s) else None
      except (OSError, EOFError):  # the child died: the next question starts another
        verdict = None
      if verdict is None:  # past the wait, or dead: killed
        self._stop()
        return None
      self._verdicts[key] = verdict
      if len(self._verdicts) > self._cache:
        self._verdicts.popitem(last=False)
      return verdict

  def _start(self) -> None:
    self._stop()
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
    self._conn, child = ctx.Pipe()
    self._proc = ctx.Process(target=_serve, args=(child, self.timeout_s), daemon=True,
                             name="math-verify")
    self._proc.start()
    child.close()
    if not self._conn.poll(self.start_s) or self._conn.recv() != _READY:
      self._stop()
      raise RuntimeError(f"math-verify: its process did not start in {self.start_s:.0f} s")

  def _stop(self) -> None:
    if self._proc is not None:
      self._proc.kill()
      self._proc.join(5)
      self._conn.close()
    self._proc = self._conn = None

  def close(self) -> None:
    with self._lock:
      self._stop()

  @property
  def running(self) -> bool:
    return self._proc is not None and self._proc.is_alive()
