"""Per-tensor work on a shared thread pool.

The codec's loops (numba, nogil), xxh3 and numpy's copies release the GIL, so the tensors
of an update encode and apply side by side on a host's cores: on a TPU VM with tens of
idle cores while the accelerators train, publishing a large model takes a fraction of the
single-threaded time. Results and bytes do not depend on the thread count.
"""

import concurrent.futures
import os
import threading

PARALLEL_MIN = 1 << 16  # elements: smaller tasks run in the calling thread (a hand-off
# costs tens of microseconds)
MAX_DEFAULT = 8
_LOCK = threading.Lock()
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def default_threads() -> int:
  """Threads used when the caller does not say: the host's cores, at most MAX_DEFAULT."""
  return max(1, min(MAX_DEFAULT, os.cpu_count() or 1))


def resolve(threads: int | None) -> int:
  """The thread count for a `threads` argument (None: default_threads())."""
  if type(threads) is int and threads > 0:
    return threads
  if threads is None:
    return default_threads()
  if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
    raise ValueError(f"threads expected a positive int or None, got {threads!r}")
  return threads


def _pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
  """The shared pool, grown to `threads` workers when it is smaller."""
  global _POOL, _POOL_SIZE
  with _LOCK:
    if _POOL is None or _POOL_SIZE < threads:
      if _POOL is not None:
        _POOL.shutdown(wait=False)
      _POOL = concurrent.futures.ThreadPoolExecutor(threads, "rlax_ps.sync")
      _POOL_SIZE = threads
    return _POOL


def run(tasks: list, threads: int) -> list:
  """Results of `tasks`, a list of (elements, thunk), in order. With threads > 1 and at
  least two tasks of PARALLEL_MIN elements or more, the calling thread runs the small ones
  and then joins threads - 1 pool workers on the large ones (largest first); every task
  finishes before the first error, in task order, is raised."""
  big = [i for i, (size, _) in enumerate(tasks) if size >= PARALLEL_MIN]
  if threads <= 1 or len(big) < 2:
    return [thunk() for _, thunk in tasks]
  big.sort(key=lambda i: -tasks[i][0])
  results, errors = [None] * len(tasks), {}
  queue, lock = iter(big), threading.Lock()

  def call(i):
    try:
      results[i] = tasks[i][1]()
    except Exception as e:  # noqa: BLE001 (raised by the caller once every task is done)
      errors[i] = e

  def drain():
    while True:
      with lock:
        i = next(queue, None)
      if i is None:
        return
      call(i)

  workers = min(threads, len(big)) - 1
  pool = _pool(workers)
  futures = [pool.submit(drain) for _ in range(workers)]
  small = set(range(len(tasks))) - set(big)
  for i in sorted(small):
    call(i)
  drain()
  concurrent.futures.wait(futures)
  if errors:
    raise errors[min(errors)]
  return results
