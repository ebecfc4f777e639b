"""`rlax-ps sft`: flags only; the job is `rlax_ps.train.sft.train_and_evaluate`.

  rlax-ps sft --config=configs/sft_tiny.py --workdir=runs/sft_tiny
  rlax-ps sft --config=configs/sft_tiny.py:tiny --config.optimizer.lr=1e-3 --workdir=/tmp/x
  rlax-ps sft --config=configs/rl_local.py --workdir=runs/rl/sft  # an RL recipe's warm start

An RL recipe (a config with an `rl` block) trains its `sft` block, exported to HF for
`rlax-ps train --config.init_from_hf=WORKDIR/hf`; override it with --config.sft.X.

On a multi-host slice run the same command on every host with --coordinator_address=auto
(TPU VMs) and --config.checkpoint.directory on storage every host sees (e.g. gs://).
SIGTERM or Ctrl-C finishes the step, checkpoints and, with steps left, exits with 128 + the
signal (143 for SIGTERM); a rerun resumes.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from rlax_ps import distributed

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/sft_tiny.py or configs/sft_tiny.py:tiny; "
    "override fields with --config.a.b=value.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, TensorBoard "
                               "events, HF export. A rerun with the same workdir resumes.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
flags.adopt_module_key_flags(distributed)
flags.mark_flags_as_required(["config", "workdir"])


def warm_start_config(config):
  """The block `rlax-ps sft` trains: `config`, or an RL recipe's warm start (its `sft` block,
  with the HF export the RL trainer starts from, as `rlax-ps local` runs it)."""
  if "rl" not in config:
    return config
  if config.get("sft") is None:
    raise app.UsageError("--config: an RL recipe without an `sft` block has no warm start "
                         "to run; give `rlax-ps train` a checkpoint, --config.init_from_hf")
  print("sft: this RL recipe's warm start: its `sft` block (override it with --config.sft.X), "
        "exported to HF", flush=True)
  config.sft.export.hf = True
  return config.sft


def main(argv: list[str]) -> None:
  if not flags.FLAGS["verbosity"].present:  # orbax logs every save step at INFO.
    logging.set_verbosity(logging.WARNING)
  config, workdir = warm_start_config(_CONFIG.value), _WORKDIR.value
  distributed.initialize()  # before any JAX backend starts
  from rlax_ps.compile_cache import enable_compile_cache
  enable_compile_cache()
  from rlax_ps.train.run import built_or_exit  # JAX loads only once flags are valid.
  from rlax_ps.train.sft import SFTTrainer, train_and_evaluate
  trainer = built_or_exit("rlax-ps sft", lambda: SFTTrainer(config, workdir))
  summary = train_and_evaluate(config, workdir, progress=_PROGRESS.value, stop_on_signals=True,
                               trainer=trainer)
  if summary.get("stopped"):  # steps left: not done, so a supervisor restarts it
    sys.exit(128 + summary["stopped"])
