"""`algorithms` stays pure: importing all of it pulls in no gRPC, server or worker code."""

import subprocess
import sys


def test_algorithms_imports_no_grpc_server_or_workers():
  code = ("import sys, algorithms.advantages, algorithms.losses, algorithms.corrections, "
          "algorithms.allocation, algorithms.shaping, algorithms.verifiers; "
          "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
          "('grpc', 'param_server', 'inference_workers')); print(bad)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
                       cwd=__file__.rsplit("/tests/", 1)[0])
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]"
