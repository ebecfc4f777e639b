"""The environment of a process a test starts (`rlax-ps ...`): the test's own without its 8
fake CPU devices (a child sees one, or the `devices` it asks for), with XLA:CPU's backend
optimizations off and its other settings as in the tests (compiles are most of a short
child's time, and they change no result), and without the role tokens (`RLAX_PS_*_TOKEN`)
when `tokens` is False."""

import os


def child_env(*, devices: int = 0, tokens: bool = True) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if k != "XLA_FLAGS" and (tokens or "_TOKEN" not in k)}
  flags = ["--xla_backend_optimization_level=0"]
  # The test process's own XLA:CPU settings that this jaxlib takes (conftest asked it)
  flags += [f for f in os.environ.get("XLA_FLAGS", "").split()
            if f.startswith("--xla_cpu_use_fusion_emitters")]
  if devices:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  env["XLA_FLAGS"] = " ".join(flags)
  return env
