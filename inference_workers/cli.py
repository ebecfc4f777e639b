r"""`rlax-ps worker`: run one inference worker against a parameter server until stopped.

  rlax-ps worker --address=127.0.0.1:50051 --token_file=runs/ps/tokens.json \
      --config=configs/rl_local.py [--samples_per_prompt=16 --weights_format=int8]

The config file supplies the `model` and `tokenizer` sections (as the trainer's config has
them; with `init_from_hf`, that checkpoint's config.json gives the model's shape) and
optionally a `worker` section of WorkerConfig fields; explicit flags win over it. The token
comes from --token, $RLAX_PS_WORKER_TOKEN or --token_file; --tls_ca turns TLS on.
SIGTERM (a preemption notice) stops the worker cleanly within --grace_s.

A multi-host slice runs one worker: the same command on every host with
--coordinator_address (auto on TPU VMs; else process 0's HOST:PORT with --num_processes and
--process_id). Process 0 talks to the server; the others follow its device calls
(inference_workers/multihost.py).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

from rlax_ps.hard_exit import exit_now
from inference_workers.worker_config import WorkerConfig
from param_server import connect_flags
from rlax_ps import distributed
from rlax_ps.dataclass_flags import define_flags, resolve

STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
_FOLLOWER_MARGIN_S = 30.0  # past grace_s: a follower signalled to stop waits this long more

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "ml_collections file with `model`, `tokenizer` and optional `worker` "
    "sections: the trainer's, e.g. configs/rl_local.py")
flags.adopt_module_key_flags(connect_flags)
flags.adopt_module_key_flags(distributed)
flags.mark_flags_as_required(["config"])
connect_flags.require_address()

define_flags(WorkerConfig)
for _field in dataclasses.fields(WorkerConfig):  # listed by `rlax-ps worker --help`
  flags.declare_key_flag(_field.name)


def worker_config_from(section) -> WorkerConfig:
  """Defaults, then the config file's `worker` section, then explicit flags."""
  return resolve(WorkerConfig, section, "--config worker section")


def stop_on_signals(worker) -> None:
  """Turn SIGTERM/SIGINT into `worker.request_stop()` even while the main thread is inside a
  long XLA call: the signals are blocked in every thread (call `block_stop_signals` before
  any thread starts) and one thread waits for them."""
  def wait():
    signal.sigwait(STOP_SIGNALS)
    worker.request_stop()

  threading.Thread(target=wait, name="stop-signals", daemon=True).start()


def leave_on_signals(grace_s: float) -> None:
  """A multi-host worker's process other than 0: a stop signal is the leader's to act on
  (its samples go back through every host's devices), so it is passed to the leader; this
  process leaves by itself only if the leader has not stopped it within `grace_s` and a
  margin."""
  def wait():
    signal.sigwait(STOP_SIGNALS)
    from inference_workers import multihost
    multihost.ask_leader_to_stop()
    threading.Event().wait(grace_s + _FOLLOWER_MARGIN_S)
    print("rlax-ps worker: stopped by a signal, and the leader (process 0) did not end the "
          "job within the grace period", file=sys.stderr, flush=True)
    exit_now(1)

  threading.Thread(target=wait, name="stop-signals", daemon=True).start()


def lost_host_message(e: Exception, process: int) -> str:
  """One line for a device call across the hosts that failed: a host of the job is gone (the
  collective's error names its address) or failed."""
  said = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
  return (f"rlax-ps worker: a device call across the hosts of this multi-host worker failed, "
          f"so a host is gone or failed (this is process {process}): {said}")


def block_stop_signals() -> None:
  """Keep stop signals pending for `stop_on_signals`; threads started later inherit this."""
  signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def main(argv) -> None:
  block_stop_signals()  # before JAX or gRPC start any thread
  cfg = _CONFIG.value
  try:  # what the config names is made before JAX and the model load
    if "model" not in cfg:
      raise ValueError("--config: expected a `model` section (ModelConfig fields), found none")
    config = worker_config_from(cfg.get("worker"))
    from algorithms.environments import environments_from
    from algorithms.verifiers import verifiers_by_task
    verifier_for = verifiers_by_task(config.default_task, config.verifiers)
    environments = environments_from(config.environment, config.environment_args,
                                     config.environment_timeout_s or None)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  leader = distributed.initialize("rlax-ps worker")  # multi-host: before any JAX backend starts
  import jax

  from inference_workers import multihost
  from rlax_ps.compile_cache import enable_compile_cache
  enable_compile_cache()
  # JAX and the model load only once the flags are valid.
  from inference_workers.loop import Worker, worker_mesh
  from rlax_ps.models import longest_sequence, model_config_from
  from rlax_ps.tokenizers import tokenizer_from_config

  init_from_hf = cfg.get("init_from_hf", "")
  try:  # a tokenizer or checkpoint that is not there, a model field out of range: one line
    tokenizer = tokenizer_from_config(cfg.get("tokenizer"), init_from_hf,
                                      str(cfg.get("worker", {}).get("verifiers", "")))
    model_config = model_config_from(cfg.model, tokenizer.vocab_size, init_from_hf,
                                     longest_sequence(cfg))
  except (OSError, ValueError) as e:
    raise app.UsageError(str(e)) from None
  from inference_workers.weights import WeightsDoNotFit
  from param_server.client import ParamServerError
  if jax.process_count() > 1:  # every host must hold the same model and decode alike
    same = {f"model.{k}": v for k, v in model_config.to_dict().items()}
    same.update((f"worker.{k}", v) for k, v in dataclasses.asdict(config).items() if k != "name")
    try:
      multihost.check_same(same, multihost.Channel())
      worker_mesh(config)  # a mesh the hosts cannot make is refused by each, not a follower
    except ValueError as e:
      print(f"rlax-ps worker: {e}", file=sys.stderr, flush=True)
      jax.distributed.shutdown()
      exit_now(2)
  if not leader:  # another host of a multi-host worker: process 0 talks to the server
    from inference_workers.loop import follow_leader
    leave_on_signals(config.grace_s)
    try:
      code = follow_leader(model_config, tokenizer, config, multihost.Channel())
    except jax.errors.JaxRuntimeError as e:  # the leader or another host is gone
      print(lost_host_message(e, jax.process_index()), file=sys.stderr, flush=True)
      exit_now(1)  # no jax.distributed.shutdown: it would wait for the lost host
    except Exception as e:  # noqa: BLE001: leave, so the leader's next device call fails
      print(f"rlax-ps worker: process {jax.process_index()}: {type(e).__name__}: {e}",
            file=sys.stderr, flush=True)
      exit_now(1)  # jax.distributed.shutdown would wait for the leader, the leader for this
    jax.distributed.shutdown()
    exit_now(code)  # the leader's: a job it refused fails on every host
  mirror = multihost.Mirror(multihost.Channel()) if jax.process_count() > 1 else None

  def let_go(code: int) -> None:
    """The other processes of a multi-host worker stop following, to exit with `code`
    (before this one exits with it)."""
    if mirror is not None:
      try:
        mirror.stop(code)
      except jax.errors.JaxRuntimeError:  # a host is gone: shutdown would wait for it
        return
      jax.distributed.shutdown()

  def leave(code: int) -> None:
    let_go(code)
    exit_now(code)

  def crashed() -> None:
    """The worker failed (its leases released): the traceback, then exit 1 at once, since an
    environment call left hung on its thread would hold the interpreter's exit for ever."""
    traceback.print_exc()
    leave(1)

  try:
    with connect_flags.connect("worker") as client:
      try:
        worker = Worker(client, model_config, tokenizer, config, verifier_for=verifier_for,
                        environments=environments, mirror=mirror)
      except ValueError as e:  # settings the model cannot honour
        let_go(2)  # the exit status rlax-ps gives a UsageError
        raise app.UsageError(str(e)) from None
      mesh = worker.mesh
      print("worker: decoding on " + ("the default device" if mesh is None else
                                      f"{mesh.size} devices (data {mesh.shape['data']} x "
                                      f"tensor {mesh.shape['tensor']})")
            + f"; {worker.batching}", flush=True)
      stop_on_signals(worker)
      if mirror is not None:  # a follower's host stopped by a signal stops the whole job
        multihost.on_stop_asked(lambda process: (
            print(f"worker: process {process} was stopped by a signal; stopping every host",
                  flush=True), worker.request_stop()))
      stats = worker.run()
  except (ParamServerError, connect_flags.TokenFileError, WeightsDoNotFit) as e:
    print(f"rlax-ps worker: {e}", file=sys.stderr, flush=True)
    leave(1)  # leases released: skip a finalization that can abort
  except jax.errors.JaxRuntimeError as e:
    if mirror is None:
      crashed()
    print(lost_host_message(e, 0) + "; open leases released", file=sys.stderr, flush=True)
    exit_now(1)  # no stop message nor jax.distributed.shutdown: both wait for the lost host
  except app.UsageError:
    raise
  except Exception:  # noqa: BLE001 - a crash, said with its traceback
    crashed()
  logging.info("worker: done: %s", stats)
  held = ("nothing" if worker.policy.version is None else
          f"v{worker.policy.version} digest {worker.policy.digest():016x}")
  print(f"worker: exiting: {stats.leases} leases, {stats.groups_submitted} groups submitted, "
        f"{stats.prompts_released} prompts released ({stats.samples_salvaged} begun samples "
        f"handed back; {stats.groups_abandoned_stale} begun under the trainer's staleness "
        f"floor), {stats.groups_dropped_lost} dropped as their leases expired, "
        f"{stats.prompts_failed} prompts it could not sample, "
        f"{stats.score_errors} samples scored 0 "
        f"by a verifier that raised; holds {held}", flush=True)
  leave(0)  # leases released, output flushed: skip a finalization that can abort
