"""`rlax-ps train`: the RL trainer against a running parameter server; flags only, the job
is `rlax_ps.train.rl.RLTrainer.train`.

  rlax-ps train --config=configs/rl_local.py --workdir=runs/rl \\
      --address=127.0.0.1:50051 --token_file=runs/rl/ps/tokens.json \\
      --config.init_from_hf=runs/rl/sft/hf

A rerun with the same workdir resumes from its latest checkpoint. SIGTERM or Ctrl-C finishes
the step, checkpoints and exits.
"""

from __future__ import annotations

import json

from absl import flags, logging
from ml_collections import config_flags

from param_server import connect_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "RL config file, e.g. configs/rl_local.py; override fields with "
    "--config.a.b=value.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, TensorBoard "
                               "events, steps.jsonl, summary.json. A rerun resumes.")
flags.adopt_module_key_flags(connect_flags)
flags.mark_flags_as_required(["config", "workdir", "address"])


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise SystemExit(f"rlax-ps train: unexpected arguments {argv[1:]}; flags are --name=value")
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save step at INFO.
    logging.set_verbosity(logging.WARNING)
  from rlax_ps.compile_cache import enable_compile_cache
  enable_compile_cache()
  from rlax_ps.train.rl import RLTrainer, stop_on_signals  # JAX loads once flags are valid.

  config = _CONFIG.value
  with connect_flags.connect("trainer") as client, \
       RLTrainer(config, _WORKDIR.value, client) as trainer:
    stop_on_signals(trainer)
    if trainer.restored:
      print(f"resuming from checkpoint step {trainer.step} in {trainer.checkpointer.directory}",
            flush=True)
    print(f"rl: model {trainer.model_config.num_params:,} params; {trainer.total_steps} steps "
          f"of {trainer.shape.groups} groups x {trainer.shape.samples} samples; server "
          f"{client.address}", flush=True)
    summary = trainer.train(max_seconds=float(config.rl.max_seconds))
  print("rl: done: " + json.dumps(summary), flush=True)
