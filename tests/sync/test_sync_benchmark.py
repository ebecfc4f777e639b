"""benchmarks/weight_sync.py runs end to end on a small model and prints its table (the
benchmark itself asserts that every apply reproduces the target bit for bit)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # runs the whole benchmark; the round trips are tested elsewhere
def test_the_weight_sync_benchmark_prints_one_row_per_density_and_format():
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "weight_sync.py"),
       "--elements=262144", "--densities=0.01,0.1", "--real=false", "--reps=1",
       "--decode_streams=2", "--probe_mb=8", "--max_reps=3"],
      capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert run.returncode == 0, run.stderr[-2000:]
  lines = [line for line in run.stdout.splitlines() if " | " in line]
  header = [c.strip() for c in lines[0].split("|")]
  rows = [dict(zip(header, (c.strip() for c in line.split("|")))) for line in lines[1:]]
  for column in ("payload B", "/bound", "int32+val", "enc/copy", "apply/copy", "spare/copy",
                 "inplace/copy", "worker/copy", "copy GB/s", "bulk e/a"):
    assert column in header, column
  assert [(r["update"].split()[1], r["fmt"]) for r in rows] == [
      ("0.01", "bf16"), ("0.01", "int8"), ("0.1", "bf16"), ("0.1", "int8")]
  for r in rows:
    assert 1.0 <= float(r["/bound"]) < 1.6, r  # near the information bound, never below
    assert float(r["vs bf16"].rstrip("x")) > float(r["int32+val"].rstrip("x")), r
    assert float(r["copy GB/s"]) > 0 and r["enc/copy"].endswith("%"), r
    assert r["worker/copy"].endswith("%"), r
    assert all(part.endswith("%") for part in r["bulk e/a"].split("/")), r
  assert "memory copy" in run.stdout and "keyframes: bf16" in run.stdout
  assert "joint decoder: 2 streams in lockstep" in run.stdout  # --decode_streams


def test_the_threaded_copy_baseline_splits_any_shape_into_equal_runs(monkeypatch):
  """CopyProbe.threaded copies equal element runs side by side, a 2-D source too (cut by
  rows it would give the first thread everything)."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import numpy as np  # noqa: PLC0415
  import weight_sync  # noqa: PLC0415
  src = np.arange(6 * 1000, dtype=np.uint16).reshape(6, 1000)
  probe = weight_sync.CopyProbe(src)
  sizes, copy = [], np.copyto
  monkeypatch.setattr(np, "copyto", lambda dst, s: sizes.append(s.size) or copy(dst, s))
  probe.threaded(2)
  assert sorted(sizes) == [3000, 3000]
  assert np.array_equal(probe.dst, src.reshape(-1))


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


def test_the_benchmark_times_a_rows_runs_round_robin_each_after_the_probe():
  """best_times runs every (fn, setup) once per round, each right after the probe, so a
  row's runs and its copy baseline see the same stretch of a drifting machine."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import weight_sync
  calls = []
  runs = [(lambda: calls.append("a") or "ra", None),
          (lambda x: calls.append(f"b{x}") or "rb", lambda: calls.append("setup") or 7)]
  got = weight_sync.best_times(runs, 3, probe=lambda: calls.append("probe"))
  assert calls == ["probe", "a", "probe", "setup", "b7"] * 3
  assert [g[2] for g in got] == ["ra", "rb"]
  assert all(0 <= g[0] < float("inf") and 0 <= g[1] < float("inf") for g in got)
