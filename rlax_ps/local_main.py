"""`rlax-ps local`: the whole RL loop on this machine (warm start, parameter server, trainer,
workers), with a live progress line and a summary table at the end.

  rlax-ps local --config=configs/rl_local.py --workdir=runs/rl_local
  rlax-ps local --config=configs/rl_local.py:tiny --workdir=/tmp/rl --config.local.workers=1

Children log to <workdir>/logs/; TensorBoard events are in <workdir>/tb. A rerun on the same
workdir reuses the warm start and resumes the trainer from its checkpoint (one on other data
is refused before anything starts, as the trainer refuses it, and what the trainer says of
its lr schedule is printed); a rerun of a run that trained its rl.steps starts nothing and
shows its summary (raise rl.steps to go on).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from absl import flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "RL config file, e.g. configs/rl_local.py; override fields with "
    "--config.a.b=value (the children get the same overrides).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (warm start, server storage, "
                               "checkpoints, logs, summary.json).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show the live progress line.")
flags.mark_flags_as_required(["config", "workdir"])


class Terminated(Exception):
  """A SIGTERM or SIGHUP (a closed terminal): stop the children as on Ctrl-C (they run in
  sessions of their own, so the signal does not reach them); exit 128 + its number."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.code = 128 + signum


# The stop signal taken: its Terminated may have been swallowed, raised inside a gc callback
# (JAX registers one; Python prints "Exception ignored" and goes on), so it is polled too.
_RECEIVED: list[int] = []


def _raise_terminated(signum, frame) -> None:
  del frame
  _ignore_stop_signals()  # one is enough: the stop must not be cut short
  _RECEIVED.append(signum)
  raise Terminated(signum)


def _ignore_stop_signals() -> None:
  for stop in STOP_SIGNALS:
    signal.signal(stop, signal.SIG_IGN)


def check_stop() -> None:
  """Terminated if a stop signal came whose own raise was swallowed: polled between the
  phases and while children run."""
  if _RECEIVED:
    raise Terminated(_RECEIVED[0])


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def main(argv: list[str]) -> None:
  _RECEIVED.clear()  # (a notebook's second run in one process: the first's stop is done)
  before = {stop: signal.signal(stop, _raise_terminated) for stop in STOP_SIGNALS}
  try:
    _run(argv)
  except Terminated as e:  # during the checks, before anything started
    print("rlax-ps local: terminated before the run started", file=sys.stderr, flush=True)
    sys.exit(e.code)
  finally:  # the caller's handlers back (a notebook's kernel goes on)
    for stop, handler in before.items():
      if handler is not None:  # (None: one set from C, which Python cannot set again)
        signal.signal(stop, handler)


def _run(argv: list[str]) -> None:
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from tqdm import tqdm

  from rlax_ps import local
  from rlax_ps.compile_cache import enable_compile_cache
  from rlax_ps.config_files import user_path

  config = _CONFIG.value
  if not config.get("init_from_hf") and config.get("sft") is None:
    print("rlax-ps local: bad flags: --config.init_from_hf: this recipe has no warm start (no "
          "`sft` block); name the Hugging Face checkpoint to start from", file=sys.stderr)
    sys.exit(2)
  from inference_workers.worker_config import WorkerConfig  # no JAX: checked before any start
  try:
    worker_grace_s = WorkerConfig(**config.worker.to_dict()).grace_s
  except (TypeError, ValueError) as e:
    print(f"rlax-ps local: bad flags: --config.worker: {e}", file=sys.stderr)
    sys.exit(2)
  from rlax_ps.train.rl_checks import check_rl_config  # imports JAX, starts no backend
  try:
    check_rl_config(config)  # the trainer's and workers' checks, before the warm start
  except (OSError, TypeError, ValueError) as e:
    print(f"rlax-ps local: bad flags: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    workdir = user_path(_WORKDIR.value, "--workdir")
  except ValueError as e:
    print(f"rlax-ps local: bad flags: {e}", file=sys.stderr)
    sys.exit(2)
  _check_resume(config, workdir)
  check_stop()
  overrides = local.override_flags(config_flags.get_override_values(flags.FLAGS["config"]),
                                   config)
  config_file = config_flags.get_config_filename(flags.FLAGS["config"])
  path, _, variant = config_file.partition(":")
  config_file = os.path.abspath(path) + (f":{variant}" if variant else "")
  try:
    run = local.LocalRun(workdir, config_file, overrides, workers=int(config.local.workers),
                         worker_platform=str(config.local.get("worker_platform", "cpu")),
                         trainer_chips=int(config.local.get("trainer_chips", 0)),
                         chips_per_worker=int(config.local.get("chips_per_worker", 0)),
                         metrics_port=int(config.local.get("metrics_port", -1)),
                         serve_flags=str(config.local.get("serve_flags", "")),
                         worker_grace_s=worker_grace_s,
                         trainer_grace_s=float(config.local.get("trainer_grace_s", 120.0)))
  except ValueError as e:
    print(f"rlax-ps local: bad flags: {e}", file=sys.stderr)
    sys.exit(2)
  run.hold_workdir()  # held until this process exits
  if not config.init_from_hf:
    try:  # a warm start of another `sft` block there: the run after it is another's too
      local.check_warm_start(config, workdir)
    except ValueError as e:
      print(f"rlax-ps local: bad flags: {e}", file=sys.stderr, flush=True)
      sys.exit(2)
  done = local.finished_summary(workdir, int(config.rl.steps))
  if done is not None:  # nothing to train: not even the warm start (its folder may be gone)
    _show_finished(workdir, done, int(config.rl.steps))
    return
  enable_compile_cache()
  try:
    init_from_hf = os.path.abspath(local.warm_start(config, workdir, _PROGRESS.value,
                                                    check_stop=check_stop))
    check_stop()
  except local.ChildFailed as e:  # 130 / 143 when Ctrl-C or SIGTERM stopped it
    print(f"rlax-ps local: {e}", file=sys.stderr, flush=True)
    sys.exit(e.code)
  except ValueError as e:
    print(f"rlax-ps local: bad flags: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  except Terminated as e:
    print("rlax-ps local: terminated during the warm start", file=sys.stderr, flush=True)
    sys.exit(e.code)
  except KeyboardInterrupt:
    print("rlax-ps local: interrupted during the warm start", file=sys.stderr, flush=True)
    sys.exit(130)
  from rlax_ps.train.rl_checks import check_resumed_model
  try:  # (a warm start trained anew on another model block: the trainer would refuse it)
    line = check_resumed_model(config, workdir, init_from_hf)
  except (OSError, ValueError) as e:
    print(f"rlax-ps local: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  if line:  # another init_from_hf than the run's: its trainer's log alone said so
    print(f"rlax-ps local: {line}", file=sys.stderr, flush=True)
  steps = local.StepReader(os.path.join(workdir, "steps.jsonl"))
  code, message = 0, ""
  try:
    address = run.start_server()
    print(f"parameter server on {address}; logs in {run.logs}", flush=True)
    if run.metrics_url:
      print(f"parameter server metrics (Prometheus, no token) on {run.metrics_url}", flush=True)
    trainer = run.start_trainer(init_from_hf)
    run.start_workers(init_from_hf)
    bar = tqdm(total=int(config.rl.steps), initial=steps.last_step, desc="rl", unit="step",
               disable=not _PROGRESS.value, dynamic_ncols=True)  # (a resumed run's rate: its own)
    progress = local.Progress()
    while not run.check(trainer):
      check_stop()
      for record in steps.read():
        local.advance(bar, record["step"])
        bar.set_postfix(progress.postfix(record), refresh=False)
        bar.refresh()
      time.sleep(0.5)
    bar.close()
  except local.ChildFailed as e:
    code, message = e.code, f"rlax-ps local: {e}"
  except KeyboardInterrupt:
    code, message = 130, "rlax-ps local: interrupted; children stopped"
  except Terminated as e:
    code, message = e.code, "rlax-ps local: terminated; children stopped"
  finally:
    _ignore_stop_signals()  # (a stop after Ctrl-C or a child's failure: not cut short)
    run.stop()
  if code:
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)
  with open(os.path.join(workdir, "summary.json")) as f:
    _show_summary(workdir, json.load(f))


def _check_resume(config, workdir: str) -> None:
  """Before anything starts: exit 2 with the trainer's line where it would refuse to resume
  the workdir's checkpoint on this config's data, else print the lines it logs on resuming
  it (the lr schedule kept or changed), which would be in its log alone."""
  import jax

  from rlax_ps.train.rl_checks import resume_lines
  # The supervisor's own JAX (the schedule's lr in a line) runs on the CPU: an accelerator
  # it opened would be held from the trainer and workers.
  jax.config.update("jax_platforms", "cpu")
  try:
    lines = resume_lines(config, workdir)
  except (OSError, ValueError) as e:
    print(f"rlax-ps local: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  for line in lines:
    print(line, flush=True)


def _show_summary(workdir: str, summary: dict) -> None:
  """The summary table, the export and where the summary and TensorBoard events are."""
  from rlax_ps import local
  print(local.summary_table(summary), flush=True)
  if summary.get("export"):
    print(f"trained policy (Hugging Face format): {summary['export']}", flush=True)
  print(f"summary: {os.path.join(workdir, 'summary.json')}; TensorBoard: "
        f"{os.path.join(workdir, 'tb')}", flush=True)


def _show_finished(workdir: str, summary: dict, steps: int) -> None:
  """A rerun of a finished run: nothing to train; what it trained."""
  print(f"rlax-ps local: {workdir} has trained {summary['step']} steps (rl.steps={steps}): "
        f"nothing to train; raise --config.rl.steps to train on, or use another --workdir. "
        f"Its summary:", flush=True)
  _show_summary(workdir, summary)
