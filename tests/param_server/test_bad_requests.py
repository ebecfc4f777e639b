"""Every RPC sent bad input, as a buggy or hostile client would: each gets a status naming the
field, the server answers the next request, and the state (and its write-ahead log, replayed
after a restart) is what the good requests alone made.

One server for the module; raw stubs, so that nothing the client checks first hides the
server's answer.
"""

import dataclasses
import threading
from typing import Any, Callable

import grpc
import numpy as np
import pytest

from param_server.protos import param_server_pb2 as pb
from param_server.protos import param_server_pb2_grpc as pb_grpc
from param_server.server import SERVICE_NAME, ParamServer
from ps_testlib import TOKENS, small_config, tiny_weights
from rlax_ps import sync

Code = grpc.StatusCode
DAY_S = 3600.0  # the longest lease: nothing expires during the module


@dataclasses.dataclass
class Env:
  """The module's server and what its good requests made: a lease of p0..p2 (p0 answered, its
  group waiting for the trainer), p3..p5 queued, v0 published."""
  server: ParamServer
  channel: grpc.Channel
  stub: pb_grpc.ParamServerStub
  worker_id: str = ""
  lease_id: str = ""
  accepted: int = 0  # groups accepted by good requests

  def connect(self, server: ParamServer) -> None:
    self.server = server
    self.channel = grpc.insecure_channel(server.address, options=[
        ("grpc.max_send_message_length", 64 << 20)])
    self.stub = pb_grpc.ParamServerStub(self.channel)


def metadata(role):
  """Bearer metadata of a role; None: no token; any other string: that header."""
  if role is None:
    return ()
  return (("authorization", f"Bearer {TOKENS[role]}" if role in TOKENS else role),)


def sample(n=3, **fields):
  s = pb.Sample(token_ids=list(range(1, n + 1)), reward=1.0, finish_reason="stop",
                logprobs_f32=np.full(n, -0.5, "<f4").tobytes())
  for k, v in fields.items():
    if isinstance(v, list):
      s.ClearField(k)
      getattr(s, k).extend(v)
    else:
      setattr(s, k, v)
  return s


def group(prompt_id, *samples, version=0, **fields):
  return pb.RolloutGroup(prompt_id=prompt_id, samples=list(samples) or [sample()],
                         policy_version=version, **fields)


def keyframe(version, **replace):
  return sync.encode(None, dict(tiny_weights(), **replace), "bf16", version=version).to_bytes()


def chunks(blob, run="", total=None, step=4096):
  return [pb.PublishChunk(total_bytes=len(blob) if total is None else total, offset=o,
                          data=blob[o:o + step], run=run if o == 0 else "")
          for o in range(0, len(blob), step)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  storage = tmp_path_factory.mktemp("bad_requests")
  e = Env(None, None, None)
  e.connect(ParamServer(small_config(storage)).start())
  s = e.stub
  s.Publish(iter(chunks(keyframe(0))), metadata=metadata("trainer"))
  s.EnqueuePrompts(pb.EnqueuePromptsRequest(prompts=[
      pb.Prompt(id=f"p{i}", text=f"{i}+{i}?", token_ids=[1, i + 2]) for i in range(6)]),
      metadata=metadata("trainer"))
  e.worker_id = s.RegisterWorker(pb.RegisterWorkerRequest(name="w"), metadata=metadata("worker")).worker_id
  e.lease_id = s.LeasePrompts(pb.LeasePromptsRequest(worker_id=e.worker_id, n=3, deadline_s=DAY_S),
                              metadata=metadata("worker")).lease_id
  submit(e, group("p0"))
  e.accepted = 1
  yield e
  e.channel.close()
  e.server.stop(grace=0)


def submit(env, g, lease_id=None, worker_id=None):
  return env.stub.SubmitRollouts(pb.SubmitRolloutsRequest(
      lease_id=lease_id or env.lease_id, worker_id=worker_id or env.worker_id, group=g),
      metadata=metadata("worker"))


def state(env):
  """(the queues' whole state as a snapshot, the latest version, rejections counted)."""
  queues = env.server.queues
  (record,) = queues._snapshot()
  snap = record.snapshot
  stats = env.stub.GetStats(pb.GetStatsRequest(), metadata=metadata("viewer"))
  return snap.SerializeToString(deterministic=True), stats.versions.latest_version, stats.errors


@dataclasses.dataclass(frozen=True)
class Row:
  """One bad request: `request(env)` -> its message (bytes: sent as they are; a list: a
  Publish stream), the status and the field the message must start with (None: gRPC's own
  size check, which no handler sees, so the server counts nothing)."""
  name: str
  method: str
  role: Any
  request: Callable[[Env], Any]
  code: grpc.StatusCode
  field: str | None


def lease_req(**fields):
  def make(env):
    return pb.LeasePromptsRequest(**{"worker_id": env.worker_id, "n": 1, "deadline_s": 30.0, **fields})
  return make


def renew_req(*partial, **fields):
  def make(env):
    return pb.RenewLeaseRequest(**{"lease_id": env.lease_id, "worker_id": env.worker_id,
                                   "deadline_s": DAY_S, "partial": list(partial), **fields})
  return make


def release_req(**fields):
  def make(env):
    return pb.ReleaseLeaseRequest(**{"lease_id": env.lease_id, "worker_id": env.worker_id, **fields})
  return make


def submit_req(g=None, **fields):
  def make(env):
    req = pb.SubmitRolloutsRequest(**{"lease_id": env.lease_id, "worker_id": env.worker_id, **fields})
    if g is not None:
      req.group.CopyFrom(g)
    return req
  return make


def take_req(**fields):
  return lambda env: pb.TakeRolloutsRequest(**{"max_groups": 8, "ack_deadline_s": 30.0, **fields})


def const(message):
  return lambda env: message


NAN, INF = float("nan"), float("inf")
GARBAGE = b"\xff\xff\xff\xff not a protobuf"
ENQUEUE_EMPTY = const(pb.EnqueuePromptsRequest())

ROWS = [
    # Tokens and roles.
    Row("no token", "GetStats", None, const(pb.GetStatsRequest()), Code.UNAUTHENTICATED, "authorization"),
    Row("unknown token", "GetStats", "Bearer nope", const(pb.GetStatsRequest()),
        Code.UNAUTHENTICATED, "authorization"),
    Row("not a bearer header", "GetStats", TOKENS["viewer"], const(pb.GetStatsRequest()),
        Code.UNAUTHENTICATED, "authorization"),
    Row("worker enqueues", "EnqueuePrompts", "worker", ENQUEUE_EMPTY,
        Code.PERMISSION_DENIED, "authorization"),
    Row("worker takes", "TakeRollouts", "worker", take_req(), Code.PERMISSION_DENIED, "authorization"),
    Row("worker acks", "AckRollouts", "worker", const(pb.AckRolloutsRequest(take_id="t")),
        Code.PERMISSION_DENIED, "authorization"),
    Row("worker publishes", "Publish", "worker", lambda env: chunks(keyframe(1)),
        Code.PERMISSION_DENIED, "authorization"),
    Row("trainer leases", "LeasePrompts", "trainer", lease_req(), Code.PERMISSION_DENIED, "authorization"),
    Row("trainer submits", "SubmitRollouts", "trainer", submit_req(group("p1")),
        Code.PERMISSION_DENIED, "authorization"),
    Row("trainer heartbeats", "Heartbeat", "trainer", const(pb.HeartbeatRequest(worker_id="w")),
        Code.PERMISSION_DENIED, "authorization"),
    Row("viewer enqueues", "EnqueuePrompts", "viewer", ENQUEUE_EMPTY,
        Code.PERMISSION_DENIED, "authorization"),
    Row("viewer releases", "ReleaseLease", "viewer", release_req(), Code.PERMISSION_DENIED, "authorization"),
    # Bytes that are no message of the method's type.
    Row("garbage lease request", "LeasePrompts", "worker", const(GARBAGE), Code.INVALID_ARGUMENT, "request"),
    Row("garbage submission", "SubmitRollouts", "worker", const(GARBAGE), Code.INVALID_ARGUMENT, "request"),
    Row("garbage pull", "Pull", "worker", const(GARBAGE), Code.INVALID_ARGUMENT, "request"),
    Row("a worker id not UTF-8", "LeasePrompts", "worker", const(b"\x0a\x02\xff\xfe"),
        Code.INVALID_ARGUMENT, "request"),
    Row("garbage publish chunk", "Publish", "trainer", const([GARBAGE]), Code.INVALID_ARGUMENT, "chunks[0]"),
    # Prompts.
    Row("1e5 prompts in one call", "EnqueuePrompts", "trainer", lambda env: pb.EnqueuePromptsRequest(
        prompts=[pb.Prompt(text="a")] * 100_000), Code.INVALID_ARGUMENT, "prompts"),
    Row("over the receive limit", "EnqueuePrompts", "trainer", lambda env: pb.EnqueuePromptsRequest(
        prompts=[pb.Prompt(text="a" * (2 << 20))]), Code.RESOURCE_EXHAUSTED, None),
    Row("one id twice", "EnqueuePrompts", "trainer", const(pb.EnqueuePromptsRequest(prompts=[
        pb.Prompt(id="n", text="a"), pb.Prompt(id="n", text="b")])), Code.INVALID_ARGUMENT, "prompts[1].id"),
    Row("neither text nor tokens", "EnqueuePrompts", "trainer", const(pb.EnqueuePromptsRequest(
        prompts=[pb.Prompt(id="e")])), Code.INVALID_ARGUMENT, "prompts[0]"),
    Row("an id holding a newline", "EnqueuePrompts", "trainer", const(pb.EnqueuePromptsRequest(
        prompts=[pb.Prompt(id="a\nb\x00", text="a")])), Code.INVALID_ARGUMENT, "prompts[0].id"),
    Row("negative token id", "EnqueuePrompts", "trainer", const(pb.EnqueuePromptsRequest(
        prompts=[pb.Prompt(token_ids=[3, -1])])), Code.INVALID_ARGUMENT, "prompts[0].token_ids[1]"),
    Row("begun samples from a client", "EnqueuePrompts", "trainer", const(pb.EnqueuePromptsRequest(
        prompts=[pb.Prompt(text="a", partial=[sample(token_ids=[-5])], partial_version=99)])),
        Code.INVALID_ARGUMENT, "prompts[0].partial"),
    Row("lease n < 1", "LeasePrompts", "worker", lease_req(n=-1), Code.INVALID_ARGUMENT, "n"),
    Row("lease n huge", "LeasePrompts", "worker", lease_req(n=2**31 - 1), Code.INVALID_ARGUMENT, "n"),
    Row("lease deadline NaN", "LeasePrompts", "worker", lease_req(deadline_s=NAN),
        Code.INVALID_ARGUMENT, "deadline_s"),
    Row("lease deadline inf", "LeasePrompts", "worker", lease_req(deadline_s=INF),
        Code.INVALID_ARGUMENT, "deadline_s"),
    Row("lease deadline 0", "LeasePrompts", "worker", lease_req(deadline_s=0.0),
        Code.INVALID_ARGUMENT, "deadline_s"),
    Row("lease deadline huge", "LeasePrompts", "worker", lease_req(deadline_s=1e300),
        Code.INVALID_ARGUMENT, "deadline_s"),
    Row("lease wait huge", "LeasePrompts", "worker", lease_req(wait_s=1e9), Code.INVALID_ARGUMENT, "wait_s"),
    Row("lease without worker id", "LeasePrompts", "worker", lease_req(worker_id=""),
        Code.INVALID_ARGUMENT, "worker_id"),
    Row("lease for a 1e5-character worker id", "LeasePrompts", "worker", lease_req(worker_id="w" * 100_000),
        Code.INVALID_ARGUMENT, "worker_id"),
    Row("lease for a worker id holding a NUL", "LeasePrompts", "worker", lease_req(worker_id="w\x00"),
        Code.INVALID_ARGUMENT, "worker_id"),
    Row("renew unknown lease", "RenewLease", "worker", renew_req(lease_id="nope"),
        Code.NOT_FOUND, "lease_id"),
    Row("renew another's lease", "RenewLease", "worker", renew_req(worker_id="thief"),
        Code.FAILED_PRECONDITION, "worker_id"),
    Row("renew deadline -1", "RenewLease", "worker", renew_req(deadline_s=-1.0),
        Code.INVALID_ARGUMENT, "deadline_s"),
    Row("renew a prompt twice", "RenewLease", "worker", renew_req(*[pb.PartialRollouts(
        prompt_id="p1", samples=[sample()])] * 2), Code.INVALID_ARGUMENT, "partial"),
    Row("renew a prompt of no lease", "RenewLease", "worker", renew_req(pb.PartialRollouts(
        prompt_id="p4", samples=[sample()])), Code.INVALID_ARGUMENT, "partial[0].prompt_id"),
    Row("renew kept < 0", "RenewLease", "worker", renew_req(pb.PartialRollouts(
        prompt_id="p1", samples=[sample()], kept=[-1])), Code.INVALID_ARGUMENT, "partial[0].kept[0]"),
    Row("renew an unpublished version", "RenewLease", "worker", renew_req(pb.PartialRollouts(
        prompt_id="p1", samples=[sample()], policy_version=7)),
        Code.INVALID_ARGUMENT, "partial[0].policy_version"),
    Row("renew NaN log-probs", "RenewLease", "worker", renew_req(pb.PartialRollouts(
        prompt_id="p1", samples=[sample(logprobs_f32=np.array([-1, np.nan, -1], "<f4").tobytes())])),
        Code.INVALID_ARGUMENT, "partial[0].samples[0].logprobs[1]"),
    Row("release another's lease", "ReleaseLease", "worker", release_req(worker_id="thief"),
        Code.FAILED_PRECONDITION, "worker_id"),
    Row("release unknown lease", "ReleaseLease", "worker", release_req(lease_id="nope"),
        Code.NOT_FOUND, "lease_id"),
    Row("release without lease id", "ReleaseLease", "worker", release_req(lease_id=""),
        Code.INVALID_ARGUMENT, "lease_id"),
    Row("release a prompt of no lease", "ReleaseLease", "worker", release_req(prompt_ids=["p1", "p5"]),
        Code.INVALID_ARGUMENT, "prompt_ids[1]"),
    Row("release an answered prompt", "ReleaseLease", "worker", release_req(prompt_ids=["p0"]),
        Code.FAILED_PRECONDITION, "prompt_ids[0]"),
    Row("complete with open prompts", "CompleteLease", "worker", lambda env: pb.CompleteLeaseRequest(
        lease_id=env.lease_id, worker_id=env.worker_id), Code.FAILED_PRECONDITION, "lease_id"),
    # Rollouts.
    Row("submit without group", "SubmitRollouts", "worker", submit_req(), Code.INVALID_ARGUMENT, "group"),
    Row("submit without prompt id", "SubmitRollouts", "worker", submit_req(group("")),
        Code.INVALID_ARGUMENT, "group.prompt_id"),
    Row("submit no samples", "SubmitRollouts", "worker", submit_req(pb.RolloutGroup(prompt_id="p1")),
        Code.INVALID_ARGUMENT, "group.samples"),
    Row("submit 5000 samples", "SubmitRollouts", "worker", submit_req(group("p1", *[sample(1)] * 5000)),
        Code.INVALID_ARGUMENT, "group.samples"),
    Row("submit NaN reward", "SubmitRollouts", "worker", submit_req(group("p1", sample(reward=NAN))),
        Code.INVALID_ARGUMENT, "group.samples[0].reward"),
    Row("submit inf reward", "SubmitRollouts", "worker", submit_req(group("p1", sample(), sample(reward=-INF))),
        Code.INVALID_ARGUMENT, "group.samples[1].reward"),
    Row("submit NaN log-prob", "SubmitRollouts", "worker", submit_req(group("p1", sample(
        logprobs_f32=b"", logprobs=[-0.1, NAN, -0.1]))),
        Code.INVALID_ARGUMENT, "group.samples[0].logprobs[1]"),
    Row("submit -inf log-prob", "SubmitRollouts", "worker", submit_req(group("p1", sample(
        logprobs_f32=np.array([-np.inf, -1, -1], "<f4").tobytes()))), Code.INVALID_ARGUMENT,
        "group.samples[0].logprobs[0]"),
    Row("log-probs shorter than tokens", "SubmitRollouts", "worker", submit_req(group("p1", sample(
        logprobs_f32=np.zeros(2, "<f4").tobytes()))), Code.INVALID_ARGUMENT, "group.samples[0].logprobs"),
    Row("log-probs not whole floats", "SubmitRollouts", "worker", submit_req(group("p1", sample(
        logprobs_f32=bytes(11)))), Code.INVALID_ARGUMENT, "group.samples[0].logprobs"),
    Row("log-probs both ways", "SubmitRollouts", "worker", submit_req(group("p1", sample(
        logprobs=[-1.0, -1.0, -1.0]))), Code.INVALID_ARGUMENT, "group.samples[0].logprobs"),
    Row("negative sample token", "SubmitRollouts", "worker", submit_req(group("p1", sample(
        token_ids=[1, -2, 3]))), Code.INVALID_ARGUMENT, "group.samples[0].token_ids[1]"),
    Row("observed flags of another length", "SubmitRollouts", "worker", submit_req(group("p1", sample(
        observed=b"\x00\x01"))), Code.INVALID_ARGUMENT, "group.samples[0].observed"),
    Row("a version never published", "SubmitRollouts", "worker", submit_req(group("p1", version=3)),
        Code.INVALID_ARGUMENT, "group.policy_version"),
    Row("a negative version", "SubmitRollouts", "worker", submit_req(group("p1", version=-1)),
        Code.INVALID_ARGUMENT, "group.policy_version"),
    Row("failure with samples", "SubmitRollouts", "worker", submit_req(group("p1", failure="too long")),
        Code.INVALID_ARGUMENT, "group.samples"),
    Row("submit to an unknown lease", "SubmitRollouts", "worker", submit_req(group("p1"), lease_id="nope"),
        Code.NOT_FOUND, "lease_id"),
    Row("submit to another's lease", "SubmitRollouts", "worker", submit_req(group("p1"), worker_id="thief"),
        Code.FAILED_PRECONDITION, "worker_id"),
    Row("submit a prompt of no lease", "SubmitRollouts", "worker", submit_req(group("p4")),
        Code.INVALID_ARGUMENT, "group.prompt_id"),
    Row("another group for an answered prompt", "SubmitRollouts", "worker", submit_req(group("p0", sample(2))),
        Code.FAILED_PRECONDITION, "group"),
    Row("a group over the receive limit", "SubmitRollouts", "worker", lambda env: submit_req(group(
        "p1", sample(text="x" * (2 << 20))))(env), Code.RESOURCE_EXHAUSTED, None),
    Row("take 0 groups", "TakeRollouts", "trainer", take_req(max_groups=0),
        Code.INVALID_ARGUMENT, "max_groups"),
    Row("take 2^31-1 groups", "TakeRollouts", "trainer", take_req(max_groups=2**31 - 1),
        Code.INVALID_ARGUMENT, "max_groups"),
    Row("take from version -1", "TakeRollouts", "trainer", take_req(min_version=-1),
        Code.INVALID_ARGUMENT, "min_version"),
    Row("take from a version never published", "TakeRollouts", "trainer", take_req(min_version=10**18),
        Code.FAILED_PRECONDITION, "min_version"),
    Row("take ack deadline NaN", "TakeRollouts", "trainer", take_req(ack_deadline_s=NAN),
        Code.INVALID_ARGUMENT, "ack_deadline_s"),
    Row("take ack deadline huge", "TakeRollouts", "trainer", take_req(ack_deadline_s=1e12),
        Code.INVALID_ARGUMENT, "ack_deadline_s"),
    Row("take wait -inf", "TakeRollouts", "trainer", take_req(wait_s=-INF), Code.INVALID_ARGUMENT, "wait_s"),
    Row("ack an unknown take", "AckRollouts", "trainer", const(pb.AckRolloutsRequest(take_id="nope")),
        Code.NOT_FOUND, "take_id"),
    Row("ack no take", "AckRollouts", "trainer", const(pb.AckRolloutsRequest()),
        Code.INVALID_ARGUMENT, "take_id"),
    # Its message echoed the 20 kB id past gRPC's metadata limit: RESOURCE_EXHAUSTED instead.
    Row("ack a take of a huge id", "AckRollouts", "trainer",
        const(pb.AckRolloutsRequest(take_id="x" * 20000)), Code.NOT_FOUND, "take_id"),
    # Workers.
    Row("register without name", "RegisterWorker", "worker", const(pb.RegisterWorkerRequest()),
        Code.INVALID_ARGUMENT, "name"),
    Row("register a name of two lines", "RegisterWorker", "worker",
        const(pb.RegisterWorkerRequest(name="w\nx")), Code.INVALID_ARGUMENT, "name"),
    Row("register a long name", "RegisterWorker", "worker", const(pb.RegisterWorkerRequest(name="n" * 129)),
        Code.INVALID_ARGUMENT, "name"),
    Row("heartbeat without id", "Heartbeat", "worker", const(pb.HeartbeatRequest()),
        Code.INVALID_ARGUMENT, "worker_id"),
    Row("heartbeat of a 1e5-character id", "Heartbeat", "worker",
        const(pb.HeartbeatRequest(worker_id="w" * 100_000)),
        Code.INVALID_ARGUMENT, "worker_id"),
    Row("heartbeat inf tokens/s", "Heartbeat", "worker", const(pb.HeartbeatRequest(worker_id="w", tokens_per_s=INF)),
        Code.INVALID_ARGUMENT, "tokens_per_s"),
    Row("heartbeat version -2", "Heartbeat", "worker", const(pb.HeartbeatRequest(worker_id="w", version=-2)),
        Code.INVALID_ARGUMENT, "version"),
    Row("heartbeat NaN seconds decoding", "Heartbeat", "worker", const(pb.HeartbeatRequest(
        worker_id="w", time=pb.WorkerTime(decoding_s=NAN))), Code.INVALID_ARGUMENT, "time.decoding_s"),
    Row("register with 17 kB of metadata keys", "RegisterWorker", "worker", const(pb.RegisterWorkerRequest(
        name="w", metadata={"k" * (17 << 10): ""})), Code.INVALID_ARGUMENT, "metadata"),
    Row("heartbeat of an unknown kind", "Heartbeat", "worker", const(pb.HeartbeatRequest(worker_id="w", kind="x")),
        Code.INVALID_ARGUMENT, "kind"),
    # Weights.
    Row("pull from a version never published", "Pull", "worker", const(pb.PullRequest(have_version=2**62)),
        Code.FAILED_PRECONDITION, "have_version"),
    Row("pull from version -2", "Pull", "worker", const(pb.PullRequest(have_version=-2)),
        Code.INVALID_ARGUMENT, "have_version"),
    Row("pull resuming at -1", "Pull", "worker", const(pb.PullRequest(resume_offset=-1)),
        Code.INVALID_ARGUMENT, "resume_offset"),
    Row("watch after -2", "Watch", "worker", const(pb.WatchRequest(after_version=-2)),
        Code.INVALID_ARGUMENT, "after_version"),
    Row("publish nothing", "Publish", "trainer", const([]), Code.INVALID_ARGUMENT, "chunks"),
    Row("publish total -1", "Publish", "trainer", lambda env: chunks(keyframe(1), total=-1),
        Code.INVALID_ARGUMENT, "total_bytes"),
    Row("publish total 2^62", "Publish", "trainer", lambda env: chunks(keyframe(1), total=2**62),
        Code.RESOURCE_EXHAUSTED, "total_bytes"),
    Row("publish truncated", "Publish", "trainer", lambda env: chunks(keyframe(1))[:-1],
        Code.INVALID_ARGUMENT, "total_bytes"),
    Row("publish a truncated update", "Publish", "trainer", lambda env: chunks(keyframe(1)[:-100]),
        Code.INVALID_ARGUMENT, "data"),
    Row("publish chunks out of order", "Publish", "trainer", lambda env: chunks(keyframe(1))[::-1],
        Code.INVALID_ARGUMENT, "offset"),
    Row("publish a chunk over the limit", "Publish", "trainer", lambda env: chunks(keyframe(1), step=8192),
        Code.RESOURCE_EXHAUSTED, "data"),
    Row("publish another shape", "Publish", "trainer",
        lambda env: chunks(keyframe(1, embed=np.zeros((8, 8), np.float32))),
        Code.FAILED_PRECONDITION, "tensors['embed']"),
    Row("publish an old version", "Publish", "trainer",
        lambda env: chunks(keyframe(0, embed=np.ones((64, 32), np.float32))),
        Code.FAILED_PRECONDITION, "version"),
    Row("publish a run id with spaces", "Publish", "trainer", lambda env: chunks(keyframe(1), run=" r1 "),
        Code.INVALID_ARGUMENT, "run"),
    Row("publish a run id over 128 characters", "Publish", "trainer", lambda env: chunks(keyframe(1), run="r" * 200),
        Code.INVALID_ARGUMENT, "run"),
]


def send(env, row):
  """Sends the row's request; returns (status code, details)."""
  request = row.request(env)
  path = f"/{SERVICE_NAME}/{row.method}"
  raw = isinstance(request, bytes) or (isinstance(request, list) and request
                                       and isinstance(request[0], bytes))
  kind = {"Publish": env.channel.stream_unary, "Pull": env.channel.unary_stream,
          "Watch": env.channel.unary_stream}.get(row.method, env.channel.unary_unary)
  call = kind(path, request_serializer=(lambda b: b) if raw else (lambda m: m.SerializeToString()),
              response_deserializer=lambda b: b)
  if row.method == "Publish":
    request = iter(request)
  try:
    reply = call(request, metadata=metadata(row.role), timeout=10)
    if row.method in ("Pull", "Watch"):
      next(reply)
  except grpc.RpcError as e:
    return e.code(), e.details()
  return Code.OK, "accepted"


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_a_bad_request_gets_a_status_naming_the_field_and_changes_nothing(env, row):
  queues, latest, errors = state(env)
  code, details = send(env, row)
  assert code == row.code, details
  if row.field is None:
    assert "larger than max" in details
  else:
    assert details.startswith(f"{row.field}: "), details
  assert state(env) == (queues, latest, errors + (row.field is not None))


def test_an_enqueue_of_a_prompt_whose_group_waits_is_a_retry(env):
  """p0's group waits for the trainer: enqueued again, p0 would sit in the queue too, and be
  in two places once that group is dropped as stale."""
  reply = env.stub.EnqueuePrompts(pb.EnqueuePromptsRequest(prompts=[pb.Prompt(id="p0", text="again")]),
                                  metadata=metadata("trainer"))
  assert (list(reply.ids), reply.duplicates, reply.queue_depth) == (["p0"], 1, 3)


def test_concurrent_duplicate_submissions_accept_one_group_per_prompt(env):
  lease = env.stub.LeasePrompts(pb.LeasePromptsRequest(worker_id=env.worker_id, n=2, deadline_s=DAY_S),
                                metadata=metadata("worker"))
  first, second = (p.id for p in lease.prompts)
  sends = [group(first)] * 6 + [group(second, sample(k + 1)) for k in range(6)]
  replies = [None] * len(sends)

  def send_one(i):
    try:
      replies[i] = submit(env, sends[i], lease_id=lease.lease_id)
    except grpc.RpcError as e:
      replies[i] = e.code()

  threads = [threading.Thread(target=send_one, args=(i,)) for i in range(len(sends))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  same, different = replies[:6], replies[6:]
  assert sorted(r.duplicate for r in same) == [False] + [True] * 5
  assert len({r.rollout_id for r in same}) == 1
  accepted = [r for r in different if not isinstance(r, grpc.StatusCode)]
  assert len(accepted) == 1 and not accepted[0].duplicate
  assert [r for r in different if isinstance(r, grpc.StatusCode)] == [Code.FAILED_PRECONDITION] * 5
  env.accepted += 2
  stats = env.stub.GetStats(pb.GetStatsRequest(), metadata=metadata("viewer"))
  assert (stats.rollouts_ready, stats.rollouts_accepted) == (env.accepted, env.accepted)


def test_after_the_bad_requests_a_restart_replays_the_good_state(env):
  queues, latest, _ = state(env)
  config = env.server.config
  env.channel.close()
  env.server.stop(grace=0)
  env.connect(ParamServer(config).start())
  assert state(env)[:2] == (queues, latest)
  stats = env.stub.GetStats(pb.GetStatsRequest(), metadata=metadata("viewer"))
  assert (stats.rollouts_ready, stats.rollouts_accepted, stats.leases_active) == (
      env.accepted, env.accepted, 1)
  take = env.stub.TakeRollouts(pb.TakeRolloutsRequest(max_groups=8, ack_deadline_s=30.0),
                               metadata=metadata("trainer"))
  assert len(take.rollouts) == env.accepted
