"""The prompt queue, prompt leases and the rollout queue, as one logged state machine.

Every change is validated first, written to the write-ahead log as one
`WalRecord`, then applied by `_apply`, the same function recovery replays, so
the state after a restart is exactly the acknowledged state. Invariant: every
prompt is in exactly one place: the queue, an open lease, or (answered) a
rollout group waiting for the trainer; a lease that expires or is released puts
its unanswered prompts back at the front of the queue.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
import math
import threading
import time
import uuid
from typing import Callable, Iterator, Sequence

import numpy as np
from absl import logging

from param_server import errors
from param_server.protos import param_server_pb2 as pb
from param_server.wal import WriteAheadLog


@dataclasses.dataclass(frozen=True)
class QueueLimits:
  """Bounds on requests; anything outside them is rejected, naming the field."""
  max_prompts_per_enqueue: int = 10_000
  max_lease_prompts: int = 1024
  max_lease_deadline_s: float = 3600.0
  max_wait_s: float = 60.0
  max_take_groups: int = 4096
  max_samples_per_group: int = 4096
  # Closed or expired leases remembered to acknowledge retried submissions (a forgotten
  # one's retry is answered NOT_FOUND, its group long accepted): each holds ~1.3 KB and is
  # rewritten in every compaction, so the history stays a few tens of MB.
  closed_lease_history: int = 20_000
  acked_take_history: int = 10_000
  # Rewrite the log as one snapshot after this many records, or once it holds this many
  # bytes and 4x its size after the last rewrite (begun samples sent with every renewal
  # replace the last ones, so the log grows faster than the state it holds).
  wal_compact_records: int = 20_000
  wal_compact_bytes: int = 64 << 20
  # The snapshot is taken under the lock (references: the state is copied on write) and
  # written beside the calls, in records of about this many bytes (one protobuf message
  # holds < 2 GiB). False: written in the call that made it due (tests).
  wal_snapshot_record_bytes: int = 64 << 20
  compact_in_background: bool = True
  # A prompt with the begun samples it holds, at most: one lease reply must carry it
  # (increments joined past it would leave the prompt leased to no one at every deadline).
  max_prompt_bytes: int = 16 << 20


@dataclasses.dataclass
class LeaseState:
  lease_id: str
  worker_id: str
  prompt_ids: list[str]
  deadline: float
  answered: dict[str, int] = dataclasses.field(default_factory=dict)
  fingerprints: dict[str, bytes] = dataclasses.field(default_factory=dict)
  released: set[str] = dataclasses.field(default_factory=set)
  expired: bool = False

  @property
  def open_ids(self) -> list[str]:
    return [p for p in self.prompt_ids if p not in self.answered and p not in self.released]

  @property
  def closed(self) -> bool:
    return self.expired or not self.open_ids


@dataclasses.dataclass(frozen=True)
class _Captured:
  """The queues' state at one point of the log (`_capture`), for a snapshot of it."""
  queued: list[pb.Prompt]
  leases: list[tuple["LeaseState", list[pb.Prompt]]]  # with the open prompts' records
  rollouts: list["RolloutEntry"]
  takes: list[tuple[str, list[int], float]]
  acked_takes: dict[str, int]
  next_rollout_id: int
  counters: collections.Counter


@dataclasses.dataclass
class RolloutEntry:
  rollout_id: int
  prompt: pb.Prompt
  group: pb.RolloutGroup
  worker_id: str


def _durable(method):
  """Runs a public method, then waits (outside the lock) until what it logged is on disk; one
  that logged nothing (a duplicate submission, a repeated ack) answers from state another
  call's records made, so it waits until all logged so far is on disk."""
  @functools.wraps(method)
  def wrapper(self, *args, **kwargs):
    depth = getattr(self._local, "depth", 0)
    if depth == 0:
      self._local.position = 0
    self._local.depth = depth + 1
    try:
      return method(self, *args, **kwargs)
    finally:
      self._local.depth = depth
      if depth == 0:  # the outermost call syncs, after its lock is released
        self._wal.sync(self._local.position or self._wal.written)
  return wrapper


def group_fingerprint(group: pb.RolloutGroup) -> bytes:
  return hashlib.sha256(group.SerializeToString(deterministic=True)).digest()


MAX_ID_CHARS = 512  # a prompt's or a worker's id, kept in the write-ahead log
# A log-probability is <= 0; past this a worker's are wrong (they would skew the importance
# ratios of loss.correction), not rounded.
LOGPROB_SLACK = 1e-3


def check_id(field: str, value: str) -> None:
  """InvalidArgument naming `field` when an id is longer than MAX_ID_CHARS or holds a
  control character (a newline split `rlax-ps status`'s table; errors echoed a NUL)."""
  if len(value) > MAX_ID_CHARS:
    raise errors.InvalidArgument(field, f"expected at most {MAX_ID_CHARS} characters, got {len(value)}")
  if not value.isprintable():
    raise errors.InvalidArgument(field, f"expected printable characters, got {value!r}")


def _validate_prompt(prompt: pb.Prompt, where: str) -> None:
  if not prompt.text and not prompt.token_ids:
    raise errors.InvalidArgument(f"{where}", "a prompt needs text or token_ids, got neither")
  for i, t in enumerate(prompt.token_ids):
    if t < 0:
      raise errors.InvalidArgument(f"{where}.token_ids[{i}]", f"expected >= 0, got {t}")
  check_id(f"{where}.id", prompt.id)
  if prompt.partial or prompt.partial_version:
    raise errors.InvalidArgument(f"{where}.partial", "expected none: begun samples are set by the "
                                 "server (a released prompt's), got "
                                 f"{len(prompt.partial)} samples at v{prompt.partial_version}")


MAX_FAILURE_CHARS = 2000  # a worker's reason for not sampling a prompt, kept with it


def check_policy_version(group: pb.RolloutGroup, latest_version: int,
                         where: str = "group") -> None:
  """InvalidArgument unless the group's policy version is one the server published."""
  top = max(latest_version, 0)
  if not 0 <= group.policy_version <= top:
    raise errors.InvalidArgument(
        f"{where}.policy_version", f"expected a published version in [0, {top}], got {group.policy_version}")


def validate_group(group: pb.RolloutGroup, *, latest_version: int | None, max_samples: int,
                   where: str = "group", partial: bool = False) -> None:
  """Checks a submitted rollout group's fields (or `partial` rollouts', as a group named
  `where`: their samples' routes come without the prompt's); raises InvalidArgument naming
  the field. `latest_version` None: its policy version is checked apart
  (`check_policy_version`)."""
  if not group.prompt_id:
    raise errors.InvalidArgument(f"{where}.prompt_id", "expected a prompt id, got ''")
  if group.failure and (group.samples or partial):
    raise errors.InvalidArgument(f"{where}.samples", f"expected none with a failure (the "
                                 f"prompt could not be sampled), got {len(group.samples)}")
  if len(group.failure) > MAX_FAILURE_CHARS:
    raise errors.InvalidArgument(f"{where}.failure", f"expected at most {MAX_FAILURE_CHARS} "
                                 f"characters, got {len(group.failure)}")
  if not group.samples and not group.failure:
    raise errors.InvalidArgument(f"{where}.samples", "expected at least one sample (or a "
                                 "failure saying why there is none), got 0")
  if len(group.samples) > max_samples:
    raise errors.InvalidArgument(f"{where}.samples", f"expected at most {max_samples}, got {len(group.samples)}")
  if latest_version is not None:
    check_policy_version(group, latest_version, where)
  if group.HasField("baseline_reward") and not math.isfinite(group.baseline_reward):
    raise errors.InvalidArgument(f"{where}.baseline_reward",
                                 f"expected a finite number, got {group.baseline_reward}")
  for i, s in enumerate(group.samples):
    at = f"{where}.samples[{i}]"
    if not math.isfinite(s.reward):
      raise errors.InvalidArgument(f"{at}.reward", f"expected a finite number, got {s.reward}")
    if s.logprobs and s.logprobs_f32:
      raise errors.InvalidArgument(f"{at}.logprobs", "expected logprobs or logprobs_f32, got both")
    n_lp = len(s.logprobs) if s.logprobs else len(s.logprobs_f32) / 4
    if (s.logprobs or s.logprobs_f32) and n_lp != len(s.token_ids):
      raise errors.InvalidArgument(
          f"{at}.logprobs", f"expected one per token ({len(s.token_ids)}), got {n_lp:g}")
    logprobs = _f32(s)
    bad = np.flatnonzero(~np.isfinite(logprobs))
    if bad.size:
      j = int(bad[0])
      raise errors.InvalidArgument(f"{at}.logprobs[{j}]", f"expected a finite number, got "
                                   f"{logprobs[j]} ({bad.size} of {logprobs.size} are not)")
    above = np.flatnonzero(logprobs > LOGPROB_SLACK)
    if above.size:
      j = int(above[0])
      raise errors.InvalidArgument(f"{at}.logprobs[{j}]", f"expected a log-probability (<= 0), "
                                   f"got {logprobs[j]} ({above.size} of {logprobs.size} are above)")
    negative = np.flatnonzero(np.asarray(s.token_ids, np.int64) < 0)
    if negative.size:
      j = int(negative[0])
      raise errors.InvalidArgument(f"{at}.token_ids[{j}]", f"expected >= 0, got {s.token_ids[j]}")
    if s.observed and (len(s.observed) != len(s.token_ids) or s.observed.strip(b"\x00\x01")):
      other = "" if len(s.observed) != len(s.token_ids) else " holding other values"
      raise errors.InvalidArgument(
          f"{at}.observed", f"expected one byte 0 or 1 per token ({len(s.token_ids)}), got "
          f"{len(s.observed)} bytes{other}")
    _validate_teacher(s, at)
  _validate_routes(group, where, partial)


def _validate_teacher(s: pb.Sample, at: str) -> None:
  """A sample's teacher scores (worker.teacher): one float32 log-prob per token, and top-k
  ids and log-probs of k per token, all finite, ids >= 0; or none."""
  n = len(s.token_ids)
  lp = s.teacher_logprobs_f32
  if lp and (len(lp) != 4 * n or not _log_probabilities(np.frombuffer(lp, "<f4"))):
    raise errors.InvalidArgument(f"{at}.teacher_logprobs_f32", f"expected {n} finite float32 "
                                 f"log-probabilities <= 0 (one per token), got {len(lp)} bytes")
  ids, top = s.teacher_topk_ids, s.teacher_topk_logprobs_f32
  if ids or top:
    if not n or len(ids) != len(top) or len(ids) % (4 * n):
      raise errors.InvalidArgument(f"{at}.teacher_topk_ids", f"expected k int32 ids and k "
                                   f"float32 log-probs per token ({n}), got {len(ids)} and "
                                   f"{len(top)} bytes")
    if (np.frombuffer(ids, "<i4") < 0).any() or not _log_probabilities(np.frombuffer(top, "<f4")):
      raise errors.InvalidArgument(f"{at}.teacher_topk_ids", "expected ids >= 0 and finite "
                                   "log-probs <= 0")


def _log_probabilities(values: np.ndarray) -> bool:
  """Whether every value is a finite log-probability (<= 0, give or take LOGPROB_SLACK)."""
  return bool(np.isfinite(values).all() and (values <= LOGPROB_SLACK).all())


def _routes_tokens(routes: pb.Routes, where: str) -> int:
  """How many tokens a Routes message covers; InvalidArgument unless its bytes fit."""
  if routes.id_bytes not in (1, 2) or routes.layers < 1 or routes.top_k < 1:
    raise errors.InvalidArgument(where, f"expected id_bytes 1 or 2 and layers, top_k >= 1, got "
                                 f"{routes.id_bytes}, {routes.layers}, {routes.top_k}")
  row = routes.layers * routes.top_k * routes.id_bytes
  if len(routes.ids) % row:
    raise errors.InvalidArgument(f"{where}.ids", f"expected a multiple of {row} bytes (layers x "
                                 f"top_k x id_bytes), got {len(routes.ids)}")
  return len(routes.ids) // row


def _validate_routes(group: pb.RolloutGroup, where: str, partial: bool = False) -> None:
  """Routing replay: routes for the prompt (not for partial rollouts) and every sample
  (every token but the last), all of one shape, or none at all."""
  routed = [s.HasField("routes") for s in group.samples]
  if not group.HasField("prompt_routes") and not any(routed):
    return
  first = group.samples[routed.index(True)].routes if any(routed) else group.prompt_routes
  if not partial:
    if not group.HasField("prompt_routes"):
      raise errors.InvalidArgument(f"{where}.prompt_routes", "expected with the samples' routes")
    _routes_tokens(group.prompt_routes, f"{where}.prompt_routes")
    first = group.prompt_routes
  shape = (first.layers, first.top_k)
  for i, s in enumerate(group.samples):
    at = f"{where}.samples[{i}].routes"
    if not s.HasField("routes"):
      raise errors.InvalidArgument(at, f"expected with {where}.prompt_routes" if not partial
                                   else "expected with the other samples' routes")
    if (s.routes.layers, s.routes.top_k) != shape:
      raise errors.InvalidArgument(at, f"expected layers, top_k = {shape} as the "
                                   f"{'prompt' if not partial else 'first sample'}'s, got "
                                   f"{(s.routes.layers, s.routes.top_k)}")
    tokens, want = _routes_tokens(s.routes, at), max(len(s.token_ids) - 1, 0)
    if tokens != want:
      raise errors.InvalidArgument(at, f"expected {want} tokens (all but the last), got {tokens}")


def joined_partial(held: Sequence[pb.Sample], part: pb.PartialRollouts,
                   where: str = "partial") -> pb.PartialRollouts:
  """Begun samples whole. With `part.kept` (an incremental checkpoint) sample i is the first
  kept[i] tokens of the held sample i followed by part's sample i (whose other fields
  win); without, `part` as it is. InvalidArgument names a count that does not fit."""
  if not part.kept:
    return part
  if len(part.kept) != len(part.samples):
    raise errors.InvalidArgument(f"{where}.kept", f"expected one count per sample "
                                 f"({len(part.samples)}), got {len(part.kept)}")
  whole = pb.PartialRollouts(prompt_id=part.prompt_id, policy_version=part.policy_version)
  for i, (sample, k) in enumerate(zip(part.samples, part.kept)):
    have = len(held[i].token_ids) if i < len(held) else 0
    if not 0 <= k <= have:
      raise errors.InvalidArgument(f"{where}.kept[{i}]", f"expected 0 to the {have} tokens held "
                                   f"for sample {i}, got {k}")
    whole.samples.append(_joined(held[i], k, sample, f"{where}.samples[{i}]") if k else sample)
  return whole


def _joined(held: pb.Sample, k: int, new: pb.Sample, where: str) -> pb.Sample:
  """The first k tokens of `held` (with their log-probs, observed flags and routes), then
  `new`'s; the rest of `new` as it is."""
  if len(new.logprobs_f32) % 4:  # (checked whole after the join: frombuffer raises first)
    raise errors.InvalidArgument(f"{where}.logprobs_f32", f"expected 4 bytes a log-prob, got "
                                 f"{len(new.logprobs_f32)} bytes")
  out = pb.Sample(text=new.text, reward=new.reward, finish_reason=new.finish_reason,
                  metadata=new.metadata)
  out.token_ids.extend(held.token_ids[:k])
  out.token_ids.extend(new.token_ids)
  n = len(new.token_ids)
  if held.logprobs or held.logprobs_f32 or new.logprobs or new.logprobs_f32:
    out.logprobs_f32 = _f32(held)[:k].tobytes() + _f32(new).tobytes()
  if held.observed or new.observed:
    out.observed = (held.observed[:k] or bytes(k)) + (new.observed or bytes(n))
  if held.HasField("routes") or new.HasField("routes"):
    routes = [r for r, has in ((held.routes, held.HasField("routes")),
                               (new.routes, new.HasField("routes"))) if has]
    if new.HasField("routes"):
      _routes_tokens(new.routes, f"{where}.routes")
    if len({(r.layers, r.top_k) for r in routes}) > 1:
      raise errors.InvalidArgument(f"{where}.routes", f"expected layers, top_k = "
                                   f"{(held.routes.layers, held.routes.top_k)} as the held "
                                   f"sample's, got {(new.routes.layers, new.routes.top_k)}")
    layers, top_k = routes[0].layers, routes[0].top_k
    width = max(r.id_bytes for r in routes)
    ids = [np.frombuffer(r.ids, f"<u{r.id_bytes}").astype(f"<u{width}") for r in routes]
    if held.HasField("routes"):  # every token but the last: the first k tokens' k - 1 rows
      ids[0] = ids[0][:max(k - 1, 0) * layers * top_k]
    out.routes.CopyFrom(pb.Routes(ids=b"".join(a.tobytes() for a in ids), layers=layers,
                                  top_k=top_k, id_bytes=width))
  return out


def _f32(sample: pb.Sample) -> np.ndarray:
  """A sample's log-probs as little-endian float32, whichever way they were sent."""
  if sample.logprobs_f32:
    return np.frombuffer(sample.logprobs_f32, "<f4")
  return np.asarray(sample.logprobs, "<f4")


def _oldest_policy_first(entries) -> list[RolloutEntry]:
  """Ready groups in the order a take hands them out: oldest policy version first (ties:
  submission order), so a group sampled by an older policy is trained on before it falls
  under the trainer's staleness floor and is dropped, its sampling wasted."""
  return sorted(entries, key=lambda e: (e.group.policy_version, e.rollout_id))


def _without_partial(prompt: pb.Prompt) -> pb.Prompt:
  """A copy of the prompt without the partial rollouts it carried."""
  copy = pb.Prompt()
  copy.CopyFrom(prompt)
  copy.ClearField("partial")
  copy.ClearField("partial_version")
  return copy


class PromptRolloutQueues:
  """Prompt queue + leases + rollout queue; thread-safe, durable through a WriteAheadLog."""

  def __init__(self, wal: WriteAheadLog, *, limits: QueueLimits = QueueLimits(),
               clock: Callable[[], float] = time.time,
               latest_version: Callable[[], int] = lambda: -1):
    self.limits = limits
    self._wal = wal
    self._clock = clock
    self._latest_version = latest_version
    self._lock = threading.RLock()
    self._local = threading.local()
    self._cond = threading.Condition(self._lock)
    self._compact_after = 0  # a failed compaction: records since the rewrite before a retry
    self._compaction: threading.Thread | None = None  # the one under way
    self.prompts: dict[str, pb.Prompt] = {}  # queued or leased
    self.queue: collections.OrderedDict[str, None] = collections.OrderedDict()
    self.leases: dict[str, LeaseState] = {}  # open ones
    self.closed_leases: collections.OrderedDict[str, LeaseState] = collections.OrderedDict()
    self.ready: collections.OrderedDict[int, RolloutEntry] = collections.OrderedDict()
    self.in_flight: dict[int, RolloutEntry] = {}
    self.takes: dict[str, tuple[list[int], float]] = {}
    self.acked_takes: collections.OrderedDict[str, int] = collections.OrderedDict()
    self.next_rollout_id = 1
    self.counters = collections.Counter()
    # The min_version of the trainer's latest take, named in lease and submission replies
    # so that workers stop prompts begun on an older policy. Not logged: after a restart
    # 0 (no floor) until the trainer's next take says it again.
    self.staleness_floor = 0
    for record in wal.recovered:
      self._apply(record)
    wal.recovered = []

  # ------------------------------------------------------------ logging core

  def _commit(self, record: pb.WalRecord, joined: dict | None = None) -> None:
    """Logs then applies one record; called with the lock held. The calling public method
    returns only once the record is on disk (`_durable`). `joined`: its increments joined
    already (by prompt id), as validation made them."""
    self._local.position = self._wal.append(record)
    try:
      self._apply(record, joined)
    except Exception:
      # A record that cannot be applied would fail every replay: the log becomes what the
      # server holds now, so that it still starts after this, and the caller gets the error.
      logging.exception("queues: a %s record failed to apply; the log is rewritten as the "
                        "state held now", record.WhichOneof("op"))
      self._wal.rewrite(self._snapshot())
      raise
    wal = self._wal
    if ((wal.records_since_rewrite >= self.limits.wal_compact_records
         or wal.bytes >= max(self.limits.wal_compact_bytes, 4 * wal.base_bytes))
        and wal.records_since_rewrite >= self._compact_after and self._compaction is None):
      self._compaction = threading.Thread(
          target=self._compact, args=(self._capture(), wal.mark()), name="wal-compaction",
          daemon=True)
      if self.limits.compact_in_background:
        self._compaction.start()
      else:
        self._compaction.run()
    self._cond.notify_all()

  def _compact(self, state: "_Captured", since) -> None:
    """Rewrites the log as `state`, the state at `since`, and what was logged after it."""
    wal = self._wal
    try:
      wal.rewrite(self._snapshot(state), since=since)
      failed = False
    except Exception:  # noqa: BLE001 - compaction only saves space: the changes are logged
      # and applied, and their callers heard so (a retry would lease or take again)
      logging.exception("queues: compacting the write-ahead log failed; %s",
                        "the log takes no more changes until a restart" if wal.broken else
                        f"it grows on, and compaction is tried again after "
                        f"{self.limits.wal_compact_records} more records")
      failed = True
    with self._lock:
      self._compact_after = (wal.records_since_rewrite + self.limits.wal_compact_records
                             if failed else 0)
      self._compaction = None

  def wait_compacted(self) -> None:
    """Returns once no compaction is under way."""
    with self._lock:
      compaction = self._compaction
    if compaction is not None and compaction.is_alive():
      compaction.join()

  def _apply(self, record: pb.WalRecord, joined: dict | None = None) -> None:
    op = record.WhichOneof("op")
    if op == "snapshot":
      self._load_snapshot(record.snapshot)
    elif op == "enqueue":
      for p in record.enqueue.prompts:
        self.prompts[p.id] = p
        self.queue[p.id] = None
    elif op == "lease":
      r = record.lease
      for pid in r.prompt_ids:
        del self.queue[pid]
        partial = self.prompts[pid].partial
        begun = sum(bool(s.token_ids) for s in partial)
        if begun:
          self.counters["prompts_resumed"] += 1
          self.counters["samples_resumed"] += begun
          self.counters["tokens_resumed"] += sum(len(s.token_ids) for s in partial)
      self.leases[r.lease_id] = LeaseState(r.lease_id, r.worker_id, list(r.prompt_ids), r.deadline_unix_s)
    elif op == "renew":
      self.leases[record.renew.lease_id].deadline = record.renew.deadline_unix_s
      self._hold_partial(record.renew.partial, joined)
    elif op == "returned":
      r = record.returned
      lease = self.leases[r.lease_id]
      self._hold_partial(r.partial, joined)
      for pid in reversed(r.prompt_ids):
        self.queue[pid] = None
        self.queue.move_to_end(pid, last=False)
      if r.expired:
        lease.expired = True
        self.counters["leases_expired"] += 1
      else:
        lease.released.update(r.prompt_ids)
      self._close_if_done(lease)
    elif op == "submit":
      r = record.submit
      lease = self.leases[r.lease_id]
      pid = r.group.prompt_id
      lease.answered[pid] = r.rollout_id
      lease.fingerprints[pid] = r.fingerprint
      prompt = self.prompts.pop(pid)
      if prompt.partial:  # answered: were its group dropped as stale, it starts afresh
        prompt = _without_partial(prompt)
      self.ready[r.rollout_id] = RolloutEntry(r.rollout_id, prompt, r.group, r.worker_id)
      self.next_rollout_id = max(self.next_rollout_id, r.rollout_id + 1)
      self.counters["rollouts_accepted"] += 1
      self._close_if_done(lease)
    elif op == "take":
      r = record.take
      for rid in r.rollout_ids:
        self.in_flight[rid] = self.ready.pop(rid)
      self.takes[r.take_id] = (list(r.rollout_ids), r.deadline_unix_s)
    elif op == "ack":
      ids, _ = self.takes.pop(record.ack.take_id)
      for rid in ids:
        del self.in_flight[rid]
      self.acked_takes[record.ack.take_id] = len(ids)
      while len(self.acked_takes) > self.limits.acked_take_history:
        self.acked_takes.popitem(last=False)
    elif op == "requeue_take":
      ids, _ = self.takes.pop(record.requeue_take.take_id)
      for rid in ids:
        self.ready[rid] = self.in_flight.pop(rid)
      self.ready = collections.OrderedDict(sorted(self.ready.items()))
      self.counters["takes_requeued"] += 1
    elif op == "drop_stale":
      for rid in reversed(record.drop_stale.rollout_ids):
        entry = self.ready.pop(rid)
        self.prompts[entry.prompt.id] = entry.prompt
        self.queue[entry.prompt.id] = None
        self.queue.move_to_end(entry.prompt.id, last=False)
      self.counters["rollouts_stale_dropped"] += len(record.drop_stale.rollout_ids)
    else:
      raise ValueError(f"write-ahead log record: unknown op {op!r}")

  def _hold_partial(self, parts: Sequence[pb.PartialRollouts],
                    joined: dict | None = None) -> None:
    """Each prompt named keeps these begun samples (in place of any it had; increments
    joined to them, or taken from `joined`), for the next worker should it go back to the
    queue."""
    for part in parts:  # a copy: a lease reply may still hold the prompt as it was
      prompt = pb.Prompt()
      prompt.CopyFrom(self.prompts[part.prompt_id])
      part = (joined or {}).get(part.prompt_id) or joined_partial(prompt.partial, part)
      del prompt.partial[:]
      prompt.partial.extend(part.samples)
      prompt.partial_version = part.policy_version
      self.prompts[part.prompt_id] = prompt

  def _close_if_done(self, lease: LeaseState) -> None:
    if lease.closed and lease.lease_id in self.leases:
      del self.leases[lease.lease_id]
      self.closed_leases[lease.lease_id] = lease
      while len(self.closed_leases) > self.limits.closed_lease_history:
        self.closed_leases.popitem(last=False)

  def _capture(self) -> "_Captured":
    """The state now, for `_snapshot`; called with the lock held. Cheap: prompts, groups and
    closed leases are replaced, never changed in place, so it keeps references to them; open
    leases change in place and are copied."""
    return _Captured(
        queued=[self.prompts[p] for p in self.queue],
        leases=[(lease, []) for lease in self.closed_leases.values()] + [
            (dataclasses.replace(lease, prompt_ids=list(lease.prompt_ids),
                                 answered=dict(lease.answered),
                                 fingerprints=dict(lease.fingerprints),
                                 released=set(lease.released)),
             [self.prompts[p] for p in lease.open_ids] if not lease.closed else [])
            for lease in self.leases.values()],
        rollouts=sorted(list(self.ready.values()) + list(self.in_flight.values()),
                        key=lambda e: e.rollout_id),
        takes=[(take_id, list(ids), deadline) for take_id, (ids, deadline) in self.takes.items()],
        acked_takes=dict(self.acked_takes), next_rollout_id=self.next_rollout_id,
        counters=collections.Counter(self.counters))

  def _snapshot(self, state: "_Captured | None" = None) -> Iterator[pb.WalRecord]:
    """The snapshot records of `state` (default: the state now, under the lock), about
    limits.wal_snapshot_record_bytes each: the first with the counters, then continuations;
    the takes come last, after the rollouts they move."""
    if state is None:
      with self._lock:
        state = self._capture()
    c = state.counters
    snap = pb.WalSnapshot(
        next_rollout_id=state.next_rollout_id,
        rollouts_accepted=c["rollouts_accepted"],  # (rollouts_duplicate: this process's)
        rollouts_stale_dropped=c["rollouts_stale_dropped"], leases_expired=c["leases_expired"],
        prompts_resumed=c["prompts_resumed"], samples_resumed=c["samples_resumed"],
        tokens_resumed=c["tokens_resumed"], takes_requeued=c["takes_requeued"],
        acked_takes=list(state.acked_takes), acked_take_groups=list(state.acked_takes.values()))
    size = snap.ByteSize()

    def add(field: str, item) -> Iterator[pb.WalRecord]:
      nonlocal snap, size
      n = item.ByteSize() + 8  # (its tag and length)
      if size and size + n > self.limits.wal_snapshot_record_bytes:
        yield pb.WalRecord(snapshot=snap)
        snap, size = pb.WalSnapshot(continues=True), 0
      getattr(snap, field).append(item)
      size += n

    for p in state.queued:
      yield from add("queued", p)
    for lease, open_prompts in state.leases:
      yield from add("leases", pb.WalLeaseState(
          lease_id=lease.lease_id, worker_id=lease.worker_id, prompt_ids=lease.prompt_ids,
          deadline_unix_s=lease.deadline, answered=lease.answered,
          fingerprints=lease.fingerprints, released=sorted(lease.released),
          expired=lease.expired, open_prompts=open_prompts))
    for entry in state.rollouts:
      yield from add("rollouts", pb.WalRollout(rollout_id=entry.rollout_id, prompt=entry.prompt,
                                               group=entry.group, worker_id=entry.worker_id))
    for take_id, ids, deadline in state.takes:
      yield from add("takes", pb.WalTake(take_id=take_id, rollout_ids=ids,
                                         deadline_unix_s=deadline))
    yield pb.WalRecord(snapshot=snap)

  def _load_snapshot(self, snap: pb.WalSnapshot) -> None:
    if not snap.continues:
      self._load_snapshot_start(snap)
    for p in snap.queued:
      self.prompts[p.id] = p
      self.queue[p.id] = None
    for s in snap.leases:
      lease = LeaseState(s.lease_id, s.worker_id, list(s.prompt_ids), s.deadline_unix_s,
                         dict(s.answered), dict(s.fingerprints), set(s.released), s.expired)
      if lease.closed:
        self.closed_leases[lease.lease_id] = lease
      else:
        self.leases[lease.lease_id] = lease
        for p in s.open_prompts:
          self.prompts[p.id] = p
    for r in snap.rollouts:
      self.ready[r.rollout_id] = RolloutEntry(r.rollout_id, r.prompt, r.group, r.worker_id)
    for t in snap.takes:
      for rid in t.rollout_ids:
        self.in_flight[rid] = self.ready.pop(rid)
      self.takes[t.take_id] = (list(t.rollout_ids), t.deadline_unix_s)

  def _load_snapshot_start(self, snap: pb.WalSnapshot) -> None:
    """The state a snapshot's first record replaces: emptied, with the record's counters."""
    self.prompts, self.queue = {}, collections.OrderedDict()
    self.leases, self.closed_leases = {}, collections.OrderedDict()
    self.ready, self.in_flight, self.takes = collections.OrderedDict(), {}, {}
    counts = list(snap.acked_take_groups)  # (none in a snapshot of an older server: 0)
    counts += [0] * (len(snap.acked_takes) - len(counts))
    self.acked_takes = collections.OrderedDict(zip(snap.acked_takes, counts))
    self.next_rollout_id = snap.next_rollout_id
    self.counters = collections.Counter(
        rollouts_accepted=snap.rollouts_accepted, rollouts_duplicate=0,
        rollouts_stale_dropped=snap.rollouts_stale_dropped, leases_expired=snap.leases_expired,
        prompts_resumed=snap.prompts_resumed, samples_resumed=snap.samples_resumed,
        tokens_resumed=snap.tokens_resumed, takes_requeued=snap.takes_requeued)

  # ------------------------------------------------------------ time-driven changes

  @_durable
  def expire_due(self) -> int:
    """Returns the prompts of expired leases and the rollouts of unacked takes; returns how many changes."""
    changes = 0
    with self._lock:
      now = self._clock()
      for lease in [l for l in self.leases.values() if l.deadline <= now]:
        self._commit(pb.WalRecord(returned=pb.WalReturn(
            lease_id=lease.lease_id, prompt_ids=lease.open_ids, expired=True)))
        changes += 1
      for take_id in [t for t, (_, d) in self.takes.items() if d <= now]:
        self._commit(pb.WalRecord(requeue_take=pb.WalRequeueTake(take_id=take_id)))
        changes += 1
    return changes

  @_durable
  def expire_leases_of(self, worker_ids: Sequence[str]) -> dict[str, int]:
    """Expires now the open leases of these workers (silent ones, presumed dead): their
    prompts go back to the queue as at a deadline. Returns {lease id: prompts returned}."""
    silent, out = set(worker_ids), {}
    with self._lock:
      for lease in [l for l in self.leases.values() if l.worker_id in silent and not l.closed]:
        out[lease.lease_id] = len(lease.open_ids)
        self._commit(pb.WalRecord(returned=pb.WalReturn(
            lease_id=lease.lease_id, prompt_ids=lease.open_ids, expired=True)))
    return out

  def _wait(self, ready: Callable[[], bool], wait_s: float) -> None:
    end = time.monotonic() + wait_s
    while not ready():
      left = end - time.monotonic()
      if left <= 0:
        return
      self._cond.wait(min(left, 0.25))
      self.expire_due()

  # ------------------------------------------------------------ prompts

  @_durable
  def enqueue(self, prompts: list[pb.Prompt]) -> pb.EnqueuePromptsReply:
    if len(prompts) > self.limits.max_prompts_per_enqueue:
      raise errors.InvalidArgument(
          "prompts", f"expected at most {self.limits.max_prompts_per_enqueue} per call, got {len(prompts)}")
    seen, fresh, ids = set(), [], []
    for i, p in enumerate(prompts):
      _validate_prompt(p, f"prompts[{i}]")
      if p.id and p.id in seen:
        raise errors.InvalidArgument(f"prompts[{i}].id", f"expected unique ids in one call, got {p.id!r} twice")
      seen.add(p.id)
    with self._lock:
      duplicates, waiting = 0, self._answered_ids()
      for p in prompts:
        if p.id and (p.id in self.prompts or p.id in waiting):
          duplicates += 1
          ids.append(p.id)
          continue
        q = pb.Prompt()
        q.CopyFrom(p)
        if not q.id:
          q.id = uuid.uuid4().hex
        fresh.append(q)
        ids.append(q.id)
      if fresh:
        self._commit(pb.WalRecord(enqueue=pb.WalEnqueue(prompts=fresh)))
      return pb.EnqueuePromptsReply(ids=ids, duplicates=duplicates, queue_depth=len(self.queue))

  def _answered_ids(self) -> set[str]:
    """Ids of the prompts whose rollout group waits for the trainer (ready or taken): an
    enqueue of one is a retry, else the prompt would be in two places once its group is
    dropped as stale."""
    return {e.prompt.id for e in (*self.ready.values(), *self.in_flight.values())}

  def _check_deadline(self, deadline_s: float) -> None:
    if not (0 < deadline_s <= self.limits.max_lease_deadline_s):
      raise errors.InvalidArgument(
          "deadline_s", f"expected in (0, {self.limits.max_lease_deadline_s}], got {deadline_s}")

  def _check_wait(self, wait_s: float) -> None:
    if not (0 <= wait_s <= self.limits.max_wait_s):
      raise errors.InvalidArgument("wait_s", f"expected in [0, {self.limits.max_wait_s}], got {wait_s}")

  @_durable
  def lease(self, worker_id: str, n: int, deadline_s: float, wait_s: float = 0.0,
            max_bytes: int = 8 << 20) -> pb.Lease:
    """Up to `n` queued prompts (about `max_bytes` of them with the partial samples they
    carry; one at least) leased to `worker_id` until `deadline_s` from now."""
    if not worker_id:
      raise errors.InvalidArgument("worker_id", "expected a worker id, got ''")
    check_id("worker_id", worker_id)
    if not 1 <= n <= self.limits.max_lease_prompts:
      raise errors.InvalidArgument("n", f"expected in [1, {self.limits.max_lease_prompts}], got {n}")
    self._check_deadline(deadline_s)
    self._check_wait(wait_s)
    with self._lock:
      self.expire_due()
      self._wait(lambda: bool(self.queue), wait_s)
      if not self.queue:
        return pb.Lease(worker_id=worker_id)
      ids, size = [], 0
      for pid in itertools.islice(self.queue, n):  # (a reply past the server's send limit
        size += self.prompts[pid].ByteSize()  # failed, its prompts leased to no one, again
        if ids and size > max_bytes:  # at each deadline: partial samples grow unbounded)
          break
        ids.append(pid)
      lease_id = uuid.uuid4().hex
      deadline = self._clock() + deadline_s
      self._commit(pb.WalRecord(lease=pb.WalLease(
          lease_id=lease_id, worker_id=worker_id, prompt_ids=ids, deadline_unix_s=deadline)))
      return pb.Lease(lease_id=lease_id, worker_id=worker_id, deadline_unix_s=deadline,
                      prompts=[self._leasable(self.prompts[p]) for p in ids])

  def _leasable(self, prompt: pb.Prompt) -> pb.Prompt:
    """The prompt as a lease hands it out: without its begun samples where they are past
    max_prompt_bytes (a log of an older server: the reply could not be sent), begun anew."""
    if prompt.partial and prompt.ByteSize() > self.limits.max_prompt_bytes:
      logging.warning("param server: prompt %r holds %d bytes of begun samples, more than a "
                      "lease carries: leased without them", prompt.id, prompt.ByteSize())
      return _without_partial(prompt)
    return prompt

  def _lease_of(self, lease_id: str, worker_id: str, *, allow_closed: bool = False) -> LeaseState:
    if not lease_id:
      raise errors.InvalidArgument("lease_id", "expected a lease id, got ''")
    lease = self.leases.get(lease_id) or self.closed_leases.get(lease_id)
    if lease is None:
      raise errors.NotFound("lease_id", f"no lease {lease_id!r}")
    if lease.worker_id != worker_id:
      raise errors.FailedPrecondition(
          "worker_id", f"lease {lease_id!r} belongs to worker {lease.worker_id!r}, got {worker_id!r}")
    if lease.expired and not allow_closed:
      raise errors.FailedPrecondition("lease_id", f"lease {lease_id!r} expired; its prompts went back to the queue")
    return lease

  @_durable
  def renew(self, lease_id: str, worker_id: str, deadline_s: float,
            partial: Sequence[pb.PartialRollouts] = ()) -> pb.Lease:
    """Extends a lease; the samples `partial` holds for its open prompts are kept with them,
    so that, should the lease expire, the next worker continues them. Those of prompts
    answered or released meanwhile are passed over."""
    self._check_deadline(deadline_s)
    self._validate_partial(partial)
    with self._lock:
      self.expire_due()
      lease = self._lease_of(lease_id, worker_id)
      if lease.closed:
        raise errors.FailedPrecondition("lease_id", f"lease {lease_id!r} is closed: no prompt left open")
      for k, part in enumerate(partial):
        if part.prompt_id not in lease.prompt_ids:
          raise errors.InvalidArgument(f"partial[{k}].prompt_id",
                                       f"prompt {part.prompt_id!r} is not in lease {lease_id!r}")
      joined = self._validate_joined(partial, lambda part: part.prompt_id in lease.open_ids)
      held = [part for part in partial if part.prompt_id in lease.open_ids]
      deadline = self._clock() + deadline_s
      self._commit(pb.WalRecord(renew=pb.WalRenew(lease_id=lease_id, deadline_unix_s=deadline,
                                                  partial=held)), joined)
      return pb.Lease(lease_id=lease_id, worker_id=worker_id, deadline_unix_s=deadline,
                      prompts=[_without_partial(self.prompts[p]) for p in lease.open_ids])

  def _validate_partial(self, partial: Sequence[pb.PartialRollouts]) -> None:
    """Checks whole begun samples as a group's samples (a status naming `partial[k]...`);
    increments (`kept`) are checked joined, under the lock (`_validate_joined`)."""
    if len({part.prompt_id for part in partial}) != len(partial):
      raise errors.InvalidArgument("partial", "expected each prompt at most once")
    for k, part in enumerate(partial):
      if not part.kept:
        self._check_begun(part, f"partial[{k}]")

  def _validate_joined(self, partial: Sequence[pb.PartialRollouts],
                       kept: Callable[[pb.PartialRollouts], bool]
                       ) -> dict[str, pb.PartialRollouts]:
    """Under the lock: checks the increments among `partial` that will be `kept`, joined to
    the samples their prompts hold; returns them joined, by prompt id (the record's apply
    holds these instead of joining again)."""
    joined = {}
    for k, part in enumerate(partial):
      if part.kept and kept(part):
        where = f"partial[{k}]"
        prompt = self.prompts[part.prompt_id]
        whole = joined_partial(prompt.partial, part, where)
        self._check_begun(whole, where)
        # The prompt as it would be held, sized without copying its samples under the lock
        # (+ 8: each sample's tag and length)
        size = prompt.ByteSize() - sum(s.ByteSize() for s in prompt.partial) + sum(
            s.ByteSize() + 8 for s in whole.samples)
        if size > self.limits.max_prompt_bytes:
          raise errors.ResourceExhausted(
              where, f"prompt {part.prompt_id!r} would hold {size} bytes with these samples "
              f"joined, more than the {self.limits.max_prompt_bytes} a lease can carry; "
              f"send them whole, or keep them")
        joined[part.prompt_id] = whole
    return joined

  def _check_begun(self, part: pb.PartialRollouts, where: str) -> None:
    validate_group(pb.RolloutGroup(prompt_id=part.prompt_id, samples=part.samples,
                                   policy_version=part.policy_version),
                   latest_version=self._latest_version(),
                   max_samples=self.limits.max_samples_per_group, where=where, partial=True)

  @_durable
  def release(self, lease_id: str, worker_id: str, prompt_ids: list[str],
              partial: Sequence[pb.PartialRollouts] = ()) -> int:
    """Returns the listed (default: all open) prompts to the queue, each with the partial
    rollouts given for it (the next worker continues them); repeating it is harmless."""
    self._validate_partial(partial)
    with self._lock:
      self.expire_due()
      lease = self._lease_of(lease_id, worker_id, allow_closed=True)
      if lease.expired:
        return 0
      wanted = list(prompt_ids) or lease.open_ids
      for i, pid in enumerate(wanted):
        if pid not in lease.prompt_ids:
          raise errors.InvalidArgument(f"prompt_ids[{i}]", f"prompt {pid!r} is not in lease {lease_id!r}")
        if pid in lease.answered:
          raise errors.FailedPrecondition(
              f"prompt_ids[{i}]", f"prompt {pid!r} already has an accepted rollout group")
      todo = [p for p in dict.fromkeys(wanted) if p not in lease.released]
      # A retried release (its reply lost) is answered as the first was: partial rollouts of
      # prompts it released already were taken then.
      partial = [part for part in partial if part.prompt_id not in lease.released]
      for k, part in enumerate(partial):
        if part.prompt_id not in todo:
          raise errors.InvalidArgument(f"partial[{k}].prompt_id", f"prompt {part.prompt_id!r} is "
                                       f"not among the prompts released now ({len(todo)})")
      joined = self._validate_joined(partial, lambda part: True)
      if todo:
        self._commit(pb.WalRecord(returned=pb.WalReturn(lease_id=lease_id, prompt_ids=todo,
                                                        partial=partial)), joined)
      return len(todo)

  @_durable
  def complete(self, lease_id: str, worker_id: str) -> int:
    """Checks that every prompt of a lease was answered or released; returns how many were answered."""
    with self._lock:
      self.expire_due()
      lease = self._lease_of(lease_id, worker_id)
      if lease.open_ids:
        raise errors.FailedPrecondition(
            "lease_id", f"{len(lease.open_ids)} prompts of lease {lease_id!r} have no accepted rollout "
            f"group ({', '.join(lease.open_ids[:5])}); submit or release them first")
      return len(lease.answered)

  # ------------------------------------------------------------ rollouts

  @_durable
  def submit(self, lease_id: str, worker_id: str, group: pb.RolloutGroup) -> pb.SubmitRolloutsReply:
    """Accepts one prompt's rollout group once per lease; an identical retry is acknowledged again.
    A malformed group is INVALID_ARGUMENT; then an unknown lease is NOT_FOUND whatever the
    group's version (a server that lost the lease never published it)."""
    validate_group(group, latest_version=None, max_samples=self.limits.max_samples_per_group)
    fingerprint = group_fingerprint(group)
    with self._lock:
      self.expire_due()
      lease = self._lease_of(lease_id, worker_id, allow_closed=True)
      check_policy_version(group, self._latest_version())
      pid = group.prompt_id
      if pid in lease.answered:
        if lease.fingerprints[pid] != fingerprint:
          raise errors.FailedPrecondition(
              "group", f"prompt {pid!r} of lease {lease_id!r} was already answered by a different group "
              f"(rollout {lease.answered[pid]})")
        self.counters["rollouts_duplicate"] += 1  # logged nowhere: counted since this start
        return pb.SubmitRolloutsReply(rollout_id=lease.answered[pid], duplicate=True, lease_closed=lease.closed)
      if lease.expired:
        raise errors.FailedPrecondition("lease_id", f"lease {lease_id!r} expired; its prompts went back to the queue")
      if pid not in lease.prompt_ids:
        raise errors.InvalidArgument("group.prompt_id", f"prompt {pid!r} is not in lease {lease_id!r}")
      if pid in lease.released:
        raise errors.FailedPrecondition("group.prompt_id", f"prompt {pid!r} was released from lease {lease_id!r}")
      rollout_id = self.next_rollout_id
      self._commit(pb.WalRecord(submit=pb.WalSubmit(
          lease_id=lease_id, rollout_id=rollout_id, group=group, fingerprint=fingerprint,
          worker_id=worker_id)))
      return pb.SubmitRolloutsReply(rollout_id=rollout_id, lease_closed=lease.closed)

  @_durable
  def take(self, min_version: int, max_groups: int, wait_s: float, ack_deadline_s: float,
           max_bytes: int = 8 << 20, requeue_unacked: bool = False) -> pb.TakeRolloutsReply:
    """Hands out up to `max_groups` groups (and about `max_bytes`) made at `min_version` or
    later, oldest policy version first (`_oldest_policy_first`).

    `requeue_unacked` first returns every unacknowledged take to the queue (a restarted
    trainer's first call: the groups of its lost steps come back, oldest first)."""
    if not 1 <= max_groups <= self.limits.max_take_groups:
      raise errors.InvalidArgument("max_groups", f"expected in [1, {self.limits.max_take_groups}], got {max_groups}")
    if min_version < 0:
      raise errors.InvalidArgument("min_version", f"expected >= 0, got {min_version}")
    top = max(self._latest_version(), 0)
    if min_version > top:  # every group would be dropped as stale
      raise errors.FailedPrecondition(
          "min_version", f"expected at most the latest published version v{top} (no group is "
          f"newer), got {min_version}")
    if not (0 < ack_deadline_s <= self.limits.max_lease_deadline_s):
      raise errors.InvalidArgument(
          "ack_deadline_s", f"expected in (0, {self.limits.max_lease_deadline_s}], got {ack_deadline_s}")
    self._check_wait(wait_s)
    with self._lock:
      self.staleness_floor = min_version  # a restarted trainer's may be lower: said as it is
      self.expire_due()
      if requeue_unacked:
        for take_id in list(self.takes):
          self._commit(pb.WalRecord(requeue_take=pb.WalRequeueTake(take_id=take_id)))
      dropped = 0

      def drop_stale() -> bool:
        nonlocal dropped
        stale = [rid for rid, e in self.ready.items() if e.group.policy_version < min_version]
        if stale:
          self._commit(pb.WalRecord(drop_stale=pb.WalDropStale(rollout_ids=stale)))
          dropped += len(stale)
        return bool(self.ready)

      self._wait(drop_stale, wait_s)
      ids, size = [], 0
      for entry in _oldest_policy_first(self.ready.values()):
        size += entry.group.ByteSize() + entry.prompt.ByteSize()
        if len(ids) == max_groups or (ids and size > max_bytes):
          break
        ids.append(entry.rollout_id)
      if not ids:
        return pb.TakeRolloutsReply(dropped_stale=dropped)
      take_id = uuid.uuid4().hex
      self._commit(pb.WalRecord(take=pb.WalTake(
          take_id=take_id, rollout_ids=ids, deadline_unix_s=self._clock() + ack_deadline_s)))
      taken = [self.in_flight[r] for r in ids]
      return pb.TakeRolloutsReply(take_id=take_id, dropped_stale=dropped, rollouts=[
          pb.TakenRollout(rollout_id=e.rollout_id, prompt=e.prompt, group=e.group, worker_id=e.worker_id)
          for e in taken])

  @_durable
  def ack(self, take_id: str) -> int:
    if not take_id:
      raise errors.InvalidArgument("take_id", "expected a take id, got ''")
    with self._lock:
      if take_id in self.acked_takes:
        return self.acked_takes[take_id]
      # A take still held is acked, its deadline past or not: the reaper had not requeued
      # it, and its groups were trained on (expiring it first made the ack NotFound, and
      # its groups came back to be dropped as stale, their prompts sampled again).
      if take_id not in self.takes:
        raise errors.NotFound("take_id", f"no unacknowledged take {take_id!r} (unknown, or its ack deadline "
                              "passed and its rollouts were queued again)")
      n = len(self.takes[take_id][0])
      self._commit(pb.WalRecord(ack=pb.WalAck(take_id=take_id)))
      return n

  # ------------------------------------------------------------ introspection

  def leases_by_worker(self) -> collections.Counter:
    with self._lock:
      return collections.Counter(l.worker_id for l in self.leases.values())

  def depths(self) -> dict[str, int]:
    with self._lock:
      return dict(
          prompts_queued=len(self.queue),
          prompts_leased=sum(len(l.open_ids) for l in self.leases.values()),
          leases_active=len(self.leases),
          rollouts_ready=len(self.ready),
          rollouts_in_flight=len(self.in_flight),
          rollouts_accepted=self.counters["rollouts_accepted"],
          rollouts_duplicate=self.counters["rollouts_duplicate"],
          rollouts_stale_dropped=self.counters["rollouts_stale_dropped"],
          leases_expired=self.counters["leases_expired"],
          prompts_resumed=self.counters["prompts_resumed"],
          samples_resumed=self.counters["samples_resumed"],
          tokens_resumed=self.counters["tokens_resumed"],
          takes_requeued=self.counters["takes_requeued"])

  def close(self) -> None:
    self.wait_compacted()
    with self._lock:
      self._wal.close()
