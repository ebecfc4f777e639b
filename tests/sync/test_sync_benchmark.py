"""Payload sizes against the information bound, and the benchmarks that report them."""

import os
import subprocess
import sys

import numpy as np
import pytest

from rlax_ps import sync
from rlax_ps.sync import entropy
from rlax_ps.sync.bits import BF16
from rlax_ps.sync.byte_reader import ByteReader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import weight_sync  # noqa: E402


@pytest.fixture(scope="module")
def synthetic():
  """Weights ~ N(0, 0.02) and an Adam-like step direction, 2M elements."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal(1 << 21, dtype=np.float32) * np.float32(0.02)
  return w, weight_sync.adam_direction(rng, w.size)


@pytest.mark.parametrize("density", [0.001, 0.01, 0.03, 0.1])
def test_synthetic_deltas_are_within_1_15x_of_the_information_bound(synthetic, density):
  w, u = synthetic
  lr = weight_sync.calibrate_lr(w, u, density)
  base = sync.held_state({"w.kernel": w.reshape(-1, 4096)}, "bf16")
  target = sync.held_state({"w.kernel": (w - np.float32(lr) * u).reshape(-1, 4096)}, "bf16")
  bound, nnz, n = weight_sync.bound_bytes(base, target)
  update = sync.encode(base, target, version=1)
  assert abs(nnz / n - density) < density / 5
  assert bound <= update.nbytes <= 1.15 * bound, (update.nbytes, bound)
  if density == 0.01:
    assert 2 * n / update.nbytes >= 150


def test_int8_keyframes_are_at_most_52_percent_of_bf16(synthetic):
  w = {"w.kernel": synthetic[0].reshape(-1, 4096), "norm.scale": np.ones(4096, np.float32)}
  int8 = sync.encode(None, w, "int8", version=0).nbytes
  assert int8 <= 0.52 * sync.encode(None, w, "bf16", version=0).nbytes


@pytest.mark.parametrize("values", [
    [0], [0, 0, 0], [31, 32, 33, 63, 64, 2**40, 2**52 - 1], list(range(1000)),
    np.random.default_rng(0).geometric(0.002, 5000) - 1])
def test_entropy_streams_round_trip_and_reject_values_past_their_limit(values):
  values = np.asarray(values, np.uint64)
  data = entropy.encode(values)
  out = np.empty(values.size, np.uint64)
  entropy.decode(ByteReader(data, "s"), values.size, 2**52, 0, out)
  assert np.array_equal(out, values)
  if values.max():
    with pytest.raises(sync.CodecError, match="s: corrupted entropy stream: a value exceeds"):
      entropy.decode(ByteReader(data, "s"), values.size, int(values.max()) - 1, 0, out)
  with pytest.raises(sync.CodecError, match="s: "):
    entropy.decode(ByteReader(data[:-3], "s"), values.size, 2**52, 0, out)


def test_malformed_entropy_streams_give_a_named_codec_error_never_a_crash():
  """The compiled stream parser reads no byte past its field: every truncation and every
  single-byte change of a stream (header, table, rANS words, raw bits) is a CodecError
  naming the stream, or decodes to values within the limit."""
  rng = np.random.default_rng(2)
  values = np.concatenate([rng.geometric(0.01, 300) - 1, [0, 5, 2**20]]).astype(np.uint64)
  data = entropy.encode(values)
  limit = 2**21
  out = np.empty(values.size, np.uint64)
  for cut in range(len(data)):
    with pytest.raises(sync.CodecError, match="^s: "):
      entropy.decode(ByteReader(data[:cut], "s"), values.size, limit, 0, out)
  messages = set()
  for pos in range(len(data)):
    for flip in (0x01, 0x80, 0xFF):
      bad = bytearray(data)
      bad[pos] ^= flip
      try:
        entropy.decode(ByteReader(bytes(bad), "s"), values.size, limit, 0, out)
      except sync.CodecError as e:
        assert str(e).startswith("s: ")
        messages.add(str(e).split(":")[1].split()[0])
      else:
        assert out.max() <= limit
  assert len(messages) >= 4, messages  # table, header and stream errors are told apart


def test_entropy_streams_refuse_what_they_cannot_code():
  for values in ([], [2**52]):
    with pytest.raises(ValueError, match="below 2\\*\\*52"):
      entropy.encode(np.asarray(values, np.uint64))


def test_entropy_streams_cost_their_entropy_within_a_percent():
  rng = np.random.default_rng(1)
  for values in (rng.geometric(0.01, 200_000) - 1, rng.geometric(0.3, 200_000) - 1):
    _, counts = np.unique(values, return_counts=True)
    p = counts / counts.sum()
    bits = -(p * np.log2(p)).sum() * values.size
    assert len(entropy.encode(values.astype(np.uint64))) * 8 < 1.01 * bits


@pytest.mark.slow  # runs the whole benchmark; sizes and round trips are tested above
def test_the_weight_sync_benchmark_prints_one_row_per_density_and_format():
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "weight_sync.py"),
       "--elements=262144", "--densities=0.01,0.1", "--real_sizes=", "--reps=1"],
      capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert run.returncode == 0, run.stderr[-2000:]
  lines = [line for line in run.stdout.splitlines() if " | " in line]
  header = [c.strip() for c in lines[0].split("|")]
  rows = [dict(zip(header, (c.strip() for c in line.split("|")))) for line in lines[1:]]
  assert [(r["update"].split()[1], r["fmt"]) for r in rows] == [
      ("0.01", "bf16"), ("0.01", "int8"), ("0.1", "bf16"), ("0.1", "int8")]
  for r in rows:
    assert 1.0 <= float(r["/bound"]) < (1.1 if r["fmt"] == "bf16" else 3), r  # int8: ~100 changes
    for column in ("enc/copy", "apply/copy", "inplace/copy", "publish/copy",
                   "device diff/copy"):
      assert r[column].endswith("%") and float(r[column][:-1]) > 0, r
  assert "keyframes: bf16" in run.stdout


def test_the_benchmark_times_runs_round_robin_each_after_the_eviction():
  calls = []
  runs = [(lambda: calls.append("a"), None),
          (lambda x: calls.append(f"b{x}"), lambda: calls.append("setup") or 7)]
  got = weight_sync.best_times(runs, 3, lambda: calls.append("evict"))
  assert calls == ["evict", "a", "evict", "setup", "b7"] * 3
  assert all(0 <= g < float("inf") for g in got)


def test_the_bound_counts_changed_positions_and_offsets():
  old = {"a": np.zeros(8, BF16)}
  new = {"a": np.array([0, 1, 0, 0, 0, 0, 1, 0], np.float32).astype(BF16)}
  bound, nnz, n = weight_sync.bound_bytes(old, new)
  assert (nnz, n) == (2, 8)  # H(1/4) bits per position, one offset value (0 bits)
  assert bound == pytest.approx(8 * (-(0.25 * np.log2(0.25) + 0.75 * np.log2(0.75))) / 8)


def test_the_worker_checks_benchmark_compares_pulling_with_device_fingerprints():
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "worker_checks.py"),
       "--elements=1000000", "--reps=1", "--fmt=int8"],
      capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert run.returncode == 0, run.stderr[-2000:]
  rows = {line.split(" | ")[0]: line.split(" | ")[1:] for line in run.stdout.splitlines()
          if " | " in line}
  assert set(rows) == {"check", "pull+xxh3", "device fprint", "host xxh3", "host fprint"}
  assert rows["device fprint"][2].endswith("x pull+xxh3")
  assert rows["host fprint"][2].endswith("x host xxh3")
  assert all(float(r[0]) > 0 for name, r in rows.items() if name != "check")
