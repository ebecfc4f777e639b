#!/usr/bin/env bash
# Shared-prompt kernels on one NVIDIA GPU, in under 4 minutes on a fresh machine:
#   bash benchmarks/gpu_check.sh
# 1) installs the package with jax[cuda12] (skipped when jax already sees a GPU),
# 2) checks packed attention as dispatched on the GPU (f32, bf16; forward, LSE, dQ/dK/dV)
#    against the N-copies reference, 3) times the whole-model train step packed vs
#    N copies and the attention kernel vs cuDNN flash attention on N copies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  echo "== installing rlax-ps with jax[cuda12]"
  "$PY" -m pip install -q -e '.[cuda]'
fi
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== shared-prompt benchmark + correctness on GPU (sizes of issue 7)"
timeout 200 "$PY" benchmarks/shared_prompt.py --backend=gpu --reps=5
