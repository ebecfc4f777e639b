"""Tensors encoded and applied on several threads: same bytes, same weights, same errors."""

import threading

import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import parallel
from rlax_ps.sync.bits import BF16


def test_run_keeps_task_order_and_runs_large_tasks_on_other_threads():
  seen = {}

  def task(i):
    def thunk():
      seen[i] = threading.get_ident()
      return i * i
    return thunk

  sizes = [parallel.PARALLEL_MIN * (1 + i % 3) if i % 2 else 10 for i in range(9)]
  tasks = [(s, task(i)) for i, s in enumerate(sizes)]
  assert parallel.run(tasks, 3) == [i * i for i in range(9)]
  me = threading.get_ident()
  assert all(seen[i] == me for i, s in enumerate(sizes) if s < parallel.PARALLEL_MIN)
  assert parallel.run(tasks, 1) == [i * i for i in range(9)]
  assert all(seen[i] == me for i in range(9))  # one thread: all in the caller


def test_run_finishes_every_task_then_raises_the_first_error_in_task_order():
  done = []

  def fail(i):
    def thunk():
      done.append(i)
      raise ValueError(f"task {i}")
    return thunk

  def ok(i):
    return lambda: done.append(i)

  big = parallel.PARALLEL_MIN
  tasks = [(big, ok(0)), (big, fail(1)), (5, fail(2)), (big, ok(3)), (big, fail(4))]
  with pytest.raises(ValueError, match="task 1"):
    parallel.run(tasks, 4)
  assert sorted(done) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_are_rejected(bad):
  with pytest.raises(ValueError, match="threads"):
    parallel.resolve(bad)
  with pytest.raises(ValueError, match="threads"):
    sync.encode(None, {"w": np.zeros(4, BF16)}, version=0, threads=bad)


@pytest.fixture(scope="module")
def model():
  rng = np.random.default_rng(11)
  base = {f"layer{i}.w": (rng.standard_normal((256, 300 + 40 * i)) * 0.02).astype(BF16)
          for i in range(5)}
  base.update({f"layer{i}.scale": np.ones(256, BF16) for i in range(5)})
  target = {k: v.copy() for k, v in base.items()}
  for i, (k, v) in enumerate(target.items()):
    bits = v.reshape(-1).view(np.uint16)
    idx = rng.choice(bits.size, max(1, bits.size // (10 + 20 * i)), replace=False)
    bits[idx] += rng.choice(np.array([1, 0xFFFF, 2], np.uint16), idx.size)
  return base, target


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_threads_give_the_same_bytes_and_weights(model, fmt):
  base, target = model
  held_base = sync.held_state(base, fmt)
  one = sync.encode(held_base, target, fmt, version=1, threads=1)
  for threads in (2, 4):
    many = sync.encode(held_base, target, fmt, version=1, threads=threads)
    assert many.to_bytes() == one.to_bytes()
    want = sync.apply(held_base, one, threads=1)
    got = sync.apply(held_base, sync.Update.from_bytes(many.to_bytes()), threads=threads)
    assert got.keys() == want.keys()
    for k in want:
      assert np.array_equal(got[k].view(np.uint8), want[k].view(np.uint8)), k
    held = {k: v.copy() for k, v in held_base.items()}
    out = sync.apply(held, sync.Update.from_bytes(many.to_bytes()), inplace=True,
                     threads=threads)
    for k in want:
      assert out[k] is held[k] and np.array_equal(held[k].view(np.uint8),
                                                  want[k].view(np.uint8)), k
  keyframe = sync.encode(None, target, fmt, version=0, threads=4)
  assert keyframe.to_bytes() == sync.encode(None, target, fmt, version=0, threads=1).to_bytes()
  restored = sync.apply(None, keyframe, threads=4)
  assert all(np.array_equal(restored[k].view(np.uint8), v.view(np.uint8))
             for k, v in sync.held_state(target, fmt).items())


def test_a_corrupted_tensor_is_named_when_applied_on_threads(model):
  base, target = model
  update = sync.encode(base, target, version=1, threads=1)
  data = bytearray(update.to_bytes())
  meta = update.tensors["layer3.w"]
  assert meta.nbytes > 16 and meta.size >= parallel.PARALLEL_MIN
  data[meta.offset + meta.nbytes // 2] ^= 0x5A
  with pytest.raises(sync.CodecError, match="layer3.w"):
    sync.apply(base, sync.Update.from_bytes(bytes(data), base), threads=4)
