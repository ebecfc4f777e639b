"""`rlax-ps local`: the whole RL loop on one machine, supervised.

The supervised warm start runs first (in <workdir>/sft, reused once finished) unless the
config names `init_from_hf`. Then a parameter server, the trainer and the workers run as
child processes on 127.0.0.1, each logging to <workdir>/logs/. The supervisor itself never
starts a JAX backend (the warm start is a child too), so the trainer can have this
machine's accelerators; the workers run on the CPU unless `local.worker_platform` says
('': all share one GPU, none preallocating its memory), or each gets GPUs or TPU chips of
its own (`local.trainer_chips`, `local.chips_per_worker`; rlax_ps/chips.py).
Tokens are made fresh in the server's owner-only tokens.json, which the children read
(never a command line); `local.metrics_port` turns on the server's Prometheus metrics. One
live line shows the trainer's progress; the run ends at the trainer's last step, on Ctrl-C,
SIGTERM or SIGHUP, or when any child fails (then with a non-zero exit naming the child and
its last log lines). A supervisor killed without notice
takes its children with it (each gets a SIGTERM, Linux).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

from param_server import auth
from rlax_ps import chips
from rlax_ps.cli import STOP_WITH_PARENT
from rlax_ps.config_files import make_workdir, run_config_changes
from rlax_ps.folder_lock import FolderInUse, FolderLock
from rlax_ps.sizes import human_bytes

LISTENING = re.compile(r"parameter server listening on (\S+)")
METRICS = re.compile(r"metrics on (http://\S+)")
TAIL_LINES = 20
PR_SET_PDEATHSIG = 1  # prctl(2)
# A stopped worker's time past its worker.grace_s before it is killed (its exit, after the release).
_EXIT_SLACK_S = 5.0


class ChildFailed(RuntimeError):
  """A child process of the run exited while the run needed it; `code`: the exit status the
  run ends with (1, or 128 + the signal that stopped it)."""

  def __init__(self, message: str, code: int = 1):
    super().__init__(message)
    self.code = code


def override_flags(overrides: dict[str, Any], config: Any) -> list[str]:
  """The `--config.a.b=value` flags that give a child the supervisor's `config`: each path
  ml_collections says was overridden, at its final value there (the values given, one a
  path in first-given order, ended otherwise where two paths are one block: rl_local's
  model and sft.model; a warm start of one size, a trainer of another)."""
  out = []
  for path in overrides:
    value = config
    for part in path.split("."):
      value = value[part]
    text = value if isinstance(value, str) else repr(value)
    out.append(f"--config.{path}={text}")
  return out


def stop_with_parent(parent_pid: int) -> None:
  """In a child: a SIGTERM once the process `parent_pid` is gone, even killed without
  notice (Linux's parent-death signal; elsewhere nothing), so a supervisor that dies leaves
  no server, trainer or worker running on. Each child calls it first thing (the `rlax-ps`
  entry point, told the supervisor's pid in its environment; the warm start's process)."""
  if not sys.platform.startswith("linux"):
    return
  import ctypes
  ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
  if os.getppid() != parent_pid:  # it died before the call
    os.kill(os.getpid(), signal.SIGTERM)


def tail(path: str, n: int = TAIL_LINES, start: int = 0) -> str:
  """The last `n` lines of the log at `path` from byte `start` on (a log is appended to by
  every run on the workdir: this run's part alone)."""
  try:
    with open(path, "rb") as f:
      f.seek(start)
      text = f.read().decode(errors="replace")
  except OSError:
    return "(no log)"
  return "".join(text.splitlines(keepends=True)[-n:])


@dataclasses.dataclass
class Child:
  name: str
  process: subprocess.Popen
  log: str
  start: int = 0  # where this run's part of the log begins

  def failed_message(self) -> str:
    code = self.process.returncode
    how = (f"was killed by {signal.Signals(-code).name}" if code < 0
           else f"exited with status {code}")  # (Popen's -N: the signal N)
    return f"{self.name} {how}; last lines of {self.log}:\n{tail(self.log, start=self.start)}"


class LocalRun:
  """The children of one `rlax-ps local` run and their supervision."""

  def __init__(self, workdir: str, config_file: str, overrides: Sequence[str], *,
               workers: int, worker_platform: str = "cpu", trainer_chips: int = 0,
               chips_per_worker: int = 0, metrics_port: int = -1, serve_flags: str = "",
               python: str = sys.executable, dev: str = "/dev", worker_grace_s: float = 25.0,
               trainer_grace_s: float = 120.0):
    if workers < 1:
      raise ValueError(f"local.workers: expected >= 1, got {workers}")
    if not trainer_grace_s > 0:
      raise ValueError(f"local.trainer_grace_s: expected a number of seconds > 0, got "
                       f"{trainer_grace_s}")
    if not -1 <= metrics_port <= 65535:
      raise ValueError(f"local.metrics_port: expected -1 (off) or a port 0-65535 (0: any "
                       f"free one), got {metrics_port}")
    self.serve_flags = str(serve_flags).split()
    reserved = [f for f in self.serve_flags if not f.startswith("--") or f.split("=")[0] in (
        "--storage_dir", "--port", "--host", "--metrics_port", "--token_file")]
    if reserved:
      raise ValueError(f"local.serve_flags: expected more `rlax-ps serve` flags (--name=value), "
                       f"not {reserved[0]!r} (the run sets its storage, address and tokens; "
                       f"metrics: local.metrics_port)")
    if (trainer_chips > 0) != (chips_per_worker > 0) or min(trainer_chips, chips_per_worker) < 0:
      raise ValueError(f"{chips.FIELDS}: expected both > 0 (a split of this host's GPUs or "
                       f"TPU chips) or both 0, got {trainer_chips} and {chips_per_worker}")
    self.trainer_env: dict[str, str] = {}
    self.worker_envs = [{"JAX_PLATFORMS": worker_platform} if worker_platform else {}
                        for _ in range(workers)]
    if not worker_platform and not trainer_chips:  # all share the accelerators (one GPU):
      # none takes 75% of a GPU's memory at start (JAX's default), each allocates as it goes
      share = {"XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE",
                                                               "false")}
      self.trainer_env = dict(share)
      self.worker_envs = [{**env, **share} for env in self.worker_envs]
    if trainer_chips:  # the trainer's chips first, then each worker its own
      self.trainer_env, *self.worker_envs = chips.split_envs(trainer_chips, chips_per_worker,
                                                             workers, dev)
    self.workdir = make_workdir(workdir)
    self.worker_grace_s = worker_grace_s  # worker.grace_s: what a stopped worker may take
    self.trainer_grace_s = trainer_grace_s  # local.trainer_grace_s: its step and checkpoint
    self.config_file, self.overrides = config_file, list(overrides)
    self.num_workers, self.python = workers, python
    self.logs = os.path.join(self.workdir, "logs")
    self.ps_dir = os.path.join(self.workdir, "ps")
    self.token_file = os.path.join(self.ps_dir, auth.TOKEN_FILE)
    self.children: list[Child] = []
    self.address = ""
    self.metrics_port = metrics_port
    self.metrics_url = ""  # the server's Prometheus /metrics, once started with a port
    os.makedirs(self.logs, exist_ok=True)
    os.makedirs(self.ps_dir, exist_ok=True)

  def hold_workdir(self) -> None:
    """Lock the run's logs folder while this supervisor lives (`workdir_lock`): a second
    `rlax-ps local` on the workdir is refused (FolderInUse, naming the first's pid) before
    its warm start and server, rather than failing in them; so is a workdir a trainer
    (`rlax-ps train`) holds, its lock tried and let go (this run's trainer takes it)."""
    self.workdir_lock = FolderLock(self.logs, holder="`rlax-ps local`", flag="--workdir")
    try:
      FolderLock(self.workdir, holder="trainer", flag="--workdir").release()
    except FolderInUse:
      self.workdir_lock.release()
      raise

  def _spawn(self, name: str, args: list[str], env: dict | None = None) -> Child:
    log = os.path.join(self.logs, f"{name}.log")
    with open(log, "ab") as f:
      start = f.tell()
      f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {name}\n".encode())
      f.flush()
      process = subprocess.Popen([self.python, "-m", "rlax_ps", *args], stdout=f,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**os.environ, **(env or {}),
                                      STOP_WITH_PARENT: str(os.getpid())},
                                 start_new_session=True)
    child = Child(name, process, log, start)
    self.children.append(child)
    return child

  def server_args(self) -> list[str]:
    """The `rlax-ps serve` command line of the run's server: loopback, a free port,
    Prometheus metrics on `local.metrics_port` when it is not -1, and local.serve_flags."""
    args = ["serve", f"--storage_dir={self.ps_dir}", "--port=0", "--host=127.0.0.1"]
    if self.metrics_port >= 0:
      args.append(f"--metrics_port={self.metrics_port}")
    return args + self.serve_flags

  def start_server(self, timeout_s: float = 60.0) -> str:
    """Start the parameter server on a free loopback port; returns its address (and sets
    `metrics_url` when it serves metrics)."""
    auth.load_tokens(self.ps_dir, {})  # fresh tokens, owner-only, before anything reads them
    for role in auth.ROLES:  # the children read the file, not the environment
      os.environ.pop(auth.env_var(role), None)
    server = self._spawn("server", self.server_args())
    wanted = "'listening' and 'metrics on' lines" if self.metrics_port >= 0 else "'listening' line"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      if server.process.poll() is not None:
        raise ChildFailed(server.failed_message())
      with open(server.log, errors="replace") as f:
        f.seek(server.start)  # this run's part, however soon the server wrote to it
        text = f.read()
      found, metrics = LISTENING.search(text), METRICS.search(text)
      if found and (metrics or self.metrics_port < 0):
        self.address = found.group(1)
        self.metrics_url = metrics.group(1) if metrics else ""
        return self.address
      time.sleep(0.1)
    raise ChildFailed(f"server: no {wanted} in {server.log} after {timeout_s}s:\n"
                      f"{tail(server.log, start=server.start)}")

  def _client_flags(self) -> list[str]:
    return [f"--config={self.config_file}", *self.overrides, f"--address={self.address}",
            f"--token_file={self.token_file}"]

  def start_trainer(self, init_from_hf: str) -> Child:
    extra = [f"--config.init_from_hf={init_from_hf}"] if init_from_hf else []
    return self._spawn("trainer", ["train", *self._client_flags(), *extra,
                                   f"--workdir={self.workdir}"], self.trainer_env)

  def start_workers(self, init_from_hf: str) -> list[Child]:
    extra = [f"--config.init_from_hf={init_from_hf}"] if init_from_hf else []
    return [self._spawn(f"worker-{i}", ["worker", *self._client_flags(), *extra,
                                        f"--name=worker-{i}", f"--seed={i}"],
                        self.worker_envs[i])
            for i in range(self.num_workers)]

  def check(self, trainer: Child) -> bool:
    """True once the trainer has exited cleanly; ChildFailed if any child failed."""
    for child in self.children:
      code = child.process.poll()
      if code is None:
        continue
      if child is trainer and code == 0:
        return True
      raise ChildFailed(child.failed_message())
    return False

  def stop(self, grace_s: float = 30.0) -> None:
    """SIGTERM the workers and trainer (they release leases and checkpoint), then the server;
    SIGKILL whatever outlives `grace_s` (a worker: its own worker.grace_s and a little more;
    the trainer: local.trainer_grace_s, its step and checkpoint).
    A second Ctrl-C or signal meanwhile is ignored: cut short, the stop would leave the
    children to stop all at once, the server first, and a hung one running."""
    main = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, signal.SIG_IGN) for s in signals} if main else {}
    try:
      order = [c for c in self.children if c.name != "server"] + [
          c for c in self.children if c.name == "server"]
      for group in (order[:-1], order[-1:]):
        for child in group:
          if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        for child in group:
          grace = (max(grace_s, self.worker_grace_s + _EXIT_SLACK_S)
                   if child.name.startswith("worker") else
                   max(grace_s, self.trainer_grace_s) if child.name == "trainer" else grace_s)
          try:
            child.process.wait(max(0.1, start + grace - time.monotonic()))
          except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
    finally:
      for s, handler in before.items():
        signal.signal(s, handler)


class StepReader:
  """Follows the trainer's steps.jsonl: the records this run's trainer wrote since the last
  call. A resumed trainer rewrites the file without the steps a kill undid: it is then read
  again from its start, the earlier runs' records passed over by their time (reading on from
  the old size met the middle of a line, and the supervisor ended with a traceback)."""

  def __init__(self, path: str):
    self.path, self.offset, self.inode = path, 0, None
    self.since = time.time()
    self.last_step = 0  # the step the file ended at (a resumed run's bar starts there)
    if os.path.exists(path):
      st = os.stat(path)
      self.offset, self.inode = st.st_size, st.st_ino
      with open(path, "rb") as f:
        lines = f.read().splitlines()
      for line in reversed(lines):
        record = _record(line)
        if record is not None:
          self.last_step = int(record.get("step", 0))
          break

  def read(self) -> list[dict[str, Any]]:
    try:
      st = os.stat(self.path)
    except FileNotFoundError:
      return []
    if st.st_ino != self.inode or st.st_size < self.offset:  # rewritten
      self.offset, self.inode = 0, st.st_ino
    with open(self.path, "rb") as f:
      f.seek(self.offset)
      data = f.read()
    end = data.rfind(b"\n") + 1
    self.offset += end
    records = (_record(line) for line in data[:end].splitlines())
    return [r for r in records if r is not None and r.get("time", self.since) >= self.since]


def _record(line: bytes) -> dict[str, Any] | None:
  """A steps.jsonl line's record; None for one that is not (a progress line never ends
  the run)."""
  try:
    record = json.loads(line)
  except ValueError:
    return None
  return record if isinstance(record, dict) else None


def heldout_cell(x: float | None, scores: dict[str, Any], digits: int = 1) -> str:
  """A held-out figure as the tables print it: a percentage, or where a reward model scores
  the set (a "reward_model" name among `scores`), its score."""
  if x is None:
    return "-"
  return f"{x:.3f}" if "reward_model" in scores else f"{100 * x:.{digits}f}%"


class Progress:
  """The live line's figures from the trainer's steps.jsonl records: the latest step's, the
  bytes published over the records read, and the last held-out evaluation (the records
  between evaluations carry none)."""

  def __init__(self):
    self.synced = 0
    self.heldout: dict[str, Any] | None = None

  def postfix(self, record: dict[str, Any]) -> dict[str, str]:
    """The line's fields after `record`, the newest step."""
    self.synced += record.get("sync_bytes", 0) + record.get("sync_keyframe_bytes", 0)
    if record.get("heldout"):
      self.heldout = record["heldout"]
    acc = self.heldout
    return {"v": str(record["version"]), "reward": f"{record['reward_mean']:.2f}",
            "acc": "-" if not acc else heldout_cell(acc["all"], acc, digits=0),
            "len": f"{record.get('response_len_mean', 0):.0f}tok",
            "samples/s": f"{record['samples_per_s']:.1f}",
            "stale": f"{record['staleness_mean']:.1f}v", "synced": human_bytes(self.synced)}


def advance(bar, step: int) -> None:
  """Move the live bar (tqdm) to `step`. A resumed trainer's first step at or below the bar
  (the killed run had logged steps past its checkpoint) starts the bar over from there, its
  rate its own (it went backwards, at a negative rate and time left)."""
  if step <= bar.n:
    bar.initial = step - 1
    bar.start_t = bar.last_print_t = time.time()  # (tqdm's reset() would draw 0 steps first)
  bar.n = step


def sampling_label(sampling: dict[str, float]) -> str:
  """How pass@k sampled, e.g. "T=1.0, top_p=0.95": the temperature and each truncation on."""
  shown = [f"T={sampling.get('temperature', 1.0)}"]
  off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
  shown += [f"{k}={sampling[k]}" for k in off if sampling.get(k, off[k]) != off[k]]
  return ", ".join(shown)


def summary_table(summary: dict[str, Any]) -> str:
  """The end-of-run table: held-out accuracy before and after RL, sync and throughput."""
  before = summary.get("warm_start") or {}
  after = summary.get("heldout_exact_match") or {}
  scores = {**before, **after}
  title = "held-out score" if "reward_model" in scores else "held-out exact match"
  # Without a held-out set (a reward model's recipe may have none), no header without rows.
  rows = [(title, "before RL", "after RL")] if scores or summary.get("heldout_pass") else []
  for name in sorted(scores, key=lambda n: (n == "all", n)):
    rows.append((f"  {name}", heldout_cell(before.get(name), scores),
                 heldout_cell(after.get(name), scores)))
  for name, v in (summary.get("heldout_pass") or {}).items():
    rows.append((f"  {name} ({sampling_label(summary.get('pass_sampling') or {})})", "",
                 heldout_cell(v, scores)))
  sync = summary.get("sync", {})
  rows += [
      ("steps / versions", "", f"{summary['step']} / v{summary['version']}"),
      ("rollout groups trained", "", str(summary["rollout_groups_trained"])),
      ("RL time this run (rl.max_seconds)", "", f"{summary['seconds']:.0f} s"),
      (f"sync ({sync.get('format', '?')}): bytes per delta", "",
       f"{sync.get('delta_bytes_mean', 0):,.0f}"),
      ("sync: seconds per delta (median)", "",
       f"{sync.get('delta_seconds_median', sync.get('delta_seconds_mean', 0)):.3f}"),
      ("sync: keyframe bytes", "", f"{sync.get('keyframe_bytes', 0):,}"),
      ("stale groups dropped", "", str(summary.get("dropped_stale", 0))),
      ("groups rejected (trainer log: why)", "", str(summary.get("rejected", 0))),
      ("samples resumed after a worker stopped", "", str(summary.get("samples_resumed", 0))),
      ("samples a verifier raised on (worker logs: why)", "",
       str(summary.get("samples_score_errors", 0))),
  ]
  if "filtered" in summary:
    rows.append(("all-equal-reward groups left out / filled", "",
                 f"{summary['filtered']} / {summary['filled']}"))
  width = max(len(r[0]) for r in rows)
  return "\n".join(f"{a:<{width}}  {b:>10}  {c:>10}" for a, b, c in rows)


def finished_summary(workdir: str, steps: int) -> dict[str, Any] | None:
  """The summary.json of a run in `workdir` that trained all `steps` (rl.steps) already and
  was not stopped in its final evaluation, or None: a rerun of a finished run has nothing to
  train and says so rather than starting the server, trainer and workers to evaluate and
  export the same weights again."""
  path = os.path.join(workdir, "summary.json")
  try:
    with open(path) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  if (not isinstance(summary, dict) or int(summary.get("step", -1)) < steps
      or summary.get("stopped")):
    return None
  return summary


def check_warm_start(config, workdir: str) -> str:
  """The warm start's folder (<workdir>/sft); ValueError naming --workdir when the one there
  was begun with another `sft` block (so is the RL run after it)."""
  sft_dir = os.path.join(os.path.abspath(workdir), "sft")
  config.sft.export.hf = True  # RL starts from the export
  changes = run_config_changes(sft_dir, config.sft)
  if changes:
    from rlax_ps.train.rl_checks import resumed_metadata
    rl_dir, saved = resumed_metadata(config, workdir)
    then = (f"delete {sft_dir} to train it anew" if saved is None else
            f"delete {sft_dir}, {rl_dir} and {os.path.join(os.path.abspath(workdir), 'ps')} "
            f"to train it and the RL run after it anew")
    raise ValueError(f"--workdir: the warm start in {sft_dir} was begun with another `sft` "
                     f"config ({'; '.join(changes[:4])}{'; ...' if len(changes) > 4 else ''}); "
                     f"use another --workdir, or {then}")
  return sft_dir


def warm_start(config, workdir: str, progress: bool = True,
               check_stop: Callable[[], None] | None = None) -> str:
  """The HF checkpoint RL starts from: config.init_from_hf, else the export of the `sft`
  block trained in <workdir>/sft (reused when a finished one is there, resumed when begun;
  `progress`: its progress bar; `check_stop`: polled while it trains, its exception stops
  it). ValueError naming --workdir when the one there was begun with another `sft` block."""
  if config.init_from_hf:
    return config.init_from_hf
  sft_dir = check_warm_start(config, workdir)
  hf = os.path.join(sft_dir, "hf")
  if os.path.exists(os.path.join(sft_dir, "summary.json")) and os.path.exists(
      os.path.join(hf, "config.json")):
    print(f"warm start: reusing {hf}", flush=True)
    return hf
  print(f"warm start: supervised training in {sft_dir}", flush=True)
  child = multiprocessing.get_context("spawn").Process(
      target=_sft, args=(config.sft, sft_dir, os.getpid(), progress), name="sft")
  child.start()
  try:
    while child.is_alive():
      child.join(0.5)
      if check_stop is not None:
        check_stop()
  finally:  # stopped meanwhile (Ctrl-C, SIGTERM): the warm start stops too
    if child.is_alive():
      child.terminate()
      child.join()
  if child.exitcode in (128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGHUP):
    raise ChildFailed(f"sft (the warm start) was stopped by "
                      f"{signal.Signals(child.exitcode - 128).name}; the step it reached is "
                      f"checkpointed in {sft_dir}: a rerun resumes it", child.exitcode)
  if child.exitcode != 0:
    raise ChildFailed(f"sft (the warm start) exited with status {child.exitcode}; its "
                      f"output is above")
  return hf


def _sft(config, workdir: str, parent_pid: int, progress: bool = True) -> None:
  """The warm start's process: `rlax-ps sft` on the config's `sft` block, stopped with its
  supervisor."""
  stop_with_parent(parent_pid)
  from absl import logging

  from rlax_ps.compile_cache import enable_compile_cache
  from rlax_ps.train.sft import train_and_evaluate
  logging.set_verbosity(logging.WARNING)
  enable_compile_cache()
  # Ctrl-C reaches it too: the step reached is checkpointed, and the next run resumes it.
  summary = train_and_evaluate(config, workdir, progress=progress, stop_on_signals=True)
  if summary.get("stopped"):  # not finished: no export for RL to start from
    sys.exit(128 + summary["stopped"])
