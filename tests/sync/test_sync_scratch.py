"""Scratch buffers and the apply arena: reuse without aliasing what callers keep."""

import threading

import numpy as np

from rlax_ps import sync
from rlax_ps.sync import scratch
from rlax_ps.sync.bits import BF16


def test_a_slot_is_reused_per_thread_and_large_requests_are_not_kept():
  a = scratch.buffer("test slot", 100, np.uint16)
  assert a.shape == (100,) and a.dtype == np.uint16
  a[:] = 7
  b = scratch.buffer("test slot", 50, np.uint32)  # same memory, leftover contents
  assert np.shares_memory(a, b) and b.dtype == np.uint32 and (b.view(np.uint16) == 7).all()
  other = []
  thread = threading.Thread(
      target=lambda: other.append(scratch.buffer("test slot", 100, np.uint16)))
  thread.start()
  thread.join()
  assert not np.shares_memory(a, other[0])
  big = scratch.buffer("test slot", scratch.KEEP_MAX + 8, np.uint8)
  assert not np.shares_memory(big, a) and big.size == scratch.KEEP_MAX + 8
  assert np.shares_memory(scratch.buffer("test slot", 100, np.uint16), a)  # still kept
  scratch.release()
  assert not np.shares_memory(scratch.buffer("test slot", 100, np.uint16), a)


def test_a_set_of_buffers_is_the_same_arrays_while_its_specs_repeat():
  specs = ((100, np.uint64), (30, np.uint8), (7, np.uint32))
  first = scratch.buffers("test set", specs)
  assert [(a.size, a.dtype) for a in first] == [(100, np.uint64), (30, np.uint8), (7, np.uint32)]
  assert all(a is b for a, b in zip(first, scratch.buffers("test set", specs)))
  assert all(a is b for a, b in zip(first, scratch.buffers("test set", tuple(specs))))
  assert not any(np.shares_memory(a, b) for i, a in enumerate(first) for b in first[i + 1:])
  grown = scratch.buffers("test set", ((200, np.uint64), (30, np.uint8), (7, np.uint32)))
  assert grown[0].size == 200 and grown[1] is not first[1]  # new specs: looked up anew
  scratch.release()
  again = scratch.buffers("test set", specs)
  assert not any(a is b for a, b in zip(first, again))  # release drops the set too


def test_a_raw_buffer_is_the_same_array_while_it_is_large_enough():
  first = scratch.raw("test raw", 1000)
  assert first.dtype == np.uint8 and first.ndim == 1 and first.size >= 1000
  assert scratch.raw("test raw", 1000) is first and scratch.raw("test raw", 10) is first
  grown = scratch.raw("test raw", 5000)
  assert grown.size >= 5000 and grown is not first
  assert scratch.raw("test raw", 1000) is grown  # the larger one is kept
  other = []
  thread = threading.Thread(target=lambda: other.append(scratch.raw("test raw", 1000)))
  thread.start()
  thread.join()
  assert not np.shares_memory(other[0], grown)  # per thread
  big = scratch.raw("test raw", scratch.KEEP_MAX + 8)
  assert big.size == scratch.KEEP_MAX + 8 and scratch.raw("test raw", 10) is grown
  scratch.release()
  assert not np.shares_memory(scratch.raw("test raw", 1000), grown)  # release drops it


def test_release_all_threads_reaches_the_pool_and_forgets_finished_threads():
  held, done = [], threading.Event()

  def worker():
    held.append(scratch.buffer("test pool slot", 64, np.uint8))
    done.wait(30)

  live = threading.Thread(target=worker, daemon=True)
  live.start()
  gone = threading.Thread(target=lambda: scratch.buffer("test gone slot", 64, np.uint8))
  gone.start()
  gone.join()
  try:
    mine = scratch.buffer("test pool slot", 64, np.uint8)
    while not held:
      threading.Event().wait(0.01)
    scratch.release()  # this thread's only
    assert not np.shares_memory(scratch.buffer("test pool slot", 64, np.uint8), mine)
    entries = [b for t, b in scratch._ALL if t() is live]
    assert len(entries) == 1 and "test pool slot" in entries[0]
    scratch.release(all_threads=True)
    assert entries[0] == {}
    assert all(t() is not gone for t, _ in scratch._ALL)
  finally:
    done.set()
    live.join()


def _root(a):
  while isinstance(a.base, np.ndarray):
    a = a.base
  return a


def test_applied_arrays_share_one_buffer_but_never_the_base_or_the_message():
  rng = np.random.default_rng(5)
  base = {f"t{i}": (rng.standard_normal((64, 300)) * 0.02).astype(BF16) for i in range(3)}
  base["small"] = (rng.standard_normal(10) * 0.02).astype(BF16)
  target = {k: v.copy() for k, v in base.items()}
  for v in target.values():
    v.reshape(-1).view(np.uint16)[::7] += 1
  for update in (sync.encode(base, target, version=1), sync.encode(None, target, version=0)):
    out = sync.apply(base, update)
    for k, v in out.items():
      assert v.flags.c_contiguous and v.flags.writeable and v.ctypes.data % 64 == 0, k
      assert not np.shares_memory(v, base[k]) and not np.shares_memory(v, target[k]), k
      assert np.array_equal(v.view(np.uint16), target[k].view(np.uint16)), k
    roots = {id(_root(v)) for v in out.values()}
    assert len(roots) == 1, "one buffer for all new arrays"
    out["t1"][...] = 0  # writing one result touches no other
    assert np.array_equal(out["t2"].view(np.uint16), target["t2"].view(np.uint16))
