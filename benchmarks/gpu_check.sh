#!/usr/bin/env bash
# Checks and timings on one NVIDIA GPU, one prepared run per section:
#   bash benchmarks/gpu_check.sh [kernels] [sampler] [loop]    (default: kernels)
#   kernels  (~4 min) packed attention on the GPU (Pallas Triton and XLA two-pass, f32 and
#            bf16, forward, LSE and dQ/dK/dV) against the N-copies reference, timed against
#            cuDNN flash on N copies; a worker's weight check (pull + xxh3 vs device
#            fingerprints, 1 GB)
#   sampler  (~4.5 min) benchmarks/sampler.py on a 787M bf16 model, HF generate on CUDA
#   loop     (~5 min) `rlax-ps local` for 240 s of RL, the trainer and both workers
#            sharing the GPU; summary in $GPU_CHECK_OUT (default /tmp/gpu_check)
# Python: .venv (made with the system's packages) when jax there sees a GPU with every
# dependency importable; else it installs what is missing: the wheels in .whl/ when that
# folder holds some (a machine without a registry), else the package with jax[cuda12].
set -euo pipefail
cd "$(dirname "$0")/.."
for section in "${@:-kernels}"; do  # before anything is installed
  case "$section" in
    kernels|sampler|loop) ;;
    *) echo "gpu_check.sh: unknown section '$section' (kernels, sampler or loop)" >&2; exit 2 ;;
  esac
done
if [ ! -x .venv/bin/python ]; then python3 -m venv --system-site-packages .venv; fi
PY=.venv/bin/python
ready() {
  "$PY" -c "import jax, rlax_ps.cli, inference_workers.loop, param_server.serve_main, sys
sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null
}
if ! ready; then
  if compgen -G ".whl/*.whl" > /dev/null; then
    echo "== installing the wheels in .whl/"
    "$PY" -m pip install -q --no-index --no-deps .whl/*.whl
  else
    echo "== installing rlax-ps with jax[cuda12]"
    "$PY" -m pip install -q -e '.[cuda]'
  fi
fi
export PYTHONPATH=. PYTHONUNBUFFERED=1
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
OUT_DIR=${GPU_CHECK_OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
for section in "${@:-kernels}"; do
  case "$section" in
    kernels)
      echo "== shared-prompt correctness + benchmark on GPU"
      timeout 210 "$PY" benchmarks/shared_prompt.py --backend=gpu --reps=5
      echo "== worker weight checks on GPU: pull+xxh3 vs device fingerprints"
      timeout 120 "$PY" benchmarks/worker_checks.py --elements=500000000 ;;
    sampler)
      echo "== sampler: decode vs HF generate and the roofline, updates in place vs reload"
      timeout 330 "$PY" benchmarks/sampler.py --dtype=bfloat16 --hidden=2048 --layers=16 \
        --heads=16 --intermediate=5632 --densities=0.01 ;;
    loop)
      echo "== the RL loop on one GPU: 240 s of RL"
      rm -rf "$OUT_DIR/local"
      timeout 420 "$PY" -m rlax_ps local --config=configs/rl_local.py \
        --workdir="$OUT_DIR/local" --config.rl.max_seconds=240 --config.local.worker_platform=
      cat "$OUT_DIR/local/summary.json" ;;
  esac
done
