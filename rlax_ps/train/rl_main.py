"""`rlax-ps train`: the RL trainer against a running parameter server; flags only, the job
is `rlax_ps.train.rl.RLTrainer.train`.

  rlax-ps train --config=configs/rl_local.py --workdir=runs/rl \\
      --address=127.0.0.1:50051 --token_file=runs/ps/tokens.json \\
      --config.init_from_hf=runs/rl_local/sft/hf

A rerun with the same workdir resumes from its latest checkpoint. SIGTERM or Ctrl-C finishes
the step, checkpoints and, if the run had steps left, exits with 128 + the signal (143 for
SIGTERM): not done, so a supervisor such as a Kubernetes Job restarts it and it resumes.

On a multi-host slice run the same command on every host with --coordinator_address=auto
(TPU: jax.distributed finds the slice), or HOST:PORT with --num_processes and --process_id.
Process 0 connects to the server and writes the workdir's logs; --config.checkpoint.directory
must be storage every host sees (e.g. gs://).
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys

from absl import flags, logging
from ml_collections import config_flags

from param_server import connect_flags
from rlax_ps import distributed

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "RL config file, e.g. configs/rl_local.py; override fields with "
    "--config.a.b=value.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, TensorBoard "
                               "events, steps.jsonl, summary.json. A rerun resumes.")
TOKEN_FILE_WAIT_S = 300.0
flags.adopt_module_key_flags(connect_flags)
flags.adopt_module_key_flags(distributed)
flags.mark_flags_as_required(["config", "workdir"])
connect_flags.require_address()


def main(argv: list[str]) -> None:
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save step at INFO.
    logging.set_verbosity(logging.WARNING)
  leader = distributed.initialize()  # before any JAX backend starts
  import jax

  from rlax_ps.compile_cache import enable_compile_cache
  enable_compile_cache()
  from rlax_ps.train.rl import RLTrainer, server_retry, stop_on_signals
  from rlax_ps.train.run import built_or_exit
  from rlax_ps.train.state import mesh_layout

  config = _CONFIG.value
  # A server started beside the trainer writes its token file at start: wait for it.
  with (connect_flags.connect("trainer", token_wait_s=TOKEN_FILE_WAIT_S,
                              retry=server_retry(config)) if leader
        else contextlib.nullcontext()) as client, \
       built_or_exit("rlax-ps train", lambda: RLTrainer(config, _WORKDIR.value, client)
                     ) as trainer:
    stop_on_signals(trainer)
    if trainer.restored:
      print(f"resuming from checkpoint step {trainer.step} in {trainer.checkpointer.directory}",
            flush=True)
    elif not trainer.init_from_hf and leader:  # (RL of an untrained policy learns nothing)
      print("rl: warning: the policy starts from random weights: no --config.init_from_hf and "
            "no checkpoint in the workdir" + (
                "; this recipe's warm start (its sft block) is run by `rlax-ps local`, or by "
                "`rlax-ps sft` with this --config and --workdir=W: give `rlax-ps train` its "
                "export, --config.init_from_hf=W/hf"
                if config.get("sft") is not None else ""), file=sys.stderr, flush=True)
    print(f"rl: model {trainer.model_config.num_params:,} params; "
          f"{mesh_layout(trainer.model_config, trainer.mesh)}; {trainer.total_steps} steps "
          f"of {trainer.shape.groups} groups x {trainer.shape.samples} samples; "
          + (f"server {client.address}" if leader else
             f"process {jax.process_index()} of {jax.process_count()}"), flush=True)
    summary = trainer.train(max_seconds=float(config.rl.max_seconds))
  if trainer.stop_signal and summary.get("stopped"):
    where = (f"at step {summary['step']} of {trainer.total_steps}"
             if summary["step"] < trainer.total_steps else "during the final evaluation")
    print(f"rl: stopped by {signal.Signals(trainer.stop_signal).name} {where}, checkpointed; "
          f"rerun to resume", flush=True)
    sys.exit(128 + trainer.stop_signal)
  if leader:
    print("rl: done: " + json.dumps(summary), flush=True)
  else:
    print(f"rl: done at step {summary['step']} (process {jax.process_index()})", flush=True)
