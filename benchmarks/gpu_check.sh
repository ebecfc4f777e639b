#!/usr/bin/env bash
# Shared-prompt kernels on one NVIDIA GPU, in under 4 minutes on a fresh machine:
#   bash benchmarks/gpu_check.sh
# 1) makes .venv (reusing system packages) and installs the package with jax[cuda12]
#    unless jax already sees a GPU there, 2) checks packed attention on the GPU, Pallas
#    Triton kernel and XLA two-pass, f32 and bf16 (forward, LSE, dQ/dK/dV), against the
#    N-copies reference, 3) times attention fwd+bwd (packed kernels vs cuDNN flash on N
#    copies) and the whole-model train step (packed vs N copies), sizes of issue 7,
# 4) times a worker's weight check on the GPU: pull + xxh3 vs device fingerprints (1 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv --system-site-packages .venv; fi
PY=.venv/bin/python
ready() { "$PY" -c "import jax, flax, optax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; }
if ! ready; then
  echo "== installing rlax-ps with jax[cuda12]"
  "$PY" -m pip install -q -e '.[cuda]'
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== shared-prompt correctness + benchmark on GPU"
PYTHONPATH=. timeout 210 "$PY" benchmarks/shared_prompt.py --backend=gpu --reps=5
echo "== worker weight checks on GPU: pull+xxh3 vs device fingerprints"
PYTHONPATH=. timeout 120 "$PY" benchmarks/worker_checks.py --elements=500000000
