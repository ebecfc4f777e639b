"""A weight relay: a cache of the parameter server's weights for a group of workers (a zone,
a rack, a node pool), so that each version crosses the long link once, not once per worker.

The relay follows the server (Watch), pulls each new version once, streaming it into a
`WeightStore` of its own (verified, kept on disk, compacted as the server's is), and serves
`Pull`, `Watch` and `GetLatest` from there. Every other call (leases, rollouts, heartbeats,
stats) passes through to the server unchanged, the caller's token with it, so a worker
points `--address` at its relay and needs nothing else. A pull that arrives while the relay
is still fetching the version the server announced is served cut-through: the update's
bytes go on to the worker as they arrive (read back from the file they stream into), so a
worker behind a relay has a version about as soon as the relay does, however large it is;
Watch and GetLatest announce a version once it begins to arrive, so relays in tiers (a
region's, then a zone's following it) pipeline it the same way.
A stream from the server that breaks is resumed from the byte it broke at; the pulls
reading it wait (up to `max_wait_s` without progress), then fail as UNAVAILABLE, which
workers retry. Workers verify what they apply, as from the server. Given
`--address=ipv4:RELAY_IP:PORT,SERVER_IP:PORT`, a worker talks to the server directly once
its relay does not answer or cannot follow the server, and tries the relay again a minute
later (`ParamServerClient.relay_again_s`): a replaced relay gets its workers back.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import grpc
from absl import logging
from grpc_health.v1 import health_pb2

from param_server import auth, errors
from param_server.client import RELAY_DOWN, ParamServerClient, ParamServerError, RetryPolicy
from param_server.durable import write_durably
from param_server.protos import param_server_pb2 as pb
from param_server.server import (MESSAGE_OVERHEAD, MIN_THREADS, SERVICE_NAME, ParamServerServicer, PullSource,
                                 ServerConfig, grpc_server, method_handlers)
from param_server.weights import PublishWriter, WeightLimits, WeightStore
from rlax_ps.config_files import user_path
from rlax_ps.dataclass_flags import setting
from rlax_ps.folder_lock import FolderLock

# What the relay answers itself (checking the caller's token); everything else goes to the
# server, which checks it. A publication is refused: it belongs to the server.
SERVED_HERE = ("GetLatest", "Pull", "Watch")
REPORT_S = 5.0  # how often the relay tells the server the version it holds
GET_LATEST_WAIT_S = 2.0  # a version query waits this long for the server's newest to arrive
ONE_ATTEMPT = RetryPolicy(deadline_s=0.0)  # asking the server while a caller waits
# What a caller whose token the relay does not know is told (a trainer sent to a relay).
RELAY_TOKEN_HINT = ("; this is a weight relay: it serves workers and takes the server's worker "
                    "token only (a trainer's --address is the parameter server's)")
# The server refused the relay's own token: no retry mends that.
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class UpstreamRefused(Exception):
  """The relay cannot follow --address: the server refused the relay's token (or role), or
  the address is the relay's own."""


def _ips(host: str) -> set[str]:
  try:
    return {info[4][0] for info in socket.getaddrinfo(host, None)}
  except OSError:
    return set()


def names_itself(address: str, host: str, port: int) -> bool:
  """Whether the client target `address` (host:port, ipv4:/ipv6:/dns:/// ones too) is this
  relay's own listening `host`:`port` (a wildcard host: this machine's loopback or name)."""
  target = address
  for scheme in ("dns:///", "ipv4:", "ipv6:"):
    target = target.removeprefix(scheme)
  name, sep, target_port = target.rpartition(":")
  if "," in target or not sep or not target_port.isdigit() or int(target_port) != port:
    return False
  own = _ips(host)
  if own & {"0.0.0.0", "::"}:
    own = {"127.0.0.1", "::1"} | _ips(socket.gethostname())
  return bool(_ips(name.strip("[]")) & own)


@dataclasses.dataclass
class RelayConfig:
  """Everything `rlax-ps relay` can set; each field is also a flag of the same name."""
  storage_dir: str = setting("runs/relay", "folder for the relayed weights")
  host: str = setting("127.0.0.1", "interface to listen on (0.0.0.0 for all)")
  port: int = setting(0, "port to listen on; 0 picks a free one")
  chunk_bytes: int = setting(4 << 20, "bytes per stored array chunk (read and cached whole)")
  pull_message_bytes: int = setting(
      256 << 10, "bytes per Pull message: a pull cut off resumes after the last whole one")
  max_message_bytes: int = setting(16 << 20, "gRPC message size limit (passed-through calls)")
  cache_bytes: int = setting(32 << 20, "recently read chunks kept in memory, shared by pulls")
  delta_history: int = setting(4, "deltas kept before the newest keyframe, for workers that lag")
  threads: int = setting(128, "handler threads (each long poll or stream holds one); at "
                         "least 6, shared out as the server's (thread_budget)")
  max_wait_s: float = setting(60.0, "how long a pull waits for a version the relay is fetching "
                              "to begin, or for its next bytes")
  poll_s: float = setting(30.0, "how often the relay asks the server's version besides watching "
                          "it (a server restarted on an empty store is noticed then)")
  name: str = setting("", "the relay's id in the server's stats (`rlax-ps status`); default "
                      "relay@HOSTNAME:PORT")
  tls_cert: str = setting("", "PEM certificate; with tls_key, serve TLS to the workers")
  tls_key: str = setting("", "PEM private key")
  metrics_port: int = setting(-1, "serve Prometheus metrics (no token) on http://host:PORT/"
                              "metrics: the version held against the server's, bytes fetched "
                              "and served; 0 picks a free port, -1 = off")

  def __post_init__(self):
    self.storage_dir = user_path(self.storage_dir, "RelayConfig.storage_dir")
    for name in ("chunk_bytes", "pull_message_bytes", "max_message_bytes", "threads"):
      if getattr(self, name) <= 0:
        raise ValueError(f"RelayConfig.{name}: expected a positive int, got {getattr(self, name)}")
    if self.threads < MIN_THREADS:
      raise ValueError(f"RelayConfig.threads: expected at least {MIN_THREADS} (pulls, long "
                       f"polls, takes and Watch streams each hold one; short calls need their "
                       f"own), got {self.threads}")
    if not self.max_wait_s >= 0:
      raise ValueError(f"RelayConfig.max_wait_s: expected >= 0, got {self.max_wait_s}")
    if not self.poll_s > 0:
      raise ValueError(f"RelayConfig.poll_s: expected > 0, got {self.poll_s}")
    if not 0 <= self.port <= 65535:  # gRPC would take it modulo 65536
      raise ValueError(f"RelayConfig.port: expected a port 0-65535 (0 picks a free one), got "
                       f"{self.port}")
    if not -1 <= self.metrics_port <= 65535:
      raise ValueError(f"RelayConfig.metrics_port: expected -1 (off) or a port 0-65535, got "
                       f"{self.metrics_port}")


class _Arriving:
  """The update the relay is receiving from the server, readable while it arrives: pulls
  read its bytes back from the file they stream into (a descriptor of their own, so the
  file stays readable after the store takes it in)."""

  def __init__(self, writer: PublishWriter, version: int, base_version: int):
    self.writer = writer
    self.version = version
    self.base_version = base_version  # -1: a keyframe
    self.nbytes = writer.total
    self.received = 0
    self.failed = ""  # why its readers must stop, once it cannot complete
    self._changed = threading.Condition()
    self._file = open(writer.path, "rb", buffering=0)

  def write(self, offset: int, data) -> None:
    self.writer.write(offset, data)
    with self._changed:
      self.received = self.writer.received
      self._changed.notify_all()

  def fail(self, why: str) -> None:
    with self._changed:
      self.failed = why
      self._changed.notify_all()

  def source(self, context, stopping: threading.Event, patience_s: float) -> PullSource:
    """The update for a pull: `read` waits for the bytes it asks (at most `patience_s`
    without progress, while the caller is there)."""

    def read(start: int, stop: int) -> bytes:
      with self._changed:
        seen, since = self.received, time.monotonic()
        while self.received < stop and not self.failed:
          if stopping.is_set() or not context.is_active():
            raise errors.Unavailable("Pull", "the relay is stopping")
          if self.received != seen:
            seen, since = self.received, time.monotonic()
          elif time.monotonic() - since > patience_s:
            raise errors.Unavailable("Pull", f"v{self.version} from the server stalled at byte "
                                     f"{self.received} of {self.nbytes} for {patience_s:g}s")
          self._changed.wait(0.5)
        if self.failed:
          raise errors.Unavailable("Pull", self.failed)
      return os.pread(self._file.fileno(), stop - start, start)

    return PullSource(self.version, self.base_version, self.nbytes, read)


def _busy(error: Exception) -> str:
  """"watches" or "pulls" where `error` is the server's busy answer (errors.Busy) to a Watch
  or a Pull, else ""."""
  if isinstance(error, ParamServerError):
    code, details = error.code, error.details
  elif isinstance(error, grpc.RpcError):
    code, details = error.code(), error.details() or ""
  else:
    return ""
  if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
    return ""
  return next((kind for kind in ("watches", "pulls") if details.startswith(f"{kind}: busy:")), "")


def _nothing_to_release() -> None:
  """What a plan of nothing stored releases: nothing (it pinned no blob)."""


class _RelayServicer(ParamServerServicer):
  """The server's weight handlers on the relay's store; a pull or a version query first
  waits for the version the server announced (a pull only until it begins to arrive: it is
  streamed on as it comes); a publication is refused (it goes to the server)."""

  def __init__(self, config: ServerConfig, weights: WeightStore, relay: "WeightRelay"):
    super().__init__(config, weights, queues=None)
    self._relay = relay
    self._version_changed = relay._changed

  def _latest(self) -> int:
    return self._relay.announced()

  def _version_info(self) -> pb.VersionInfo:
    """The server's version info as this relay serves it: with the server's storage id (a
    relay following this one, then the server, sees one run; "" until known)."""
    info = super()._version_info()
    info.latest_version = max(info.latest_version, self._relay.announced())
    info.store_id = self._relay.upstream_store
    return info

  def Publish(self, request_iterator, context):
    self._rejections.abort(context, "Publish", errors.FailedPrecondition(
        "Publish", "this is a weight relay: publish to the parameter server it follows"))

  def GetLatest(self, request, context):
    """The server's latest (asked now: a relay behind this one asks when its pullers hold
    all it knows), once it begins to arrive here; after GET_LATEST_WAIT_S, what is held: a
    relay that cannot fetch yet (the server's pull slots full) must not hold every worker's
    version check, and the thread it took, for the caller's whole deadline."""
    self._relay.refresh()
    self._relay.wait_current(context, cut_through=True, wait_s=GET_LATEST_WAIT_S)
    return super().GetLatest(request, context)

  def _stored_plan(self, have, context):
    """The stored updates for `have`; a relay still fetching what the server holds answers
    what it cannot serve yet (nothing held, or `have` past it: pulled from the server) as
    UNAVAILABLE (RELAY_DOWN), which workers retry or take to the server, not as the
    server's verdicts NOT_FOUND or FAILED_PRECONDITION."""
    try:
      return super()._pull_plan(have, context)
    except (errors.NotFound, errors.FailedPrecondition) as e:
      if self.weights.latest >= self._relay.server_latest:
        raise
      raise errors.Unavailable("Pull", f"{RELAY_DOWN} it holds v{self.weights.latest} "
                               f"and is fetching v{self._relay.server_latest} ({e})") from None

  def _pull_plan(self, have, context):
    """What is stored, then the update arriving (when it brings the server's latest). A
    puller holding all this relay knows of may have heard of a newer version from the
    server (its heartbeat): the relay asks the server first."""
    if (-1 if have is None else have) >= self._relay.announced():
      self._relay.refresh()
    arriving = self._relay.wait_current(context, cut_through=True)
    if arriving is None or self.weights.latest >= arriving.version:
      return self._stored_plan(have, context)
    if have is not None and have >= arriving.version:
      return [], _nothing_to_release, arriving.version
    if arriving.base_version < 0:  # a keyframe: all a puller needs
      plan, release = [], _nothing_to_release
    else:  # a delta on what is stored: the stored updates up to its base first
      plan, release, latest = self._stored_plan(have, context)
      if latest >= arriving.version:  # stored meanwhile
        return plan, release, latest
    with self._lock:
      self._relay.pulls_cut_through += 1
    source = arriving.source(context, self.stopping, self._relay.config.max_wait_s)
    return plan + [source], release, arriving.version


# The long polls a relay passes on: each holds one of its threads while the server waits.
_LONG_POLLS = {"LeasePrompts": pb.LeasePromptsRequest, "TakeRollouts": pb.TakeRolloutsRequest}


def _passing(method: str, upstream: ParamServerClient, timeout_s: float, upstream_address: str,
             wait_slot=None):
  """A handler that sends a call's bytes to the server and its answer (or status) back, on
  the upstream client's route of the moment (a relay following a region's relay, then the
  server while that one is down). A long poll past the relay's slots for them (`wait_slot`,
  as the server's) is passed on with wait_s 0: its client waits out the rest."""
  def forward(request: bytes, context):
    kind = _LONG_POLLS.get(method) if wait_slot is not None else None
    if kind is None:
      return _forward(request, context)
    try:
      parsed = kind.FromString(request)
    except Exception:  # noqa: BLE001 - passed on as it is: the server names what is wrong
      return _forward(request, context)
    with wait_slot(parsed.wait_s) as allowed:
      if allowed < parsed.wait_s:
        parsed.wait_s = allowed
        request = parsed.SerializeToString()
      return _forward(request, context)

  def _forward(request: bytes, context):
    call = upstream.channel.unary_unary(f"/{SERVICE_NAME}/{method}")
    metadata = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
    remaining = context.time_remaining()
    try:
      return call(request, metadata=metadata,
                  timeout=timeout_s if remaining is None else min(remaining, timeout_s))
    except grpc.RpcError as e:
      details = e.details() or f"{method} via the relay to {upstream_address}: {e.code().name}"
      if e.code() == grpc.StatusCode.UNAVAILABLE:  # the caller may go to the server itself
        details = f"{RELAY_DOWN} {method} to {upstream_address}: {details}"
      context.abort(e.code(), details)

  return grpc.unary_unary_rpc_method_handler(forward)


class WeightRelay:
  """A running relay with a lifetime: `start()`, `stop()`; also a context manager.
  `upstream`: a worker-role client of the server, whose token the relay also asks of the
  callers of what it serves itself."""

  def __init__(self, config: RelayConfig, upstream: ParamServerClient, token: str):
    self.config = config
    self.upstream = upstream
    self.server_latest = -1  # the newest version the server announced
    # Set for good once the server holds less than the relay, or its keyframe cannot follow
    # what the relay holds (another history): the relay serves nothing it holds, and says so.
    self.diverged = ""
    # The storage id of the server whose versions the relay holds (a file of its storage
    # folder): a server of another one is another run, whatever its version numbers.
    self._store_file = os.path.join(config.storage_dir, "upstream_store")
    self.upstream_store = _read_text(self._store_file)
    self.store_changed = ""  # why: the relay serves nothing it holds again
    self.metrics_port: int | None = None  # the bound port, once serving metrics
    self._metrics = None
    self.fetches = 0  # updates pulled from the server
    self._from_keyframe = False  # the next fetch pulls a keyframe (an update was refused)
    self.bytes_fetched = 0
    self.bytes_resumed = 0  # bytes of broken streams from the server not sent again
    self.pulls_cut_through = 0  # pulls served (in part) from an update still arriving
    self._arriving: _Arriving | None = None
    # Why the server cannot be followed now ("" once it answered the relay): callers of
    # what the relay serves then get UNAVAILABLE saying so, and may go to the server.
    self.upstream_problem = "not asked yet"
    self._refreshing = threading.Lock()
    self._refreshed_at = -1.0
    self.refreshes = 0  # times a pull made the relay ask the server's version
    self._changed = threading.Condition()
    self._stopping = threading.Event()
    os.makedirs(config.storage_dir, exist_ok=True)
    # FolderInUse: another relay (or a server) has it; two would rename over each other.
    self._lock = FolderLock(config.storage_dir, holder="weight relay", flag="--storage_dir")
    try:
      limit = max(config.chunk_bytes, config.max_message_bytes) + MESSAGE_OVERHEAD
      self.weights = WeightStore(config.storage_dir, chunk_bytes=config.chunk_bytes, limits=WeightLimits(
          max_chunk_bytes=64 << 20, delta_history=config.delta_history, cache_bytes=config.cache_bytes))
      served = ServerConfig(storage_dir=config.storage_dir, chunk_bytes=config.chunk_bytes,
                            pull_message_bytes=config.pull_message_bytes,
                            max_message_bytes=config.max_message_bytes,
                            threads=config.threads)  # (half of them serve pulls at once)
      self.servicer = _RelayServicer(served, self.weights, self)
      handlers = {name: h for name, h in method_handlers(self.servicer).items()
                  if name in SERVED_HERE + ("Publish",)}
      for m in pb.DESCRIPTOR.services_by_name["ParamServer"].methods:
        if m.name not in handlers:
          handlers[m.name] = _passing(m.name, upstream, upstream.timeout_s + 120.0,
                                      upstream.address, self.servicer._wait_slot)
      self._server, self._health, self.port = grpc_server(
          handlers, auth.TokenAuthInterceptor({"worker": token}, methods=SERVED_HERE,
                                              on_denied=self.servicer._rejections.bump,
                                              unavailable=self.upstream_down,
                                              unknown_hint=RELAY_TOKEN_HINT),
          threads=config.threads, limit=limit, host=config.host, port=config.port,
          tls_cert=config.tls_cert, tls_key=config.tls_key)
    except BaseException:
      self._lock.release()
      raise
    self.address = f"{config.host}:{self.port}"
    self.relay_id = config.name or f"relay@{socket.gethostname()}:{self.port}"
    self._follower = threading.Thread(target=self._follow, name="relay-follow", daemon=True)
    self._reporter = threading.Thread(target=self._report, name="relay-report", daemon=True)

  # ------------------------------------------------------------ following the server

  def _follow(self) -> None:
    """Ask the server's version, fetch up to it, then fetch each version the server announces,
    asking again every poll_s; on a failure, log it and start again."""
    while not self._stopping.is_set():
      try:
        self._ask_and_announce()
        self._fetch()
        for info in self.upstream.watch(after_version=self.weights.latest,
                                        timeout_s=self.config.poll_s):
          self._note_store(info)  # (a watch the client carried over to a restarted server)
          self._announce(info.latest_version)
          self._fetch()
          if self._stopping.is_set():
            return
        continue
      except Exception as e:  # noqa: BLE001: the relay outlives a server restart
        if self._stopping.is_set():
          return
        busy = _busy(e)
        if busy:  # flow control: the server's Watch or pull slots all taken; no failure
          logging.log_every_n_seconds(logging.INFO, "relay: %s busy at %s (%s); asking again",
                                      60, busy, self.upstream.address, e)
          # Without a Watch stream, the server's version is asked every poll_s.
          self._stopping.wait(self.config.poll_s if busy == "watches" else 1.0)
          continue
        logging.warning("relay: following %s failed (%s); retrying", self.upstream.address, e)
      self._stopping.wait(1.0)

  def _ask_and_announce(self, retry: RetryPolicy | None = None) -> None:
    """Ask the server's latest version and announce it. What the relay held before asking
    is what the answer must not be below: a version fetched while the answer came back
    is not a server gone back (a new run)."""
    held = self.weights.latest
    self._announce(self._ask_upstream(retry), asked=True, held=held)

  def _ask_upstream(self, retry: RetryPolicy | None = None) -> int:
    """The server's latest version; notes whether the server can be followed."""
    try:
      info = self.upstream.version_info(retry)
    except ParamServerError as e:
      # Refused: nothing it holds can be trusted to be current. Unreachable: what it holds
      # is served on through the server's blip; holding nothing, it sends callers there.
      if e.code in REFUSED or (e.code == grpc.StatusCode.UNAVAILABLE and self.weights.latest < 0):
        self.upstream_problem = str(e)
      raise
    self.upstream_problem = ""
    self._note_store(info)
    return info.latest_version

  def _note_store(self, info: pb.VersionInfo) -> None:
    """The server's storage id (info.store_id): kept the first time; another one after is
    another run, whatever its version numbers say (store_changed, for good)."""
    if not info.store_id or self.store_changed:
      return
    if not self.upstream_store or (info.store_id != self.upstream_store
                                   and self.weights.latest < 0):  # holding none of another's
      write_durably(self._store_file, info.store_id)
      self.upstream_store = info.store_id
    elif info.store_id != self.upstream_store:
      logging.error("relay: the server's storage is %s, not the %s of the versions this relay "
                    "holds: another run", info.store_id, self.upstream_store)
      self.store_changed = (f"the server {self.upstream.address} keeps another run's versions "
                            f"(storage {info.store_id}, not {self.upstream_store}) than this "
                            f"relay holds: restart the relay with an empty storage_dir")

  def upstream_down(self) -> str:
    """What a caller of what the relay serves is told while the server cannot be followed
    (refused, unreachable holding nothing, or another run's: `diverged`; "" while it can):
    UNAVAILABLE, so that a worker given the server too goes there."""
    problem = self.upstream_problem or self.diverged
    if not problem:
      return ""
    return f"{RELAY_DOWN} it cannot follow its server {self.upstream.address}: {problem}"

  def _report(self) -> None:
    """Tell the server the version held, every REPORT_S, as workers do (kind "relay"): its
    stats and `rlax-ps status` list the relays and how far behind each is."""
    while not self._stopping.wait(REPORT_S):
      try:
        self.upstream.heartbeat(version=self.weights.latest, worker_id=self.relay_id,
                                kind="relay")
      except (ParamServerError, ValueError) as e:  # ValueError: its channel closed
        if self._stopping.is_set():
          return
        logging.warning("relay: reporting to %s failed (%s)", self.upstream.address, e)

  def _announce(self, latest: int, asked: bool = False, held: int | None = None) -> None:
    """The server's `latest` (`asked`: its answer to the relay's question, below the version
    `held` then (default: now) only when it went back)."""
    held = self.weights.latest if held is None else held
    with self._changed:
      if self.store_changed:  # for good: no version number makes the other run's follow on
        self.diverged = self.store_changed
      elif asked and latest < held and not self.diverged:
        # For good, as another storage is: a server gone back (an empty store, a restored
        # backup) publishes another history, whose version numbers pass this relay's later.
        logging.error("relay: the server holds v%d, older than the v%d this relay holds: "
                      "another history (an empty or restored store)", latest, held)
        self.diverged = (f"the server {self.upstream.address} holds v{latest}, older than the "
                         f"v{held} this relay holds (a new run, or a store restored from a "
                         f"backup): restart the relay with an empty storage_dir")
      if not self.diverged:  # (an answer asked before a version Watch announced since can
        # come after it; a server gone back below that is met by the fetch: nothing newer)
        self.server_latest = max(self.server_latest, latest)
      self._changed.notify_all()

  def _fetch(self) -> None:
    """Bring the store up to the server's latest, one update at a time, each streamed from
    the server into a publication of the store (verified as the server verifies it); an
    update begun by a broken stream is resumed where it broke."""
    while (self.weights.latest < self.server_latest and not self.diverged
           and not self._stopping.is_set()):
      have, arriving = self.weights.latest, self._arriving
      resume = None
      if arriving is not None and arriving.received:
        resume = (arriving.version, arriving.base_version, arriving.received)
      start = None if have < 0 or self._from_keyframe else have
      call = self.upstream.stream_pull(start, resume=resume, relay_id=self.relay_id)
      try:
        for chunk in call:
          if resume is not None:
            if chunk.offset == resume[2]:
              self.bytes_resumed += chunk.offset
            resume = None
          if chunk.update_count == 0:  # nothing newer after all
            self._drop_arriving(f"the server holds nothing newer than v{chunk.version}")
            with self._changed:
              self.server_latest = self.weights.latest
              self._changed.notify_all()
            return
          self._receive(chunk)
      except grpc.RpcError as e:
        raise ParamServerError("Pull", e.code(), e.details() or "") from None
      finally:
        call.cancel()
      if self.weights.latest == have:
        raise ParamServerError("Pull", grpc.StatusCode.DATA_LOSS,
                               f"the server's stream ended before v{self.server_latest} arrived")

  def _receive(self, chunk) -> None:
    """One chunk from the server: into the arriving update (begun by it, or resumed), which
    is stored once complete."""
    arriving = self._arriving
    if arriving is not None and (arriving.version, arriving.base_version) == (
        chunk.version, chunk.base_version) and chunk.offset == arriving.received != 0:
      pass  # the next chunk, or the first of a resumed stream
    elif chunk.offset == 0:
      self._drop_arriving(f"the server sent another update than v{arriving.version}: pull again"
                          if arriving is not None else "")
      arriving = _Arriving(self.weights.begin_publish(chunk.update_bytes), chunk.version,
                           chunk.base_version)
      with self._changed:
        self._arriving = arriving
        self._changed.notify_all()
    else:
      raise ParamServerError("Pull", grpc.StatusCode.DATA_LOSS,
                             f"chunk at offset {chunk.offset} of an update not begun")
    arriving.write(chunk.offset, chunk.data)
    if arriving.received < arriving.nbytes:
      return
    try:
      blob, _ = self.weights.commit(arriving.writer)
    except Exception as e:
      self._drop_arriving(f"v{arriving.version} failed the relay's checks: {e}")
      if isinstance(e, errors.RequestError) and not self._from_keyframe:
        # e.g. a delta on other weights of its base: the next fetch starts from a keyframe
        self._from_keyframe = True
        logging.warning("relay: v%d refused (%s); fetching the server's latest from a "
                        "keyframe", arriving.version, e)
      elif (isinstance(e, errors.RequestError) and arriving.base_version < 0
            and arriving.version <= self.weights.latest):  # the server's keyframe: behind
        logging.error("relay: the server's v%d refused too (%s): another history than the "
                      "v%d this relay holds", arriving.version, e, self.weights.latest)
        with self._changed:
          self.diverged = (f"the server {self.upstream.address}'s v{arriving.version} cannot "
                           f"follow the v{self.weights.latest} this relay holds (another "
                           f"history: a store restored from a backup?): restart the relay "
                           f"with an empty storage_dir")
          self._changed.notify_all()
      raise
    self._from_keyframe = self._from_keyframe and not blob.is_keyframe
    self.fetches += 1
    self.bytes_fetched += blob.nbytes
    logging.info("relay: holds v%d (%s, %d bytes)", blob.version,
                 "keyframe" if blob.is_keyframe else f"delta on v{blob.base_version}", blob.nbytes)
    with self._changed:
      self._arriving = None
      self._changed.notify_all()

  def _drop_arriving(self, why: str) -> None:
    """Give up the update being received: its file goes, its readers stop with `why`."""
    with self._changed:
      arriving, self._arriving = self._arriving, None
      self._changed.notify_all()
    if arriving is not None:
      arriving.fail(why or f"the relay gave up v{arriving.version}: pull again")
      arriving.writer.abort()

  def announced(self) -> int:
    """The newest version a pull gets here now: the store's, or the one arriving for the
    server's latest (served cut-through)."""
    arriving = self._arriving
    if arriving is not None and arriving.version == self.server_latest:
      return max(self.weights.latest, arriving.version)
    return self.weights.latest

  def refresh(self) -> None:
    """Ask the server its latest version now (besides watching it), once: through a
    server's blip the caller is served what is held, not held for the client's retries.
    Callers that arrive while an asking is under way take its answer (many pulls at once
    ask once)."""
    called = time.monotonic()
    with self._refreshing:
      if self._refreshed_at >= called:
        return
      try:
        self._ask_and_announce(ONE_ATTEMPT)
        self.refreshes += 1
      except ParamServerError as e:
        logging.warning("relay: asking %s its version failed (%s)", self.upstream.address, e)
      self._refreshed_at = time.monotonic()

  def wait_current(self, context, cut_through: bool = False,
                   wait_s: float | None = None) -> _Arriving | None:
    """Wait (up to `wait_s`, default max_wait_s, while the caller is there) until the store
    holds the newest version the server announced, or (`cut_through`) until that version
    begins to arrive: then return it."""
    full = wait_s is None  # (a short wait's end is no news worth a warning)
    limit = self.config.max_wait_s if full else min(wait_s, self.config.max_wait_s)
    remaining = context.time_remaining()  # (an answer after the caller's deadline is lost)
    wait_s = limit if remaining is None else min(limit, max(0.0, remaining - 1.0))
    end = time.monotonic() + wait_s
    with self._changed:
      while (self.weights.latest < self.server_latest and not self._stopping.is_set()
             and context.is_active()):
        arriving = self._arriving
        if cut_through and arriving is not None and arriving.version == self.server_latest:
          return arriving
        left = end - time.monotonic()
        if left <= 0:
          if full:
            logging.warning("relay: serving v%d; v%d not fetched within %gs",
                            self.weights.latest, self.server_latest, wait_s)
          return None
        self._changed.wait(min(left, 0.5))
    return None

  # ------------------------------------------------------------ lifetime

  def start(self) -> "WeightRelay":
    """Serve, following the server; UpstreamRefused (nothing started) when the server
    refuses the relay's token: a relay that cannot follow must not stand in for it."""
    if names_itself(self.upstream.address, self.config.host, self.port):
      self.upstream.close()
      self._server.stop(0)
      self._lock.release()
      raise UpstreamRefused(f"--address {self.upstream.address} is this relay's own --host/"
                            f"--port; give the parameter server's address")
    try:  # what the server holds now: pulls wait for it rather than find the relay empty
      self._ask_and_announce()
    except ParamServerError as e:
      # Refused, or not a parameter server at all (an HTTP port, TLS on one side only).
      if e.code in REFUSED or e.code == grpc.StatusCode.FAILED_PRECONDITION:
        self.upstream.close()
        self._server.stop(0)
        self._lock.release()
        raise UpstreamRefused(
            f"--address {self.upstream.address}: {e}" if e.code not in REFUSED else
            f"the server {self.upstream.address} refused the relay's worker token ({e}); "
            f"give the server's worker token: --token, $RLAX_PS_WORKER_TOKEN or --token_file"
        ) from None
      logging.warning("relay: %s not reachable yet (%s); following it once it is; until then "
                      "workers are told to go to the server", self.upstream.address, e)
    if self.config.metrics_port >= 0:  # first: a port taken leaves nothing half started
      from param_server.metrics import RelayCollector, serve_metrics
      try:
        self._metrics = serve_metrics(RelayCollector(self), self.config.host,
                                      self.config.metrics_port)
      except BaseException:
        self.stop(grace=0)
        raise
      self.metrics_port = self._metrics.server_port
    self._server.start()
    self._follower.start()
    self._reporter.start()
    for name in ("", SERVICE_NAME):
      self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
    logging.info("relay on %s for %s, storage %s, holds v%d", self.address,
                 self.upstream.address, self.config.storage_dir, self.weights.latest)
    return self

  def stop(self, grace: float = 1.0) -> None:
    self._stopping.set()
    self.servicer.stopping.set()
    self._health.enter_graceful_shutdown()
    if self._metrics is not None:
      self._metrics.shutdown()
      self._metrics.server_close()
      self._metrics = None
    self._server.stop(grace).wait()
    self.upstream.interrupt.set()  # ends a retry's wait
    self.upstream.close()  # ends the follower's watch
    for thread in (self._follower, self._reporter):
      if thread.is_alive():
        thread.join(timeout=10)
    self._drop_arriving("the relay stopped")
    self._lock.release()

  def __enter__(self) -> "WeightRelay":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def _read_text(path: str) -> str:
  """A small file's text ("" without the file)."""
  try:
    with open(path) as f:
      return f.read().strip()
  except FileNotFoundError:
    return ""
