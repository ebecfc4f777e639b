"""The multi-host flags: a combination jax.distributed cannot join (or one that would leave
each host training alone) is refused in one line naming the flag and its value, before any
JAX backend or coordinator starts."""

import os
import subprocess
import sys

import jax
import pytest
from absl import app, flags
from absl.testing import flagsaver

from child_env import child_env
from rlax_ps import distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def parsed_flags():
  """FLAGS readable (as after absl parsing) for the test, and as found afterwards; the CPU
  collectives setting initialize() changes is put back too."""
  was_parsed = flags.FLAGS.is_parsed()
  collectives = jax.config.jax_cpu_collectives_implementation
  flags.FLAGS.mark_as_parsed()
  try:
    yield
  finally:
    jax.config.update("jax_cpu_collectives_implementation", collectives)
    if not was_parsed:
      flags.FLAGS.unparse_flags()


@pytest.mark.parametrize("given, named", [
    (dict(num_processes=2, process_id=1), "--num_processes=2, --process_id=1"),
    (dict(coordinator_address="127.0.0.1:8476"), "--num_processes"),
    (dict(coordinator_address="127.0.0.1:8476", num_processes=2), "--process_id"),
    (dict(coordinator_address="127.0.0.1:8476", num_processes=2, process_id=2),
     "--process_id: expected this process's index, 0 to 1 (--num_processes=2), got 2"),
    (dict(coordinator_address="localhost", num_processes=1, process_id=0),
     "--coordinator_address: expected HOST:PORT"),
])
def test_flags_it_cannot_join_with_are_named(parsed_flags, given, named):
  with flagsaver.flagsaver(**given), pytest.raises(app.UsageError) as raised:
    distributed.initialize()
  assert named in str(raised.value)
  assert not jax.distributed.is_initialized()


def test_a_given_coordinator_detects_no_cluster(parsed_flags, monkeypatch):
  """HOST:PORT with the process count and id: no cluster detection, which under SLURM (or
  Open MPI) would give each process its local rank's GPU alone (2 GPUs of 16 trained)."""
  from ports import free_port
  asked = {}
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: asked.update(k))
  monkeypatch.setenv("SLURM_JOB_ID", "7")  # (a job this would have been detected in)
  with flagsaver.flagsaver(coordinator_address=f"127.0.0.1:{free_port()}", num_processes=2,
                           process_id=0):
    distributed.initialize()
  assert asked["cluster_detection_method"] == "deactivate"


def test_one_process_needs_no_coordinator(parsed_flags):
  with flagsaver.flagsaver(num_processes=1, process_id=0):
    assert distributed.initialize()


def test_auto_off_a_multi_host_environment_is_named_in_one_line(tmp_path):
  # In a process of its own: jax.distributed must start before any JAX backend, as it does
  # in `rlax-ps sft` (a test process has started one already).
  r = subprocess.run([sys.executable, "-m", "rlax_ps", "sft", "--config=configs/sft_tiny.py:tiny",
                      f"--workdir={tmp_path}", "--coordinator_address=auto"], cwd=REPO,
                     env=child_env(), capture_output=True, text=True, timeout=120)
  assert r.returncode == 2, r.stderr[-2000:]
  assert "rlax-ps sft: --coordinator_address=auto: found no multi-host" in r.stderr
  assert "Traceback" not in r.stderr


BROADCAST = """
import sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from rlax_ps.sharding import broadcast_int
for value in (3_000_000_000, -(1 << 40) - 7, 5):
  print("got", broadcast_int(value if jax.process_index() == 0 else 0), flush=True)
"""


def test_an_int64_crosses_from_process_0_whole(tmp_path):
  """JAX without x64 holds an int64 as int32: a keyframe of 3 GB crossed to a multi-host
  worker's followers as a length of -1.3 GB, and they got none of it."""
  from ports import free_port
  coordinator = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", BROADCAST, coordinator, str(i)], cwd=REPO,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  outs = [p.communicate(timeout=120) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-2000:]
    got = [line.split()[1] for line in out.splitlines() if line.startswith("got ")]
    assert got == ["3000000000", str(-(1 << 40) - 7), "5"], out
