"""`ParamServerClient`: the trainer's and the workers' handle on the parameter server.

Calls are retried with exponential backoff and full jitter while the server is
UNAVAILABLE (restarting, or the network blinked) or a call ran past its deadline (a
server stalled for a while); every other failure raises a
`ParamServerError` carrying the gRPC code and the server's message (which names
the field). A broken `pull` resumes from the last byte it holds, for as long as each attempt
brings bytes (a large keyframe over a link that breaks now and then still arrives); one that
fails outright is resumed by the next `pull` from the same version. Retrying is
safe for every call: publishing the same update twice, enqueueing the same
prompt id, submitting the same group, acking the same take are all acknowledged
once; a lease or take whose reply was lost simply expires and is served again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import random
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

import grpc
import numpy as np
from absl import logging

from param_server import errors, pull_wire
from param_server.keepalive import DEAD_AFTER_S, client_options
from param_server.protos import param_server_pb2 as pb
from param_server.protos import param_server_pb2_grpc as pb_grpc

# The messages callers build, re-exported so callers need not know the proto module.
Prompt = pb.Prompt
Sample = pb.Sample
RolloutGroup = pb.RolloutGroup
VersionInfo = pb.VersionInfo
Stats = pb.Stats

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# How a weight relay begins the UNAVAILABLE it answers while it cannot reach, or is refused
# by, the server it follows: a client given `ipv4:RELAY,SERVER` then talks to the server.
RELAY_DOWN = "weight relay cannot serve:"
RELAY_AGAIN_S = 60.0  # a client that left its relay tries it again after this long
PULL_TURN_S = 1.0  # a pull told the server's pull slots are all taken asks again after ~this
RETRY_LOG_S = 30.0  # a call that keeps failing is logged at once, then at most this often
# A connection mistake `explained` names (an HTTP port, TLS on one side only, a certificate
# for another host), failing this many attempts in a row before any call was answered, is
# raised as FAILED_PRECONDITION rather than retried: a restarting server refuses
# connections, it does not answer as the wrong kind of endpoint.
MISTAKE_TRIES = 3


def _flag_hint(role: str) -> str:
  return f"--token, ${'RLAX_PS_' + role.upper() + '_TOKEN'} or --token_file"


def relay_and_server(address: str) -> tuple[str, str] | None:
  """`ipv4:RELAY:PORT,SERVER:PORT` -> (`ipv4:RELAY:PORT`, `ipv4:SERVER:PORT`) (the server:
  the addresses after the first); None for a single address."""
  scheme, sep, rest = address.partition(":")
  if not sep or scheme not in ("ipv4", "ipv6") or "," not in rest:
    return None
  relay, server = rest.split(",", 1)
  return f"{scheme}:{relay}", f"{scheme}:{server}"


@dataclasses.dataclass(frozen=True)
class _Route:
  """One channel to call on, the relay's or the server's, with its stubs."""
  address: str
  channel: grpc.Channel
  stub: pb_grpc.ParamServerStub
  pull: Callable  # Pull, its chunks parsed without copying their bytes (pull_wire.py)
  pull_channel: grpc.Channel  # a connection of its own: see ParamServerClient._open


class ParamServerError(Exception):
  """A call the server rejected (or that kept failing); `code` is the grpc.StatusCode."""

  def __init__(self, method: str, code: grpc.StatusCode, details: str):
    super().__init__(f"{method}: {code.name}: {details}")
    self.method = method
    self.code = code
    self.details = details


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
  """Exponential backoff with full jitter, until `deadline_s` has passed (math.inf: never);
  the one backoff of the project: client calls and the worker's loop use it."""
  initial_s: float = 0.05
  max_s: float = 2.0
  multiplier: float = 2.0
  deadline_s: float = 60.0

  def delays(self) -> Iterator[float]:
    """The waits between attempts, until deadline_s from now (the call: its first attempt's
    time counts too)."""
    end = time.monotonic() + self.deadline_s

    def waits():
      cap = self.initial_s
      while time.monotonic() < end:
        yield min(random.uniform(0, cap), max(0.0, end - time.monotonic()))
        cap = min(self.max_s, cap * self.multiplier)
    return waits()


@dataclasses.dataclass
class Lease:
  lease_id: str
  worker_id: str
  prompts: list[pb.Prompt]
  deadline_unix_s: float
  latest_version: int = -1  # the server's latest version as it answered
  staleness_floor: int = 0  # the trainer's latest take's min_version (0: none heard)

  @classmethod
  def from_proto(cls, m: pb.Lease) -> "Lease":
    return cls(m.lease_id, m.worker_id, list(m.prompts), m.deadline_unix_s, m.latest_version,
               m.staleness_floor)


@dataclasses.dataclass
class Take:
  """Rollouts handed to the trainer; `ack(take.take_id)` once they are safely consumed."""
  take_id: str
  rollouts: list[pb.TakenRollout]
  dropped_stale: int
  store_id: str = ""  # the server's storage id (pb.VersionInfo.store_id)


class _OtherUpdate(Exception):
  """A resumed pull's server sends another update than the one the bytes held began."""


@dataclasses.dataclass
class PullProgress:
  """What a pull has received so far; pass it back to `pull` to resume after a failure."""
  have_version: int | None = None
  updates: list[bytearray] = dataclasses.field(default_factory=list)
  partial: bytearray | None = None
  partial_filled: int = 0
  partial_version: int = -1
  partial_base: int = -1
  latest_version: int = -1
  done: bool = False
  attempts: int = 0
  resumed_bytes: int = 0  # bytes the server skipped thanks to resumption

  @property
  def position(self) -> tuple[int, int]:
    """(updates complete, bytes of the next one held): grows with every chunk received."""
    return len(self.updates), self.partial_filled

  def request(self) -> pb.PullRequest:
    req = pb.PullRequest()
    if self.have_version is not None:
      req.have_version = self.have_version
    if self.partial is not None and self.partial_filled:
      req.resume_version = self.partial_version
      req.resume_base_version = self.partial_base
      req.resume_offset = self.partial_filled
    return req

  def add(self, chunk: pull_wire.PullChunkView) -> None:
    if chunk.update_count == 0:
      self.latest_version = chunk.version
      self.done = True
      return
    key = (chunk.version, chunk.base_version)
    if self.partial is None or key != (self.partial_version, self.partial_base) or chunk.offset == 0:
      if chunk.offset != 0:
        raise ParamServerError("Pull", grpc.StatusCode.DATA_LOSS,
                               f"chunk at offset {chunk.offset} of an update this client has no start of")
      self.partial = bytearray(chunk.update_bytes)
      self.partial_filled = 0
      self.partial_version, self.partial_base = key
    elif chunk.offset != self.partial_filled:
      raise ParamServerError("Pull", grpc.StatusCode.DATA_LOSS,
                             f"chunk at offset {chunk.offset}, expected {self.partial_filled}")
    elif chunk.update_bytes != len(self.partial):  # resumed into another update of that
      self.partial, self.partial_filled = None, 0  # version (a new run's, a server's loss):
      raise _OtherUpdate()  # begun again without resuming
    end = chunk.offset + len(chunk.data)
    if end > len(self.partial):
      raise ParamServerError("Pull", grpc.StatusCode.DATA_LOSS,
                             f"chunk ends at {end}, past the update's {len(self.partial)} bytes")
    memoryview(self.partial)[chunk.offset:end] = chunk.data  # one copy (a bytearray slice makes two)
    self.partial_filled = end
    if end == len(self.partial):
      self.updates.append(self.partial)
      self.have_version = chunk.version
      self.partial, self.partial_filled = None, 0
      if chunk.update_index == chunk.update_count - 1:
        self.latest_version = chunk.version
        self.done = True


def make_sample(token_ids: Sequence[int], reward: float, *, text: str = "",
                logprobs: Sequence[float] | np.ndarray | None = None, finish_reason: str = "",
                metadata: dict[str, str] | None = None,
                routes: np.ndarray | None = None,
                observed: np.ndarray | None = None,
                teacher: tuple | None = None) -> pb.Sample:
  """A sample; logprobs travel packed as little-endian float32, routes as `make_routes`,
  `observed` (multi-turn: True on the environment's tokens) as a byte per token, the
  `teacher`'s scores as `sample_teacher` reads them."""
  s = pb.Sample(token_ids=list(map(int, token_ids)), reward=float(reward), text=text,
                finish_reason=finish_reason, metadata=metadata or {})
  if logprobs is not None:
    s.logprobs_f32 = np.asarray(logprobs, dtype="<f4").tobytes()
  if observed is not None and np.any(observed):
    s.observed = np.asarray(observed, bool).astype(np.uint8).tobytes()
  if routes is not None:
    s.routes.CopyFrom(make_routes(routes))
  if teacher is not None:  # (log-probs [t], top ids [t, k] or None, top log-probs or None)
    logp, ids, top = teacher
    s.teacher_logprobs_f32 = np.asarray(logp, "<f4").tobytes()
    if ids is not None:
      s.teacher_topk_ids = np.asarray(ids, "<i4").tobytes()
      s.teacher_topk_logprobs_f32 = np.asarray(top, "<f4").tobytes()
  return s


def make_routes(ids: np.ndarray) -> pb.Routes:
  """Expert ids [tokens, layers, top_k] as a Routes message: one byte per id when they fit
  (at most 256 experts), else two."""
  ids = np.asarray(ids)
  if ids.ndim != 3 or (ids.size and ids.min() < 0):
    raise ValueError(f"routes: expected expert ids >= 0 of shape [tokens, layers, top_k], got "
                     f"shape {ids.shape}")
  width = 1 if not ids.size or ids.max() < 256 else 2
  return pb.Routes(ids=ids.astype(f"<u{width}").tobytes(), layers=ids.shape[1],
                   top_k=ids.shape[2], id_bytes=width)


def routes_of(routes: pb.Routes) -> np.ndarray:
  """A Routes message's expert ids [tokens, layers, top_k] (int32)."""
  flat = np.frombuffer(routes.ids, dtype=f"<u{routes.id_bytes}").astype(np.int32)
  return flat.reshape(-1, routes.layers, routes.top_k)


def sample_observed(sample: pb.Sample) -> np.ndarray | None:
  """Which of a sample's tokens an environment wrote ([tokens] bool); None: all the policy's."""
  if not sample.observed:
    return None
  return np.frombuffer(sample.observed, dtype=np.uint8).astype(bool)


def sample_teacher(sample: pb.Sample) -> tuple[np.ndarray | None, np.ndarray | None,
                                                 np.ndarray | None]:
  """A sample's teacher scores (worker.teacher): its tokens' log-probs [t] float32, and the
  top ids [t, k] int32 and log-probs [t, k] float32; None for what it has none of."""
  t = len(sample.token_ids)
  logp = (np.frombuffer(sample.teacher_logprobs_f32, "<f4").astype(np.float32)
          if sample.teacher_logprobs_f32 else None)
  if not sample.teacher_topk_ids or not t:
    return logp, None, None
  ids = np.frombuffer(sample.teacher_topk_ids, "<i4").astype(np.int32).reshape(t, -1)
  top = np.frombuffer(sample.teacher_topk_logprobs_f32, "<f4").astype(np.float32)
  return logp, ids, top.reshape(t, -1)


def sample_logprobs(sample: pb.Sample) -> np.ndarray:
  """A sample's behaviour log-probabilities as float32, whichever way they were sent."""
  if sample.logprobs_f32:
    return np.frombuffer(sample.logprobs_f32, dtype="<f4")
  return np.asarray(sample.logprobs, dtype=np.float32)


class ParamServerClient:
  """A connection to one parameter server, for one role (`trainer`, `worker` or `viewer`)."""

  def __init__(self, address: str, token: str | None = None, role: str = "worker", *,
               root_certificates: bytes | None = None, tls_server_name: str | None = None,
               chunk_bytes: int = 4 << 20, retry: RetryPolicy = RetryPolicy(),
               timeout_s: float = 30.0, dead_after_s: float = DEAD_AFTER_S,
               relay_again_s: float = RELAY_AGAIN_S):
    self.address = address
    self.role = role
    self.chunk_bytes = chunk_bytes
    self.retry = retry
    self.timeout_s = timeout_s
    self.worker_id = ""
    self._has_token = bool(token)
    self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
    self._tls = root_certificates is not None
    # Set (by a stop request) to end any retry wait at once: the call then fails UNAVAILABLE.
    self.interrupt = threading.Event()
    self._retry_logged_at = -RETRY_LOG_S
    self._answered = False  # some call got an answer: a closed socket is no TLS mismatch
    self._mistakes = 0  # attempts in a row that failed as a named connection mistake
    # Pulls under way by have_version, which a second caller joins rather than fetch the
    # same bytes again, and the progress of the last one that failed, which the next pull
    # from the same version resumes.
    self._pulls: dict[int | None, concurrent.futures.Future] = {}
    self._unfinished: tuple[int | None, PullProgress] | None = None
    self._pulls_lock = threading.Lock()
    # No size limits of its own: the server sets them (`rlax-ps serve --max_message_bytes`)
    # and tells a worker its request limit when it registers.
    self.max_request_bytes = 0  # 0: not told
    self._options = [("grpc.max_receive_message_length", -1),
                     ("grpc.max_send_message_length", -1), *client_options(dead_after_s)]
    if tls_server_name and root_certificates is None:
      raise ValueError(f"tls_server_name: {tls_server_name!r} without root_certificates: "
                       f"TLS is on only with them (the token would go in clear)")
    if root_certificates is not None:
      if tls_server_name:
        self._options.append(("grpc.ssl_target_name_override", tls_server_name))
      self._credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    else:
      self._credentials = None
    # Given `ipv4:RELAY,SERVER`: calls go to the relay; one it cannot answer (down, or
    # unable to follow its server) goes to the server, and so do the calls after it until
    # `relay_again_s` has passed; then the relay is tried again (it may have restarted).
    relay_server = relay_and_server(address)
    self.relay_again_s = relay_again_s
    self._relay = self._open(relay_server[0] if relay_server else address)
    self._server_address = relay_server[1] if relay_server else None
    self._server: _Route | None = None  # opened when first needed
    self._route = self._relay
    self._relay_again_at = math.inf
    self._route_lock = threading.Lock()

  def _channel(self, address: str, options: list) -> grpc.Channel:
    if self._credentials is not None:
      return grpc.secure_channel(address, self._credentials, options=options)
    return grpc.insecure_channel(address, options=options)

  def _open(self, address: str) -> _Route:
    """The channels to `address`. Pulls go on a TCP connection of their own: on one shared
    with the other calls, a heartbeat's or a renewal's answer queues behind the pull's bytes
    in flight, seconds on a slow link."""
    channel = self._channel(address, self._options)
    pull_channel = self._channel(address, [*self._options, ("grpc.use_local_subchannel_pool", 1)])
    pull = pull_channel.unary_stream(
        "/rlax_ps.v1.ParamServer/Pull", request_serializer=pb.PullRequest.SerializeToString,
        response_deserializer=pull_wire.decode_pull_chunk)
    return _Route(address, channel, pb_grpc.ParamServerStub(channel), pull, pull_channel)

  # ------------------------------------------------------------ plumbing

  @property
  def channel(self) -> grpc.Channel:
    """The channel calls go to now (TLS and limits as this client's), for a relay's
    passed-through calls."""
    return self._now().channel

  @property
  def on_relay(self) -> bool:
    """Whether calls go to the relay now (a single address: always)."""
    return self._route is self._relay

  def close(self) -> None:
    for route in (self._relay, self._server):
      if route is not None:
        route.channel.close()
        route.pull_channel.close()

  def __enter__(self) -> "ParamServerClient":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def error(self, method: str, code: grpc.StatusCode, details: str) -> ParamServerError:
    """A ParamServerError whose message says what to do where the status alone misleads: no
    token vs a token refused, and the connection failures `explained` names."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
      details = (f"no token given for role {self.role!r} ({_flag_hint(self.role)}); {details}"
                 if not self._has_token else
                 f"the {self.role} token was rejected by {self.address}; {details}")
    return ParamServerError(method, code, self.explained(code, details))

  def explained(self, code: grpc.StatusCode, details: str) -> str:
    """`details` of a failed call, with the likely mistake named where gRPC's words hide it:
    TLS on one side only, an HTTP server at the address, a certificate for another name."""
    hint = self._mistake(code, details)
    return f"{details} ({hint})" if hint else details

  def _mistake(self, code: grpc.StatusCode, details: str) -> str:
    """What to fix when a failure before any answer reads as a connection mistake; ""
    otherwise (the server may just be away)."""
    if code != grpc.StatusCode.UNAVAILABLE or self._answered:
      return ""
    said = details.lower()
    if not self._tls and "socket closed" in said:
      return f"is the server at {self.address} using TLS? pass --tls_ca"
    if "failed parsing http/2" in said:
      return (f"{self.address} is not a gRPC server (an HTTP server answered: a metrics "
              f"port?); give the parameter server's or relay's --port")
    if self._tls and "wrong_version_number" in said:
      return f"the server at {self.address} is not using TLS; drop --tls_ca"
    if self._tls and "hostname verification" in said:
      return (f"the server's certificate is not for the host in {self.address}; pass "
              f"--tls_server_name=NAME, a name the certificate holds")
    if self._tls and "certificate_verify_failed" in said:
      return (f"the certificate of the server at {self.address} is not signed by --tls_ca; "
              f"give the CA that signed its --tls_cert (or that certificate itself)")
    return ""

  def _now(self) -> _Route:
    """Where a call goes: the relay, or the server while the relay is left (until
    relay_again_s after leaving it)."""
    if self._route is not self._relay and time.monotonic() >= self._relay_again_at:
      with self._route_lock:
        if self._route is not self._relay:
          logging.info("param server client: trying the relay %s again", self._relay.address)
          self._route = self._relay
    return self._route

  def _leave_relay(self, route: _Route, details: str) -> bool:
    """After a call to the relay failed as retryable: the server takes the calls from now
    (True), the relay tried again relay_again_s later; False with no server to go to or
    when the failed call went to the server."""
    if self._server_address is None or route is not self._relay:
      return False
    with self._route_lock:  # calls on other threads may fail on the relay too
      if self._route is self._relay:
        logging.warning("param server client: the relay %s cannot serve (%s); talking to %s "
                        "for %gs", self._relay.address, details, self._server_address,
                        self.relay_again_s)
        if self._server is None:
          self._server = self._open(self._server_address)
        self._route = self._server
        self._relay_again_at = time.monotonic() + self.relay_again_s
    return True

  def _wait_to_retry(self, method: str, code: grpc.StatusCode, details: str, delays,
                     route: _Route, retry: RetryPolicy | None = None) -> None:
    """Sleep the next backoff delay after a failed attempt on `route` (logged at once, then
    at most every RETRY_LOG_S); raise once the retries (`retry`, else the client's) are
    spent or a stop was requested. A relay that failed is left for the server at once."""
    if self.interrupt.is_set():
      raise ParamServerError(method, code, f"stop requested: {details}")
    if self._leave_relay(route, details):
      return
    hint = self._mistake(code, details)
    self._mistakes = self._mistakes + 1 if hint else 0
    if self._mistakes >= MISTAKE_TRIES:
      raise ParamServerError(method, grpc.StatusCode.FAILED_PRECONDITION,
                             f"{details} ({hint}); not retried: {self._mistakes} attempts in a "
                             f"row failed so")
    deadline_s = (retry or self.retry).deadline_s
    delay = next(delays, None)
    if delay is None:
      raise self.error(method, code, f"still failing after {deadline_s:g}s of retries: "
                       f"{details}" if deadline_s > 0 else details)
    now = time.monotonic()
    if now - self._retry_logged_at >= RETRY_LOG_S:
      self._retry_logged_at = now
      logging.warning("param server %s: %s failed (%s: %s); retrying %s", self.address,
                      method, code.name, self.explained(code, details),
                      f"for up to {deadline_s:g}s" if math.isfinite(deadline_s) else
                      "until it answers")
    if self.interrupt.wait(delay):
      raise ParamServerError(method, code, f"stop requested while retrying: {details}")

  def _with_retry(self, method: str, fn: Callable[[pb_grpc.ParamServerStub], object],
                  retry: RetryPolicy | None = None):
    """fn(stub) for the route of the moment, retried as RETRYABLE says."""
    delays = (retry or self.retry).delays()
    while True:
      route = self._now()
      try:
        reply = fn(route.stub)
        self._answered = True
        return reply
      except grpc.RpcError as e:
        if e.code() not in RETRYABLE:
          raise self.error(method, e.code(), e.details() or "") from None
        code, details = e.code(), e.details() or ""
      self._wait_to_retry(method, code, details, delays, route, retry)

  def _call(self, method: str, request, timeout_s: float | None = None,
            retry: RetryPolicy | None = None):
    timeout = self.timeout_s if timeout_s is None else timeout_s
    return self._with_retry(method, lambda stub: getattr(stub, method)(
        request, metadata=self._metadata, timeout=timeout), retry)

  def _require_worker(self, worker_id: str | None) -> str:
    wid = worker_id or self.worker_id
    if not wid:
      raise ValueError("worker_id: expected one (call register() first or pass worker_id), got ''")
    return wid

  # ------------------------------------------------------------ workers

  def register(self, name: str, metadata: dict[str, str] | None = None) -> str:
    reply = self._call("RegisterWorker", pb.RegisterWorkerRequest(name=name, metadata=metadata or {}))
    self.worker_id = reply.worker_id
    self.heartbeat_interval_s = reply.heartbeat_interval_s
    self.max_request_bytes = reply.max_request_bytes
    return reply.worker_id

  def heartbeat(self, version: int = -1, tokens_per_s: float = 0.0, worker_id: str | None = None,
                kind: str = "", leaving: bool = False, time: pb.WorkerTime | None = None
                ) -> pb.HeartbeatReply:
    """Reports the version held and the generation speed (kind "relay": a weight relay's
    version) and where the worker's time went (`time`); the reply names the latest version
    and the trainer's staleness floor. `leaving`: the last one of a worker that stops (the
    server then lists it no more)."""
    return self._call("Heartbeat", pb.HeartbeatRequest(
        worker_id=self._require_worker(worker_id), version=version, tokens_per_s=tokens_per_s,
        kind=kind, leaving=leaving, time=time))

  def stats(self) -> pb.Stats:
    return self._call("GetStats", pb.GetStatsRequest())

  # ------------------------------------------------------------ weights

  def version_info(self, retry: RetryPolicy | None = None) -> pb.VersionInfo:
    """The server's latest version and its details; `retry` for this call instead of the
    client's (RetryPolicy(deadline_s=0): one attempt)."""
    return self._call("GetLatest", pb.GetLatestRequest(), retry=retry)

  def latest_version(self, retry: RetryPolicy | None = None) -> int:
    return self.version_info(retry).latest_version

  def publish(self, update_bytes, *, run: str = "") -> pb.PublishReply:
    """Sends one `Update.to_bytes()` blob (or the `rlax_ps.sync.Update` itself) in chunks
    (trainer only). `run`: the publishing run's id; a server holding another run's versions
    refuses it (FAILED_PRECONDITION), so that two runs never share one weight stream."""
    if hasattr(update_bytes, "to_bytes") and not isinstance(update_bytes, (bytes, bytearray)):
      update_bytes = update_bytes.to_bytes()
    try:
      view = memoryview(update_bytes).cast("B")
    except TypeError:
      raise TypeError(f"update_bytes: expected the bytes of an rlax_ps.sync.Update, got "
                      f"{type(update_bytes).__name__}") from None
    total = len(view)

    def chunks():
      for offset in range(0, max(total, 1), self.chunk_bytes):
        yield pb.PublishChunk(total_bytes=total if offset == 0 else 0, offset=offset,
                              data=bytes(view[offset:offset + self.chunk_bytes]),
                              run=run if offset == 0 else "")

    timeout = self.timeout_s + total / (50 << 20)
    return self._with_retry("Publish", lambda stub: stub.Publish(
        chunks(), metadata=self._metadata, timeout=timeout))

  def stream_pull(self, have_version: int | None = None,
                  resume: tuple[int, int, int] | None = None, relay_id: str = ""):
    """The raw Pull stream from `have_version` (None: nothing held): the chunks
    (`pull_wire.PullChunkView`, data not copied) as they arrive, no retries; `cancel()`
    it to stop early. `resume` = (version, base_version, bytes held) of a first update
    already begun: the server starts there if that is still its first update. A relay
    streams them to disk, naming itself (`relay_id`: a relay's pull slot, not a worker's)."""
    request = PullProgress(have_version=have_version).request()
    request.relay_id = relay_id
    if resume is not None:
      request.resume_version, request.resume_base_version, request.resume_offset = resume
    return self._now().pull(request, metadata=self._metadata)

  def pull(self, have_version: int | None = None, *, progress: PullProgress | None = None,
           on_chunk: Callable[[pull_wire.PullChunkView], None] | None = None) -> list[bytearray]:
    """The update blobs (keyframe and/or deltas, in order) that bring `have_version` to the latest.

    Pass a `PullProgress` to keep what arrived if this call fails, and pass it again
    to resume from the last byte received. Without one, a call from the version a pull
    under way started at waits for that pull and returns its blobs (the same objects), and
    a call from the version a failed pull started at resumes it. An empty list means
    `have_version` is the latest.
    """
    if progress is not None or on_chunk is not None:
      return self._pull(progress or PullProgress(have_version=have_version), on_chunk)
    with self._pulls_lock:
      shared = self._pulls.get(have_version)
      if shared is not None:
        leader = False
      else:
        leader, shared = True, self._pulls.setdefault(have_version, concurrent.futures.Future())
        unfinished, self._unfinished = self._unfinished, None
    if not leader:
      return shared.result()
    progress = (unfinished[1] if unfinished is not None and unfinished[0] == have_version
                else PullProgress(have_version=have_version))
    try:
      shared.set_result(self._pull(progress, None))
    except BaseException as e:
      shared.set_exception(e)
      if (isinstance(e, ParamServerError) and e.code in RETRYABLE
          and progress.position != (0, 0)):  # unreachable for a while: resumed next time
        with self._pulls_lock:
          self._unfinished = (have_version, progress)
    finally:
      with self._pulls_lock:
        del self._pulls[have_version]
    return shared.result()

  def _pull(self, progress: PullProgress,
            on_chunk: Callable[[pull_wire.PullChunkView], None] | None) -> list[bytearray]:
    """`pull` into `progress`, retried while the server is unreachable; an attempt that
    brought bytes starts the retries' deadline and backoff afresh."""
    delays = self.retry.delays()
    while not progress.done:
      progress.attempts += 1
      request = progress.request()
      route, before = self._now(), progress.position
      try:
        first, call = True, route.pull(request, metadata=self._metadata)
        try:
          for chunk in call:
            self._answered = True
            if first and request.resume_offset and chunk.offset == request.resume_offset:
              progress.resumed_bytes += chunk.offset
            first = False
            progress.add(chunk)
            if on_chunk is not None:
              on_chunk(chunk)
        finally:
          call.cancel()  # frees the server's stream at once when this worker gives up
        if progress.done:
          break
        error = "the stream ended before the last update was complete"
      except _OtherUpdate:
        continue  # (progress dropped the bytes it held: the next attempt asks from 0)
      except grpc.RpcError as e:
        if (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and (e.details() or "").startswith(errors.PULLS_BUSY)):
          self._wait_for_a_pull_slot(e.details())
          continue
        if e.code() not in RETRYABLE:
          raise self.error("Pull", e.code(), e.details() or "") from None
        error = e.details() or ""
      if progress.position != before:
        delays = self.retry.delays()
      self._wait_to_retry("Pull", grpc.StatusCode.UNAVAILABLE, error, delays, route)
    return progress.updates

  def _wait_for_a_pull_slot(self, details: str) -> None:
    """The server (or relay) serves its most pulls at once: wait PULL_TURN_S (jittered) and
    ask again on the same route, for as long as it says so (it is up: no retry deadline);
    logged at once, then at most every RETRY_LOG_S."""
    now = time.monotonic()
    if now - self._retry_logged_at >= RETRY_LOG_S:
      self._retry_logged_at = now
      logging.warning("param server %s: %s; waiting for a turn to pull", self.address, details)
    if self.interrupt.wait(PULL_TURN_S * random.uniform(0.5, 1.5)):
      raise ParamServerError("Pull", grpc.StatusCode.UNAVAILABLE,
                             f"stop requested while waiting for a turn to pull: {details}")

  def pull_updates(self, have_version: int | None = None, **kwargs) -> list:
    """Like `pull`, decoded to `rlax_ps.sync.Update`s. Blobs that do not decode (a resumed
    pull joined to another update of the same version and size: a server that lost its
    storage, a new run) are pulled once more from their first byte."""
    from rlax_ps import sync  # numpy-only codec; imported on use
    blobs = self.pull(have_version, **kwargs)
    try:
      return [sync.Update.from_bytes(b) for b in blobs]  # (each blob kept, not copied)
    except sync.CodecError as e:
      if kwargs:  # the caller's own progress: theirs to handle
        raise
      logging.warning("pull: an update from version %s does not decode (%s); pulling it "
                      "again from its first byte", have_version, e)
      return [sync.Update.from_bytes(b)
              for b in self._pull(PullProgress(have_version=have_version), None)]

  def watch(self, after_version: int = -1, timeout_s: float | None = None) -> Iterator[pb.VersionInfo]:
    """Yields the version info each time a version above `after_version` is published.

    Reconnects (with backoff) while the server is UNAVAILABLE; ends after `timeout_s`."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    delays = self.retry.delays()
    while end is None or time.monotonic() < end:
      left = None if end is None else max(0.0, end - time.monotonic())
      route = self._now()
      stream = route.stub.Watch(pb.WatchRequest(after_version=after_version), metadata=self._metadata,
                                timeout=left)
      try:
        for info in stream:
          after_version = info.latest_version
          delays = self.retry.delays()
          yield info
        return
      except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
          return
        if e.code() not in RETRYABLE:
          raise self.error("Watch", e.code(), e.details() or "") from None
        self._wait_to_retry("Watch", e.code(), e.details() or "", delays, route)
      finally:
        stream.cancel()

  # ------------------------------------------------------------ prompts

  def enqueue_prompts(self, prompts: Iterable[pb.Prompt]) -> pb.EnqueuePromptsReply:
    """Queues prompts (trainer); prompts with an id already queued or leased are skipped."""
    return self._call("EnqueuePrompts", pb.EnqueuePromptsRequest(prompts=list(prompts)))

  def lease(self, n: int, deadline_s: float, *, wait_s: float = 0.0, worker_id: str | None = None) -> Lease:
    """Leases up to `n` prompts until `deadline_s` from now; an empty lease when none came within `wait_s`."""
    start = time.monotonic()
    reply = self._call("LeasePrompts", pb.LeasePromptsRequest(
        worker_id=self._require_worker(worker_id), n=n, deadline_s=deadline_s, wait_s=wait_s),
        timeout_s=self.timeout_s + wait_s)
    if not reply.prompts:
      self._wait_out(start, wait_s)
    return Lease.from_proto(reply)

  def _wait_out(self, start: float, wait_s: float) -> None:
    """After an empty long poll answered before its `wait_s` (a server whose long-poll slots
    were all taken answers at once): the rest of the wait here, so an idle caller asking
    again at once does not spin (a stop request ends it)."""
    left = start + wait_s - time.monotonic()
    if left > 0:
      self.interrupt.wait(left)

  def renew(self, lease: Lease | str, deadline_s: float, *, worker_id: str | None = None,
            partial: Sequence[pb.PartialRollouts] = ()) -> Lease:
    """Extends a lease to `deadline_s` from now; `partial`: samples begun for its open
    prompts, which go back to the queue with them should the lease expire."""
    lease_id = lease if isinstance(lease, str) else lease.lease_id
    return Lease.from_proto(self._call("RenewLease", pb.RenewLeaseRequest(
        lease_id=lease_id, worker_id=self._require_worker(worker_id), deadline_s=deadline_s,
        partial=list(partial))))

  def complete(self, lease: Lease | str, *, worker_id: str | None = None) -> int:
    lease_id = lease if isinstance(lease, str) else lease.lease_id
    return self._call("CompleteLease", pb.CompleteLeaseRequest(
        lease_id=lease_id, worker_id=self._require_worker(worker_id))).prompts_answered

  def release(self, lease: Lease | str, prompt_ids: Sequence[str] = (), *, worker_id: str | None = None,
              partial: Sequence[pb.PartialRollouts] = ()) -> int:
    """Returns prompts of a lease to the queue (all its open ones by default), each with the
    samples `partial` holds for it, which the next worker continues; how many went back."""
    lease_id = lease if isinstance(lease, str) else lease.lease_id
    return self._call("ReleaseLease", pb.ReleaseLeaseRequest(
        lease_id=lease_id, worker_id=self._require_worker(worker_id), prompt_ids=list(prompt_ids),
        partial=list(partial))).returned

  # ------------------------------------------------------------ rollouts

  def submit_rollouts(self, lease_id: str, group: pb.RolloutGroup, policy_version: int | None = None,
                      worker_id: str | None = None) -> pb.SubmitRolloutsReply:
    """Submits one leased prompt's rollout group; a retry of the same group is acknowledged
    once. The reply names the server's latest version (`latest_version`) and the trainer's
    staleness floor (`staleness_floor`)."""
    if policy_version is not None:
      g = pb.RolloutGroup()
      g.CopyFrom(group)
      g.policy_version = policy_version
      group = g
    request = pb.SubmitRolloutsRequest(lease_id=lease_id, worker_id=self._require_worker(worker_id),
                                       group=group)
    if self.max_request_bytes and request.ByteSize() > self.max_request_bytes:
      raise ParamServerError("SubmitRollouts", grpc.StatusCode.INVALID_ARGUMENT, (
          f"group: {request.ByteSize()} bytes, more than the server takes ({self.max_request_bytes}); "
          f"raise `rlax-ps serve --max_message_bytes`"))
    return self._call("SubmitRollouts", request)

  def take_rollouts(self, min_version: int = 0, max_n: int = 64, *, wait_s: float = 0.0,
                    ack_deadline_s: float = 60.0, requeue_unacked: bool = False) -> Take:
    """Rollout groups made at `min_version` or later (older ones are dropped and their prompts re-queued).

    `requeue_unacked`: first return every unacknowledged take to the queue (a restarted trainer)."""
    start = time.monotonic()
    reply = self._call("TakeRollouts", pb.TakeRolloutsRequest(
        min_version=min_version, max_groups=max_n, wait_s=wait_s, ack_deadline_s=ack_deadline_s,
        requeue_unacked=requeue_unacked),
        timeout_s=self.timeout_s + wait_s)
    if not reply.rollouts and not reply.dropped_stale:
      self._wait_out(start, wait_s)
    return Take(reply.take_id, list(reply.rollouts), reply.dropped_stale, reply.store_id)

  def ack(self, take: Take | str) -> int:
    take_id = take if isinstance(take, str) else take.take_id
    return self._call("AckRollouts", pb.AckRolloutsRequest(take_id=take_id)).acked
