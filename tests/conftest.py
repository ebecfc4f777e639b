"""Test setup: CPU only, 8 fake devices for sharding tests, XLA:CPU programs compiled for
compile time (unoptimized, elemental emitters), a persistent compile cache.

The environment must be set before jax is imported anywhere.
"""

import gc
import os
import subprocess
import sys
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# Tests check results, not speed: XLA:CPU's backend optimizations cost compile time (a
# quarter of the model tests' time) and change no IEEE result (no fast math on CPU).
if "xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0"


def _xla_takes(flag: str) -> bool:
  """Whether this jaxlib's XLA knows `flag`: it aborts a process on an unknown one (asked
  once, in a child; xdist's processes and the tests' children inherit the answer)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flag}
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True).returncode == 0


# XLA:CPU's MLIR fusion emitters compile a tiny model's programs about 2.5x slower than the
# elemental emitters they replace (backend compile of the loss tests' grad programs).
_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "xla_cpu_use_fusion_emitters" not in _flags and _xla_takes(_EMITTERS):
  _flags += " " + _EMITTERS
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# Compiles dominate a JAX suite on CPU; keep them between runs, outside the repo.
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get("RLAX_PS_JAX_CACHE", os.path.expanduser("~/.cache/rlax_ps/jax")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# Prompt-length checks kept for the session alone (children inherit it): a test sees its own.
os.environ.setdefault("RLAX_PS_PROMPT_CHECKS", tempfile.mkdtemp(prefix="rlax_ps_prompt_checks_"))

# Model-written code (the `code` task, the python environment) runs as `nobody` under a root
# worker, which refuses to start where nobody cannot run its Python (a venv under /root, as
# on the CI machines): there the tests run it as root, as a worker would be told to.
if os.geteuid() == 0 and "RLAX_PS_SANDBOX_USER" not in os.environ:
  from algorithms.verifiers.code_exec import _can_run_as, _user_ids  # noqa: E402
  if not _can_run_as(sys.executable, *_user_ids("nobody")):
    os.environ["RLAX_PS_SANDBOX_USER"] = "root"
# A worker refuses code tasks where no namespace can be made (a container's seccomp profile):
# on such a test machine the tests run the code unsandboxed, as a worker would be told to.
if "RLAX_PS_NO_SANDBOX" not in os.environ:
  from algorithms.verifiers.code_exec import namespace_flags  # noqa: E402
  if not namespace_flags():
    os.environ["RLAX_PS_NO_SANDBOX"] = "1"

# The longest modules first (about 13-85 s each on 2 cores; the rest follow in collection
# order). xdist hands out whole modules in this order (`make test` passes
# --no-loadscope-reorder, whose default orders them by test count): a long one handed out
# last would leave the other process idle at the end.
_LONGEST_FIRST = [
    "tests/test_local.py", "tests/train/test_rl_loss.py", "tests/train/test_rl_trainer.py",
    "tests/models/test_hf_parity.py", "tests/inference_workers/test_worker_loop.py",
    "tests/inference_workers/test_continuous_batching.py", "tests/train/test_critic.py",
    "tests/train/test_multihost.py", "tests/kernels/test_packed_model_logprobs.py",
    "tests/inference_workers/test_multi_turn.py", "tests/train/test_lora.py",
    "tests/models/test_routing_replay.py", "tests/kernels/test_kernels_on_a_mesh.py",
    "tests/train/test_rl_exactly_once.py", "tests/models/test_moe.py",
    "tests/models/test_deepseek.py", "tests/train/test_expert_parallel.py",
    "tests/kernels/test_shared_prompt_window.py", "tests/tpu_scripts/test_tpu_launch_scripts.py",
    "tests/test_cli.py", "tests/models/test_gemma.py",
]


def pytest_collection_modifyitems(config, items):
  rank = {m: i for i, m in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """After each test module, drop JAX's compiled programs: each holds memory maps, and an
  xdist worker that keeps every module's (27,000 maps for tests/models alone) reaches the
  kernel's vm.max_map_count (65,530), where XLA:CPU segfaults compiling or (de)serializing."""
  yield
  jax.clear_caches()
  gc.collect()
