"""The gRPC parameter server: weights, prompt leases and rollouts behind one authenticated service.

`ParamServer(config).start()` serves on `config.host:config.port` (port 0 picks
a free one) with token auth, optional TLS, health checking and reflection, and with
`metrics_port` Prometheus metrics (param_server.metrics).
Every handler validates its request; a rejection is logged, answered with a
status naming the field, and changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
import time
import uuid
from concurrent import futures
from typing import Callable

import grpc
from absl import logging
from google.protobuf import message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from param_server import auth, errors, pull_wire
from param_server.durable import write_durably
from param_server.keepalive import DEAD_AFTER_S, server_options
from param_server.protos import param_server_pb2 as pb
from param_server.protos import param_server_pb2_grpc as pb_grpc
from param_server.queues import PromptRolloutQueues, QueueLimits, check_id
from param_server.wal import WriteAheadLog
from param_server.weights import WeightLimits, WeightStore
from rlax_ps.config_files import user_path
from rlax_ps.dataclass_flags import setting
from rlax_ps.folder_lock import FolderLock

SERVICE_NAME = "rlax_ps.v1.ParamServer"
# Room for the fields around a chunk's bytes in one message.
MESSAGE_OVERHEAD = 64 << 10
RELAY_PULLS = 8  # relays' fetches on slots of their own (at most; relay_pulls), past max_pulls
TAKE_WAITS = 2  # trainer takes waiting at once (one trainer; a restarted one's old call)
MIN_THREADS = 6  # handler threads: 2 for short calls, 2 takes, a relay's fetch, a worker's
MAX_WORKERS = 65536  # workers and relays known at once (each registration or new id one)
MAX_LISTED_WORKERS = 4096  # listed in GetStats, the most recently heard first
MAX_WORKER_METADATA = 16 << 10  # bytes of a registration's metadata (keys and values)


def thread_budget(threads: int) -> dict[str, int]:
  """How `threads` handler threads are shared out: `reserved` ones that no long call holds
  (heartbeats, submissions, renewals always find one), the trainer's takes, relays' fetches,
  and the rest, `workers`, that the workers' pulls, long polls and Watch streams may hold
  together (each kind's own slots add up to more than that)."""
  reserved, relay = max(2, threads // 16), max(1, min(RELAY_PULLS, threads // 16))
  return {"reserved": reserved, "takes": TAKE_WAITS, "relay_pulls": relay,
          "workers": threads - reserved - TAKE_WAITS - relay}


def message_limit(config: "ServerConfig") -> int:
  """The largest gRPC message the server sends or takes (told to workers on registering)."""
  return max(config.max_chunk_bytes, config.chunk_bytes, config.max_message_bytes) + MESSAGE_OVERHEAD


@dataclasses.dataclass
class ServerConfig:
  """Everything `rlax-ps serve` can set; each field is also a flag of the same name."""
  storage_dir: str = setting("runs/param_server", "folder for weights, the write-ahead log and tokens")
  host: str = setting("127.0.0.1", "interface to listen on (0.0.0.0 for all)")
  port: int = setting(0, "port to listen on; 0 picks a free one")
  chunk_bytes: int = setting(4 << 20, "bytes per stored array chunk (read and cached whole)")
  pull_message_bytes: int = setting(
      256 << 10, "bytes per Pull message: a pull cut off resumes after the last whole one, so "
      "a link that drops every few MiB still carries a keyframe")
  max_chunk_bytes: int = setting(4 << 20, "largest Publish chunk accepted")
  max_message_bytes: int = setting(16 << 20, "gRPC message size limit for all other messages")
  max_publish_bytes: int = setting(64 << 30, "largest publication (one Update) accepted")
  delta_history: int = setting(4, "deltas kept before the newest keyframe, for workers that lag")
  verify_keyframes: bool = setting(True, "decode each published keyframe to check its checksums")
  compact_in_background: bool = setting(True, "compact the delta chain in a background thread")
  cache_bytes: int = setting(32 << 20, "recently read chunks kept in memory, shared by concurrent pulls")
  heartbeat_interval_s: float = setting(10.0, "heartbeat period asked of workers; 3 missed = not alive")
  silent_worker_heartbeats: float = setting(
      6.0, "a worker silent this many heartbeat periods (killed, or cut off) loses its leases "
      "at once: their prompts go back to the queue with the samples its renewals carried, "
      "long before the leases' deadlines; 0 = only at the deadlines")
  reap_interval_s: float = setting(0.25, "how often expired leases and unacked takes are returned")
  threads: int = setting(128, "handler threads, at least 6: pulls take at most max_pulls, "
                         "long polls for prompts a quarter, Watch streams an eighth, and all "
                         "three together leave the trainer's takes 2, relays' fetches "
                         "threads/16 (1 to 8) and heartbeats and submissions threads/16 "
                         "(at least 2)")
  max_pulls: int = setting(0, "pulls served at once (each holds a handler thread for its whole "
                           "transfer: minutes on a slow link); 0 = half of threads. One more "
                           "is told to come back (its client waits for a turn), so leases, "
                           "submissions and heartbeats always find a thread")
  dead_after_s: float = setting(DEAD_AFTER_S, "a client whose connection answers no ping for "
                                "this long is dropped (a vanished worker's streams end)")
  wal_fsync: bool = setting(True, "fsync the write-ahead log before acknowledging a change")
  tls_cert: str = setting("", "PEM server certificate; with tls_key, serve TLS")
  tls_key: str = setting("", "PEM server private key")
  trainer_token: str = setting("", "trainer bearer token; else $RLAX_PS_TRAINER_TOKEN, else the "
                               "one in <storage_dir>/tokens.json, else generated there (a given one "
                               "is not kept there)")
  worker_token: str = setting("", "worker bearer token; else $RLAX_PS_WORKER_TOKEN, else the "
                              "one in <storage_dir>/tokens.json, else generated there (a given one "
                              "is not kept there)")
  viewer_token: str = setting("", "viewer bearer token; else $RLAX_PS_VIEWER_TOKEN, else the "
                              "one in <storage_dir>/tokens.json, else generated there (a given one "
                              "is not kept there)")
  max_lease_prompts: int = setting(1024, "most prompts in one lease")
  max_lease_deadline_s: float = setting(3600.0, "longest lease or ack deadline")
  max_wait_s: float = setting(60.0, "longest long-poll wait for LeasePrompts and TakeRollouts")
  metrics_port: int = setting(-1, "serve Prometheus metrics (no token) on http://host:PORT/"
                              "metrics; 0 picks a free port, -1 = off")

  def __post_init__(self):
    self.storage_dir = user_path(self.storage_dir, "ServerConfig.storage_dir")
    if not (self.silent_worker_heartbeats == 0 or self.silent_worker_heartbeats >= 2):
      raise ValueError(f"ServerConfig.silent_worker_heartbeats: expected 0 (off) or >= 2, got "
                       f"{self.silent_worker_heartbeats}")
    if not 0 <= self.port <= 65535:  # gRPC would take it modulo 65536
      raise ValueError(f"ServerConfig.port: expected a port 0-65535 (0 picks a free one), got "
                       f"{self.port}")
    if not -1 <= self.metrics_port <= 65535:
      raise ValueError(f"ServerConfig.metrics_port: expected -1 (off) or a port 0-65535, got "
                       f"{self.metrics_port}")
    for name in ("chunk_bytes", "pull_message_bytes", "max_chunk_bytes", "max_publish_bytes",
                 "threads", "max_lease_prompts"):  # (0 threads raised deep in grpc; a 0 chunk hung)
      if not getattr(self, name) >= 1:
        raise ValueError(f"ServerConfig.{name}: expected a positive int, got "
                         f"{getattr(self, name)}")
    if self.threads < MIN_THREADS:  # one Watch held the only thread: every call waited on it
      raise ValueError(f"ServerConfig.threads: expected at least {MIN_THREADS} (pulls, long "
                       f"polls, takes and Watch streams each hold one; short calls need their "
                       f"own), got {self.threads}")
    if not (self.max_pulls == 0 or 1 <= self.max_pulls < self.threads):
      raise ValueError(f"ServerConfig.max_pulls: expected 0 (half of threads) or from 1 to "
                       f"threads - 1 = {self.threads - 1} (a thread left for the other "
                       f"calls), got {self.max_pulls}")
    if not self.max_message_bytes >= 64 << 10:  # a lease or a stats reply must fit
      raise ValueError(f"ServerConfig.max_message_bytes: expected at least {64 << 10}, got "
                       f"{self.max_message_bytes}")
    for name in ("delta_history", "cache_bytes"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"ServerConfig.{name}: expected >= 0, got {getattr(self, name)}")
    for name in ("heartbeat_interval_s", "reap_interval_s", "max_lease_deadline_s"):
      if not 0 < getattr(self, name) < math.inf:  # (a 0 s reaper spun a core)
        raise ValueError(f"ServerConfig.{name}: expected seconds > 0, got "
                         f"{getattr(self, name)}")
    if not 0 <= self.max_wait_s < math.inf:
      raise ValueError(f"ServerConfig.max_wait_s: expected seconds >= 0, got {self.max_wait_s}")
    if not (math.isfinite(self.dead_after_s) and self.dead_after_s >= 1):
      raise ValueError(f"ServerConfig.dead_after_s: expected a number of seconds >= 1, got "
                       f"{self.dead_after_s}")


RUN_FILE = "RUN"
STORE_FILE = "STORE"


def store_id_of(storage_dir: str) -> str:
  """The id of `storage_dir`, made (at random) and kept in <storage_dir>/STORE the first
  time a server uses the folder: a trainer that meets another id at its server's address
  knows the server lost what it held (the folder lost or replaced)."""
  path = os.path.join(storage_dir, STORE_FILE)
  try:
    with open(path) as f:
      kept = f.read().strip()
  except FileNotFoundError:
    kept = ""
  if kept:
    return kept
  store = uuid.uuid4().hex
  write_durably(path, store + "\n")
  return store


def _read_run(storage_dir: str) -> str:
  try:
    with open(os.path.join(storage_dir, RUN_FILE)) as f:
      return f.read().strip()
  except FileNotFoundError:
    return ""


def _finite(field: str, value: float, lo: float = 0.0) -> None:
  if not math.isfinite(value) or value < lo:
    raise errors.InvalidArgument(field, f"expected a finite number >= {lo}, got {value}")


MAX_RUN_CHARS = 128


def _check_run_id(run: str) -> None:
  """A run id is kept in <storage_dir>/RUN and compared with later ones: printable, without
  surrounding spaces (which that file would not keep), at most MAX_RUN_CHARS."""
  if len(run) > MAX_RUN_CHARS or not run.isprintable() or run != run.strip():
    raise errors.InvalidArgument(
        "run", f"expected at most {MAX_RUN_CHARS} printable characters without surrounding "
        f"spaces, got {run[:MAX_RUN_CHARS]!r}{'...' if len(run) > MAX_RUN_CHARS else ''}")


@dataclasses.dataclass(frozen=True)
class MalformedRequest:
  """Bytes that do not parse as the request's message type, passed to the handler to be
  answered INVALID_ARGUMENT (gRPC would answer INTERNAL, as if the server had failed)."""
  type_name: str
  error: str


def _parser(message_type):
  """The request deserializer of `message_type`: a message, or a MalformedRequest."""
  def parse(data: bytes):
    try:
      return message_type.FromString(data)
    except message.DecodeError as e:
      return MalformedRequest(message_type.DESCRIPTOR.full_name, str(e))
  return parse


def _well_formed(request, field: str = "request"):
  """The request, unless it is a MalformedRequest (InvalidArgument naming `field`)."""
  if isinstance(request, MalformedRequest):
    raise errors.InvalidArgument(field, f"expected a {request.type_name} message, got bytes "
                                 f"that do not parse as one ({request.error})")
  return request


class _Rejections:
  """Turns RequestErrors into logged gRPC statuses; counts them for stats. A stream refused
  while every slot of its kind is taken (errors.Busy) is flow control, not a rejection:
  logged at most every 30 s (a fleet fetching a keyframe is refused hundreds of times), and
  pulls so refused counted apart (`busy`)."""

  def __init__(self):
    self.count = 0
    self.busy = 0
    self._lock = threading.Lock()

  def bump(self) -> None:
    with self._lock:
      self.count += 1

  def abort(self, context, method: str, err: errors.RequestError):
    said = _cut(str(err))
    if isinstance(err, errors.Busy):
      if isinstance(err, errors.PullsBusy):
        with self._lock:
          self.busy += 1
      logging.log_every_n_seconds(logging.INFO, "%s: %s", 30, method, said)
    else:
      self.bump()
      logging.warning("%s rejected (%s): %s", method, err.code.name, said)
    context.abort(err.code, said)


_MAX_DETAILS = 2000  # characters: a status message echoing a 20 kB id exceeded gRPC's
# metadata limit, and the client got RESOURCE_EXHAUSTED "Stream removed" instead


def _cut(message: str) -> str:
  """A status message short enough for gRPC's metadata, its start (the field) kept."""
  if len(message) <= _MAX_DETAILS:
    return message
  return f"{message[:_MAX_DETAILS - 40]}... ({len(message):,} characters in all)"


def storage_failed(storage_dir: str, e: OSError) -> errors.Unavailable:
  """The status of a call the storage folder failed (full, read-only, gone): UNAVAILABLE, so
  that clients keep their data and retry while the operator mends it."""
  return errors.Unavailable("storage_dir", f"{storage_dir}: storage failed ({e.strerror or e}"
                            f"{': ' + str(e.filename) if e.filename else ''}); this call failed "
                            f"and the server keeps what it acknowledged before; free "
                            f"space or mend the folder (clients retry)")


def _unary(method):
  @functools.wraps(method)
  def wrapper(self, request, context):
    try:
      return method(self, _well_formed(request), context)
    except errors.RequestError as e:
      self._rejections.abort(context, method.__name__, e)
    except OSError as e:
      self._rejections.abort(context, method.__name__,
                             storage_failed(self.config.storage_dir, e))
  return wrapper


def _streaming(method):
  @functools.wraps(method)
  def wrapper(self, request, context):
    with self._lock:
      self.streams_open += 1
    try:
      yield from method(self, _well_formed(request), context)
    except errors.RequestError as e:
      self._rejections.abort(context, method.__name__, e)
    except OSError as e:
      self._rejections.abort(context, method.__name__,
                             storage_failed(self.config.storage_dir, e))
    finally:
      with self._lock:
        self.streams_open -= 1
  return wrapper


@dataclasses.dataclass(frozen=True)
class PullSource:
  """One update of a pull: its header and `read(start, stop)`, its bytes [start, stop)."""
  version: int
  base_version: int  # -1: a keyframe
  nbytes: int
  read: Callable[[int, int], object]


@dataclasses.dataclass
class _Worker:
  worker_id: str
  name: str
  metadata: dict
  version: int = -1
  tokens_per_s: float = 0.0
  last_seen: float = dataclasses.field(default_factory=time.monotonic)
  kind: str = ""  # "relay": a weight relay (HeartbeatRequest.kind)
  time: pb.WorkerTime | None = None  # where its time went, as its last heartbeat said
  heard: bool = True  # False: known only as the holder of leases recovered from the log


class ParamServerServicer(pb_grpc.ParamServerServicer):
  """The RPC handlers; state lives in a WeightStore and a PromptRolloutQueues."""

  def __init__(self, config: ServerConfig, weights: WeightStore, queues: PromptRolloutQueues):
    self.config = config
    self.weights = weights
    self.queues = queues
    self._rejections = _Rejections()
    # The holders of leases recovered from the log, as if heard from now: one that never
    # comes back falls silent, and its leases expire then, not at their deadlines.
    self._workers: dict[str, _Worker] = {
        wid: _Worker(wid, wid, {}, heard=False)
        for wid in (queues.leases_by_worker() if queues is not None else ())}
    self._lock = threading.Lock()
    self.bytes_served = 0
    self.pulls_served = 0
    self.max_pulls = config.max_pulls or max(1, config.threads // 2)
    self._pull_slots = threading.BoundedSemaphore(self.max_pulls)
    # A relay's fetch (PullRequest.relay_id) serves its whole fleet: it does not queue for a
    # worker's slot behind pulls crawling over slow links.
    budget = thread_budget(config.threads)
    self._relay_pull_slots = threading.BoundedSemaphore(budget["relay_pulls"])
    # Long polls (a lease or take waiting for work) waiting at once: each holds a thread; an
    # idle fleet's would hold them all. Past this many, one answers at once (nothing new) and
    # its client waits out the rest of its wait_s itself.
    self.max_waits = max(1, config.threads // 4)
    self._wait_slots = threading.BoundedSemaphore(self.max_waits)
    # The trainer's take waits apart: an idle fleet's leases holding every wait slot
    # answered each take at once, and its group reached the trainer a wait_s late.
    self._take_slots = threading.BoundedSemaphore(TAKE_WAITS)
    # Watch streams each hold a thread for as long as their client keeps them (relays
    # follow the server so): unbounded, any token could take every thread.
    self.max_watches = max(1, config.threads // 8)
    self._watch_slots = threading.BoundedSemaphore(self.max_watches)
    # The workers' long calls above (pulls, long polls, Watch streams) hold together at most
    # the threads the takes, relays' fetches and short calls leave (thread_budget): each
    # kind's own slots add up to more than `threads` below about 120 of them.
    self.reserved_threads = budget["reserved"]
    self._held_slots = threading.BoundedSemaphore(budget["workers"])
    self.streams_open = 0  # Pull and Watch streams being served
    self._run_lock = threading.Lock()
    self.run = _read_run(config.storage_dir)  # the run whose versions are held ("": none said)
    self.store_id = store_id_of(config.storage_dir)
    self.started = time.monotonic()
    self.stopping = threading.Event()
    self._version_changed = weights.changed  # notified as _latest() may change

  # ------------------------------------------------------------ weights

  def _latest(self) -> int:
    """The newest version a pull gets now (what Watch announces)."""
    return self.weights.latest

  def _version_info(self) -> pb.VersionInfo:
    return pb.VersionInfo(**self.weights.info(), store_id=self.store_id)

  @_unary
  def Publish(self, request_iterator, context):
    writer, run = None, ""
    try:
      for i, chunk in enumerate(request_iterator):
        chunk = _well_formed(chunk, f"chunks[{i}]")
        if writer is None:
          run = chunk.run
          _check_run_id(run)
          self._check_run(run)
          writer = self.weights.begin_publish(chunk.total_bytes)
        elif chunk.total_bytes not in (0, writer.total):
          raise errors.InvalidArgument(
              f"chunks[{i}].total_bytes", f"expected 0 or {writer.total} after the first chunk, got {chunk.total_bytes}")
        writer.write(chunk.offset, chunk.data)
      if writer is None:
        raise errors.InvalidArgument("chunks", "expected at least one chunk, got none")
      if not context.is_active():
        writer.abort()
        return pb.PublishReply()
      with self._run_lock:  # another run's publication cannot slip in between
        self._check_run(run)
        blob, duplicate = self.weights.commit(writer)
        if run and run != self.run:
          self._keep_run(run)
      writer = None
      logging.info("published v%d (%s, %d bytes)%s", blob.version,
                   "keyframe" if blob.is_keyframe else f"delta on v{blob.base_version}", blob.nbytes,
                   " again (duplicate)" if duplicate else "")
      return pb.PublishReply(info=self._version_info(), duplicate=duplicate)
    finally:
      if writer is not None:
        writer.abort()

  def _check_run(self, run: str) -> None:
    """FailedPrecondition when `run` is not the run whose versions the server holds."""
    if run and self.run and run != self.run and self.weights.latest >= 0:
      raise errors.FailedPrecondition(
          "run", f"this server holds the versions of another run ({self.run}, up to "
          f"v{self.weights.latest}) and its prompts and rollouts; a new run needs a server "
          f"of its own (a fresh --storage_dir), or resume that run's --workdir")

  def _keep_run(self, run: str) -> None:
    """Record the run whose versions the server holds, in <storage_dir>/RUN."""
    write_durably(os.path.join(self.config.storage_dir, RUN_FILE), run + "\n")
    self.run = run

  @_unary
  def GetLatest(self, request, context):
    return self._version_info()

  def _pull_plan(self, have: int | None, context) -> tuple[list["PullSource"], Callable[[], None], int]:
    """(the updates that bring `have` to the latest, what releases them, the version they
    reach): stored blobs, pinned until `release` runs."""
    plan = self.weights.plan(have)
    once = threading.Lock()  # gRPC's cancel callback and the stream's end may race to it

    def release():
      if once.acquire(blocking=False):  # (never released: the first call alone unpins)
        self.weights.release(plan)

    return [self._stored(b) for b in plan], release, plan[-1].version if plan else self.weights.latest

  def _stored(self, blob) -> "PullSource":
    array = None

    def read(start: int, stop: int):
      nonlocal array
      if array is None:
        array = self.weights.open_array(blob)
      return self.weights.read_range(blob, array, start, stop)

    return PullSource(blob.version, -1 if blob.base_version is None else blob.base_version,
                      blob.nbytes, read)

  @contextlib.contextmanager
  def _wait_slot(self, wait_s: float, slots: threading.BoundedSemaphore | None = None):
    """`wait_s` while a long-poll slot (of `slots`, default the workers') is held; 0
    (answered at once) when all are taken."""
    slots = self._wait_slots if slots is None else slots
    if wait_s <= 0 or not self._hold(slots):
      yield 0.0
      return
    try:
      yield wait_s
    finally:
      self._let_go(slots)

  def _hold(self, slots: threading.BoundedSemaphore) -> bool:
    """One of `slots` (and, for a worker's kind of call, one of the threads those may hold
    together), or none."""
    if not slots.acquire(blocking=False):
      return False
    if self._apart(slots) or self._held_slots.acquire(blocking=False):
      return True
    slots.release()
    return False

  def _let_go(self, slots: threading.BoundedSemaphore) -> None:
    if not self._apart(slots):
      self._held_slots.release()
    slots.release()

  def _apart(self, slots: threading.BoundedSemaphore) -> bool:
    """The trainer's takes and relays' fetches: threads of their own, not the workers'."""
    return slots is self._take_slots or slots is self._relay_pull_slots

  @_streaming
  def Pull(self, request, context):
    have = request.have_version if request.HasField("have_version") else None
    if have is not None and have < -1:
      raise errors.InvalidArgument("have_version", f"expected >= -1 or absent, got {have}")
    if request.resume_offset < 0:
      raise errors.InvalidArgument("resume_offset", f"expected >= 0, got {request.resume_offset}")
    # A relay's fetch takes a relay slot, else a worker's like any pull.
    if request.relay_id and self._hold(self._relay_pull_slots):
      slots = self._relay_pull_slots
    elif self._hold(self._pull_slots):
      slots = self._pull_slots
    else:
      raise errors.PullsBusy(f"{self.max_pulls} pulls under way (max_pulls), or every thread "
                             f"long calls may hold; come back shortly")
    try:
      yield from self._serve_pull(have, request, context)
    finally:
      self._let_go(slots)

  def _serve_pull(self, have: int | None, request, context):
    plan, release, latest = self._pull_plan(None if have == -1 else have, context)
    context.add_callback(release)
    try:
      with self._lock:
        self.pulls_served += 1
      if not plan:
        yield pull_wire.encode_pull_chunk(b"", update_count=0, version=latest)
        return
      start = 0
      first = plan[0]
      if (request.resume_offset and request.resume_version == first.version
          and request.resume_base_version == first.base_version
          and request.resume_offset < first.nbytes):
        start = request.resume_offset
      # Whole stored chunks are read (a cache shares them between pulls), each sent in
      # messages of pull_message_bytes: a client keeps what came in whole messages.
      step, message = self.config.chunk_bytes, self.config.pull_message_bytes
      for index, update in enumerate(plan):
        offset = start if index == 0 else 0
        while offset < update.nbytes:
          base = offset - offset % step
          end = min(base + step, update.nbytes)
          data = memoryview(update.read(base, end)).cast("B")
          while offset < end:
            if not context.is_active() or self.stopping.is_set():
              return
            cut = min(offset + message, end)
            yield pull_wire.encode_pull_chunk(data[offset - base:cut - base], update_index=index,
                                              update_count=len(plan), version=update.version,
                                              base_version=update.base_version,
                                              update_bytes=update.nbytes, offset=offset)
            with self._lock:
              self.bytes_served += cut - offset
            offset = cut
    finally:
      release()

  @_streaming
  def Watch(self, request, context):
    if request.after_version < -1:
      raise errors.InvalidArgument("after_version", f"expected >= -1, got {request.after_version}")
    if not self._hold(self._watch_slots):
      raise errors.Busy("watches", f"{self.max_watches} Watch streams open (threads // 8), "
                        f"or every thread long calls may hold; come back shortly")
    try:
      last = request.after_version
      changed = self._version_changed
      while context.is_active() and not self.stopping.is_set():
        with changed:
          if self._latest() <= last:
            changed.wait(timeout=0.5)
          latest = self._latest()
        if latest > last:
          last = latest
          yield self._version_info()
    finally:
      self._let_go(self._watch_slots)

  # ------------------------------------------------------------ prompts

  @_unary
  def EnqueuePrompts(self, request, context):
    return self.queues.enqueue(list(request.prompts))

  @_unary
  def LeasePrompts(self, request, context):
    _finite("deadline_s", request.deadline_s)
    _finite("wait_s", request.wait_s)
    self._touch(request.worker_id)
    with self._wait_slot(request.wait_s) as wait_s:
      lease = self.queues.lease(request.worker_id, request.n, request.deadline_s, wait_s,
                                max_bytes=self.config.max_message_bytes // 2)
    self._touch(request.worker_id)  # a lease made after a long poll is not a silent worker's
    lease.latest_version = self._latest()
    lease.staleness_floor = self.queues.staleness_floor
    return lease

  @_unary
  def RenewLease(self, request, context):
    _finite("deadline_s", request.deadline_s)
    self._touch(request.worker_id)
    lease = self.queues.renew(request.lease_id, request.worker_id, request.deadline_s,
                              list(request.partial))
    lease.latest_version = self._latest()
    lease.staleness_floor = self.queues.staleness_floor
    return lease

  @_unary
  def CompleteLease(self, request, context):
    return pb.CompleteLeaseReply(prompts_answered=self.queues.complete(request.lease_id, request.worker_id))

  @_unary
  def ReleaseLease(self, request, context):
    return pb.ReleaseLeaseReply(
        returned=self.queues.release(request.lease_id, request.worker_id, list(request.prompt_ids),
                                     list(request.partial)))

  # ------------------------------------------------------------ rollouts

  @_unary
  def SubmitRollouts(self, request, context):
    if not request.HasField("group"):
      raise errors.InvalidArgument("group", "expected a rollout group, got none")
    self._touch(request.worker_id)
    reply = self.queues.submit(request.lease_id, request.worker_id, request.group)
    reply.latest_version = self._latest()
    reply.staleness_floor = self.queues.staleness_floor
    return reply

  @_unary
  def TakeRollouts(self, request, context):
    _finite("wait_s", request.wait_s)
    _finite("ack_deadline_s", request.ack_deadline_s)
    with self._wait_slot(request.wait_s, self._take_slots) as wait_s:
      reply = self.queues.take(request.min_version, request.max_groups, wait_s,
                               request.ack_deadline_s,
                               max_bytes=self.config.max_message_bytes // 2,
                               requeue_unacked=request.requeue_unacked)
    reply.store_id = self.store_id
    return reply

  @_unary
  def AckRollouts(self, request, context):
    return pb.AckRolloutsReply(acked=self.queues.ack(request.take_id))

  # ------------------------------------------------------------ workers

  @_unary
  def RegisterWorker(self, request, context):
    if not request.name or len(request.name) > 128:
      raise errors.InvalidArgument("name", f"expected 1 to 128 characters, got {len(request.name)}")
    if not request.name.isprintable():  # (it begins the worker's id)
      raise errors.InvalidArgument("name", f"expected printable characters, got {request.name!r}")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in request.metadata.items())
    if size > MAX_WORKER_METADATA:
      raise errors.InvalidArgument("metadata", f"expected at most {MAX_WORKER_METADATA} bytes of "
                                   f"keys and values, got {size}")
    worker_id = f"{request.name}-{uuid.uuid4().hex[:8]}"
    with self._lock:
      self._forget_silent_workers()
      self._room_for_a_worker()
      self._workers[worker_id] = _Worker(worker_id, request.name, dict(request.metadata))
    logging.info("worker %s registered", worker_id)
    return pb.RegisterWorkerReply(worker_id=worker_id,
                                  heartbeat_interval_s=self.config.heartbeat_interval_s,
                                  max_request_bytes=message_limit(self.config))

  @_unary
  def Heartbeat(self, request, context):
    if not request.worker_id:
      raise errors.InvalidArgument("worker_id", "expected a worker id, got ''")
    check_id("worker_id", request.worker_id)
    if request.version < -1:
      raise errors.InvalidArgument("version", f"expected >= -1, got {request.version}")
    _finite("tokens_per_s", request.tokens_per_s)
    if request.kind not in ("", "relay"):
      raise errors.InvalidArgument("kind", f"expected '' (a worker) or 'relay', got {request.kind!r}")
    for f in pb.WorkerTime.DESCRIPTOR.fields:
      _finite(f"time.{f.name}", getattr(request.time, f.name))
    with self._lock:
      self._forget_silent_workers()
      if request.leaving:  # stopped cleanly: not counted alive for its last heartbeats' span
        self._workers.pop(request.worker_id, None)
        return self._heartbeat_reply()
      # Upsert: workers registered before a server restart keep their id (a relay's is its own).
      worker = self._workers.get(request.worker_id)
      if worker is None:
        self._room_for_a_worker()
        worker = self._workers[request.worker_id] = _Worker(request.worker_id,
                                                            request.worker_id, {})
      worker.version = request.version
      worker.tokens_per_s = request.tokens_per_s
      worker.last_seen = time.monotonic()
      worker.kind, worker.heard = request.kind, True
      if request.HasField("time"):
        worker.time = request.time
    return self._heartbeat_reply()

  def _heartbeat_reply(self) -> pb.HeartbeatReply:
    """The latest version and the trainer's staleness floor, as the server answers."""
    return pb.HeartbeatReply(latest_version=self._latest(),
                             staleness_floor=self.queues.staleness_floor)

  def _touch(self, worker_id: str) -> None:
    """A registered worker's lease call is a sign of life, as a heartbeat is."""
    with self._lock:
      worker = self._workers.get(worker_id)
      if worker is not None:
        worker.last_seen, worker.heard = time.monotonic(), True

  def silent_workers(self) -> list[str]:
    """Workers heard from once but silent for `silent_worker_heartbeats` periods."""
    if not self.config.silent_worker_heartbeats:
      return []
    cutoff = time.monotonic() - self.config.silent_worker_heartbeats * self.config.heartbeat_interval_s
    with self._lock:
      return [w.worker_id for w in self._workers.values() if w.last_seen < cutoff]

  def _room_for_a_worker(self) -> None:
    """ResourceExhausted when MAX_WORKERS are known (under the lock): ids without end (a
    client registering in a loop) grew the server's memory and its stats past a message."""
    if len(self._workers) >= MAX_WORKERS:
      raise errors.ResourceExhausted("worker_id", f"{MAX_WORKERS} workers and relays known (those "
                                     f"silent for 30 heartbeat intervals are forgotten); a "
                                     f"worker registers once and keeps its id")

  def _forget_silent_workers(self) -> None:
    """Drops workers silent for 30 heartbeat intervals (preempted ones never say goodbye)."""
    cutoff = time.monotonic() - 30 * self.config.heartbeat_interval_s
    for wid in [w.worker_id for w in self._workers.values() if w.last_seen < cutoff]:
      del self._workers[wid]

  @_unary
  def GetStats(self, request, context):
    now = time.monotonic()
    leases = self.queues.leases_by_worker()
    alive_after = 3 * self.config.heartbeat_interval_s
    with self._lock:
      heard = sorted((w for w in self._workers.values() if w.heard),
                     key=lambda w: w.last_seen, reverse=True)
      alive = sum(now - w.last_seen <= alive_after and not w.kind for w in heard)
      known = sum(not w.kind for w in heard)
      workers = [pb.WorkerStats(worker_id=w.worker_id, name=w.name, version=w.version,
                                tokens_per_s=w.tokens_per_s, seconds_since_heartbeat=now - w.last_seen,
                                leases=leases.get(w.worker_id, 0), kind=w.kind, time=w.time)
                 for w in heard[:MAX_LISTED_WORKERS]]
      served, pulls, streams = self.bytes_served, self.pulls_served, self.streams_open
    return pb.Stats(versions=self._version_info(), **self.queues.depths(),
                    bytes_served=served, pulls_served=pulls, streams_open=streams,
                    workers_alive=alive, workers_known=known,
                    workers_unlisted=len(heard) - len(workers),
                    workers=workers, uptime_s=now - self.started, errors=self._rejections.count,
                    pulls_busy=self._rejections.busy)


def method_handlers(servicer: ParamServerServicer) -> dict[str, grpc.RpcMethodHandler]:
  """The service's handlers, as the generated code makes them, except that Pull yields
  pre-serialised bytes and a request that does not parse reaches its handler (MalformedRequest)."""
  make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
          (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
  handlers = {}
  for m in pb.DESCRIPTOR.services_by_name["ParamServer"].methods:
    request, reply = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
    serialize = (lambda b: b) if m.name == "Pull" else reply.SerializeToString
    handlers[m.name] = make[(m.client_streaming, m.server_streaming)](
        getattr(servicer, m.name), request_deserializer=_parser(request), response_serializer=serialize)
  return handlers


def grpc_server(handlers: dict[str, grpc.RpcMethodHandler], interceptor, *, threads: int,
                limit: int, host: str, port: int, tls_cert: str = "", tls_key: str = "",
                dead_after_s: float = DEAD_AFTER_S):
  """(server, health servicer, bound port): the service's `handlers` behind `interceptor`,
  with health checking and reflection, on host:port (TLS with a certificate and key), not
  started. The parameter server and a weight relay listen alike."""
  server = grpc.server(
      futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
      interceptors=[interceptor],
      # A reply may carry a request's worth twice: a take's group (submitted in a request of
      # up to `limit`) with its prompt (enqueued in another), a lease's prompt with the
      # partial samples a renewal carried; always at least one, or every take would fail.
      options=[("grpc.max_receive_message_length", limit),
               ("grpc.max_send_message_length", 2 * limit + MESSAGE_OVERHEAD),
               ("grpc.so_reuseport", 0), *server_options(dead_after_s)])
  server.add_registered_method_handlers(SERVICE_NAME, handlers)
  health_servicer = health.HealthServicer()
  health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
  reflection.enable_server_reflection(
      (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
  address = f"{host}:{port}"
  try:
    if tls_cert or tls_key:
      with open(tls_key, "rb") as f:
        key = f.read()
      with open(tls_cert, "rb") as f:
        cert = f.read()
      bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
      bound = server.add_insecure_port(address)
  except RuntimeError as e:  # gRPC: "Failed to bind to address ..."
    raise CannotListen(f"--host {host} --port {port}: cannot listen there ({e}); is another "
                       f"server on that port?") from None
  return server, health_servicer, bound


class CannotListen(RuntimeError):
  """The server's address cannot be bound (the port is taken, or the host is not ours)."""


class ParamServer:
  """A running server with a lifetime: `start()`, `stop()`; also a context manager."""

  def __init__(self, config: ServerConfig):
    self.config = config
    self.metrics_port: int | None = None  # the bound port, once serving metrics
    self._metrics = None
    os.makedirs(config.storage_dir, exist_ok=True)
    # FolderInUse: another server has it.
    self._lock = FolderLock(config.storage_dir, holder="parameter server", flag="--storage_dir")
    try:
      self._open(config)
    except BaseException:
      self._lock.release()
      raise

  def _open(self, config: ServerConfig) -> None:
    """Tokens, weights, queues (replaying the write-ahead log) and the gRPC server."""
    self.tokens = auth.load_tokens(config.storage_dir, {
        "trainer": config.trainer_token, "worker": config.worker_token, "viewer": config.viewer_token})
    self.weights = WeightStore(config.storage_dir, chunk_bytes=config.chunk_bytes, limits=WeightLimits(
        max_publish_bytes=config.max_publish_bytes, max_chunk_bytes=config.max_chunk_bytes,
        delta_history=config.delta_history, verify_keyframes=config.verify_keyframes,
        compact_in_background=config.compact_in_background, cache_bytes=config.cache_bytes))
    self.wal = WriteAheadLog(os.path.join(config.storage_dir, "queues.wal"), fsync=config.wal_fsync)
    self.queues = PromptRolloutQueues(
        self.wal, latest_version=lambda: self.weights.latest, limits=QueueLimits(
            max_lease_prompts=config.max_lease_prompts, max_lease_deadline_s=config.max_lease_deadline_s,
            max_wait_s=config.max_wait_s, max_prompt_bytes=config.max_message_bytes))
    self.servicer = ParamServerServicer(config, self.weights, self.queues)
    limit = message_limit(config)
    self._server, self._health, self.port = grpc_server(
        method_handlers(self.servicer),
        auth.TokenAuthInterceptor(self.tokens, on_denied=self.servicer._rejections.bump),
        threads=config.threads, limit=limit, host=config.host, port=config.port,
        tls_cert=config.tls_cert, tls_key=config.tls_key, dead_after_s=config.dead_after_s)
    self.address = f"{config.host}:{self.port}"
    self._reaper = threading.Thread(target=self._reap, name="reaper", daemon=True)

  def _reap(self) -> None:
    while not self.servicer.stopping.wait(self.config.reap_interval_s):
      try:
        self.queues.expire_due()
        silent = self.servicer.silent_workers()
        expired = self.queues.expire_leases_of(silent) if silent else {}
        if expired:
          logging.warning("reaper: workers %s are silent; their leases expire now (%d "
                          "prompts back in the queue)", silent, sum(expired.values()))
      except OSError as e:  # a full or failing storage folder: said, not a traceback a tick
        logging.log_every_n_seconds(logging.WARNING, "reaper: expiring leases failed: %s "
                                    "(expired leases stay open until it can log them)", 30,
                                    storage_failed(self.config.storage_dir, e))
      except Exception:
        logging.exception("reaper: expiring leases failed")

  def start(self) -> "ParamServer":
    """Serve; CannotListen (nothing left running, the storage folder free) when the metrics
    port cannot be bound."""
    if self.config.metrics_port >= 0:  # first: a port taken leaves nothing half started
      from param_server.metrics import StatsCollector, serve_metrics
      try:
        self._metrics = serve_metrics(
            StatsCollector(lambda: self.servicer.GetStats(None, None)), self.config.host,
            self.config.metrics_port)
      except BaseException:
        self.stop(grace=0)
        raise
      self.metrics_port = self._metrics.server_port
    self._server.start()
    self._reaper.start()
    for name in ("", SERVICE_NAME):
      self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
    logging.info("parameter server on %s (%s), storage %s, latest v%d", self.address,
                 "TLS" if self.config.tls_cert else "plaintext", self.config.storage_dir, self.weights.latest)
    return self

  def wait(self) -> None:
    self._server.wait_for_termination()

  def stop(self, grace: float = 1.0) -> None:
    self.servicer.stopping.set()
    self._health.enter_graceful_shutdown()
    if self._metrics is not None:
      self._metrics.shutdown()
      self._metrics.server_close()
      self._metrics = None
    self._server.stop(grace).wait()
    if self._reaper.is_alive():
      self._reaper.join()
    self.queues.close()
    self._lock.release()

  def __enter__(self) -> "ParamServer":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
