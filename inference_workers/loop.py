"""The inference worker: pull weights, lease prompts, sample, score, submit; preemption-safe.

A worker is stateless: killed at any instant it loses nothing (its leases expire and the
prompts are served again). A SIGTERM (the preemption notice) stops leasing; the prompts
being generated are finished and submitted, the rest are released, and the worker exits
within `grace_s`; a watchdog releases whatever is still open if generation overruns it.
No call made while stopping outlasts the grace period, whatever the server does: a prompt
left unreleased is not lost, its lease expires and the server serves it again.

With a fixed number of samples per prompt (GRPO) the worker batches continuously
(`ContinuousBatch`): `prompts_per_call` prompt slots decode together (`rows_per_prompt` rows
each), a finished prompt's group is scored and submitted at once and a newly leased prompt
takes its slot; or (`sample_rows`, `SampleBatch`) rows shared by every prompt's samples, a
row taking the next queued sample as soon as its own ends. VIGOR samples in rounds, one
continuous batch a round of `prompts_per_call` prompts, whose groups may be unequal;
stopping, it sends each prompt's samples so far as its group (two or more) once only
salvage_s of the grace period is left.
With an `environment` for a prompt's task, each turn a sample ends is answered by it
(multi-turn rollouts), on `environment_threads` threads while the other rows decode on: the
reply is rendered as the next message and the sample goes on; the verifier scores the whole.

New versions are pulled on a thread of their own as the heartbeat hears of them, while
generation runs, and applied in place: by default once the prompts started on the held
version have finished (new prompts wait), so a group is sampled by one version, the one it
carries; with `in_flight_updates` between decode chunks at once, a group then carrying the
oldest version it was sampled with (its per-token behaviour log-probs stay exact). An
unreachable server is retried with capped exponential backoff. A prompt the worker cannot
sample (too long for its model with max_new_tokens, ids outside its vocabulary) is answered
with a group holding the reason and no samples: the trainer counts it and logs why, and no
such prompt goes round the fleet failing each worker.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import sys
import threading
import time
import zlib
from typing import Any, Callable

import grpc
import jax
import numpy as np
from absl import logging

from algorithms.allocation import FixedAllocator
from algorithms.environments import (conversation, environment_for, environments_from,
                                    turn_text)
from algorithms.verifiers import (REWARD_MODEL_TASK, Verifier, VerifierResult, load_verifiers,
                                  verifier_for_task, verifiers_by_task)
from inference_workers import multihost
from inference_workers.continuous import ContinuousBatch, SlotsDevice
from inference_workers.decoding import Sample, bucket, check_request, pad_prompts, replies_in
from rlax_ps.hard_exit import exit_now
from inference_workers.sample_batch import SampleBatch
from inference_workers.sampling import GREEDY_SEED
from inference_workers.weights import HeldPolicy, ResyncNeeded
from inference_workers.worker_config import WATCHDOG_LEAD_S, WorkerConfig
from param_server.client import (Lease, ParamServerClient, ParamServerError, RetryPolicy,
                                  make_routes, make_sample, routes_of, sample_logprobs,
                                  sample_observed)
from param_server.protos import PROMPT_SEED, SCORE_ERROR, WORKER_ACTIVITIES
from param_server.protos import param_server_pb2 as pb
from rlax_ps import chat
from rlax_ps import sharding as shd
from rlax_ps.models.config import ModelConfig
from rlax_ps.reward_scoring import RewardScorer, prompt_messages
from rlax_ps.sync import CodecError, Update
from rlax_ps.teacher import Teacher, own_tokenizer, score_retokenized
from rlax_ps.tokenizers import HFTokenizer

_RATE_CHUNKS = 64  # decode chunks the reported tokens/s is averaged over
VERSIONS_KEPT = 64  # WorkerStats.versions_applied: the last ones
_HEARTBEAT_JOIN_S = 5.0  # how long run() waits for the heartbeat thread on the way out
_EXIT_SLACK_S = 1.0  # past the grace period, how long the watchdog lets its releases go on
_PARTIAL_BYTES = 3 << 20  # begun samples per call (renewal, salvage): under gRPC's 4 MiB
# Failures that mean "the server is not there right now": back off and try again.
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.RESOURCE_EXHAUSTED)


def worker_mesh(config: WorkerConfig):
  """The (data, tensor) mesh the worker decodes on: worker.devices of each process's local
  devices (every host of a multi-host worker), worker.tensor_parallel; None for one device
  (the default device, as placed)."""
  local = jax.local_devices()
  count = config.devices or len(local)
  if count > len(local):
    raise ValueError(f"WorkerConfig.devices: expected at most the {len(local)} local devices, "
                     f"got {count}")
  devices = [d for p in range(jax.process_count())
             for d in sorted((d for d in jax.devices() if d.process_index == p),
                             key=lambda d: d.id)[:count]]
  if len(devices) % config.tensor_parallel:
    raise ValueError(f"WorkerConfig.tensor_parallel: expected a divisor of the {len(devices)} "
                     f"devices, got {config.tensor_parallel}")
  if len(devices) == 1:
    return None
  return shd.make_mesh({"data": len(devices) // config.tensor_parallel, "fsdp": 1,
                        "tensor": config.tensor_parallel}, devices)


def follow_leader(model_config: ModelConfig, tokenizer: Any, config: WorkerConfig,
                  channel: multihost.Channel) -> int:
  """A multi-host worker's process other than 0: hold the weights, the decode state and a
  reward model on this host's devices and make the leader's device calls
  (multihost.follow) until it stops; the exit status the leader ends with."""
  mesh = worker_mesh(config)
  policy = HeldPolicy(model_config, config.weights_format, mesh=mesh)
  return multihost.follow(channel, {
      "policy": lambda: multihost.PolicyCalls(policy),
      "slots": lambda **settings: SlotsDevice(policy.model, mesh=mesh, **settings),
      "reward": lambda: RewardScorer(config.reward_model, tokenizer, config.reward_model_dtype,
                                     config.reward_model_batch, mesh=mesh),
      "teacher": lambda: make_teacher(config, tokenizer, mesh,
                                      teacher_tokenizer(config, tokenizer))},
      alike=(ValueError, ResyncNeeded, CodecError))


def make_teacher(config: WorkerConfig, tokenizer: Any, mesh,
                 own: HFTokenizer | None) -> Teacher | None:
  """worker.teacher's model on the worker's devices (None without one); `own`: its own
  tokenizer (teacher_tokenizer; None: the teacher scores the policy's ids)."""
  if not config.teacher:
    return None
  return Teacher(config.teacher, mesh, vocab_size=(own or tokenizer).vocab_size,
                 dtype=config.teacher_dtype, topk=config.teacher_topk, field="worker.teacher",
                 logits_chunk=config.teacher_logits_chunk,
                 tokenizer=own or tokenizer, retokenized=own is not None)


def teacher_tokenizer(config: WorkerConfig, tokenizer: Any) -> HFTokenizer | None:
  """worker.teacher_tokenizer's tokenizer (None: the teacher shares the policy's), with its
  own chat template where the policy's prompts are rendered through one."""
  if not config.teacher_tokenizer:
    return None
  return own_tokenizer(config.teacher_tokenizer, tokenizer, "worker.teacher_tokenizer")


def _in_calls(partial: list[pb.PartialRollouts]) -> list[list[pb.PartialRollouts]]:
  """`partial` split over calls of at most about _PARTIAL_BYTES each (one a call past it)."""
  calls, size = [], 0
  for part in partial:
    n = part.ByteSize()
    if not calls or (calls[-1] and size + n > _PARTIAL_BYTES):
      calls.append([])
      size = 0
    calls[-1].append(part)
    size += n
  return calls


def make_allocator(config: WorkerConfig):
  """The allocation policy named by the config (fixed N by default)."""
  if config.allocator == "vigor":
    from algorithms.allocation import VigorAllocator
    return VigorAllocator(**config.allocator_settings())
  return FixedAllocator(config.samples_per_prompt)


def policy_turns(tokens: np.ndarray, observed: np.ndarray) -> list[np.ndarray]:
  """A multi-turn sample's turns: its runs of tokens the policy drew, between the replies."""
  cuts = np.flatnonzero(np.diff(np.concatenate([[True], observed, [True]]).astype(np.int8)))
  return [tokens[a:b] for a, b in zip(cuts[::2], cuts[1::2])]


def reward_term_verifiers(config: WorkerConfig) -> list[tuple[str, float, Verifier]]:
  """worker.reward_terms as (name, weight, verifier), made once at start after the files
  worker.verifiers names are imported: a name no verifier has is a ValueError naming the
  field. A name resolves as a prompt's task does (`task:<name>` too)."""
  terms = config.reward_term_weights()
  if terms:
    load_verifiers(config.verifiers, "worker.verifiers")
  return [(name, weight, verifier_for_task(name.removeprefix("task:"),
                                           "WorkerConfig.reward_terms"))
          for name, weight in terms]


def sample_metadata(passed: bool | None, parts: dict[str, float] | None,
                    erred: bool = False) -> dict[str, str] | None:
  """A sample's metadata: "passed" ("1" or "0"), its verifier's verdict, where one scored
  it; "reward/<name>" (repr of a float), each raw reward part, where the worker logs them;
  "score_error": "1" where a verifier raised on it (scored 0: the trainer counts them)."""
  meta = {} if passed is None else {"passed": str(int(passed))}
  if erred:
    meta[SCORE_ERROR] = "1"
  meta.update((f"reward/{name}", repr(float(v))) for name, v in (parts or {}).items())
  return meta or None


def _evaluated(prompt: pb.Prompt) -> bool:
  """Whether the trainer sent `prompt` for a held-out answer (eval.on_workers), not to train."""
  return "eval" in prompt.metadata


def _eval_samples(prompt: pb.Prompt, draws: int) -> tuple[int, str]:
  """A held-out prompt's sampled answers (metadata eval_samples, for pass@k; 0: one greedy
  answer), and why this worker cannot give them ("" when it can: 1 to `draws`)."""
  value = prompt.metadata.get("eval_samples", "0")
  try:
    k = int(value)
  except ValueError:
    k = -1
  if 0 <= k <= draws:
    return k, ""
  return 0, (f"its metadata eval_samples: expected 0 to {draws} (the samples a prompt decodes "
             f"here), got {value!r}")


def reference_of(prompt: pb.Prompt) -> str:
  """The reference answer a prompt carries: its `extra` bytes, else metadata["answer"]."""
  if prompt.extra:
    return prompt.extra.decode("utf-8")
  return prompt.metadata.get("answer", "")


class TimeSplit:
  """Where the decode loop's wall time goes: seconds by activity (a span counts for its own
  time, not its inner spans'), and decode seconds weighted by the fraction of slots full.
  Spans open on the thread that called `start()` only; `snapshot()` reads from any thread."""

  def __init__(self, clock: Callable[[], float] = time.monotonic):
    self._clock = clock
    self._lock = threading.Lock()
    self._owner: int | None = None
    self.started = self._since = clock()
    self.seconds = dict.fromkeys(WORKER_ACTIVITIES, 0.0)
    self.slot_s = 0.0
    self._open: list[tuple[str, float | None]] = []  # (activity, slots full), innermost last

  def start(self) -> None:
    """Count from now, the calling thread's spans."""
    with self._lock:
      self._owner = threading.get_ident()
      self.started = self._since = self._clock()

  @contextlib.contextmanager
  def span(self, activity: str, full: float | None = None):
    """Count the time inside as `activity` (`full`: the fraction of decode slots in use)."""
    if threading.get_ident() != self._owner:
      yield
      return
    with self._lock:
      self._charge()
      self._open.append((activity, full))
    try:
      yield
    finally:
      with self._lock:
        self._charge()
        self._open.pop()

  def _charge(self) -> None:
    now = self._clock()
    if self._open:
      activity, full = self._open[-1]
      self.seconds[activity] += now - self._since
      if full is not None:
        self.slot_s += full * (now - self._since)
    self._since = now

  def snapshot(self) -> pb.WorkerTime:
    """The split so far (an open span counted up to now)."""
    with self._lock:
      self._charge()
      return pb.WorkerTime(total_s=self._since - self.started, slot_s=self.slot_s,
                           **{f"{a}_s": v for a, v in self.seconds.items()})

  def __repr__(self) -> str:
    t = self.snapshot()
    total = max(t.total_s, 1e-9)
    parts = [f"{a.replace('_', ' ')} {getattr(t, a + '_s') / total:.0%}"
             for a in WORKER_ACTIVITIES]
    return (f"TimeSplit({t.total_s:.0f}s: {', '.join(parts)}; slots full while decoding "
            f"{t.slot_s / max(t.decoding_s, 1e-9):.0%})")


@dataclasses.dataclass
class WorkerStats:
  leases: int = 0
  groups_submitted: int = 0
  groups_refused: int = 0  # rejected by the server as they were (the prompt is released)
  prompts_failed: int = 0  # could not be sampled here: answered with the reason, no samples
  prompts_released: int = 0
  samples: int = 0
  tokens: int = 0
  resyncs: int = 0
  reconnects: int = 0
  score_errors: int = 0  # scores of 0 because a verifier (task's or reward term's) raised
  replies: int = 0  # multi-turn: environment replies fed to samples
  samples_salvaged: int = 0  # begun samples handed back as partial rollouts on a stop
  checkpoints: int = 0  # lease renewals that carried begun samples (worker.checkpoint_s)
  # Prompts begun on a version under the trainer's staleness floor (the server would drop
  # their groups): stopped, or not sent once finished, and released to be sampled anew.
  groups_abandoned_stale: int = 0
  groups_dropped_lost: int = 0  # running prompts of leases a renewal found gone
  updates_applied: int = 0
  # The last VERSIONS_KEPT versions applied, in order (all of them were a list as long as
  # the run, logged whole at the worker's exit).
  versions_applied: list = dataclasses.field(default_factory=list)
  time: TimeSplit = dataclasses.field(default_factory=TimeSplit)  # reported by the heartbeat


class Worker:
  """One inference worker bound to one server connection; `run()` until stopped."""

  def __init__(self, client: ParamServerClient, model_config: ModelConfig, tokenizer: Any,
               config: WorkerConfig = WorkerConfig(), *, allocator=None,
               verifier_for: Callable[[str], Verifier] | None = None,
               environments: dict | None = None, mirror: multihost.Mirror | None = None):
    self.client = client
    self.tokenizer = tokenizer
    self._tokenizer_identity = tokenizer.identity  # (named in each group: checked by the trainer)
    self.config = config
    if config.routing_replay and not model_config.moe_layers:
      raise ValueError("WorkerConfig.routing_replay: expected False for a model without "
                       "mixture-of-experts layers (there are no routes to send)")
    if config.max_new_tokens >= model_config.max_position_embeddings:
      raise ValueError(f"WorkerConfig.max_new_tokens: expected fewer than the model's "
                       f"max_position_embeddings={model_config.max_position_embeddings} "
                       f"(the prompt's tokens need positions too), got {config.max_new_tokens}")
    self.mesh = worker_mesh(config)
    # A multi-host worker (this is process 0): every device call is mirrored to the others.
    self.mirror = mirror
    policy = HeldPolicy(model_config, config.weights_format, mesh=self.mesh)
    self.policy = policy if mirror is None else multihost.MirroredPolicy(policy, mirror)
    self.allocator = allocator if allocator is not None else make_allocator(config)
    self.verifier_for = verifier_for or verifiers_by_task(config.default_task,
                                                          config.verifiers)
    self.reward_terms = reward_term_verifiers(config)
    self.environments = (environments if environments is not None else
                         environments_from(config.environment, config.environment_args,
                                           config.environment_timeout_s or None))
    self.reward_scorer = (RewardScorer(config.reward_model, tokenizer, config.reward_model_dtype,
                                       config.reward_model_batch, mesh=self.mesh)
                          if config.reward_model else None)
    if self.reward_scorer is not None and mirror is not None:
      self.reward_scorer = mirror.mirrored("reward", self.reward_scorer, {}, ("scores",))
    self.teacher_tokenizer = teacher_tokenizer(config, tokenizer)  # None: the policy's
    self.teacher = make_teacher(config, tokenizer, self.mesh,  # on-policy distillation's
                                self.teacher_tokenizer)
    if self.teacher is not None and mirror is not None:
      self.teacher = mirror.mirrored("teacher", self.teacher, {},
                                     ("score_group", "score_groups"))
    self.params = config.sampling(tokenizer.stop_ids)
    self.stats = WorkerStats()
    self._stop = threading.Event()
    self._salvage_at = math.inf  # stopping: when running samples go back as partial rollouts
    self._grace_end = math.inf  # stopping: when the grace period ends (time.monotonic)
    # The client's own call timeout: once stopping, each call gets at most the grace left.
    self._client_timeout = getattr(client, "timeout_s", None)
    # Set once stopping: the client then retries nothing (its retry waits end at once).
    self._interrupt = getattr(client, "interrupt", None)
    self._done = threading.Event()  # set when run() returns
    self._beat_now = threading.Event()  # wakes the heartbeat early: a new version is held
    # The newest version the heartbeat (or a lease or submission reply: `_hear`) heard of,
    # for the prefetch thread to pull (a long pull must not silence the heartbeat: the
    # server expires a silent worker's leases).
    self._latest_heard = -1
    # The trainer's staleness floor as the last lease, renewal, submission or heartbeat reply
    # named it (0: none): prompts begun on an older version are stopped (`_stop_stale`).
    self._floor = 0
    self._skipped_version = -1  # the newest version seen in another format (not pulled again)
    # The storage id of the server whose version is held (pb.VersionInfo.store_id): another
    # is a server restarted on an empty store, or another run's, whose version numbers may
    # equal the held one's with other weights.
    self._held_store = ""
    self._pull_now = threading.Event()
    self._lock = threading.Lock()
    self._scoring_pool: concurrent.futures.ThreadPoolExecutor | None = None  # when first asked
    self._inflight: dict[str, set[str]] = {}  # lease id -> prompt ids not yet answered
    self._lease_deadline: dict[str, float] = {}
    # Begun samples of running prompts, by lease, for the heartbeat's next renewals to carry,
    # past the tokens of each sample the server holds (its last renewal's, or those the
    # prompt was leased with), by prompt key: checkpoints send what is new.
    self._checkpoint: dict[str, list[pb.PartialRollouts]] = {}
    self._held: dict[tuple[str, str], list[int]] = {}
    self._checkpointed_at = time.monotonic()
    self._tokens_per_s = 0.0
    self._prefetched: tuple[int, list[Update]] | None = None  # (base version, updates)
    # The base version of the prefetch under way, and its end (`_prefetch_done`).
    self._prefetching: int | None = None
    self._prefetch_done = threading.Condition(self._lock)
    # Continuous batching (fixed allocation): prompts leased but not in a slot yet, the
    # oldest version the samples of each prompt in a slot were drawn with, and leases the
    # server took back.
    self._continuous = isinstance(self.allocator, FixedAllocator)
    self._batch: ContinuousBatch | SampleBatch | None = None
    self._slots = 1  # prompts the batch decodes at once (set when it is made)
    self._pending: collections.deque[tuple[str, pb.Prompt]] = collections.deque()
    self._started: dict[tuple[str, str], tuple[pb.Prompt, int]] = {}
    # Finished groups being scored and submitted on the submitter's threads while decoding
    # goes on, by prompt key, in the order they finished (continuous batching): several at
    # once, so a group held by one slow test does not hold the next groups' scoring.
    self._scoring: dict[tuple[str, str], concurrent.futures.Future] = {}
    self._submitter: concurrent.futures.ThreadPoolExecutor | None = None
    # Adaptive allocators' rounds: a thread per prompt of a round, scoring each prompt's
    # samples (on the scoring threads) as it finishes, while the round decodes on.
    self._round_pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._abandoned: set[str] = set()
    # Leases a renewal found gone (expired, or the server's run restarted): their running
    # prompts are served to another worker, so the decode loop drops them (`_drop_lost`).
    self._lost: set[str] = set()
    self._newer_waits = False  # a newer version waits for the running prompts to end
    # Multi-turn: the replies each running sample got, by prompt key and sample index.
    self._given: dict[tuple[str, str], dict[int, list]] = collections.defaultdict(dict)
    self._chunks: collections.deque[tuple[float, int]] = collections.deque(maxlen=_RATE_CHUNKS)
    self._stepping_since: float | None = None  # when the decode chunk under way began

  # ------------------------------------------------------------ stopping

  def request_stop(self, grace_s: float | None = None) -> None:
    """Stop leasing; finish the current call, release the rest, exit within the grace period.
    A call the client is retrying (the server unreachable or stalled) gives up at once, and
    so does any later call that fails."""
    if self._stop.is_set():
      return
    grace = self.config.grace_s if grace_s is None else grace_s
    self._grace_end = time.monotonic() + grace
    self._salvage_at = self._grace_end - self.config.salvage_s
    self._stop.set()
    if self._interrupt is not None:
      self._interrupt.set()
    logging.info("worker: stop requested; releasing in-flight prompts within %.1fs", grace)
    threading.Thread(target=self._watchdog, args=(grace,), daemon=True).start()

  def _give_up(self) -> None:
    """After a crash: calls retried while the server is unreachable end, and those left to
    make on the way out (sends, releases) are bounded by the grace period, as on a stop; so
    the error reaches the caller (and the supervisor that restarts the worker) now, not when
    the server is back. No watchdog: the error is the exit."""
    self._grace_end = min(self._grace_end, time.monotonic() + self.config.grace_s)
    self._stop.set()
    if self._interrupt is not None:
      self._interrupt.set()

  def _watchdog(self, grace: float) -> None:
    """If the worker is still at work near the end of the grace period, release what is open
    and leave: by the end of the grace period plus _EXIT_SLACK_S, whatever the server does
    (a call begun before the stop keeps its full timeout; this does not wait for it)."""
    if self._done.wait(max(0.0, grace - WATCHDOG_LEAD_S)):
      return
    released = []
    releaser = threading.Thread(target=lambda: released.append(self._release_all()),
                                name="worker-release", daemon=True)
    releaser.start()
    releaser.join(max(0.0, self._grace_left()) + _EXIT_SLACK_S)
    if released:
      logging.warning("worker: grace period over while generating; released %d prompts, "
                      "exiting", released[0])
    else:  # the server did not answer in time: the leases' expiry serves their prompts again
      logging.warning("worker: grace period over while generating and releasing; exiting")
    exit_now(0)

  def _release_all(self) -> int:
    """Release every open prompt; how many went back. Stopping, no call outlasts the grace
    period and none is made once it is spent. Nothing is lost when a release fails or is
    not sent: the lease expires and the server serves its prompts again."""
    with self._lock:
      open_leases = {k: sorted(v) for k, v in self._inflight.items() if v}
    total = 0
    for lease_id, ids in open_leases.items():
      try:
        total += self._rpc("release", lease_id, ids)
      except ParamServerError as e:
        if e.code in TRANSIENT:  # the server is away or slow, or the grace is spent
          logging.warning("worker: release of lease %s failed (%s); its %d prompts are served "
                          "again when it expires", lease_id, e.code.name, len(ids))
        else:
          # One of them may have been answered meanwhile (the server then refuses the whole
          # call): release them one by one.
          logging.warning("worker: release of lease %s failed (%s); releasing one by one",
                          lease_id, e)
          total += self._release_one_by_one(lease_id, ids)
      with self._lock:
        self._inflight.get(lease_id, set()).difference_update(ids)
    self.stats.prompts_released += total
    return total

  def _release_one_by_one(self, lease_id: str, ids: list[str]) -> int:
    """Release the prompts of a lease one call each, until the server is away or slow or the
    grace period is spent (the lease's expiry then serves the rest again)."""
    total = 0
    for pid in ids:
      try:
        total += self._rpc("release", lease_id, [pid])
      except ParamServerError as e:
        if e.code in TRANSIENT:
          logging.warning("worker: releasing lease %s stopped (%s); the rest of its prompts "
                          "are served again when it expires", lease_id, e.code.name)
          break
        logging.info("worker: prompt %s of lease %s not released: %s", pid, lease_id, e)
    return total

  def _grace_left(self) -> float:
    """Seconds left of the grace period (math.inf until a stop is requested)."""
    return self._grace_end - time.monotonic()

  def _rpc(self, method: str, *args, **kwargs):
    """self.client.<method>(*args, **kwargs); once stopping, with a timeout no longer than
    the grace left, and refused (DEADLINE_EXCEEDED, nothing sent) once it is spent. The
    client's lease, rollout and heartbeat methods take no timeout of their own: the
    client's default (`timeout_s`, which every call reads as it starts) is cut instead,
    for the calls of every thread alike."""
    if self.stopping:
      left = self._grace_left()
      if left <= 0:
        raise ParamServerError(method, grpc.StatusCode.DEADLINE_EXCEEDED,
                               "not sent: the grace period is spent")
      if self._client_timeout is not None:
        self.client.timeout_s = min(self._client_timeout, left)
    return getattr(self.client, method)(*args, **kwargs)

  @property
  def stopping(self) -> bool:
    return self._stop.is_set()

  # ------------------------------------------------------------ weights

  def sync_weights(self) -> bool:
    """Bring the held policy to the latest published version; True when it changed."""
    before = self.policy.version
    self._apply_or_resync(self._pull_from(before))
    return self.policy.version != before

  def _pull_from(self, held: int | None) -> list[Update]:
    """The updates that bring `held` to the latest; from a keyframe instead (what is held
    dropped, said in one line) when the server holds less than `held` (a new run, or a
    server restarted on an empty store: it refuses a pull from a version it never had) or
    the updates from `held` do not decode (a stored blob failing its seal: every pull from
    `held` would fail alike)."""
    if held is None:
      return self.client.pull_updates(None)
    try:
      return self.client.pull_updates(held)
    except ParamServerError as e:
      if (e.code != grpc.StatusCode.FAILED_PRECONDITION
          or not e.details.startswith("have_version")):
        raise
      why = f"the server refused a pull from it ({e.details})"
    except CodecError as e:
      why = f"the updates from it to the latest do not decode ({e})"
    self._drop_held(held, why)
    return self.client.pull_updates(None)

  def _drop_held(self, held: int, why: str) -> None:
    """Say (one line) that the held version `held` is given up for a keyframe, and why."""
    logging.warning("worker: dropping the v%d it holds: %s; pulling the latest keyframe",
                    held, why)
    self.stats.resyncs += 1

  def prefetch(self, latest: int) -> None:
    """Pull (network + decode) the updates past the held version, to apply between batches."""
    held = self.policy.version
    if held is None or latest <= held or latest == self._skipped_version:
      return
    with self._lock:
      pre = self._prefetched
      if pre is not None and pre[0] == held and pre[1] and pre[1][-1].version >= latest:
        return
      self._prefetching = held
    try:
      info = self.client.version_info()
      if self._another_store(info) or not self._in_own_format(info.latest_version, info.fmt):
        return  # (another store's: _catch_up pulls its keyframe)
      updates = self._pull_from(held)
      with self._lock:
        self._prefetched = (held, updates)
    finally:
      with self._lock:
        self._prefetching = None
        self._prefetch_done.notify_all()

  def _await_prefetch(self) -> None:
    """Wait for a prefetch under way from the held version: a pull now would share its
    bytes (`ParamServerClient.pull`) but decode them again, and its updates would go unused."""
    with self._lock:
      while self._prefetching is not None and self._prefetching == self.policy.version:
        self._prefetch_done.wait()

  def apply_prefetched(self) -> bool:
    """Apply prefetched updates if they start from the held version; True when applied."""
    with self._lock:
      pre, self._prefetched = self._prefetched, None
    if pre is None or not pre[1] or pre[0] != self.policy.version:
      return False
    self._apply_or_resync(pre[1])
    return True

  def _apply_or_resync(self, updates: list[Update]) -> None:
    """Apply in order; on any mismatch start again from the latest keyframe. Versions
    published in another format than this worker's are not applied (_other_format)."""
    if self._other_format(updates):
      return
    try:
      self._apply_all(updates)
    except ResyncNeeded as e:
      logging.warning("worker: %s; resynchronising from a keyframe", e)
      self.stats.resyncs += 1
      keyframe = self.client.pull_updates(None)
      if not self._other_format(keyframe):
        self._apply_all(keyframe)

  def _other_format(self, updates: list[Update]) -> bool:
    """True (said once per version) when `updates` are published in another format than
    worker.weights_format: the worker keeps what it holds and waits for a version in its
    own (the trainer's publish.format was changed on a resumed run: its first keyframe
    brings one), pulling that version no more."""
    other = next((u.fmt for u in updates if u.fmt != self.policy.fmt), None)
    return other is not None and not self._in_own_format(updates[-1].version, other)

  def _in_own_format(self, version: int, fmt: str) -> bool:
    """Whether `version`, published in `fmt` ("": not told, e.g. by a relay still empty),
    is worth a pull: not when `fmt` is not worker.weights_format, said in one line (once
    per version). Asked before pulling, so that no version of another format is fetched."""
    if not fmt or fmt == self.policy.fmt:
      return True
    if version != self._skipped_version:
      self._skipped_version = version
      held = self.policy.version
      logging.warning("worker: v%d is published in %s, not this worker's %s (worker."
                      "weights_format, which must equal the trainer's publish.format); "
                      "not pulled: %s, waiting for a version in %s", version, fmt,
                      self.policy.fmt, "holding nothing" if held is None else
                      f"keeping v{held}", self.policy.fmt)
    return False

  def _apply_all(self, updates: list[Update]) -> None:
    for update in updates:
      self.policy.apply(update)
      self.stats.updates_applied += 1
      self.stats.versions_applied.append(update.version)
      del self.stats.versions_applied[:-VERSIONS_KEPT]
    if updates:
      self._beat_now.set()  # status and metrics show the version held within moments

  # ------------------------------------------------------------ the loop

  def run(self) -> WorkerStats:
    """Register, then lease/generate/submit until stopped or `max_leases` leases are done."""
    self._done.clear()
    self.stats.time.start()
    self._beat_now.set()  # the first heartbeat goes out as soon as the worker registers
    heartbeat = threading.Thread(target=self._heartbeat_loop, name="worker-heartbeat", daemon=True)
    puller = threading.Thread(target=self._prefetch_loop, name="worker-prefetch", daemon=True)
    crashed = False
    try:
      self._with_backoff(lambda: self.client.register(self.config.name))
      if not self.stopping:  # registered (a stop during the retries leaves no worker id)
        heartbeat.start()
        puller.start()
      while True:
        if self._continuous:
          if not (self._may_lease() or self._pending or self._started or self._scoring):
            break
          self._with_backoff(self._cycle)
        else:
          if not self._may_lease():
            break
          self._with_backoff(self._one_lease)
    except BaseException:
      crashed = True
      self._give_up()
      raise
    finally:
      if crashed:  # the heartbeat renews no lease from now on
        self._done.set()
      self._drain_scoring()
      # The open prompts go back before the batch's environment calls are waited for (one
      # may never return: worker.environment_timeout_s 0); after a crash, not waited for.
      self._release_all()
      if self._batch is not None:
        if crashed:  # calls not begun are dropped at once; one under way is not waited for
          threading.Thread(target=self._batch.close, name="worker-close", daemon=True).start()
        else:
          self._batch.close()
      self._done.set()
      self._beat_now.set()
      self._pull_now.set()
      for thread in (heartbeat, puller):  # let an in-flight heartbeat or pull finish: a
        if thread.is_alive():  # daemon thread inside gRPC at interpreter exit aborts
          thread.join(min(_HEARTBEAT_JOIN_S, max(0.0, self._grace_left())))
      self._say_leaving()
      if self.stopping and self._client_timeout is not None:  # the client may serve on
        self.client.timeout_s = self._client_timeout
        if self._interrupt is not None:
          self._interrupt.clear()
    return self.stats

  def _say_leaving(self) -> None:
    """Tell the server this worker is gone (its leases settled), so that status and metrics
    stop counting it at once; if the server is away or the grace is spent, its silence
    tells it later."""
    if not getattr(self.client, "worker_id", ""):  # never registered
      return
    try:
      self._rpc("heartbeat", -1 if self.policy.version is None else self.policy.version,
                leaving=True)
    except ParamServerError as e:
      logging.info("worker: could not say it is leaving: %s", e)

  def _with_backoff(self, fn: Callable[[], Any]) -> Any:
    """fn(), retried with the client's capped exponential backoff (no deadline: a worker
    waits out any outage) while the server is unreachable; None once stopping."""
    delays = RetryPolicy(initial_s=self.config.backoff_initial_s,
                         max_s=self.config.backoff_max_s, deadline_s=math.inf).delays()
    while True:
      try:
        return fn()
      except ParamServerError as e:
        if e.code not in TRANSIENT:
          raise
        if self.stopping:  # said, not silent: a group or a release may be left undone
          logging.warning("worker: stopping with the server unreachable; not done: %s (a "
                          "lease left open is served again when it expires)", e)
          return None
        with self._lock:
          self.stats.reconnects += 1
        wait = next(delays)
        logging.warning("worker: server unreachable (%s); retrying until it answers or the worker "
                        "stops (no deadline), next in %.1fs", e.code.name, wait)
        self._stop.wait(wait)

  def _may_lease(self) -> bool:
    return not self.stopping and not (self.config.max_leases
                                      and self.stats.leases >= self.config.max_leases)

  def _catch_up(self) -> None:
    """Hold the newest published version (prefetched, else pulled now)."""
    with self.stats.time.span("waiting_weights"):
      info = self._rpc("version_info")
      latest, held = info.latest_version, self.policy.version
      if held is not None and self._another_store(info):
        if latest < 0:  # nothing there yet: sampled, these weights' groups would be refused
          logging.warning("worker: dropping the v%d it holds: the server's storage is another "
                          "(id %s, not %s) and holds no version yet; waiting for its first",
                          held, info.store_id, self._held_store)
          self.stats.resyncs += 1
          self.policy.version = None
          self._skipped_version = -1
          with self._lock:
            self._prefetched = None
          return
        self._drop_held(held, f"the server's storage is another (id {info.store_id}, not "
                        f"{self._held_store}): a server restarted on an empty store, or "
                        f"another run's; its v{latest} need not be these weights")
        self._skipped_version = -1
        with self._lock:
          self._prefetched = None
        if self._in_own_format(latest, info.fmt):  # (else kept, and asked again)
          self._apply_or_resync(self.client.pull_updates(None))  # a keyframe, in place
          self._held_store = info.store_id
        return
      self._held_store = info.store_id or self._held_store
      if latest < 0 or latest in (held, self._skipped_version):
        return
      if not self._in_own_format(latest, info.fmt):
        return
      if held is not None and latest < held:  # (a pull from `held` would be refused)
        self._drop_held(held, f"the server's latest is v{latest}, older (a new run, or a "
                        f"server restarted on an empty store)")
        self._apply_or_resync(self.client.pull_updates(None))
        return
      self._await_prefetch()
      self.apply_prefetched()
      if latest != self.policy.version:
        self.sync_weights()

  def _await_first_version(self) -> None:
    """Nothing published yet: wait a while for a first version."""
    with self.stats.time.span("waiting_weights"):
      self._stop.wait(self.config.lease_wait_s)

  def _lease(self, wait_s: float) -> Lease:
    """Lease prompts (waiting up to wait_s for some); a non-empty lease is tracked (renewed by
    the heartbeat, released on the way out) and counted."""
    with self.stats.time.span("waiting_prompts"):
      lease = self.client.lease(self.config.prompts_per_lease, self.config.lease_deadline_s,
                                wait_s=wait_s)
    self._hear(lease.latest_version, lease.staleness_floor)
    if lease.prompts:
      with self._lock:
        self._inflight[lease.lease_id] = {p.id for p in lease.prompts}
        self._lease_deadline[lease.lease_id] = time.monotonic() + self.config.lease_deadline_s
      self.stats.leases += 1
    return lease

  def _one_lease(self) -> None:
    if self.stopping:
      return
    self._catch_up()
    if self.policy.version is None:  # nothing published yet
      self._await_first_version()
      return
    if self.stopping:
      return
    lease = self._lease(self.config.lease_wait_s)
    if not lease.prompts:
      return
    try:
      self._serve(lease)
    except ParamServerError as e:
      if e.code in TRANSIENT:
        raise
      # The lease expired or was taken back: its prompts are already queued again.
      logging.warning("worker: lease %s abandoned: %s", lease.lease_id, e)
    finally:
      with self._lock:
        left = self._inflight.get(lease.lease_id)
      if left:
        self._release_all()
      with self._lock:
        self._inflight.pop(lease.lease_id, None)
        self._lease_deadline.pop(lease.lease_id, None)

  def _serve(self, lease: Lease) -> None:
    """Generate and submit each group of the lease; on a stop request, release the rest."""
    prompts = list(lease.prompts)
    step = self.config.prompts_per_call
    for start in range(0, len(prompts), step):
      if self.stopping:
        self._release_all()
        return
      chunk = prompts[start:start + step]
      # A version switch happens here, between generation calls. The lease may have waited
      # out a publication: groups of the older version could be too stale to train on.
      self._catch_up()
      version = self.policy.version
      if version is None:  # the server's storage is another, with nothing published yet
        with self.stats.time.span("submitting"):
          self.stats.prompts_released += self._rpc("release", lease.lease_id,
                                                   [p.id for p in prompts[start:]])
        return
      checked = [(p, *self._checked_tokens(p)) for p in chunk]
      for prompt, _, fault in checked:
        if fault:
          self._submit(lease.lease_id, prompt.id, self._failed(prompt, version, fault))
      chunk = [p for p, _, fault in checked if not fault]
      tokens = [t for _, t, fault in checked if not fault]
      groups = self._rollout_groups(chunk, tokens, version) if chunk else []
      stale = []
      for prompt, group in zip(chunk, groups):
        if group is None and self._salvaging:  # stopped before its group was worth sending
          continue  # released on the way out
        if group is None or self._stale(version):  # None: stopped under the floor (which may
          stale.append(prompt.id)  # have fallen since); a submission's reply may raise it
        else:  # an outage is waited out: the group is kept, as the continuous path keeps it
          self._with_backoff(lambda: self._submit(lease.lease_id, prompt.id, group))
      if stale:
        self._count_stale(len(stale), version)
        with self.stats.time.span("submitting"):
          self.stats.prompts_released += self._rpc("release", lease.lease_id, stale)
        with self._lock:
          self._inflight[lease.lease_id].difference_update(stale)
    with self._lock:
      left = self._inflight[lease.lease_id]
    if not left:
      with self.stats.time.span("submitting"):
        self._rpc("complete", lease.lease_id)

  def _submit(self, lease_id: str, prompt_id: str, group: pb.RolloutGroup) -> None:
    """Submit one group and mark its prompt answered. A group refused as it is (too large
    for the server or a relay on the way, malformed) is counted and logged, and the prompt
    answered with why (the trainer is told; sampled again, it would be refused at every
    worker); any other failure is raised."""
    try:
      with self.stats.time.span("submitting"):
        reply = self._rpc("submit_rollouts", lease_id, group)
    except ParamServerError as e:
      if (e.code == grpc.StatusCode.INVALID_ARGUMENT
          and e.details.startswith("group.policy_version")):
        # A version the server does not hold (restarted on another storage while this group
        # was sampled): the group is dropped and its prompt released when its lease settles.
        logging.warning("worker: the group of prompt %s was sampled by v%d, which the server "
                        "does not hold (%s); the prompt is released, to be sampled again",
                        prompt_id, group.policy_version, e.details)
        self.stats.groups_refused += 1
        return
      too_large = (e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                   and "larger than max" in e.details)  # gRPC's own limit, anywhere on the way
      if e.code != grpc.StatusCode.INVALID_ARGUMENT and not too_large:
        raise
      self.stats.groups_refused += 1
      logging.error("worker: the group of prompt %s was refused: %s", prompt_id, e)
      if not group.failure:  # (a refused answer of why: the prompt goes back to the queue)
        self._submit(lease_id, prompt_id, self._failed(
            pb.Prompt(id=prompt_id), group.policy_version, f"its group was refused: {e}"))
      return
    self._hear(getattr(reply, "latest_version", -1), getattr(reply, "staleness_floor", 0))
    with self._lock:
      self._inflight[lease_id].discard(prompt_id)
      self.stats.groups_submitted += 1

  # ------------------------------------------------------------ continuous batching

  def _cycle(self) -> None:
    """One turn: lease while slots are free, start waiting prompts on the newest version the
    batch allows, decode one chunk, submit the groups that finished."""
    if self._batch is None:
      c = self.config
      common = dict(record_routes=c.routing_replay, chunk_steps=c.decode_chunk_steps,
                    respond=self._respond if self.environments else None,
                    max_turns=c.max_turns, respond_threads=c.environment_threads,
                    resume=self._resumable, mesh=self.mesh, kv_dtype=c.kv_cache_dtype or None,
                    mirror=self.mirror)
      if c.sample_rows:
        self._batch = SampleBatch(self.policy.model, c.draws, c.sample_rows,
                                  self.params, **common)
      else:
        self._batch = ContinuousBatch(self.policy.model, c.draws,
                                      c.prompts_per_call, self.params,
                                      rows_per_prompt=c.rows_per_prompt, **common)
      self._slots = self._batch.free  # prompts it decodes at once, empty
    batch = self._batch
    self._harvest()
    self._stop_stale(batch)
    self._drop_lost(batch)
    if batch.running and self._salvaging and self._resumable:
      self._salvage(batch)
      return
    if self.policy.version is None:
      self._catch_up()
      if self.policy.version is None:  # nothing published yet
        self._await_first_version()
        return
    if self.stopping:
      self._release_pending()
    elif self._may_lease() and len(self._pending) < batch.free:
      idle = not (batch.running or self._pending)
      lease = self._lease(self.config.lease_wait_s if idle else 0.0)
      self._pending.extend((lease.lease_id, p) for p in lease.prompts)
    self._start_pending(batch)
    if not (batch.running or batch.waiting):
      if self._scoring and not self._pending:  # nothing to decode: wait for the oldest
        self._harvest(block=True)
      return
    t0 = time.monotonic()
    with self.stats.time.span("decoding", 1 - batch.free / self._slots):
      finished = self._step(batch)
    # A group's tokens count when it finishes but were made over many chunks: the rate is
    # taken over the last _RATE_CHUNKS chunks.
    self._chunks.append((time.monotonic() - t0,
                         sum(len(s.tokens) for _, got in finished for s in got)))
    self._tokens_per_s = (sum(n for _, n in self._chunks)
                          / max(sum(t for t, _ in self._chunks), 1e-9))
    for (lease_id, prompt_id), got in finished:
      self._submit_group(lease_id, prompt_id, got)
    while len(self._scoring) > self._slots:  # a batch's worth at most: scoring keeps up
      self._harvest(block=True)
    every = self.config.checkpoint_s
    if every and self._resumable and time.monotonic() - self._checkpointed_at >= every:
      self._take_checkpoint(batch)

  def _step(self, batch: ContinuousBatch | SampleBatch) -> list:
    """One decode chunk, timed for the heartbeat's stall check (`_check_stall`)."""
    self._stepping_since = time.monotonic()
    try:
      return batch.step()
    finally:
      self._stepping_since = None

  def _check_stall(self) -> None:
    """A decode chunk running past worker.stall_s (a hung device: no call returns from it)
    would hold its leases for ever, renewed by this heartbeat: release every open prompt to
    the other workers and exit 1, for the supervisor to start a fresh worker."""
    since, limit = self._stepping_since, self.config.stall_s
    if not limit or since is None or time.monotonic() - since <= limit:
      return
    logging.error("worker: one decode chunk has run %.0fs, past worker.stall_s=%g (a hung "
                  "device?); releasing the open prompts and exiting", time.monotonic() - since,
                  limit)
    released = self._release_all()
    print(f"worker: stalled: a decode chunk ran past worker.stall_s={limit:g}s; {released} "
          f"prompts released to the other workers; exiting 1", file=sys.stderr, flush=True)
    exit_now(1)

  def _start_pending(self, batch: ContinuousBatch) -> None:
    """Put waiting prompts in free slots, on the newest version. Without in-flight updates
    a newer version waits for the running prompts to end, and new prompts wait with it."""
    in_flight = self.config.in_flight_updates
    if not (self._pending and batch.free):
      # An idle worker takes a prefetched version too: it holds the newest (and shows it)
      # when the run ends or work comes back, not the one its last prompts were sampled by.
      if in_flight or not self._started:
        with self.stats.time.span("waiting_weights"):
          self.apply_prefetched()
      return
    if in_flight or not batch.running:
      self._catch_up()
    elif self._newer_waits or self._newer_published():
      self._newer_waits = True
      return
    self._newer_waits = False
    version = self.policy.version
    if version is None:  # the server's storage is another, with nothing published yet
      return
    while self._pending and batch.free:
      lease_id, prompt = self._pending.popleft()
      tokens, fault = self._checked_tokens(prompt)
      if fault:
        self._abandon(lease_id, self._send(lease_id, prompt.id, self._failed(prompt, version,
                                                                             fault)))
        self._settle(lease_id)
        continue
      if (prompt.partial and self._resumable and not self._stale(prompt.partial_version)
          and self._resume(lease_id, prompt, version)):
        continue
      self._started[(lease_id, prompt.id)] = (prompt, version)
      batch.add((lease_id, prompt.id), tokens, self._prompt_seeds(prompt, version))

  def _newer_published(self) -> bool:
    """Whether the server holds a version to take in place of the one held: another than
    it, in this worker's format (one in another is not pulled: waiting for it would stop
    every refill), or is on another storage (whose versions, or none yet, replace it)."""
    with self.stats.time.span("waiting_weights"):
      info = self._rpc("version_info")
    latest = info.latest_version
    return self._another_store(info) or (
        latest >= 0 and latest not in (self.policy.version, self._skipped_version)
        and self._in_own_format(latest, info.fmt))

  def _another_store(self, info: pb.VersionInfo) -> bool:
    """Whether `info` comes from another storage than the held version's."""
    return bool(self._held_store and info.store_id and info.store_id != self._held_store)

  @staticmethod
  def _begun(s: Sample, done: bool, replies: list, held: int = 0) -> tuple[pb.Sample, int]:
    """A sample so far as a partial rollout, past the first `held` tokens (those the server
    holds; returned with how many of them it keeps): a reply not fed whole is left out (the
    next worker asks for it again); the replies it holds travel as JSON metadata."""
    tokens, logprobs, observed, routes = s.tokens, s.sampling_logprobs, s.observed, s.routes
    if observed is not None and not done and len(observed) and observed[-1]:
      k = len(observed) - int(np.argmin(observed[::-1])) if not observed.all() else 0
      tokens, logprobs, observed = tokens[:k], logprobs[:k], observed[:k]
      routes = None if routes is None else routes[:max(k - 1, 0)]
    runs = replies_in(observed)
    meta = {"replies": json.dumps(list(replies[:runs]))} if runs else None
    kept = min(held, len(tokens))  # routes: every token but the last, so from kept - 1 on
    return make_sample(tokens[kept:], 0.0, logprobs=logprobs[kept:],
                       finish_reason=s.finish_reason if done else "",
                       routes=None if routes is None else routes[max(kept - 1, 0):],
                       observed=None if observed is None else observed[kept:],
                       metadata=meta), kept

  def _resume(self, lease_id: str, prompt: pb.Prompt, version: int) -> bool:
    """Queue a prompt whose samples a worker that stopped began (partial rollouts), to be
    drawn on with their seeds; False (it starts afresh) when they do not fit this worker.
    A multi-turn sample that had ended a turn gets its reply first (asked for now)."""
    n, key = self.config.draws, (lease_id, prompt.id)
    # The group's version is the oldest its samples were drawn with.
    self._started[key] = (prompt, min(version, prompt.partial_version))
    try:
      environment = self._environment(prompt)
      begun = [self._begun_sample(key, j, p, environment)
               for j, p in enumerate(prompt.partial[:n])]
      self._batch.add(key, self._prompt_tokens(prompt),
                      self._prompt_seeds(prompt, prompt.partial_version), begun)
    except (ValueError, TypeError) as e:  # e.g. another model's ids: not ours to go on
      logging.warning("worker: the begun samples of prompt %s are drawn afresh: %s", prompt.id, e)
      self._given.pop(key, None)
      del self._started[key]
      return False
    with self._lock:
      self._held[key] = [len(p.token_ids) for p in prompt.partial]
    return True

  def _begun_sample(self, key: tuple[str, str], j: int, p: pb.Sample, environment) -> Sample:
    """Sample j of a partial rollout; multi-turn (the `environment` of its prompt's task):
    its replies restored, and the reply to a turn it had ended appended (or it finishes, as
    the environment or max_turns says)."""
    tokens, logprobs = np.asarray(p.token_ids, np.int32), sample_logprobs(p)
    observed = sample_observed(p)
    sample = Sample(tokens, logprobs, logprobs, p.finish_reason, observed=observed,
                    routes=routes_of(p.routes) if p.HasField("routes") else None)
    if environment is None and observed is not None and observed.any():
      raise ValueError(f"partial sample {j}: holds an environment's replies; this worker "
                       f"has no worker.environment for its task")
    if environment is None or not len(tokens):
      return sample
    replies = json.loads(p.metadata.get("replies", "[]"))
    if not isinstance(replies, list):
      raise TypeError(f"partial sample {j}: metadata replies: expected a JSON list")
    self._given[key][j] = replies  # a finished sample's too: scoring and checkpoints read them
    if p.finish_reason:
      return sample
    turn_ended = int(tokens[-1]) in self.params.stop_tokens and (
        observed is None or not observed[-1])
    if not turn_ended:
      return sample
    ids = None if len(replies) >= self.config.max_turns else self._respond(
        key, j, tokens, np.zeros(len(tokens), bool) if observed is None else observed)
    if ids is None:  # the conversation ends at that turn
      return dataclasses.replace(sample, finish_reason="stop")
    fed = np.ones(len(ids), bool)
    return dataclasses.replace(
        sample, tokens=np.concatenate([tokens, np.asarray(ids, np.int32)]),
        logprobs=np.concatenate([logprobs, np.zeros(len(ids), np.float32)]),
        sampling_logprobs=np.concatenate([logprobs, np.zeros(len(ids), np.float32)]),
        observed=np.concatenate([np.zeros(len(tokens), bool) if observed is None else observed,
                                 fed]))

  def _environment(self, prompt: pb.Prompt):
    """The environment that answers the prompt's task (None: single-turn)."""
    return environment_for(self.environments, prompt.task or self.config.default_task)

  def _respond(self, key: tuple[str, str], j: int, tokens: np.ndarray,
               observed: np.ndarray) -> list[int] | None:
    """Multi-turn (on a reply thread): the environment's reply to the turn sample j of
    prompt `key` just ended (its tokens so far, the closing stop token last; `observed`:
    which of them earlier replies wrote), as the ids that continue the sample."""
    prompt, _ = self._started.get(key, (None, 0))
    if prompt is None:  # stopped meanwhile (`_stop_stale`): the reply would go unused
      return None
    environment = self._environment(prompt)
    if environment is None:  # a single-turn task: the sample ends at its stop token
      return None
    given = self._given[key].setdefault(j, [])
    turns = [turn_text(self.tokenizer, t) for t in policy_turns(tokens, observed)]
    messages, errors = conversation(turns, given), environment.errors
    try:
      reply = environment(messages, reference_of(prompt))
      if environment.errors > errors and (errors < 5 or errors % 1000 == 0):
        logging.warning("worker: environment %r raised on prompt %s (%d so far); its error "
                        "is the reply: %s", environment.name, prompt.id, errors + 1, reply)
      if reply is None:
        return None
      ids = self.tokenizer.encode_reply(reply, int(tokens[-1]))
    # A reply of a wrong type (an error the environment counts, logged as its raising is),
    # or one the tokenizer cannot encode (e.g. a character it lacks): this sample ends here.
    except (TypeError, ValueError) as e:
      if environment.errors == errors or errors < 5 or errors % 1000 == 0:
        logging.warning("worker: environment %r's reply on prompt %s cannot be fed (the "
                        "sample ends; environment errors so far: %d): %s", environment.name,
                        prompt.id, environment.errors, e)
      return None
    if not ids:  # nothing to feed (an empty reply without a template): the sample ends
      return None
    given.append(reply)
    with self._lock:
      self.stats.replies += 1
    return ids

  def _submit_group(self, lease_id: str, prompt_id: str, samples: list[Sample]) -> None:
    """Hand one finished group to the submitter's threads, which score and submit it while
    decoding goes on (`_send`); one of an abandoned lease, or under the staleness floor,
    is settled here. As many groups as worker.scoring_threads are scored at once, their
    samples sharing the scoring threads (1: one sample at a time, on one thread)."""
    key = (lease_id, prompt_id)
    prompt, version = self._started.pop(key)
    given = self._given.pop(key, {})
    with self._lock:  # the server's count of its begun tokens: done with
      self._held.pop(key, None)
    self.stats.samples += len(samples)
    self.stats.tokens += sum(len(s.tokens) for s in samples)
    if lease_id in self._abandoned:
      self._settle(lease_id)
    elif self._stale(version):  # the server would drop it: sampled anew elsewhere
      self._count_stale(1, version)
      self._release_stale(lease_id, [prompt_id])
      self._settle(lease_id)
    else:
      if self._submitter is None:
        self._submitter = concurrent.futures.ThreadPoolExecutor(
            self.config.scoring_threads, thread_name_prefix="submit")
      self._scoring[key] = self._submitter.submit(
          self._score_and_send, lease_id, prompt_id, prompt,
          (version, version if self.policy.version is None else self.policy.version),
          samples, given)

  def _score_and_send(self, lease_id: str, prompt_id: str, prompt: pb.Prompt,
                      versions: tuple[int, int], samples: list[Sample],
                      given: dict[int, list]) -> ParamServerError | None:
    """(A submitter's thread.) Score a finished group, then `_send` it. `versions`: the
    oldest and the newest it was sampled with (the one held when it finished)."""
    try:
      rewards, passed, parts, erred = self._scored(prompt, samples, given)
    except ValueError as e:  # e.g. a reward model's chat template refusing the conversation:
      # the trainer is told why, and this worker goes on (as would the next one it went to)
      return self._send(lease_id, prompt_id, self._failed(
          prompt, versions[0], f"its samples could not be scored: {e}"))
    baseline = None
    if self.config.greedy_baseline and not _evaluated(prompt):  # the last sample is greedy
      baseline, n = rewards[-1], self.config.samples_per_prompt
      samples, rewards, erred = samples[:n], rewards[:n], erred[:n]
      passed, parts = (None if x is None else x[:n] for x in (passed, parts))
    return self._send(lease_id, prompt_id, self._group(prompt, versions[0], samples, rewards,
                                                       passed, parts, versions[1], baseline,
                                                       erred))

  def _send(self, lease_id: str, prompt_id: str, group: pb.RolloutGroup
            ) -> ParamServerError | None:
    """Submit a group of a continuous batch's lease (an outage is waited out: the group is
    kept); the error of a lease the server took back (None: sent)."""
    try:
      self._with_backoff(lambda: self._submit(lease_id, prompt_id, group))
    except ParamServerError as e:  # the lease expired or was taken back: queued again
      return e
    return None

  def _abandon(self, lease_id: str, error: ParamServerError | None) -> None:
    """A lease the server took back (`error`; None: not): no more calls for it, its waiting
    prompts dropped (the server serves them again)."""
    if error is None:
      return
    logging.warning("worker: lease %s abandoned: %s", lease_id, error)
    self._abandoned.add(lease_id)
    self._pending = collections.deque(x for x in self._pending if x[0] != lease_id)

  def _harvest(self, block: bool = False) -> None:
    """Settle the leases of the groups the submitter is done with, in order (`block`: wait
    for the oldest); a lease the server took back is abandoned. A verifier's mistake (a
    result that is not a VerifierResult) is raised here."""
    while self._scoring:
      key, future = next(iter(self._scoring.items()))
      if not (block or future.done()):
        return
      with self.stats.time.span("scoring"):  # the decode loop waits for it (`block`)
        error = future.result()
      block = False
      del self._scoring[key]
      self._abandon(key[0], error)
      self._settle(key[0])

  def _drain_scoring(self) -> None:
    """On the way out: the groups being scored are sent (within the grace period when
    stopping: past it, their leases expire and their prompts are served again), and the
    scoring threads end."""
    if self._scoring:
      wait = self._grace_left() if self.stopping else None
      concurrent.futures.wait(list(self._scoring.values()), timeout=wait)
      try:
        self._harvest()
      except Exception as e:  # noqa: BLE001 - already on the way out with another error
        logging.error("worker: scoring a finished group failed: %s", e)
    for pool in (self._submitter, self._scoring_pool, self._round_pool):
      if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    self._submitter = self._scoring_pool = self._round_pool = None

  def _stale(self, version: int) -> bool:
    """Whether a group of `version` is under the trainer's staleness floor (the server drops
    it at the trainer's next take), while versions at the floor are ones this worker can
    hold: not when they are published in another format (`_other_format`), where prompts
    begun again would start on the same old version."""
    return version < self._floor and self._skipped_version < self._floor

  def _stop_stale(self, batch: ContinuousBatch | SampleBatch) -> None:
    """Take out of the batch the prompts begun on a version under the trainer's staleness
    floor, freeing their slots for prompts started on the newest version, and release them
    without their samples (those would keep the old version)."""
    stale = [key for key, (_, version) in self._started.items() if self._stale(version)]
    if not stale:
      return
    self._count_stale(len(stale), min(self._started[key][1] for key in stale))
    self._take_out(batch, stale)
    by_lease: dict[str, list[str]] = collections.defaultdict(list)
    for lease_id, prompt_id in stale:
      by_lease[lease_id].append(prompt_id)
    for lease_id, ids in by_lease.items():
      self._release_stale(lease_id, ids)
      self._settle(lease_id)

  def _drop_lost(self, batch: ContinuousBatch | SampleBatch) -> None:
    """Take out of the batch the prompts of leases a renewal found gone: the server serves
    them again already, so decoding on would only make a group it refuses."""
    with self._lock:
      lost, self._lost = self._lost, set()
    if not lost:
      return
    keys = [key for key in self._started if key[0] in lost]
    self._take_out(batch, keys)
    with self._lock:
      for lease_id in lost:
        self._checkpoint.pop(lease_id, None)
    self.stats.groups_dropped_lost += len(keys)
    for lease_id in lost:
      logging.warning("worker: lease %s is gone from the server; %d of its running prompts "
                      "dropped (served again elsewhere)",
                      lease_id, sum(key[0] == lease_id for key in keys))
      self._abandoned.add(lease_id)
      self._pending = collections.deque(x for x in self._pending if x[0] != lease_id)
      self._settle(lease_id)

  def _take_out(self, batch: ContinuousBatch | SampleBatch, keys: list[tuple[str, str]]
                ) -> None:
    """Drop the running prompts `keys` from the batch and all the worker keeps of them: their
    replies so far, and their samples a renewal would carry."""
    if keys:
      batch.drop(keys)
    for key in keys:
      del self._started[key]
      self._given.pop(key, None)
    with self._lock:
      for key in keys:
        self._held.pop(key, None)
        parts = self._checkpoint.get(key[0])
        if parts is not None:
          self._checkpoint[key[0]] = [p for p in parts if p.prompt_id != key[1]]

  def _count_stale(self, n: int, version: int) -> None:
    """Count (and say) `n` prompts begun on `version` (the oldest), under the floor."""
    self.stats.groups_abandoned_stale += n
    logging.info("worker: %d prompts begun on v%d, under the trainer's staleness floor v%d, "
                 "released to be sampled anew (%d so far)", n, version, self._floor,
                 self.stats.groups_abandoned_stale)

  def _release_stale(self, lease_id: str, ids: list[str]) -> None:
    """Release prompts begun on a version under the staleness floor, without their
    samples, to be sampled anew. A lease the server took back is abandoned (its prompts
    are queued again already)."""
    if lease_id in self._abandoned:
      return
    try:
      with self.stats.time.span("submitting"):
        released = self._with_backoff(lambda: self._rpc("release", lease_id, ids))
    except ParamServerError as e:  # the lease expired or was taken back: queued again
      logging.warning("worker: lease %s abandoned: %s", lease_id, e)
      self._abandoned.add(lease_id)
      self._pending = collections.deque(x for x in self._pending if x[0] != lease_id)
      return
    if released is None:  # stopping with the server away: the lease's expiry serves them
      return
    self.stats.prompts_released += released
    with self._lock:
      self._inflight.get(lease_id, set()).difference_update(ids)

  def _teacher_prompt(self, prompt: pb.Prompt) -> list[int]:
    """The prompt in the teacher's tokens (worker.teacher_tokenizer), rendered by its own
    chat template where the trainer sent a conversation."""
    return self.teacher_tokenizer.encode_prompt(chat.raw_prompt(prompt.text, prompt.metadata))

  def _checked_tokens(self, prompt: pb.Prompt) -> tuple[list[int], str]:
    """The prompt's token ids, and why this worker cannot sample it ("" when it can): its
    task has no verifier or reward model here, its text does not encode, its ids lie
    outside the model's vocabulary, it leaves no room for max_new_tokens, it is a held-out
    prompt this worker cannot answer as asked, or a teacher of another tokenizer cannot
    read it (its chat template refuses it)."""
    if _evaluated(prompt) and not self._continuous:
      return [], (f"it is a held-out prompt (eval.on_workers), answered by workers of the "
                  f"fixed allocator only; this one's is {self.config.allocator!r}")
    _, fault = _eval_samples(prompt, self.config.draws)
    if fault:
      return [], fault
    if (prompt.task or self.config.default_task) == REWARD_MODEL_TASK:
      if self.reward_scorer is None:
        return [], (f"task {REWARD_MODEL_TASK!r} is scored by a reward model, and this "
                    f"worker has none (worker.reward_model)")
    else:
      try:  # a task this worker's verifiers do not know (worker.verifiers)
        self.verifier_for(prompt.task)
      except ValueError as e:
        return [], str(e)
    try:
      tokens = self._prompt_tokens(prompt)
    except (ValueError, KeyError, UnicodeError) as e:
      return [], f"its text does not encode: {e}"
    if self.teacher_tokenizer is not None and not _evaluated(prompt):
      try:  # the teacher reads it too, in its own tokens
        self._teacher_prompt(prompt)
      except (ValueError, KeyError, UnicodeError) as e:
        return tokens, f"worker.teacher_tokenizer: the teacher cannot read it: {e}"
    config = self.policy.model.config
    try:
      pad_prompts([tokens], 1, max(len(tokens), 1), config.vocab_size)
      check_request(config, [tokens], [0], 1, self.params)
    except ValueError as e:
      return tokens, str(e).replace("prompts[0]: ", "")
    return tokens, ""

  def _failed(self, prompt: pb.Prompt, version: int, fault: str) -> pb.RolloutGroup:
    """The answer to a prompt this worker cannot sample: the reason, no samples."""
    self.stats.prompts_failed += 1
    logging.log_every_n_seconds(logging.WARNING, "worker: prompt %s cannot be sampled "
                                "here (%s); the trainer is told", 10, prompt.id, fault)
    return pb.RolloutGroup(prompt_id=prompt.id, policy_version=version, failure=fault[:1000],
                           metadata={"worker": self.config.name})

  def _settle(self, lease_id: str) -> None:
    """Once no prompt of the lease waits or runs: complete it, releasing what was refused."""
    if any(l == lease_id for l, _ in self._pending) or any(
        l == lease_id for l, _ in (*self._started, *self._scoring)):
      return
    with self._lock:
      left = self._inflight.pop(lease_id, set())
      self._lease_deadline.pop(lease_id, None)
    if lease_id in self._abandoned:
      self._abandoned.discard(lease_id)
      return
    try:
      with self.stats.time.span("submitting"):
        if left:
          self.stats.prompts_released += self._with_backoff(
              lambda: self._rpc("release", lease_id, sorted(left))) or 0
        else:
          self._with_backoff(lambda: self._rpc("complete", lease_id))
    except ParamServerError as e:  # expired, or a server that lost it: nothing left to settle
      logging.warning("worker: lease %s abandoned: %s", lease_id, e)

  @property
  def _resumable(self) -> bool:
    """Whether samples are handed back and continued as partial rollouts: with continuous
    batching, when worker.salvage_s is on."""
    return self._continuous and self.config.salvage_s > 0

  def _partial_rollouts(self, batch: ContinuousBatch, incremental: bool = False
                        ) -> list[tuple[tuple[str, str], pb.PartialRollouts]]:
    """Each running prompt's samples so far, by key, in sample order (sample j's seed is
    j's); `incremental`: past the tokens the server holds (`kept`)."""
    out = []
    with self._lock:
      held = dict(self._held) if incremental else {}
    for key, samples, finished in batch.partial():
      given, have = self._given.get(key, {}), held.get(key, [])
      begun = [self._begun(s, done, given.get(j, []), have[j] if j < len(have) else 0)
               for j, (s, done) in enumerate(zip(samples, finished))]
      part = pb.PartialRollouts(prompt_id=key[1], samples=[b for b, _ in begun],
                                policy_version=self._started[key][1])
      if any(k for _, k in begun):
        part.kept.extend(k for _, k in begun)
      out.append((key, part))
    return out

  def _take_checkpoint(self, batch: ContinuousBatch) -> None:
    """Hand the heartbeat the running prompts' samples so far: its next renewals carry them,
    and should the lease expire (a worker killed without notice) the next worker continues
    them."""
    parts: dict[str, list[pb.PartialRollouts]] = collections.defaultdict(list)
    begun = self._partial_rollouts(batch, incremental=True)
    for (lease_id, _), part in begun:
      if lease_id not in self._abandoned:
        parts[lease_id].append(part)
    with self._lock:
      self._checkpoint = dict(parts)
      running = {key for key, _ in begun}
      self._held = {key: n for key, n in self._held.items() if key in running}
    self._checkpointed_at = time.monotonic()
    self._beat_now.set()

  def _salvage(self, batch: ContinuousBatch) -> None:
    """Stopping, with little grace left: hand each running prompt back with its samples so
    far (partial rollouts, which the next worker continues from where they stopped, with
    the same seeds; past the tokens the last checkpoint gave the server) and the waiting
    ones as they are."""
    parts: dict[str, list[pb.PartialRollouts]] = collections.defaultdict(list)
    for key, part in self._partial_rollouts(batch, incremental=True):
      del self._started[key]
      self._given.pop(key, None)
      if key[0] not in self._abandoned:
        parts[key[0]].append(part)
    batch.clear()
    # Prompts the batch had queued but not started go back as they are, after these (a
    # lease is settled once none of its prompts waits: here, by _release_pending).
    self._pending.extendleft((key[0], prompt) for key, (prompt, _) in self._started.items())
    self._started.clear()
    for lease_id, partial in parts.items():
      for chunk in _in_calls(partial):  # (one message of a lease's all could be refused)
        ids = [p.prompt_id for p in chunk]
        try:
          self.stats.prompts_released += self._rpc("release", lease_id, ids, partial=chunk)
          self.stats.samples_salvaged += sum(
              bool(s.token_ids) or k > 0 for p in chunk
              for s, k in zip(p.samples, list(p.kept) or [0] * len(p.samples)))
        except ParamServerError as e:  # e.g. refused: _settle releases them as held there
          logging.warning("worker: partial rollouts of lease %s not handed back: %s",
                          lease_id, e)
        else:
          with self._lock:
            self._inflight.get(lease_id, set()).difference_update(ids)
      self._settle(lease_id)
    self._release_pending()
    logging.info("worker: handed back %d running prompts with %d begun samples",
                 sum(map(len, parts.values())), self.stats.samples_salvaged)

  def _release_pending(self) -> None:
    """Stopping: give back the leased prompts that have not started."""
    by_lease: dict[str, list[str]] = collections.defaultdict(list)
    while self._pending:
      lease_id, prompt = self._pending.popleft()
      by_lease[lease_id].append(prompt.id)
    for lease_id, ids in by_lease.items():
      if lease_id not in self._abandoned:
        try:
          self.stats.prompts_released += self._rpc("release", lease_id, ids)
        except ParamServerError as e:  # no more calls for it: its expiry serves them again
          logging.warning("worker: release of lease %s failed (left to expire): %s", lease_id, e)
          self._abandoned.add(lease_id)
      with self._lock:
        self._inflight.get(lease_id, set()).difference_update(ids)
      self._settle(lease_id)

  # ------------------------------------------------------------ generation

  def _prompt_tokens(self, prompt: pb.Prompt) -> list[int]:
    if prompt.token_ids:
      return list(prompt.token_ids)
    return self.tokenizer.encode_prompt(prompt.text)

  def _prompt_seeds(self, prompt: pb.Prompt, version: int) -> list[int]:
    """A continuous batch's prompt's seeds: samples_per_prompt of them, then GREEDY_SEED
    with worker.greedy_baseline (its last sample is the greedy one); a held-out prompt the
    trainer asks the fleet to evaluate (metadata "eval"): one greedy answer, or its
    eval_samples sampled ones (pass@k)."""
    if _evaluated(prompt):
      k, _ = _eval_samples(prompt, self.config.draws)
      return self._seeds(prompt, version, 0, k) if k else [GREEDY_SEED]
    seeds = self._seeds(prompt, version, 0, self.config.samples_per_prompt)
    return seeds + [GREEDY_SEED] * int(self.config.greedy_baseline)

  def _seeds(self, prompt: pb.Prompt, version: int, round_: int, n: int) -> list[int]:
    """n samples' seeds for `prompt`, allocation round `round_`: of the seed its trainer
    gave it (metadata PROMPT_SEED) alone, not `version` (a restart republishes its
    checkpoint's weights as the next version: they draw what an uninterrupted run drew);
    else of this worker's seed, the prompt's id and `version`."""
    given = prompt.metadata.get(PROMPT_SEED)
    key = given if given else f"{self.config.seed}:{prompt.id}:{version}"
    base = zlib.crc32(f"{key}:{round_}".encode())
    return [(base + 7919 * j) % (2 ** 31) for j in range(n)]

  def _rollout_groups(self, prompts: list[pb.Prompt], tokens: list[list[int]], version: int
                      ) -> list[pb.RolloutGroup | None]:
    """Allocate samples over the prompts (their token ids `tokens`; rounds for adaptive
    allocators), score, package. A prompt's samples of a round are scored as soon as they
    finish, beside the round's other prompts' decoding and scoring. Stopping with
    only salvage_s of grace left, the rounds end where they are: a prompt with two samples
    or more (finished ones) gets its group, the others None (released)."""
    state = self.allocator.start(len(prompts), self.config.samples_per_prompt * len(prompts))
    samples: list[list[Sample]] = [[] for _ in prompts]
    rewards: list[list[float]] = [[] for _ in prompts]
    passed: list[list[bool] | None] = [[] for _ in prompts]
    parts: list[list[dict[str, float]] | None] = [[] for _ in prompts]
    erred: list[list[bool]] = [[] for _ in prompts]
    failed: dict[int, str] = {}  # prompt index -> why its samples could not be scored
    round_ = 0
    while not state.done and not self._salvaging and not self._stale(version):
      counts = [int(c) for c in self.allocator.requests(state)]
      early = {}  # prompt index -> (its samples, their scores' future)

      def score_early(i, got, replies):
        if self._round_pool is None:
          self._round_pool = concurrent.futures.ThreadPoolExecutor(
              self.config.prompts_per_call, thread_name_prefix="round-scoring")
        early[i] = (got, self._round_pool.submit(self._scored, prompts[i], got, replies))

      t0 = time.monotonic()
      drawn, given = self._draw(prompts, tokens, counts, version, round_, score_early)
      elapsed = time.monotonic() - t0
      new_rewards = []
      for i, (prompt, got) in enumerate(zip(prompts, drawn)):
        try:
          if i in early and early[i][0] is got:
            with self.stats.time.span("scoring"):
              scores, passes, got_parts, got_erred = early[i][1].result()
          else:  # cut short (a stop, the floor): what it kept
            scores, passes, got_parts, got_erred = self._scored(prompt, got, given[i])
        except ValueError as e:  # e.g. a reward model's chat template refusing it: the
          failed.setdefault(i, str(e))  # trainer is told why, the worker goes on
          new_rewards.append(np.zeros(len(got), np.float32))
          continue
        samples[i].extend(got)
        rewards[i].extend(scores)
        passed[i] = None if passes is None else passed[i] + passes
        parts[i] = None if got_parts is None else parts[i] + got_parts
        erred[i].extend(got_erred)
        new_rewards.append(np.asarray(scores, np.float32))
      n_tokens = sum(len(s.tokens) for got in drawn for s in got)
      self.stats.samples += sum(map(len, drawn))
      self.stats.tokens += n_tokens
      self._tokens_per_s = n_tokens / max(elapsed, 1e-9)
      round_ += 1
      if self._salvaging or self._stale(version):  # the round may be cut short
        break
      state = self.allocator.observe(state, new_rewards)
    if self._stale(version):  # the server would drop them: `_serve` releases the prompts
      return [None] * len(prompts)
    if not state.done:
      logging.info("worker: stopping: %d of %d prompts keep the samples of %d rounds",
                   sum(len(got) >= 2 for got in samples), len(prompts), round_)
    return [self._failed(p, version, f"its samples could not be scored: {failed[i]}")
            if i in failed else
            self._group(p, version, got, rs, ps, pp, erred=es)
            if state.done or len(got) >= 2 else None
            for i, (p, got, rs, ps, pp, es) in enumerate(zip(prompts, samples, rewards, passed,
                                                              parts, erred))]

  @property
  def batching(self) -> str:
    """How prompts are decoded, for the worker's first log line."""
    c = self.config
    if self._continuous and c.sample_rows:
      return f"continuous batching of samples on {c.sample_rows} rows"
    if self._continuous:
      return (f"continuous batching of {c.prompts_per_call} prompts x "
              f"{c.rows_per_prompt or c.draws} rows")
    return f"{c.allocator} rounds of {c.prompts_per_call} prompts"

  @property
  def _salvaging(self) -> bool:
    """Stopping, with only salvage_s of the grace period left: what runs ends now."""
    return self.stopping and time.monotonic() >= self._salvage_at

  def _group(self, prompt: pb.Prompt, version: int, samples: list[Sample],
             rewards: list[float], passed: list[bool] | None = None,
             parts: list[dict[str, float]] | None = None,
             last_version: int | None = None,
             baseline: float | None = None,
             erred: list[bool] | None = None) -> pb.RolloutGroup:
    """One prompt's scored samples as a RolloutGroup of `version` (the oldest sampled with;
    metadata last_version: the newest, `last_version`, else the one held now); each
    sample's metadata: `sample_metadata` of its verdict and reward parts; `baseline`: the
    greedy sample's reward (worker.greedy_baseline); `erred`: whether a verifier raised on
    each sample (scored 0). With worker.teacher, each sample carries the teacher's scores of
    its tokens (on-policy distillation)."""
    meta = {"worker": self.config.name, "weights_format": self.config.weights_format,
            "logprobs": "sampling", "temperature": repr(self.params.temperature),
            "top_k": str(self.params.top_k), "top_p": repr(self.params.top_p),
            "min_p": repr(self.params.min_p), "max_new_tokens": str(self.params.max_new_tokens),
            "samples_per_prompt": str(self.config.samples_per_prompt),
            "tokenizer": self._tokenizer_identity,
            "last_version": str(self.policy.version if last_version is None
                                else last_version)}
    resumed = sum(s.resumed for s in samples)
    if resumed:
      meta["resumed_samples"] = str(resumed)
    teacher = None
    if self.teacher is not None and samples and not _evaluated(prompt):  # one packed row
      with self.stats.time.span("scoring"):
        if self.teacher_tokenizer is None:
          teacher = self.teacher.score_group(self._prompt_tokens(prompt),
                                             [s.tokens for s in samples], bucket(len(samples)),
                                             self.config.max_new_tokens)
        else:  # its log-probs of the same texts, shared out over the policy's tokens
          teacher = [(logp, None, None) for logp in score_retokenized(
              self.teacher, self.tokenizer, self.teacher_tokenizer,
              [self._teacher_prompt(prompt)], [[s.tokens for s in samples]],
              [[s.sampling_logprobs for s in samples]],
              [[s.finish_reason == "stop" for s in samples]], bucket(len(samples)),
              [[s.observed for s in samples]])[0]]
    group = pb.RolloutGroup(
        prompt_id=prompt.id, policy_version=version, metadata=meta,
        samples=[make_sample(s.tokens, r, text=self.tokenizer.decode(s.tokens),
                             logprobs=s.sampling_logprobs, finish_reason=s.finish_reason,
                             routes=s.routes, observed=s.observed,
                             metadata=sample_metadata(p, pp, e), teacher=t)
                 for s, r, p, pp, t, e in zip(samples, rewards,
                                              passed or [None] * len(samples),
                                              parts or [None] * len(samples),
                                              teacher or [None] * len(samples),
                                              erred or [False] * len(samples))])
    if self.config.routing_replay and samples:  # the samples share the prompt's routes
      group.prompt_routes.CopyFrom(make_routes(samples[0].prompt_routes))
    if baseline is not None:
      group.baseline_reward = baseline
    return group

  def _draw(self, prompts, tokens, counts, version, round_,
            finished: Callable[[int, list[Sample], dict[int, list]], None] | None = None
            ) -> tuple[list[list[Sample]], list[dict[int, list]]]:
    """counts[i] samples of prompt i, and the replies each multi-turn sample got (by prompt
    and sample index): the round's prompts in one continuous batch, each prompt's samples
    on one prefill, their turns answered by their tasks' environments; `finished(i,
    samples, replies)` is told of each prompt's as they finish. Stopping with only
    salvage_s of grace left: the samples finished so far."""
    out: list[list[Sample]] = [[] for _ in prompts]
    given: list[dict[int, list]] = [{} for _ in prompts]
    live = [i for i, c in enumerate(counts) if c > 0]
    if not live:
      return out, given
    batch = ContinuousBatch(self.policy.model, bucket(max(counts[i] for i in live)),
                            self.config.prompts_per_call, self.params,  # few programs: n 2^k
                            record_routes=self.config.routing_replay,
                            respond=self._respond if self.environments else None,
                            max_turns=self.config.max_turns,
                            respond_threads=self.config.environment_threads, mesh=self.mesh,
                            chunk_steps=self.config.decode_chunk_steps,  # stops heard soon
                            kv_dtype=self.config.kv_cache_dtype or None, mirror=self.mirror)
    keys = {i: ("round", prompts[i].id) for i in live}
    index = {key: i for i, key in keys.items()}
    ended_well = False
    try:
      for i, key in keys.items():
        self._started[key] = (prompts[i], version)
        batch.add(key, tokens[i], self._seeds(prompts[i], version, round_, counts[i]))
      done, kept = {}, {}  # kept: a cut round's finished samples, by their index in it
      while batch.waiting or batch.running:
        if self._stale(version):  # under the staleness floor: nothing of it is sent
          done.update((keys[i], []) for i in live)
          break
        if self._salvaging:  # stopping: the round's finished samples, the rest dropped
          for key, got, ended in batch.partial():
            kept[key] = [j for j, end in enumerate(ended) if end]
            done[key] = [got[j] for j in kept[key]]
          done.update((keys[i], []) for i in live if keys[i] not in done)
          break
        with self.stats.time.span("decoding", 1 - batch.free / self.config.prompts_per_call):
          ended = self._step(batch)
        done.update(ended)
        for key, got in ended if finished else ():
          i = index[key]
          given[i] = self._given.pop(key, {})
          finished(i, got, given[i])
      ended_well = True
    finally:  # after a crash, an environment call under way (it may hang) is not waited for
      batch.release(wait=ended_well)
      for i, key in keys.items():
        self._started.pop(key, None)
        if key in self._given:  # a finished prompt's were handed over already
          given[i] = self._given.pop(key)
    for i, key in keys.items():  # replies follow their samples' new indices
      if key in kept:
        given[i] = {new: given[i][j] for new, j in enumerate(kept[key]) if j in given[i]}
    for i, key in keys.items():
      out[i] = done[key]
    return out, given

  def _scored(self, prompt: pb.Prompt, samples: list[Sample],
              given: dict[int, list] | None = None
              ) -> tuple[list[float], list[bool] | None, list[dict[str, float]] | None,
                         list[bool]]:
    """The samples' rewards: the reward model's scores for task reward_model, else the
    task verifier's plus reward_model_weight x the reward model's; plus each reward term's
    weight x its reward. Then the verifier's verdicts (None for task reward_model: a score
    has none; terms never change them), and each sample's raw parts by name ("task", each
    term's, "reward_model" where it scored) when reward_terms or a reward model is set,
    else None; and whether a verifier (task's or term's) raised on each sample, scoring it 0.
    `given`: each multi-turn sample's replies, by index."""
    rm_only = (prompt.task or self.config.default_task) == REWARD_MODEL_TASK
    weight = 1.0 if rm_only else self.config.reward_model_weight
    with self.stats.time.span("scoring"):
      scored = [] if rm_only else self._on_threads(lambda s: self._score(prompt, s), samples)
      parts = {} if rm_only else {"task": np.asarray([r for r, _, _ in scored], np.float64)}
      erred = [e for _, _, e in scored] or [False] * len(samples)
      rewards = parts.get("task", np.zeros(len(samples)))
      texts = [self.tokenizer.decode(s.tokens) for s in samples] if self.reward_terms else []
      for name, term_weight, verifier in self.reward_terms:
        results = self._on_threads(lambda text: self._checked(
            f"reward term {name!r}", verifier, prompt, text), texts)
        parts[name] = np.asarray([r.reward for r in results], np.float64)
        erred = [e or "error" in r.info for e, r in zip(erred, results)]
        rewards = rewards + term_weight * parts[name]
      if self.reward_scorer is not None and weight and samples:
        parts["reward_model"] = self._model_scores(prompt, samples, given or {})
        rewards = rewards + weight * parts["reward_model"]
    by_sample = ([{name: float(v[j]) for name, v in parts.items()} for j in range(len(samples))]
                 if self.reward_terms or self.reward_scorer is not None else None)
    return ([float(r) for r in rewards], None if rm_only else [p for _, p, _ in scored],
            by_sample, erred)

  def _model_scores(self, prompt: pb.Prompt, samples: list[Sample],
                    given: dict[int, list]) -> np.ndarray:
    """The reward model's score of each sample's conversation."""
    scorer, head = self.reward_scorer, self._prompt_tokens(prompt)
    messages = prompt_messages(prompt.text, dict(prompt.metadata))
    sequences = []
    for j, s in enumerate(samples):
      text = self.tokenizer.decode(s.tokens)
      turns = ([self.tokenizer.decode(t) for t in policy_turns(s.tokens, s.observed)]
               if s.observed is not None else []) or [text]
      response = conversation(turns, given.get(j, [])[:len(turns) - 1])
      sequences.append(scorer.encode(messages + response, prompt.text, text,
                                     head + [int(t) for t in s.tokens]))
    return scorer.scores(sequences)

  def _on_threads(self, fn: Callable, items: list) -> list:
    """[fn(x) for x in items], worker.scoring_threads of them at once."""
    if self.config.scoring_threads == 1 or len(items) < 2:
      return [fn(x) for x in items]
    with self._lock:  # a round's prompts are scored from threads of their own: one pool
      if self._scoring_pool is None:
        self._scoring_pool = concurrent.futures.ThreadPoolExecutor(
            self.config.scoring_threads, thread_name_prefix="scoring")
    return list(self._scoring_pool.map(fn, items))

  def _score(self, prompt: pb.Prompt, sample: Sample) -> tuple[float, bool, bool]:
    """The task verifier's (reward, passed) of one sample, and whether it raised."""
    task = prompt.task or self.config.default_task
    result = self._checked(f"verifier of task {task!r}", self.verifier_for(prompt.task),
                           prompt, self.tokenizer.decode(sample.tokens))
    return float(result.reward), bool(result.passed), "error" in result.info

  def _checked(self, what: str, verifier: Verifier, prompt: pb.Prompt, text: str
               ) -> VerifierResult:
    """`verifier`'s result on `text` against the prompt's reference; one that raised or
    gave NaN / inf (scored 0 by verifiers.Guarded) is counted and logged."""
    result = verifier(text, reference_of(prompt))
    if "error" in result.info:
      with self._lock:  # (scoring threads)
        self.stats.score_errors += 1
        errors = self.stats.score_errors
      if errors <= 5 or errors % 1000 == 0:
        logging.warning("worker: %s gave no reward on prompt %s (scored 0; %d so far): %s",
                        what, prompt.id, errors, result.info["error"])
    return result

  # ------------------------------------------------------------ heartbeat

  def _heartbeat_loop(self) -> None:
    """Report liveness, speed and the version held (at once after registering and after
    each new version, else every interval); renew leases past half their deadline or with
    begun samples to carry."""
    interval = max(0.2, min(getattr(self.client, "heartbeat_interval_s", 10.0) or 10.0,
                            self.config.lease_deadline_s / 4))
    while True:
      self._beat_now.wait(interval)
      self._beat_now.clear()
      if self._done.is_set():
        return
      self._beat()

  def _beat(self) -> None:
    """One heartbeat: report, hear the latest version and the staleness floor (a worker
    decoding one long group makes no other call for a while), renew the leases due (unless
    decoding stalled: _check_stall)."""
    self._check_stall()
    try:
      reply = self._rpc("heartbeat", -1 if self.policy.version is None else self.policy.version,
                        self._tokens_per_s, time=self.stats.time.snapshot())
    except ParamServerError as e:  # the server is away: renewals would fail alike
      logging.warning("worker: heartbeat failed: %s", e)
      return
    self._latest_heard = reply.latest_version  # as said: lower after a new run's restart
    self._hear(reply.latest_version, reply.staleness_floor)
    self._pull_now.set()
    self._renew_leases()

  def _hear(self, latest: int, floor: int | None = None) -> None:
    """A reply (a lease, a renewal, a submission, a heartbeat) named the server's latest
    version and the trainer's staleness `floor` (None: not named). A version newer than the
    held and than the last heard wakes the prefetch thread, so that its pull and decode
    overlap decoding instead of a wait at the next version check."""
    if floor is not None:  # as named: a restarted trainer's floor may be lower
      self._floor = floor
    held = self.policy.version
    if latest > max(self._latest_heard, -1 if held is None else held):
      self._latest_heard = latest
      self._pull_now.set()

  def _prefetch_loop(self) -> None:
    """Pull the updates past the held version as the heartbeat, a lease or a submission
    hears of them (`prefetch`)."""
    while True:
      self._pull_now.wait()
      self._pull_now.clear()
      if self._done.is_set():
        return
      try:
        self.prefetch(self._latest_heard)
      except Exception as e:  # noqa: BLE001 - the next version is pulled (or resynced) anyway
        logging.warning("worker: prefetch failed: %s", e)

  def _renew_leases(self) -> None:
    """Renew the leases past half their deadline and those with begun samples to carry."""
    now, length = time.monotonic(), self.config.lease_deadline_s
    with self._lock:
      checkpoint, self._checkpoint = self._checkpoint, {}
      due = [k for k, d in self._lease_deadline.items()
             if (d - now < length / 2 or k in checkpoint) and self._inflight.get(k)]
    for lease_id in due:
      try:
        self._renew(lease_id, checkpoint.get(lease_id, []))
      except ParamServerError as e:  # e.g. answered meanwhile: the lease is closed
        logging.warning("worker: renewal of lease %s failed: %s", lease_id, e)
        if e.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
          with self._lock:  # expired, or another run's server: the decode loop drops it
            self._lost.add(lease_id)
        continue
      with self._lock:  # a lease settled during the call stays forgotten
        if lease_id in self._lease_deadline:
          self._lease_deadline[lease_id] = now + length

  def _renew(self, lease_id: str, partial: list[pb.PartialRollouts]) -> None:
    """One lease renewal, its begun samples split over calls that stay under gRPC's
    default 4 MiB message limit; samples the server refuses are dropped (the next
    checkpoint sends them whole), the lease renewed."""
    for chunk in _in_calls(partial) or [[]]:
      try:
        reply = self._rpc("renew", lease_id, self.config.lease_deadline_s, partial=chunk)
        self._hear(getattr(reply, "latest_version", -1), getattr(reply, "staleness_floor", 0))
      except ParamServerError as e:
        if not chunk:
          raise
        logging.warning("worker: begun samples of lease %s not kept: %s", lease_id, e)
        with self._lock:
          for part in chunk:
            self._held.pop((lease_id, part.prompt_id), None)
        self._rpc("renew", lease_id, self.config.lease_deadline_s)
        continue
      with self._lock:
        for part in chunk:
          kept = list(part.kept) or [0] * len(part.samples)
          self._held[(lease_id, part.prompt_id)] = [
              k + len(sample.token_ids) for k, sample in zip(kept, part.samples)]
      if chunk:
        self.stats.checkpoints += 1
